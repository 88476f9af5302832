"""Development check of the Hopper backward ("wgmma" family) on an sm_90 GPU: tile variants side by side.

For each variant: dq, dk, dv against the mma backward on the same inputs (odd shapes, causal and not,
GQA), then backward TFLOP/s (the three launches: Delta, main, dQ conversion) on the DESIGN grid shapes
(B*N = 16k, H*D = 2048) next to the mma backward and SDPA FLASH's backward, in this one process (CUDA
events, median after warm-up). The harness (`python -m cupyflash.bench`) gives the published figures.

Usage: python benchmarks/dev_wgmma_bwd.py [--d 64,128] [--n 1024,8192] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse

import cupy as cp
import numpy as np

from cupyflash import _dtypes
from cupyflash.kernels import mma, wgmma
from cupyflash.plans import wgmma as plans
from cupyflash.validation import check_attention

from dev_wgmma import median_ms

VARIANTS = {
    64: [plans.BackwardConfig(64, br=128), plans.BackwardConfig(64, br=128, stages=3)],
    128: [plans.BackwardConfig(128, br=64), plans.BackwardConfig(128, br=64, stages=3)],
}


def label(c: plans.BackwardConfig) -> str:
    return f"Br={c.br} Bc={c.bc} st={c.stages}"


def grads(fn, do, q, k, v, o, lse, p):
    dq, dk, dv = (cp.full(x.shape, np.nan, x.dtype) for x in (q, k, v))
    fn(do, q, k, v, o, lse, dq, dk, dv, p)
    return dq, dk, dv


def check(cfg, dtype) -> str:
    rng = np.random.default_rng(1)
    worst = 0.0
    for b, hq, hk, nq, nk, d, causal in [(2, 4, 2, 333, 517, cfg.d - 8, True), (1, 2, 2, 300, 300, cfg.d, False),
                                         (1, 3, 1, 150, 40, cfg.d, True), (1, 2, 2, 1, 257, cfg.d, False),
                                         (1, 2, 1, 700, 300, cfg.d, True)]:  # fmt: skip
        q, k, v = (cp.asarray(rng.standard_normal((b, h, n, d)).astype(dtype)) for h, n in ((hq, nq), (hk, nk), (hk, nk)))
        do = cp.asarray(rng.standard_normal((b, hq, nq, d)).astype(dtype))
        p = check_attention(q, k, v, causal=causal)
        o = cp.empty_like(q)
        lse = cp.empty(q.shape[:-1], np.float32)
        mma.forward(q, k, v, o, lse, p)
        got = grads(lambda *a: wgmma.backward(*a, config=cfg), do, q, k, v, o, lse, p)
        ref = grads(mma.backward, do, q, k, v, o, lse, p)
        for name, g, r in zip("qkv", got, ref):
            g, r = g.astype(np.float32), r.astype(np.float32)
            if not bool(cp.isfinite(g).all()):
                return f"NON-FINITE d{name} at {(b, hq, hk, nq, nk, d, causal)}"
            err = float(cp.abs(g - r).max() / max(float(cp.abs(r).max()), 1e-6))
            if err > 2e-2:
                return f"d{name} BAD {err:.1e} at {(b, hq, hk, nq, nk, d, causal)}"
            worst = max(worst, err)
    return f"max |g - g_mma| / max |g| = {worst:.1e}"


def sdpa_bwd_ms(q, k, v, do, causal) -> float | None:
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    tq, tk, tv = (torch.from_dlpack(x).detach().requires_grad_() for x in (q, k, v))
    tdo = torch.from_dlpack(do)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        ms = median_ms(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True))
    torch.cuda.synchronize()
    return ms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--n", default="1024,4096,16384")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-check", action="store_true")
    a = ap.parse_args()
    dtype = _dtypes.BFLOAT16 if a.dtype == "bfloat16" else _dtypes.FLOAT16
    for d in (int(x) for x in a.d.split(",")):
        if not a.no_check:
            for cfg in VARIANTS[d]:
                print(f"D={d} {label(cfg)}: {check(cfg, dtype)}", flush=True)
        for n in (int(x) for x in a.n.split(",")):
            b, h = 16384 // n, 2048 // d
            rng = np.random.default_rng(0)
            q, k, v, do = (cp.asarray(rng.standard_normal((b, h, n, d)), dtype) for _ in range(4))
            for causal in (False, True):
                p = check_attention(q, k, v, causal=causal)
                flops = 10 * b * h * n * n * d / (2 if causal else 1)
                o = cp.empty_like(q)
                lse = cp.empty(q.shape[:-1], np.float32)
                mma.forward(q, k, v, o, lse, p)
                dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
                row = [f"D={d:3d} N={n:5d} causal={int(causal)}"]
                t = median_ms(lambda: mma.backward(do, q, k, v, o, lse, dq, dk, dv, p))
                row.append(f"mma {flops / t / 1e9:5.0f}")
                for cfg in VARIANTS[d]:
                    t = median_ms(lambda cfg=cfg: wgmma.backward(do, q, k, v, o, lse, dq, dk, dv, p, config=cfg))
                    row.append(f"[{label(cfg)}] {flops / t / 1e9:5.0f}")
                s = sdpa_bwd_ms(q, k, v, do, causal)
                if s:
                    row.append(f"sdpa-flash {flops / s / 1e9:5.0f}")
                print("  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
