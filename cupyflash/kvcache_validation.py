"""Argument checks of ``attention_with_kvcache`` and ``merge_attention_states``: types, shapes, dtypes and
keywords only (nothing reads array contents, so the checks are CPU-tested and cacheable per signature).
``check_values`` is the one content check, run when the caller asks for ``validate=True``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _dtypes
from .validation import (
    MAX_HEAD_DIM,
    _c_contiguous,
    _check_dtype,
    array_kind,
    check_builtin_variant,
    common_kind,
)
from .variants import Variant

INT32 = np.dtype(np.int32)
MAX_PAGE_SIZE = 256


@dataclass(frozen=True)
class KVCacheProblem:
    """A checked ``attention_with_kvcache`` call."""

    batch: int  # B (rows of q)
    hq: int
    hk: int
    nq: int
    d: int
    n_new: int  # keys appended by this call (0: none)
    paged: bool
    page_size: int  # keys per page (contiguous: S)
    num_pages: int  # pages (contiguous: B_cache)
    pages_per_seq: int  # block-table width (contiguous: 1)
    seqlen_const: int | None  # cache_seqlens given as a Python int
    dtype: np.dtype
    variant: Variant
    scale: float
    xp: str
    rotary_dim: int = 0  # leading dims of q and new k rotated (0: no rotary)
    rotary_interleaved: bool = False
    rotary_rows: int = 0  # positions rotary_cos/sin cover

    @property
    def group(self) -> int:
        return self.hq // self.hk

    @property
    def rotary_q_step(self) -> int:
        """q row i sits at position cache_seqlens + i under causal/local masks, else every row at cache_seqlens
        (FlashAttention's rule)."""
        return int(self.variant.causal or self.variant.window is not None)

    @property
    def capacity(self) -> int:
        """Keys one sequence can hold: S, or pages_per_seq * page_size."""
        return self.page_size * self.pages_per_seq


def _int32_array(name: str, x: Any, xp: str, shape: tuple[int, ...]) -> None:
    kind = array_kind(name, x)
    if kind != xp:
        raise TypeError(f"{name} must be a {xp} array like q (no implicit copies); got a {kind} array")
    if np.dtype(x.dtype) != INT32:
        raise TypeError(f"{name}.dtype must be int32; got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}; got {tuple(x.shape)}")


#: The decode kernels attention_with_kvcache's ``kernel`` may name (kernels/decode.py, ``plan``).
DECODE_KERNELS = ("auto", "mma", "fma")


def check_kvcache(
    q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *, cache_seqlens: Any, block_table: Any = None,
    cache_batch_idx: Any = None, causal: bool = False, scale: float | None = None, window_size: Any = None,
    softcap: Any = 0.0, alibi_slopes: Any = None, sinks: Any = None, rotary_cos: Any = None, rotary_sin: Any = None,
    rotary_interleaved: bool = False, num_splits: Any = 0, kernel: Any = "auto", allow_float64: bool = False,
) -> KVCacheProblem:  # fmt: skip
    """Check every argument of ``attention_with_kvcache``; raise TypeError/ValueError naming it."""
    xp = common_kind(q=q, k_cache=k_cache, v_cache=v_cache)
    dtype = _check_dtype("q", q, allow_float64=allow_float64)
    _check_dtype("k_cache", k_cache, dtype)
    _check_dtype("v_cache", v_cache, dtype)
    if q.ndim != 4:
        raise ValueError(f"q must have shape (B, Hq, Nq, D); got {q.shape}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have shape (B_cache, Hk, S, D) or, paged, (num_pages, Hk, page_size, D); "
                             f"got {x.shape}")  # fmt: skip
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape; got {k_cache.shape}, {v_cache.shape}")
    b, hq, nq, d = q.shape
    rows, hk, slots, dc = k_cache.shape
    if dc != d:
        raise ValueError(f"head dim of k_cache must equal that of q; got q {q.shape}, k_cache {k_cache.shape}")
    if d < 1 or d > MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be in 1..{MAX_HEAD_DIM}; got D={d}")
    if hk < 1 or hq < 1 or hq % hk:
        raise ValueError(f"query heads must be a positive multiple of key/value heads; got Hq={hq}, Hk={hk}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
            raise ValueError(f"{name} must have a contiguous last dim (it is written in place); strides {x.strides}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (or neither)")
    n_new = 0
    if k is not None:
        common_kind(q=q, k=k, v=v)
        _check_dtype("k", k, dtype)
        _check_dtype("v", v, dtype)
        if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[1] != hk or k.shape[3] != d:
            raise ValueError(f"k and v must have shape (B, Hk, Nnew, D) = ({b}, {hk}, Nnew, {d}); "
                             f"got k {k.shape}, v {v.shape}")  # fmt: skip
        n_new = k.shape[2]
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx is for contiguous caches; a paged cache maps rows by block_table")
        if block_table.ndim != 2 or block_table.shape[0] != b:
            raise ValueError(f"block_table must have shape (B, max_pages_per_seq) with B = {b}; "
                             f"got {tuple(block_table.shape)}")  # fmt: skip
        _int32_array("block_table", block_table, xp, (b, block_table.shape[1]))
        if block_table.shape[1] < 1:
            raise ValueError("block_table needs at least one page per sequence")
        if not 1 <= slots <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size (k_cache.shape[2]) must be in 1..{MAX_PAGE_SIZE}; got {slots}")
        if block_table.strides[-1] != 4 and block_table.shape[1] > 1:
            raise ValueError(f"block_table rows must be contiguous; got strides {block_table.strides}")
        page_size, num_pages, pages_per_seq = slots, rows, block_table.shape[1]
    else:
        if cache_batch_idx is not None:
            _int32_array("cache_batch_idx", cache_batch_idx, xp, (b,))
        elif rows != b:
            raise ValueError(f"k_cache has {rows} rows but q has batch {b}: pass cache_batch_idx to map them")
        page_size, num_pages, pages_per_seq = slots, rows, 1
    capacity = page_size * pages_per_seq
    if n_new > capacity:
        raise ValueError(f"{n_new} new keys do not fit a cache of {capacity} keys per sequence")
    seqlen_const = None
    if isinstance(cache_seqlens, (bool, np.bool_)):
        raise TypeError("cache_seqlens must be an int or an int32 array (B,); got a bool")
    if isinstance(cache_seqlens, (int, np.integer)):
        seqlen_const = int(cache_seqlens)
        if not 0 <= seqlen_const <= capacity - n_new:
            raise ValueError(f"cache_seqlens = {seqlen_const} must be in 0..{capacity - n_new} "
                             f"(cache of {capacity} keys, {n_new} new)")  # fmt: skip
    else:
        _int32_array("cache_seqlens", cache_seqlens, xp, (b,))
    if nq < 1 and b and hq:
        raise ValueError(f"q needs at least one query row; got {q.shape}")
    scale, window, cap = check_builtin_variant(causal, scale, d, window_size, softcap, alibi_slopes, sinks, xp, (b,),
                                               hq)  # fmt: skip
    rotary_dim, rotary_rows = 0, 0
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise TypeError(f"rotary_interleaved must be a bool; got {type(rotary_interleaved).__name__}")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together (or neither)")
    if rotary_cos is not None:
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            kind = array_kind(name, x)
            if kind != xp:
                raise TypeError(f"{name} must be a {xp} array like q (no implicit copies); got a {kind} array")
            if np.dtype(x.dtype) != _dtypes.FLOAT32 and not (allow_float64 and np.dtype(x.dtype) == np.float64):
                raise TypeError(f"{name}.dtype must be float32; got {x.dtype}")
            if x.ndim != 2 or x.shape != rotary_cos.shape:
                raise ValueError(f"{name} must have shape (seqlen_ro, rotary_dim / 2), as rotary_cos; got {x.shape}")
            if x.size and not _c_contiguous(x):
                raise ValueError(f"{name} must be contiguous; got strides {x.strides}")
        rotary_rows, rotary_dim = rotary_cos.shape[0], 2 * rotary_cos.shape[1]
        if not 0 < rotary_dim <= d:
            raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] must be in 2..D = {d}; got {rotary_dim}")
        if rotary_rows < capacity:
            raise ValueError(f"rotary_cos must cover every cache position: {rotary_rows} rows < {capacity} keys")
    if isinstance(num_splits, (bool, np.bool_)) or not isinstance(num_splits, (int, np.integer)) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: automatic, 1: no split); got {num_splits!r}")
    if not isinstance(kernel, str) or kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel must be one of {DECODE_KERNELS}; got {kernel!r}")
    if kernel != "auto" and xp == "numpy":
        raise TypeError(f"kernel={kernel!r} names a CUDA decode kernel; NumPy arrays run the NumPy backend "
                        "(pass CuPy arrays, or leave kernel='auto')")  # fmt: skip
    variant = Variant.of(bool(causal), window, cap, alibi_slopes is not None, sinks is not None)
    return KVCacheProblem(b, hq, hk, nq, d, n_new, paged, page_size, num_pages, pages_per_seq, seqlen_const, dtype,
                          variant, float(scale), xp, rotary_dim, bool(rotary_interleaved), rotary_rows)  # fmt: skip


