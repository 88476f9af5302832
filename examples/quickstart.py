"""Quickstart: attention forward and backward on CuPy arrays, checked against the float64 reference.

    python examples/quickstart.py

Runs in a few seconds on any CUDA GPU that CuPy supports. Without one it says why in one
line and runs the same check on NumPy arrays (see also examples/numpy_quickstart.py).
"""
from __future__ import annotations

import sys

import numpy as np

import cupyflash as cf
from cupyflash import gpu_status


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref||, both taken to float64 on the host."""
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def main() -> int:
    reason = gpu_status()
    if reason is not None:
        print(f"no GPU: {reason}; running the NumPy quickstart instead")
        from cupyflash import quickstart

        return quickstart.main()
    import cupy as cp

    # N = 1000 on purpose: any length works, not only multiples of the kernels' tiles.
    B, H, N, D = 2, 4, 1000, 64
    dtype = cp.float16
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(dtype) for _ in range(4))

    o, lse = cf.attention_forward(q, k, v, causal=True)  # o: (B, H, N, D) float16, lse: (B, H, N) float32
    dq, dk, dv = cf.attention_backward(do, q, k, v, o, lse, causal=True)
    print(f"q, k, v {q.shape} {q.dtype} -> o {o.shape} {o.dtype}, lse {lse.shape} {lse.dtype}")
    print(f"gradients: dq {dq.shape}, dk {dk.shape}, dv {dv.shape}")

    # The NumPy reference computes the same mathematics in float64 (whole score matrix at once).
    o_ref, vjp = cf.reference.attention_vjp(q.get(), k.get(), v.get(), causal=True)
    grads_ref = vjp(do.get())
    bound = 2e-3  # the float16 error bound cupyflash's tests use
    worst = 0.0
    for name, got, ref in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), (o_ref, *grads_ref)):
        got = cp.asnumpy(got).astype(np.float64)
        err = rel_err(got, ref)
        worst = max(worst, err)
        print(f"{name:>2}: max |error| {np.abs(got - ref).max():.2e}, relative error {err:.2e}")
    ok = worst < bound
    print(f"{'ok' if ok else 'FAILED'}: worst relative error {worst:.2e} (float16 bound {bound:.0e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
