"""The decode family's host side (cuda_src/decode.cu): ``DecodeParams`` on the host, the launch plan (tile
configuration, split count, workspace) as a pure function of the call's static shapes, and the launches.

The kernels take their own struct, ``DecodeParams``, which embeds an ``AttentionParams`` (what the variant
policies and the q/o/lse epilogue read) and appends the cache's fields: decode-only fields stay out of every
other kernel's argument, and the variant policies are reused as they are.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _dtypes
from ..kvcache_validation import KVCacheProblem
from ..plans import DeviceLimits, LaunchPlan, blocks_by_smem, cdiv
from . import build
from .params import PARAMS

SOURCE = "decode.cu"
THREADS = 128
#: Padded head dims; the FMA kernel's rows per block (query rows sharing one KV head) and keys per tile.
HEAD_DIMS = (64, 128, 256)
ROWS = (4, 8, 16, 32, 64)
KEY_TILES = (64, 32)

_STRIDES = np.dtype([("b", "<i8"), ("h", "<i8"), ("n", "<i8")], align=True)
DECODE_POINTERS = ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", "block_table", "cache_batch_idx",
                   "o_part", "lse_part")  # fmt: skip
DECODE_PARAMS = np.dtype(
    [("attn", PARAMS)]
    + [(n, "<u8") for n in DECODE_POINTERS]
    + [(n, _STRIDES) for n in ("kc_s", "vc_s", "kn_s", "vn_s")]
    + [("bt_stride", "<i8")]
    + [(n, "<i4") for n in ("n_new", "page_size", "num_pages", "pages_per_seq", "seqlen_const", "m_rows")]
    + [(n, "<u8") for n in ("rotary_cos", "rotary_sin", "q_rot")]
    + [(n, "<i4") for n in ("rotary_dim", "rotary_interleaved", "rotary_rows", "rotary_q_step")]
    + [("split_count", "<u8")],  # decode v3: the in-launch merge's arrival counters
    align=True,
)


def smem_bytes(itemsize: int, kd: int, km: int, kbc: int) -> int:
    """sizeof(DecodeSmem<T, kD, kM, kBc>) of the FMA kernel: q and s tiles (f32), three row vectors, two stages
    of K and V."""
    pitch = kd + 16 // itemsize
    return 4 * (km * kd + km * kbc + 3 * km) + 2 * 2 * kbc * pitch * itemsize


#: The tensor-core kernel (decode_split_mma): keys per tile, row tiles (16 x 1, 2 or 4 warp strips), stages.
MMA_KEY_TILE = 64
MMA_ROW_WARPS = (1, 2, 4)
MMA_STAGES = (4, 3, 2)


def mma_smem_bytes(kd: int, row_warps: int, stages: int) -> int:
    """DecodeMmaSmem<T, kD, kRowWarps, kStages>::kBytes (16-bit T): Q and the K/V ring, or the combine buffer
    (each warp's 16 x (kD + 8) float32 O, m and l) that reuses them after the loop."""
    loop = 2 * (16 * row_warps * kd + 2 * stages * MMA_KEY_TILE * kd)
    warps = THREADS // 32
    epilogue = 4 * (warps * 16 * (kd + 8) + 2 * warps * 16)
    return max(loop, epilogue)


#: The most splits the split model gives the one-strip tensor-core kernel on a contiguous cache (plan): one batch of
#: merge_if_last's loads at D = 128 (32 at D = 64, 8 at D = 256).
CONTIGUOUS_SPLITS = 16


def blocks_per_sm(shared: int, limits: DeviceLimits) -> int:
    """Resident blocks per SM by shared memory (``plans.blocks_by_smem``), at least 1 and at most 4."""
    return max(1, min(4, blocks_by_smem(shared, limits)))


@dataclass(frozen=True)
class DecodePlan:
    kd: int
    km: int
    kbc: int
    m_chunks: int
    splits: int
    decode: LaunchPlan
    append: LaunchPlan | None
    rotate_q: LaunchPlan | None = None
    kernel: str = "fma"  # "mma" (decode_split_mma) or "fma" (decode_split)
    stages: int = 2


def unsupported(p: KVCacheProblem) -> str | None:
    """Why the decode kernel cannot run p (static reasons), or None."""
    if p.dtype not in _dtypes.CTYPE:
        return f"dtype {p.dtype} has no CUDA kernel"
    vec = 16 // p.dtype.itemsize
    if p.d % vec:
        return f"the decode kernel reads 16-byte rows: D must be a multiple of {vec} for {p.dtype}; got D={p.d}"
    return None


def choose_splits(blocks: int, tiles: int, limits: DeviceLimits, num_splits: int, per_sm: int = 2,
                  max_splits: int = 128) -> int:  # fmt: skip
    """Split the key range when the (B, Hk, row chunks) blocks cannot fill the GPU's ``sm_count * per_sm`` resident
    slots. The split count minimises a wave model, waves x (tiles per split + 2 for the prologue and epilogue),
    over 1..max_splits splits of at least four key tiles each: at small B * Hk it fills one wave exactly (B = 1,
    Hk = 8, 264 slots: 33 splits) instead of leaving a second wave a fifth full. A static function of shapes: the
    workspace is sized from it."""
    if num_splits > 0:
        return max(1, min(num_splits, tiles, 1024))
    slots = limits.sm_count * per_sm
    if blocks >= slots:
        return 1
    best, best_cost = 1, None
    for s in range(1, max(1, min(max_splits, cdiv(tiles, 4))) + 1):
        cost = cdiv(blocks * s, slots) * (cdiv(tiles, s) + 2)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def _tile(itemsize: int, kd: int, km: int, limits: DeviceLimits) -> tuple[int, int]:
    """(rows, keys) per tile of the FMA kernel: the most rows (up to km) and then the most keys whose shared
    memory fits; 32 keys at D = 256 (its 128 threads own two columns each, and a 64-key tile would cost twice
    the shared memory)."""
    for rows in [r for r in reversed(ROWS) if r <= km]:
        for keys in (KEY_TILES[1:] if kd == 256 else KEY_TILES):
            if smem_bytes(itemsize, kd, rows, keys) <= limits.max_shared_per_block:
                return rows, keys
    raise ValueError(f"the decode kernel needs {smem_bytes(itemsize, kd, ROWS[0], KEY_TILES[-1])} bytes of shared "
                     f"memory at D = {kd}; the device allows {limits.max_shared_per_block}")


def _mma_tile(kd: int, m_rows: int, limits: DeviceLimits) -> tuple[int, int] | None:
    """(row warps, stages) of the tensor-core kernel, or None where even two stages do not fit. Rows: one 16-row
    strip up to 16 packed rows (the Nq = 1 shapes; its warps split the keys), 2 up to 32, else 4 (64-row chunks).
    Stages: the deepest ring (4, 3, 2) with two blocks per SM, else the deepest that fits one block."""
    row_warps = next((w for w in MMA_ROW_WARPS if 16 * w >= m_rows), MMA_ROW_WARPS[-1])
    fits = [s for s in MMA_STAGES if mma_smem_bytes(kd, row_warps, s) <= limits.max_shared_per_block]
    if not fits:
        return None
    two = [s for s in fits if blocks_per_sm(mma_smem_bytes(kd, row_warps, s), limits) >= 2]
    return row_warps, (two or fits)[0]


def plan(p: KVCacheProblem, limits: DeviceLimits, num_splits: int = 0, kernel: str = "auto") -> DecodePlan:
    """Tile configuration, split count and launches of one call (pure: shapes and device limits only).

    The kernel: fp16/bf16 caches run ``decode_split_mma`` (tensor cores: S = QK^T and PV as m16n8k16 products
    of 16-bit operands, exact for these inputs); float32 caches run the FMA kernel ``decode_split``, since mma
    with float32 operands would round them (tf32) and break the float32 accuracy bound. kernel="fma" forces the
    FMA kernel for 16-bit caches too (tests and benchmarks compare the two); "mma" insists on tensor cores.
    """
    if kernel not in ("auto", "mma", "fma"):
        raise ValueError(f"kernel must be 'auto', 'mma' or 'fma'; got {kernel!r}")
    ctype = _dtypes.CTYPE[p.dtype]
    kd = next(x for x in HEAD_DIMS if x >= p.d)
    m_rows = p.group * p.nq
    mma_tile = _mma_tile(kd, m_rows, limits) if p.dtype.itemsize == 2 and kernel != "fma" else None
    if kernel == "mma" and mma_tile is None:
        raise ValueError(f"the tensor-core decode kernel needs a 16-bit dtype and {mma_smem_bytes(kd, 1, 2)} bytes "
                         f"of shared memory at D = {kd}; got {p.dtype}, {limits.max_shared_per_block} bytes")
    if mma_tile is not None:
        row_warps, stages = mma_tile
        km, kbc = 16 * row_warps, MMA_KEY_TILE
        shared = mma_smem_bytes(kd, row_warps, stages)
        name = f"cupyflash::decode_split_mma<{ctype}, {kd}, {row_warps}, {stages}, {p.variant.cpp_policy}>"
        used = "mma"
    else:
        km, kbc = _tile(p.dtype.itemsize, kd, next((x for x in ROWS if x >= m_rows), ROWS[-1]), limits)
        shared = smem_bytes(p.dtype.itemsize, kd, km, kbc)
        name = f"cupyflash::decode_split<{ctype}, {kd}, {km}, {kbc}, {p.variant.cpp_policy}>"
        stages, used = 2, "fma"
    m_chunks = cdiv(m_rows, km)
    # Resident blocks the split model fills: those shared memory allows. On a contiguous cache the one-strip
    # tensor-core kernel (M <= 16: its four warps split the keys) fills two an SM with at most CONTIGUOUS_SPLITS
    # splits: it streams K/V at DRAM's rate either way, and a merge of up to 16 partials is one L2 round trip at
    # the launch's tail (decode v8; H200 sweeps in benchmarks/NOTES.md s27: B = 8 at 4 splits 1.5% faster than 2,
    # B = 1 the same at 16 and 32 splits, both ahead of 20 and 24).
    contiguous_strip = used == "mma" and km == 16 and not p.paged
    per_sm, max_splits = blocks_per_sm(shared, limits), 128
    if contiguous_strip:
        per_sm, max_splits = min(2, per_sm), CONTIGUOUS_SPLITS
    splits = choose_splits(p.batch * p.hk * m_chunks, max(1, cdiv(p.capacity, kbc)), limits, num_splits, per_sm,
                           max_splits)  # fmt: skip
    # the largest carveout: the plan counts on blocks_per_sm blocks' shared memory per SM
    decode = LaunchPlan(SOURCE, name, (p.batch, p.hk * m_chunks, splits), (THREADS, 1, 1), shared, max_carveout=True)
    append = None
    if p.n_new:
        append = LaunchPlan(SOURCE, f"cupyflash::kv_append<{ctype}>", (p.batch, p.hk, 1), (THREADS, 1, 1), 0)
    rotate = None
    if p.rotary_dim:
        rotate = LaunchPlan(SOURCE, f"cupyflash::rotate_q<{ctype}>", (p.batch, p.hq, 1), (THREADS, 1, 1), 0)
    return DecodePlan(kd, km, kbc, m_chunks, splits, decode, append, rotate, used, stages)


def merge_name(tin: np.dtype, tout: np.dtype) -> str:
    return f"cupyflash::merge_states<{_dtypes.CTYPE[np.dtype(tin)]}, {_dtypes.CTYPE[np.dtype(tout)]}>"


def instantiations() -> list[tuple[str, str]]:
    """A representative set for CI (tests/test_compile.py): the tensor-core kernel at its three row layouts
    (M <= 16 key-split warps, 2 x 2, 4 row strips), every D (Q fragments in registers up to D = 128, reloaded
    at 256) and ring depth the H100 plan picks, the variant policies (a mask; a window with the score mod) and
    both 16-bit types; the FMA kernel (float32 caches) at its smallest and largest row tiles and its 32-key D = 256
    tile with a variant; and the append, rotary and merge kernels."""
    from ..variants import Variant

    plain = Variant().cpp_policy
    causal = Variant(causal=True).cpp_policy
    mixed = Variant(window=(8, 8), softcap=30.0).cpp_policy
    mma = "cupyflash::decode_split_mma"
    fma = "cupyflash::decode_split"
    out = [
        f"{mma}<__nv_bfloat16, 128, 1, 3, {plain}>",
        f"{mma}<__nv_bfloat16, 128, 4, 3, {plain}>",
        f"{mma}<__nv_bfloat16, 128, 1, 3, {causal}>",
        f"{mma}<__half, 64, 2, 4, {mixed}>",
        f"{mma}<__nv_bfloat16, 256, 4, 2, {mixed}>",
        f"{fma}<float, 128, 4, 64, {plain}>",
        f"{fma}<float, 128, 64, 64, {causal}>",
        f"{fma}<float, 256, 16, 32, {mixed}>",
    ]
    out += [f"cupyflash::{k}<{t}>" for k in ("kv_append", "rotate_q") for t in ("float", "__half", "__nv_bfloat16")]
    out += [f"cupyflash::merge_states<float, {t}>" for t in ("float", "__half", "__nv_bfloat16")]
    out += ["cupyflash::merge_states<__half, __half>", "cupyflash::merge_states<__nv_bfloat16, __nv_bfloat16>"]
    return [(SOURCE, e) for e in out]


# ---------------------------------------------------------------------------- launches made ready


def field_offset(name: str) -> int:
    """Byte offset of a DecodeParams field; ``attn.<name>`` for the embedded AttentionParams' fields."""
    if name.startswith("attn."):
        return DECODE_PARAMS.fields["attn"][1] + PARAMS.fields[name[5:]][1]
    return DECODE_PARAMS.fields[name][1]


class PointerWriter:
    """Writes a fixed list of 8-byte DecodeParams fields (pointers) into a launch's argument buffer in place:
    fields adjacent in the struct go in one ``pack_into``, so a call costs a handful of them. ``write(buffer,
    values)`` takes the values in ``names`` order; names given in struct order (as ``kvcache`` gives them) make each
    run a slice of the values, with no per-call gathering (1.4 -> 0.6 us a decode call's pointers on a workstation)."""

    __slots__ = ("runs", "write")

    def __init__(self, names: tuple[str, ...]) -> None:
        offsets = [field_offset(n) for n in names]
        runs: list[tuple[int, list[int]]] = []
        for off, i in sorted((off, i) for i, off in enumerate(offsets)):
            if runs and runs[-1][0] + 8 * len(runs[-1][1]) == off:
                runs[-1][1].append(i)
            else:
                runs.append((off, [i]))
        self.runs = tuple((struct.Struct("<" + "Q" * len(ix)).pack_into, off, tuple(ix)) for off, ix in runs)
        if offsets == sorted(offsets):  # each run's values are values[ix[0]:ix[-1] + 1]
            slices = tuple((pack_into, off, ix[0], ix[-1] + 1) for pack_into, off, ix in self.runs)

            def write(buffer: Any, values: tuple[int, ...]) -> None:
                for pack_into, off, a, b in slices:
                    pack_into(buffer, off, *values[a:b])
        else:
            gathered = self.runs

            def write(buffer: Any, values: tuple[int, ...]) -> None:
                for pack_into, off, ix in gathered:
                    pack_into(buffer, off, *[values[i] for i in ix])

        self.write = write


SEQLEN_CONST_AT = field_offset("seqlen_const")
_INT32 = struct.Struct("<i")


def write_seqlen_const(buffer: Any, value: int) -> None:
    _INT32.pack_into(buffer, SEQLEN_CONST_AT, value)


def merge_plan(tin: np.dtype, tout: np.dtype, rows: int) -> LaunchPlan:
    """merge_states over ``rows`` dense rows: one warp per row."""
    return LaunchPlan(SOURCE, merge_name(tin, tout), (cdiv(rows, THREADS // 32), 1, 1), (THREADS, 1, 1), 0)


# ---------------------------------------------------------------------------- launches


def launch_merge(o_parts: Any, lse_parts: Any, o: Any, lse: Any, sinks: Any, rows: int, parts: int, d: int,
                 nq: int = 1, hq: int = 1) -> None:  # fmt: skip
    """merge_states over dense (parts, rows, d) / (parts, rows) into dense o (rows, d) and lse (rows,)."""
    if rows == 0:
        return
    args = (o_parts, lse_parts, o, lse, np.uint64(0 if sinks is None else sinks.data.ptr), np.int64(rows),
            np.int32(parts), np.int32(d), np.int32(nq), np.int32(hq))  # fmt: skip
    build.launch_plan(merge_plan(o_parts.dtype, o.dtype, rows), args)
