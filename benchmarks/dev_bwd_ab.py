"""The wgmma backward of whatever tree is imported, over the variants (plain, causal, softcap, ALiBi, window,
dropout, deterministic), for A/B runs of trees in alternating processes (s17: where the dQ adds sit in a step).
bf16, B*N = 16k, H*D = 2048; GPU ms per call (dev_ws_ab.per_call_ms), and float64 sums of dk, dv, dq so that the
trees' results can be compared (dk and dv bitwise; dq adds in any order). GPU machine:
    for r in 1 2; do for t in old new; do PYTHONPATH=$PWD/<tree of $t> python benchmarks/dev_bwd_ab.py $t; done
    done > $OUT/bwd_ab.txt
"""
from __future__ import annotations

import argparse
import os
import sys

import cupyflash as cf  # the tree on PYTHONPATH, imported before dev_ws_ab puts this checkout first

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dev_ws_ab import per_call_ms  # noqa: E402

ROWS = {  # name: (causal, keywords)
    "full": (False, {}),
    "causal": (True, {}),
    "softcap": (False, {"softcap": 50.0}),
    "softcap-c": (True, {"softcap": 50.0}),
    "alibi-c": (True, {"alibi_slopes": None}),
    "window-c": (True, {"window_size": (1024, 0)}),
    "dropout": (False, {"dropout_p": 0.1, "dropout_seed": 7}),
    "determ": (False, {"deterministic": True}),
}


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("tag")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[8192])
    ap.add_argument("--rows", nargs="+", default=list(ROWS))
    a = ap.parse_args()
    print(f"# {a.tag}: {cf.__file__}", flush=True)
    bf16 = cp.dtype("bfloat16")
    for d in a.d:
        for n in a.n:
            b, h = max(1, 16384 // n), 2048 // d
            rng = cp.random.default_rng(0)
            q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(bf16) for _ in range(4))
            for name in a.rows:
                causal, kw = ROWS[name]
                kw = dict(kw)
                if "alibi_slopes" in kw:
                    kw["alibi_slopes"] = (2.0 ** (-8.0 * (cp.arange(h, dtype=cp.float32) + 1) / h)).astype(cp.float32)
                det = kw.pop("deterministic", False)
                o, lse = cf.attention_forward(q, k, v, causal=causal, **kw)
                grads = cf.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=det, **kw)
                sums = " ".join(f"{float(g.astype(cp.float64).sum()):.9e}" for g in grads[:3])
                ms = per_call_ms(lambda: cf.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=det,
                                                               **kw))
                print(f"{a.tag} D={d} N={n} {name:9s} bwd {ms:.3f} ms | sums dq dk dv {sums}", flush=True)
            q = k = v = do = o = lse = grads = None
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
