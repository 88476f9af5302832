"""Every launcher passes exactly the arguments its kernel declares, checked without a GPU.

The launchers run against stand-ins (NumPy arrays for device arrays, a recorder for the
compiled function, H100 limits); each recorded launch is compared with the parameter list
that NVRTC's PTX gives for the instantiation: same count, and 8-byte pointers and int64s
where the kernel has 8-byte parameters, 4-byte scalars where it has 4-byte ones.
"""
from __future__ import annotations

import re
import types

import numpy as np
import pytest

from test_compile import NVRTC_REASON

pytestmark = pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON))


class _DeviceArray(np.ndarray):
    """A host array that looks enough like a CuPy array for the launchers."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _empty(shape, dtype=None):
    return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else 0, dtype).view(_DeviceArray)


@pytest.fixture
def launches(monkeypatch):
    import cupy

    from cupyflash import plans
    from cupyflash.kernels import build

    seen = []

    class Recorder:
        max_dynamic_shared_size_bytes = 0
        preferred_shared_memory_carveout = 0

        def __init__(self, source, name):
            self.source, self.name = source, name

        def __call__(self, grid, block, args, shared_mem=0):
            seen.append((self.source, self.name, args))

    monkeypatch.setattr(build, "get_function", lambda source, name: Recorder(source, name))
    monkeypatch.setattr(plans.DeviceLimits, "current", classmethod(lambda cls: plans.H100))
    monkeypatch.setattr(cupy, "empty", _empty)
    monkeypatch.setattr(cupy, "zeros", _empty)
    return seen


def _ptx_param_sizes(source: str, name: str) -> list[int]:
    from cupy.cuda import nvrtc

    from cupyflash.kernels.build import ARCH_SPECIFIC, compile_options, read_source

    arch = ARCH_SPECIFIC.get(source, "sm_80").replace("sm_", "compute_")
    prog = nvrtc.createProgram(read_source(source), source, [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, [*compile_options(), f"-arch={arch}"])
        lowered = nvrtc.getLoweredName(prog, name)
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    head = ptx[ptx.index(f".entry {lowered}(") :]
    head = head[: head.index(")")]
    return [int(m.group(1)) // 8 for m in re.finditer(r"\.param \.[a-z]+?(\d+) ", head)]


def _arg_size(a) -> int:
    if isinstance(a, np.ndarray):
        return 8  # a device pointer
    return np.dtype(type(a)).itemsize


def _check(seen):
    assert seen, "nothing was launched"
    for source, name, args in seen:
        want = _ptx_param_sizes(source, name)
        got = [_arg_size(a) for a in args]
        assert got == want, f"{name}: launcher passes sizes {got}, kernel declares {want}"


def _problem(dtype, causal=True):
    from cupyflash.validation import check_attention

    q = _empty((2, 4, 33, 64), dtype)
    k = _empty((2, 2, 40, 64), dtype)
    v = _empty((2, 2, 40, 64), dtype)
    q[...] = k[..., :1, :1] = v[..., :1, :1] = 1.0
    return q, k, v, check_attention(q, k, v, causal=causal)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("strategy", ["atomic", "separate"])
def test_portable_launches_match_kernels(launches, dtype, strategy):
    from cupyflash.kernels import portable

    q, k, v, p = _problem(np.dtype(dtype))
    o, lse = _empty(q.shape, q.dtype), _empty(q.shape[:-1], np.float32)
    portable.forward(q, k, v, o, lse, p)
    portable.backward(o, q, k, v, o, lse, _empty(q.shape, q.dtype), _empty(k.shape, k.dtype),
                      _empty(v.shape, v.dtype), p, dq_strategy=strategy)  # fmt: skip
    _check(launches)


@pytest.mark.parametrize("causal", [False, True])
def test_mma_launches_match_kernels(launches, causal):
    from cupyflash.kernels import mma

    q, k, v, p = _problem(np.dtype(np.float16), causal)
    o, lse = _empty(q.shape, q.dtype), _empty(q.shape[:-1], np.float32)
    mma.forward(q, k, v, o, lse, p)
    mma.backward(o, q, k, v, o, lse, _empty(q.shape, q.dtype), _empty(k.shape, k.dtype), _empty(v.shape, v.dtype), p)
    names = [name for _, name, _ in launches]
    assert any(n.startswith("mma_flash_fwd") for n in names) and any(n.startswith("mma_flash_bwd") for n in names)
    _check(launches)


@pytest.mark.parametrize("causal", [False, True])
def test_wgmma_launches_match_kernels(launches, causal):
    from cupyflash.kernels import wgmma

    q, k, v, p = _problem(np.dtype(np.float16), causal)
    o, lse = _empty(q.shape, q.dtype), _empty(q.shape[:-1], np.float32)
    wgmma.forward(q, k, v, o, lse, p)
    wgmma.backward(o, q, k, v, o, lse, _empty(q.shape, q.dtype), _empty(k.shape, k.dtype), _empty(v.shape, v.dtype), p)
    assert [name for _, name, _ in launches] == [
        "wgmma_flash_fwd<__half, 64, 64, 2, 4, 2>",
        "mma_bwd_delta<__half>",
        "wgmma_flash_bwd<__half, 64, 128, 2, 2>",
        "mma_bwd_dq_convert<__half>",
    ]
    _check(launches)


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # float16 reaches the fused tensor-core walk
@pytest.mark.parametrize("path", ["chunked", "masked"])
def test_linear_launches_match_kernels(launches, monkeypatch, path, dtype):
    import cupy
    import cupy.lib.stride_tricks

    from cupyflash.kernels import linear
    from cupyflash.linear_validation import check_linear

    def as_device(x):
        return np.asarray(x).view(_DeviceArray)

    monkeypatch.setattr(cupy, "ascontiguousarray", lambda x, dtype=None: as_device(np.ascontiguousarray(x, dtype)))
    monkeypatch.setattr(cupy, "broadcast_to", lambda x, shape: as_device(np.broadcast_to(x, shape)))
    monkeypatch.setattr(cupy.lib.stride_tricks, "as_strided",
                        lambda x, shape, strides: as_device(np.lib.stride_tricks.as_strided(x, shape, strides)))  # fmt: skip
    monkeypatch.setattr(linear, "_device_decay", lambda d, device: as_device(np.asarray(d, np.float32)))
    monkeypatch.setattr(cupy.cuda, "Device", lambda *a: types.SimpleNamespace(id=0))
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: types.SimpleNamespace(synchronize=lambda: None))
    q, k, v, _ = _problem(np.dtype(dtype))
    mask = _empty((33, 40), np.float32) if path == "masked" else None
    decay = _empty((4,), np.float32) if path == "chunked" else None
    if decay is not None:
        decay[...] = 0.9
    p = check_linear(q, k, v, causal=True, mask=mask, decay=decay)
    linear.forward(q, k, v, mask, decay, p, path=path)
    linear.backward(q, q, k, v, mask, decay, p, mask_grad=mask is not None, path=path)
    names = [name for _, name, _ in launches]
    if path == "chunked":
        assert any(n.startswith("linear_fused_walk") for n in names) == (dtype == "float16")
    _check(launches)
