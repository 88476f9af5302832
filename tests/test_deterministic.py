"""Deterministic backward (issue 16) on the CPU: the ordered turns' bookkeeping and the keyword's checks.

The tensor-core backwards add each key tile's dQ share after the earlier key tiles that visit the same query
tile (``cuda_src/dq_turns.cuh``). A key tile's turn is ``j - keys_of(Q_i).begin // Bc``; that is only right
(and deadlock-free) if the key tiles visiting Q_i, as the kernels enumerate them through ``queries_of``, are
exactly the run of consecutive tiles starting there. The Python mirrors of the policies' ranges
(``Variant.keys_of`` / ``queries_of``) check that for every mask kind, ragged shapes and the tile sizes in use.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash.variants import Variant

MASKS = [
    Variant(),
    Variant(causal=True),
    Variant.of(False, (8, 8), 0.0, False, False),
    Variant.of(False, (0, 40), 0.0, False, False),
    Variant.of(False, (100, -1), 0.0, False, False),
    Variant.of(False, (-1, 3), 0.0, False, False),
    Variant.of(True, (17, -1), 0.0, False, False),
    Variant.of(False, (0, 0), 0.0, False, False),
]
SHAPES = [(1, 1), (64, 64), (100, 37), (37, 300), (129, 255), (256, 128), (300, 17)]
# (Br, Bc) of the mma and wgmma backwards, then of the portable dK/dV kernel
TILES = [(64, 128), (128, 128), (128, 64), (64, 64), (64, 16), (32, 64), (16, 32), (8, 16), (64, 32)]


def _tiles_covering(r, tile):
    begin, end = r
    return (0, 0) if end <= begin else (begin // tile, -(-end // tile))


@pytest.mark.parametrize("variant", MASKS, ids=lambda v: f"{v.mask_name}{v.window}")
@pytest.mark.parametrize("nq, nk", SHAPES)
@pytest.mark.parametrize("br, bc", TILES)
def test_key_tiles_visiting_a_query_tile_are_one_run_from_keys_of(variant, nq, nk, br, bc):
    n_key_tiles = -(-nk // bc)
    for i in range(-(-nq // br)):
        i0 = i * br
        visitors = []
        for t in range(n_key_tiles):  # as the kernels enumerate a key tile's query tiles
            first, last = _tiles_covering(variant.queries_of(t * bc, t * bc + bc, nq, nk), br)
            if first <= i < last:
                visitors.append(t)
        if not visitors:
            continue
        start = variant.keys_of(i0, i0 + br, nq, nk)[0] // bc
        assert visitors == list(range(start, start + len(visitors))), (i, visitors, start)


@pytest.mark.parametrize("bad", [1, 0, "yes", None, 1.0, np.int32(1)])
def test_deterministic_must_be_bool(bad):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 8, 16)).astype(np.float32)
    o, lse = cupyflash.attention_forward(q, q, q)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cupyflash.attention_backward(o, q, q, q, o, lse, deterministic=bad)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cupyflash.attention_vjp(q, q, q, deterministic=bad)


def test_numpy_backend_takes_deterministic():
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((2, 4, 24, 16)).astype(np.float32) for _ in range(4))
    o, lse = cupyflash.attention_forward(q, k, v, causal=True)
    a = cupyflash.attention_backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    b = cupyflash.attention_backward(do, q, k, v, o, lse, causal=True)
    for x, y in zip(a, b):
        assert np.array_equal(x, y)
    o2, vjp = cupyflash.attention_vjp(q, k, v, causal=True, deterministic=np.bool_(True))
    assert np.array_equal(o2, o)
    for x, y in zip(vjp(do), b):
        assert np.array_equal(x, y)
