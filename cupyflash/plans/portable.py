"""Launch geometry of the portable (SIMT) kernels: pure functions of shape and device limits.

Tile choices (all arithmetic is float32 in shared memory, whatever the input dtype):

- Threads form row groups of 16 lanes; a thread owns TM rows x (columns / 16) of every
  product, so each shared-memory load feeds TM or TN FMAs from registers. TM = 8 with
  64 x 64 tiles gives 12 float4 loads per 128 FMAs in S = Q K^T and 16 per 256 in P V.
- The head dim is padded to a multiple of 32 from ``D_PADS`` (zero-filled on load), a few
  instantiations instead of one per D. The O accumulator (TM x DP/16 floats per thread) sets
  the register budget, so larger DP takes fewer rows per thread or smaller tiles.
- ``min_blocks`` (forward) pins the register budget to that many blocks per SM; choices
  below were measured on an H200 (fp32, B=4, H=16, N=4096, D=128 and H=12, D=64 causal).
- Each table lists configurations fastest first; a plan takes the first whose shared
  memory fits the device (the later entries exist for 64 KB parts such as the T4 and the
  ~100 KB consumer parts). Every configuration compiles without spills (tests check it).
- ``kv_bufs = 2`` (forward): K_j and V_j get a shared buffer each and arrive by cp.async while
  the products run (``cuda_src/portable_forward.cu``), which hides the two global round trips a
  key tile costs a block that is alone on its SM (small grids, issue 12). Float32 only (cp.async
  cannot convert 16-bit inputs), sm_80+, and only where the extra buffer still lets ``min_blocks``
  blocks share an SM; elsewhere the next entry, the same tile with one buffer, runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from .. import _dtypes
from ..variants import BUILTIN, Variant
from . import DeviceLimits, LaunchPlan, blocks_by_smem, cdiv, grid_axes, grid_heads

FORWARD_SOURCE = "portable_forward.cu"
BACKWARD_SOURCE = "portable_backward.cu"
D_PADS = (32, 64, 128, 256)
MAX_GRID_Y = 65535
DqStrategy = Literal["atomic", "separate"]


@dataclass(frozen=True)
class Tile:
    """rows x cols of the S-like tile a block computes; TM rows per thread, LANES per row group."""

    rows: int
    cols: int
    tm: int
    lanes: int = 16
    min_blocks: int = 1  # forward only: blocks per SM the register allocation must allow
    kv_bufs: int = 1  # forward only: 2 = K_j and V_j in buffers of their own, copied by cp.async (float32, sm_80+)

    @property
    def threads(self) -> int:
        return self.rows // self.tm * self.lanes

    def targs(self) -> str:
        return f"{self.rows}, {self.cols}, {self.tm}, {self.lanes}"


# Forward: rows = query rows Br, cols = key columns Bc.
FORWARD_TILES: dict[int, tuple[Tile, ...]] = {
    32: (Tile(64, 64, 4, min_blocks=2, kv_bufs=2), Tile(64, 64, 4, min_blocks=2)),
    64: (Tile(64, 64, 8, min_blocks=3, kv_bufs=2), Tile(64, 64, 8, min_blocks=3)),  # 2 buffers: 3 blocks on H100
    # D=128: 64 x 32 with two buffers (77 KB, 3 blocks on an H100) 2.6% ahead of 64 x 64 with one (85 KB, 2 blocks);
    # 64 x 64 with two (118 KB) holds one block and is 6% behind (benchmarks/NOTES.md, session s9).
    128: (Tile(64, 32, 8, min_blocks=2, kv_bufs=2), Tile(64, 64, 8), Tile(64, 32, 8)),
    256: (Tile(64, 32, 4), Tile(32, 16, 4)),
}
# dK/dV kernel: rows = keys Bc (kept on chip), cols = queries Br streamed through.
KV_TILES: dict[int, tuple[Tile, ...]] = {
    32: (Tile(64, 32, 8),),
    64: (Tile(64, 64, 8), Tile(64, 32, 8), Tile(32, 32, 4)),
    128: (Tile(64, 64, 4), Tile(64, 32, 4), Tile(32, 16, 4)),
    256: (Tile(32, 32, 2), Tile(16, 8, 1, 8)),
}
# Separate-pass dQ kernel: rows = queries Br, cols = keys Bc.
DQ_TILES: dict[int, tuple[Tile, ...]] = {
    32: (Tile(64, 64, 4),),
    64: (Tile(64, 64, 8), Tile(64, 32, 8)),
    128: (Tile(64, 32, 8), Tile(32, 16, 4)),
    256: (Tile(32, 32, 4), Tile(16, 8, 2, 8)),
}


def padded_d(d: int) -> int:
    for dp in D_PADS:
        if d <= dp:
            return dp
    raise ValueError(f"head dim {d} exceeds {D_PADS[-1]}")


def _ld(width: int) -> int:
    return width + 4  # shared row stride in floats (portable_tile.cuh ld_of)


def forward_smem(dp: int, t: Tile) -> int:
    return 4 * ((t.rows + t.kv_bufs * t.cols) * _ld(dp) + t.rows * _ld(t.cols))  # Q_i, K_j/V_j (or K_j, V_j), P


def kv_smem(dp: int, t: Tile) -> int:
    bc, br = t.rows, t.cols  # K_j, V_j, Q_i, dO_i, P^T, dS^T, lse2, Delta
    return 4 * (2 * (bc + br) * _ld(dp) + 2 * bc * _ld(br) + 2 * br)


def dq_smem(dp: int, t: Tile) -> int:
    br, bc = t.rows, t.cols  # Q_i, dO_i, K_j, V_j, dS, lse2, Delta
    return 4 * (2 * (br + bc) * _ld(dp) + br * _ld(bc) + 2 * br)


def _pick(table: dict[int, tuple[Tile, ...]], smem, dp: int, limits: DeviceLimits,
          usable: Callable[[Tile, int], bool] = lambda t, nbytes: True) -> tuple[Tile, int]:  # fmt: skip
    """The first tile of ``table[dp]`` whose shared memory fits and that ``usable(tile, bytes)`` accepts."""
    for t in table[dp]:
        nbytes = smem(dp, t)
        if nbytes <= limits.max_shared_per_block and usable(t, nbytes):
            return t, nbytes
    raise ValueError(f"no portable tile for D_pad={dp} fits {limits.max_shared_per_block} B of shared memory")


def pipelines(t: Tile, dtype, nbytes: int, limits: DeviceLimits) -> bool:
    """May the forward use tile ``t`` with its two cp.async K/V buffers here (see the module docstring)?"""
    return (np.dtype(dtype) == _dtypes.FLOAT32 and limits.compute_capability >= 80
            and blocks_by_smem(nbytes, limits) >= t.min_blocks)  # fmt: skip


def ctype(dtype) -> str:
    return _dtypes.CTYPE[np.dtype(dtype)]


def fwd_name(ct: str, dp: int, t: Tile, policy: str) -> str:
    return f"portable_fwd<{ct}, {dp}, {t.targs()}, {t.min_blocks}, {t.kv_bufs}, {policy}>"


def kv_name(ct: str, dp: int, t: Tile, policy: str) -> str:
    return f"portable_bwd_kv<{ct}, {dp}, {t.targs()}, {policy}>"


def dq_name(ct: str, dp: int, t: Tile, policy: str) -> str:
    return f"portable_bwd_dq<{ct}, {dp}, {t.targs()}, {policy}>"


def delta_name(ct: str) -> str:
    return f"portable_bwd_delta<{ct}>"


def convert_name(ct: str) -> str:
    return f"portable_bwd_dq_convert<{ct}>"


@dataclass(frozen=True)
class Shape:
    """The shape numbers a launch depends on (one 4-D (B, H, N, D) call)."""

    b: int
    hq: int
    hk: int
    nq: int
    nk: int
    d: int
    dtype: np.dtype
    variant: Variant = Variant()
    total_q: int | None = None  # varlen: packed rows (b sequences; nq, nk are then max_seqlen_q/k)
    total_k: int | None = None

    @property
    def group(self) -> int:
        return self.hq // self.hk

    @property
    def query_heads(self) -> int:
        """The head axis of the grids over query tiles (plans.grid_heads: B*Hq dense, Hq varlen)."""
        return grid_heads(self.b, self.hq, self.total_q)

    @property
    def key_heads(self) -> int:
        return grid_heads(self.b, self.hk, self.total_k)

    def query_axes(self, rows: int) -> tuple[int, int]:
        """(heads, tiles) of a grid over query tiles of ``rows`` (grid_axes: compact for varlen)."""
        return grid_axes(self.b, self.hq, self.nq, rows, self.total_q)

    def key_axes(self, rows: int) -> tuple[int, int]:
        return grid_axes(self.b, self.hk, self.nk, rows, self.total_k)


def heads_fastest(heads: int) -> bool:
    """Grids are (tiles, B*H), one head's tiles together, unless B*H overflows gridDim.y."""
    return heads > MAX_GRID_Y


