"""Linear attention implementations: cupyflash's (when this build has it), a naive
masked-matmul CuPy one, and the flash-linear-attention library's Triton kernels (package
fla-core, when importable), as ``prepare`` functions like the softmax ones."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

from .cli import Options
from .device import to_torch
from .impls import Impl, InputSet, Prepared, Unavailable, first_line, require_cupy_matmul
from .shapes import Shape, fmt_bytes, heads_per_chunk, naive_linear_head_bytes


# ---------------------------------------------------------------------------- linear impls


def decay_rates(h: int) -> Any:
    """``--decay``'s per-head rates lambda_h = 1 - 2^(-5 - h) (RetNet's), float32 NumPy:
    from 0.969 (a ~32-position memory) up to 1 - 2^-20 for the last of 16 heads."""
    import numpy

    return (1.0 - 2.0 ** (-5.0 - numpy.arange(h))).astype(numpy.float32)


def find_linear() -> tuple[Callable | None, Callable | None]:
    """cupyflash's linear attention forward and backward, if this build has them (exported
    at the top level, or in ``cupyflash.linear_api``)."""
    import cupyflash

    mod: Any = cupyflash
    if getattr(mod, "linear_attention_forward", None) is None:
        try:
            mod = importlib.import_module("cupyflash.linear_api")
        except ImportError:
            return None, None
    fwd = getattr(mod, "linear_attention_forward", None) or getattr(mod, "linear_attention", None)
    return fwd, getattr(mod, "linear_attention_backward", None)


def cupyflash_linear_impl(kernel: str) -> Impl:
    def prepare(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
        fwd, bwd = find_linear()
        if fwd is None:
            raise Unavailable("cupyflash has no linear_attention in this build")
        # Constant rates, as a model holds them: host data, checked on the host in each timed call
        # (the device copy is made once per value set). A CuPy decay would add a synchronising
        # device-to-host copy for the range check.
        lam = decay_rates(shape.h) if opts.decay else None
        if pass_ == "fwd":
            return Prepared(lambda i: fwd(sets[i].q, sets[i].k, sets[i].v, causal=True, decay=lam), "cupy")
        if bwd is None:
            raise Unavailable("cupyflash has no linear_attention_backward in this build")

        def fwd_bwd(i: int) -> Any:
            s = sets[i]
            fwd(s.q, s.k, s.v, causal=True, decay=lam)
            return bwd(s.do, s.q, s.k, s.v, causal=True, decay=lam)

        return Prepared(fwd_bwd, "cupy")

    return prepare


def naive_linear(q: Any, k: Any, v: Any, do: Any | None, chunk: int) -> Any:
    """o = ((q k^T) * M) v with M the causal 0/1 mask, and with ``do`` its gradients
    (dA = (dO v^T) * M, dq = dA k, dk = dA^T q, dv = A^T dO), ``chunk`` heads at a time."""
    import cupy

    b, h, n, d = q.shape
    q3, k3, v3 = (x.reshape(b * h, n, d) for x in (q, k, v))
    do3 = None if do is None else do.reshape(b * h, n, d)
    mask = cupy.tri(n, n, 0, dtype=cupy.float32).astype(q.dtype)  # 1 where j <= i
    out = cupy.empty_like(q3)
    grads = None if do is None else tuple(cupy.empty_like(x) for x in (q3, k3, v3))
    for s in range(0, b * h, chunk):
        e = min(b * h, s + chunk)
        A = cupy.matmul(q3[s:e], k3[s:e].transpose(0, 2, 1))
        A *= mask
        out[s:e] = cupy.matmul(A, v3[s:e])
        if do3 is not None and grads is not None:
            dA = cupy.matmul(do3[s:e], v3[s:e].transpose(0, 2, 1))
            dA *= mask
            grads[0][s:e] = cupy.matmul(dA, k3[s:e])
            grads[1][s:e] = cupy.matmul(dA.transpose(0, 2, 1), q3[s:e])
            grads[2][s:e] = cupy.matmul(A.transpose(0, 2, 1), do3[s:e])
            del dA
        del A
    return out if grads is None else (out, grads)


def naive_linear_impl(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
    if opts.decay:
        raise Unavailable("naive-linear runs without decay (the 50x comparison of issue 4 is without it)")
    backward = pass_ != "fwd"
    require_cupy_matmul(shape.dtype)
    head = naive_linear_head_bytes(shape.n, shape.itemsize, backward)
    mask = shape.n * shape.n * shape.itemsize
    chunk = heads_per_chunk(head, mask, opts.naive_budget_bytes)
    if chunk == 0:
        raise Unavailable(f"one head's N x N matrices need {fmt_bytes(head + mask)} > budget "
                          f"{fmt_bytes(opts.naive_budget_bytes)}; raise --naive-budget-gb")
    return Prepared(
        lambda i: naive_linear(sets[i].q, sets[i].k, sets[i].v, sets[i].do if backward else None, chunk), "cupy"
    )


def fla_linear_impl(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
    """fla's ``chunk_linear_attn`` with ``normalize=False`` and scale 1: the same operation as
    ``cupyflash.linear_attention(q, k, v, causal=True)``; with ``--decay``, ``chunk_simple_gla``
    with ``g_gamma = log(lambda)`` (fla's head-wise constant decay), the same as ``decay=lambda``.
    fla takes (B, N, H, D), so each set is transposed into that layout once, outside the timed
    region."""
    try:
        import torch
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # not installed, or no Triton/GPU for it
        raise Unavailable(f"fla-core is not importable: {first_line(e)}") from e

    backward = pass_ != "fwd"
    leaves = [
        [to_torch(x).transpose(1, 2).contiguous().requires_grad_(backward) for x in (s.q, s.k, s.v)] for s in sets
    ]
    grads_out = [to_torch(s.do).transpose(1, 2).contiguous() for s in sets]

    if opts.decay:
        g_gamma = torch.log(torch.as_tensor(decay_rates(shape.h), device=leaves[0][0].device))

        def fwd(i: int) -> Any:
            return chunk_simple_gla(*leaves[i], g_gamma=g_gamma, scale=1.0)[0]

    else:

        def fwd(i: int) -> Any:
            return chunk_linear_attn(*leaves[i], scale=1.0, normalize=False)[0]

    def fwd_bwd(i: int) -> None:
        for x in leaves[i]:
            x.grad = None
        fwd(i).backward(grads_out[i])

    try:  # the first call compiles the Triton kernels; a refusal shows as n/a
        (fwd_bwd if backward else fwd)(0)
    except Exception as e:
        raise Unavailable(f"fla refuses this case: {first_line(e)}") from e
    torch.cuda.synchronize()
    return Prepared(fwd_bwd if backward else fwd, "torch")
