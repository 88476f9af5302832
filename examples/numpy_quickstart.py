"""Quickstart without a GPU: cupyflash on NumPy arrays, checked against the float64 reference.

    python examples/numpy_quickstart.py

NumPy arrays take the same calls as CuPy arrays and run on the CPU; only `pip install .`
is needed (no CUDA). The same code with `cupy` in place of `numpy` runs the CUDA kernels.
"""
import numpy as np

import cupyflash as cf

B, H, N, D = 2, 4, 500, 64
rng = np.random.default_rng(0)
q, k, v, do = (rng.standard_normal((B, H, N, D), dtype=np.float32) for _ in range(4))

o, lse = cf.attention_forward(q, k, v, causal=True)  # o: (B, H, N, D) float32, lse: (B, H, N) float32
dq, dk, dv = cf.attention_backward(do, q, k, v, o, lse, causal=True)

# The reference computes the same mathematics in float64 with the whole score matrix at once.
o_ref, vjp = cf.reference.attention_vjp(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
for name, got, ref in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv), (o_ref, *vjp(do.astype(np.float64)))):
    print(f"{name:>2} {got.shape} {got.dtype}: relative error {np.linalg.norm(got - ref) / np.linalg.norm(ref):.1e}")