def _grid(tiles: int, heads: int) -> tuple[int, int, int]:
    return (heads, tiles, 1) if heads_fastest(heads) else (tiles, heads, 1)


@dataclass(frozen=True)
class PortableForwardPlan:
    shape: Shape
    d_pad: int
    tile: Tile
    launch: LaunchPlan

    @property
    def launches(self) -> tuple[LaunchPlan, ...]:
        return (self.launch,)


def forward_plan(s: Shape, limits: DeviceLimits) -> PortableForwardPlan:
    dp = padded_d(s.d)
    t, smem = _pick(FORWARD_TILES, forward_smem, dp, limits,
                    lambda t, nbytes: t.kv_bufs == 1 or pipelines(t, s.dtype, nbytes, limits))
    heads, tiles = s.query_axes(t.rows)
    grid = _grid(tiles, heads)  # one block per (Q_i tile, batch and query head)
    name = fwd_name(ctype(s.dtype), dp, t, s.variant.cpp_policy)
    # Two K/V buffers count on min_blocks blocks' shared memory per SM: ask for the largest carveout.
    lp = LaunchPlan(FORWARD_SOURCE, name, grid, (t.threads, 1, 1), smem, max_carveout=t.kv_bufs > 1)
    return PortableForwardPlan(s, dp, t, lp)


