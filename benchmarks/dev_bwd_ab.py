"""The wgmma kernels of whatever tree is imported, over the variants (plain, causal, softcap, ALiBi, window,
dropout, deterministic), for A/B runs of trees in alternating processes (s17: where the backward's dQ adds sit in a
step; the forwards' one-sided ALiBi strips). bf16, H*D = 2048; GPU ms per call (dev_ws_ab.per_call_ms) and what lets
the trees' results be compared:
- ``--pass bwd`` (B*N = 16k, N = 8k by default): float64 sums of dq, dk, dv (dk and dv bitwise; dq adds in any
  order);
- ``--pass fwd`` (B = 1, N = 16k by default): a hash of o and lse, bitwise.
Rows doc8 and prefix are ``--suite flex``'s user snippets with their block masks (its documents: seed 0).
GPU machine:
    for r in 1 2; do for t in old new; do PYTHONPATH=$PWD/<tree of $t> python benchmarks/dev_bwd_ab.py $t; done
    done > $OUT/bwd_ab.txt
"""
from __future__ import annotations

import argparse
import hashlib
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
    "alibi": (False, {"alibi_slopes": None}),
    "alibi-c": (True, {"alibi_slopes": None}),
    "window-c": (True, {"window_size": (1024, 0)}),
    "dropout": (False, {"dropout_p": 0.1, "dropout_seed": 7}),
    "determ": (False, {"deterministic": True}),
    "doc8": (True, {"flex": "doc8"}),  # --suite flex's cases: snippets with their block masks
    "prefix": (False, {"flex": "prefix-lm"}),
}
DEFAULT_ROWS = {"bwd": ["full", "causal", "softcap", "alibi-c", "window-c", "dropout", "determ"],
                "fwd": ["alibi-c", "alibi", "softcap-c", "causal"]}


def flex_keywords(case: str, b: int, n: int) -> dict:
    """mask_mod, aux and block_mask of a --suite flex case (cupyflash.bench.flex) at batch b, length n."""
    import cupy as cp
    import numpy as np

    from cupyflash.bench import flex as bflex

    doc = np.broadcast_to(bflex.doc_ids(n), (b, n))
    kw = bflex._snippet(case, {"doc": cp.asarray(doc.copy()), "prefix": n // 4})
    kw["block_mask"] = cf.create_block_mask(kw["mask_mod"], b, None, n, n, aux=kw["aux"])
    return kw


def row_keywords(name: str, b: int, h: int, n: int) -> tuple[bool, dict]:
    """(causal, keywords) of a row at batch b, h heads, length n: ALiBi slopes and snippets filled in."""
    import cupy as cp

    causal, kw = ROWS[name]
    kw = dict(kw)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = (2.0 ** (-8.0 * (cp.arange(h, dtype=cp.float32) + 1) / h)).astype(cp.float32)
    if "flex" in kw:
        kw = flex_keywords(kw["flex"], b, n)
    return causal, kw


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("tag")
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=None)
    ap.add_argument("--rows", nargs="+", default=None)
    ap.add_argument("--no-tma", action="store_true", help="the backward's loader copies by cp.async (plans.wgmma.TMA)")
    ap.add_argument("--no-tma-fwd", action="store_true",
                    help="the ws forward's producer copies by cp.async (plans.wgmma.TMA_FORWARD)")
    a = ap.parse_args()
    if a.no_tma_fwd:
        from cupyflash.plans import wgmma as wgmma_plans

        wgmma_plans.TMA_FORWARD = False  # (a tree without the flag: no TMA forward anyway)
    if a.no_tma:
        from cupyflash.plans import wgmma as wgmma_plans

        wgmma_plans.TMA = False  # a tree without the flag has no TMA path anyway
    ns = a.n or ([8192] if a.which == "bwd" else [16384])
    print(f"# {a.tag}: {cf.__file__}", flush=True)
    bf16 = cp.dtype("bfloat16")
    for d in a.d:
        for n in ns:
            b, h = max(1, 16384 // n) if a.which == "bwd" else 1, 2048 // d
            rng = cp.random.default_rng(0)
            q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(bf16) for _ in range(4))
            for name in a.rows or DEFAULT_ROWS[a.which]:
                causal, kw = row_keywords(name, b, h, n)
                det = kw.pop("deterministic", False)
                o, lse = cf.attention_forward(q, k, v, causal=causal, **kw)
                if a.which == "fwd":
                    digest = hashlib.sha1(o.get().tobytes() + lse.get().tobytes()).hexdigest()[:12]
                    ms = per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal, **kw))
                    print(f"{a.tag} D={d} N={n} {name:9s} fwd {ms:.3f} ms | o,lse {digest}", flush=True)
                    continue
                grads = cf.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=det, **kw)
                sums = " ".join(f"{float(g.astype(cp.float64).sum()):.9e}" for g in grads[:3])
                ms = per_call_ms(lambda: cf.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=det,
                                                               **kw))
                print(f"{a.tag} D={d} N={n} {name:9s} bwd {ms:.3f} ms | sums dq dk dv {sums}", flush=True)
            q = k = v = do = o = lse = grads = None
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
