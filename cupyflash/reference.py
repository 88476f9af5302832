"""The float64 reference: the ground truth every kernel is checked against.

Two formulations of the same mathematics, both computed in float64 whatever the input
dtype (float64, float32, float16, bfloat16):

- the *plain* one (``attention_forward``, ``attention_backward``) materialises the whole
  score matrix ``S = scale * Q K^T`` and is short enough to check by eye;
- the *tiled* one (``tiled_attention_forward``, ``tiled_attention_backward``) is
  FlashAttention's algorithm written as loops over Br x Bc tiles (online softmax in the
  forward, recomputation of P in the FA2-ordered backward). It mirrors what the CUDA
  kernels do, tile by tile, so a kernel bug can be narrowed to one step of the algorithm.

Conventions (as in ``cupyflash.attention_forward``): q is (..., Hq, Nq, D), k and v are (..., Hk, Nk, D) with
Hq % Hk == 0 and query head h reading key/value head h // (Hq // Hk); ``causal`` masks key j
for query i when j > i + (Nk - Nq); lse is the natural-log log-sum-exp of the scaled scores;
a query row that sees no key gives o = 0, lse = -inf and zero gradients.

The functions take NumPy arrays (and, the operations being NumPy-generic, CuPy arrays;
results stay on the arrays' library).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import dropout as _dropout
from .validation import (AttentionProblem, array_kind, check_attention, check_backward, check_dropout,
                         check_flex_backward, score_shape)

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
    """Boolean (len(rows), len(cols)): may query ``rows[a]`` see key ``cols[b]``? (The variant's rule,
    the same as its kernel policy's ``visible``.)"""
    return p.variant.visible(xp, rows, cols, p.nq, p.nk)


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


# ---------------------------------------------------------------------------- variants


def _per_head(x: Any, p: AttentionProblem) -> Any:
    """A float32 (Hq,) or (*batch, Hq) array as float64 (..., Hk, G, 1, 1), broadcasting like S."""
    x = x.astype(np.float64)
    lead = x.shape[:-1] if x.ndim > 1 else (1,) * len(p.batch)
    return x.reshape(*lead, p.hk, p.group, 1, 1)


def _score_array(x: Any, p: AttentionProblem) -> Any:
    """A mask or bias broadcastable to (*batch, Hq, Nq, Nk) as a (..., Hk, G, Nq, Nk) view (no copy), or None."""
    if x is None:
        return None
    xp = _xp(p)
    full = xp.broadcast_to(x, score_shape(p))
    return full.reshape(*p.batch, p.hk, p.group, p.nq, p.nk)


def _scores(xp: Any, Q: Any, K: Any, p: AttentionProblem, rows: Any, cols: Any, slopes: Any,
            arrays: tuple[Any, Any] = (None, None)) -> tuple[Any, Any]:  # fmt: skip
    """(S after softcap, ALiBi and the bias, S scaled only) on the rows x cols tile, masked to -inf where
    hidden (by the built-in mask or the mask array). ``arrays``: (mask, bias) from ``_score_array``; rows and
    cols are contiguous ranges."""
    raw = p.scale * (Q @ _t(K))
    S = p.variant.scores(xp, raw, slopes, rows, cols, p.nq, p.nk)
    mask, bias = arrays
    visible = _visible(xp, rows, cols, p)
    if len(rows) and len(cols):  # (an empty tile has nothing to add or hide)
        tile = (Ellipsis, slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1))
        if bias is not None:
            S = S + bias[tile].astype(np.float64)
        if mask is not None:
            visible = visible & mask[tile]
    twins = _twins(p)
    if twins is not None:  # score_mod after ALiBi, mask_mod ANDed with the masks
        from .flex import twin_scores

        S, visible = twin_scores(twins, xp, S, visible, p.batch, p.hk, p.group, rows, cols)
    S = xp.where(visible, S, NEG_INF)
    return S, raw


def _twin_dscore(xp: Any, p: AttentionProblem, S: Any, rows: Any, cols: Any) -> Any:
    """d(new score)/d(score) of score_mod from its twin score_mod_grad, given S after score_mod (1 without)."""
    twins = _twins(p)
    if twins is None:
        return 1.0
    from .flex import twin_dscore

    return twin_dscore(twins, xp, S, p.batch, p.hk, p.group, rows, cols)


