"""The float64 reference of packed variable-length (varlen) attention, issue 14.

A pack of B sequences is B independent attention problems, so the reference is the dense reference run
once per sequence: sequence b's queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` attend to its keys
``k[cu_seqlens_k[b]:cu_seqlens_k[b] + Nk_b]`` (``Nk_b`` = the sequence's length, or ``seqused_k[b]``), with
causal and windows bottom-right aligned per sequence (``Nq_b``, ``Nk_b``). Keys past ``seqused_k[b]``
are not read and get zero gradients. An empty sequence is allowed (a query sequence with no key gives
o = 0 and lse = -inf, or the sink).

With dropout, sequence b's keep mask is the dense rule's for batch index b, with rows and columns counted
within the sequence (``cupyflash.dropout_mask``'s ``[b]`` entry for the sequence's own lengths), as the kernels
key it.

``attention_varlen_*`` run the plain reference per sequence, ``tiled_attention_varlen_*`` the tiled
(FlashAttention) one. Inputs are packed ``(total, H, D)``; lse is ``(Hq, total_q)``. The values of
cu_seqlens/seqused_k are read on the host and checked (``check_varlen_values``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from . import reference as _dense
from .validation import check_dropout
from .varlen_validation import VarlenProblem, check_varlen, check_varlen_backward, check_varlen_values

NEG_INF = -np.inf


def _xp(p: VarlenProblem) -> Any:
    if p.xp == "numpy":
        return np
    import cupy

    return cupy


def _host(x: Any) -> list[int]:
    return (x.get() if hasattr(x, "get") else np.asarray(x)).tolist()


def _sequences(p: VarlenProblem, cu_seqlens_q: Any, cu_seqlens_k: Any, seqused_k: Any) -> Iterator[tuple]:
    """(b, query rows slice, used key rows slice) of every sequence, after checking the packing."""
    check_varlen_values(_xp(p), p, cu_seqlens_q, cu_seqlens_k, seqused_k)
    cq, ck = _host(cu_seqlens_q), _host(cu_seqlens_k)
    used = None if seqused_k is None else _host(seqused_k)
    for b in range(p.batch_size):
        nk = ck[b + 1] - ck[b] if used is None else used[b]
        yield b, slice(cq[b], cq[b + 1]), slice(ck[b], ck[b] + nk)


def _seq(x: Any, rows: slice) -> Any:
    """Rows of a packed (total, H, D) array as the dense layout (H, N, D) (a view)."""
    return x[rows].transpose(1, 0, 2)


def _slopes_of(alibi_slopes: Any, b: int) -> Any:
    if alibi_slopes is None or alibi_slopes.ndim == 1:
        return alibi_slopes
    return alibi_slopes[b]


def _dropout_of(dropout_p: Any, dropout_seed: Any, b: int) -> dict[str, Any]:
    """The dense reference's dropout keywords for sequence b (none without dropout)."""
    if not dropout_p:
        return {}
    return {"dropout_p": dropout_p, "dropout_seed": dropout_seed, "dropout_batch0": b}


def _forward(fwd: Callable[..., tuple[Any, Any]], q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
             max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float | None, window_size: Any,
             softcap: float, alibi_slopes: Any, sinks: Any, seqused_k: Any, dropout_p: Any = 0.0,
             dropout_seed: Any = None) -> tuple[Any, Any]:  # fmt: skip
    p = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=scale,
                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                     seqused_k=seqused_k, allow_float64=True, dropout_p=dropout_p)  # fmt: skip
    check_dropout(dropout_p, dropout_seed)  # the seed too, before any sequence runs
    xp = _xp(p)
    o = xp.zeros(q.shape)
    lse = xp.full((p.dense.hq, p.total_q), NEG_INF)
    for b, qr, kr in _sequences(p, cu_seqlens_q, cu_seqlens_k, seqused_k):
        o_b, lse_b = fwd(_seq(q, qr), _seq(k, kr), _seq(v, kr), causal, p.dense.scale, window_size=window_size,
                         softcap=softcap, alibi_slopes=_slopes_of(alibi_slopes, b), sinks=sinks,
                         **_dropout_of(dropout_p, dropout_seed, b))  # fmt: skip
        o[qr] = o_b.transpose(1, 0, 2)
        lse[:, qr] = lse_b
    return o, lse


