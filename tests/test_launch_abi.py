"""The kernel ABI, checked without a GPU.

- ``AttentionParams``: NVRTC compiles the C++ struct and reports its size and every field offset; they
  must equal the NumPy layout in ``cupyflash/kernels/params.py`` that the launchers fill.
- Every attention kernel takes exactly one parameter of that size (read from NVRTC's PTX).
- Every launch a family plans names an instantiation the family lists (so CI compiled it).
- The linear-attention launchers pass what their kernels declare (positional arguments).
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


def _ptx(source: str, names: list[str], arch: str | None = None) -> str:
    from cupy.cuda import nvrtc

    from cupyflash.kernels.build import ARCH_SPECIFIC, compile_options, read_source

    arch = arch or ARCH_SPECIFIC.get(source, "sm_80").replace("sm_", "compute_")
    code = read_source(source) if source.endswith((".cu", ".cuh")) and "\n" not in source else source
    prog = nvrtc.createProgram(code, "probe.cu", [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        try:
            nvrtc.compileProgram(prog, [*compile_options(), f"-arch={arch}"])
        except nvrtc.NVRTCError as e:
            raise AssertionError(f"{e}\n{nvrtc.getProgramLog(prog)}") from None
        ptx = nvrtc.getPTX(prog)
        lowered = {n: nvrtc.getLoweredName(prog, n) for n in names}
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    return ptx if not names else (ptx, lowered)


def _layout_probe(offset_of) -> list[int]:
    """sizeof(AttentionParams) and every field's offset, as NVRTC computes them (read from the PTX initializer)."""
    from cupyflash.kernels.params import STRIDE4_FIELDS, field_offsets

    exprs = ["sizeof(cupyflash::AttentionParams)"]
    for m in field_offsets():  # nested stride members as two offsets
        outer, _, inner = m.partition(".")
        inner_type = "cupyflash::Strides4" if outer in STRIDE4_FIELDS else "cupyflash::Strides"
        exprs.append(offset_of("cupyflash::AttentionParams", outer)
                     + (" + " + offset_of(inner_type, inner) if inner else ""))  # fmt: skip
    return probe_values("attention_params.cuh", exprs)


def probe_values(header: str, exprs: list[str], arch: str = "compute_80") -> list[int]:
    """The values NVRTC computes for compile-time C++ expressions (after ``#include header``): emitted as a device
    array's initializer and read back from the PTX, so CPU-only CI checks Python's layouts and sizes against the
    C++ ones."""
    probe = (f'#include "{header}"\nextern "C" __device__ unsigned long long cupyflash_probe[] = {{\n  '
             + ",\n  ".join(f"(unsigned long long)({e})" for e in exprs) + "\n};\n")  # fmt: skip
    ptx = _ptx(probe, [], arch)
    m = re.search(r"\.(b8|u64) cupyflash_probe\[\d+\] = \{([^}]*)\}", ptx)
    assert m, "the probe was not emitted"
    raw = [int(x) for x in m.group(2).split(",")]
    if m.group(1) == "b8":  # emitted as little-endian bytes
        raw = [int.from_bytes(bytes(raw[i : i + 8]), "little") for i in range(0, len(raw), 8)]
    return raw


def test_params_layout_matches_cpp():
    from cupyflash.kernels.params import PARAMS, field_offsets

    try:
        values = _layout_probe(lambda t, f: f"__builtin_offsetof({t}, {f})")
    except AssertionError as e:  # NVRTC 13.0 has no __builtin_offsetof (CI's NVRTC 13.5 does)
        if "__builtin_offsetof" not in str(e):
            raise
        pytest.skip("this NVRTC has no __builtin_offsetof for the layout probe (NVRTC >= 13.5 has)")
    offsets = field_offsets()
    assert values[0] == PARAMS.itemsize, f"sizeof(AttentionParams) = {values[0]}, Python has {PARAMS.itemsize}"
    for name, got in zip(offsets, values[1:]):
        assert got == offsets[name], f"offset of {name}: C++ {got}, Python {offsets[name]}"


def _all_attention_instantiations():
    from cupyflash.kernels import mma, portable, wgmma

    by_source: dict[str, list[str]] = {}
    for fam in (portable, mma, wgmma):
        for source, name in fam.instantiations():
            by_source.setdefault(source, []).append(name)
    return by_source


def _takes_tma_params(name: str) -> bool:
    """The kernels that copy by TMA take TmaParams: the wgmma backward's kLoader, kTma and the ws forward's kTma
    (after kPersistent)."""
    if name.startswith("wgmma_flash_fwd_ws<"):
        return name.rsplit(">, ", 1)[-1] in ("false, true>", "true, true>")
    return name.startswith("wgmma_flash_bwd<") and name.endswith(", true, true>")