def _dbias(dS: Any, bias: Any, p: AttentionProblem) -> Any:
    """The bias gradient: dS = d loss / d score, (..., Hk, G, Nq, Nk), summed to the bias's own shape."""
    full = dS.reshape(score_shape(p))
    lead = full.ndim - bias.ndim
    out = full.sum(axis=tuple(range(lead))) if lead else full
    axes = tuple(i for i, n in enumerate(bias.shape) if n == 1 and out.shape[i] != 1)
    return out.sum(axis=axes, keepdims=True) if axes else out


def _variant_kwargs(window_size: Any, softcap: Any, alibi_slopes: Any, sinks: Any, mask: Any = None,
                    bias: Any = None, dropout_p: Any = 0.0, *flex: Any) -> dict[str, Any]:  # fmt: skip
    """The variant keywords for the checks; ``flex``: (mask_mod, score_mod, score_mod_grad, aux, block_mask)."""
    out = {"window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes, "sinks": sinks,
           "mask": mask, "bias": bias, "dropout_p": dropout_p}  # fmt: skip
    out.update(zip(("mask_mod", "score_mod", "score_mod_grad", "aux", "block_mask"), flex))
    return out


def _twins(p: AttentionProblem) -> Any:
    """The Python twins of user snippets (issue 17 part 3), or None; C++ text cannot run here."""
    from .flex import FlexTwins

    flex = p.variant.flex
    if flex is not None and not isinstance(flex, FlexTwins):
        raise TypeError("the NumPy reference cannot run C++ snippets: pass mask_mod/score_mod/score_mod_grad as Python "
                        "callables on broadcast index arrays (the snippets' twins; see cupyflash.flex)")  # fmt: skip
    return flex


def _dropout_seed(dropout_p: Any, dropout_seed: Any) -> int | None:
    return check_dropout(dropout_p, dropout_seed, need_seed=True)[1]


def _dropout_factor(xp: Any, p: AttentionProblem, seed: int | None, rows: Any, cols: Any, b0: int = 0) -> Any:
    """keep / (1 - p_eff) on the rows x cols tile, (*batch, Hk, G, len(rows), len(cols)), broadcasting like S; None
    without dropout. The mask is ``dropout.keep``'s (the kernels' rule), its batch indices from ``b0`` on."""
    if not p.variant.dropout > 0:
        return None
    rows, cols = (np.asarray(x.get() if hasattr(x, "get") else x) for x in (rows, cols))
    kept = _dropout.keep(seed, p.variant.dropout, np.arange(b0, b0 + p.batch_size), np.arange(p.hq), rows, cols)
    z = kept.reshape(*p.batch, p.hk, p.group, len(rows), len(cols)) * _dropout.keep_scale(p.variant.dropout)
    return xp.asarray(z)


# ---------------------------------------------------------------------------- plain


def attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, *,
    window_size: Any = None, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None, mask: Any = None,
    bias: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None, mask_mod: Any = None, score_mod: Any = None,
    score_mod_grad: Any = None, aux: Any = None, block_mask: Any = None, dropout_batch0: int = 0,
) -> tuple[Any, Any]:  # fmt: skip
    """o = softmax(scores) v and lse, both float64, the whole score matrix at once.

    scores = scale q k^T, then softcap, then ALiBi, then the bias, then the causal/window mask and the mask
    array; a sink logit per head joins every row's denominator (and its lse). With dropout, o = (P * keep /
    (1 - p_eff)) v with ``cupyflash.dropout_mask``'s keep mask and p_eff = ``cupyflash.effective_dropout_p(p)``;
    lse is the undropped one. ``dropout_batch0``: the mask's batch index of the first batch entry (the packed
    sequence's index, for the varlen reference)."""
    p = check_attention(q, k, v, causal=causal, scale=scale, allow_float64=True,
                        **_variant_kwargs(window_size, softcap, alibi_slopes, sinks, mask, bias, dropout_p,
                                          mask_mod, score_mod, score_mod_grad, aux, block_mask))  # fmt: skip
    seed = _dropout_seed(dropout_p, dropout_seed)
    xp = _xp(p)
    Q, K, V = _grouped(q, p, p.hq, p.group), _grouped(k, p, p.hk, 1), _grouped(v, p, p.hk, 1)
    slopes = None if alibi_slopes is None else _per_head(alibi_slopes, p)
    arrays = (_score_array(mask, p), _score_array(bias, p))
    S, _ = _scores(xp, Q, K, p, xp.arange(p.nq), xp.arange(p.nk), slopes, arrays)  # (..., Hk, G, Nq, Nk)
    m = _row_max(xp, S)
    sink = None if sinks is None else _per_head(sinks, p)
    if sink is not None:
        m = xp.maximum(m, sink)
    m_safe = xp.where(xp.isfinite(m), m, 0.0)  # a row with no key (and no sink): keep exp() at 0, not NaN
    E = xp.exp(S - m_safe)
    l = E.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + xp.exp(sink - m_safe)
    P = E / xp.where(l > 0, l, 1.0)
    Z = _dropout_factor(xp, p, seed, np.arange(p.nq), np.arange(p.nk), dropout_batch0)
    O = (P if Z is None else P * Z) @ V
    lse = xp.where(l > 0, m + xp.log(xp.where(l > 0, l, 1.0)), NEG_INF)
    return O.reshape(q.shape), lse.reshape(q.shape[:-1])


