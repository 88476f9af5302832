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
from .variants import Variant, check_finite_nonneg

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
    variant: Variant  # mask and score rule: the C++ policy, the reference's rule, grid order
    scale: float
    xp: str  # "numpy" or "cupy"
    # Varlen (issue 14): packed row counts, None for a dense call. A varlen kernel problem has batch (B,) =
    # the sequences and nq, nk = max_seqlen_q/k (the grid's extent); kernels read each sequence's own.
    total_q: int | None = None
    total_k: int | None = None

    @property
    def varlen(self) -> bool:
        return self.total_q is not None

    @property
    def causal(self) -> bool:
        return self.variant.causal

    @property
    def group(self) -> int:
        """Query heads per key/value head (1: MHA, hq: MQA)."""
        return self.hq // self.hk

    @property
    def batch_size(self) -> int:
        return math.prod(self.batch)


def array_kind(name: str, x: Any) -> str:
    """'numpy' or 'cupy' for an array argument; TypeError for anything else."""
    t = type(x)
    if t is np.ndarray:
        return "numpy"
    if t.__name__ == "ndarray" and t.__module__ == "cupy":  # the exact types first: a call checks this per array
        return "cupy"
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = t.__module__
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
            hint = (" (NumPy's default: convert with .astype(numpy.float32), or use cupyflash.reference, which "
                    "computes in float64)") if dt == np.float64 else ""
            raise TypeError(f"{name}.dtype must be one of {names}; got {dt}{hint}")
    elif dt != want:
        raise TypeError(f"{name}.dtype must equal q.dtype ({want}); got {dt}")
    return dt


def _check_window(window_size: Any) -> tuple[int, int] | None:
    if window_size is None:
        return None
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right) of ints (-1: unbounded); got {window_size!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if w is None:
            w = -1
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)):
            raise TypeError(f"window_size {side} must be an int (-1: unbounded); got {w!r}")
        if w < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1: unbounded); got {w}")
        out.append(int(w))
    return out[0], out[1]


def _check_head_vector(name: str, x: Any, xp: str, batch: tuple[int, ...], hq: int, batched: bool) -> None:
    """A float32 per-head array: (Hq,) or, when ``batched``, (*batch, Hq); contiguous; q's array library."""
    kind = array_kind(name, x)
    if kind != xp:
        raise TypeError(f"{name} must be a {xp} array like q (no implicit copies); got a {kind} array")
    if np.dtype(x.dtype) != _dtypes.FLOAT32:
        raise TypeError(f"{name}.dtype must be float32; got {x.dtype}")
    shapes = [(hq,)] + ([(*batch, hq)] if batched and batch else [])
    if tuple(x.shape) not in shapes:
        want = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name} must have shape {want} (Hq = {hq}); got {tuple(x.shape)}")
    if x.size and x.strides[-1] != x.itemsize or (x.ndim > 1 and not _c_contiguous(x)):
        raise ValueError(f"{name} must be contiguous; got strides {x.strides}")


