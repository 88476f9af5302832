"""Float64 reference for linear attention: W and the N x N scores materialised, short enough
to check by eye. Same signatures as ``cupyflash.linear_api``; results are float64 (the
public API rounds them once to the input dtype).

    A = scale * W o (Q K^T)          (..., Hq, Nq, Nk)
    O = A V
    dA = dO V^T
    dV = A^T dO,  dQ = (scale W o dA) K,  dK = (scale W o dA)^T Q   (dK, dV summed per GQA group)
    dmask = scale * (Q K^T) o dA o W_cd, summed to the mask's shape (W_cd: causal and decay only)
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .linear_api import LinearProblem, check_linear, check_linear_backward


def _f64(x: Any) -> np.ndarray:
    if not isinstance(x, np.ndarray):
        raise TypeError(f"the linear-attention reference takes NumPy arrays; got {type(x).__name__}")
    return x.astype(np.float64)


def _kv(x: Any, p: LinearProblem) -> np.ndarray:
    """k or v repeated to one copy per query head (query head h reads kv head h // group)."""
    return np.repeat(_f64(x), p.base.group, axis=-3)


def _group_sum(x: np.ndarray, p: LinearProblem) -> np.ndarray:
    b = p.base
    return x.reshape(*b.batch, b.hk, b.group, *x.shape[-2:]).sum(axis=-3)


def causal_decay_weights(p: LinearProblem, decay: Any) -> np.ndarray:
    """W_cd, shape (Hq, Nq, Nk): causal indicator times decay[h] ** (i + Nk - Nq - j)."""
    b = p.base
    pos = np.arange(b.nq)[:, None] + (b.nk - b.nq)  # key position each query row sits at
    dist = pos - np.arange(b.nk)[None, :]
    w = np.ones((b.hq, b.nq, b.nk))
    if b.causal:
        w = w * (dist >= 0)
    if decay is not None:
        lam = _f64(decay)[:, None, None]
        w = w * lam ** np.maximum(dist, 0)
    return w


def _weights(p: LinearProblem, mask: Any, decay: Any) -> tuple[np.ndarray, np.ndarray]:
    """(W, W_cd): the full weight (..., Hq, Nq, Nk) and its causal/decay factor (Hq, Nq, Nk)."""
    wcd = causal_decay_weights(p, decay)
    w = np.broadcast_to(wcd, p.full_shape)
    if mask is not None:
        w = w * np.broadcast_to(_f64(mask), p.full_shape)
    return w, wcd


def sum_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Undo a broadcast: sum x over the leading dims shape lacks and the dims where shape has 1."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def linear_attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, mask: Any = None, decay: Any = None, scale: float = 1.0
) -> np.ndarray:
    """o in float64 (no lse: linear attention has no normaliser)."""
    p = check_linear(q, k, v, causal=causal, mask=mask, decay=decay, scale=scale, allow_float64=True)
    w, _ = _weights(p, mask, decay)
    s = _f64(q) @ np.swapaxes(_kv(k, p), -1, -2)
    return (p.base.scale * w * s) @ _kv(v, p)


def linear_attention(
    q: Any, k: Any, v: Any, causal: bool = False, mask: Any = None, decay: Any = None, scale: float = 1.0
) -> np.ndarray:
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
) -> tuple[np.ndarray, ...]:
    """(dq, dk, dv[, dmask]) in float64; dmask summed to the mask's own shape."""
    p = check_linear_backward(
        do, q, k, v, causal=causal, mask=mask, decay=decay, scale=scale, mask_grad=mask_grad, allow_float64=True
    )
    sc = p.base.scale
    w, wcd = _weights(p, mask, decay)
    q64, k64, v64, do64 = _f64(q), _kv(k, p), _kv(v, p), _f64(do)
    s = q64 @ np.swapaxes(k64, -1, -2)
    da = do64 @ np.swapaxes(v64, -1, -2)
    ds = sc * w * da
    dq = ds @ k64
    dk = _group_sum(np.swapaxes(ds, -1, -2) @ q64, p)
    dv = _group_sum(np.swapaxes(sc * w * s, -1, -2) @ do64, p)
    if not mask_grad:
        return dq, dk, dv
    dmask = sum_to_shape(sc * s * da * wcd, p.mask_shape)  # type: ignore[arg-type]
    return dq, dk, dv, dmask


def linear_attention_vjp(
    q: Any,
    k: Any,
    v: Any,
    causal: bool = False,
    mask: Any = None,
    decay: Any = None,
    scale: float = 1.0,
    mask_grad: bool = False,
) -> tuple[np.ndarray, Callable[[Any], tuple[np.ndarray, ...]]]:
    """o (float64) and vjp(do) -> (dq, dk, dv[, dmask]) in float64."""
    if mask_grad and mask is None:
        raise ValueError("mask_grad=True needs a mask (there is nothing to differentiate)")
    o = linear_attention_forward(q, k, v, causal, mask, decay, scale)

    def vjp(do: Any) -> tuple[np.ndarray, ...]:
        return linear_attention_backward(do, q, k, v, causal, mask, decay, scale, mask_grad)

    return o, vjp


__all__ = [
    "causal_decay_weights",
    "linear_attention",
    "linear_attention_forward",
    "linear_attention_backward",
    "linear_attention_vjp",
    "sum_to_shape",
]