def attention(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, **variant: Any) -> Any:
    """Output only; see ``attention_forward``."""
    return attention_forward(q, k, v, causal, scale, **variant)[0]


def _dsinks(xp: Any, L: Any, Delta: Any, sinks: Any, p: AttentionProblem) -> Any:
    """d loss / d sink_h = -sum over batch and rows of P_sink * Delta, P_sink = exp(sink_h - lse)."""
    P_sink = xp.where(xp.isfinite(L), xp.exp(_per_head(sinks, p) - xp.where(xp.isfinite(L), L, 0.0)), 0.0)
    d = -(P_sink * Delta).sum(axis=(-1, -2))  # (*batch, Hk, G)
    return d.reshape(-1, p.hq).sum(axis=0)


def _backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, p: AttentionProblem, alibi_slopes: Any,
              sinks: Any, mask: Any = None, bias: Any = None, bias_grad: bool = False,
              seed: int | None = None, b0: int = 0) -> tuple[Any, ...]:  # fmt: skip
    xp = _xp(p)
    Q, dO, O = (_grouped(x, p, p.hq, p.group) for x in (q, do, o))
    K, V = _grouped(k, p, p.hk, 1), _grouped(v, p, p.hk, 1)
    L = lse.astype(np.float64).reshape(*p.batch, p.hk, p.group, p.nq, 1)
    slopes = None if alibi_slopes is None else _per_head(alibi_slopes, p)
    arrays = (_score_array(mask, p), _score_array(bias, p))
    S, raw = _scores(xp, Q, K, p, xp.arange(p.nq), xp.arange(p.nk), slopes, arrays)
    P = _probabilities(xp, S, L, xp.isfinite(S))
    Z = _dropout_factor(xp, p, seed, np.arange(p.nq), np.arange(p.nk), b0)
    dV = (P if Z is None else P * Z).swapaxes(-1, -2) @ dO  # (..., Hk, G, Nk, D): summed over the group below
    dP = dO @ _t(V)
    if Z is not None:  # d(loss)/d(undropped P) = Z dP; Delta = rowsum(dO O) still equals rowsum(P Z dP)
        dP = dP * Z
    Delta = (dO * O).sum(axis=-1, keepdims=True)  # = rowsum(P * dP) (+ the sink's share) when o is exact
    dS_score = P * (dP - Delta)  # d loss / d score: the bias's gradient before any reduction
    dS = dS_score * p.variant.dscore(xp, raw) * _twin_dscore(xp, p, S, xp.arange(p.nq), xp.arange(p.nk))
    dQ = p.scale * (dS @ K)
    dK = p.scale * (_t(dS) @ Q)
    grads = (dQ.reshape(q.shape), _kv_heads(dK, p), _kv_heads(dV, p))
    if sinks is not None:
        grads = (*grads, _dsinks(xp, L, Delta, sinks, p))
    return grads if not bias_grad else (*grads, _dbias(dS_score, bias, p))


