"""Argument checks of linear attention: nothing launches or allocates until these pass.

Shared by the public API (``linear_api``), the float64 reference (``linear_reference``) and the
kernels (``kernels/linear.py``), so none of them imports another's module. The checks look at
types, shapes and dtypes (and the host values of a decay), the same on NumPy and CuPy arrays.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

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


def _check_rate_values(vals: np.ndarray) -> None:
    if not (np.all(np.isfinite(vals)) and np.all(vals > 0) and np.all(vals <= 1)):
        raise ValueError(f"decay values must lie in (0, 1]; got min {vals.min()}, max {vals.max()}")


@functools.lru_cache(maxsize=256)
def _host_rates_ok(dtype: np.dtype, values: bytes) -> bool:
    """The range check of one set of host rates, remembered by value (a model passes the same
    rates every call); a failing set raises every time, as exceptions are never cached."""
    _check_rate_values(np.frombuffer(values, dtype=dtype).astype(np.float64))
    return True


def _check_decay_values(decay: Any) -> None:
    """Rates in (0, 1]: host rates by value through a cache; a CuPy decay costs one tiny
    (synchronising) device-to-host copy per call."""
    if isinstance(decay, np.ndarray):
        _host_rates_ok(decay.dtype, decay.tobytes())
        return
    import cupy

    _check_rate_values(cupy.asnumpy(decay).astype(np.float64))


def _signature(q: Any, k: Any, v: Any, causal: Any, mask: Any, decay: Any, scale: Any, allow_float64: bool) -> tuple:
    """Everything the shape, dtype and kind checks read (types too: True == 1 and 1 == 1.0 as keys)."""
    m = None if mask is None else (type(mask), mask.shape, mask.dtype)
    d = None if decay is None else (type(decay), decay.shape, decay.dtype)
    return (type(q), q.shape, q.dtype, type(k), k.shape, k.dtype, type(v), v.shape, v.dtype,
            type(causal), causal, type(scale), scale, allow_float64, m, d)  # fmt: skip


#: checked problems by signature; only calls that passed every check are ever stored
_checked: dict[tuple, LinearProblem] = {}
_MAX_CHECKED = 256


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
    """Check q (..., Hq, Nq, D), k and v (..., Hk, Nk, D), the mask and the decay.

    The shape, dtype and kind checks are pure functions of the arguments' types, shapes and dtypes
    (and of causal and scale): their verdict is remembered per signature, so a repeated call costs
    one dictionary lookup, and a signature that failed is checked (and fails) again every time.
    Decay values are checked on every call.
    """
    decay = host_decay(decay)
    try:
        key = _signature(q, k, v, causal, mask, decay, scale, allow_float64)
        p = _checked.get(key)
    except (AttributeError, TypeError):  # not arrays, or an unhashable scale: the full checks say why
        key, p = None, None
    if p is None:
        p = _check_signature(q, k, v, causal, mask, decay, scale, allow_float64)
        if key is not None:
            if len(_checked) >= _MAX_CHECKED:
                _checked.clear()
            _checked[key] = p
    if decay is not None:
        _check_decay_values(decay)
    return p


def _check_signature(
    q: Any, k: Any, v: Any, causal: Any, mask: Any, decay: Any, scale: Any, allow_float64: bool
) -> LinearProblem:
    arrays = {"q": q, "k": k, "v": v}
    if mask is not None:
        arrays["mask"] = mask
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


__all__ = ["LinearProblem", "check_linear", "check_linear_backward", "dmask_dtype", "host_decay"]
