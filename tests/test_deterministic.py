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
        begin, end = variant.keys_of(i0, i0 + br, nq, nk)
        start = begin // bc
        assert visitors == list(range(start, start + len(visitors))), (i, visitors, start)
        assert visitors[-1] == (end - 1) // bc, (i, visitors, end)  # the first turn (dq_turn_of)


# --- Turns v2: the turn order, the walks and the grid order, simulated (cuda_src/dq_turns.cuh) ---------------


def _turn_of(variant, i0, j0, br, bc, nq, nk):
    """dq_turn_of: how many key tiles after K_j visit Q_i (descending order, the diagonal's first)."""
    return (variant.keys_of(i0, i0 + br, nq, nk)[1] - 1) // bc - j0 // bc


def _dq_grid_coord(lin, heads, tiles, per):
    """dq_grid_coord: (head, grid tile) of linear block index ``lin``, heads in groups of ``per``."""
    per = max(1, min(per, heads))
    h0 = lin // (per * tiles) * per
    n = min(per, heads - h0)
    r = lin - h0 * tiles
    return h0 + r % n, r // n


def _blocks(variant, nq, nk, br, bc, kv_heads, group, per):
    """The backward's blocks in linear (launch) order: (kv head, key tile j, its steps [(query head, i)])."""
    tiles = -(-nk // bc)
    out = []
    for lin in range(kv_heads * tiles):
        h, t = _dq_grid_coord(lin, kv_heads, tiles, per)
        j = tiles - 1 - t  # dq_key_tile_coord: the key-tile axis reversed
        first, last = _tiles_covering(variant.queries_of(j * bc, j * bc + bc, nq, nk), br)
        out.append((h, j, [(h * group + g, i) for g in range(group) for i in range(first, last)]))
    return out


def _simulate(blocks, variant, nq, nk, br, bc, slots):
    """Blocks start in linear order while fewer than ``slots`` are resident; each time step, every resident
    block takes its next step if the slot's counter reads its turn (the pass is seen the step after). Returns
    each block's waiting steps and the turns taken per (query head, query tile); raises on a deadlock."""
    counter, taken, waits, pos = {}, {}, [0] * len(blocks), [0] * len(blocks)
    resident, nxt, clock = [], 0, 0
    limit = 4 * sum(len(s) for _, _, s in blocks) + 4 * len(blocks) + 16
    while nxt < len(blocks) or resident:
        while len(resident) < slots and nxt < len(blocks):
            resident.append(nxt)
            nxt += 1
        clock += 1
        assert clock < limit, "deadlock"
        passes = []
        for b in list(resident):
            _, j, steps = blocks[b]
            if pos[b] < len(steps):
                hq, i = steps[pos[b]]
                turn = _turn_of(variant, i * br, j * bc, br, bc, nq, nk)
                assert counter.get((hq, i), 0) <= turn  # nobody overtakes
                if counter.get((hq, i), 0) == turn:
                    taken.setdefault((hq, i), []).append(turn)
                    passes.append((hq, i))
                    pos[b] += 1
                else:
                    waits[b] += 1
            if pos[b] == len(steps):
                resident.remove(b)
        for key in passes:
            counter[key] = counter.get(key, 0) + 1
    return waits, taken


def _first_tiles(variant, nq, nk, br, bc):
    tiles = -(-nk // bc)
    return [_tiles_covering(variant.queries_of(j * bc, j * bc + bc, nq, nk), br) for j in range(tiles)]


@pytest.mark.parametrize("variant", MASKS, ids=lambda v: f"{v.mask_name}{v.window}")
@pytest.mark.parametrize("nq, nk", [(1, 1), (100, 37), (37, 300), (256, 128), (300, 300)])
@pytest.mark.parametrize("br, bc", [(64, 128), (128, 128), (128, 64), (16, 32)])
@pytest.mark.parametrize("kv_heads, group, per", [(1, 1, 1), (3, 2, 1), (3, 1, 2), (4, 1, 4)])
def test_turns_each_taken_once_without_deadlock(variant, nq, nk, br, bc, kv_heads, group, per):
    """Every (query head, query tile)'s turns are taken once each, in order, by exactly its visitors, with
    one block resident at a time (a block waits only on blocks started before it), a few, or all."""
    blocks = _blocks(variant, nq, nk, br, bc, kv_heads, group, per)
    visits = {}
    for _, _, steps in blocks:
        for key in steps:
            visits[key] = visits.get(key, 0) + 1
    for slots in (1, 2, 5, len(blocks)):
        waits, taken = _simulate(blocks, variant, nq, nk, br, bc, slots)
        assert {k: len(v) for k, v in taken.items()} == visits
        assert all(v == list(range(len(v))) for v in taken.values())
        if slots == 1:
            assert sum(waits) == 0  # in launch order, every turn is already due


@pytest.mark.parametrize("variant", MASKS, ids=lambda v: f"{v.mask_name}{v.window}")
@pytest.mark.parametrize("nq, nk", [(256, 256), (300, 200), (200, 300), (512, 512)])
@pytest.mark.parametrize("br, bc", [(64, 128), (128, 128), (32, 32), (128, 64)])
def test_turn_waits_when_a_heads_key_tiles_start_together(variant, nq, nk, br, bc):
    """The prediction of dq_turns.cuh with every key tile of a head started at once: nobody waits where each
    key tile's walk starts past the previous one's (causal, bounded windows with Br <= Bc); key tile j waits
    at most its T - 1 - j later tiles' steps (the fill of key tiles that start together), exactly that where
    every key tile starts at the first query tile and visits them all (no mask)."""
    blocks = _blocks(variant, nq, nk, br, bc, 1, 1, 1)
    waits, _ = _simulate(blocks, variant, nq, nk, br, bc, len(blocks))
    tiles = len(blocks)
    by_tile = {j: w for (_, j, _), w in zip(blocks, waits)}
    starts = [f for f, e in _first_tiles(variant, nq, nk, br, bc) if e > f]
    assert all(by_tile[j] <= tiles - 1 - j for j in range(tiles))
    if all(a < b for a, b in zip(starts, starts[1:])) and len(starts) == tiles:
        assert sum(waits) == 0, by_tile
    if variant.mask_name == "NoMask":
        assert [by_tile[j] for j in range(tiles)] == [tiles - 1 - j for j in range(tiles)]


@pytest.mark.parametrize("heads, tiles", [(1, 1), (1, 7), (5, 1), (6, 4), (7, 3), (33, 8), (10, 10)])
@pytest.mark.parametrize("per", [0, 1, 2, 3, 4, 6, 7, 100])
def test_dq_grid_coord_is_one_to_one_and_each_heads_tiles_grow_with_the_block_index(heads, tiles, per):
    coords = [_dq_grid_coord(lin, heads, tiles, per) for lin in range(heads * tiles)]
    assert sorted(coords) == [(h, t) for h in range(heads) for t in range(tiles)]
    for h in range(heads):
        assert [t for hh, t in coords if hh == h] == list(range(tiles))
    if per <= 1:
        assert coords == [(h, t) for h in range(heads) for t in range(tiles)]  # tiles fastest
    if per >= heads:
        assert coords == [(h, t) for t in range(tiles) for h in range(heads)]  # heads fastest


def test_dq_head_group_rule():
    from cupyflash.plans import dq_head_group

    assert dq_head_group(256, 132, longest_first=False, heads_first=False) == 33
    assert dq_head_group(16, 132, longest_first=False, heads_first=True) == 16
    assert dq_head_group(16, 2, longest_first=False, heads_first=False) == 1
    assert dq_head_group(256, 132, longest_first=True, heads_first=False) == 2  # measured: benchmarks/NOTES.md
    assert dq_head_group(48, 132, longest_first=True, heads_first=True) == 2
    assert dq_head_group(1, 132, longest_first=True, heads_first=True) == 1


def test_grouped_heads_shorten_the_non_causal_fill():
    """The prediction behind dq_head_group (benchmarks/NOTES.md, "Deterministic turns v2"), in the model of
    _simulate (one step per time unit, 132 resident blocks): N = 1024 non-causal, Br = Bc = 128, B*H = 128.
    With tiles fastest a head's 8 key tiles start together and the fill comes back with every wave."""
    v, n, t = Variant(), 1024, 128
    busy = {}
    for per in (1, 33):
        blocks = _blocks(v, n, n, t, t, 128, 1, per)
        waits, _ = _simulate(blocks, v, n, n, t, t, 132)
        work = sum(len(s) for _, _, s in blocks)
        busy[per] = work / (work + sum(waits))
    assert busy[1] < 0.75 and busy[33] > 0.9, busy


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
