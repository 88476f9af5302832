"""Launch geometry of the Hopper kernels ("wgmma" family, sm_90a): pure functions of shape and limits.

Head dims are padded to 64 or 128 (the kernel's tiles are 64-column slabs of the 128-byte swizzle);
heads of 32 or fewer stay with the mma family, where padding to 64 would double the work.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..variants import BUILTIN, Variant
from . import DeviceLimits, LaunchPlan, cdiv, grid_axes
from .tensorcore import MAX_GRID_Y, BackwardPlan, ForwardPlan, backward_plan_around, owns_dq, staged_policy

FORWARD_SOURCE = "wgmma_forward.cu"
FORWARD_WS_SOURCE = "wgmma_forward_ws.cu"  # the warp-specialised forward (wgmma_flash_fwd_ws)
BACKWARD_SOURCE = "wgmma_backward.cu"

#: The compute capability whose "a" target the kernels are built for (wgmma runs on 9.0 only).
COMPUTE_CAPABILITY = 90
ARCH = "sm_90a"

#: Head dims handled: (MIN_D, MAX_D], padded up to a multiple of 64.
MIN_D, MAX_D = 32, 128

_ELEM = 2
_ALIGN_SLACK = 1024  # the kernel aligns its smem base to 1024 bytes (the swizzle period)


def padded_head_dim(d: int) -> int | None:
    return 64 * cdiv(d, 64) if MIN_D < d <= MAX_D else None


@dataclass(frozen=True)
class ForwardConfig:
    """Tiles of wgmma_flash_fwd: Br = 64 * warpgroups query rows, Bc keys, a kStages K/V ring, and the
    blocks per SM that the register budget must leave room for.

    ``ws``: the warp-specialised kernel wgmma_flash_fwd_ws instead (cuda_src/wgmma_forward_ws.cu): one producer
    warpgroup that copies beside ``warpgroups`` consumer warpgroups (2 or 3) that compute, one block per SM (its
    setmaxnreg split assumes the whole register file), and the ring's 4 * stages mbarriers after the tiles."""

    d: int  # padded head dim, 64 or 128
    bc: int
    warpgroups: int = 2  # warpgroups that compute (the consumers, with ws)
    stages: int = 3  # tile t+1 loads while P_{t-1} V_{t-1} still reads tile t-1
    min_blocks: int = 1
    ws: bool = False
    persistent: bool = False  # ws only: at most a block an SM, each walking several query tiles (persistent_by_default)

    def __post_init__(self) -> None:
        if self.ws and (self.warpgroups not in (2, 3) or self.min_blocks != 1 or self.stages < 2):
            raise ValueError(f"the warp-specialised forward takes 2 or 3 consumer warpgroups, one block per SM and "
                             f"2 or more stages (got {self})")  # fmt: skip
        if self.persistent and not self.ws:
            raise ValueError(f"only the warp-specialised forward has a persistent form (got {self})")

    @property
    def br(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * (self.warpgroups + self.ws)

    @property
    def source(self) -> str:
        return FORWARD_WS_SOURCE if self.ws else FORWARD_SOURCE

    @property
    def shared_bytes(self) -> int:
        # FULL_K, FULL_V, EMPTY_K, EMPTY_V per slot, and persistent blocks' Q_EMPTY
        barriers = (4 * self.stages + self.persistent) * 8 if self.ws else 0
        return (self.br + 2 * self.stages * self.bc) * self.d * _ELEM + barriers + _ALIGN_SLACK

    def name(self, ctype: str, policy: str, tma: bool = False) -> str:
        if tma and not self.ws:
            raise ValueError("TMA copies are the ws forward's producer's (kTma needs ws)")
        if self.ws:
            # kPersistent, kTma: trailing defaults (false) left out
            flags = [self.persistent, tma]
            while flags and not flags[-1]:
                flags.pop()
            tail = "".join(f", {'true' if f else 'false'}" for f in flags)
            return f"wgmma_flash_fwd_ws<{ctype}, {self.d}, {self.bc}, {self.warpgroups}, {self.stages}, {policy}{tail}>"
        return (
            f"wgmma_flash_fwd<{ctype}, {self.d}, {self.bc}, {self.warpgroups}, {self.stages}, {self.min_blocks}, "
            f"{policy}>"
        )


# Measured on an H200 (benchmarks/dev_wgmma.py, bf16, TFLOP/s at N = 1024 / 4096 / 16384 non-causal; see
# benchmarks/NOTES.md). D = 64: Bc = 64 with two blocks per SM (127 registers, 81 KB) 296 / 351 / 359, ahead
# of Bc = 128 at one block (244 / 292 / 310) and of three warpgroups (243 / 318 / 352). D = 128: Bc = 128
# 299 / 389 / 430, ahead of Bc = 64 with two or three warpgroups (279 / 366 / 407, 276 / 379 / 415).
FORWARD_CONFIGS: dict[int, ForwardConfig] = {
    64: ForwardConfig(64, bc=64, stages=4, min_blocks=2),
    128: ForwardConfig(128, bc=128, stages=3),
}
#: With mask/bias arrays (issue 17) the forward stages two Br x Bc tiles of them beside its K/V ring
#: (score_tile.cuh), so its ring is shorter: D = 64 keeps two blocks per SM with a bf16 bias (3 stages: 103 KB),
#: D = 128 goes to Bc = 64 (the Bc = 128 ring alone takes 225 KB).
ARRAY_FORWARD_CONFIGS: dict[int, ForwardConfig] = {
    64: ForwardConfig(64, bc=64, stages=3, min_blocks=2),
    128: ForwardConfig(128, bc=64, stages=3),
}


#: The warp-specialised forward (wgmma_flash_fwd_ws; benchmarks/NOTES.md, "Warp-specialised Hopper forward"): one
#: producer warpgroup, FlashAttention-3's register split and ping-pong. D = 128: two consumers (Br = 128, the
#: lockstep kernel's tile), 24 / 240 registers. D = 64: three consumers (Br = 192) with Bc = 128, 32 / 160 registers,
#: FlashAttention-3's hdim-64 tile; one block per SM where the lockstep kernel runs two.
WS_FORWARD_CONFIGS: dict[int, ForwardConfig] = {
    64: ForwardConfig(64, bc=128, warpgroups=3, stages=4, ws=True),
    128: ForwardConfig(128, bc=128, warpgroups=2, stages=3, ws=True),
}
#: Per padded head dim: does a call that the warp-specialised forward takes (ws_unsupported) get it by default?
#: Measured through the API against the lockstep kernel (benchmarks/dev_ws_ab.py, H100, bf16, B*N = 16k, N 1k-16k):
#: 1.05-1.21x at D = 64 and 1.03-1.11x at D = 128 on 18 of 20 shapes, the two others D = 64 causal at N = 1k (0.85x:
#: few 192-row tiles a head, one block an SM; WS_MIN_CAUSAL_ROWS_D64) and D = 128 causal at 4k (0.995x). Tests and
#: dev scripts flip it, or pass ``forward_config(..., ws=...)`` / an explicit ``config``.
WS_DEFAULT: dict[int, bool] = {64: True, 128: True}
#: Causal D = 64 calls with fewer query rows than this keep the lockstep kernel (see WS_DEFAULT), or its tile in the
#: persistent ws forward (WS_FEW_TILES_D64).
WS_MIN_CAUSAL_ROWS_D64 = 2048
#: D = 64 calls with a block mask whose query rows visit fewer keys than this on average under the call's masks
#: (``Variant.block_keys``) keep the lockstep kernel: its two blocks an SM hide each other's ends where a 192-row
#: tile meets few key tiles. Measured (benchmarks/dev_flex_ws.py, H200, bf16, N = 16k, H = 32; ws's speed over
#: lockstep's) since partial tiles read the block mask's bits (s23): causal documents of random lengths, 4 docs
#: (2890 keys a row) 1.16x, 8 (1460) 1.00x, 16 (975) 0.97x; prefix-LM (non-causal, 8728) 1.28x. (Before the bits,
#: s21: 2 docs (6162) 1.14x, 4 0.99x, 8 0.82x, 16 0.77x.) D = 128 (two consumers, the lockstep kernel's tile) gained
#: at every one of them: 1.13-1.19x.
WS_MIN_BLOCK_KEYS_D64 = 2048
#: D = 64 calls with a sliding window narrower than this (left + right + 1 keys, both sides bounded) keep the lockstep
#: kernel (or its tile persistent, WS_FEW_TILES_D64), for the same reason. Measured (dev_flex_ws.py, H200, bf16,
#: N = 16k, H = 32, causal windows; lockstep ms / ws ms): 256 keys 0.208 / 0.275 (lockstep 1.32x), 1024 0.478 /
#: 0.475, 4096 1.447 / 1.271 (ws 1.14x); D = 128: ws 1.07-1.12x at all three.
WS_MIN_WINDOW_KEYS_D64 = 1024


def ws_unsupported(variant: Variant) -> str | None:
    """Why the warp-specialised forward cannot run a call of ``variant`` (the lockstep kernel then does), or None.
    It takes every policy but mask/bias arrays, of either dtype."""
    if variant.arrays:
        return "does not stage mask/bias array tiles (the lockstep kernel does)"
    return None


#: The ws forward with the lockstep kernel's 128-row tile at D = 64 (two consumers), persistent: where the D = 64 rules
#: above give a call the lockstep kernel and the call may run persistent (persistent_by_default), this runs it
#: (``few_tiles_by_default``). Its finer tile and the next tile's copies under the last one's epilogue beat both the
#: lockstep kernel and the three-consumer tile there. Measured (benchmarks/dev_persistent_ab.py --two, H200, bf16,
#: H*D = 2048, B*N = 16k; ms): causal N = 512 0.167 (lockstep 0.180), N = 1024 0.245 (three consumers persistent
#: 0.268, lockstep 0.285), N = 2048 0.390 (0.383: not taken); causal windows of 256 keys 0.168-0.199 against the
#: lockstep kernel's 0.177-0.213 (N = 512-16k); but dense rows and windows of 1024 keys at N >= 4k 0.87-0.99x the
#: three-consumer tile, whose 192-row tile keeps the tensor cores busier.
WS_FEW_TILES_D64 = ForwardConfig(64, bc=128, warpgroups=2, stages=4, ws=True, persistent=True)


def lockstep_by_default(d: int, nq: int, variant: Variant) -> bool:
    """Does a call that both forwards can run get the lockstep kernel by default? D = 64 calls whose query tiles
    meet few key tiles (the three rules above), and user snippets other than a mask_mod with its block mask, which the
    ws kernel has not been timed with (a score_mod, or a mask_mod on every element; at D = 64 its consumers spill
    668-840 B with a score_mod, tests/test_compile.py)."""
    if variant.flex is not None and (not variant.block_keys or getattr(variant.flex, "score_mod", None)):
        return True
    if padded_head_dim(d) != 64:
        return False
    if variant.block_keys:  # (counted under the call's window too: BlockMask.keys_a_row)
        return variant.block_keys < WS_MIN_BLOCK_KEYS_D64
    if variant.window_keys is not None:
        return variant.window_keys < WS_MIN_WINDOW_KEYS_D64
    return variant.causal and nq < WS_MIN_CAUSAL_ROWS_D64


#: Persistent ws forwards (``ForwardConfig.persistent``, cuda_src/wgmma_forward_ws.cu): the grid holds at most a block
#: an SM and each block walks an even run of the plain grid's query tiles, its producer copying the next tile's Q_i
#: and first K/V while its consumers finish the last one. Where query tiles meet few key tiles (sliding windows,
#: short sequences) a block's fill and drain are a large share of its time. False turns it off (A/B scripts).
PERSISTENT = True
#: Calls whose rows meet at most this many keys (left + right + 1 for a window bounded on both sides, else Nk) run
#: persistent. Measured (benchmarks/dev_persistent_ab.py, H200, bf16, H*D = 2048, B*N = 16k; persistent over one
#: tile a block): causal windows of 1024 keys 1.02-1.06x, 512 + 512 1.03-1.08x, 256 at D = 128 1.17-1.18x; 2048
#: 0.99-1.02x; 4096 0.94-1.01x. Dense rows (causal or not), one tile a block against persistent: N = 512-2048
#: 1.04-1.25x through the API (--suite grid, two runs each; D = 64 causal at N <= 1024 was on the lockstep kernel),
#: N = 4096 0.90-1.11x and N = 16k 0.96-1.03x in dev_persistent_ab.py (noisy: not taken).
PERSISTENT_MAX_KEYS = 2048


def keys_a_row(variant: Variant, nk: int) -> int:
    """The most keys a query row may meet: Nk, or fewer under a sliding window bounded on both sides."""
    return nk if variant.window_keys is None else min(nk, variant.window_keys)


def persistent_by_default(variant: Variant, varlen: bool, nk: int) -> bool:
    """Does a ws forward call run persistent? Dense calls whose rows meet at most PERSISTENT_MAX_KEYS keys (short
    sequences, narrow windows), without a block mask (whose policy decodes its (batch, heads) from the block's grid
    coordinates, flex_policy.cuh's BlockMasked) and without dropout (its keep-bit draws spill 4-68 B in the D = 64
    persistent consumers, NVRTC 13.5; never timed); varlen grids map blocks to sequences, so they keep one tile a
    block."""
    short = keys_a_row(variant, nk) <= PERSISTENT_MAX_KEYS
    return PERSISTENT and short and not varlen and variant.flex is None and not variant.dropout


def few_tiles_by_default(d: int, nq: int, variant: Variant, varlen: bool, nk: int) -> bool:
    """Does a D = 64 call that lockstep_by_default gives the lockstep kernel (query tiles meeting few key tiles)
    run WS_FEW_TILES_D64 instead? Where it may run persistent: not user snippets, block masks, dropout or varlen."""
    return (lockstep_by_default(d, nq, variant) and padded_head_dim(d) == 64
            and persistent_by_default(variant, varlen, nk) and ws_unsupported(variant) is None)  # fmt: skip


def forward_config(d: int, limits: DeviceLimits, variant: Variant = Variant(), ws: bool | None = None
                   ) -> ForwardConfig | None:  # fmt: skip
    """The forward configuration of a call: the warp-specialised one where ``ws`` asks for it (None:
    ``WS_DEFAULT``) and ``ws_unsupported`` has no objection, else the lockstep kernel's (its array configuration
    with score arrays); None where nothing fits."""
    pd = padded_head_dim(d)
    if pd is None or limits.compute_capability != COMPUTE_CAPABILITY:
        return None
    if (WS_DEFAULT[pd] if ws is None else ws) and ws_unsupported(variant) is None:
        cfg = WS_FORWARD_CONFIGS[pd]
    else:
        cfg = (ARRAY_FORWARD_CONFIGS if variant.arrays else FORWARD_CONFIGS)[pd]
    return cfg if cfg.shared_bytes <= limits.max_shared_per_block else None


def _heads_first(longest_first: bool, heads: int, sm_count: int, tiles: int = 1) -> bool:
    """Grid order (both passes): when tiles differ in work (causal), heads fastest (every head's longest tiles first) only while at
    most half an SM count of heads is in flight; with more, one head's tiles run together and share its K/V
    (forward) or Q_i/dO_i and dQ lines (backward) in L2. Measured on an H100 (bf16, B*N = 16k): heads fastest
    is 3-10% ahead at B*H <= 64 and 2-10% (forward) or 17-35% (backward) behind at B*H >= 128. The H200 would
    rather keep heads fastest for the D=64 forward at B*H = 128 (11%), but the H100's D=128 forward there
    falls below SDPA FLASH with it (benchmarks/NOTES.md, "Causal grid order"). Tiles go on x whenever they
    would overflow gridDim.y (a large varlen pack)."""
    if tiles > MAX_GRID_Y and heads <= MAX_GRID_Y:
        return False
    return (longest_first and heads <= sm_count // 2) or heads > MAX_GRID_Y


#: The ws forward's producer by TMA (kTma, cuda_src/wgmma_forward_ws.cu): one thread's cp.async.bulk.tensor per
#: 64-column slab of Q_i, K_t and V_t instead of 128 threads' cp.async and their wait/fence/arrive chain. Wherever the
#: ws forward runs (persistent or not) and the call's q, k and v have TMA maps (``kernels.wgmma.forward_tma_maps``:
#: dense, 16-byte strides). False: the producer copies with cp.async (tests and A/B scripts).
TMA_FORWARD = True


def uses_tma_forward(cfg: ForwardConfig, maps: tuple) -> bool:
    """Does the ws forward's producer copy by TMA? Where it runs and the call came with maps of q, k and v."""
    return TMA_FORWARD and cfg.ws and len(maps) == 3


def plan_forward(
    batch: int, hq: int, nq: int, d: int, ctype: str, limits: DeviceLimits,
    config: ForwardConfig | None = None, variant: Variant = Variant(), total: int | None = None,
    maps: Callable[[ForwardConfig], tuple | str] | None = None, nk: int | None = None,
) -> ForwardPlan:  # fmt: skip
    """Grid (B*Hq, query tiles) or (query tiles, B*Hq), in the order _heads_first picks. ``maps``: the TMA maps
    of q, k and v for the call's views and a configuration's boxes (Br and Bc rows), or why there are none
    (``uses_tma_forward``: the ws forward then copies by TMA and carries them). ``nk``: keys a row (None: ``nq``),
    which persistent_by_default weighs."""
    nk, varlen = nq if nk is None else nk, total is not None
    if config is None and few_tiles_by_default(d, nq, variant, varlen, nk):
        cfg = WS_FEW_TILES_D64
    else:
        cfg = config or forward_config(d, limits, variant, ws=False if lockstep_by_default(d, nq, variant) else None)
    if cfg is None or cfg.shared_bytes > limits.max_shared_per_block:
        raise ValueError(f"no wgmma forward configuration for D={d} on sm_{limits.compute_capability}")
    if cfg.ws and ws_unsupported(variant) is not None:
        raise ValueError(f"the warp-specialised wgmma forward {ws_unsupported(variant)}")
    if config is None and cfg.ws and persistent_by_default(variant, varlen, nk):
        cfg = replace(cfg, persistent=True)
    if cfg.persistent and (varlen or variant.flex is not None):
        raise ValueError("the persistent ws forward takes dense calls without a block mask")
    heads, tiles = grid_axes(batch, hq, nq, cfg.br, total)
    on_x = _heads_first(variant.longest_first, heads, limits.sm_count, tiles)
    grid = (heads, tiles, 1) if on_x else (tiles, heads, 1)
    if cfg.persistent:  # blocks walk the grid above (dense_tile_coord)
        grid = (min(heads * tiles, limits.sm_count), 1, 1)
    policy, smem = staged_policy(variant, cfg.br, cfg.bc, 2, cfg.shared_bytes, limits)  # slots: tiles t, t + 1
    specs = maps(cfg) if maps is not None and cfg.ws else ()
    specs = specs if isinstance(specs, tuple) else ()
    tma = uses_tma_forward(cfg, specs)
    main = LaunchPlan(cfg.source, cfg.name(ctype, policy, tma), grid, (cfg.threads, 1, 1), smem, max_carveout=True,
                      tensor_maps=specs if tma else ())  # fmt: skip
    return ForwardPlan(cfg, main, on_x)


@dataclass(frozen=True)
class BackwardConfig:
    """Tiles of wgmma_flash_bwd: Bc = 64 * warpgroups keys per block (warpgroup g owns keys 64g..), Br query
    rows per step through a kStages-deep Q_i/dO_i ring. dQ_i is split between the two warpgroups by rows
    when Br = Bc, else (Br = 64, D = 128) by 64-column slabs."""

    d: int  # padded head dim, 64 or 128
    br: int
    warpgroups: int = 2
    stages: int = 2

    @property
    def bc(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def shared_bytes(self) -> int:
        tiles = 2 * self.bc * self.d + 2 * self.stages * self.br * self.d + self.bc * self.br  # K, V, Q/dO ring, dS^T
        return tiles * _ELEM + self.stages * 2 * self.br * 4 + _ALIGN_SLACK  # + lse and Delta per step

    def name(self, ctype: str, policy: str, own_dq: bool = False, drawer: bool = False, loader: bool = False,
             tma: bool = False) -> str:  # fmt: skip
        # kOwnDQ (cuda_src/dq_own.cuh), kDrawer, kLoader, kTma: trailing defaults (false) left out
        if tma and not loader:
            raise ValueError("TMA copies are the loader warpgroup's (kTma needs kLoader)")
        flags = [own_dq, drawer, loader, tma]
        while flags and not flags[-1]:
            flags.pop()
        tail = "".join(f", {'true' if f else 'false'}" for f in flags)
        return f"wgmma_flash_bwd<{ctype}, {self.d}, {self.br}, {self.warpgroups}, {self.stages}, {policy}{tail}>"

    @property
    def loader_bytes(self) -> int:
        """Shared memory the loader warpgroup adds: the second dS^T buffer (Bc x Br) that lets its kernel drop the
        top-of-step barrier, the dQ_i tile of its bulk adds (Br rows of D floats, 32 bytes of padding a row), the
        ring's and the dQ tile's FULL/EMPTY mbarriers, and 144 bytes of alignment slack."""
        return self.bc * self.br * _ELEM + self.br * (4 * self.d + 32) + 2 * (self.stages + 1) * 8 + 144

    def keep_ring_bytes(self) -> int:
        """Shared memory of the drawer's keep-bit ring (KEEP_SLOTS steps of every compute warp's bits, 8 or 4
        bytes a lane as KeepBits<Br / 8>, then 2 mbarriers a slot) and 16 bytes of alignment slack."""
        bits = 8 if self.br // 16 > 4 else 4
        return KEEP_SLOTS * (4 * self.warpgroups * 32 * bits + 16) + 16


#: The backward's keep-bit drawer (issue 16): with dropout on plain scores, a third warpgroup draws each step's
#: keep bits (Philox) KEEP_SLOTS steps ahead of the two that compute (cuda_src/wgmma_backward.cu, kDrawer), on
#: the head dims listed. Not with softcap/ALiBi/arrays/snippets: the compute warpgroups' 240 registers spill.
DRAWER_HEAD_DIMS = frozenset({64, 128})
KEEP_SLOTS = 4


def uses_drawer(cfg: BackwardConfig, variant: Variant) -> bool:
    return variant.dropout > 0 and variant.score_name == "PlainScore" and cfg.d in DRAWER_HEAD_DIMS


#: The backward's loader warpgroup (kLoader, cuda_src/wgmma_backward.cu): a third warpgroup copies every step's
#: Q_i/dO_i/lse/Delta into the ring and adds dQ_i by bulk reductions, so the two that compute lose the copies, the
#: top-of-step barrier and dQ's red.add. Measured 1.01-1.05x the lockstep kernel with the copies alone, then the bulk
#: dQ adds 1.05-1.10x more at D = 64, 0.97-1.17x at D = 128 (H200; benchmarks/NOTES.md, s24). False: every backward
#: runs lockstep (tests and dev scripts compare the two).
LOADER = True

#: Scores whose D = 64 backward takes the loader: the compute warpgroups' 240 registers (255 lockstep) hold plain
#: scores spill-free, softcap alone (SoftcapScore) with 8-16 B and ALiBi with 68/84 B (1.07x the lockstep kernel,
#: which spills none); softcap with ALiBi (ModScore) and score_mods spill 450-890 B there (ModScore's softcap measured
#: 0.68x). At D = 128 every built-in score takes it (the loader's own 20/28 B).
LOADER_SCORES_D64 = frozenset({"PlainScore", "AlibiScore", "SoftcapScore"})


def uses_loader(d: int, variant: Variant, own: bool) -> bool:
    """Does the backward's main kernel run with the loader warpgroup? Not with dropout (the drawer's place), mask/bias
    arrays (staged tiles) or when the block owns dQ; at D = 64 on LOADER_SCORES_D64 only; never with a score_mod
    (FlexScore: 56-80 B of spill at D = 128, not measured)."""
    if not LOADER or own or variant.dropout > 0 or variant.arrays:
        return False
    score = variant.score_name
    return score in LOADER_SCORES_D64 or (d == 128 and not score.startswith("FlexScore"))


#: The loader's Q_i/dO_i by TMA (kTma, cuda_src/wgmma_backward.cu): one loader thread's cp.async.bulk.tensor per
#: 64-column slab instead of 128 threads' cp.async, and lse/Delta arriving on the ring by themselves, so that no
#: loader thread waits for a copy before dQ's bulk adds. Wherever the loader runs and the call's q and dout have TMA
#: maps (``tma_maps``: dense, 16-byte strides). False: the loader copies with cp.async (tests and A/B scripts).
TMA = True


def uses_tma(loader: bool, maps: tuple) -> bool:
    """Does the loader copy Q_i/dO_i by TMA? Where it runs and the call came with maps of q and dout (the family
    module builds them from the call's geometry, ``kernels.wgmma.tma_maps``)."""
    return TMA and loader and len(maps) == 2


BACKWARD_CONFIGS: dict[int, BackwardConfig] = {
    64: BackwardConfig(64, br=128),
    128: BackwardConfig(128, br=64),
}


def backward_config(d: int, limits: DeviceLimits) -> BackwardConfig | None:
    pd = padded_head_dim(d)
    if pd is None or limits.compute_capability != COMPUTE_CAPABILITY:
        return None
    cfg = BACKWARD_CONFIGS[pd]
    return cfg if cfg.shared_bytes <= limits.max_shared_per_block else None


def plan_backward(
    batch: int, hq: int, hk: int, nq: int, nk: int, d: int, ctype: str, limits: DeviceLimits,
    config: BackwardConfig | None = None, variant: Variant = Variant(), total: int | None = None,
    maps: Callable[[BackwardConfig], tuple | str] | None = None,
) -> BackwardPlan:  # fmt: skip
    """The mma family's three launches (Delta, main, dQ conversion) with this family's main kernel; one launch
    when a key tile covers every key (``owns_dq``). ``maps``: the TMA maps of q and dout for the call's views and a
    configuration's boxes (Br rows), or why there are none (``uses_tma``: the main kernel with the loader then copies
    Q_i/dO_i by TMA and carries them), as plan_forward's."""
    cfg = config or backward_config(d, limits)
    if cfg is None or cfg.shared_bytes > limits.max_shared_per_block:
        raise ValueError(f"no wgmma backward configuration for D={d} on sm_{limits.compute_capability}")
    heads, tiles = grid_axes(batch, hk, nk, cfg.bc, total)
    on_x = _heads_first(variant.longest_first, heads, limits.sm_count, tiles)
    grid = (heads, tiles, 1) if on_x else (tiles, heads, 1)
    own = owns_dq(tiles, total)
    policy, smem = staged_policy(variant, cfg.br, cfg.bc, cfg.stages, cfg.shared_bytes, limits)  # a tile a ring slot
    drawer = uses_drawer(cfg, variant)
    loader = uses_loader(cfg.d, variant, own) and smem + cfg.loader_bytes <= limits.max_shared_per_block
    specs = maps(cfg) if maps is not None and loader else ()
    specs = specs if isinstance(specs, tuple) else ()
    tma = uses_tma(loader, specs)
    threads = cfg.threads + 128 * (drawer or loader)
    smem += cfg.keep_ring_bytes() if drawer else cfg.loader_bytes if loader else 0
    main = LaunchPlan(BACKWARD_SOURCE, cfg.name(ctype, policy, own, drawer, loader, tma), grid, (threads, 1, 1), smem,
                      max_carveout=True, tensor_maps=specs if tma else ())  # fmt: skip
    return backward_plan_around(cfg, main, on_x, batch, hq, nq, d, ctype, own)


def instantiations(ctypes: tuple[str, ...] = ("__half", "__nv_bfloat16"), variants: tuple[Variant, ...] = BUILTIN
                   ) -> list[tuple[str, str]]:  # fmt: skip
    """The forward (lockstep and warp-specialised, the latter copying by cp.async or by TMA) and backward main
    kernels (the backward's helpers are the mma family's; lockstep, and with the loader where ``uses_loader`` gives it
    one, copying by cp.async or by TMA), with the policies of ``variants``."""
    out: list[tuple[str, str]] = []
    for ct in ctypes:
        for v in variants:
            pol = v.cpp_policy
            out += [(c.source, c.name(ct, pol)) for c in (*FORWARD_CONFIGS.values(), *WS_FORWARD_CONFIGS.values())]
            out += [(c.source, c.name(ct, pol, tma=True)) for c in WS_FORWARD_CONFIGS.values()]
            if persistent_by_default(v, varlen=False, nk=1):  # (its short calls run persistent)
                out += [(c.source, replace(c, persistent=True).name(ct, pol, tma)) for c in WS_FORWARD_CONFIGS.values()
                        for tma in (False, True)]
            if few_tiles_by_default(64, nq=1, variant=v, varlen=False, nk=1):
                out += [(FORWARD_WS_SOURCE, WS_FEW_TILES_D64.name(ct, pol, tma)) for tma in (False, True)]
            out += [(BACKWARD_SOURCE, c.name(ct, pol)) for c in BACKWARD_CONFIGS.values()]
            out += [(BACKWARD_SOURCE, c.name(ct, pol, loader=True, tma=tma)) for c in BACKWARD_CONFIGS.values()
                    for tma in (False, True) if uses_loader(c.d, v, own=False)]
    return out


def array_instantiations(variants: tuple[Variant, ...], ctypes: tuple[str, ...] = ("__nv_bfloat16",),
                         limits: DeviceLimits | None = None) -> list[tuple[str, str]]:  # fmt: skip
    """The forward and backward main kernels that calls with mask/bias ``variants`` launch on ``limits`` (an H100
    by default): staged or not as ``plan_forward``/``plan_backward`` decide."""
    from . import H100

    limits = limits or H100
    out: list[tuple[str, str]] = []
    for ct in ctypes:
        for v in variants:
            for d in FORWARD_CONFIGS:
                out.append((FORWARD_SOURCE, plan_forward(1, 1, 1024, d, ct, limits, variant=v).main.name))
                out.append((BACKWARD_SOURCE, plan_backward(1, 1, 1, 1024, 1024, d, ct, limits, variant=v).main.name))
    return out
