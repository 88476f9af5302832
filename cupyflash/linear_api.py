"""Linear attention (TransNormerLLM-style): no softmax, no normaliser.

    o[..., h, i, :] = scale * sum_j W[h, i, j] * (q_i . k_j) * v_j

W is the product of an optional ``mask`` (any real array broadcastable to (..., Hq, Nq, Nk)),
the causal indicator ``j <= i + (Nk - Nq)`` when ``causal`` and ``decay[h] ** (i + Nk - Nq - j)``
when a per-head ``decay`` (shape (Hq,), values in (0, 1], causal only) is given. decay may be
host data (a NumPy array, list or tuple) for either backend: its values are checked on the host and
copied to the device once per value set, so a CuPy call with host rates never waits on the GPU; a
CuPy decay (CuPy inputs only) costs one small device-to-host copy, which synchronises the stream,
for that check.

The array type picks the backend: CuPy arrays run the CUDA kernels (``kernels/linear.py``) on
the current device and stream; NumPy arrays run the float64 reference and round once to the
input dtype. Everything is checked before anything is allocated or launched.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import _dtypes
from .validation import AttentionProblem, check_attention, common_kind


@dataclass(frozen=True)
class LinearProblem:
    """A checked linear-attention call: the attention shapes plus the weight terms."""

    base: AttentionProblem  # batch, heads, sizes, dtype, causal, scale (default 1.0), xp
    mask_shape: tuple[int, ...] | None  # the mask's own shape (None: no mask)
    mask_dtype: np.dtype | None
    has_decay: bool

    @property
    def full_shape(self) -> tuple[int, ...]:
        """Shape W broadcasts to: (..., Hq, Nq, Nk)."""
        b = self.base
        return (*b.batch, b.hq, b.nq, b.nk)


def _is_real_dtype(dt: np.dtype) -> bool:
    return dt.kind in "biuf" or dt == _dtypes.BFLOAT16


def dmask_dtype(mask_dtype: np.dtype) -> np.dtype:
    """dmask keeps a floating mask's dtype; a bool or integer mask gets a float32 gradient."""
    dt = np.dtype(mask_dtype)
    return dt if (dt.kind == "f" or dt == _dtypes.BFLOAT16) else _dtypes.FLOAT32


def host_decay(decay: Any) -> Any:
    """A list or tuple of rates as a NumPy array (host data); arrays pass through unchanged."""
    return np.asarray(decay) if isinstance(decay, (list, tuple)) else decay


def _decay_values(decay: Any) -> np.ndarray:
    """Host values of decay for the range check: a CuPy decay costs one tiny (synchronising) copy."""
    if isinstance(decay, np.ndarray):
        return decay.astype(np.float64)
    import cupy

    return cupy.asnumpy(decay).astype(np.float64)


def check_linear(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    mask: Any = None,
    decay: Any = None,
    scale: float | None = 1.0,
    allow_float64: bool = False,
) -> LinearProblem:
    """Check q (..., Hq, Nq, D), k and v (..., Hk, Nk, D), the mask and the decay."""
    arrays = {"q": q, "k": k, "v": v}
    if mask is not None:
        arrays["mask"] = mask
    decay = host_decay(decay)
    if decay is not None and not isinstance(decay, np.ndarray):  # host rates go with either backend
        arrays["decay"] = decay
    common_kind(**arrays)
    base = check_attention(q, k, v, causal=causal, scale=1.0 if scale is None else scale, allow_float64=allow_float64)
    full = (*base.batch, base.hq, base.nq, base.nk)
    mask_shape = mask_dt = None
    if mask is not None:
        mask_dt = np.dtype(mask.dtype)
        if not _is_real_dtype(mask_dt):
            raise TypeError(f"mask must have a real dtype (bool, integer or float); got {mask_dt}")
        mask_shape = tuple(mask.shape)
        try:
            ok = np.broadcast_shapes(mask_shape, full) == full
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"mask of shape {mask_shape} does not broadcast to (..., Hq, Nq, Nk) = {full} "
                f"(q {q.shape}, k {k.shape})"
            )
    if decay is not None:
        if not base.causal:
            raise ValueError("decay needs causal=True (decay ** (i + Nk - Nq - j) grows without bound for j > i)")
        dt = np.dtype(decay.dtype)
        if not _is_real_dtype(dt) or dt.kind == "b":
            raise TypeError(f"decay must have a float or integer dtype; got {dt}")
        if tuple(decay.shape) != (base.hq,):
            raise ValueError(f"decay must have shape (Hq,) = ({base.hq},) for q {q.shape}; got {tuple(decay.shape)}")
        vals = _decay_values(decay)
        if not (np.all(np.isfinite(vals)) and np.all(vals > 0) and np.all(vals <= 1)):
            raise ValueError(f"decay values must lie in (0, 1]; got min {vals.min()}, max {vals.max()}")
    return LinearProblem(base, mask_shape, mask_dt, decay is not None)


