"""Public functions. The array type picks the backend: CuPy arrays run the CUDA kernels on the current
device and stream (``cuda_backend``), NumPy arrays run the float64 reference and round once to the
input dtype."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import cuda_backend, reference  # cuda_backend imports CuPy only when a call needs it
from .validation import array_kind, check_attention, check_backward, check_dropout, check_flag

Kernel = str  # "auto", "wgmma", "mma" or "portable" (kernels.dispatch.KERNELS)
KERNELS = ("auto", "wgmma", "mma", "portable")


def _check_kernel(kernel: Kernel) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")


def _is_cupy(x: Any) -> bool:
    return array_kind("q", x) == "cupy"


def _numpy_kernel(kernel: Kernel) -> None:
    """A named family is a CUDA kernel family: with NumPy arrays that is a mistake, not a hint to ignore."""
    if kernel != "auto":
        raise TypeError(f"kernel={kernel!r} names a CUDA kernel family; NumPy arrays run the NumPy backend "
                        "(pass CuPy arrays, or leave kernel='auto')")  # fmt: skip


#: The NumPy backend's tiles: FlashAttention's algorithm in float64 NumPy, so memory stays O(N) (a few
#: (..., 512, 512) tiles at a time) instead of the (..., Nq, Nk) score matrix.
NUMPY_BLOCK = 512


def attention_forward(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, *,
    window_size: tuple[int, int] | None = None, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None,
    mask: Any = None, bias: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
    mask_mod: Any = None, score_mod: Any = None, score_mod_grad: Any = None, aux: Any = None, block_mask: Any = None,
    kernel: Kernel = "auto",
) -> tuple[Any, Any]:  # fmt: skip
    """Softmax attention ``o = softmax(scale * q @ k^T) @ v`` and ``lse``, each row's log-sum-exp.

    Args:
        q: ``(..., Hq, Nq, D)``; k, v: ``(..., Hk, Nk, D)`` with ``Hq % Hk == 0`` (GQA/MQA: query head h
            reads key/value head ``h // (Hq // Hk)``); leading dims are batch dims and must match.
            float32, float16 or bfloat16, all the same; CuPy arrays (CUDA kernels on the current device
            and stream; strided views such as a ``(B, N, H, D)`` array seen as ``(B, H, N, D)`` are read
            in place) or NumPy arrays (FlashAttention's tiled algorithm in float64 NumPy, O(N) memory; for
            float64 inputs use ``cupyflash.reference``), not mixed.
        causal: mask key j for query i when ``j > i + Nk - Nq`` (bottom-right aligned, FlashAttention >= 2.1).
        scale: the softmax scale; ``1/sqrt(D)`` when None.
        window_size: ``(left, right)``, ``-1`` (or None) = unbounded on that side: key j is visible to query i
            iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (sliding window); with ``causal``, right = 0.
        softcap: ``s = softcap * tanh(s / softcap)`` on the scaled score (Gemma 2); 0 = off.
        alibi_slopes: float32 ``(Hq,)`` or ``(*batch, Hq)``: ``s -= slope[h] * |i + Nk - Nq - j|`` (ALiBi).
        sinks: float32 ``(Hq,)``: a learnable logit per head in every row's softmax denominator (a key with
            value 0; GPT-OSS). lse includes it, so a row that sees no key still has lse = sink and o = 0.
        mask: bool array broadcastable to ``(*batch, Hq, Nq, Nk)``, True = may attend (SDPA's convention),
            ANDed with causal/window; read through its strides (a broadcast mask is never expanded).
        bias: float32/float16/bfloat16 array broadcastable to ``(*batch, Hq, Nq, Nk)``, added to the score
            after softcap and ALiBi (before the masks); read through its strides like ``mask``.
            Scores are formed as scale -> softcap -> ALiBi -> bias -> window/causal mask and mask -> softmax
            (with the sink).
        dropout_p: attention dropout in [0, 1): after the softmax each probability is kept with probability
            ``1 - p_eff`` and scaled by ``1 / (1 - p_eff)``; lse stays that of the undropped softmax. The keep
            test compares 8-bit random numbers (FlashAttention-2's precision), so ``p_eff =
            cupyflash.effective_dropout_p(dropout_p) = round(dropout_p * 256) / 256`` (at most 255/256; below
            1/512 nothing is dropped): 0.1 drops 26/256 = 0.1016. The scaling uses p_eff, so the expectation is
            exact.
        dropout_seed: an int in [0, 2**64), required when ``dropout_p > 0``: the keep mask is Philox4x32-10
            keyed by (seed, batch, head, i, j) (``cupyflash.dropout_mask`` returns it), so the backward given
            the same seed regenerates it. ``attention`` and ``attention_vjp`` draw one when none is given.
        mask_mod: a CUDA C++ expression of ``(b, h, q_idx, kv_idx)``, true where the query may attend the key
            (or a small function body with ``return``), compiled into the kernels on first use and ANDed with
            causal/window (FlexAttention's mask_mod). ``b`` is the batch index (leading dims flattened), ``h`` the
            query head. With NumPy arrays, a Python callable on broadcast index arrays instead.
        score_mod: a CUDA C++ expression (or body) of ``(score, b, h, q_idx, kv_idx)``: the new score (natural
            units), applied after softcap and ALiBi and before the masks. NumPy arrays: a Python callable.
        score_mod_grad: d(new score)/d(score), an expression of ``(new_score, b, h, q_idx, kv_idx)``; needed by the
            backward when score_mod is given. NumPy arrays: a Python callable.
        aux: ``{"name": array or Python scalar}`` that snippets read by name: a scalar as a ``bool``/``int``/
            ``float`` constant (a run-time value), an array of 1-4 dims as ``name(i, j, ...)`` (float for float
            dtypes; an index outside the array reads 0). Snippets may also read ``Nq`` and ``Nk``. See
            ``cupyflash.flex`` for every name and the errors (``SnippetError``).
        block_mask: ``cupyflash.create_block_mask(mask_mod, ...)``'s result for this mask_mod and shape: key tiles
            it marks empty are skipped.
        kernel: ``"auto"`` (the fastest family that can run the call), or ``"wgmma"`` (Hopper, fp16/bf16,
            32 < D <= 128), ``"mma"`` (sm_80+, fp16/bf16), ``"portable"`` (any dtype and GPU); a family
            that cannot run the call raises ``TypeError`` with its reason.

    Returns:
        ``o`` (q's shape and dtype) and ``lse`` (float32, q's shape without D, natural log of the scaled
        scores; ``-inf`` for a row that sees no key, whose output is 0).

    Raises ``TypeError`` / ``ValueError`` naming the argument before anything is launched.
    """
    if (window_size is None and alibi_slopes is None and sinks is None and mask is None and bias is None
            and dropout_seed is None and mask_mod is None and score_mod is None and score_mod_grad is None
            and aux is None and block_mask is None and type(softcap) is float and not softcap
            and type(dropout_p) is float and not dropout_p and type(kernel) is str and kernel == "auto"):  # fmt: skip
        # A plain call (every variant keyword at its default) of a cached signature: the keyword checks passed when
        # the signature was cached, and plain_forward says why that is the full path's answer (issue 12).
        out = cuda_backend.plain_forward(q, k, v, causal, scale)
        if out is not None:
            return out
    _check_kernel(kernel)
    _, seed = check_dropout(dropout_p, dropout_seed)
    variant = {"window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes, "sinks": sinks,
               "mask": mask, "bias": bias, "dropout_p": dropout_p, "mask_mod": mask_mod, "score_mod": score_mod,
               "score_mod_grad": score_mod_grad, "aux": aux, "block_mask": block_mask}  # fmt: skip
    if _is_cupy(q):
        return cuda_backend.forward(q, k, v, causal, scale, kernel, dropout_seed=seed, **variant)
    p = check_attention(q, k, v, causal=causal, scale=scale, **variant)
    _numpy_kernel(kernel)
    o, lse = reference.tiled_attention_forward(q, k, v, causal, p.scale, NUMPY_BLOCK, NUMPY_BLOCK, dropout_seed=seed,
                                               **variant)  # fmt: skip
    return o.astype(p.dtype), lse.astype(np.float32)


def attention(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, **keywords: Any) -> Any:
    """Softmax attention output ``o`` only; arguments as in ``attention_forward``, except that with
    ``dropout_p > 0`` and no ``dropout_seed`` a seed is drawn (``draw_seed``)."""
    return attention_forward(q, k, v, causal, scale, **_with_seed(q, keywords))[0]


def draw_seed(like: Any) -> int:
    """A dropout seed from the global generator of ``like``'s library: CuPy's (``cupy.random``, which costs one
    device-to-host copy) for CuPy arrays, NumPy's for NumPy arrays. Seed those generators to reproduce it."""
    if _is_cupy(like):
        import cupy

        hi, lo = (int(x) for x in cupy.random.randint(0, 1 << 31, size=2, dtype=np.int64).get())
    else:
        hi, lo = (int(x) for x in np.random.randint(0, 1 << 31, size=2, dtype=np.int64))
    return (hi << 31) | lo


def _with_seed(q: Any, keywords: dict[str, Any]) -> dict[str, Any]:
    """``keywords`` with a drawn dropout_seed where dropout is asked for without one."""
    p, seed = check_dropout(keywords.get("dropout_p", 0.0), keywords.get("dropout_seed"), need_seed=False)
    if p > 0 and seed is None:
        return {**keywords, "dropout_seed": draw_seed(q)}
    return keywords


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
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    mask: Any = None,
    bias: Any = None,
    bias_grad: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    score_mod_grad: Any = None,
    aux: Any = None,
    block_mask: Any = None,
    kernel: Kernel = "auto",
    deterministic: bool = False,
) -> tuple[Any, ...]:
    """Gradients ``(dq, dk, dv)`` of ``attention`` for the output gradient ``do``; with ``sinks`` also
    ``dsinks`` (float32, ``(Hq,)``, summed over batch and rows); with ``bias_grad=True`` (which needs a
    ``bias``) last ``dbias``, the gradient of the bias in its own shape and dtype (summed over the dims it
    broadcasts along).

    ``o`` and ``lse`` are the forward's outputs for the same q, k, v, causal and scale; ``do`` has
    q's shape and dtype. The attention matrix is recomputed tile by tile (FlashAttention's
    backward), so memory stays O(N). dk and dv have k's and v's shapes: under GQA each sums over its
    group of query heads. The variant keywords must be those of the forward that made o and lse (its lse
    includes the sinks: that is how the backward knows each row's sink share); so must ``dropout_p`` and
    ``dropout_seed`` (the mask is regenerated from them, never stored). ``kernel`` as in
    ``attention_forward`` (any family's backward runs on any family's forward output).

    ``deterministic=True`` makes the CUDA backward bitwise reproducible from run to run (any stream, GQA and
    causal included): every family adds each key tile's dQ share in key-tile order (ordered turns), and
    dsinks is summed without atomics. The NumPy backend is always deterministic.
    """
    if (window_size is None and alibi_slopes is None and sinks is None and mask is None and bias is None
            and bias_grad is False and dropout_seed is None and mask_mod is None and score_mod is None
            and score_mod_grad is None and aux is None and block_mask is None and type(softcap) is float
            and not softcap and type(dropout_p) is float and not dropout_p and type(kernel) is str
            and kernel == "auto" and deterministic is False):  # fmt: skip
        out = cuda_backend.plain_backward(do, q, k, v, o, lse, causal, scale)  # as in attention_forward
        if out is not None:
            return out
    _check_kernel(kernel)
    check_flag("deterministic", deterministic)
    _, seed = check_dropout(dropout_p, dropout_seed)
    variant = {"window_size": window_size, "softcap": softcap, "alibi_slopes": alibi_slopes, "sinks": sinks,
               "mask": mask, "bias": bias, "dropout_p": dropout_p, "mask_mod": mask_mod, "score_mod": score_mod,
               "score_mod_grad": score_mod_grad, "aux": aux, "block_mask": block_mask}  # fmt: skip
    if _is_cupy(q):
        return cuda_backend.backward(do, q, k, v, o, lse, causal, scale, kernel, bias_grad=bias_grad,
                                     deterministic=deterministic, dropout_seed=seed, **variant)  # fmt: skip
    p = check_backward(do, q, k, v, o, lse, causal=causal, scale=scale, bias_grad=bias_grad, **variant)
    _numpy_kernel(kernel)
    grads = reference.tiled_attention_backward(do, q, k, v, o, lse, causal, p.scale, NUMPY_BLOCK, NUMPY_BLOCK,
                                               bias_grad=bias_grad, dropout_seed=seed, **variant)  # fmt: skip
    out = tuple(g.astype(p.dtype) for g in grads[:3])
    if sinks is not None:
        out = (*out, grads[3].astype(np.float32))
    return out if not bias_grad else (*out, grads[-1].astype(bias.dtype))


def attention_vjp(
    q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None, **keywords: Any
) -> tuple[Any, Callable[[Any], tuple[Any, ...]]]:
    """``o`` and a function ``vjp(do) -> (dq, dk, dv)`` (``+ dsinks`` with sinks, ``+ dbias`` with
    ``bias_grad=True``); keywords as in ``attention_forward`` plus ``bias_grad`` and ``deterministic`` for the
    backward (see ``attention_backward``). Only o and lse stay alive in between. With ``dropout_p > 0`` and no
    ``dropout_seed`` a seed is drawn (``draw_seed``) and the backward uses the same one."""
    if keywords.get("bias_grad") and keywords.get("bias") is None:  # say so before the forward runs
        raise ValueError("bias_grad=True needs a bias (the gradient is that of the bias argument)")
    if keywords.get("score_mod") is not None and keywords.get("score_mod_grad") is None:
        raise ValueError("attention_vjp with score_mod needs score_mod_grad (the backward's d(new score)/d(score))")
    deterministic = check_flag("deterministic", keywords.pop("deterministic", False))
    keywords = _with_seed(q, keywords)
    forward_keywords = {n: x for n, x in keywords.items() if n != "bias_grad"}
    o, lse = attention_forward(q, k, v, causal, scale, **forward_keywords)

    def vjp(do: Any) -> tuple[Any, ...]:
        return attention_backward(do, q, k, v, o, lse, causal, scale, deterministic=deterministic, **keywords)

    return o, vjp
