"""Linear attention (no softmax) with cupyflash: forward, backward, a check against the float64
reference, and a timing against naive masked matmuls.

    python examples/linear_attention.py
"""
import sys

import numpy as np

from cupyflash import gpu_status

if (_reason := gpu_status()) is not None:
    print(f"skipped: linear_attention.py needs an NVIDIA GPU (no GPU: {_reason})")
    sys.exit(0)

import cupy  # noqa: E402

from cupyflash import linear_reference  # noqa: E402
from cupyflash.linear_api import linear_attention, linear_attention_backward  # noqa: E402

rng = np.random.default_rng(0)
B, H, N, D = 2, 4, 2048, 64


def unit_rows(x):  # without a softmax, unit-norm q and k keep o's size independent of D
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


q = unit_rows(rng.standard_normal((B, H, N, D))).astype(np.float16)
k = unit_rows(rng.standard_normal((B, H, N, D))).astype(np.float16)
v = rng.standard_normal((B, H, N, D)).astype(np.float16)
do = rng.standard_normal((B, H, N, D)).astype(np.float16)
decay = np.linspace(0.9, 0.999, H).astype(np.float32)  # one per head (TransNormerLLM's lambda)
qd, kd, vd, dod, decd = (cupy.asarray(x) for x in (q, k, v, do, decay))

# Causal with per-head decay: the chunked O(N D^2) kernels.
o = linear_attention(qd, kd, vd, causal=True, decay=decd)
dq, dk, dv = linear_attention_backward(dod, qd, kd, vd, causal=True, decay=decd)

# Check one batch element against the float64 reference (which materialises N x N: keep it small).
o_ref = linear_reference.linear_attention(q[:1], k[:1], v[:1], causal=True, decay=decay)
dq_ref, dk_ref, dv_ref = linear_reference.linear_attention_backward(do[:1], q[:1], k[:1], v[:1], causal=True,
                                                                    decay=decay)
for name, x, r in (("o", o, o_ref), ("dq", dq, dq_ref), ("dk", dk, dk_ref), ("dv", dv, dv_ref)):
    err = np.linalg.norm(x[:1].get().astype(np.float64) - r) / np.linalg.norm(r)
    print(f"{name}: relative error vs float64 reference {err:.2e}")

# An arbitrary mask (broadcast over batch and heads) runs the tiled kernel; ask for its gradient too.
mask = cupy.asarray(rng.uniform(size=(N, N)) > 0.5)
o_m = linear_attention(qd, kd, vd, mask=mask)
*_, dmask = linear_attention_backward(dod, qd, kd, vd, mask=mask, mask_grad=True)
print(f"masked: o {o_m.shape}, dmask {dmask.shape} {dmask.dtype}")

# Timing: ours against S = Q K^T; S *= tril; O = S V.
tril = cupy.tri(N, dtype=cupy.float16)


def naive():
    s = cupy.matmul(qd, kd.transpose(0, 1, 3, 2))
    s *= tril
    return cupy.matmul(s, vd)


def time_ms(fn, runs=20):
    fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(runs):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


t_ours = time_ms(lambda: linear_attention(qd, kd, vd, causal=True))
t_naive = time_ms(naive)
print(f"causal forward B={B} H={H} N={N} D={D}: cupyflash {t_ours:.3f} ms, naive {t_naive:.3f} ms "
      f"({t_naive / t_ours:.1f}x)")
