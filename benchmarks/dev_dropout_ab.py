"""Forward and backward with and without dropout 0.1 in whatever tree is imported, for A/B runs of two trees in
alternating processes (issue 16; s15 compared the forward's PRMT masks on packed P against the keep bits' FSELs).
bf16, the dropout suite's shapes (B*N = 16k, H*D = 2048); GPU ms per call (dev_ws_ab.per_call_ms). Prints one
line per shape with a tag, so that the rounds of both trees can be merged (best of each). GPU machine:
    for r in 1 2; do for t in old new; do PYTHONPATH=$PWD/<tree of $t> python benchmarks/dev_dropout_ab.py $t; done
    done > $OUT/dropout_ab.txt
"""
from __future__ import annotations

import argparse
import os
import sys

import cupyflash as cf  # the tree on PYTHONPATH, imported before dev_ws_ab puts this checkout first

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dev_ws_ab import per_call_ms  # noqa: E402


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("tag")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    a = ap.parse_args()
    bf16 = cp.dtype("bfloat16")
    rng = cp.random.default_rng(0)
    drop = {"dropout_p": 0.1, "dropout_seed": 7}
    print(f"# {a.tag}: {cf.__file__}", flush=True)
    for d in a.d:
        for n in a.n:
            b, h = 16384 // n, 2048 // d
            q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(bf16) for _ in range(4))
            for causal in (False, True):
                o0, lse0 = cf.attention_forward(q, k, v, causal=causal)
                o1, lse1 = cf.attention_forward(q, k, v, causal=causal, **drop)
                fwd0 = per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal))
                fwd1 = per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal, **drop))
                bwd0 = per_call_ms(lambda: cf.attention_backward(do, q, k, v, o0, lse0, causal=causal))
                bwd1 = per_call_ms(lambda: cf.attention_backward(do, q, k, v, o1, lse1, causal=causal, **drop))
                print(f"{a.tag} D={d} N={n} B={b} {'causal' if causal else 'full'}: fwd {fwd0:.3f} / {fwd1:.3f} "
                      f"({fwd0 / fwd1:.3f}) | bwd {bwd0:.3f} / {bwd1:.3f} ({bwd0 / bwd1:.3f}) | fwd+bwd "
                      f"{(fwd0 + bwd0) / (fwd1 + bwd1):.3f}", flush=True)
            q = k = v = do = o0 = o1 = None  # noqa: F841 - free before the next shape
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
