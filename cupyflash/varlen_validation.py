"""Checks of packed variable-length (varlen) calls: FlashAttention's layout, issue 14.

q is ``(total_q, Hq, D)`` and k, v are ``(total_k, Hk, D)``: B sequences packed along the first axis,
sequence b owning rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
of k and v. Two levels of checks:

- ``check_varlen`` / ``check_varlen_backward`` look at types, shapes and dtypes only (no device data is
  read, so a CuPy call never synchronises): they run before anything is allocated or launched.
- ``check_varlen_values`` reads the values of cu_seqlens and seqused_k (non-decreasing, from 0 to total,
  no sequence longer than max_seqlen, seqused_k within its sequence). The NumPy backend always runs it;
  on CuPy arrays it is ``validate=True``'s one synchronisation (the values are the caller's contract, as
  in FlashAttention).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .validation import AttentionProblem, _check_head_vector, array_kind, check_attention, common_kind

INT32 = np.dtype(np.int32)


@dataclass(frozen=True)
class VarlenProblem:
    """A checked varlen call: the per-head problem (``dense``, batch ``()``, with nq/nk = total_q/total_k,
    which carries dtype, heads, D, variant and scale) plus the packing."""

    dense: AttentionProblem
    batch_size: int  # B: sequences in the pack
    total_q: int
    total_k: int
    max_seqlen_q: int
    max_seqlen_k: int
    has_seqused_k: bool

    @property
    def xp(self) -> str:
        return self.dense.xp


def _heads_first(x: Any) -> Any:
    """(total, H, D) seen as (H, total, D): the dense checks then apply as they are (a view, no copy)."""
    return x.transpose(1, 0, 2)


def _check_index_vector(name: str, x: Any, xp: str, length: int | None) -> int:
    """A 1-D int32 array of q's library; returns its length (checked against ``length`` when given)."""
    kind = array_kind(name, x)
    if kind != xp:
        raise TypeError(f"{name} must be a {xp} array like q (no implicit copies); got a {kind} array")
    if np.dtype(x.dtype) != INT32:
        raise TypeError(f"{name}.dtype must be int32 (FlashAttention's layout); got {x.dtype}")
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D; got shape {tuple(x.shape)}")
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},); got {tuple(x.shape)}")
    if x.shape[0] > 1 and x.strides[0] != x.itemsize:
        raise ValueError(f"{name} must be contiguous; got strides {x.strides}")
    return int(x.shape[0])


def _check_max_seqlen(name: str, x: Any) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be a Python int (read on the host, no device copy); got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0; got {x}")
    return int(x)


