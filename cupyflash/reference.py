"""The float64 reference: the ground truth every kernel is checked against.

Two formulations of the same mathematics, both computed in float64 whatever the input
dtype (float64, float32, float16, bfloat16):

- the *plain* one (``attention_forward``, ``attention_backward``) materialises the whole
  score matrix ``S = scale * Q K^T`` and is short enough to check by eye;
- the *tiled* one (``tiled_attention_forward``, ``tiled_attention_backward``) is
  FlashAttention's algorithm written as loops over Br x Bc tiles (online softmax in the
  forward, recomputation of P in the FA2-ordered backward). It mirrors what the CUDA
  kernels do, tile by tile, so a kernel bug can be narrowed to one step of the algorithm.

Conventions (DESIGN.md §1): q is (..., Hq, Nq, D), k and v are (..., Hk, Nk, D) with
Hq % Hk == 0 and query head h reading key/value head h // (Hq // Hk); ``causal`` masks key j
for query i when j > i + (Nk - Nq); lse is the natural-log log-sum-exp of the scaled scores;
a query row that sees no key gives o = 0, lse = -inf and zero gradients.

The functions take NumPy arrays (and, the operations being NumPy-generic, CuPy arrays;
results stay on the arrays' library).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .validation import AttentionProblem, array_kind, check_attention, check_backward

NEG_INF = -np.inf


# ---------------------------------------------------------------------------- helpers


def _xp(p: AttentionProblem) -> Any:
    if p.xp == "numpy":
        return np
    import cupy

    return cupy


def _grouped(x: Any, p: AttentionProblem, heads: int, group: int) -> Any:
    """float64 view of (..., H, N, D) as (..., Hk, group, N, D).

    q becomes (..., Hk, G, Nq, D) and k/v (..., Hk, 1, Nk, D), so broadcasting in matmul
    pairs query head h with key/value head h // G without copying k/v G times.
    """
    *_, n, d = x.shape
    return x.astype(np.float64).reshape(*p.batch, heads // group, group, n, d)


def _kv_heads(x: Any, p: AttentionProblem) -> Any:
    """Sum a per-query-head gradient (..., Hk, G, Nk, D) over each group: (..., Hk, Nk, D)."""
    return x.sum(axis=-3).reshape(*p.batch, p.hk, p.nk, p.d)


def _visible(xp: Any, rows: Any, cols: Any, p: AttentionProblem) -> Any:
    """Boolean (len(rows), len(cols)): may query ``rows[a]`` see key ``cols[b]``?"""
    if not p.causal:
        return xp.ones((len(rows), len(cols)), dtype=bool)
    return cols[None, :] <= rows[:, None] + (p.nk - p.nq)


def _row_max(xp: Any, s: Any) -> Any:
    """max over the last axis, keeping it; -inf for an empty row (Nk = 0)."""
    if s.shape[-1] == 0:
        return xp.full(s.shape[:-1] + (1,), NEG_INF)
    return s.max(axis=-1, keepdims=True)


def _probabilities(xp: Any, s: Any, lse: Any, visible: Any) -> Any:
    """P = exp(S - lse), 0 where masked or where the row saw no key (lse = -inf)."""
    keep = visible & xp.isfinite(lse)
    return xp.exp(xp.where(keep, s - xp.where(xp.isfinite(lse), lse, 0.0), NEG_INF))


def _t(x: Any) -> Any:
    return x.swapaxes(-1, -2)


# ---------------------------------------------------------------------------- plain


def attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None
) -> tuple[Any, Any]:
    """o = softmax(scale * q k^T) v and lse, both float64, the whole score matrix at once."""
    p = check_attention(q, k, v, causal=causal, scale=scale, allow_float64=True)
    xp = _xp(p)
    Q, K, V = _grouped(q, p, p.hq, p.group), _grouped(k, p, p.hk, 1), _grouped(v, p, p.hk, 1)
    S = p.scale * (Q @ _t(K))  # (..., Hk, G, Nq, Nk)
    S = xp.where(_visible(xp, xp.arange(p.nq), xp.arange(p.nk), p), S, NEG_INF)
    m = _row_max(xp, S)
    m_safe = xp.where(xp.isfinite(m), m, 0.0)  # a row with no key: keep exp() at 0, not NaN
    E = xp.exp(S - m_safe)
    l = E.sum(axis=-1, keepdims=True)
    P = E / xp.where(l > 0, l, 1.0)
    O = P @ V
    lse = xp.where(l > 0, m + xp.log(xp.where(l > 0, l, 1.0)), NEG_INF)
    return O.reshape(q.shape), lse.reshape(q.shape[:-1])


def attention(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None) -> Any:
    """Output only; see ``attention_forward``."""
    return attention_forward(q, k, v, causal, scale)[0]


def _backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, p: AttentionProblem) -> tuple[Any, Any, Any]:
    xp = _xp(p)
    Q, dO, O = (_grouped(x, p, p.hq, p.group) for x in (q, do, o))
    K, V = _grouped(k, p, p.hk, 1), _grouped(v, p, p.hk, 1)
    L = lse.astype(np.float64).reshape(*p.batch, p.hk, p.group, p.nq, 1)
    S = p.scale * (Q @ _t(K))
    P = _probabilities(xp, S, L, _visible(xp, xp.arange(p.nq), xp.arange(p.nk), p))
    dV = P.swapaxes(-1, -2) @ dO  # (..., Hk, G, Nk, D): summed over the group below
    dP = dO @ _t(V)
    Delta = (dO * O).sum(axis=-1, keepdims=True)  # = rowsum(P * dP) when o is exact
    dS = P * (dP - Delta)
    dQ = p.scale * (dS @ K)
    dK = p.scale * (_t(dS) @ Q)
    return dQ.reshape(q.shape), _kv_heads(dK, p), _kv_heads(dV, p)


def attention_backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: bool = False, scale: float | None = None
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) in float64 by recomputing P = exp(S - lse) from the given lse.

    Delta = rowsum(dO * O) uses the given o, as the kernels do. dk and dv have k's and v's
    shapes: under GQA each sums over its group's query heads.
    """
    p = check_backward(do, q, k, v, o, lse, causal=causal, scale=scale, allow_float64=True)
    return _backward(do, q, k, v, o, lse, p)