def attention_backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: bool = False, scale: float | None = None, *,
    window_size: Any = None, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None, mask: Any = None,
    bias: Any = None, bias_grad: bool = False, dropout_p: float = 0.0, dropout_seed: int | None = None,
    mask_mod: Any = None, score_mod: Any = None, score_mod_grad: Any = None, aux: Any = None, block_mask: Any = None,
    dropout_batch0: int = 0,
) -> tuple[Any, ...]:  # fmt: skip
    """(dq, dk, dv) in float64 by recomputing P = exp(S - lse) from the given lse, then dsinks (float64,
    (Hq,)) when ``sinks`` is given (lse must come from a forward with the same sinks), then dbias (float64,
    the bias's shape: d loss / d score summed over the bias's broadcast dims) when ``bias_grad``. Dropout
    keywords (``dropout_batch0`` too) as the forward's.

    Delta = rowsum(dO * O) uses the given o, as the kernels do. dk and dv have k's and v's
    shapes: under GQA each sums over its group's query heads.
    """
    p = check_backward(do, q, k, v, o, lse, causal=causal, scale=scale, allow_float64=True, bias_grad=bias_grad,
                       **_variant_kwargs(window_size, softcap, alibi_slopes, sinks, mask, bias, dropout_p, mask_mod,
                                         score_mod, score_mod_grad, aux, block_mask))  # fmt: skip
    return _backward(do, q, k, v, o, lse, p, alibi_slopes, sinks, mask, bias, bool(bias_grad),
                     _dropout_seed(dropout_p, dropout_seed), dropout_batch0)  # fmt: skip


def attention_vjp(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, **variant: Any
) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    """o (float64) and vjp(do) -> (dq, dk, dv[, dsinks][, dbias]); do has q's shape and dtype (or float64).
    ``bias_grad=True`` (with a bias) adds dbias."""
    bias_grad = variant.pop("bias_grad", False)
    seed = variant.pop("dropout_seed", None)
    p = check_attention(q, k, v, causal=causal, scale=scale, allow_float64=True, **variant)
    if bias_grad and variant.get("bias") is None:
        raise ValueError("bias_grad=True needs a bias (the gradient is that of the bias argument)")
    seed = _dropout_seed(p.variant.dropout, seed)
    o, lse = attention_forward(q, k, v, causal, p.scale, dropout_seed=seed, **variant)

    def vjp(do: Any) -> tuple[Any, ...]:
        array_kind("do", do)
        if do.shape != q.shape:
            raise ValueError(f"do must have q's shape {q.shape}; got {do.shape}")
        if np.dtype(do.dtype) not in (p.dtype, np.dtype(np.float64)):
            raise TypeError(f"do.dtype must equal q.dtype ({p.dtype}) or be float64; got {do.dtype}")
        check_flex_backward(p)
        return _backward(do, q, k, v, o, lse, p, variant.get("alibi_slopes"), variant.get("sinks"),
                         variant.get("mask"), variant.get("bias"), bool(bias_grad), seed)  # fmt: skip

    return o, vjp


# ---------------------------------------------------------------------------- tiled (FlashAttention)


def _check_blocks(block_q: int, block_k: int) -> None:
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(b, (int, np.integer)) or isinstance(b, bool) or b < 1:
            raise ValueError(f"{name} must be a positive int; got {b!r}")


def _tile_skipped(p: AttentionProblem, i0: int, i1: int, j0: int, j1: int) -> bool:
    """True when no query of [i0, i1) sees any key of [j0, j1) (the kernels skip such tiles too)."""
    k0, k1 = p.variant.keys_of(i0, i1, p.nq, p.nk)
    return j1 <= k0 or j0 >= k1


