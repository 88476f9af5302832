"""Block masks (issue 17 part 3; FlexAttention's ``create_block_mask``): which tiles of a mask_mod are empty.

``create_block_mask(mask_mod, B, H, Nq, Nk, aux=None, block_size=64)`` evaluates the mask once per
``block_size x block_size`` tile of every (b, h) and records each tile as empty (0), partial (1) or full (2)
(``BlockMask.states``). With CuPy it runs a small generated kernel (one thread block per tile) compiled from the
same snippet text as the attention kernels, then ``block_mask_runs.cu`` for the full runs below; with a Python
callable (the snippet's twin) it runs in NumPy, the reference of the CPU tests.

Passing ``block_mask=`` with the same ``mask_mod`` (and aux) to an attention call narrows every kernel tile loop
to the blocks between the first and the last non-empty one of its rows (forwards) or columns (backwards)
(``BlockMasked`` in ``cuda_src/flex_policy.cuh``): for a document mask or a prefix-LM mask that skips every
empty tile. mask_mod then runs only in partial tiles (``FlexMask``): a kernel tile whose blocks lie inside the
longest run of FULL blocks of their block row or column (``BlockMask.full_kv`` / ``full_q``; ``full_tiles``) and
that the built-in mask leaves whole runs as an unmasked tile (for document, prefix-LM and window masks every FULL
block of a row or column is in that run). Interior empty tiles
(a row whose visible blocks are not contiguous) are still visited, as partial tiles. In partial tiles the kernels
read mask_mod's value of each pair from bits the mask keeps for its mixed 64 x 64 tiles (``bit_index``,
``bits_q``, ``bits_k``; a second generated kernel, ``cf_block_bits``) instead of running mask_mod, unless those
would take more than ``BITS_BUDGET``. The block size need not
match any kernel's tiles: a kernel tile covering part of a block takes that block's whole range and state
(conservative). ``B``/``H`` of ``None`` (or 1)
make one table serve every batch / head (the mask must then not depend on ``b`` / ``h``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2
DEFAULT_BLOCK = 64
#: The bits' tile edge (FlexMask::strip_words: one 64-bit word a row of a tile).
BIT_TILE = 64
#: The most bytes a block mask keeps as bits (1 KB a mixed tile, both orientations): 256 MB is a quarter of every
#: pair of a 32k x 32k mask; masks with more mixed tiles than that run mask_mod per pair of their partial tiles.
BITS_BUDGET = 256 << 20


@dataclass(eq=False)
class BlockMask:
    """A mask_mod's tile states and the per-row / per-column ranges of non-empty blocks the kernels read."""

    mask_mod: Any  # the snippet text (or Python twin) it was made from
    aux_signature: tuple  # the aux slots (flex.AuxSlot) it was made with
    batch: int  # 1: one table for every batch
    heads: int  # 1: one table for every head
    nq: int
    nk: int
    block_size: int
    states: Any  # uint8 (batch, heads, ceil(Nq / bs), ceil(Nk / bs)): EMPTY, PARTIAL, FULL
    kv_range: Any  # int32 (batch, heads, nqb, 2): [first, last) non-empty key blocks per query block
    q_range: Any  # int32 (batch, heads, nkb, 2): [first, last) non-empty query blocks per key block
    full_kv: Any  # int32 (batch, heads, nqb, 2): [first, last) key blocks of each query block's longest FULL run
    full_q: Any  # int32 (batch, heads, nkb, 2): the same per key block, over query blocks
    #: The mean number of keys a query row's narrowed tile loop visits, over the rows' [first, last) blocks, and the
    #: same under the bottom-right causal rule: read once when the mask is made (one synchronisation there, none in
    #: the calls), for the forward's kernel choice (``keys_a_row``, plans.wgmma). 0: not known.
    visited_keys: int = 0
    visited_keys_causal: int = 0
    #: mask_mod's value of every pair of the mixed 64 x 64 tiles (``BIT_TILE``), which partial kernel tiles read
    #: instead of running mask_mod (``FlexMask<..., true>``): ``bit_index`` int32 (batch, heads, ceil(Nq / 64),
    #: ceil(Nk / 64)), a mixed tile's slot, -1 where every pair of the tile is visible (or it holds none of the
    #: problem's pairs), -2 where none is; ``bits_q`` / ``bits_k`` uint64 (slots * 64,): slot s's word r is query row
    #: 64 qt + r over keys 64 kt.. (bit j: key 64 kt + j), resp. key 64 kt + r over queries; pairs outside the problem
    #: read 1. None where the mixed tiles would take more than ``BITS_BUDGET`` bytes: mask_mod then runs per pair.
    bit_index: Any = None
    bits_q: Any = None
    bits_k: Any = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.states.shape)

    def sparsity(self) -> float:
        """The fraction of tiles that are empty."""
        return float((self.states == EMPTY).mean())

    def visited(self) -> float:
        """The fraction of tiles the kernels' narrowed loops visit (between the first and last non-empty block of
        each query block's row)."""
        r = self.kv_range
        return float((r[..., 1] - r[..., 0]).clip(0).sum()) / max(1, self.states.size)

    def keys_a_row(self, causal: bool, window: tuple[int, int] | None) -> int:
        """The mean number of keys a query row's tile loop visits in a call with this built-in mask (a Variant's
        causal and window): the block ranges, under the causal rule where the call is causal or its window's right
        side is 0, and at most a window's width where both its sides are bounded."""
        keys = self.visited_keys_causal if causal or (window is not None and window[1] == 0) else self.visited_keys
        if window is not None and min(window) >= 0:
            keys = min(keys, window[0] + window[1] + 1)
        return keys

    def full_tiles(self, rows: int, cols: int) -> np.ndarray:
        """Per kernel tile of ``rows`` x ``cols`` (b, h, ceil(Nq / rows), ceil(Nk / cols)): does it skip mask_mod?
        ``FlexMask::all_full``'s rule in NumPy (tests, and the work a call leaves per element): the tile's blocks,
        clipped to the problem, lie inside its block column's full run when it is one block wide, else inside each
        of its block rows' full runs."""
        kv, q = np.asarray(_host(self.full_kv)), np.asarray(_host(self.full_q))
        bs, nq, nk = self.block_size, self.nq, self.nk
        nqt, nkt = -(-nq // rows), -(-nk // cols)
        out = np.zeros((*kv.shape[:2], nqt, nkt), bool)
        for i in range(nqt):
            i0, i1 = i * rows // bs, (min((i + 1) * rows, nq) - 1) // bs
            for j in range(nkt):
                j0, j1 = j * cols // bs, (min((j + 1) * cols, nk) - 1) // bs
                if j0 == j1:
                    out[:, :, i, j] = (q[:, :, j0, 0] <= i0) & (i1 < q[:, :, j0, 1])
                else:
                    out[:, :, i, j] = ((kv[:, :, i0 : i1 + 1, 0] <= j0) & (j1 < kv[:, :, i0 : i1 + 1, 1])).all(axis=2)
        return out

    def pointers(self) -> dict[str, Any]:
        """The params' pointer fields (``AttentionParams.bm_kv``, ``bm_q``, ``bm_full_kv``, ``bm_full_q``, and the
        bits' ``bm_bit_index``, ``bm_bits_q``, ``bm_bits_k`` where there are bits)."""
        out = {"bm_kv": self.kv_range, "bm_q": self.q_range, "bm_full_kv": self.full_kv, "bm_full_q": self.full_q}
        if self.bits_q is not None:
            out.update(bm_bit_index=self.bit_index, bm_bits_q=self.bits_q, bm_bits_k=self.bits_k)
        return out

    def params(self) -> dict[str, int]:
        nqb, nkb = self.states.shape[-2:]
        magic, shift = block_divisor(self.block_size)
        return {"bm_size": self.block_size, "bm_nqb": nqb, "bm_nkb": nkb, "bm_bb": self.batch, "bm_hb": self.heads,
                "bm_magic": magic, "bm_magic_shift": shift}  # fmt: skip

    def __repr__(self) -> str:
        return (f"BlockMask(batch={self.batch}, heads={self.heads}, Nq={self.nq}, Nk={self.nk}, "
                f"block_size={self.block_size}, empty={self.sparsity():.3f})")  # fmt: skip


def block_divisor(bs: int) -> tuple[int, int]:
    """(m, s) with x // bs == (x * m) >> s for every 0 <= x < 2**31 and m < 2**32 (the round-up method: s = 31 +
    ceil(log2 bs), m = ceil(2**s / bs), whose error m * bs - 2**s < bs <= 2**(s - 31) keeps every quotient exact):
    FlexMask's block index without a division."""
    s = 31 + (bs - 1).bit_length()
    return -(-(1 << s) // bs), s


def _host(x: Any) -> Any:
    """A CuPy array's NumPy copy (NumPy arrays as they are)."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else x


def _positive(name: str, x: Any, allow_none: bool = False) -> int:
    if x is None and allow_none:
        return 1
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}; got {x!r}")
    return int(x)


def ranges(states: Any, xp: Any) -> tuple[Any, Any]:
    """(kv_range, q_range) of a states array: per row (column) the first and one past the last non-empty block,
    (0, 0) where a row (column) is empty."""

    def first_last(visible: Any) -> Any:  # (..., rows, n) -> (..., rows, 2)
        n = visible.shape[-1]
        any_ = visible.any(axis=-1)
        first = xp.argmax(visible, axis=-1)
        last = n - xp.argmax(visible[..., ::-1], axis=-1)
        out = xp.stack([xp.where(any_, first, 0), xp.where(any_, last, 0)], axis=-1)
        return xp.ascontiguousarray(out.astype(np.int32))

    visible = states != EMPTY
    return first_last(visible), first_last(visible.swapaxes(-1, -2))


def create_block_mask(mask_mod: Any, B: Any, H: Any, Nq: int, Nk: int, aux: dict[str, Any] | None = None,
                      block_size: int = DEFAULT_BLOCK) -> BlockMask:  # fmt: skip
    """Evaluate ``mask_mod`` per tile and return the ``BlockMask`` to pass as ``block_mask=``.

    mask_mod: the C++ snippet (CuPy: a generated kernel on the current device) or its Python twin (NumPy).
    B, H: the batch (leading dims flattened) and query-head counts, or None (one table for all; mask_mod is then
    evaluated at b = 0 / h = 0). Nq, Nk: the sequence lengths. aux: as the attention call's (same names, kinds,
    dtypes and dims). block_size: the tile edge (default 64; any positive size works with every kernel family).
    With CuPy it waits for the device once, to read how many keys a row visits (``visited_keys``: which Hopper
    forward runs the calls); the attention calls that take the mask do not.
    """
    from . import flex

    bb, hb = _positive("B", B, True), _positive("H", H, True)
    nq, nk, bs = _positive("Nq", Nq), _positive("Nk", Nk), _positive("block_size", block_size)
    if callable(mask_mod):
        slots = flex.check_aux(aux, "numpy")
        pairs = _numpy_pairs(mask_mod, bb, hb, nq, nk)
        states = _numpy_states(pairs, bs)
        full = states == FULL
        runs = _longest_runs(full), _longest_runs(full.swapaxes(-1, -2))
        bits = _numpy_bits(pairs)
        xp: Any = np
    else:
        flex.check_text("mask_mod", mask_mod)
        slots = flex.check_aux(aux, "cupy")
        spec = flex.FlexSpec(mask_mod=mask_mod, aux=slots)
        flex.check(spec)
        states, runs = _cuda_states(spec, aux, bb, hb, nq, nk, bs)
        bits = _cuda_bits(spec, aux, bb, hb, nq, nk, states if bs == BIT_TILE else None)
        import cupy

        xp = cupy
    kv, q = ranges(states, xp)
    return BlockMask(mask_mod, slots, bb, hb, nq, nk, bs, states, kv, q, *runs, *_visited_keys(kv, nq, nk, bs, xp),
                     *bits)  # fmt: skip


def mixed_tile_index(states: Any, xp: Any) -> tuple[Any, int]:
    """(bit_index, slots) of the 64 x 64 tiles' states: mixed tiles numbered in order, -1 FULL, -2 EMPTY."""
    mixed = states == PARTIAL
    slot = xp.cumsum(mixed.ravel(), dtype=np.int64).reshape(states.shape) - 1
    index = xp.where(mixed, slot, xp.where(states == EMPTY, -2, -1)).astype(np.int32)
    return index, int(mixed.sum())


def _visited_keys(kv_range: Any, nq: int, nk: int, bs: int, xp: Any) -> tuple[int, int]:
    """(BlockMask.visited_keys, visited_keys_causal) of a kv_range table: per block row, the keys from its first
    non-empty block to its last (clipped to Nk), and that range cut where the causal rule ends the row block's keys
    (keys < its last query + 1 + Nk - Nq, bottom-right aligned, as Causal::keys_of), averaged over every row of
    every (b, h); one transfer from the device."""
    first = kv_range[..., 0] * bs
    last = xp.minimum(kv_range[..., 1] * bs, nk)
    rows = xp.arange(kv_range.shape[-2])
    causal_end = xp.clip(xp.minimum((rows + 1) * bs, nq) + nk - nq, 0, nk)
    spans = xp.stack([last - first, xp.minimum(last, causal_end) - first])
    full, causal = (round(float(x)) for x in _host(xp.clip(spans, 0, None).reshape(2, -1).mean(axis=1)))
    return full, causal


def _longest_runs(full: np.ndarray) -> np.ndarray:
    """(..., n) bool -> (..., 2) int32: the [first, last) of each line's longest run of True (the first of equal
    length), (0, 0) where it has none. The reference of the CUDA tables' kernel (cf_full_runs)."""
    idx = np.arange(full.shape[-1])
    last_gap = np.maximum.accumulate(np.where(full, -1, idx), axis=-1)  # the last False at or before each index
    length = np.where(full, idx - last_gap, 0)  # of the run ending at each index
    end, size = length.argmax(axis=-1) + 1, length.max(axis=-1)
    return np.ascontiguousarray(np.stack([np.where(size > 0, end - size, 0), np.where(size > 0, end, 0)], axis=-1),
                                dtype=np.int32)  # fmt: skip


def _numpy_pairs(mask_mod: Any, bb: int, hb: int, nq: int, nk: int) -> np.ndarray:
    """The reference: mask_mod's twin on every pair, bool (bb, hb, nq, nk)."""
    b = np.arange(bb).reshape(bb, 1, 1, 1)
    h = np.arange(hb).reshape(1, hb, 1, 1)
    q = np.arange(nq).reshape(1, 1, nq, 1)
    k = np.arange(nk).reshape(1, 1, 1, nk)
    return np.broadcast_to(np.asarray(mask_mod(b, h, q, k), dtype=bool), (bb, hb, nq, nk))


def _numpy_bits(pairs: np.ndarray) -> tuple[Any, Any, Any]:
    """(bit_index, bits_q, bits_k) of every pair (the reference of ``_cuda_bits``), or three Nones past the budget."""
    bb, hb, nq, nk = pairs.shape
    t = BIT_TILE
    index, slots = mixed_tile_index(_numpy_states(pairs, t), np)
    if slots * 2 * t * 8 > BITS_BUDGET:
        return None, None, None
    nqt, nkt = -(-nq // t), -(-nk // t)
    pad = np.ones((bb, hb, nqt * t, nkt * t), bool)  # pairs outside the problem read 1
    pad[..., :nq, :nk] = pairs
    tiles = pad.reshape(bb, hb, nqt, t, nkt, t).transpose(0, 1, 2, 4, 3, 5)[index >= 0]  # (slots, q rows, keys)
    weights = np.uint64(1) << np.arange(t, dtype=np.uint64)
    bits_q = (tiles.astype(np.uint64) * weights).sum(axis=2, dtype=np.uint64).reshape(-1)
    bits_k = (tiles.swapaxes(1, 2).astype(np.uint64) * weights).sum(axis=2, dtype=np.uint64).reshape(-1)
    return index, np.ascontiguousarray(bits_q), np.ascontiguousarray(bits_k)


def _numpy_states(pairs: np.ndarray, bs: int) -> np.ndarray:
    """The tile states of every pair's value."""
    bb, hb, nq, nk = pairs.shape
    nqb, nkb = -(-nq // bs), -(-nk // bs)
    pad = np.zeros((bb, hb, nqb * bs, nkb * bs), bool)
    pad[..., :nq, :nk] = pairs
    inside = np.zeros((nqb * bs, nkb * bs), bool)
    inside[:nq, :nk] = True
    tiles = pad.reshape(bb, hb, nqb, bs, nkb, bs).sum(axis=(3, 5))
    size = inside.reshape(nqb, bs, nkb, bs).sum(axis=(1, 3))
    return np.where(tiles == 0, EMPTY, np.where(tiles == size, FULL, PARTIAL)).astype(np.uint8)


#: The full runs' kernel (BlockMask.full_kv / full_q from the states): one source for every snippet.
RUNS_SOURCE = "block_mask_runs.cu"
#: The generated kernel: one thread block per tile; each thread ORs and ANDs its elements' mask, then the block.
_STATES_KERNEL = r"""
__global__ void cf_block_states(const __grid_constant__ cupyflash::AttentionParams p) {
  const int bs = p.bm_size, nqb = p.bm_nqb, nkb = p.bm_nkb;
  long long t = blockIdx.x;
  const int kb = t % nkb; t /= nkb;
  const int qb = t % nqb; t /= nqb;
  const int h = t % p.bm_hb;
  const int b = static_cast<int>(t / p.bm_hb);
  int any = 0, all = 1;
  for (int e = threadIdx.x; e < bs * bs; e += blockDim.x) {
    const int q = qb * bs + e / bs, k = kb * bs + e % bs;
    if (q < p.nq && k < p.nk) {
      const bool m = cupyflash::flex::User::mask_mod(p, b, h, q, k);
      any |= m;
      all &= m;
    }
  }
  any = __syncthreads_or(any);
  all = __syncthreads_and(all);
  if (threadIdx.x == 0) static_cast<unsigned char*>(p.o)[blockIdx.x] = any ? (all ? 2 : 1) : 0;
}
"""
#: The bits' kernel (a program of its own: one kernel a generated program, as NVRTC's ptxas report is read per program).
_BITS_KERNEL = r"""
// The bits of the mixed 64 x 64 tiles: block s takes slot s, tile p.q[s] (a flat (b, h, qt, kt) index); threads
// 0-63 write query row r's word to p.o (bits_q), threads 64-127 key r's to p.dq (bits_k). Pairs outside the
// problem read 1.
__global__ void cf_block_bits(const __grid_constant__ cupyflash::AttentionParams p) {
  const int nqt = (p.nq + 63) >> 6, nkt = (p.nk + 63) >> 6;
  long long t = static_cast<const long long*>(p.q)[blockIdx.x];
  const int kt = t % nkt; t /= nkt;
  const int qt = t % nqt; t /= nqt;
  const int h = t % p.bm_hb;
  const int b = static_cast<int>(t / p.bm_hb);
  const int r = threadIdx.x & 63;
  const bool keys = threadIdx.x >= 64;
  unsigned long long w = 0;
  for (int j = 0; j < 64; ++j) {
    const int q = qt * 64 + (keys ? j : r), k = kt * 64 + (keys ? r : j);
    const bool m = q >= p.nq || k >= p.nk || cupyflash::flex::User::mask_mod(p, b, h, q, k);
    w |= static_cast<unsigned long long>(m) << j;
  }
  static_cast<unsigned long long*>(keys ? p.dq : p.o)[64LL * blockIdx.x + r] = w;
}
"""


def _launch_snippet(spec: Any, aux: Any, name: str, blocks: int, threads: int, pointers: dict[str, Any],
                    **fields: int) -> None:  # fmt: skip
    """Launch one of the generated kernels above (spec's mask_mod pasted in) with params ``fields`` and the named
    pointer fields (arrays) besides aux's."""
    import cupy

    from . import flex
    from .kernels import build
    from .kernels.params import Params
    from .plans import LaunchPlan

    params = Params().set(**fields, **_aux_params(aux))
    kernel = {"cf_block_states": _STATES_KERNEL, "cf_block_bits": _BITS_KERNEL}[name]
    source = build.generated_source(name, spec.key, flex.generate(spec) + kernel)
    flex._specs[spec.key] = spec
    launch = build.Launch(LaunchPlan(source, name, (blocks, 1, 1), (threads, 1, 1), 0), params.to_bytes())
    arrays = {**pointers, **flex.aux_arrays(aux)}
    Params.write_pointers(launch.buffer, Params.pointer_values({n: a.data.ptr for n, a in arrays.items()}))
    launch.fire(cupy.cuda.get_current_stream().ptr)


def _tile_states(spec: Any, aux: Any, bb: int, hb: int, nq: int, nk: int, bs: int) -> Any:
    """uint8 (bb, hb, ceil(nq / bs), ceil(nk / bs)): each tile EMPTY, PARTIAL or FULL, on the device."""
    import cupy

    nqb, nkb = -(-nq // bs), -(-nk // bs)
    states = cupy.empty((bb, hb, nqb, nkb), dtype=np.uint8)
    _launch_snippet(spec, aux, "cf_block_states", states.size, 256, {"o": states}, nq=nq, nk=nk, bm_size=bs,
                    bm_nqb=nqb, bm_nkb=nkb, bm_bb=bb, bm_hb=hb)  # fmt: skip
    return states


def _cuda_states(spec: Any, aux: Any, bb: int, hb: int, nq: int, nk: int, bs: int) -> tuple[Any, tuple[Any, Any]]:
    """The states and the (full_kv, full_q) runs, on the device."""
    import cupy

    from .kernels import build

    states = _tile_states(spec, aux, bb, hb, nq, nk, bs)
    nqb, nkb = states.shape[-2:]
    full_runs = build.get_function(RUNS_SOURCE, "cf_full_runs")
    out = []
    for lines, n, inner, step in ((nqb, nkb, nkb, 1), (nkb, nqb, 1, nkb)):  # block rows, then block columns
        table = cupy.empty((bb, hb, lines, 2), dtype=np.int32)
        total = bb * hb * lines
        full_runs(((total + 255) // 256,), (256,), (states, table, np.int64(total), np.int32(lines), np.int32(n),
                                                    np.int64(nqb * nkb), np.int64(inner), np.int64(step)))  # fmt: skip
        out.append(table)
    return states, (out[0], out[1])


def _cuda_bits(spec: Any, aux: Any, bb: int, hb: int, nq: int, nk: int, states64: Any) -> tuple[Any, Any, Any]:
    """``_numpy_bits`` on the device (one synchronisation: the mixed tiles' count); ``states64``: the 64 x 64 tiles'
    states where the block mask's own tiles are those."""
    import cupy

    t = BIT_TILE
    if states64 is None:
        states64 = _tile_states(spec, aux, bb, hb, nq, nk, t)
    index, slots = mixed_tile_index(states64, cupy)
    if slots * 2 * t * 8 > BITS_BUDGET:
        return None, None, None
    bits_q = cupy.empty(max(slots, 1) * t, dtype=np.uint64)
    bits_k = cupy.empty(max(slots, 1) * t, dtype=np.uint64)
    if slots:
        tiles = cupy.flatnonzero(index.ravel() >= 0).astype(np.int64)
        _launch_snippet(spec, aux, "cf_block_bits", slots, 2 * t, {"q": tiles, "o": bits_q, "dq": bits_k},
                        nq=nq, nk=nk, bm_bb=bb, bm_hb=hb)  # fmt: skip
    return index, bits_q, bits_k


def _aux_params(aux: Any) -> dict[str, Any]:
    from .flex import aux_params, aux_values

    return aux_params(aux_values(aux))


def check_block_mask(block_mask: Any, full: tuple[int, ...], xp: str) -> None:
    """A block mask must come from ``create_block_mask`` for this call's Nq, Nk and batch/heads (or 1), on q's
    array library."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must come from cupyflash.create_block_mask; got {type(block_mask).__name__}")
    *batch, hq, nq, nk = full
    nb = int(np.prod(batch)) if batch else 1
    kind = "numpy" if isinstance(block_mask.states, np.ndarray) else "cupy"
    if kind != xp:
        raise TypeError(f"block_mask was made for {kind} arrays; this call has {xp} arrays")
    if (block_mask.nq, block_mask.nk) != (nq, nk) or block_mask.batch not in (1, nb) or block_mask.heads not in (1, hq):
        raise ValueError(f"block_mask was made for B={block_mask.batch}, H={block_mask.heads}, Nq={block_mask.nq}, "
                         f"Nk={block_mask.nk}; this call has B={nb}, H={hq}, Nq={nq}, Nk={nk}")  # fmt: skip
