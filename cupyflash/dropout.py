"""Attention dropout's keep mask: one rule shared by the kernels (``cuda_src/dropout.cuh``), the NumPy reference
and ``cupyflash.dropout_mask``.

Probability P_ij of query i and key j, in batch b and query head h, is kept iff the uint32 ``u`` drawn for it
is >= ``threshold(p) = floor(p * 2^32)`` (so it is kept with probability 1 - p to within 2^-32), and a kept
one is scaled by 1 / (1 - p). ``u`` comes from Philox4x32-10 (``philox.py``) with key = the 64-bit seed
(low word, high word) and counter = (j // 2, i // 2, h, b): one draw serves the 2 x 2 block of (i, j) it
covers, output (i % 2) * 2 + j % 2. The mask is a function of (seed, b, h, i, j) alone, whatever tiles or
threads compute it. b is the index into the leading (batch) dims flattened in C order.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .philox import philox4x32_10

SEED_LIMIT = 1 << 64


def threshold(p: float) -> int:
    """The uint32 below which a draw drops its probability."""
    return min(int(math.floor(p * 2.0**32)), 2**32 - 1)


def key_of(seed: int) -> tuple[int, int]:
    return seed & 0xFFFFFFFF, seed >> 32


def keep(seed: int, p: float, b: Any, h: Any, rows: Any, cols: Any) -> np.ndarray:
    """Bool keep mask (len(b), len(h), len(rows), len(cols)) for batch indices b, query heads h, queries rows
    and keys cols (1-D integer arrays)."""
    b, h, rows, cols = (np.asarray(x, dtype=np.int64) for x in (b, h, rows, cols))
    counter = np.empty((len(b), len(h), len(rows), len(cols), 4), dtype=np.uint32)
    counter[..., 0] = (cols // 2).astype(np.uint32)[None, None, None, :]
    counter[..., 1] = (rows // 2).astype(np.uint32)[None, None, :, None]
    counter[..., 2] = h.astype(np.uint32)[None, :, None, None]
    counter[..., 3] = b.astype(np.uint32)[:, None, None, None]
    draws = philox4x32_10(counter, np.array(key_of(seed), dtype=np.uint32))
    slot = ((rows % 2) * 2)[:, None] + (cols % 2)[None, :]
    u = np.take_along_axis(draws, np.broadcast_to(slot[..., None], draws.shape[:-1] + (1,)), axis=-1)[..., 0]
    return u >= np.uint32(threshold(p))


#: dropout_mask refuses masks beyond this many elements (it materialises them, for tests and debugging).
MAX_MASK_ELEMENTS = 1 << 26


def dropout_mask(batch: Any, hq: int, nq: int, nk: int, dropout_p: float, dropout_seed: int) -> np.ndarray:
    """The keep mask (bool, ``(*batch, hq, nq, nk)``, a NumPy array) that ``attention_forward(...,
    dropout_p=dropout_p, dropout_seed=dropout_seed)`` applies to a problem with leading dims ``batch`` (an int or
    a tuple), ``hq`` query heads, ``nq`` queries and ``nk`` keys: ``o = ((P * mask) / (1 - p)) @ v``."""
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
