"""``AttentionParams`` on the host: the Python mirror of ``cuda_src/attention_params.cuh``.

Every attention kernel takes that one struct by value. ``PARAMS`` is its NumPy layout (natural C
alignment, field for field); ``tests/test_launch_abi.py`` compiles the C++ struct with NVRTC and
checks the size and every offset against it, so the two cannot drift apart.

A launch fills a ``Params`` once per problem signature (sizes, strides, scale, grid order) and only
writes the array pointers per call into each launch's own buffer (``build.Launch``): one ``struct.pack_into`` per
launch (``PointerPacker`` for a fixed set of names, ``pointer_values``/``write_pointers`` for any).
"""
from __future__ import annotations

import struct
from typing import Any, Iterable

import numpy as np

_STRIDES = np.dtype([("b", "<i8"), ("h", "<i8"), ("n", "<i8")], align=True)
_STRIDES4 = np.dtype([("b", "<i8"), ("h", "<i8"), ("q", "<i4"), ("k", "<i4")], align=True)

#: Array pointers, in struct order; they come first so that one pack_into writes them all.
POINTERS: tuple[str, ...] = (
    "q", "k", "v", "o", "lse", "dout", "dq", "dk", "dv", "dq_accum", "delta", "lse_log2", "alibi", "sinks", "dsinks",
    "cu_seqlens_q", "cu_seqlens_k", "seqused_k",  # varlen (issue 14)
    "mask", "bias", "dbias",  # masks and biases (issue 17)
    "dq_turns",
    "aux0", "aux1", "aux2", "aux3", "aux4", "aux5", "aux6", "aux7",  # user snippets' aux arrays (issue 17)
    "bm_kv", "bm_q",  # block masks (issue 17)
    "bm_full_kv", "bm_full_q",  # block masks' runs of FULL blocks (issue 17 speed: full tiles skip mask_mod)
    "bm_bit_index", "bm_bits_q", "bm_bits_k",  # block masks' element bits (issue 17 speed: no mask_mod per pair)
    "kv_part",  # float32 backward's query parts: partial dK/dV (plans.mma.query_parts)
)  # fmt: skip
STRIDE_FIELDS: tuple[str, ...] = ("q_s", "k_s", "v_s", "o_s", "lse_s", "dout_s", "dq_s", "dk_s", "dv_s")
STRIDE4_FIELDS: tuple[str, ...] = ("mask_s", "bias_s", "dbias_s")

PARAMS = np.dtype(
    [(name, "<u8") for name in POINTERS]
    + [(name, _STRIDES) for name in STRIDE_FIELDS]
    + [
        ("rows", "<i8"),
        ("batch", "<i4"),
        ("hq", "<i4"),
        ("hk", "<i4"),
        ("group", "<i4"),
        ("nq", "<i4"),
        ("nk", "<i4"),
        ("d", "<i4"),
        ("scale", "<f4"),
        ("scale_log2", "<f4"),
        ("heads_fastest", "<i4"),
        ("vec", "<i4"),
        ("alibi_sb", "<i8"),
        ("window_left", "<i4"),
        ("window_right", "<i4"),
        ("softcap_scale", "<f4"),
        ("softcap_log2", "<f4"),
        # varlen (issue 14)
        ("total_q", "<i4"),
        ("total_k", "<i4"),
        # masks and biases (issue 17): (b, h, q, k) element strides
        ("mask_s", _STRIDES4),
        ("bias_s", _STRIDES4),
        ("dbias_s", _STRIDES4),
        ("dropout_seed", "<u8"),
        ("dropout_threshold", "<u4"),
        ("dropout_scale", "<f4"),
        ("dropout_b0", "<i4"),
        ("softcap_inv_log2", "<f4"),
        # user snippets (issue 17 part 3): per aux slot, an array's strides and extents or a scalar's value
        ("aux_s", "<i8", (8, 4)),
        ("aux_n", "<i4", (8, 4)),
        ("aux_x", "<f8", (8,)),
        # block masks (issue 17 part 3)
        ("bm_size", "<i4"),
        ("bm_nqb", "<i4"),
        ("bm_nkb", "<i4"),
        ("bm_bb", "<i4"),
        ("bm_hb", "<i4"),
        ("bm_magic", "<u4"),
        ("bm_magic_shift", "<i4"),
        # dbias stores (issue 17 speed): 1 = dbias is the output, one element per pair (no atomics)
        ("dbias_direct", "<i4"),
        # deterministic backward (issue 16, turns v2): heads per group of the key-major grid order
        ("dq_head_group", "<i4"),
        # dbias summed over the batch (issue 17 speed): the backward's grid runs one kv head's batches together
        ("batch_inner", "<i4"),
        # float32 backward's query parts (plans.mma.query_parts): blocks a key tile's query tiles are split over
        ("q_parts", "<i4"),
    ],
    align=True,
)

_POINTER_PACK = struct.Struct("<" + "Q" * len(POINTERS))

