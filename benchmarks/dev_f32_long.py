"""GPU: how far the float32 mma backward's dK/dV drift as a block sums more query rows (group x Nq), against a
float64 reference computed by CuPy per head.

    python benchmarks/dev_f32_long.py [--cases NAME ...]

The backward runs through the mma family's entry point (``kernels.mma.backward``), which takes any Nq: the API's
``supports`` is bypassed on purpose, to measure what it guards. o and lse are the float64 reference's, rounded to
float32. Errors are ||x - ref|| / ||ref|| over the whole tensor (the tests' rel_err; DESIGN.md bound 1e-4).
Prints one line per case: the query parts (plans.mma.query_parts), the rows one block sums, dq, dk, dv errors.
"""
from __future__ import annotations

import argparse
import math
import os
import sys


# (name, B, Hq, Hk, N, D, causal)
CASES = [
    ("mha-n4096-d64", 1, 4, 4, 4096, 64, False),
    ("mha-n8192-d64", 1, 2, 2, 8192, 64, False),
    ("mha-n8192-d64-causal", 1, 2, 2, 8192, 64, True),
    ("mha-n8192-d128", 1, 2, 2, 8192, 128, False),
    ("gqa4-n4096-d64", 1, 8, 2, 4096, 64, False),
    ("gqa8-n2048-d64", 1, 8, 1, 2048, 64, False),
    ("gqa2-n4096-d128", 1, 4, 2, 4096, 128, False),
    ("mha-n16384-d64-causal", 1, 1, 1, 16384, 64, True),
]


def reference(q, k, v, do, causal):
    """(o, lse, dq, dk, dv) in float64, one query head at a time (GQA: dk, dv summed over the group)."""
    import cupy as cp

    b, hq, n, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    scale = 1.0 / math.sqrt(d)
    o = cp.empty(q.shape, cp.float64)
    lse = cp.empty(q.shape[:-1], cp.float64)
    dq = cp.empty(q.shape, cp.float64)
    dk = cp.zeros(k.shape, cp.float64)
    dv = cp.zeros(v.shape, cp.float64)
    for bi in range(b):
        for h in range(hq):
            qh, kh, vh, doh = (x.astype(cp.float64) for x in (q[bi, h], k[bi, h // g], v[bi, h // g], do[bi, h]))
            s = qh @ kh.T * scale
            if causal:
                s = cp.where(cp.tri(n, dtype=bool), s, -cp.inf)
            m = s.max(-1, keepdims=True)
            p = cp.exp(s - m)
            den = p.sum(-1, keepdims=True)
            p /= den
            oh = p @ vh
            o[bi, h], lse[bi, h] = oh, (m + cp.log(den))[:, 0]
            dv[bi, h // g] += p.T @ doh
            ds = p * (doh @ vh.T - (doh * oh).sum(-1, keepdims=True))
            del p, s
            dq[bi, h] = ds @ kh * scale
            dk[bi, h // g] += ds.T @ qh * scale
    return o, lse, dq, dk, dv


def rel(x, r) -> float:
    import cupy as cp

    return float(cp.linalg.norm(x.astype(cp.float64) - r) / cp.linalg.norm(r))


def run(case) -> str:
    import cupy as cp

    from cupyflash.kernels import mma
    from cupyflash.validation import check_backward

    name, b, hq, hk, n, d, causal = case
    rs = cp.random.RandomState(0)
    q, do = (rs.standard_normal((b, hq, n, d), dtype=cp.float32) for _ in range(2))
    k, v = (rs.standard_normal((b, hk, n, d), dtype=cp.float32) for _ in range(2))
    o64, lse64, *ref = reference(q, k, v, do, causal)
    o, lse = o64.astype(cp.float32), lse64.astype(cp.float32)
    del o64, lse64
    p = check_backward(do, q, k, v, o, lse, causal=causal)
    dq, dk, dv = (cp.full(x.shape, cp.nan, cp.float32) for x in (q, k, v))
    mma.backward(do, q, k, v, o, lse, dq, dk, dv, p)
    errs = [rel(x, r) for x, r in zip((dq, dk, dv), ref)]
    try:  # a tree with query parts (s20) sums fewer rows a block
        from cupyflash.plans import cdiv, mma as plans

        br = plans.BACKWARD_CONFIGS_F32[d].br
        parts = plans.query_parts(hq // hk, n, br) or 0
        rows = hq // hk * cdiv(cdiv(n, br), parts) * br if parts else 0
    except AttributeError:
        parts, rows = 1, hq // hk * n
    return (f"{name:24s} parts {parts}  rows/block {rows:6d}  dq {errs[0]:.2e}  dk {errs[1]:.2e}  "
            f"dv {errs[2]:.2e}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=None)
    args = ap.parse_args()
    lines = [run(c) for c in CASES if args.cases is None or c[0] in args.cases]
    text = "\n".join(lines)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "f32_long.txt"), "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
