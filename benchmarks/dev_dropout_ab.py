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


DROP = {"dropout_p": 0.1, "dropout_seed": 7}


def suite_rows(ds, ns):
    """The dropout suite's shapes (bf16, B*N = 16k, H*D = 2048), causal or not, with what every dropout A/B needs:
    inputs, both forwards' outputs (o0, lse0 without dropout; o1, lse1 with) and the times of the forward without
    and with dropout and of the backward without (fwd0, fwd1, bwd0)."""
    import types

    import cupy as cp

    bf16 = cp.dtype("bfloat16")
    rng = cp.random.default_rng(0)
    for d in ds:
        for n in ns:
            b, h = 16384 // n, 2048 // d
            q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(bf16) for _ in range(4))
            for causal in (False, True):
                r = types.SimpleNamespace(d=d, n=n, b=b, causal=causal, q=q, k=k, v=v, do=do)
                r.o0, r.lse0 = cf.attention_forward(q, k, v, causal=causal)
                r.o1, r.lse1 = cf.attention_forward(q, k, v, causal=causal, **DROP)
                r.fwd0 = per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal))
                r.fwd1 = per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal, **DROP))
                r.bwd0 = per_call_ms(lambda: cf.attention_backward(do, q, k, v, r.o0, r.lse0, causal=causal))
                yield r
            q = k = v = do = r = None  # noqa: F841 - free before the next shape
            cp.get_default_memory_pool().free_all_blocks()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tag")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    a = ap.parse_args()
    print(f"# {a.tag}: {cf.__file__}", flush=True)
    for r in suite_rows(a.d, a.n):
        bwd1 = per_call_ms(lambda: cf.attention_backward(r.do, r.q, r.k, r.v, r.o1, r.lse1, causal=r.causal, **DROP))
        print(f"{a.tag} D={r.d} N={r.n} B={r.b} {'causal' if r.causal else 'full'}: fwd {r.fwd0:.3f} / {r.fwd1:.3f} "
              f"({r.fwd0 / r.fwd1:.3f}) | bwd {r.bwd0:.3f} / {bwd1:.3f} ({r.bwd0 / bwd1:.3f}) | fwd+bwd "
              f"{(r.fwd0 + r.bwd0) / (r.fwd1 + bwd1):.3f}", flush=True)


if __name__ == "__main__":
    main()