DELTA_THREADS = 256  # 8 warps, one query row each
CONVERT_THREADS = 256


@dataclass(frozen=True)
class PortableBackwardPlan:
    """Delta, then dK/dV (with dQ atomics or followed by the dQ pass), then the dQ conversion."""

    shape: Shape
    d_pad: int
    dq_strategy: DqStrategy
    delta: LaunchPlan
    kv: LaunchPlan
    dq: LaunchPlan  # portable_bwd_dq (separate) or portable_bwd_dq_convert (atomic)
    kv_tile: Tile | None = None  # the dK/dV kernel's tile: its cols are the query tiles of the dQ turns

    @property
    def launches(self) -> tuple[LaunchPlan, ...]:
        return (self.delta, self.kv, self.dq)


def backward_plan(s: Shape, limits: DeviceLimits, dq_strategy: DqStrategy = "atomic",
                  rows: int | None = None) -> PortableBackwardPlan:  # fmt: skip
    """``rows``: the per-row kernels' (Delta, dQ conversion) row count when it is not B * Hq * Nq (varlen:
    Hq * total_q)."""
    if dq_strategy not in ("atomic", "separate"):
        raise ValueError(f"dq_strategy must be 'atomic' or 'separate'; got {dq_strategy!r}")
    ct, dp = ctype(s.dtype), padded_d(s.d)
    rows = s.b * s.hq * s.nq if rows is None else rows
    delta_grid = (cdiv(rows, DELTA_THREADS // 32), 1, 1)
    delta = LaunchPlan(BACKWARD_SOURCE, delta_name(ct), delta_grid, (DELTA_THREADS, 1, 1), 0)
    kt, kv_bytes = _pick(KV_TILES, kv_smem, dp, limits)
    pol = s.variant.cpp_policy
    heads, tiles = s.key_axes(kt.rows)
    kv_grid = _grid(tiles, heads)  # one block per (K_j/V_j tile, batch and kv head)
    kv = LaunchPlan(BACKWARD_SOURCE, kv_name(ct, dp, kt, pol), kv_grid, (kt.threads, 1, 1), kv_bytes)
    if dq_strategy == "separate":
        qt, dq_bytes = _pick(DQ_TILES, dq_smem, dp, limits)
        heads, tiles = s.query_axes(qt.rows)
        dq_grid = _grid(tiles, heads)
        dq = LaunchPlan(BACKWARD_SOURCE, dq_name(ct, dp, qt, pol), dq_grid, (qt.threads, 1, 1), dq_bytes)
    else:
        # Grid-stride loop: enough blocks to fill the device, no more.
        blocks = max(1, min(cdiv(rows * s.d, CONVERT_THREADS), 32 * limits.sm_count))
        dq = LaunchPlan(BACKWARD_SOURCE, convert_name(ct), (blocks, 1, 1), (CONVERT_THREADS, 1, 1), 0)
    return PortableBackwardPlan(s, dp, dq_strategy, delta, kv, dq, kt)


def instantiations(variants: tuple[Variant, ...] = BUILTIN) -> list[tuple[str, str]]:
    """Every (source, name expression) the portable family can launch with the policies of ``variants``."""
    out: list[tuple[str, str]] = []
    for dtype in _dtypes.SUPPORTED:
        ct = ctype(dtype)
        for pol in (v.cpp_policy for v in variants):
            for dp in D_PADS:
                out += [(FORWARD_SOURCE, fwd_name(ct, dp, t, pol)) for t in FORWARD_TILES[dp]
                        if t.kv_bufs == 1 or np.dtype(dtype) == _dtypes.FLOAT32]  # fmt: skip
                out += [(BACKWARD_SOURCE, kv_name(ct, dp, t, pol)) for t in KV_TILES[dp]]
                out += [(BACKWARD_SOURCE, dq_name(ct, dp, t, pol)) for t in DQ_TILES[dp]]
        out += [(BACKWARD_SOURCE, delta_name(ct)), (BACKWARD_SOURCE, convert_name(ct))]
    return out
