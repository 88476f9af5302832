"""Philox4x32-10 in vectorised NumPy uint32 arithmetic: the twin of ``cuda_src/philox.cuh``.

Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2, 3" (SC 2011). A counter-based
generator: the four 32-bit outputs are a pure function of a 128-bit counter and a 64-bit key, so the
dropout mask of any (batch, head, query, key) can be recomputed anywhere, in any tile order.
"""
from __future__ import annotations

from typing import Any

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (Weyl) increments
ROUNDS = 10

_MASK32 = np.uint64(0xFFFFFFFF)


def _mulhilo(m: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    prod = np.uint64(m) * x.astype(np.uint64)
    return (prod >> np.uint64(32)).astype(np.uint32), (prod & _MASK32).astype(np.uint32)


def philox4x32_10(counter: Any, key: Any) -> np.ndarray:
    """Outputs (..., 4) uint32 for counters (..., 4) and keys (..., 2) (broadcasting), both uint32."""
    c = np.asarray(counter, dtype=np.uint32)
    k = np.asarray(key, dtype=np.uint32)
    c = [c[..., i] for i in range(4)]
    k0, k1 = k[..., 0], k[..., 1]
    with np.errstate(over="ignore"):
        for _ in range(ROUNDS):
            hi0, lo0 = _mulhilo(M0, c[0])
            hi1, lo1 = _mulhilo(M1, c[2])
            c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
            k0 = (k0 + np.uint32(W0)).astype(np.uint32)
            k1 = (k1 + np.uint32(W1)).astype(np.uint32)
    return np.stack(np.broadcast_arrays(*c), axis=-1)