def tiled_attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, block_q: int = 64, block_k: int = 64,
    *, window_size: Any = None, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None, mask: Any = None,
    bias: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None, mask_mod: Any = None, score_mod: Any = None,
    score_mod_grad: Any = None, aux: Any = None, block_mask: Any = None, dropout_batch0: int = 0,
) -> tuple[Any, Any]:  # fmt: skip
    """FlashAttention's forward (Algorithm 1 of FA2) on Br x Bc = block_q x block_k tiles.

    For each Q_i the keys stream past once; a running row max m and row sum l let O_i be
    rescaled instead of recomputed, and lse = m + log l is written once at the end. A sink starts
    m at its logit and l at 1. Dropout drops from what multiplies V_j, not from l (lse stays undropped).
    """
    _check_blocks(block_q, block_k)
    p = check_attention(q, k, v, causal=causal, scale=scale, allow_float64=True,
                        **_variant_kwargs(window_size, softcap, alibi_slopes, sinks, mask, bias, dropout_p,
                                          mask_mod, score_mod, score_mod_grad, aux, block_mask))  # fmt: skip
    seed = _dropout_seed(dropout_p, dropout_seed)
    xp = _xp(p)
    Q, K, V = _grouped(q, p, p.hq, p.group), _grouped(k, p, p.hk, 1), _grouped(v, p, p.hk, 1)
    slopes = None if alibi_slopes is None else _per_head(alibi_slopes, p)
    arrays = (_score_array(mask, p), _score_array(bias, p))
    sink = None if sinks is None else _per_head(sinks, p)
    O = xp.zeros(Q.shape)
    lse = xp.full(Q.shape[:-1] + (1,), NEG_INF)
    for i0 in range(0, p.nq, block_q):
        i1 = min(i0 + block_q, p.nq)
        Q_i = Q[..., i0:i1, :]
        m = xp.full(Q_i.shape[:-1] + (1,), NEG_INF)
        l = xp.zeros(Q_i.shape[:-1] + (1,))
        if sink is not None:
            m = xp.zeros(m.shape) + sink  # every row starts at its head's sink, with exp(0) = 1 in l
            l = l + 1.0
        acc = xp.zeros(Q_i.shape)
        for j0 in range(0, p.nk, block_k):
            j1 = min(j0 + block_k, p.nk)
            if _tile_skipped(p, i0, i1, j0, j1):
                continue
            S_ij, _ = _scores(xp, Q_i, K[..., j0:j1, :], p, xp.arange(i0, i1), xp.arange(j0, j1), slopes, arrays)
            m_new = xp.maximum(m, _row_max(xp, S_ij))
            m_safe = xp.where(xp.isfinite(m_new), m_new, 0.0)  # row saw no key yet
            P_ij = xp.exp(S_ij - m_safe)
            alpha = xp.exp(m - m_safe)  # rescales what was summed under the old max
            l = alpha * l + P_ij.sum(axis=-1, keepdims=True)
            Z_ij = _dropout_factor(xp, p, seed, np.arange(i0, i1), np.arange(j0, j1), dropout_batch0)
            acc = alpha * acc + (P_ij if Z_ij is None else P_ij * Z_ij) @ V[..., j0:j1, :]
            m = m_new
        seen = l > 0
        O[..., i0:i1, :] = acc / xp.where(seen, l, 1.0)
        lse[..., i0:i1, :] = xp.where(seen, m + xp.log(xp.where(seen, l, 1.0)), NEG_INF)
    return O.reshape(q.shape), lse.reshape(q.shape[:-1])