def check_linear_backward(do: Any, q: Any, k: Any, v: Any, *, mask_grad: bool = False, allow_float64: bool = False,
                          **kw: Any) -> LinearProblem:
    """The forward's checks plus dO (q's shape, dtype and array kind) and ``mask_grad``."""
    common_kind(do=do, q=q)
    p = check_linear(q, k, v, allow_float64=allow_float64, **kw)
    if not isinstance(mask_grad, (bool, np.bool_)):
        raise TypeError(f"mask_grad must be a bool; got {type(mask_grad).__name__}")
    if mask_grad and p.mask_shape is None:
        raise ValueError("mask_grad=True needs a mask (there is nothing to differentiate)")
    dt = np.dtype(do.dtype)
    if dt != p.base.dtype and not (allow_float64 and dt == np.float64):
        raise TypeError(f"do.dtype must equal q.dtype ({p.base.dtype}); got {dt}")
    if tuple(do.shape) != tuple(q.shape):
        raise ValueError(f"do must have q's shape {q.shape}; got {do.shape}")
    return p


# ---------------------------------------------------------------------------- public API


def linear_attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, mask: Any = None, decay: Any = None, scale: float = 1.0
) -> Any:
    """Linear attention output ``o`` (q's shape and dtype).

    There is no lse: without a softmax nothing needs saving for the backward but the inputs.
    Causal problems without a mask run the chunked O(N D^2) kernels (a running D x D state);
    a mask runs the tiled O(N^2 D) kernel that streams mask tiles through its strides.
    """
    decay = host_decay(decay)
    p = check_linear(q, k, v, causal=causal, mask=mask, decay=decay, scale=scale)
    if p.base.xp == "numpy":
        from . import linear_reference

        o = linear_reference.linear_attention_forward(q, k, v, causal=causal, mask=mask, decay=decay, scale=p.base.scale)
        return o.astype(p.base.dtype)
    from .kernels import linear

    return linear.forward(q, k, v, mask, decay, p)


def linear_attention(
    q: Any, k: Any, v: Any, causal: bool = False, mask: Any = None, decay: Any = None, scale: float = 1.0
) -> Any:
    """``o = scale * (W o (q k^T)) v`` per head; see ``linear_attention_forward``."""
    return linear_attention_forward(q, k, v, causal, mask, decay, scale)


def linear_attention_backward(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    causal: bool = False,
    mask: Any = None,
    decay: Any = None,
    scale: float = 1.0,
    mask_grad: bool = False,
) -> tuple[Any, ...]:
    """(dq, dk, dv), or (dq, dk, dv, dmask) with ``mask_grad=True``.

    dk and dv have k's and v's shapes (summed over each GQA group). dmask has the mask's own
    shape (summed over the dims it broadcasts along) and dtype (float32 for a bool or integer
    mask). ``decay`` is treated as a constant.
    """
    decay = host_decay(decay)
    p = check_linear_backward(do, q, k, v, causal=causal, mask=mask, decay=decay, scale=scale, mask_grad=mask_grad)
    if p.base.xp == "numpy":
        from . import linear_reference

        grads = linear_reference.linear_attention_backward(
            do, q, k, v, causal=causal, mask=mask, decay=decay, scale=p.base.scale, mask_grad=mask_grad
        )
        out = [g.astype(p.base.dtype) for g in grads[:3]]
        if mask_grad:
            out.append(grads[3].astype(dmask_dtype(p.mask_dtype)))
        return tuple(out)
    from .kernels import linear

    return linear.backward(do, q, k, v, mask, decay, p, mask_grad)


def linear_attention_vjp(
    q: Any,
    k: Any,
    v: Any,
    causal: bool = False,
    mask: Any = None,
    decay: Any = None,
    scale: float = 1.0,
    mask_grad: bool = False,
) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    """``o`` and ``vjp(do) -> (dq, dk, dv[, dmask])`` (the backward needs only the inputs)."""
    if mask_grad and mask is None:
        raise ValueError("mask_grad=True needs a mask (there is nothing to differentiate)")
    o = linear_attention_forward(q, k, v, causal, mask, decay, scale)

    def vjp(do: Any) -> tuple[Any, ...]:
        return linear_attention_backward(do, q, k, v, causal, mask, decay, scale, mask_grad)

    return o, vjp


__all__ = [
    "LinearProblem",
    "check_linear",
    "check_linear_backward",
    "dmask_dtype",
    "linear_attention",
    "linear_attention_forward",
    "linear_attention_backward",
    "linear_attention_vjp",
]

