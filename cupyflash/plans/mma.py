"""Launch geometry of the tensor-core ("mma") family: pure functions of shape and device limits.

Head dims are padded up to one of ``HEAD_DIMS`` (zero-filled columns cost flops, not accuracy);
each padded head dim has one forward and one backward tile configuration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..variants import BUILTIN, Variant
from . import DeviceLimits, LaunchPlan, cdiv, grid_axes
from .tensorcore import (CONVERT_LANES, DELTA_LANES, DELTA_LANES_F32, MAX_GRID_Y, BackwardPlan, ForwardPlan,
                         backward_plan_around, owns_dq, staged_policy, with_query_parts)

FORWARD_SOURCE = "mma_forward.cu"
BACKWARD_SOURCE = "mma_backward.cu"

#: Padded head dims that have kernels; D is rounded up to the next one.
HEAD_DIMS: tuple[int, ...] = (32, 64, 96, 128, 192, 256)

#: Bytes per element of the 16-bit types the family handles.
_ELEM = 2
#: Bytes per element of each ctype the family runs (float32: 3xTF32, cuda_src/mma_tf32.cuh).
ELEM_OF: dict[str, int] = {"__half": 2, "__nv_bfloat16": 2, "float": 4}


def padded_head_dim(d: int) -> int | None:
    """The smallest instantiated head dim >= d, or None past the largest."""
    for pd in HEAD_DIMS:
        if d <= pd:
            return pd
    return None


def _pitch(width: int) -> int:
    """Elements per smem row of a tile ``width`` wide (TileLayout in mma_primitives.cuh)."""
    return width if width % 64 == 0 else width + 8


@dataclass(frozen=True)
class ForwardConfig:
    """Tiles of mma_flash_fwd: Br query rows (kWarps warps of Br/kWarps rows), Bc keys, a kStages ring.
    ``elem``: bytes per element of the kernel's T, 2 (float16/bfloat16) or 4 (float32, whose tile of D columns is a
    16-bit tile of 2 D columns in shared memory: FloatTile in cuda_src/mma_tf32.cuh)."""

    d: int  # padded head dim
    br: int
    bc: int
    warps: int
    stages: int = 2
    min_blocks: int = 1
    elem: int = _ELEM

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def width(self) -> int:
        """A tile row in 16-bit units (TileLayout's width)."""
        return self.d * self.elem // 2

    @property
    def shared_bytes(self) -> int:
        return (self.br + 2 * self.stages * self.bc) * _pitch(self.width) * 2

    def name(self, ctype: str, policy: str) -> str:
        if ELEM_OF[ctype] != self.elem:
            raise ValueError(f"{ctype} has {ELEM_OF[ctype]}-byte elements; this forward configuration {self.elem}")
        return (
            f"mma_flash_fwd<{ctype}, {self.d}, {self.br}, {self.bc}, {self.warps}, {self.stages}, {self.min_blocks}, "
            f"{policy}>"
        )


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles of mma_flash_bwd: Bc = 16 * key_warps keys per block, Br query rows per step;
    d_split > 1 splits the dK/dV columns over more warps (which recompute S^T and dP^T)."""

    d: int
    br: int
    key_warps: int
    d_split: int = 1
    stages: int = 2  # depth of the Q_i/dO_i cp.async ring
    min_blocks: int = 1
    dp_chunks: int = 1  # dP^T computed in this many query chunks (fewer live registers)
    elem: int = _ELEM  # bytes per element: 2 (fp16/bf16), 4 (float32, 3xTF32: tiles of 2 d 16-bit units a row)

    @property
    def bc(self) -> int:
        return 16 * self.key_warps

    @property
    def warps(self) -> int:
        return self.key_warps * self.d_split

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def shared_bytes(self) -> int:
        w = self.elem // _ELEM  # 16-bit units per element: a float tile is TileLayout<2 d> (mma_tf32.cuh)
        kv = 2 * self.bc * _pitch(w * self.d) * _ELEM
        q_do = 2 * self.stages * self.br * _pitch(w * self.d) * _ELEM  # Q_i and dO_i ring
        ds = self.bc * _pitch(w * self.br) * _ELEM  # dS^T in the element type (float32: not rounded)
        stats = 2 * self.stages * self.br * 4  # lse and Delta ring
        return kv + q_do + ds + stats

    def name(self, ctype: str, policy: str, own_dq: bool = False) -> str:
        if ELEM_OF[ctype] != self.elem:
            raise ValueError(f"{ctype} has {ELEM_OF[ctype]}-byte elements; this backward configuration {self.elem}")
        return (
            f"mma_flash_bwd<{ctype}, {self.d}, {self.br}, {self.key_warps}, {self.d_split}, {self.stages}, "
            f"{self.min_blocks}, {self.dp_chunks}, {policy}{', true' if own_dq else ''}>"  # kOwnDQ: dq_own.cuh
        )


@dataclass(frozen=True)
class Backward2DConfig:
    """Tiles of mma_flash_bwd2d (FlashAttention-2's 2-D warp layout): Bc keys x Br queries per step,
    S^T/dP^T tiled s_key_warps (keys) x the rest (queries), dK/dV v_key_warps (keys) x the rest
    (columns), dQ q_row_warps (queries) x the rest (columns); P^T and dS^T go through smem."""

    d: int
    br: int
    bc: int
    warps: int = 8
    s_key_warps: int = 4
    v_key_warps: int = 4
    q_row_warps: int = 2
    stages: int = 2
    min_blocks: int = 1
    packed_p: bool = False  # P^T kept as 16-bit values next to dP^T (fewer registers, one more rounding)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def shared_bytes(self) -> int:
        kv = 2 * self.bc * _pitch(self.d) * _ELEM
        q_do = 2 * self.stages * self.br * _pitch(self.d) * _ELEM
        p_ds = 2 * self.bc * _pitch(self.br) * _ELEM  # P^T and dS^T
        stats = 2 * self.stages * self.br * 4
        return kv + q_do + p_ds + stats

    def name(self, ctype: str, policy: str, own_dq: bool = False) -> str:
        return (
            f"mma_flash_bwd2d<{ctype}, {self.d}, {self.br}, {self.bc}, {self.warps}, {self.s_key_warps}, "
            f"{self.v_key_warps}, {self.q_row_warps}, {self.stages}, {self.min_blocks}, "
            f"{'true' if self.packed_p else 'false'}, {policy}{', true' if own_dq else ''}>"  # kOwnDQ: dq_own.cuh
        )


AnyBackwardConfig = BackwardConfig | Backward2DConfig


# Measured on an H200 (benchmarks/dev_mma.py). D = 64 and 128 use FlashAttention-2's split:
# 4 warps of 32 query rows each, so every K/V fragment read from smem feeds two mma; at 255/222
# registers two blocks fit per SM (+20-25% over 8 warps of 16 rows, which ran at 1 block/SM and
# was bound by ldmatrix traffic and latency). The other head dims keep the 16-row split (verified,
# not tuned). Every instantiation compiles spill-free for sm_80/86/89/90a (tests/test_compile.py).
FORWARD_CONFIGS: dict[int, ForwardConfig] = {
    32: ForwardConfig(32, br=128, bc=128, warps=8),
    64: ForwardConfig(64, br=128, bc=64, warps=4),
    96: ForwardConfig(96, br=128, bc=64, warps=8),
    128: ForwardConfig(128, br=128, bc=64, warps=4),
    192: ForwardConfig(192, br=64, bc=32, warps=4),
    256: ForwardConfig(256, br=64, bc=16, warps=4),  # bc=32 spills 4 B under NVRTC 13.0 on sm_90a
}

# float32 (3xTF32, elem = 4): every tile is twice the bytes of the 16-bit one, and each product is three m16n8k8 mma
# on hi/lo parts split in registers (mma_tf32.cuh). Each key tile's P V goes to a fresh accumulator that joins O in
# the rescale's FFMA (mma_forward.cu: the tensor cores' accumulation truncates, and straight into O over N = 4096 keys
# it drifted 2.9e-5 relative, over the 1e-5 bound; now ~1e-6), so a strip holds O and P V: 2 D / 8 * 4 floats. So one
# 16-row strip a warp (kM = 1) and 8 warps (Br = 128) at every D. NVRTC 13.5 registers, built-in policies, sm_80 /
# sm_90a: D = 32 (Bc 64) 150-236, D = 64 (Bc 64) 186-204, D = 96 (Bc 32) 215-251, D = 128 (Bc 32) 234-255, no
# spill; mask + bias arrays at 255 with 4-52 B (the 16-bit forwards' array allowance). One block an SM (256 threads
# at <= 255 registers: at most 64K / 256). Measured on an H100 against two strips a warp at D = 64 (which spill
# with the fresh accumulator) and one strip of 4 warps: benchmarks/NOTES.md, "float32 on tensor cores".
# D = 192/256 are left to the portable family (kernels.mma.supports): O and P V alone would take 192-256 registers.
FORWARD_CONFIGS_F32: dict[int, ForwardConfig] = {
    32: ForwardConfig(32, br=128, bc=64, warps=8, elem=4),
    64: ForwardConfig(64, br=128, bc=64, warps=8, elem=4),
    96: ForwardConfig(96, br=128, bc=32, warps=8, elem=4),
    128: ForwardConfig(128, br=128, bc=32, warps=8, elem=4),
}
# Where shared memory is short of the table (sm_86/sm_89: 99 KB a block; D = 128 takes 128 KB): Bc 16 (96 KB,
# 219-229 registers on sm_86), built so that float32 runs wherever the 16-bit forward does, not tuned.
FORWARD_FALLBACKS_F32: dict[int, tuple[ForwardConfig, ...]] = {
    128: (ForwardConfig(128, br=128, bc=16, warps=8, elem=4),),
}

# float32 grids that leave SMs idle take tiles of half the rows (forward) or keys (backward): twice the blocks, each
# with half the work, since one block of the tables keeps an SM busy alone (one block an SM). Used where the table's
# grid fills at most half the SMs, or all of them when tiles differ in work (causal: the longest-first order balances
# finer tiles better); not where the table's backward owns dQ (one launch, kOwnDQ). Measured through the API
# (benchmarks/dev_f32_small.py, H100, 132 SMs, GPU us per call): B=1 H=16 N=512 (64 blocks) forward D = 64
# 49.4 -> 32.8, backward D = 64 108.3 -> 82.6, D = 128 218.1 -> 166.4; causal B=4 H=12 N=256 D = 64 (96 blocks)
# forward 28.1 -> 24.1, backward 63.4 -> 53.3; non-causal at 96-128 blocks they lost (0.70-0.92x).
SMALL_GRID_FORWARD_F32: dict[int, ForwardConfig] = {
    64: ForwardConfig(64, br=64, bc=32, warps=4, elem=4),  # D = 128 with Br 64, Bc 32: 4 B of spill (sm_80), 1.09x
}
SMALL_GRID_BACKWARD_F32: dict[int, BackwardConfig] = {
    64: BackwardConfig(64, br=64, key_warps=4, elem=4),
    128: BackwardConfig(128, br=32, key_warps=4, elem=4),
}


# Mask/bias arrays (issue 17): the float32 kernels stage their Br x Bc tiles in shared memory, one a K/V ring slot
# (forward) or a Q_i/dO_i ring slot (backward), where they fit (plans.tensorcore.staged_policy: the forward at
# D = 64/128, the backward at D = 64 and with a mask alone at D = 128; spill-free, NVRTC 13.5 sm_80/sm_90a); the
# 16-bit forward (kM = 2 strips a warp) spilled 28-492 B staged against <= 64 B reading them through L1, so the
# 16-bit kernels keep that.


def _policy_and_smem(cfg: AnyBackwardConfig | ForwardConfig, variant: Variant, limits: DeviceLimits
                     ) -> tuple[str, int]:  # fmt: skip
    """(C++ policy, shared bytes) of a main kernel: float32 stages its mask/bias tiles (see above), a tile a ring
    slot; the 16-bit kernels read them through L1."""
    if getattr(cfg, "elem", _ELEM) == 4:
        return staged_policy(variant, cfg.br, cfg.bc, cfg.stages, cfg.shared_bytes, limits)
    return variant.cpp_policy, cfg.shared_bytes


def small_grid(blocks: int, longest_first: bool, sm_count: int) -> bool:
    """Does a float32 grid of ``blocks`` table tiles leave enough SMs idle for the half tiles (SMALL_GRID_*_F32)?"""
    return blocks * (1 if longest_first else 2) <= sm_count


def _small_grid_config(table: AnyBackwardConfig | ForwardConfig, small: dict, blocks: int, variant: Variant,
                       limits: DeviceLimits) -> AnyBackwardConfig | ForwardConfig:
    """``table``, or its half-size float32 tile where the table's grid of ``blocks`` leaves SMs idle."""
    alt = small.get(table.d) if getattr(table, "elem", _ELEM) == 4 else None
    if alt is None or alt.shared_bytes > limits.max_shared_per_block:
        return table
    return alt if small_grid(blocks, variant.longest_first, limits.sm_count) else table


#: The most query rows one block of the float32 backward sums into its dK_j/dV_j (group x Nq, or a query part's
#: share of them). The tensor cores add into their accumulators with truncation, a bias that grows with the length of
#: a sum: the forward sums P V a key tile at a time (exact at any N), but the backward's dK_j/dV_j sum over every
#: query of the block in registers: measured 3.0e-5 relative at 4096 rows, 5.9e-5 at 8192 (8.8e-5 causal) and
#: 1.16e-4 at 16384 (GQA, group 4 x 4096), against the 1e-4 bound (H100, benchmarks/dev_f32_long.py). Flushing them
#: to dk/dv every 1024 queries spilled 160-320 B at D = 128 (benchmarks/NOTES.md); past this many rows the plan
#: splits the query tiles over blocks instead (query_parts).
MAX_ROWS_F32 = 4096

#: The most query parts a float32 backward takes (so group x Nq <= MAX_Q_PARTS x MAX_ROWS_F32 on tensor cores, the
#: rest on the portable family): each part costs a float32 copy of dk and dv in scratch.
MAX_Q_PARTS = 4


def query_parts(group: int, nq: int, br: int, varlen: bool = False) -> int | None:
    """How many blocks split each key tile's query tiles (the float32 backward's grid z; cuda_src/mma_bwd_tf32.cuh
    query_part: part z takes tiles [z per, (z + 1) per), per = cdiv(cdiv(nq, br), parts)) so that no block sums more
    than MAX_ROWS_F32 rows of its group's queries; None past MAX_Q_PARTS (or past one part for varlen packs, whose
    partial sums the kernels do not split)."""
    tiles = cdiv(nq, br)
    for parts in range(1, 2 if varlen else MAX_Q_PARTS + 1):
        if group * cdiv(tiles, parts) * br <= MAX_ROWS_F32:
            return parts
    return None

#: The largest head dim the float32 forward takes (FORWARD_CONFIGS_F32).
MAX_D_F32 = max(FORWARD_CONFIGS_F32)

# One block of 8 warps per SM (dK_j/dV_j accumulators: D f32 registers per thread at kDSplit = 1).
# D = 128 takes FlashAttention-2's 2-D warp layout (Br = 64, Bc = 128; S^T/dP^T in 32 x 32 warp tiles, P^T
# and dS^T through smem): 0.45 ldmatrix per mma instead of 0.70 for the key-major strips with Br = 32,
# +13-17% measured on an H200 (the key-major kernel was bound by shared-memory fragment reads). A 3-deep
# Q_i/dO_i ring gave +1-2% (H100/H200 only: 198 KB), 16-bit P^T next to dP^T nothing, and 4 warps at 2 blocks
# per SM (Bc = 64) -9%. D = 64 keeps the key-major kernel with FlashAttention-2's Br = 128 (dP^T in 2 query
# chunks to fit 255 registers): at D = 64 the 2-D layout measured 4-10% slower (its P^T round trip through
# smem costs as much as the fragment reads it saves). See benchmarks/NOTES.md.
BACKWARD_CONFIGS: dict[int, AnyBackwardConfig] = {
    32: BackwardConfig(32, br=64, key_warps=8),
    64: BackwardConfig(64, br=128, key_warps=8, dp_chunks=2),
    96: BackwardConfig(96, br=64, key_warps=8),
    128: Backward2DConfig(128, br=64, bc=128),
    192: BackwardConfig(192, br=32, key_warps=4, d_split=2),
    256: BackwardConfig(256, br=32, key_warps=2, d_split=4),
}

# Smaller tiles for parts whose shared memory per block is short of the configuration above
# (130 KB at D = 64): e.g. 99 KB on sm_86/sm_89, where D = 64 with Br = 64 needs 81 KB.
BACKWARD_FALLBACKS: dict[int, BackwardConfig] = {
    64: BackwardConfig(64, br=64, key_warps=8),
}


# float32 (3xTF32 on m16n8k8, cuda_src/mma_bwd_tf32.cuh): every tile is twice the bytes of a 16-bit one and the
# dK_j/dV_j accumulators are the same D f32 registers a thread (kDSplit = 1), beside P^T (Br / 2) and dP^T (Br / 2
# a chunk) and the split hi/lo operands. 8 key warps (Bc = 128) share each Q_i/dO_i tile, and Br shrinks with D so
# that K_j, V_j and a 2-deep Q_i/dO_i ring fit one block an SM (H100: 227 KB a block, 228 KB an SM, 64K registers):
#   D = 32:  Br = 64, 97 KB: one block of 8 warps an SM by registers (182, NVRTC 13.5 sm_90a: two would need <= 128)
#   D = 64:  Br = 64, 161 KB: one block (acc 64 + P^T 32 + dP^T 32; 204 registers)
#   D = 96:  Br = 32, 170 KB: one block (acc 96 + P^T 16 + dP^T 16; 191 registers)
#   D = 128: Br = 32, 209 KB: one block (acc 128 + P^T 16 + dP^T 16; 225 registers); a d split would redo S^T and
#            dP^T (+40% flops)
# Not yet tuned on a GPU (benchmarks/dev_mma_f32_bwd.py --sweep times alternatives). D = 192/256 are not built for
# float32 (dK_j/dV_j alone would take 192-256 registers, or a d split).
BACKWARD_CONFIGS_F32: dict[int, BackwardConfig] = {
    32: BackwardConfig(32, br=64, key_warps=8, elem=4),
    64: BackwardConfig(64, br=64, key_warps=8, elem=4),
    96: BackwardConfig(96, br=32, key_warps=8, elem=4),
    128: BackwardConfig(128, br=32, key_warps=8, elem=4),
}

# Smaller float32 tiles where shared memory per block is short of the above, tried in order. An A100 (163 KB) runs
# every table entry but D = 128, which gets 4 key warps (137 KB, 1 block of 4 warps an SM); the 99 KB of sm_86/sm_89
# take the others: 4 key warps at D = 64 (73 KB), Br = 16 at D = 96 (77 KB) and 2 key warps, Br = 16 at D = 128
# (67 KB): built so that float32 runs wherever the 16-bit backward does, not tuned.
BACKWARD_FALLBACKS_F32: dict[int, tuple[BackwardConfig, ...]] = {
    64: (BackwardConfig(64, br=32, key_warps=4, elem=4),),
    96: (BackwardConfig(96, br=16, key_warps=4, elem=4),),
    128: (BackwardConfig(128, br=32, key_warps=4, elem=4), BackwardConfig(128, br=16, key_warps=2, elem=4)),
}

def _heads_on_x(longest_first: bool, heads: int, tiles: int = 1) -> bool:
    """Grid (B*H, tiles) -- heads fastest -- when tiles differ in work (causal: every head's longest tiles go first);
    (tiles, B*H) otherwise, so that one head's blocks run together and share its K/V (forward) or
    Q/dO and dQ lines (backward) through L2; (B*H, tiles) also when B*H overflows gridDim.y, and (tiles, H) when
    the tiles would (a large varlen pack)."""
    if tiles > MAX_GRID_Y and heads <= MAX_GRID_Y:
        return False
    return longest_first or heads > MAX_GRID_Y


def forward_config(d: int, limits: DeviceLimits, elem: int = _ELEM) -> ForwardConfig | None:
    """The forward's tiles for head dim ``d`` and ``elem``-byte elements (4: float32, FORWARD_CONFIGS_F32), or None
    (no padded head dim, none for float32 past D = 128, or short of shared memory)."""
    pd = padded_head_dim(d)
    if pd is None:
        return None
    if elem != 4:
        cfg = FORWARD_CONFIGS[pd]
        return cfg if cfg.shared_bytes <= limits.max_shared_per_block else None
    tried = (FORWARD_CONFIGS_F32[pd], *FORWARD_FALLBACKS_F32.get(pd, ())) if pd in FORWARD_CONFIGS_F32 else ()
    return next((c for c in tried if c.shared_bytes <= limits.max_shared_per_block), None)


def backward_config(d: int, limits: DeviceLimits, elem: int = _ELEM) -> AnyBackwardConfig | None:
    """The backward tiles for head dim d (``elem``: bytes per element; 4 is float32, D <= 128), the first of the
    table's and its fallbacks' that fits the device's shared memory, or None."""
    pd = padded_head_dim(d)
    if pd is None:
        return None
    if elem == 4:  # float32
        candidates: tuple[AnyBackwardConfig | None, ...] = (
            (BACKWARD_CONFIGS_F32[pd], *BACKWARD_FALLBACKS_F32.get(pd, ())) if pd in BACKWARD_CONFIGS_F32 else ())
    else:
        candidates = (BACKWARD_CONFIGS[pd], BACKWARD_FALLBACKS.get(pd))
    for cfg in candidates:
        if cfg is not None and cfg.shared_bytes <= limits.max_shared_per_block:
            return cfg
    return None


def plan_forward(
    batch: int,
    hq: int,
    nq: int,
    d: int,
    ctype: str,
    limits: DeviceLimits,
    config: ForwardConfig | None = None,
    variant: Variant = Variant(),
    total: int | None = None,
) -> ForwardPlan:
    """Grid over (B*Hq, query tiles), in the order _heads_on_x picks; the kernel counts query tiles down
    from the last (most work under causal). ``total``: varlen's packed query rows (grid_axes)."""
    cfg = config or forward_config(d, limits, ELEM_OF[ctype])
    if cfg is None or cfg.shared_bytes > limits.max_shared_per_block:
        raise ValueError(f"no mma forward configuration for D={d} ({ctype}) within {limits.max_shared_per_block} B "
                         "of smem")
    heads, tiles = grid_axes(batch, hq, nq, cfg.br, total)
    if config is None:
        cfg = _small_grid_config(cfg, SMALL_GRID_FORWARD_F32, heads * tiles, variant, limits)
        heads, tiles = grid_axes(batch, hq, nq, cfg.br, total)
    on_x = _heads_on_x(variant.longest_first, heads, tiles)
    grid = (heads, tiles, 1) if on_x else (tiles, heads, 1)
    policy, smem = _policy_and_smem(cfg, variant, limits)
    main = LaunchPlan(FORWARD_SOURCE, cfg.name(ctype, policy), grid, (cfg.threads, 1, 1), smem, max_carveout=True)
    return ForwardPlan(cfg, main, on_x)


def plan_backward(
    batch: int,
    hq: int,
    hk: int,
    nq: int,
    nk: int,
    d: int,
    ctype: str,
    limits: DeviceLimits,
    config: AnyBackwardConfig | None = None,
    variant: Variant = Variant(),
    total: int | None = None,
) -> BackwardPlan:
    """Grid over (B*Hk, key tiles) for the main kernel, in the order _heads_on_x picks; one warp per query
    row for the helpers, which the main kernel does itself when a key tile covers every key (``owns_dq``)."""
    cfg = config or backward_config(d, limits, ELEM_OF[ctype])
    if cfg is None or cfg.shared_bytes > limits.max_shared_per_block:
        raise ValueError(f"no mma backward configuration for D={d} ({ctype}) within {limits.max_shared_per_block} B "
                         "of smem")
    f32 = getattr(cfg, "elem", _ELEM) == 4
    heads, tiles = grid_axes(batch, hk, nk, cfg.bc, total)
    # A block that owns dQ visits every query row of its kv head, so query parts rule it out (dq_own.cuh's
    # own_rows writes Delta, dsinks and dQ = 0 for all of them).
    own = owns_dq(tiles, total) and (not f32 or query_parts(hq // hk, nq, cfg.br, total is not None) == 1)
    if config is None and not own:  # half tiles only add key tiles, so the kernel still does not own dQ
        cfg = _small_grid_config(cfg, SMALL_GRID_BACKWARD_F32, heads * tiles, variant, limits)
        heads, tiles = grid_axes(batch, hk, nk, cfg.bc, total)
    on_x = _heads_on_x(variant.longest_first, heads, tiles)
    grid = (heads, tiles, 1) if on_x else (tiles, heads, 1)
    policy, smem = _policy_and_smem(cfg, variant, limits)
    main = LaunchPlan(BACKWARD_SOURCE, cfg.name(ctype, policy, own), grid, (cfg.threads, 1, 1), smem,
                      max_carveout=True)
    plan = backward_plan_around(cfg, main, on_x, batch, hq, nq, d, ctype, own)
    if not f32:
        return plan
    parts = query_parts(hq // hk, nq, cfg.br, total is not None)
    if parts is None:
        raise ValueError(f"float32 backward: {hq // hk} x {nq} query rows a kv head are past {MAX_Q_PARTS} parts of "
                         f"{MAX_ROWS_F32}")
    return with_query_parts(plan, parts, batch * hk * nk, ctype)


def instantiations(ctypes: tuple[str, ...] = ("__half", "__nv_bfloat16"), variants: tuple[Variant, ...] = BUILTIN,
                   f32: bool = True) -> list[tuple[str, str]]:  # fmt: skip
    """Every (source, name expression) the family can launch with the policies of ``variants``: the 16-bit
    ``ctypes``' forwards and backwards, and the float32 forwards and backwards (``f32``)."""
    out: list[tuple[str, str]] = []
    for ct in ctypes:
        for pol in (v.cpp_policy for v in variants):
            out += [(FORWARD_SOURCE, c.name(ct, pol)) for c in FORWARD_CONFIGS.values()]
            out += [(BACKWARD_SOURCE, c.name(ct, pol)) for c in BACKWARD_CONFIGS.values()]
            out += [(BACKWARD_SOURCE, c.name(ct, pol)) for c in BACKWARD_FALLBACKS.values()]
        out += [(BACKWARD_SOURCE, f"mma_bwd_delta<{ct}, {lanes}>") for lanes in DELTA_LANES]
        out += [(BACKWARD_SOURCE, f"mma_bwd_dq_convert<{ct}, {lanes}>") for lanes in CONVERT_LANES]
    if f32:
        for pol in (v.cpp_policy for v in variants):
            out += [(FORWARD_SOURCE, c.name("float", pol)) for c in forward_configs_f32()]
        out += backward_instantiations_f32(variants)
    return out


def forward_configs_f32() -> list[ForwardConfig]:
    """Every float32 forward configuration (tables, fallbacks and small-grid tiles)."""
    return [*FORWARD_CONFIGS_F32.values(), *(c for cs in FORWARD_FALLBACKS_F32.values() for c in cs),
            *SMALL_GRID_FORWARD_F32.values()]


def backward_configs_f32() -> list[BackwardConfig]:
    """Every float32 backward configuration (tables, fallbacks and small-grid tiles), each once."""
    out: list[BackwardConfig] = []
    for cfg in (*BACKWARD_CONFIGS_F32.values(), *(c for cs in BACKWARD_FALLBACKS_F32.values() for c in cs),
                *SMALL_GRID_BACKWARD_F32.values()):
        if cfg not in out:
            out.append(cfg)
    return out


def backward_instantiations_f32(variants: tuple[Variant, ...] = BUILTIN) -> list[tuple[str, str]]:
    """The float32 backward's (source, name expression) pairs: the main kernel of every configuration with the
    policies of ``variants``, and the Delta and dQ-conversion kernels."""
    out: list[tuple[str, str]] = []
    for pol in (v.cpp_policy for v in variants):
        out += [(BACKWARD_SOURCE, c.name("float", pol)) for c in backward_configs_f32()]
    out += [(BACKWARD_SOURCE, f"mma_bwd_delta<float, {lanes}>") for lanes in DELTA_LANES_F32]
    out += [(BACKWARD_SOURCE, f"mma_bwd_dq_convert<float, {lanes}>") for lanes in CONVERT_LANES]
    out += [(BACKWARD_SOURCE, f"mma_bwd_kv_combine<float, {lanes}>") for lanes in CONVERT_LANES]
    return out
