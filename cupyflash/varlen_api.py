"""Packed variable-length batches (varlen, issue 14): FlashAttention's ``flash_attn_varlen_func`` layout.

B documents of different lengths are concatenated along the first axis instead of padded: q is
``(total_q, Hq, D)``, k and v are ``(total_k, Hk, D)``, and int32 ``cu_seqlens_q``/``cu_seqlens_k`` of shape
``(B + 1,)`` (cumulative lengths, from 0 to total) say where each sequence starts. Each sequence is its
own attention problem: it attends only to itself, causal and windows are bottom-right aligned per
sequence (its ``Nq_b``, ``Nk_b``), and an empty sequence is allowed.

The array type picks the backend as elsewhere: NumPy arrays run FlashAttention's tiled algorithm in
float64 NumPy per sequence and round once to the input dtype; CuPy arrays run the CUDA kernels
(``varlen_cuda``: one launch per pass for the whole pack, in every kernel family).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import varlen_cuda, varlen_reference  # varlen_cuda imports CuPy only when a call needs it
from .api import NUMPY_BLOCK, _check_kernel, _is_cupy, _numpy_kernel, _with_seed
from .validation import check_dropout, check_flag
from .varlen_validation import check_varlen, check_varlen_backward


def _check_validate(validate: Any) -> None:
    if not isinstance(validate, (bool, np.bool_)):
        raise TypeError(f"validate must be a bool; got {type(validate).__name__}")


def attention_varlen_forward(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool = False, scale: float | None = None, *, window_size: tuple[int, int] | None = None,
    softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None, seqused_k: Any = None,
    dropout_p: float = 0.0, dropout_seed: int | None = None, kernel: str = "auto", validate: bool = False,
) -> tuple[Any, Any]:  # fmt: skip
    """Softmax attention of B packed sequences, each attending only to itself; ``(o, lse)``.

    Args:
        q: ``(total_q, Hq, D)``; k, v: ``(total_k, Hk, D)`` with ``Hq % Hk == 0`` (GQA/MQA as in
            ``attention_forward``). float32, float16 or bfloat16, all the same; all NumPy or all CuPy
            (strided views accepted).
        cu_seqlens_q, cu_seqlens_k: int32 ``(B + 1,)``, B >= 1, of q's array library: sequence b owns q rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` and k/v rows ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``.
            Non-decreasing, from 0 to total_q / total_k. Their values are the caller's contract (reading
            them on the device would cost a synchronisation): ``validate=True`` checks them; whatever they
            hold, nothing outside the arrays is read or written.
        max_seqlen_q, max_seqlen_k: Python ints, at least every sequence's length (they size the grid on
            the device without a device-to-host copy).
        causal: mask key j for query i of sequence b when ``j > i + Nk_b - Nq_b`` (bottom-right aligned per
            sequence, FlashAttention >= 2.1).
        scale: the softmax scale; ``1/sqrt(D)`` when None.
        window_size: ``(left, right)``, ``-1`` (or None) = unbounded: key j of sequence b is visible to its
            query i iff ``i + Nk_b - Nq_b - left <= j <= i + Nk_b - Nq_b + right``.
        softcap: ``s = softcap * tanh(s / softcap)`` on the scaled score; 0 = off.
        alibi_slopes: float32 ``(Hq,)`` or ``(B, Hq)`` (per sequence): ``s -= slope * |i + Nk_b - Nq_b - j|``.
        sinks: float32 ``(Hq,)``: a learnable logit per head in every row's softmax denominator.
        seqused_k: optional int32 ``(B,)``: only the first ``seqused_k[b]`` keys of sequence b are used
            (``Nk_b = seqused_k[b]``; a KV cache with room to spare). The others are never read.
        dropout_p, dropout_seed: attention dropout as in ``attention_forward`` (``dropout_seed`` required when
            ``dropout_p > 0``); sequence b's keep mask is ``cupyflash.dropout_mask``'s for batch index b, rows
            and columns counted within the sequence. Pass the same pair to the backward.
        kernel: ``"auto"``, ``"wgmma"``, ``"mma"`` or ``"portable"`` as in ``attention_forward`` (every
            family runs packed batches; one that cannot run the call raises ``TypeError`` with why).
        validate: check the values of cu_seqlens, seqused_k and max_seqlen_* on the device first (one
            synchronisation; for debugging) and raise ``ValueError`` naming what is wrong. The NumPy
            backend always checks them (it reads them anyway).

    Returns:
        ``o`` (q's shape and dtype) and ``lse`` (float32 ``(Hq, total_q)``, FlashAttention's varlen layout;
        ``-inf`` for a row that sees no key, whose output is 0).

    Raises ``TypeError`` / ``ValueError`` naming the argument before anything is launched.
    """
    _check_kernel(kernel)
    _check_validate(validate)
    _, seed = check_dropout(dropout_p, dropout_seed)
    variant = {"window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes, "sinks": sinks,
               "dropout_p": dropout_p}  # fmt: skip
    if _is_cupy(q):  # checked there, once per call signature
        return varlen_cuda.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                   kernel, bool(validate), seqused_k, dropout_seed=seed, **variant)  # fmt: skip
    p = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=scale,
                     seqused_k=seqused_k, **variant)  # fmt: skip
    _numpy_kernel(kernel)
    o, lse = varlen_reference.tiled_attention_varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, p.dense.scale, NUMPY_BLOCK,
        NUMPY_BLOCK, seqused_k=seqused_k, dropout_seed=seed, **variant)  # fmt: skip
    return o.astype(p.dense.dtype), lse.astype(np.float32)


def attention_varlen(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool = False, scale: float | None = None, **keywords: Any,
) -> Any:  # fmt: skip
    """Output ``o`` only; arguments as in ``attention_varlen_forward``, except that with ``dropout_p > 0`` and no
    ``dropout_seed`` a seed is drawn (``draw_seed``)."""
    return attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                    scale, **_with_seed(q, keywords))[0]  # fmt: skip


def attention_varlen_backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int,
    max_seqlen_k: int, causal: bool = False, scale: float | None = None, *,
    window_size: tuple[int, int] | None = None, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None,
    seqused_k: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None, kernel: str = "auto",
    validate: bool = False, deterministic: bool = False,
) -> tuple[Any, ...]:  # fmt: skip
    """Gradients ``(dq, dk, dv)`` of ``attention_varlen`` for the output gradient ``do``; with ``sinks`` also
    ``dsinks`` (float32 ``(Hq,)``, summed over every sequence and row).

    ``o`` and ``lse`` (``(Hq, total_q)``) are the forward's outputs for the same arguments; ``do`` has q's
    shape and dtype. dk and dv have k's and v's shapes: each sequence's keys get gradients from its own
    queries only (summed over each GQA group), and keys past ``seqused_k[b]`` get zeros. The other
    arguments as in ``attention_varlen_forward``; the variant and dropout keywords must be the forward's.

    ``deterministic=True`` makes the CUDA backward bitwise reproducible from run to run, as in
    ``attention_backward``: each sequence's key tiles add into its dQ in a fixed order, and dsinks is summed
    without atomics. The NumPy backend is always deterministic.
    """
    _check_kernel(kernel)
    _check_validate(validate)
    check_flag("deterministic", deterministic)
    _, seed = check_dropout(dropout_p, dropout_seed)
    variant = {"window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes, "sinks": sinks,
               "dropout_p": dropout_p}  # fmt: skip
    if _is_cupy(q):  # checked there, once per call signature
        return varlen_cuda.backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal, scale, kernel, bool(validate), seqused_k,
                                    deterministic=bool(deterministic), dropout_seed=seed, **variant)  # fmt: skip
    p = check_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal=causal, scale=scale, seqused_k=seqused_k, **variant)  # fmt: skip
    _numpy_kernel(kernel)
    grads = varlen_reference.tiled_attention_varlen_backward(
        do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, p.dense.scale,
        NUMPY_BLOCK, NUMPY_BLOCK, seqused_k=seqused_k, dropout_seed=seed, **variant)  # fmt: skip
    out = tuple(g.astype(p.dense.dtype) for g in grads[:3])
    return out if sinks is None else (*out, grads[3].astype(np.float32))


def attention_varlen_vjp(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: int, max_seqlen_k: int,
    causal: bool = False, scale: float | None = None, **keywords: Any,
) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:  # fmt: skip
    """``o`` and ``vjp(do) -> (dq, dk, dv)`` (``+ dsinks`` with sinks); keywords as in
    ``attention_varlen_forward`` plus ``deterministic`` for the backward. Only o and lse stay alive in between.
    With ``dropout_p > 0`` and no ``dropout_seed`` a seed is drawn (``draw_seed``) and the backward uses the same
    one."""
    deterministic = check_flag("deterministic", keywords.pop("deterministic", False))
    keywords = _with_seed(q, keywords)
    o, lse = attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                      scale, **keywords)  # fmt: skip

    def vjp(do: Any) -> tuple[Any, ...]:
        return attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, causal, scale, deterministic=deterministic,
                                         **keywords)  # fmt: skip

    return o, vjp