def check_varlen(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any, *,
    causal: bool = False, scale: float | None = None, window_size: Any = None, softcap: Any = 0.0,
    alibi_slopes: Any = None, sinks: Any = None, seqused_k: Any = None, allow_float64: bool = False,
    dropout_p: Any = 0.0,
) -> VarlenProblem:  # fmt: skip
    """Check a varlen call's types, shapes and dtypes (not the values of cu_seqlens: see the module)."""
    xp = common_kind(q=q, k=k, v=v)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must have shape (total, H, D) (packed varlen layout); got {tuple(x.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got k {k.shape}, v {v.shape}")
    # The dense checks on the (H, total, D) views: dtypes, D, heads, causal, scale, window, softcap, sinks,
    # dropout_p (the seed is the entry points' to check).
    # ALiBi slopes are per sequence here ((B, Hq)), so they are checked below with B.
    dense = check_attention(_heads_first(q), _heads_first(k), _heads_first(v), causal=causal, scale=scale,
                            window_size=window_size, softcap=softcap, sinks=sinks, dropout_p=dropout_p,
                            allow_float64=allow_float64)  # fmt: skip
    n = _check_index_vector("cu_seqlens_q", cu_seqlens_q, xp, None)
    if n < 2:
        raise ValueError(f"cu_seqlens_q must have shape (B + 1,) with B >= 1; got {tuple(cu_seqlens_q.shape)}")
    _check_index_vector("cu_seqlens_k", cu_seqlens_k, xp, n)
    batch = n - 1
    if seqused_k is not None:
        _check_index_vector("seqused_k", seqused_k, xp, batch)
    mq = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    mk = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    if alibi_slopes is not None:  # (Hq,) or one row per sequence (B, Hq); ALiBi back into the variant
        _check_head_vector("alibi_slopes", alibi_slopes, xp, (batch,), dense.hq, batched=True)
        dense = replace(dense, variant=replace(dense.variant, alibi=True))
    return VarlenProblem(dense, batch, int(q.shape[0]), int(k.shape[0]), mq, mk, seqused_k is not None)


def check_varlen_backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
    max_seqlen_k: Any, *, allow_float64: bool = False, **keywords: Any,
) -> VarlenProblem:  # fmt: skip
    """The forward's checks plus dO, O (q's shape and dtype) and lse (float32 ``(Hq, total_q)``)."""
    common_kind(do=do, q=q, k=k, v=v, o=o, lse=lse)
    p = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     allow_float64=allow_float64, **keywords)  # fmt: skip
    for name, x in (("do", do), ("o", o)):
        dt = np.dtype(x.dtype)
        if dt != p.dense.dtype and not (allow_float64 and dt == np.float64):
            raise TypeError(f"{name}.dtype must equal q.dtype ({p.dense.dtype}); got {dt}")
        if x.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {q.shape}; got {x.shape}")
    lse_ok = (np.dtype(np.float32), np.dtype(np.float64)) if allow_float64 else (np.dtype(np.float32),)
    if np.dtype(lse.dtype) not in lse_ok:
        raise TypeError(f"lse.dtype must be float32; got {lse.dtype}")
    want = (p.dense.hq, p.total_q)
    if tuple(lse.shape) != want:
        raise ValueError(f"lse must have shape (Hq, total_q) = {want}; got {tuple(lse.shape)}")
    return p


def varlen_value_errors(xp: Any, p: VarlenProblem, cu_seqlens_q: Any, cu_seqlens_k: Any, seqused_k: Any) -> list[str]:
    """What is wrong with the values of cu_seqlens and seqused_k, as sentences ([] when nothing).

    ``xp`` is numpy or cupy: every test is computed on the arrays' device and the results come back in
    one transfer (the one synchronisation of ``validate=True`` on CuPy arrays)."""
    cq = cu_seqlens_q.astype(np.int64)
    ck = cu_seqlens_k.astype(np.int64)
    lq, lk = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
    used = ck[:0] if seqused_k is None else seqused_k.astype(np.int64)
    tests = [
        ("cu_seqlens_q[0] must be 0", cq[0] != 0),
        ("cu_seqlens_k[0] must be 0", ck[0] != 0),
        (f"cu_seqlens_q[-1] must equal total_q = {p.total_q}", cq[-1] != p.total_q),
        (f"cu_seqlens_k[-1] must equal total_k = {p.total_k}", ck[-1] != p.total_k),
        ("cu_seqlens_q must be non-decreasing", (lq < 0).any()),
        ("cu_seqlens_k must be non-decreasing", (lk < 0).any()),
        (f"a query sequence is longer than max_seqlen_q = {p.max_seqlen_q}", (lq > p.max_seqlen_q).any()),
        (f"a key sequence is longer than max_seqlen_k = {p.max_seqlen_k}", (lk > p.max_seqlen_k).any()),
    ]
    if seqused_k is not None:
        tests.append(("seqused_k must be in [0, cu_seqlens_k[b + 1] - cu_seqlens_k[b]] for every b",
                      ((used < 0) | (used > lk)).any()))  # fmt: skip
    flags = xp.stack([xp.asarray(bad) for _, bad in tests])
    flags = flags.get() if hasattr(flags, "get") else flags  # one device-to-host copy
    return [msg for (msg, _), bad in zip(tests, np.asarray(flags).tolist()) if bad]


def check_varlen_values(xp: Any, p: VarlenProblem, cu_seqlens_q: Any, cu_seqlens_k: Any, seqused_k: Any) -> None:
    """ValueError listing every problem with the values of cu_seqlens / seqused_k / max_seqlen."""
    errors = varlen_value_errors(xp, p, cu_seqlens_q, cu_seqlens_k, seqused_k)
    if errors:
        raise ValueError("bad varlen packing: " + "; ".join(errors))