@pytest.mark.parametrize("source", sorted(_all_attention_instantiations()))
def test_every_attention_kernel_takes_one_params_struct(source):
    from cupyflash.kernels.params import PARAMS, TMA_PARAMS

    every = _all_attention_instantiations()[source]
    # the parameter list is the same for every instantiation: the first few, and the first that copies by TMA
    names = every[:6] + [n for n in every if _takes_tma_params(n)][:1]
    ptx, lowered = _ptx(source, names)
    for name in names:
        head = ptx[ptx.index(f".entry {lowered[name]}(") :]
        head = head[: head.index(")")]
        params = re.findall(r"\.param \.align (\d+) \.b8 \w+\[(\d+)\]|\.param \.\w+ \w+", head)
        if _takes_tma_params(name):  # TmaParams: the maps want 64-byte alignment in the parameter space
            assert len(params) == 1 and int(params[0][1]) == TMA_PARAMS.itemsize, f"{name}: {head}"
            assert int(params[0][0]) >= 64, f"{name}: {head}"
        else:  # AttentionParams keeps its 8-byte alignment (ptxas loads its fields so in every kernel)
            assert len(params) == 1 and int(params[0][1]) == PARAMS.itemsize, f"{name}: {head}"
            assert int(params[0][0]) == 8, f"{name}: {head}"


def test_tma_params_layout_matches_cpp():
    """TmaParams: AttentionParams at 0, each map at the offset and alignment Python writes it at (the driver's
    encoder and the PTX ISA want 64-byte aligned maps; CUDA 13's CUtensorMap is aligned to 128)."""
    from cupyflash.kernels.params import MAP_OFFSETS, TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES, TMA_MAPS, TMA_PARAMS

    exprs = ["sizeof(cupyflash::TmaParams)", "alignof(cupyflash::TmaParams)", "sizeof(cupyflash::TensorMap)",
             "alignof(cupyflash::TensorMap)", "sizeof(cupyflash::AttentionParams)"]
    try:
        exprs += [f"__builtin_offsetof(cupyflash::TmaParams, {f})" for f in ("p", *(f"tma_{n}" for n in TMA_MAPS))]
        values = probe_values("attention_params.cuh", exprs)
    except AssertionError as e:  # NVRTC 13.0 has no __builtin_offsetof (CI's NVRTC 13.5 does)
        if "__builtin_offsetof" not in str(e):
            raise
        pytest.skip("this NVRTC has no __builtin_offsetof for the layout probe (NVRTC >= 13.5 has)")
    size, align, map_size, map_align, base, p_at, *map_at = values
    assert (size, align, map_size, map_align) == (TMA_PARAMS.itemsize, TENSOR_MAP_ALIGN, TENSOR_MAP_BYTES,
                                                  TENSOR_MAP_ALIGN)  # fmt: skip
    assert p_at == 0 and base == TMA_PARAMS.fields["p"][0].itemsize
    assert map_at == [MAP_OFFSETS[n] for n in TMA_MAPS]
    assert all(at % 64 == 0 and at >= base for at in map_at)


@pytest.fixture
def planned(monkeypatch):
    """Launches recorded instead of run, on H100 limits, with host stand-ins for device arrays."""
    import cupy

    from cupyflash import plans
    from cupyflash.kernels import build

    from cupyflash.kernels import family

    seen, host = [], []

    def allocate(nbytes):
        host.append(_empty((nbytes,), np.uint8))
        return types.SimpleNamespace(ptr=host[-1].ctypes.data)

    monkeypatch.setattr(build.Launch, "fire", lambda self, stream: seen.append((self.plan, bytes(self.buffer))))
    monkeypatch.setattr(family, "allocate", allocate)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: types.SimpleNamespace(ptr=0))
    monkeypatch.setattr(cupy.cuda.runtime, "memsetAsync", lambda ptr, value, nbytes, stream: None)
    monkeypatch.setattr(plans.DeviceLimits, "current", classmethod(lambda cls: plans.H100))
    from cupyflash.kernels import tensor_map  # TMA maps (the ws forward's): encoded by a stand-in for libcuda

    monkeypatch.setattr(tensor_map, "driver_functions", lambda: ((lambda *args: 0), (lambda *args: 0)))
    return seen


