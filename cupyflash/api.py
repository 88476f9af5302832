"""Public functions. The array type picks the backend: CuPy runs the CUDA kernels on the
current device and stream, NumPy runs the float64 reference and casts back."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import reference
from .validation import AttentionProblem, check_attention, check_backward

Kernel = str  # "auto", "wgmma", "mma" or "portable" (see kernels.dispatch.KERNELS)


def _check_kernel(kernel: Kernel) -> None:
    from .kernels.dispatch import KERNELS

    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")


# ---------------------------------------------------------------------------- CUDA backend


def _select(p: AttentionProblem, kernel: Kernel):
    from .kernels import dispatch
    from .plans import DeviceLimits

    return dispatch.select(p, DeviceLimits.current(), kernel)


def _cuda_forward(q, k, v, p: AttentionProblem, kernel: Kernel):
    import cupy

    from ._layout import batch_views, unit_last_stride

    fam = _select(p, kernel)  # raises before anything is allocated or launched
    q, k, v = (unit_last_stride(x) for x in (q, k, v))
    o = cupy.empty(q.shape, dtype=p.dtype)
    lse = cupy.empty(q.shape[:-1], dtype=np.float32)
    if o.size == 0:
        return o, lse
    if p.nk == 0:  # no key at all: every row is fully masked
        o.fill(0)
        lse.fill(-np.inf)
        return o, lse
    for q4, k4, v4, o4, lse3 in batch_views((q, k, v, o, lse[..., None]), p.batch):
        fam.forward(q4, k4, v4, o4, lse3[..., 0], p)
    return o, lse


def _cuda_backward(do, q, k, v, o, lse, p: AttentionProblem, kernel: Kernel):
    import cupy

    from ._layout import batch_views, unit_last_stride

    fam = _select(p, kernel)
    do, q, k, v, o = (unit_last_stride(x) for x in (do, q, k, v, o))
    lse = cupy.ascontiguousarray(lse)
    dq = cupy.empty(q.shape, dtype=p.dtype)
    dk = cupy.empty(k.shape, dtype=p.dtype)
    dv = cupy.empty(v.shape, dtype=p.dtype)
    if p.nq == 0 or p.nk == 0 or p.batch_size == 0:
        for g in (dq, dk, dv):
            g.fill(0)
        return dq, dk, dv
    arrays = (do, q, k, v, o, lse[..., None], dq, dk, dv)
    for do4, q4, k4, v4, o4, lse3, dq4, dk4, dv4 in batch_views(arrays, p.batch):
        fam.backward(do4, q4, k4, v4, o4, lse3[..., 0], dq4, dk4, dv4, p)
    return dq, dk, dv


# ---------------------------------------------------------------------------- public API


def attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, *, kernel: Kernel = "auto"
) -> tuple[Any, Any]:
    """Softmax attention: ``o = softmax(scale * q @ k^T) @ v`` and ``lse``, its per-row log-sum-exp.

    q: (..., Hq, Nq, D); k, v: (..., Hk, Nk, D) with Hq % Hk == 0 (GQA/MQA).
    ``causal`` masks key j for query i when j > i + Nk - Nq (bottom-right aligned).
    Returns o (q's shape and dtype) and lse (float32, q's shape without D; -inf where a
    row sees no key). ``kernel`` picks a kernel family ("auto", "mma", "portable").
    """
    _check_kernel(kernel)
    p = check_attention(q, k, v, causal=causal, scale=scale)
    if p.xp == "numpy":
        o, lse = reference.attention_forward(q, k, v, causal=p.causal, scale=p.scale)
        return o.astype(p.dtype), lse.astype(np.float32)
    return _cuda_forward(q, k, v, p, kernel)


def attention(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, *, kernel: Kernel = "auto"
) -> Any:
    """Softmax attention output only; see ``attention_forward``."""
    return attention_forward(q, k, v, causal, scale, kernel=kernel)[0]


def attention_backward(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    causal: bool = False,
    scale: float | None = None,
    *,
    kernel: Kernel = "auto",
) -> tuple[Any, Any, Any]:
    """Gradients (dq, dk, dv) of ``attention`` given dO and the forward's o and lse.

    Recomputes the attention matrix tile by tile (FlashAttention's backward), so memory
    stays O(N). dk and dv have k's and v's shapes: under GQA they sum over each group.
    """
    _check_kernel(kernel)
    p = check_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    if p.xp == "numpy":
        grads = reference.attention_backward(do, q, k, v, o, lse, causal=p.causal, scale=p.scale)
        return tuple(g.astype(p.dtype) for g in grads)  # type: ignore[return-value]
    return _cuda_backward(do, q, k, v, o, lse, p, kernel)


def attention_vjp(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, *, kernel: Kernel = "auto"
) -> tuple[Any, Callable[[Any], tuple[Any, Any, Any]]]:
    """``o`` and a function that maps dO to (dq, dk, dv), keeping only o and lse alive."""
    o, lse = attention_forward(q, k, v, causal, scale, kernel=kernel)

    def vjp(do: Any) -> tuple[Any, Any, Any]:
        return attention_backward(do, q, k, v, o, lse, causal, scale, kernel=kernel)

    return o, vjp
