"""The decode family's host side (cuda_src/decode.cu): ``DecodeParams`` on the host, the launch plan (tile
configuration, split count, workspace) as a pure function of the call's static shapes, and the launches.

The kernels take their own struct, ``DecodeParams``, which embeds an ``AttentionParams`` (what the variant
policies and the q/o/lse epilogue read) and appends the cache's fields: decode-only fields stay out of every
other kernel's argument, and the variant policies are reused as they are.
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _dtypes
from ..kvcache_validation import KVCacheProblem
from ..plans import DeviceLimits, LaunchPlan, cdiv
from . import build
from .params import PARAMS

SOURCE = "decode.cu"
THREADS = 128
#: Padded head dims, rows per block (query rows sharing one KV head), keys per tile.
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
    + [(n, "<i4") for n in ("rotary_dim", "rotary_interleaved", "rotary_rows", "rotary_q_step")],
    align=True,
)


def smem_bytes(itemsize: int, kd: int, km: int, kbc: int) -> int:
    """sizeof(DecodeSmem<T, kD, kM, kBc>): q and s tiles (f32), three row vectors, two stages of K and V."""
    pitch = kd + 16 // itemsize
    return 4 * (km * kd + km * kbc + 3 * km) + 2 * 2 * kbc * pitch * itemsize


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


def unsupported(p: KVCacheProblem) -> str | None:
    """Why the decode kernel cannot run p (static reasons), or None."""
    if p.dtype not in _dtypes.CTYPE:
        return f"dtype {p.dtype} has no CUDA kernel"
    vec = 16 // p.dtype.itemsize
    if p.d % vec:
        return f"the decode kernel reads 16-byte rows: D must be a multiple of {vec} for {p.dtype}; got D={p.d}"
    return None


def choose_splits(blocks: int, tiles: int, limits: DeviceLimits, num_splits: int) -> int:
    """Split the key range when (B, Hk, row chunks) blocks cannot fill the GPU: about two blocks per SM,
    at least four key tiles per split, at most 128 splits (a static function of shapes: the workspace is
    sized from it)."""
    if num_splits > 0:
        return max(1, min(num_splits, tiles, 1024))
    if blocks >= limits.sm_count:
        return 1
    return max(1, min(cdiv(2 * limits.sm_count, blocks), cdiv(tiles, 4), 128))


def _tile(itemsize: int, kd: int, km: int, limits: DeviceLimits) -> tuple[int, int]:
    """(rows, keys) per tile: the most rows (up to km) and then the most keys whose shared memory fits; 32 keys
    at D = 256 (its 128 threads own two columns each, and a 64-key tile would cost twice the shared memory)."""
    for rows in [r for r in reversed(ROWS) if r <= km]:
        for keys in (KEY_TILES[1:] if kd == 256 else KEY_TILES):
            if smem_bytes(itemsize, kd, rows, keys) <= limits.max_shared_per_block:
                return rows, keys
    raise ValueError(f"the decode kernel needs {smem_bytes(itemsize, kd, ROWS[0], KEY_TILES[-1])} bytes of shared "
                     f"memory at D = {kd}; the device allows {limits.max_shared_per_block}")


def plan(p: KVCacheProblem, limits: DeviceLimits, num_splits: int = 0) -> DecodePlan:
    """Tile configuration, split count and launches of one call (pure: shapes and device limits only)."""
    ctype = _dtypes.CTYPE[p.dtype]
    kd = next(x for x in HEAD_DIMS if x >= p.d)
    m_rows = p.group * p.nq
    km, kbc = _tile(p.dtype.itemsize, kd, next((x for x in ROWS if x >= m_rows), ROWS[-1]), limits)
    m_chunks = cdiv(m_rows, km)
    shared = smem_bytes(p.dtype.itemsize, kd, km, kbc)
    splits = choose_splits(p.batch * p.hk * m_chunks, max(1, cdiv(p.capacity, kbc)), limits, num_splits)
    name = f"cupyflash::decode_split<{ctype}, {kd}, {km}, {kbc}, {p.variant.cpp_policy}>"
    decode = LaunchPlan(SOURCE, name, (p.batch, p.hk * m_chunks, splits), (THREADS, 1, 1), shared)
    append = None
    if p.n_new:
        append = LaunchPlan(SOURCE, f"cupyflash::kv_append<{ctype}>", (p.batch, p.hk, 1), (THREADS, 1, 1), 0)
    rotate = None
    if p.rotary_dim:
        rotate = LaunchPlan(SOURCE, f"cupyflash::rotate_q<{ctype}>", (p.batch, p.hq, 1), (THREADS, 1, 1), 0)
    return DecodePlan(kd, km, kbc, m_chunks, splits, decode, append, rotate)


def merge_name(tin: np.dtype, tout: np.dtype) -> str:
    return f"cupyflash::merge_states<{_dtypes.CTYPE[np.dtype(tin)]}, {_dtypes.CTYPE[np.dtype(tout)]}>"


def instantiations() -> list[tuple[str, str]]:
    """A representative set for CI (tests/test_compile.py; ~6 decode kernels per architecture): the smallest and
    largest row tiles, the 32-key tile of D = 256, the variant policies (a mask, and a window with the score
    mod) at the issue's shape (D = 128, 16 rows), float32 and bfloat16 (float16 is the same code), and the
    append and merge kernels."""
    from ..variants import Variant

    plain = Variant().cpp_policy
    split = "cupyflash::decode_split"
    out = [
        f"{split}<__nv_bfloat16, 128, 4, 64, {plain}>",
        f"{split}<__nv_bfloat16, 128, 64, 64, {plain}>",
        f"{split}<__nv_bfloat16, 256, 16, 32, {plain}>",
        f"{split}<__nv_bfloat16, 128, 16, 64, {Variant(causal=True).cpp_policy}>",
        f"{split}<__nv_bfloat16, 128, 16, 64, {Variant(window=(8, 8), softcap=30.0).cpp_policy}>",
        f"{split}<float, 128, 16, 64, {plain}>",
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
    fields adjacent in the struct go in one ``pack_into``, so a call costs a handful of them."""

    __slots__ = ("runs",)

    def __init__(self, names: tuple[str, ...]) -> None:
        spots = sorted((field_offset(n), i) for i, n in enumerate(names))
        runs: list[tuple[int, list[int]]] = []
        for off, i in spots:
            if runs and runs[-1][0] + 8 * len(runs[-1][1]) == off:
                runs[-1][1].append(i)
            else:
                runs.append((off, [i]))
        self.runs = tuple((struct.Struct("<" + "Q" * len(ix)).pack_into, off, tuple(ix)) for off, ix in runs)

    def write(self, buffer: Any, values: tuple[int, ...]) -> None:
        for pack_into, off, ix in self.runs:
            pack_into(buffer, off, *[values[i] for i in ix])


