"""The wgmma backward's and ws forward's TMA paths (kTma) on the CPU: the maps of (B, H, N, d) views, when the plans
take them, and what a call writes into the kernel's TmaParams, with CuPy's device calls faked
(benchmarks/dev_host_fake.py) and the driver's encoder replaced by a recorder (no GPU, no libcuda).
"""
from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.dev_host_fake import FakeDevice  # noqa: E402

import cupyflash  # noqa: E402
from cupyflash import cuda_backend  # noqa: E402
from cupyflash.kernels import tensor_map  # noqa: E402
from cupyflash.kernels.params import MAP_OFFSETS, PARAMS, POINTERS, TMA_PARAMS  # noqa: E402
from cupyflash.plans import H100  # noqa: E402
from cupyflash.plans import wgmma as plans  # noqa: E402
from cupyflash.variants import Variant  # noqa: E402

BF16 = np.dtype("bfloat16")
SLOT = {n: 8 * i for i, n in enumerate(POINTERS)}


# ---------------------------------------------------------------------------- maps of views


def test_contiguous_view():
    spec = tensor_map.view_spec("q", "__nv_bfloat16", 2, 2, 4, 1000, 128, (4 * 1000 * 128, 1000 * 128, 128), 64)
    assert spec.dims == (128, 1000, 4, 2) and spec.strides == (256, 256 * 1000, 256 * 4000)
    assert spec.box == (64, 64, 1, 1) and spec.dtype == "__nv_bfloat16"


def test_bnhd_view_and_small_head_dim():
    # (B, N, H, D) memory seen as (B, H, N, D): rows H * D apart, heads D apart
    spec = tensor_map.view_spec("dout", "__half", 2, 3, 8, 500, 40, (500 * 8 * 40, 40, 8 * 40), 128)
    assert spec.dims == (40, 500, 8, 3) and spec.strides == (8 * 80, 80, 500 * 8 * 80) and spec.box == (64, 128, 1, 1)


def test_extent_one_axes_take_packed_strides():
    spec = tensor_map.view_spec("q", "__nv_bfloat16", 2, 1, 1, 17, 64, (7, 3, 128), 64)
    assert spec.strides == (256, 17 * 256, 17 * 256)  # rows 128 elements apart; the extent-1 axes packed after them


@pytest.mark.parametrize("strides, why", [((36 * 1000, 36 * 1000, 36), "row stride of 72 bytes"),
                                          ((128 * 1000, 0, 128), "head stride of 0 bytes"),
                                          ((128 * 1000, 128 * 100, -128), "row stride of -256 bytes")])
def test_views_tma_cannot_describe(strides, why):
    d = 36 if strides[2] == 36 else 128
    assert why in tensor_map.view_spec("q", "__nv_bfloat16", 2, 2, 10, 100, d, strides, 64)


def test_only_16_bit_elements():
    assert "16-bit" in tensor_map.view_spec("q", "float", 4, 1, 1, 100, 64, (6400, 6400, 64), 64)


# ---------------------------------------------------------------------------- the plan's choice


def _maps(rows: int = 64):
    return tuple(tensor_map.view_spec(n, "__nv_bfloat16", 2, 1, 8, 4096, 128, (8 * 4096 * 128, 4096 * 128, 128), rows)
                 for n in ("q", "dout"))  # fmt: skip


def _maps_for(cfg) -> tuple:
    """plan_backward's ``maps``: the maps of _maps whatever the configuration (D = 128's Br = 64 rows)."""
    return _maps(cfg.br)


@pytest.mark.parametrize("variant", [Variant(), Variant(causal=True), Variant(causal=True, window=(1024, 0)),
                                     Variant(causal=True, alibi=True), Variant(softcap=30.0)])  # fmt: skip
def test_the_loader_copies_by_tma_where_maps_come(variant):
    plan = plans.plan_backward(1, 8, 8, 4096, 4096, 128, "__nv_bfloat16", H100, variant=variant, maps=_maps_for)
    assert plan.main.name.endswith(", false, false, true, true>") and plan.main.tensor_maps == _maps()
    assert plan.main.block == (384, 1, 1)
    plain = plans.plan_backward(1, 8, 8, 4096, 4096, 128, "__nv_bfloat16", H100, variant=variant)
    assert plain.main.name.endswith(", false, false, true>") and plain.main.tensor_maps == ()
    assert plain.main.shared_bytes == plan.main.shared_bytes and plain.main.grid == plan.main.grid