def _backward(bwd: Callable[..., tuple[Any, ...]], do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any,
              cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
              scale: float | None, window_size: Any, softcap: float, alibi_slopes: Any, sinks: Any,
              seqused_k: Any, dropout_p: Any = 0.0, dropout_seed: Any = None) -> tuple[Any, ...]:  # fmt: skip
    p = check_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                              alibi_slopes=alibi_slopes, sinks=sinks, seqused_k=seqused_k,
                              allow_float64=True, dropout_p=dropout_p)  # fmt: skip
    check_dropout(dropout_p, dropout_seed)
    xp = _xp(p)
    dq, dk, dv = xp.zeros(q.shape), xp.zeros(k.shape), xp.zeros(v.shape)  # unused keys keep 0
    dsinks = None if sinks is None else xp.zeros(sinks.shape)
    for b, qr, kr in _sequences(p, cu_seqlens_q, cu_seqlens_k, seqused_k):
        grads = bwd(_seq(do, qr), _seq(q, qr), _seq(k, kr), _seq(v, kr), _seq(o, qr), lse[:, qr], causal,
                    p.dense.scale, window_size=window_size, softcap=softcap,
                    alibi_slopes=_slopes_of(alibi_slopes, b), sinks=sinks,
                    **_dropout_of(dropout_p, dropout_seed, b))  # fmt: skip
        dq[qr] = grads[0].transpose(1, 0, 2)
        dk[kr] = grads[1].transpose(1, 0, 2)
        dv[kr] = grads[2].transpose(1, 0, 2)
        if dsinks is not None:
            dsinks += grads[3]
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


# ---------------------------------------------------------------------------- plain


def attention_varlen_forward(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool = False, scale: float | None = None, *, window_size: Any = None, softcap: float = 0.0,
    alibi_slopes: Any = None, sinks: Any = None, seqused_k: Any = None, dropout_p: float = 0.0,
    dropout_seed: int | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """(o, lse) in float64: o ``(total_q, Hq, D)``, lse ``(Hq, total_q)``; the plain reference per sequence.

    ``alibi_slopes`` is float32 ``(Hq,)`` or ``(B, Hq)`` (one row per sequence); the rest as in
    ``cupyflash.attention_varlen_forward``."""
    return _forward(_dense.attention_forward, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    causal, scale, window_size, softcap, alibi_slopes, sinks, seqused_k, dropout_p,
                    dropout_seed)  # fmt: skip


def attention_varlen_backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool = False, scale: float | None = None, *, window_size: Any = None,
    softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None, seqused_k: Any = None,
    dropout_p: float = 0.0, dropout_seed: int | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    """(dq, dk, dv) in float64 (+ dsinks ``(Hq,)`` summed over every sequence with sinks); the plain
    reference's backward per sequence. Keys past ``seqused_k[b]`` get zero gradients."""
    return _backward(_dense.attention_backward, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, causal, scale, window_size, softcap, alibi_slopes, sinks, seqused_k, dropout_p,
                     dropout_seed)  # fmt: skip


def attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
                     max_seqlen_k: int, causal: bool = False, scale: float | None = None, **keywords: Any) -> Any:
    """Output only; see ``attention_varlen_forward``."""
    return attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    scale, **keywords)[0]  # fmt: skip


def attention_varlen_vjp(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool = False, scale: float | None = None, **keywords: Any,
) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:  # fmt: skip
    """o (float64) and ``vjp(do) -> (dq, dk, dv[, dsinks])``."""
    o, lse = attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      scale, **keywords)  # fmt: skip

    def vjp(do: Any) -> tuple[Any, ...]:
        return attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, causal, scale, **keywords)  # fmt: skip

    return o, vjp


# ---------------------------------------------------------------------------- tiled (FlashAttention)


def tiled_attention_varlen_forward(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool = False, scale: float | None = None, block_q: int = 64, block_k: int = 64, *,
    window_size: Any = None, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None,
    seqused_k: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
) -> tuple[Any, Any]:  # fmt: skip
    """``attention_varlen_forward`` with FlashAttention's tiled forward per sequence (Br x Bc tiles that
    start at each sequence's first row, as the kernels' tiles do)."""

    def fwd(*args: Any, **kw: Any) -> tuple[Any, Any]:
        return _dense.tiled_attention_forward(*args, block_q=block_q, block_k=block_k, **kw)

    _dense._check_blocks(block_q, block_k)
    return _forward(fwd, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                    window_size, softcap, alibi_slopes, sinks, seqused_k, dropout_p, dropout_seed)  # fmt: skip


def tiled_attention_varlen_backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool = False, scale: float | None = None, block_q: int = 64, block_k: int = 64,
    *, window_size: Any = None, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None,
    seqused_k: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
) -> tuple[Any, ...]:  # fmt: skip
    """``attention_varlen_backward`` with FlashAttention-2's tiled backward per sequence."""

    def bwd(*args: Any, **kw: Any) -> tuple[Any, ...]:
        return _dense.tiled_attention_backward(*args, block_q=block_q, block_k=block_k, **kw)

    _dense._check_blocks(block_q, block_k)
    return _backward(bwd, do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                     scale, window_size, softcap, alibi_slopes, sinks, seqused_k, dropout_p, dropout_seed)  # fmt: skip
