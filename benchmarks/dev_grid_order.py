"""Development check of the causal grid order of the wgmma family on an sm_90 GPU.

For the DESIGN grid shapes (B*N = 16k, H*D = 2048, bf16, causal), forward and backward TFLOP/s with the
grid "heads fastest" (B*H on x: every head's longest tiles first) and "one head's tiles together" (tiles
on x), whatever plans.wgmma._heads_first would pick; CUDA events, median after warm-up.

Usage: python benchmarks/dev_grid_order.py
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from cupyflash import _dtypes
from cupyflash.kernels import mma, wgmma
from cupyflash.plans import DeviceLimits
from cupyflash.plans import wgmma as plans
from cupyflash.validation import check_attention

from dev_wgmma import median_ms


def main() -> int:
    pick = plans._heads_first
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode())
    for d in (64, 128):
        for n in (1024, 2048, 4096, 8192, 16384):
            b, h = 16384 // n, 2048 // d
            rng = np.random.default_rng(0)
            q, k, v, do = (cp.asarray(rng.standard_normal((b, h, n, d)), _dtypes.BFLOAT16) for _ in range(4))
            p = check_attention(q, k, v, causal=True)
            o, lse = cp.empty_like(q), cp.empty(q.shape[:-1], np.float32)
            mma.forward(q, k, v, o, lse, p)
            dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
            fwd_flops = 4 * b * h * n * n * d / 2
            chosen = "heads" if pick(True, b * h, DeviceLimits.current().sm_count) else "tiles"
            row = [f"D={d:3d} N={n:5d} B*H={b * h:4d} plan={chosen}"]
            for name, on_x in (("heads", True), ("tiles", False)):
                plans._heads_first = lambda causal, heads, sm, on_x=on_x: on_x
                try:
                    tf = median_ms(lambda: wgmma.forward(q, k, v, o, lse, p))
                    tb = median_ms(lambda: wgmma.backward(do, q, k, v, o, lse, dq, dk, dv, p))
                finally:
                    plans._heads_first = pick
                row.append(f"{name}: fwd {fwd_flops / tf / 1e9:4.0f} bwd {2.5 * fwd_flops / tb / 1e9:4.0f}")
            print("  ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