def check_values(p: KVCacheProblem, cache_seqlens: Any, block_table: Any, cache_batch_idx: Any) -> None:
    """``validate=True``: the contents of the index arrays (one device-to-host copy for CuPy arrays)."""
    arrays = [x for x in (cache_seqlens, block_table, cache_batch_idx) if x is not None and not isinstance(x, int)]
    if not arrays:
        return
    if p.xp == "cupy":
        import cupy

        flat = cupy.concatenate([x.reshape(-1) for x in arrays]).get()  # the one synchronisation
    else:
        flat = np.concatenate([np.asarray(x).reshape(-1) for x in arrays])
    at = 0
    values = {}
    for name, x in (("cache_seqlens", cache_seqlens), ("block_table", block_table),
                    ("cache_batch_idx", cache_batch_idx)):  # fmt: skip
        if x is None or isinstance(x, int):
            continue
        values[name] = flat[at : at + x.size]
        at += x.size
    if "cache_seqlens" in values:
        s = values["cache_seqlens"]
        hi = p.capacity - p.n_new
        bad = np.nonzero((s < 0) | (s > hi))[0]
        if bad.size:
            raise ValueError(f"cache_seqlens[{bad[0]}] = {s[bad[0]]} is outside 0..{hi} (cache of {p.capacity} keys "
                             f"per sequence, {p.n_new} new)")  # fmt: skip
    if "block_table" in values:
        t = values["block_table"].reshape(p.batch, p.pages_per_seq)
        s = values.get("cache_seqlens")
        for bi in range(p.batch):
            used = -(-((int(s[bi]) if s is not None else p.seqlen_const) + p.n_new) // p.page_size)
            row = t[bi, :used]
            bad = np.nonzero((row < 0) | (row >= p.num_pages))[0]
            if bad.size:
                raise ValueError(f"block_table[{bi}, {bad[0]}] = {row[bad[0]]} is not a page (0..{p.num_pages - 1})")
    if "cache_batch_idx" in values:
        c = values["cache_batch_idx"]
        bad = np.nonzero((c < 0) | (c >= p.num_pages))[0]
        if bad.size:
            raise ValueError(f"cache_batch_idx[{bad[0]}] = {c[bad[0]]} is not a cache row (0..{p.num_pages - 1})")


@dataclass(frozen=True)
class MergeProblem:
    parts: int
    shape: tuple[int, ...]  # o's shape (..., D)
    dtype: np.dtype
    xp: str


def check_merge(o_parts: Any, lse_parts: Any, allow_float64: bool = False) -> MergeProblem:
    """o_parts (P, ..., D) in a supported dtype, lse_parts (P, ...) float32 (or float64 for the reference)."""
    xp = common_kind(o_parts=o_parts, lse_parts=lse_parts)
    dtype = _check_dtype("o_parts", o_parts, allow_float64=allow_float64)
    lt = np.dtype(lse_parts.dtype)
    if lt != _dtypes.FLOAT32 and not (allow_float64 and lt == np.float64):
        raise TypeError(f"lse_parts.dtype must be float32; got {lt}")
    if o_parts.ndim < 2:
        raise ValueError(f"o_parts must have shape (P, ..., D); got {o_parts.shape}")
    if tuple(lse_parts.shape) != tuple(o_parts.shape[:-1]):
        raise ValueError(f"lse_parts must have o_parts' shape without D, {o_parts.shape[:-1]}; "
                         f"got {lse_parts.shape}")  # fmt: skip
    if o_parts.shape[0] < 1:
        raise ValueError("o_parts needs at least one part (P >= 1)")
    return MergeProblem(o_parts.shape[0], tuple(o_parts.shape[1:]), dtype, xp)