def test_no_tma_without_the_loader_or_when_turned_off(monkeypatch):
    dropout = plans.plan_backward(1, 8, 8, 4096, 4096, 128, "__nv_bfloat16", H100, variant=Variant(dropout=0.1),
                                  maps=_maps_for)  # fmt: skip
    assert dropout.main.tensor_maps == () and dropout.main.name.endswith(", false, true>")  # the drawer
    own = plans.plan_backward(1, 8, 8, 128, 128, 128, "__nv_bfloat16", H100, maps=_maps_for)  # one key tile: kOwnDQ
    assert own.own_dq and own.main.tensor_maps == ()
    monkeypatch.setattr(plans, "TMA", False)
    off = plans.plan_backward(1, 8, 8, 4096, 4096, 128, "__nv_bfloat16", H100, maps=_maps_for)
    assert off.main.name.endswith(", false, false, true>") and off.main.tensor_maps == ()
    with pytest.raises(ValueError, match="kTma needs kLoader"):
        plans.BACKWARD_CONFIGS[64].name("__half", "P", tma=True)


# ---------------------------------------------------------------------------- what a call writes


class Driver:
    """cuTensorMapEncodeTiled / cuTensorMapReplaceAddress recorded; each writes the address it is given into the
    map's first 8 bytes and a marker into the next 8 (so the launch's bytes show which call wrote them)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def encode(self, at, dtype, rank, address, dims, strides, box, ones, interleave, swizzle, l2, oob):
        self.calls.append(("encode", at, address, dtype, rank, tuple(dims), tuple(strides), tuple(box), tuple(ones),
                           interleave, swizzle, oob))  # fmt: skip
        ctypes.memmove(at, address.to_bytes(8, "little") + b"ENCODED!", 16)
        return 0

    def replace(self, at, address):
        self.calls.append(("replace", at, address))
        ctypes.memmove(at, address.to_bytes(8, "little") + b"REPLACED", 16)
        return 0


class Device(FakeDevice):
    """Keeps each launch's parameter bytes: TmaParams for the main kernel (384 threads), else AttentionParams."""

    def __init__(self, tma: bool) -> None:
        super().__init__()
        self.tma = tma
        self.params: list[bytes] = []

    def launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, argv, extra) -> None:
        super().launch()
        first = ctypes.cast(argv, ctypes.POINTER(ctypes.c_void_p))[0]
        maps = self.takes_maps(bx)
        if maps:
            assert first % 128 == 0, "the maps' buffer is 128-byte aligned"
        self.params.append(ctypes.string_at(first, TMA_PARAMS.itemsize if maps else PARAMS.itemsize))

    def takes_maps(self, threads: int) -> bool:
        """Does a launch of this many threads a block take TmaParams? The backward's main kernel (384 threads)."""
        return self.tma and threads == 384


def _recording(monkeypatch, cache: dict):
    """A recording Driver in place of libcuda's, with the pass's plan cache cleared before and after the test."""
    d = Driver()
    monkeypatch.setattr(tensor_map, "driver_functions", lambda: (d.encode, d.replace))
    cache.clear()
    yield d
    cache.clear()


@pytest.fixture
def driver(monkeypatch):
    yield from _recording(monkeypatch, cuda_backend._backward_cache)


