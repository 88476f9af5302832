"""The NumPy quickstart: forward, backward and a check against the float64 reference, no GPU.

    python -m cupyflash.quickstart

``python -m cupyflash.bench`` runs this when the machine has no usable GPU, so the README's
first command shows something useful everywhere. NumPy arrays take the same API as CuPy
arrays; only the backend differs.
"""
from __future__ import annotations

import sys
import time

import numpy as np

#: float32 bounds from DESIGN.md section 4 (relative error against the float64 reference).
BOUND_O = 1e-5
BOUND_GRAD = 1e-4


def rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    """||x - ref|| / ||ref|| in float64."""
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def main(argv: list[str] | None = None) -> int:
    import cupyflash as cf

    # Small on purpose (runs in well under a second); N = 300 is no multiple of any tile and
    # Hq = 4 over Hk = 2 exercises grouped-query attention.
    B, Hq, Hk, N, D = 2, 4, 2, 300, 64
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, N, D), dtype=np.float32)
    k, v = (rng.standard_normal((B, Hk, N, D), dtype=np.float32) for _ in range(2))
    do = rng.standard_normal(q.shape, dtype=np.float32)

    t0 = time.perf_counter()
    o, lse = cf.attention_forward(q, k, v, causal=True)
    dq, dk, dv = cf.attention_backward(do, q, k, v, o, lse, causal=True)
    ms = 1e3 * (time.perf_counter() - t0)
    print(f"cupyflash {cf.__version__}, NumPy backend: q {q.shape}, k/v {k.shape} float32, causal "
          f"-> o {o.shape} {o.dtype}, lse {lse.shape} {lse.dtype}; forward + backward {ms:.0f} ms")

    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, do))
    o_ref, lse_ref = cf.reference.attention_forward(q64, k64, v64, causal=True)
    grads_ref = cf.reference.attention_backward(do64, q64, k64, v64, o_ref, lse_ref, causal=True)
    ok = True
    for name, got, ref, bound in zip(
        ("o", "dq", "dk", "dv"), (o, dq, dk, dv), (o_ref, *grads_ref), (BOUND_O, *(3 * (BOUND_GRAD,)))
    ):
        err = rel_err(got, ref)
        ok &= err < bound
        print(f"  {name:>2} {str(got.shape):<16} relative error vs float64 reference {err:.1e} (bound {bound:.0e})")
    print("ok: the NumPy backend matches the reference" if ok else "FAILED: error above the bound")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