def attention_vjp(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None
) -> tuple[Any, Callable[[Any], tuple[Any, Any, Any]]]:
    """o (float64) and vjp(do) -> (dq, dk, dv); do has q's shape and dtype (or float64)."""
    p = check_attention(q, k, v, causal=causal, scale=scale, allow_float64=True)
    o, lse = attention_forward(q, k, v, p.causal, p.scale)

    def vjp(do: Any) -> tuple[Any, Any, Any]:
        array_kind("do", do)
        if do.shape != q.shape:
            raise ValueError(f"do must have q's shape {q.shape}; got {do.shape}")
        if np.dtype(do.dtype) not in (p.dtype, np.dtype(np.float64)):
            raise TypeError(f"do.dtype must equal q.dtype ({p.dtype}) or be float64; got {do.dtype}")
        return _backward(do, q, k, v, o, lse, p)

    return o, vjp


# ---------------------------------------------------------------------------- tiled (FlashAttention)


def _check_blocks(block_q: int, block_k: int) -> None:
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1:
            raise ValueError(f"{name} must be a positive int; got {b!r}")


def _tile_skipped(p: AttentionProblem, i1: int, j0: int) -> bool:
    """True when every key of the tile starting at j0 lies above the causal diagonal for
    every query before i1 (the last query of the tile, i1 - 1, sees the most keys)."""
    return p.causal and j0 > (i1 - 1) + (p.nk - p.nq)