SEQLEN_CONST_AT = field_offset("seqlen_const")
_INT32 = struct.Struct("<i")


def write_seqlen_const(buffer: Any, value: int) -> None:
    _INT32.pack_into(buffer, SEQLEN_CONST_AT, value)


class _MergeArgs(ctypes.Structure):
    """merge_states' parameters, in order, as the kernel's parameter array points at them."""

    _fields_ = [*((n, ctypes.c_uint64) for n in ("o_parts", "lse_parts", "o", "lse", "sinks")),
                ("rows", ctypes.c_int64), *((n, ctypes.c_int32) for n in ("parts", "d", "nq", "hq"))]


class MergeLaunch:
    """``merge_states`` over a split-KV workspace made ready for repeated calls (as ``build.Launch`` is for the
    struct-argument kernels): its sizes set once, the pointers (``o_parts``, ``lse_parts``, ``o``, ``lse``,
    ``sinks``) assigned per call, one driver call per launch."""

    __slots__ = ("plan", "args", "_argv", "_argv_ptr", "_fn", "_dims")

    def __init__(self, tin: np.dtype, tout: np.dtype, rows: int, parts: int, d: int, nq: int, hq: int) -> None:
        warps = THREADS // 32
        self.plan = LaunchPlan(SOURCE, merge_name(tin, tout), (cdiv(rows, warps), 1, 1), (THREADS, 1, 1), 0)
        self.args = _MergeArgs(rows=rows, parts=parts, d=d, nq=nq, hq=hq)
        base = ctypes.addressof(self.args)
        offsets = [getattr(_MergeArgs, f).offset for f, _ in _MergeArgs._fields_]
        self._argv = (ctypes.c_void_p * len(offsets))(*(base + o for o in offsets))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._fn = 0
        self._dims = (*self.plan.grid, *self.plan.block, 0)

    def fire(self, stream: int) -> None:
        """Queue the merge on ``stream`` with the arguments as they are now (the driver copies them)."""
        import cupy

        if not self._fn:
            self._fn = build._function_ptr(self.plan)
        cupy.cuda.driver.launchKernel(self._fn, *self._dims, stream, self._argv_ptr, 0)


# ---------------------------------------------------------------------------- launches


def launch_merge(o_parts: Any, lse_parts: Any, o: Any, lse: Any, sinks: Any, rows: int, parts: int, d: int,
                 nq: int = 1, hq: int = 1) -> None:  # fmt: skip
    """merge_states over dense (parts, rows, d) / (parts, rows) into dense o (rows, d) and lse (rows,)."""
    if rows == 0:
        return
    fn = build.get_function(SOURCE, merge_name(o_parts.dtype, o.dtype))
    warps = THREADS // 32
    args = (o_parts, lse_parts, o, lse, np.uint64(0 if sinks is None else sinks.data.ptr), np.int64(rows),
            np.int32(parts), np.int32(d), np.int32(nq), np.int32(hq))  # fmt: skip
    build.launch(fn, (cdiv(rows, warps), 1, 1), (THREADS, 1, 1), args)
