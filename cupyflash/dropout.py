"""Attention dropout's keep mask: one rule shared by the kernels (``cuda_src/dropout.cuh``), the NumPy reference
and ``cupyflash.dropout_mask``.

The rule (FlashAttention-2's 8-bit thresholds, with a draw-to-score map chosen for our fragment layouts):

- ``p`` acts as ``effective_p(p) = t / 256`` with ``t = threshold(p) = min(round(p * 256), 255)``: a kept
  probability is scaled by ``1 / (1 - t / 256)``, so the expectation of the dropped P is exactly P. (p < 1/512
  drops nothing; p >= 255.5 / 256 drops 255 / 256.)
- Scores are grouped 16 to a Philox4x32-10 draw (``philox.py``; key = the 64-bit seed as (low word, high word)):
  the group of (i, j) is ``{i, i+1, i+8, i+9} x {j, j+1, j+8, j+9}`` inside its 16 x 16 block, i.e. the scores
  sharing (i // 16, (i // 2) % 4, j // 16, (j // 2) % 4); its counter is ``(group(j), group(i), h, b)`` with
  ``group(x) = (x // 16) * 4 + (x // 2) % 4``.
- Within the draw, P_ij takes byte ``2 * ((j // 8) % 2) + (i // 8) % 2`` of word ``2 * (i % 2) + j % 2``
  (little-endian bytes of the outputs x, y, z, w); P_ij is kept iff that byte is >= t.

Why this map: in the mma.sync/wgmma accumulator layouts a lane holds rows {g, g+8} x columns {2t, 2t+1, 2t+8,
2t+9} of each 16 x 16 block (query-major forward: rows = queries; key-major backward: rows = keys), i.e. half of
a group; the lane with g ^ 1 holds the other half. So a pair of lanes draws one group each and swaps half the
words (two shuffles): one draw per 16 scores in both layouts, nothing drawn twice. The mask is a function of
(seed, b, h, i, j) alone, whatever tiles or threads compute it. b is the index into the leading (batch) dims
flattened in C order.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .philox import philox4x32_10

SEED_LIMIT = 1 << 64

#: Thresholds are 8-bit: p is quantised to multiples of 1 / LEVELS.
LEVELS = 256


def threshold(p: float) -> int:
    """The byte value below which a draw drops its probability: round(p * 256) (halves up), at most 255."""
    x = p * LEVELS  # exact: a power-of-two scaling
    t = math.floor(x)
    return min(t + (x - t >= 0.5), LEVELS - 1)


def effective_p(p: float) -> float:
    """The dropout probability the kernels apply for ``dropout_p = p``: ``threshold(p) / 256``."""
    return threshold(p) / LEVELS


def keep_scale(p: float) -> float:
    """The factor on kept probabilities: 1 / (1 - effective_p(p))."""
    return LEVELS / (LEVELS - threshold(p))


def key_of(seed: int) -> tuple[int, int]:
    return seed & 0xFFFFFFFF, seed >> 32


def group_of(x: np.ndarray) -> np.ndarray:
    """The counter word of rows (or columns) x: (x // 16) * 4 + (x // 2) % 4."""
    return (x >> 4) * 4 + ((x >> 1) & 3)


def keep(seed: int, p: float, b: Any, h: Any, rows: Any, cols: Any) -> np.ndarray:
    """Bool keep mask (len(b), len(h), len(rows), len(cols)) for batch indices b, query heads h, queries rows
    and keys cols (1-D integer arrays). Each group's draw is made once."""
    b, h, rows, cols = (np.asarray(x, dtype=np.int64) for x in (b, h, rows, cols))
    gi, row_at = np.unique(group_of(rows), return_inverse=True)
    gj, col_at = np.unique(group_of(cols), return_inverse=True)
    counter = np.empty((len(b), len(h), len(gi), len(gj), 4), dtype=np.uint32)
    counter[..., 0] = gj.astype(np.uint32)[None, None, None, :]
    counter[..., 1] = gi.astype(np.uint32)[None, None, :, None]
    counter[..., 2] = h.astype(np.uint32)[None, :, None, None]
    counter[..., 3] = b.astype(np.uint32)[:, None, None, None]
    draws = philox4x32_10(counter, np.array(key_of(seed), dtype=np.uint32))  # (B, H, groups i, groups j, 4)
    word = (2 * (rows % 2))[:, None] + (cols % 2)[None, :]
    shift = 8 * ((2 * ((cols >> 3) & 1))[None, :] + ((rows >> 3) & 1)[:, None])
    u = draws[:, :, row_at[:, None], col_at[None, :], word]  # (B, H, len(rows), len(cols))
    byte = (u >> shift.astype(np.uint32)) & np.uint32(0xFF)
    return byte >= np.uint32(threshold(p))


#: dropout_mask refuses masks beyond this many elements (it materialises them, for tests and debugging).
MAX_MASK_ELEMENTS = 1 << 26


def dropout_mask(batch: Any, hq: int, nq: int, nk: int, dropout_p: float, dropout_seed: int) -> np.ndarray:
    """The keep mask (bool, ``(*batch, hq, nq, nk)``, a NumPy array) that ``attention_forward(...,
    dropout_p=dropout_p, dropout_seed=dropout_seed)`` applies to a problem with leading dims ``batch`` (an int or
    a tuple), ``hq`` query heads, ``nq`` queries and ``nk`` keys: ``o = ((P * mask) / (1 - p_eff)) @ v`` with
    ``p_eff = cupyflash.effective_dropout_p(dropout_p)`` (dropout_p rounded to a multiple of 1/256)."""
    from .validation import check_dropout

    batch = (batch,) if isinstance(batch, (int, np.integer)) else tuple(batch)
    for name, x in (("hq", hq), ("nq", nq), ("nk", nk), *((f"batch[{i}]", x) for i, x in enumerate(batch))):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
            raise TypeError(f"{name} must be a non-negative int; got {x!r}")
    p, seed = check_dropout(dropout_p, dropout_seed, need_seed=True)
    nb = math.prod(batch)
    if nb * hq * nq * nk > MAX_MASK_ELEMENTS:
        raise ValueError(f"dropout_mask is for small shapes (<= {MAX_MASK_ELEMENTS} elements); got "
                         f"{(*batch, hq, nq, nk)}")  # fmt: skip
    m = keep(seed if seed is not None else 0, p, np.arange(nb), np.arange(hq), np.arange(nq), np.arange(nk))
    return m.reshape(*batch, hq, nq, nk)


def effective_dropout_p(dropout_p: float) -> float:
    """The dropout probability applied for ``dropout_p``: kernels and reference compare 8-bit draws with
    ``round(dropout_p * 256)`` (FlashAttention-2's precision), so they drop with probability
    ``round(dropout_p * 256) / 256`` (at most 255/256) and scale what they keep by ``1 / (1 - that)``."""
    from .validation import check_dropout

    p, _ = check_dropout(dropout_p, 0, need_seed=False)
    return effective_p(p)
