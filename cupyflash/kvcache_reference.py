"""The NumPy reference (and backend) of KV-cache attention and of the log-sum-exp merge, in float64.

``attention_with_kvcache`` here is written to be checked by eye: append the new keys/values to each
sequence's cache slots (in place, only those slots), gather the sequence's keys into a dense (Hk, Nk, D)
array through the block table or the batch index, and call the dense reference ``attention_forward``
with Nk = cache_seqlens[b] + Nnew, so causal and window masks are bottom-right aligned against that length.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import reference
from .kvcache_validation import KVCacheProblem, check_kvcache, check_merge


def merge_attention_states(o_parts: Any, lse_parts: Any) -> tuple[Any, Any]:
    """o = sum_p exp(lse_p - lse) o_p and lse = log sum_p exp(lse_p), float64; parts with lse = -inf weigh
    nothing, and a row whose parts are all -inf gives o = 0, lse = -inf."""
    check_merge(o_parts, lse_parts, allow_float64=True)
    O = np.asarray(o_parts, dtype=np.float64)
    L = np.asarray(lse_parts, dtype=np.float64)
    m = L.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(L - m_safe)  # (P, ...), 0 for -inf parts
    total = w.sum(axis=0)
    o = np.einsum("p...,p...d->...d", w, np.where(w[..., None] > 0, O, 0.0))
    o = o / np.where(total > 0, total, 1.0)[..., None]
    lse = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return o, lse


def _slots(p: KVCacheProblem, b: int, keys: np.ndarray, block_table: Any, cache_batch_idx: Any) -> tuple:
    """(page or cache row, slot) of each key of sequence b."""
    if p.paged:
        return np.asarray(block_table)[b, keys // p.page_size], keys % p.page_size
    row = b if cache_batch_idx is None else int(np.asarray(cache_batch_idx)[b])
    return np.full_like(keys, row), keys


def seqlens_of(p: KVCacheProblem, cache_seqlens: Any) -> np.ndarray:
    if p.seqlen_const is not None:
        return np.full(p.batch, p.seqlen_const, dtype=np.int64)
    return np.asarray(cache_seqlens).astype(np.int64)


def rotate(p: KVCacheProblem, x: Any, positions: Any, cos: Any, sin: Any) -> np.ndarray:
    """x (..., N, D) float64 with row n rotated to positions[n]: pairs (x1, x2) of the first rotary_dim elements
    -> (x1 cos - x2 sin, x1 sin + x2 cos); pairs are (2j, 2j + 1) when interleaved, else (j, j + rotary_dim / 2).
    A position past the table (a query row beyond the cache's capacity) takes its last row, as the kernel does."""
    x = np.array(x, dtype=np.float64)
    half = p.rotary_dim // 2
    positions = np.clip(positions, 0, len(cos) - 1)
    c = np.asarray(cos, dtype=np.float64)[positions]  # (N, half)
    s = np.asarray(sin, dtype=np.float64)[positions]
    if p.rotary_interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2].copy(), x[..., 1 : 2 * half : 2].copy()
        x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half].copy(), x[..., half : 2 * half].copy()
        x[..., :half], x[..., half : 2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def append(p: KVCacheProblem, k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any, block_table: Any,
           cache_batch_idx: Any) -> None:  # fmt: skip
    """Write k/v (B, Hk, Nnew, D) into the caches at [cache_seqlens[b], + Nnew), in place."""
    if k is None or p.n_new == 0:
        return
    lens = seqlens_of(p, cache_seqlens)
    for b in range(p.batch):
        pages, slots = _slots(p, b, lens[b] + np.arange(p.n_new), block_table, cache_batch_idx)
        for i in range(p.n_new):
            k_cache[pages[i], :, slots[i], :] = k[b, :, i, :]
            v_cache[pages[i], :, slots[i], :] = v[b, :, i, :]


def gather(p: KVCacheProblem, cache: Any, b: int, nk: int, block_table: Any, cache_batch_idx: Any) -> np.ndarray:
    """Sequence b's first nk keys (or values) as a dense (Hk, nk, D) array."""
    pages, slots = _slots(p, b, np.arange(nk), block_table, cache_batch_idx)
    return np.asarray(cache)[pages, :, slots, :].transpose(1, 0, 2)


def attention_with_kvcache(
    q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *, cache_seqlens: Any, block_table: Any = None,
    cache_batch_idx: Any = None, causal: bool = False, scale: float | None = None, window_size: Any = None,
    softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None, rotary_cos: Any = None,
    rotary_sin: Any = None, rotary_interleaved: bool = False, num_splits: int = 0, kernel: str = "auto",
) -> tuple[Any, Any]:  # fmt: skip
    """float64 ``(o, lse)`` of ``cupyflash.attention_with_kvcache`` on NumPy arrays; appends k/v to the
    caches in place first (k rotated to its positions with rotary_cos/sin, then rounded to the cache's dtype; q
    rotated too and rounded to its dtype). ``num_splits`` changes nothing here (it is a kernel's schedule); ``kernel`` must be "auto" (NumPy
    arrays run no CUDA kernel)."""
    p = check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                      cache_batch_idx=cache_batch_idx, causal=causal, scale=scale, window_size=window_size,
                      softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, rotary_cos=rotary_cos,
                      rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, num_splits=num_splits,
                      kernel=kernel, allow_float64=True)  # fmt: skip
    cached = seqlens_of(p, cache_seqlens)
    if p.rotary_dim:
        q_pos = cached[:, None] + np.arange(p.nq)[None, :] * p.rotary_q_step  # (B, Nq)
        # q is rotated and rounded to its dtype, as the kernel (and FlashAttention's rotary kernel) hands it on.
        q = np.stack([rotate(p, q[b], q_pos[b], rotary_cos, rotary_sin) for b in range(p.batch)]).astype(q.dtype)
        if k is not None:
            k_pos = cached[:, None] + np.arange(p.n_new)[None, :]
            k = np.stack([rotate(p, k[b], k_pos[b], rotary_cos, rotary_sin) for b in range(p.batch)])
            k = k.astype(k_cache.dtype)  # the cache holds the rotated keys in its own dtype
    append(p, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx)
    lens = cached + p.n_new
    o = np.zeros(q.shape, dtype=np.float64)
    lse = np.zeros(q.shape[:-1], dtype=np.float64)
    for b in range(p.batch):
        K = gather(p, k_cache, b, int(lens[b]), block_table, cache_batch_idx)
        V = gather(p, v_cache, b, int(lens[b]), block_table, cache_batch_idx)
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.ndim == 1 else alibi_slopes[b]
        # float64 throughout: q is float64 once rotated, the cache keeps its own dtype.
        Q, K, V = (np.asarray(x, dtype=np.float64) for x in (q[b], K, V))
        o[b], lse[b] = reference.attention_forward(Q, K, V, causal, p.scale, window_size=window_size,
                                                   softcap=softcap, alibi_slopes=slopes, sinks=sinks)  # fmt: skip
    return o, lse
