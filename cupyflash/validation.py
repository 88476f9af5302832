"""Argument checks shared by every backend: nothing launches until these pass.

The checks look only at types, shapes and dtypes, so they run the same on NumPy and CuPy
arrays and are unit-tested on the CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _dtypes

MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class AttentionProblem:
    """What a call asks for, once its arguments have been checked."""

    batch: tuple[int, ...]  # leading dims, shared by q, k and v
    hq: int
    hk: int
    nq: int
    nk: int
    d: int
    dtype: np.dtype
    causal: bool
    scale: float
    xp: str  # "numpy" or "cupy"

    @property
    def group(self) -> int:
        """Query heads per key/value head (1: MHA, hq: MQA)."""
        return self.hq // self.hk

    @property
    def batch_size(self) -> int:
        return math.prod(self.batch)


def array_kind(name: str, x: Any) -> str:
    """'numpy' or 'cupy' for an array argument; TypeError for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__
    if mod.startswith("cupy") and hasattr(x, "data") and hasattr(x, "dtype"):
        return "cupy"
    raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got {type(x).__name__}")


def common_kind(**arrays: Any) -> str:
    """The one array library all arguments come from; mixing them is a TypeError."""
    kinds = {name: array_kind(name, x) for name, x in arrays.items()}
    if len(set(kinds.values())) > 1:
        seen = ", ".join(f"{n}: {k}" for n, k in kinds.items())
        raise TypeError(f"arrays must all be NumPy or all be CuPy (no implicit copies); got {seen}")
    return next(iter(kinds.values()))


def _check_dtype(name: str, x: Any, want: np.dtype | None = None, allow_float64: bool = False) -> np.dtype:
    dt = np.dtype(x.dtype)
    if want is None:
        ok = _dtypes.SUPPORTED + ((np.dtype(np.float64),) if allow_float64 else ())
        if dt not in ok:
            names = ", ".join(str(d) for d in ok)
            raise TypeError(f"{name}.dtype must be one of {names}; got {dt}")
    elif dt != want:
        raise TypeError(f"{name}.dtype must equal q.dtype ({want}); got {dt}")
    return dt


def check_attention(
    q: Any, k: Any, v: Any, *, causal: bool = False, scale: float | None = None, allow_float64: bool = False
) -> AttentionProblem:
    """Check q (..., Hq, Nq, D), k and v (..., Hk, Nk, D) and describe the problem.

    ``allow_float64`` is for the NumPy reference, which also takes float64 inputs.
    """
    xp = common_kind(q=q, k=k, v=v)
    dtype = _check_dtype("q", q, allow_float64=allow_float64)
    _check_dtype("k", k, dtype)
    _check_dtype("v", v, dtype)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim < 3:
            raise ValueError(f"{name} must have shape (..., H, N, D) with at least 3 dims; got {x.shape}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {k.shape}, v {v.shape}")
    if q.shape[:-3] != k.shape[:-3]:
        raise ValueError(
            f"batch dims of q and k must match; got q {q.shape} (batch {q.shape[:-3]}), "
            f"k {k.shape} (batch {k.shape[:-3]})"
        )
    *batch, hq, nq, d = q.shape
    hk, nk, dk = k.shape[-3:]
    if dk != d:
        raise ValueError(f"head dim of k must equal that of q; got q {q.shape}, k {k.shape}")
    if d < 1 or d > MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be in 1..{MAX_HEAD_DIM}; got D={d} (q {q.shape})")
    if hk < 1 or hq < 1 or hq % hk:
        raise ValueError(f"query heads must be a positive multiple of key/value heads; got Hq={hq}, Hk={hk}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a real number or None; got {type(scale).__name__}")
    elif not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite; got {scale}")
    return AttentionProblem(tuple(batch), hq, hk, nq, nk, d, dtype, bool(causal), float(scale), xp)


def check_backward(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    allow_float64: bool = False,
) -> AttentionProblem:
    """Check the forward's arguments plus dO, O (q's shape and dtype) and lse (float32, q's shape minus D).

    With ``allow_float64`` (the reference) lse may be float32 or float64.
    """
    common_kind(do=do, q=q, k=k, v=v, o=o, lse=lse)
    p = check_attention(q, k, v, causal=causal, scale=scale, allow_float64=allow_float64)
    for name, x in (("do", do), ("o", o)):
        if not (allow_float64 and np.dtype(x.dtype) == np.float64):  # the reference takes exact o, dO
            _check_dtype(name, x, p.dtype)
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {q.shape}; got {x.shape}")
    lse_ok = (_dtypes.FLOAT32, np.dtype(np.float64)) if allow_float64 else (_dtypes.FLOAT32,)
    if np.dtype(lse.dtype) not in lse_ok:
        raise TypeError(f"lse.dtype must be float32; got {lse.dtype}")
    if lse.shape != q.shape[:-1]:
        raise ValueError(f"lse must have shape {q.shape[:-1]} (q's shape without D); got {lse.shape}")
    return p
