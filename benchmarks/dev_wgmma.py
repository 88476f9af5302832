"""Development check of the Hopper forward ("wgmma" family) on an sm_90 GPU: tile variants side by side.

For each variant: the output and lse against the mma forward on the same inputs (odd shapes, causal
and not, GQA), then forward TFLOP/s on the DESIGN grid shapes (B*N = 16k, H*D = 2048) next to the
mma forward and SDPA FLASH, all in this one process (CUDA events, median after warm-up). The harness
(`python -m cupyflash.bench --kernels wgmma,mma`) gives the published figures; this is for choosing.

Usage: python benchmarks/dev_wgmma.py [--d 64,128] [--n 1024,8192] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics

import cupy as cp
import numpy as np

from cupyflash import _dtypes
from cupyflash.kernels import mma, wgmma
from cupyflash.plans import wgmma as plans
from cupyflash.validation import check_attention

VARIANTS = {
    64: [plans.ForwardConfig(64, bc=64, stages=4, min_blocks=2), plans.ForwardConfig(64, bc=128, warpgroups=3),
         plans.ForwardConfig(64, bc=64, stages=3, min_blocks=2)],
    128: [plans.ForwardConfig(128, bc=128, warpgroups=2), plans.ForwardConfig(128, bc=64, warpgroups=1, min_blocks=2),
          plans.ForwardConfig(128, bc=64, warpgroups=2, stages=4)],
}  # fmt: skip


def label(c: plans.ForwardConfig) -> str:
    return f"Br={c.br} Bc={c.bc} st={c.stages}"


def run(fn, q, k, v, p):
    o = cp.full(q.shape, np.nan, q.dtype)
    lse = cp.full(q.shape[:-1], np.nan, np.float32)
    fn(q, k, v, o, lse, p)
    return o, lse


def check(cfg, dtype) -> str:
    rng = np.random.default_rng(1)
    worst = 0.0
    for b, hq, hk, nq, nk, d, causal in [(2, 4, 2, 333, 517, cfg.d - 8, True), (1, 2, 2, 300, 300, cfg.d, False),
                                         (1, 3, 1, 150, 40, cfg.d, True), (1, 2, 2, 1, 257, cfg.d, False)]:  # fmt: skip
        q, k, v = (cp.asarray(rng.standard_normal((b, h, n, d)).astype(dtype)) for h, n in ((hq, nq), (hk, nk), (hk, nk)))
        p = check_attention(q, k, v, causal=causal)
        o, lse = run(lambda *a: wgmma.forward(*a, config=cfg), q, k, v, p)
        ro, rlse = run(mma.forward, q, k, v, p)
        if not bool(cp.isfinite(o.astype(np.float32)).all()):
            return "NON-FINITE"
        err = float(cp.abs(o.astype(np.float32) - ro.astype(np.float32)).max() / cp.abs(ro.astype(np.float32)).max())
        fin = cp.isfinite(rlse)
        if not bool((cp.isfinite(lse) == fin).all()) or float(cp.abs(lse - rlse)[fin].max()) > 2e-2:
            return "LSE MISMATCH"
        worst = max(worst, err)
    return f"max |o - o_mma| / max |o| = {worst:.1e}" + (" BAD" if worst > 2e-2 else "")


def median_ms(fn, warmup=3, iters=20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b))
    return statistics.median(times)


def sdpa_ms(q, k, v, causal) -> float | None:
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = median_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
    torch.cuda.synchronize()
    return ms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="64,128")
    ap.add_argument("--n", default="1024,4096,16384")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    dtype = _dtypes.BFLOAT16 if a.dtype == "bfloat16" else _dtypes.FLOAT16
    for d in (int(x) for x in a.d.split(",")):
        for cfg in VARIANTS[d]:
            print(f"D={d} {label(cfg)}: {check(cfg, dtype)}", flush=True)
        for n in (int(x) for x in a.n.split(",")):
            b, h = 16384 // n, 2048 // d
            q, k, v = (cp.asarray(np.random.default_rng(0).standard_normal((b, h, n, d)), dtype) for _ in range(3))
            for causal in (False, True):
                p = check_attention(q, k, v, causal=causal)
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                o = cp.empty_like(q)
                lse = cp.empty(q.shape[:-1], np.float32)
                row = [f"D={d:3d} N={n:5d} causal={int(causal)}"]
                mma_t = median_ms(lambda: mma.forward(q, k, v, o, lse, p))
                row.append(f"mma {flops / mma_t / 1e9:5.0f}")
                for cfg in VARIANTS[d]:
                    t = median_ms(lambda cfg=cfg: wgmma.forward(q, k, v, o, lse, p, config=cfg))
                    row.append(f"[{label(cfg)}] {flops / t / 1e9:5.0f}")
                s = sdpa_ms(q, k, v, causal)
                if s:
                    row.append(f"sdpa-flash {flops / s / 1e9:5.0f}")
                print("  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