def tiled_attention_backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: bool = False, scale: float | None = None,
    block_q: int = 64, block_k: int = 64,
    *, window_size: Any = None, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None, mask: Any = None,
    bias: Any = None, bias_grad: bool = False, dropout_p: float = 0.0, dropout_seed: int | None = None,
    mask_mod: Any = None, score_mod: Any = None, score_mod_grad: Any = None, aux: Any = None, block_mask: Any = None,
    dropout_batch0: int = 0,
) -> tuple[Any, ...]:  # fmt: skip
    """FlashAttention-2's backward on tiles: Delta first, then an outer loop over K_j, V_j
    accumulating dK_j and dV_j, and an inner loop over Q_i accumulating into dQ (and, with ``bias_grad``,
    each tile's dS into dbias, summed over the bias's broadcast dims as the kernels' atomics do)."""
    _check_blocks(block_q, block_k)
    p = check_backward(do, q, k, v, o, lse, causal=causal, scale=scale, allow_float64=True, bias_grad=bias_grad,
                       **_variant_kwargs(window_size, softcap, alibi_slopes, sinks, mask, bias, dropout_p, mask_mod,
                                         score_mod, score_mod_grad, aux, block_mask))  # fmt: skip
    seed = _dropout_seed(dropout_p, dropout_seed)
    xp = _xp(p)
    Q, dO, O = (_grouped(x, p, p.hq, p.group) for x in (q, do, o))
    K, V = _grouped(k, p, p.hk, 1), _grouped(v, p, p.hk, 1)
    L = lse.astype(np.float64).reshape(*p.batch, p.hk, p.group, p.nq, 1)
    slopes = None if alibi_slopes is None else _per_head(alibi_slopes, p)
    Delta = (dO * O).sum(axis=-1, keepdims=True)
    arrays = (_score_array(mask, p), _score_array(bias, p))
    dbias = xp.zeros(bias.shape) if bias_grad else None
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
            if _tile_skipped(p, i0, i1, j0, j1):
                continue  # these queries see none of K_j; later Q_i may
            Q_i, dO_i = Q[..., i0:i1, :], dO[..., i0:i1, :]
            S_ij, raw = _scores(xp, Q_i, K_j, p, xp.arange(i0, i1), xp.arange(j0, j1), slopes, arrays)
            P_ij = _probabilities(xp, S_ij, L[..., i0:i1, :], xp.isfinite(S_ij))
            Z_ij = _dropout_factor(xp, p, seed, np.arange(i0, i1), np.arange(j0, j1), dropout_batch0)
            dV_j += (_t(P_ij if Z_ij is None else P_ij * Z_ij) @ dO_i).sum(axis=-3, keepdims=True)  # GQA: V_j shared
            dP_ij = dO_i @ _t(V_j)
            if Z_ij is not None:
                dP_ij = dP_ij * Z_ij
            dS_ij = P_ij * (dP_ij - Delta[..., i0:i1, :])
            if dbias is not None:
                _add_tile_dbias(xp, dbias, dS_ij, p, i0, i1, j0, j1)
            dS_ij = dS_ij * p.variant.dscore(xp, raw) * _twin_dscore(xp, p, S_ij, xp.arange(i0, i1), xp.arange(j0, j1))
            dQ[..., i0:i1, :] += p.scale * (dS_ij @ K_j)
            dK_j += p.scale * (_t(dS_ij) @ Q_i).sum(axis=-3, keepdims=True)
        dK[..., j0:j1, :] = dK_j
        dV[..., j0:j1, :] = dV_j
    grads = (dQ.reshape(q.shape), dK.reshape(k.shape), dV.reshape(v.shape))
    if sinks is not None:
        grads = (*grads, _dsinks(xp, L, Delta, sinks, p))
    return grads if dbias is None else (*grads, dbias)


def _add_tile_dbias(xp: Any, dbias: Any, dS_ij: Any, p: AttentionProblem, i0: int, i1: int, j0: int, j1: int) -> None:
    """Add one tile's dS (..., Hk, G, i1 - i0, j1 - j0) into dbias (the bias's shape), summing over the bias's
    broadcast dims: the tile's rows/cols land where the bias has them, or are summed where it has size 1."""
    acc = dbias.reshape((1,) * max(0, 2 - dbias.ndim) + dbias.shape)  # a view: at least (rows, cols)
    tile = dS_ij.reshape(*p.batch, p.hq, i1 - i0, j1 - j0)
    lead = tile.ndim - acc.ndim
    if lead:
        tile = tile.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, n in enumerate(acc.shape) if n == 1 and tile.shape[i] != 1)
    if axes:
        tile = tile.sum(axis=axes, keepdims=True)
    rows = slice(i0, i1) if acc.shape[-2] != 1 else slice(0, 1)
    cols = slice(j0, j1) if acc.shape[-1] != 1 else slice(0, 1)
    acc[..., rows, cols] += tile


# The linear-attention reference lives in its own module; it is part of this namespace too.
from .linear_reference import (  # noqa: E402, F401
    linear_attention,
    linear_attention_backward,
    linear_attention_forward,
    linear_attention_vjp,
)

# So does the KV-cache reference (decode with in-place append, paged caches) and the log-sum-exp merge.
from .kvcache_reference import attention_with_kvcache, merge_attention_states  # noqa: E402, F401
# Packed variable-length (varlen) batches: the dense reference per sequence, also in this namespace.
from .varlen_reference import (  # noqa: E402, F401
    attention_varlen,
    attention_varlen_backward,
    attention_varlen_forward,
    attention_varlen_vjp,
    tiled_attention_varlen_backward,
    tiled_attention_varlen_forward,
)
# Block masks from a mask_mod's Python twin (the same function: a callable runs in NumPy).
from .flex_block_mask import create_block_mask  # noqa: E402, F401
