"""TMA descriptors (the driver's ``CUtensorMap``) of the arrays a kernel copies by TMA (``cp.async.bulk.tensor``).

A map describes a strided (B, H, N, d) view innermost first, (d, N, H, B) with byte strides; the box one copy moves
(64 columns x ``rows`` rows, one head of one batch); the 128-byte swizzle, which makes TMA's shared-memory layout the
kernels' ``TileLayout<64>`` slabs (chunk c of row r at 16 * (c ^ (r % 8)) in 128-byte rows, from a 1024-byte aligned
base); and zeros for what lies outside the view (rows past N, columns past d), as the cp.async copies zero-fill.

``cuTensorMapEncodeTiled`` and ``cuTensorMapReplaceAddress`` come from libcuda through ctypes (no new dependency),
looked up once. A map's shape part is the call signature's (so fixed per cached plan): a launch encodes its maps in
its own argument buffer at its first call (``MapWriter``) and afterwards only replaces their addresses.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence

from .params import MAP_OFFSETS, TENSOR_MAP_ALIGN, TMA_MAPS

#: CUtensorMapDataType of the kernels' element types (cuda.h).
DATA_TYPE = {"__half": 6, "__nv_bfloat16": 9}
_INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO = 0, 3, 3, 0
#: The box's inner extent: 64 two-byte columns, the 128-byte swizzle's span (and a TileLayout<64> slab's row).
BOX_COLUMNS = 64
#: Limits of cuTensorMapEncodeTiled: extents, byte strides (multiples of 16), box extents.
MAX_EXTENT, MAX_STRIDE, MAX_BOX = 2**31, 2**40, 256


@dataclass(frozen=True)
class TensorMapSpec:
    """The map of one pointer field of the params (``params.TMA_MAPS``): a (B, H, N, d) view, innermost first."""

    pointer: str
    dtype: str  # the C++ element type (DATA_TYPE)
    dims: tuple[int, int, int, int]  # elements: d, N, H, B
    strides: tuple[int, int, int]  # bytes between consecutive rows, heads, batches
    box: tuple[int, int, int, int]  # elements one copy moves: BOX_COLUMNS, rows, 1, 1


def view_spec(pointer: str, dtype: str, itemsize: int, batch: int, heads: int, n: int, d: int,
              strides: Sequence[int], rows: int) -> TensorMapSpec | str:  # fmt: skip
    """The map of a (batch, heads, n, d) view with element ``strides`` (b, h, n; d contiguous) that one copy moves
    ``rows`` rows of, or why TMA cannot describe it. A stride along an axis of extent 1 is never used: it is
    replaced by a packed one, so that any layout of such an axis maps."""
    if pointer not in TMA_MAPS:
        raise ValueError(f"no TMA map slot for {pointer!r} (params.TMA_MAPS: {TMA_MAPS})")
    if dtype not in DATA_TYPE or itemsize != 2:
        return f"TMA maps here are of 16-bit elements (got {dtype})"
    if not 0 < rows <= MAX_BOX or BOX_COLUMNS * itemsize != 128:
        return f"a box of {rows} rows does not fit TMA"
    sb, sh, sn = strides
    extents = (n, heads, batch)
    if min(d, *extents) < 1 or max(d, *extents) > MAX_EXTENT:
        return f"extents {(batch, heads, n, d)} out of TMA's range"
    out, packed = [], -(-d * itemsize // 16) * 16
    for extent, stride in zip(extents, (sn, sh, sb)):
        if extent == 1:
            stride_bytes = packed if packed < MAX_STRIDE else 16
        else:
            stride_bytes = stride * itemsize
            if stride_bytes <= 0 or stride_bytes % 16 or stride_bytes >= MAX_STRIDE:
                return f"a {('row', 'head', 'batch')[len(out)]} stride of {stride_bytes} bytes (TMA: a positive " \
                       "multiple of 16)"
        out.append(stride_bytes)
        packed = -(-stride_bytes * extent // 16) * 16
    return TensorMapSpec(pointer, dtype, (d, n, heads, batch), tuple(out), (BOX_COLUMNS, rows, 1, 1))


# ---------------------------------------------------------------------------- the driver's encoder, through ctypes

_U64x4, _U64x3, _U32x4 = ctypes.c_uint64 * 4, ctypes.c_uint64 * 3, ctypes.c_uint32 * 4
_driver_fns: tuple | None = None


def driver_functions() -> tuple:
    """(cuTensorMapEncodeTiled, cuTensorMapReplaceAddress) from libcuda.so.1, looked up once."""
    global _driver_fns
    if _driver_fns is None:
        lib = ctypes.CDLL("libcuda.so.1")
        encode, replace = lib.cuTensorMapEncodeTiled, lib.cuTensorMapReplaceAddress
        p, i, u32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32
        encode.argtypes = [p, i, u32, p, _U64x4, _U64x3, _U32x4, _U32x4, i, i, i, i]
        replace.argtypes = [p, p]
        encode.restype = replace.restype = i
        _driver_fns = (encode, replace)
    return _driver_fns


class TensorMapError(RuntimeError):
    """The driver refused to encode a map (a CUresult other than CUDA_SUCCESS)."""


class MapWriter:
    """Writes one launch's TMA maps into its argument buffer (TmaParams bytes at ``base``, 128-byte aligned) per
    call: encoded at the first call, only their addresses replaced after (the shapes are the plan's)."""

    __slots__ = ("specs", "_at", "_args", "_encoded", "_last")

    def __init__(self, base: int, specs: Sequence[TensorMapSpec]) -> None:
        if base % TENSOR_MAP_ALIGN:
            raise ValueError(f"the argument buffer at {base:#x} is not {TENSOR_MAP_ALIGN}-byte aligned")
        self.specs = tuple(specs)
        self._at = tuple(base + MAP_OFFSETS[s.pointer] for s in self.specs)
        # The encoder's arrays, built once: (data type, dims, strides, box, element strides)
        self._args = tuple((DATA_TYPE[s.dtype], _U64x4(*s.dims), _U64x3(*s.strides), _U32x4(*s.box), _U32x4(1, 1, 1, 1))
                           for s in self.specs)  # fmt: skip
        self._encoded = False
        self._last: tuple[int, ...] = ()  # the addresses the maps hold now

    def __call__(self, addresses: Sequence[int]) -> None:
        """The maps of ``specs`` with these array addresses (one per spec, in order; 16-byte aligned). Maps that
        already hold them are left as they are (a loop over the same arrays, or the pool handing back the same
        blocks, costs no driver call)."""
        if type(addresses) is not tuple:
            addresses = tuple(addresses)
        if addresses == self._last:
            return
        encode, replace = driver_functions()
        self._last = ()  # until every map holds the new addresses
        if self._encoded:
            for at, address in zip(self._at, addresses):
                err = replace(at, address)
                if err:
                    raise TensorMapError(f"cuTensorMapReplaceAddress({address:#x}) returned CUresult {err}")
            self._last = addresses
            return
        for at, address, spec, (dtype, dims, strides, box, ones) in zip(self._at, addresses, self.specs, self._args):
            err = encode(at, dtype, 4, address, dims, strides, box, ones, _INTERLEAVE_NONE, _SWIZZLE_128B,
                         _L2_PROMOTION_256B, _OOB_FILL_ZERO)  # fmt: skip
            if err:
                raise TensorMapError(f"cuTensorMapEncodeTiled({spec}, address {address:#x}) returned CUresult {err}")
        self._encoded = True
        self._last = addresses