#: ``TmaParams`` (attention_params.cuh), the argument of the kernels that copy by TMA: AttentionParams at offset 0,
#: then the TMA maps (``TensorMap``: 128 opaque bytes aligned to 128) of these pointer fields, in this order.
TMA_MAPS: tuple[str, ...] = ("q", "dout", "k", "v")  # the backward maps q and dout, the ws forward q, k and v
TENSOR_MAP_BYTES = TENSOR_MAP_ALIGN = 128
_FIRST_MAP = -(-PARAMS.itemsize // TENSOR_MAP_ALIGN) * TENSOR_MAP_ALIGN
TMA_PARAMS = np.dtype({"names": ["p", *(f"tma_{n}" for n in TMA_MAPS)],
                       "formats": [PARAMS, *[("u1", (TENSOR_MAP_BYTES,))] * len(TMA_MAPS)],
                       "offsets": [0, *(_FIRST_MAP + i * TENSOR_MAP_BYTES for i in range(len(TMA_MAPS)))],
                       "itemsize": _FIRST_MAP + len(TMA_MAPS) * TENSOR_MAP_BYTES})  # fmt: skip
#: Byte offset in TmaParams of the map of each pointer field of TMA_MAPS (multiples of TENSOR_MAP_ALIGN).
MAP_OFFSETS: dict[str, int] = {n: TMA_PARAMS.fields[f"tma_{n}"][1] for n in TMA_MAPS}


def with_tensor_maps(params: bytes) -> bytes:
    """AttentionParams bytes as TmaParams bytes: the maps zeroed (a launch writes them per call, tensor_map.py)."""
    return bytes(params) + bytes(TMA_PARAMS.itemsize - len(params))


class Params:
    """One call's ``AttentionParams`` bytes: the static part set once, pointers set per call."""

    __slots__ = ("_record",)

    def __init__(self) -> None:
        self._record = np.zeros((), PARAMS)

    def set(self, **fields: Any) -> "Params":
        """Sizes, strides (3-tuples), scales and flags by field name."""
        for name, value in fields.items():
            if name in STRIDE_FIELDS or name in STRIDE4_FIELDS:
                value = tuple(int(s) for s in value)
            self._record[name] = value
        return self

    def to_bytes(self) -> bytes:
        return self._record.tobytes()

    @staticmethod
    def pointer_values(pointers: dict[str, int], offsets: dict[str, int] | None = None) -> list[int]:
        """The pointer block's values in struct order: named pointers (plus byte ``offsets``), 0 for the rest."""
        get = pointers.get
        if not offsets:
            return [get(name, 0) for name in POINTERS]
        return [get(name, 0) + offsets.get(name, 0) if name in pointers else 0 for name in POINTERS]

    @staticmethod
    def write_pointers(buffer: Any, values: list[int]) -> None:
        """Write ``pointer_values`` into the leading pointer block of a writable struct buffer."""
        _POINTER_PACK.pack_into(buffer, 0, *values)



class PointerPacker:
    """Writes the whole pointer block of one fixed set of pointer names in one ``pack_into``: a struct over every
    slot of ``POINTERS``, 8 pad bytes (written as zeros) for each slot not named. So it writes exactly what
    ``write_pointers(buffer, pointer_values(...))`` writes, without a value list built per call.
    ``pack_into(buffer, 0, *values)`` takes the values in struct order, ``names``."""

    __slots__ = ("names", "pack_into")

    def __init__(self, names: Iterable[str]) -> None:
        named = set(names)
        unknown = named.difference(POINTERS)
        if unknown:
            raise ValueError(f"not pointer fields of AttentionParams: {sorted(unknown)}")
        self.names = tuple(n for n in POINTERS if n in named)
        self.pack_into = struct.Struct("<" + "".join("Q" if n in named else "8x" for n in POINTERS)).pack_into


_SEED_AT = PARAMS.fields["dropout_seed"][1]
_B0_AT = PARAMS.fields["dropout_b0"][1]


def write_dropout(buf: bytearray, seed: int, b0: int) -> None:
    """A call's dropout seed and its launch's first batch index into a launch's params buffer."""
    struct.pack_into("<Q", buf, _SEED_AT, seed)
    write_batch0(buf, b0)


def write_batch0(buf: bytearray, b0: int) -> None:
    """A launch's first batch index (dropout's keys and user snippets' ``b`` are global batch indices)."""
    struct.pack_into("<i", buf, _B0_AT, b0)


def field_offsets() -> dict[str, int]:
    """Byte offset of every field, nested stride members as ``q_s.b`` etc. (for the layout test)."""
    out: dict[str, int] = {}
    for name in PARAMS.names:
        dt, off = PARAMS.fields[name][:2]
        if dt.names:
            for sub in dt.names:
                out[f"{name}.{sub}"] = off + dt.fields[sub][1]
        else:
            out[name] = off
    return out