def _problem(dtype, causal=True):
    from cupyflash.validation import check_attention

    q = _empty((2, 4, 33, 64), dtype)
    k = _empty((2, 2, 40, 64), dtype)
    v = _empty((2, 2, 40, 64), dtype)
    return q, k, v, check_attention(q, k, v, causal=causal)


@pytest.mark.parametrize("family_name, dtype", [("portable", "float32"), ("portable", "float16"), ("mma", "float16"),
                                                ("wgmma", "bfloat16")])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_planned_launches_are_listed_instantiations(planned, family_name, dtype, causal):
    from cupyflash import _dtypes
    from cupyflash.kernels import dispatch
    from cupyflash.kernels.params import PARAMS, TMA_PARAMS

    dt = _dtypes.BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
    fam = dispatch.families()[family_name]
    q, k, v, p = _problem(dt, causal)
    o, lse = _empty(q.shape, q.dtype), _empty(q.shape[:-1], np.float32)
    fam.forward(q, k, v, o, lse, p)
    fam.backward(o, q, k, v, o, lse, _empty(q.shape, q.dtype), _empty(k.shape, k.dtype), _empty(v.shape, v.dtype), p)
    listed = set(fam.instantiations()) | set(dispatch.families()["mma"].instantiations())
    assert planned
    # kOwnDQ: Nk = 40 is one key tile (a backward's last flag; the ws forward's kTma ends its name alike)
    own = [plan.name for plan, _ in planned if plan.name.endswith(", true>") and "_bwd" in plan.name]
    assert own if family_name != "portable" else not own
    for plan, params in planned:
        listed_name = plan.name[: -len(", true>")] + ">" if plan.name in own else plan.name  # its kOwnDQ = false form
        assert (plan.source, listed_name) in listed, plan.name
        assert len(params) == (TMA_PARAMS.itemsize if plan.tensor_maps else PARAMS.itemsize)
        assert bool(plan.tensor_maps) == _takes_tma_params(plan.name)
        assert p.variant.cpp_policy in plan.name or "<" + plan.name.split("<")[1].split(",")[0] in plan.name
        record = np.frombuffer(params[: PARAMS.itemsize], PARAMS)[0]  # (TmaParams: AttentionParams first)
        assert record["q"] == q.ctypes.data and record["nq"] == 33 and record["nk"] == 40
        assert record["hq"] == 4 and record["hk"] == 2 and record["group"] == 2 and record["d"] == 64
        assert np.isclose(record["scale"], 1 / 8)
    # Names are per variant: causal and non-causal calls never share a main kernel.
    mains = [plan.name for plan, _ in planned if "Policy" in plan.name]
    assert all(("Causal" in n) == causal for n in mains)


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # float16 reaches the fused tensor-core walk
@pytest.mark.parametrize("path", ["chunked", "masked"])
def test_linear_launches_match_kernels(monkeypatch, path, dtype):
    import cupy
    import cupy.lib.stride_tricks

    from cupyflash import plans
    from cupyflash.kernels import build, linear
    from cupyflash.linear_validation import check_linear

    seen = []

    class Recorder:
        max_dynamic_shared_size_bytes = 0

        def __init__(self, source, name):
            self.source, self.name = source, name

        def __call__(self, grid, block, args, shared_mem=0):
            seen.append((self.source, self.name, args))

    def as_device(x):
        return np.asarray(x).view(_DeviceArray)

    monkeypatch.setattr(build, "get_function", lambda source, name: Recorder(source, name))
    monkeypatch.setattr(linear, "_launch", lambda plan, args: seen.append((plan.source, plan.name, args)))
    monkeypatch.setattr(plans.DeviceLimits, "current", classmethod(lambda cls: plans.H100))
    monkeypatch.setattr(cupy, "empty", _empty)
    monkeypatch.setattr(cupy, "zeros", _empty)
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
    names = [name for _, name, _ in seen]
    if path == "chunked":
        assert any(n.startswith("linear_fused_walk") for n in names) == (dtype == "float16")
    assert seen, "nothing was launched"
    for source, name, args in seen:
        from cupyflash.kernels.build import ARCH_SPECIFIC  # noqa: F401

        ptx, lowered = _ptx(source, [name])
        head = ptx[ptx.index(f".entry {lowered[name]}(") :]
        head = head[: head.index(")")]
        want = [int(m.group(1)) // 8 for m in re.finditer(r"\.param \.[a-z]+?(\d+) ", head)]
        got = [8 if isinstance(a, np.ndarray) else np.dtype(type(a)).itemsize for a in args]
        assert got == want, f"{name}: launcher passes sizes {got}, kernel declares {want}"


def test_positional_arguments_are_packed_as_the_c_abi_lays_them_out():
    """build.ArgsLaunch (the linear kernels' launch): each argument at its natural alignment, arrays by pointer,
    and the argument-pointer array pointing at each one."""
    import ctypes
    import struct

    from cupyflash.kernels import build
    from cupyflash.plans import LaunchPlan

    plan = LaunchPlan("linear_masked.cu", "k", (1, 1, 1), (32, 1, 1), 0)
    fake = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0x1234_5678_9ABC))
    args = (np.int32(7), fake, np.float32(1.5), np.int32(-2), np.int64(-3), fake)
    launch = build.ArgsLaunch(plan, "".join(build._ARG_CODES.get(type(a), "P") for a in args))
    launch.pack(args)
    base = ctypes.addressof(launch.buffer)
    offsets = [p - base for p in launch._argv]
    assert offsets == [0, 8, 16, 20, 24, 32]
    raw = bytes(launch.buffer)
    assert struct.unpack_from("<i", raw, 0)[0] == 7 and struct.unpack_from("<Q", raw, 8)[0] == 0x1234_5678_9ABC
    assert struct.unpack_from("<f", raw, 16)[0] == 1.5 and struct.unpack_from("<i", raw, 20)[0] == -2
    assert struct.unpack_from("<q", raw, 24)[0] == -3 and struct.unpack_from("<Q", raw, 32)[0] == 0x1234_5678_9ABC