def _arrays(dev, shape, strides=None, n=6, dtype=BF16):
    step = -(-int(np.prod(shape)) * dtype.itemsize // 4096) * 4096
    return [dev.array(shape, dtype, i * step, strides) for i in range(n)]


def _map_bytes(params: bytes, name: str) -> tuple[int, bytes]:
    at = MAP_OFFSETS[name]
    return int.from_bytes(params[at:at + 8], "little"), params[at + 8:at + 16]


def _main_plan():
    (prep,) = [p for key, p in cuda_backend._backward_cache.items() if len(key) == 2]
    return next(lp for lp, _ in prep.plan.launches if lp.name.startswith("wgmma_flash_bwd"))


def test_a_call_encodes_its_maps_once_then_replaces_the_addresses(driver):
    """Encoded at the first call; new arrays replace the addresses; the same arrays again make no driver call."""
    b, h, n, d = 2, 4, 1000, 128  # ragged: 1000 rows are not a multiple of Br = 64
    with Device(tma=True) as dev:
        q, k, v, o, do, spare = _arrays(dev, (b, h, n, d))
        lse = dev.array((b, h, n), np.float32, 1 << 26)
        cupyflash.attention_backward(do, q, k, v, o, lse, causal=True)
        main = _main_plan()
        assert main.name.endswith(", true, true>") and [s.pointer for s in main.tensor_maps] == ["q", "dout"]
        encodes = [c for c in driver.calls if c[0] == "encode"]
        assert [c[2] for c in encodes] == [q.data.ptr, do.data.ptr]
        for c in encodes:
            assert c[3:] == (9, 4, (d, n, h, b), (2 * d, 2 * d * n, 2 * d * n * h), (64, 64, 1, 1), (1, 1, 1, 1), 0, 3,
                             0)  # fmt: skip
        params = dev.params[1]  # Delta, main, dQ conversion
        assert len(params) == TMA_PARAMS.itemsize
        assert _map_bytes(params, "q") == (q.data.ptr, b"ENCODED!")
        assert _map_bytes(params, "dout") == (do.data.ptr, b"ENCODED!")
        assert int.from_bytes(params[SLOT["q"]:SLOT["q"] + 8], "little") == q.data.ptr
        # the next call (new q and dout, the same signature) replaces the two addresses in place
        driver.calls.clear()
        cupyflash.attention_backward(spare, o, k, v, o, lse, causal=True)
        assert [c[0] for c in driver.calls] == ["replace", "replace"]
        assert [c[2] for c in driver.calls] == [o.data.ptr, spare.data.ptr]
        assert {c[1] % 128 for c in driver.calls} == {0}
        params = dev.params[4]
        assert _map_bytes(params, "q") == (o.data.ptr, b"REPLACED")
        assert _map_bytes(params, "dout") == (spare.data.ptr, b"REPLACED")
        assert len(dev.params[3]) == PARAMS.itemsize  # Delta: AttentionParams
        # the same arrays again: the maps already hold their addresses, so no driver call; the launch still carries them
        driver.calls.clear()
        cupyflash.attention_backward(spare, o, k, v, o, lse, causal=True)
        assert driver.calls == []
        assert _map_bytes(dev.params[7], "q") == (o.data.ptr, b"REPLACED")
        # back to the first arrays: replaced again
        cupyflash.attention_backward(do, q, k, v, o, lse, causal=True)
        assert [c[2] for c in driver.calls] == [q.data.ptr, do.data.ptr]
        assert _map_bytes(dev.params[10], "dout") == (do.data.ptr, b"REPLACED")


def test_strided_views_and_gqa_map_their_own_strides(driver):
    b, n, hq, hk, d = 2, 700, 8, 2, 96
    with Device(tma=True) as dev:
        qs = _arrays(dev, (b, n, hq, d), n=3)  # (B, N, H, D) memory seen through a transpose
        q, o, do = (x.transpose(0, 2, 1, 3) for x in qs)
        k = dev.array((b, n, hk, d), BF16, 1 << 27).transpose(0, 2, 1, 3)
        v = dev.array((b, n, hk, d), BF16, 1 << 28).transpose(0, 2, 1, 3)
        lse = dev.array((b, hq, n), np.float32, 1 << 29)
        cupyflash.attention_backward(do, q, k, v, o, lse, window_size=(256, 0))
        main = _main_plan()
        assert main.name.endswith(", true, true>")
        spec = main.tensor_maps[0]
        assert spec.dims == (d, n, hq, b) and spec.strides == (hq * d * 2, d * 2, n * hq * d * 2)
        assert spec.box == (64, 64, 1, 1)  # D = 96 pads to 128: Br = 64; columns 96..127 are the map's zeros


def test_a_view_tma_cannot_map_keeps_cp_async(driver):
    b, h, n, d = 1, 4, 512, 64
    with Device(tma=False) as dev:
        k, v, o, do = _arrays(dev, (b, h, n, d), n=4)
        q = dev.array((b, 1, n, d), BF16, 1 << 27)
        q = cupy.lib.stride_tricks.as_strided(q, (b, h, n, d), (n * d * 2, 0, d * 2, 2))  # one head read four times
        lse = dev.array((b, h, n), np.float32, 1 << 28)
        cupyflash.attention_backward(do, q, k, v, o, lse)
        main = _main_plan()
        assert main.name.endswith(", false, false, true>") and main.tensor_maps == ()
        assert driver.calls == []


def test_turned_off_the_loader_copies_by_cp_async(driver, monkeypatch):
    monkeypatch.setattr(plans, "TMA", False)
    with Device(tma=False) as dev:
        q, k, v, o, do = _arrays(dev, (1, 4, 512, 128), n=5)
        lse = dev.array((1, 4, 512), np.float32, 1 << 27)
        cupyflash.attention_backward(do, q, k, v, o, lse)
        assert _main_plan().name.endswith(", false, false, true>") and driver.calls == []
        assert all(len(p) == PARAMS.itemsize for p in dev.params)


def test_sub_batches_map_their_own_addresses(driver):
    """Batch dims that cannot merge run once per sub-batch: each launch's maps take that sub-batch's addresses (the
    first encoded, the next replaced), over the sub-batch's own batch extent."""
    h, n, d = 2, 300, 64
    with Device(tma=True) as dev:
        full = _arrays(dev, (2, 5, h, n, d), n=5)
        q, k, v, o, do = (x[:, :3] for x in full)  # (2, 3) batch dims 5 apart: they do not merge
        lse = dev.array((2, 3, h, n), np.float32, 1 << 28)
        cupyflash.attention_backward(do, q, k, v, o, lse)
        main = _main_plan()
        assert main.name.endswith(", true, true>") and main.tensor_maps[0].dims[3] == 3
        sub = 5 * h * n * d * 2  # bytes between the two sub-batches
        assert [(c[0], c[2]) for c in driver.calls] == [("encode", q.data.ptr), ("encode", do.data.ptr),
                                                        ("replace", q.data.ptr + sub), ("replace", do.data.ptr + sub)]


# ---------------------------------------------------------------------------- the ws forward's producer (kTma)


def _fwd_maps(br: int, bc: int, hq: int = 8, hk: int = 8, nq: int = 4096, nk: int = 4096, d: int = 128):
    def view(name, h, n, rows):
        return tensor_map.view_spec(name, "__nv_bfloat16", 2, 1, h, n, d, (h * n * d, n * d, d), rows)

    return (view("q", hq, nq, br), view("k", hk, nk, bc), view("v", hk, nk, bc))


def _fwd_plan(d, variant=Variant(), nq=4096, **kw):
    def maps(cfg):
        return _fwd_maps(cfg.br, cfg.bc, nq=nq, d=d)

    return plans.plan_forward(1, 8, nq, d, "__nv_bfloat16", H100, variant=variant, maps=maps, **kw)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", [Variant(), Variant(causal=True), Variant(causal=True, window=(1023, 0)),
                                     Variant(softcap=30.0), Variant(causal=True, flex=None, dropout=0.1)])  # fmt: skip