def tiled_attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, block_q: int = 64, block_k: int = 64
) -> tuple[Any, Any]:
    """FlashAttention's forward (Algorithm 1 of FA2) on Br x Bc = block_q x block_k tiles.

    For each Q_i the keys stream past once; a running row max m and row sum l let O_i be
    rescaled instead of recomputed, and lse = m + log l is written once at the end.
    """
    _check_blocks(block_q, block_k)
    p = check_attention(q, k, v, causal=causal, scale=scale, allow_float64=True)
    xp = _xp(p)
    Q, K, V = _grouped(q, p, p.hq, p.group), _grouped(k, p, p.hk, 1), _grouped(v, p, p.hk, 1)
    O = xp.zeros(Q.shape)
    lse = xp.full(Q.shape[:-1] + (1,), NEG_INF)
    for i0 in range(0, p.nq, block_q):
        i1 = min(i0 + block_q, p.nq)
        Q_i = Q[..., i0:i1, :]
        m = xp.full(Q_i.shape[:-1] + (1,), NEG_INF)
        l = xp.zeros(Q_i.shape[:-1] + (1,))
        acc = xp.zeros(Q_i.shape)
        for j0 in range(0, p.nk, block_k):
            if _tile_skipped(p, i1, j0):
                break  # later tiles lie further right: all skipped too
            j1 = min(j0 + block_k, p.nk)
            S_ij = p.scale * (Q_i @ _t(K[..., j0:j1, :]))
            S_ij = xp.where(_visible(xp, xp.arange(i0, i1), xp.arange(j0, j1), p), S_ij, NEG_INF)
            m_new = xp.maximum(m, _row_max(xp, S_ij))
            m_safe = xp.where(xp.isfinite(m_new), m_new, 0.0)  # row saw no key yet
            P_ij = xp.exp(S_ij - m_safe)
            alpha = xp.exp(m - m_safe)  # rescales what was summed under the old max
            l = alpha * l + P_ij.sum(axis=-1, keepdims=True)
            acc = alpha * acc + P_ij @ V[..., j0:j1, :]
            m = m_new
        seen = l > 0
        O[..., i0:i1, :] = acc / xp.where(seen, l, 1.0)
        lse[..., i0:i1, :] = xp.where(seen, m + xp.log(xp.where(seen, l, 1.0)), NEG_INF)
    return O.reshape(q.shape), lse.reshape(q.shape[:-1])


def tiled_attention_backward(
    do: Any,
    q: Any,
    k: Any,
    v: Any,
    o: Any,
    lse: Any,
    causal: bool = False,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int = 64,
) -> tuple[Any, Any, Any]:
    """FlashAttention-2's backward on tiles: Delta first, then an outer loop over K_j, V_j
    accumulating dK_j and dV_j, and an inner loop over Q_i accumulating into dQ."""
    _check_blocks(block_q, block_k)
    p = check_backward(do, q, k, v, o, lse, causal=causal, scale=scale, allow_float64=True)
    xp = _xp(p)
    Q, dO, O = (_grouped(x, p, p.hq, p.group) for x in (q, do, o))
    K, V = _grouped(k, p, p.hk, 1), _grouped(v, p, p.hk, 1)
    L = lse.astype(np.float64).reshape(*p.batch, p.hk, p.group, p.nq, 1)
    Delta = (dO * O).sum(axis=-1, keepdims=True)
    dQ = xp.zeros(Q.shape)
    dK = xp.zeros(K.shape)
    dV = xp.zeros(V.shape)
    for j0 in range(0, p.nk, block_k):
        j1 = min(j0 + block_k, p.nk)
        K_j, V_j = K[..., j0:j1, :], V[..., j0:j1, :]
        dK_j = xp.zeros(K_j.shape)
        dV_j = xp.zeros(V_j.shape)
        for i0 in range(0, p.nq, block_q):
            i1 = min(i0 + block_q, p.nq)
            if _tile_skipped(p, i1, j0):
                continue  # these queries see none of K_j; later Q_i may
            Q_i, dO_i = Q[..., i0:i1, :], dO[..., i0:i1, :]
            S_ij = p.scale * (Q_i @ _t(K_j))
            P_ij = _probabilities(xp, S_ij, L[..., i0:i1, :], _visible(xp, xp.arange(i0, i1), xp.arange(j0, j1), p))
            dV_j += (_t(P_ij) @ dO_i).sum(axis=-3, keepdims=True)  # GQA: the group shares V_j
            dP_ij = dO_i @ _t(V_j)
            dS_ij = P_ij * (dP_ij - Delta[..., i0:i1, :])
            dQ[..., i0:i1, :] += p.scale * (dS_ij @ K_j)
            dK_j += p.scale * (_t(dS_ij) @ Q_i).sum(axis=-3, keepdims=True)
        dK[..., j0:j1, :] = dK_j
        dV[..., j0:j1, :] = dV_j
    return dQ.reshape(q.shape), dK.reshape(k.shape), dV.reshape(v.shape)


# The linear-attention reference lives in its own module; it is part of this namespace too.
from .linear_reference import (  # noqa: E402, F401
    linear_attention,
    linear_attention_backward,
    linear_attention_forward,
    linear_attention_vjp,
)
