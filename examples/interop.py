"""Interop: cupyflash on PyTorch and JAX arrays through DLPack, without copies.

    python examples/interop.py

- PyTorch: tensors and CuPy arrays share memory both ways (same device pointer); a short
  ``torch.autograd.Function`` runs cupyflash's forward and backward inside torch's autograd,
  on torch's current stream, and is compared with ``torch.nn.functional.scaled_dot_product_attention``.
- JAX: a JAX array becomes a CuPy array (same pointer), cupyflash runs on it, and the output
  goes back to JAX; compared with plain jax.numpy attention.

A part whose library is not installed (or has no GPU) is skipped with a message.
"""
from __future__ import annotations

import os
import sys

import cupyflash as cf
from cupyflash import gpu_status

if __name__ == "__main__" and (_reason := gpu_status()) is not None:
    print(f"skipped: interop.py needs an NVIDIA GPU (no GPU: {_reason})")
    sys.exit(0)

import cupy as cp  # noqa: E402

B, H, N, D = 2, 4, 512, 64


def pytorch_part() -> bool:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("PyTorch: not installed, skipped")
        return True
    if not torch.cuda.is_available():
        print("PyTorch: no CUDA device for torch, skipped")
        return True

    # Zero-copy, both ways: the tensor and the CuPy array are views of one allocation.
    c = cp.random.default_rng(0).standard_normal((B, H, N, D), dtype=cp.float32)
    t = torch.from_dlpack(c)
    tt = torch.randn(3, 5, device="cuda")
    back = cp.from_dlpack(tt)
    shared = t.data_ptr() == c.data.ptr and back.data.ptr == tt.data_ptr()
    print(f"PyTorch <-> CuPy by DLPack share memory: {shared}")

    class FlashAttention(torch.autograd.Function):
        """cupyflash as a torch op: o = attention(q, k, v); grads from cupyflash's backward."""

        @staticmethod
        def forward(ctx, q, k, v, causal: bool):
            # cupyflash launches on CuPy's current stream: make that torch's current stream.
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                o, lse = cf.attention_forward(*(cp.from_dlpack(x.detach()) for x in (q, k, v)), causal=causal)
                o, lse = torch.from_dlpack(o), torch.from_dlpack(lse)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal = causal
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                arrays = (cp.from_dlpack(x.detach().contiguous()) for x in (do, q, k, v, o, lse))
                dq, dk, dv = cf.attention_backward(*arrays, causal=ctx.causal)
                return torch.from_dlpack(dq), torch.from_dlpack(dk), torch.from_dlpack(dv), None

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16)
    ok = True
    for causal in (False, True):
        o = FlashAttention.apply(q, k, v, causal)
        grads = torch.autograd.grad(o, (q, k, v), do)
        o_sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        grads_sdpa = torch.autograd.grad(o_sdpa, (q, k, v), do)
        diffs = []
        for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_sdpa, *grads_sdpa)):
            a, b = a.float(), b.float()
            diffs.append((name, float((a - b).norm() / b.norm())))
        worst = max(d for _, d in diffs)
        ok &= worst < 4e-3  # two float16 computations, each within 2e-3 of the exact result
        print(f"  causal={causal}: cupyflash vs torch SDPA, relative difference "
              + ", ".join(f"{n} {d:.1e}" for n, d in diffs))
    print(f"PyTorch autograd.Function around cupyflash: {'ok' if ok else 'MISMATCH'}")
    return ok and shared


def jax_part() -> bool:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        print("JAX: not installed, skipped")
        return True
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        print("JAX: no GPU backend, skipped")
        return True

    key = jax.random.split(jax.random.PRNGKey(0), 3)
    with jax.default_device(gpus[0]):
        q, k, v = (jax.random.normal(kk, (B, H, N, D), dtype=jnp.float32) for kk in key)
    qc, kc, vc = (cp.from_dlpack(x) for x in (q, k, v))
    shared = qc.data.ptr == q.unsafe_buffer_pointer()
    print(f"JAX -> CuPy by DLPack shares memory: {shared}")

    o = cf.attention(qc, kc, vc, causal=True)
    o_jax = jnp.from_dlpack(o)
    back_shared = o_jax.unsafe_buffer_pointer() == o.data.ptr
    print(f"CuPy -> JAX by DLPack shares memory: {back_shared} (JAX may copy to meet its own alignment)")

    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(jnp.float32(D))
    s = jnp.where(jnp.tril(jnp.ones((N, N), dtype=bool)), s, -jnp.inf)
    o_ref = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)
    err = float(jnp.linalg.norm(o_jax - o_ref) / jnp.linalg.norm(o_ref))
    # jax.numpy may use TF32 matmuls on the GPU; the bound leaves room for them.
    ok = err < 1e-2
    verdict = "ok" if ok else "MISMATCH"
    print(f"cupyflash on JAX arrays vs jax.numpy attention: relative difference {err:.1e} ({verdict})")
    return ok and shared


def main() -> int:
    ok = pytorch_part()
    ok &= jax_part()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