def test_the_ws_forward_copies_by_tma_where_maps_come(d, variant):
    cfg = plans.WS_FORWARD_CONFIGS[d]
    plan = _fwd_plan(d, variant)
    assert plan.config.ws and plan.main.tensor_maps == _fwd_maps(cfg.br, cfg.bc, d=d)
    assert plan.main.name.endswith(", true, true>" if plan.config.persistent else ", false, true>")
    q, k, v = plan.main.tensor_maps
    assert q.box == (64, cfg.br, 1, 1) and k.box == v.box == (64, cfg.bc, 1, 1)
    plain = plans.plan_forward(1, 8, 4096, d, "__nv_bfloat16", H100, variant=variant)  # no maps: cp.async
    assert plain.main.tensor_maps == () and plain.main.name == plan.main.name.rsplit(", ", 2)[0] + (
        ", true>" if plan.config.persistent else ">")
    assert (plain.main.grid, plain.main.block, plain.main.shared_bytes) == (plan.main.grid, plan.main.block,
                                                                            plan.main.shared_bytes)  # fmt: skip


def test_no_tma_forward_on_the_lockstep_kernel_or_when_turned_off(monkeypatch):
    lockstep = _fwd_plan(64, Variant(causal=True, dropout=0.1), nq=1000)  # D = 64 causal, short: the lockstep kernel
    assert not lockstep.config.ws and lockstep.main.tensor_maps == ()
    arrays = _fwd_plan(128, Variant(bias="__nv_bfloat16"))  # staged bias tiles: lockstep
    assert not arrays.config.ws and arrays.main.tensor_maps == ()
    no_maps = plans.plan_forward(1, 8, 4096, 128, "__nv_bfloat16", H100, maps=lambda cfg: "varlen")
    assert no_maps.main.tensor_maps == () and no_maps.main.name.endswith("PlainScore>>")
    monkeypatch.setattr(plans, "TMA_FORWARD", False)
    off = _fwd_plan(128)
    assert off.config.ws and off.main.tensor_maps == () and off.main.name.endswith("PlainScore>>")
    with pytest.raises(ValueError, match="kTma needs ws"):
        plans.FORWARD_CONFIGS[64].name("__half", "P", tma=True)