def test_positional_launch_rejects_python_scalars():
    from cupyflash.kernels import build
    from cupyflash.plans import LaunchPlan

    plan = LaunchPlan("linear_masked.cu", "k", (1, 1, 1), (32, 1, 1), 0)
    with pytest.raises(TypeError, match="NumPy int32"):
        build.launch_plan(plan, (np.int32(1), 5))


def test_positional_launch_keeps_its_first_argument_kinds(monkeypatch):
    """launch_plan reads a plan's argument kinds at its first launch only: a later call that puts a scalar where an
    array was (or an array where a scalar was) raises before anything is queued."""
    import cupy

    from cupyflash.kernels import build
    from cupyflash.plans import LaunchPlan

    calls = []
    monkeypatch.setattr(build, "_function_ptr", lambda plan: 0xF00)
    monkeypatch.setattr(cupy.cuda.driver, "launchKernel", lambda *a: calls.append(a))
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: types.SimpleNamespace(ptr=0))
    plan = LaunchPlan("linear_masked.cu", "k", (1, 1, 1), (32, 1, 1), 0)
    fake = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0x1000))
    build.launch_plan(plan, (fake, np.int32(3)))
    build.launch_plan(plan, (fake, np.int32(4)))
    assert len(calls) == 2
    with pytest.raises(AttributeError):
        build.launch_plan(plan, (np.int32(1), np.int32(4)))
    with pytest.raises(Exception):
        build.launch_plan(plan, (fake, fake))
    assert len(calls) == 2


def test_ready_launches_queue_their_own_buffers(monkeypatch):
    """build.Launch and build.ArgsLaunch hand the driver their geometry, the stream and a parameter-pointer array
    that points into their own buffer (one entry per parameter), resolving the function once."""
    import ctypes

    import cupy

    from cupyflash.kernels import build
    from cupyflash.plans import LaunchPlan

    calls, resolved = [], []
    monkeypatch.setattr(build, "_function_ptr", lambda plan: resolved.append(plan) or 0xF00)
    monkeypatch.setattr(cupy.cuda.driver, "launchKernel", lambda *a: calls.append(a))
    plan = LaunchPlan("linear_masked.cu", "k", (3, 2, 1), (128, 1, 1), 4096)
    one = build.Launch(plan, b"\x01" * 40)
    one.fire(7)
    one.fire(8)
    fn, gx, gy, gz, bx, by, bz, shared, stream, argv, extra = calls[-1]
    assert (fn, gx, gy, gz, bx, by, bz, shared, stream, extra) == (0xF00, 3, 2, 1, 128, 1, 1, 4096, 8, 0)
    assert ctypes.c_void_p.from_address(argv).value == ctypes.addressof(one.buffer) and len(resolved) == 1
    packed = build.ArgsLaunch(plan, "Qi")
    packed.fire(9, (0xABC, np.int32(5)))
    argv = calls[-1][9]
    first, second = (ctypes.c_void_p.from_address(argv + 8 * i).value for i in range(2))
    assert first == ctypes.addressof(packed.buffer) and second == first + 8
    assert ctypes.c_uint64.from_address(first).value == 0xABC and ctypes.c_int32.from_address(second).value == 5