def _check_score_array(name: str, x: Any, xp: str, full: tuple[int, ...], dtypes: tuple[np.dtype, ...]) -> None:
    """A mask or bias: ``xp``'s array kind, one of ``dtypes``, broadcastable to ``full`` = (*batch, Hq, Nq, Nk)
    (NumPy's rule: trailing dims line up, each 1 or equal)."""
    kind = array_kind(name, x)
    if kind != xp:
        raise TypeError(f"{name} must be a {xp} array like q (no implicit copies); got a {kind} array")
    if np.dtype(x.dtype) not in dtypes:
        raise TypeError(f"{name}.dtype must be {' or '.join(str(d) for d in dtypes)}; got {x.dtype}")
    shape = tuple(x.shape)
    ok = len(shape) <= len(full) and all(n in (1, m) for n, m in zip(reversed(shape), reversed(full)))
    if not ok:
        raise ValueError(f"{name} must broadcast to (*batch, Hq, Nq, Nk) = {full}; got shape {shape}")
    # Kernels address one (b, h) slice's (q, k) elements with 32-bit offsets (and dbias is contiguous there).
    tail = [(n, abs(st) // x.itemsize) for n, st in zip(shape[-2:], x.strides[-2:])]
    if sum((n - 1) * st for n, st in tail) >= 2**31 or math.prod(n for n, _ in tail) >= 2**31:
        raise ValueError(f"{name}'s (Nq, Nk) slice must span fewer than 2**31 elements; got shape {shape}, "
                         f"strides {x.strides}")  # fmt: skip


def score_shape(p: "AttentionProblem") -> tuple[int, ...]:
    """(*batch, Hq, Nq, Nk): the shape masks and biases broadcast to."""
    return (*p.batch, p.hq, p.nq, p.nk)


def _c_contiguous(x: Any) -> bool:
    step = x.itemsize
    for n, st in zip(reversed(x.shape), reversed(x.strides)):
        if n > 1 and st != step:
            return False
        step *= n
    return True


def check_builtin_variant(causal: Any, scale: Any, d: int, window_size: Any, softcap: Any, alibi_slopes: Any,
                          sinks: Any, xp: str, batch: tuple[int, ...], hq: int) -> tuple[float, Any, float]:  # fmt: skip
    """The keywords every attention entry point shares (dense, varlen, KV cache): causal, scale (1/sqrt(D) when
    None), window_size, softcap, ALiBi slopes and sinks for ``batch`` x ``hq`` heads. Returns (scale, window,
    softcap)."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a real number or None; got {type(scale).__name__}")
    elif not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite; got {scale}")
    window = _check_window(window_size)
    cap = check_finite_nonneg("softcap", softcap)
    if alibi_slopes is not None:
        _check_head_vector("alibi_slopes", alibi_slopes, xp, batch, hq, batched=True)
    if sinks is not None:
        _check_head_vector("sinks", sinks, xp, batch, hq, batched=False)
    return scale, window, cap


def check_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    window_size: Any = None,
    softcap: Any = 0.0,
    alibi_slopes: Any = None,
    sinks: Any = None,
    mask: Any = None,
    bias: Any = None,
    dropout_p: Any = 0.0,
    mask_mod: Any = None,
    score_mod: Any = None,
    score_mod_grad: Any = None,
    aux: Any = None,
    block_mask: Any = None,
    allow_float64: bool = False,
) -> AttentionProblem:
    """Check q (..., Hq, Nq, D), k and v (..., Hk, Nk, D) and the variant keywords; describe the problem.

    ``allow_float64`` is for the NumPy reference, which also takes float64 inputs (and float64 biases).
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
    scale, window, cap = check_builtin_variant(causal, scale, d, window_size, softcap, alibi_slopes, sinks, xp,
                                               tuple(batch), hq)  # fmt: skip
    full = (*batch, hq, nq, k.shape[-2])
    if mask is not None:
        _check_score_array("mask", mask, xp, full, (np.dtype(np.bool_),))
    bias_type = None
    if bias is not None:
        ok = _dtypes.SUPPORTED + ((np.dtype(np.float64),) if allow_float64 else ())
        _check_score_array("bias", bias, xp, full, ok)
        bias_type = _dtypes.CTYPE.get(np.dtype(bias.dtype), "double")
    dropout, _ = check_dropout(dropout_p, None, need_seed=False)
    variant = Variant.of(bool(causal), window, cap, alibi_slopes is not None, sinks is not None, mask is not None,
                         bias_type, dropout)  # fmt: skip
    flex = _check_flex(mask_mod, score_mod, score_mod_grad, aux, block_mask, xp, full, mask, bias)
    if flex is not None:
        from dataclasses import replace

        from .flex import aux_values

        variant = replace(variant, flex=flex, flex_aux=aux_values(aux),
                          block_mask=tuple(block_mask.params().items()) if block_mask is not None else (),
                          block_keys=(block_mask.keys_a_row(variant.causal, variant.window)
                                      if block_mask is not None else 0),
                          block_bits=block_mask is not None and block_mask.bits_q is not None)
    return AttentionProblem(tuple(batch), hq, hk, nq, nk, d, dtype, variant, float(scale), xp)


def _check_flex(mask_mod: Any, score_mod: Any, score_mod_grad: Any, aux: Any, block_mask: Any, xp: str,
                full: tuple[int, ...], mask: Any, bias: Any) -> Any:  # fmt: skip
    """User snippets (issue 17 part 3): their text or Python twins, aux, and a block mask for this shape."""
    from .flex import spec_of

    flex = spec_of(mask_mod, score_mod, score_mod_grad, aux, xp)
    if flex is not None and (mask is not None or bias is not None):
        raise ValueError("mask_mod/score_mod do not combine with mask=/bias= arrays: pass the array in aux and read it "
                         "in the snippet (e.g. score + bias(q_idx, kv_idx))")  # fmt: skip
    if block_mask is not None:
        from .flex_block_mask import check_block_mask

        if flex is None or flex.mask_mod is None:
            raise ValueError("block_mask needs the mask_mod it was made from")
        check_block_mask(block_mask, full, xp)
        if block_mask.mask_mod is not flex.mask_mod and block_mask.mask_mod != flex.mask_mod:
            raise ValueError("block_mask was made from another mask_mod than this call's")
        if getattr(flex, "aux", block_mask.aux_signature) != block_mask.aux_signature:
            raise ValueError("block_mask was made with other aux names, dtypes or dims than this call's")
    return flex


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
    bias_grad: Any = False,
    **variant: Any,
) -> AttentionProblem:
    """Check the forward's arguments plus dO, O (q's shape and dtype) and lse (float32, q's shape minus D),
    and ``bias_grad`` (a bool; True needs a ``bias``).

    With ``allow_float64`` (the reference) lse may be float32 or float64.
    """
    common_kind(do=do, q=q, k=k, v=v, o=o, lse=lse)
    if not isinstance(bias_grad, (bool, np.bool_)):
        raise TypeError(f"bias_grad must be a bool; got {type(bias_grad).__name__}")
    if bias_grad and variant.get("bias") is None:
        raise ValueError("bias_grad=True needs a bias (the gradient is that of the bias argument)")
    p = check_attention(q, k, v, causal=causal, scale=scale, allow_float64=allow_float64, **variant)
    check_flex_backward(p)
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


def check_flex_backward(p: AttentionProblem) -> None:
    """A backward through score_mod needs its derivative, and cannot take the built-in softcap under it."""
    flex = p.variant.flex
    if flex is None or flex.score_mod is None:
        return
    if flex.score_mod_grad is None:
        raise ValueError("the backward through score_mod needs score_mod_grad, d(new score)/d(score) as an expression "
                         "of new_score, b, h, q_idx, kv_idx (e.g. '1' for an additive score_mod)")  # fmt: skip
    if p.variant.softcap > 0:
        raise NotImplementedError("the backward of softcap= with score_mod is not supported: the kernels recover the "
                                  "softcap's derivative from the score before score_mod, which they do not keep; "
                                  "write the softcap inside score_mod")  # fmt: skip


def check_flag(name: str, x: Any) -> bool:
    """A keyword that must be a bool (``deterministic``): 1 or "yes" is a mistake, not a truth value."""
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {type(x).__name__}")
    return bool(x)


def check_dropout(dropout_p: Any, dropout_seed: Any, need_seed: bool = True) -> tuple[float, int | None]:
    """``dropout_p`` a real number in [0, 1); ``dropout_seed`` an int in [0, 2^64), required (``need_seed``)
    when dropout_p > 0. Returns (p, seed)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(f"dropout_p must be a real number; got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:  # NaN fails too
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p}")
    if dropout_seed is None:
        if p > 0 and need_seed:
            raise ValueError("dropout_seed is required when dropout_p > 0 (the forward and the backward must "
                             "use the same one; attention() and attention_vjp() draw one for you)")  # fmt: skip
        return p, None
    if isinstance(dropout_seed, (bool, np.bool_)) or not isinstance(dropout_seed, (int, np.integer)):
        raise TypeError(f"dropout_seed must be an int; got {type(dropout_seed).__name__}")
    seed = int(dropout_seed)
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"dropout_seed must be in [0, 2**64); got {seed}")
    return p, seed