class FwdDevice(Device):
    """The ws forward's one launch: TmaParams where it copies by TMA."""

    def takes_maps(self, threads: int) -> bool:
        return self.tma


@pytest.fixture
def fwd_driver(monkeypatch):
    yield from _recording(monkeypatch, cuda_backend._forward_cache)


def _fwd_main():
    (prep,) = {id(p): p for p in cuda_backend._forward_cache.values()}.values()
    return prep.plan.launches[0][0]


def test_a_forward_call_maps_q_k_v(fwd_driver):
    """Ragged rows (1000), GQA: q's map over Hq heads with boxes of Br rows, k's and v's over Hk with Bc rows;
    encoded once, replaced by new arrays, nothing for the same arrays again."""
    b, hq, hk, n, d = 2, 8, 2, 1000, 128
    with FwdDevice(tma=True) as dev:
        q, spare = _arrays(dev, (b, hq, n, d), n=2)
        k, v = (dev.array((b, hk, n, d), BF16, (1 << 26) * (i + 1)) for i in range(2))
        cupyflash.attention_forward(q, k, v, causal=True)
        main = _fwd_main()
        assert main.name.startswith("wgmma_flash_fwd_ws<") and main.name.endswith(", true, true>")  # persistent
        cfg = plans.WS_FORWARD_CONFIGS[128]
        mq, mk, mv = main.tensor_maps
        assert mq.dims == (d, n, hq, b) and mq.box == (64, cfg.br, 1, 1)
        assert mk.dims == mv.dims == (d, n, hk, b) and mk.box == (64, cfg.bc, 1, 1)
        assert [(c[0], c[2]) for c in fwd_driver.calls] == [("encode", q.data.ptr), ("encode", k.data.ptr),
                                                            ("encode", v.data.ptr)]  # fmt: skip
        (params,) = dev.params
        assert len(params) == TMA_PARAMS.itemsize
        for name, arr in (("q", q), ("k", k), ("v", v)):
            assert _map_bytes(params, name) == (arr.data.ptr, b"ENCODED!")
        assert _map_bytes(params, "dout") == (0, bytes(8))  # the backward's slot stays zero
        fwd_driver.calls.clear()
        cupyflash.attention_forward(spare, k, v, causal=True)
        assert [(c[0], c[2]) for c in fwd_driver.calls] == [("replace", spare.data.ptr), ("replace", k.data.ptr),
                                                            ("replace", v.data.ptr)]  # fmt: skip
        fwd_driver.calls.clear()
        cupyflash.attention_forward(spare, k, v, causal=True)
        assert fwd_driver.calls == [] and _map_bytes(dev.params[-1], "q") == (spare.data.ptr, b"REPLACED")


def test_a_forward_of_bnhd_views_maps_their_strides(fwd_driver):
    b, n, h, d = 2, 700, 4, 64
    with FwdDevice(tma=True) as dev:
        q, k, v = (x.transpose(0, 2, 1, 3) for x in _arrays(dev, (b, n, h, d), n=3))
        cupyflash.attention_forward(q, k, v)
        main = _fwd_main()
        assert main.name.endswith(", true, true>")  # persistent (short rows), by TMA
        for spec in main.tensor_maps:
            assert spec.dims == (d, n, h, b) and spec.strides == (h * d * 2, d * 2, n * h * d * 2)


def test_a_forward_tma_cannot_map_keeps_cp_async(fwd_driver):
    b, h, n, d = 1, 4, 512, 128
    with FwdDevice(tma=False) as dev:
        (q,) = _arrays(dev, (b, h, n, d), n=1)
        kv = dev.array((b, 1, n, d), BF16, 1 << 27)
        k = v = cupy.lib.stride_tricks.as_strided(kv, (b, h, n, d), (n * d * 2, 0, d * 2, 2))  # one head, read 4 times
        cupyflash.attention_forward(q, k, v)
        main = _fwd_main()
        assert main.name.startswith("wgmma_flash_fwd_ws<") and main.tensor_maps == () and fwd_driver.calls == []
