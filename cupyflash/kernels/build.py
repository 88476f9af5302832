"""The one place that turns a CUDA source plus template arguments into a compiled function.

Every kernel family names its instantiation as a C++ name expression such as
``"flash_fwd<__half, 128>"``; this module compiles it through ``cupy.RawModule`` (NVRTC),
caches the result per device, raises the dynamic shared-memory limit, and, for CI, compiles
the same instantiation for a chosen architecture without a GPU and reports what ptxas saw.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import re
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

STD = "-std=c++17"

_cupy: Any = None


def cupy_module() -> Any:
    """The ``cupy`` module, imported on first use (cupyflash imports CuPy only when a call needs it): the host path
    of a small call asks for it several times, and a function-level ``import`` costs more than this lookup."""
    global _cupy
    if _cupy is None:
        import cupy

        _cupy = cupy
    return _cupy


@functools.cache
def source_dir() -> Path:
    """Folder of the .cu/.cuh files (installed as package data cupyflash.cuda_src). A source checkout's own
    cuda_src/ beside the imported package comes first, so a second checkout (a git worktree) never
    compiles the sources of the one that is installed in editable mode."""
    beside = Path(__file__).resolve().parents[2] / "cuda_src"
    if (beside / "attention_params.cuh").is_file():
        return beside
    try:
        path = Path(str(resources.files("cupyflash.cuda_src")))
        if path.is_dir():
            return path
    except ModuleNotFoundError:  # pragma: no cover - running from a bare checkout
        pass
    return Path(__file__).resolve().parents[2] / "cuda_src"


@functools.cache
def _source_hash() -> str:
    # CuPy's disk cache keys on the top-level source and the options, not on included
    # headers: putting a hash of every source file into the options keeps it honest.
    h = hashlib.sha1()
    for f in sorted(source_dir().glob("*.cu*")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


#: Generated translation units (user snippets, issue 17 part 3): name -> text. A name is
#: ``"<family source>#flex-<hash of the snippets>"``; it compiles like its family source (same options).
_generated: dict[str, str] = {}


def generated_source(base: str, key: str, text: str) -> str:
    """Register a generated translation unit that ends by including ``base``; returns its source name."""
    name = f"{base}#flex-{key}"
    _generated.setdefault(name, text)
    return name


def base_source(source: str) -> str:
    """The file a (possibly generated) source compiles as."""
    return source.partition("#")[0]


def read_source(source: str) -> str:
    text = _generated.get(source)
    return text if text is not None else _read_file(source)


@functools.cache
def _read_file(source: str) -> str:
    return (source_dir() / source).read_text()


@functools.cache
def _cuda_include_dirs() -> tuple[str, ...]:
    """Where cuda_fp16.h lives: the toolkit CuPy found, or (CUDA 12 pip wheels, where CuPy reports no
    toolkit path) the nvidia-cuda-runtime wheel's include folder."""
    import cupy

    from .._cuda_env import cuda_include_dir

    root = cupy.cuda.get_cuda_path()
    inc = Path(root) / "include" if root else None
    if inc is not None and (inc / "cuda_fp16.h").exists():
        return (str(inc),)
    found = cuda_include_dir()
    return (str(found),) if found else ()


def compile_options() -> tuple[str, ...]:
    incs = (str(source_dir()), *_cuda_include_dirs())
    return (STD, *(f"-I{d}" for d in incs), f"-DCUPYFLASH_SOURCE_HASH={_source_hash()}")


#: Sources built for one architecture-specific target: wgmma exists only in sm_90a, which CuPy's own
#: ``-arch=sm_90`` does not enable (NVRTC keeps the "a" target when both are given).
ARCH_SPECIFIC: dict[str, str] = {"wgmma_forward.cu": "sm_90a", "wgmma_forward_ws.cu": "sm_90a",
                                 "wgmma_backward.cu": "sm_90a"}


def source_options(source: str) -> tuple[str, ...]:
    arch = ARCH_SPECIFIC.get(base_source(source))
    return (*compile_options(), f"-arch={arch}") if arch else compile_options()


_functions: dict[tuple[int, str, str], object] = {}


def get_function(source: str, name: str):
    """The compiled ``cupy.RawKernel`` for one instantiation, on the current device.

    Compiled once per device and process (CuPy's disk cache also keeps the cubin across
    processes); never rebuilt per call.
    """
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    key = (dev, source, name)
    fn = _functions.get(key)
    if fn is None:
        module = cupy.RawModule(code=read_source(source), options=source_options(source), name_expressions=[name])
        try:
            fn = module.get_function(name)
        except cupy.cuda.compiler.CompileException as e:
            if source in _generated:  # a user snippet: say where, in the snippet's own lines
                from ..flex import snippet_error_of_source

                raise snippet_error_of_source(source, str(e)) from None
            raise
        _functions[key] = fn
    return fn


_shared_limit: dict[int, int] = {}  # id(fn) -> the dynamic shared bytes it is allowed


def set_shared_limit(fn, nbytes: int) -> None:
    """Let ``fn`` use ``nbytes`` of dynamic shared memory (needed past 48 KB); the driver is asked once
    per function and size, not per launch."""
    if nbytes <= 48 * 1024 or _shared_limit.get(id(fn), 0) >= nbytes:
        return
    if fn.max_dynamic_shared_size_bytes < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes
    _shared_limit[id(fn)] = nbytes


def launch_plan(plan, args: tuple) -> None:
    """Launch one ``plans.LaunchPlan`` (its instantiation, grid, block and shared bytes) with positional
    arguments: CuPy arrays (passed as pointers) and NumPy scalars (int32, int64, float32), packed by
    ``ArgsLaunch`` (CuPy's own argument conversion costs ~1 µs an argument; these kernels take ~25).
    A plan's argument kinds are those of its first launch (one call site per plan; reading them per call cost
    ~4 µs of the linear forward's host path at 36 arguments): a later array where a scalar was, or a scalar
    where an array was, raises in ``ArgsLaunch.pack``, never launches."""
    with _packing:
        fast = _args_launches.get(id(plan))
        if fast is None or fast.plan is not plan:  # plans are cached objects; the identity check guards id reuse
            fast = _args_launches[id(plan)] = ArgsLaunch(plan, arg_codes(plan, args))
        fast.fire(cupy_module().cuda.get_current_stream().ptr, args)


def arg_codes(plan, args: tuple) -> str:
    """The ``ArgsLaunch`` codes of positional arguments: a NumPy scalar's, or "P" for an array (anything with
    ``data``; TypeError for anything else)."""
    codes = "".join([_ARG_CODES.get(type(a), "P") for a in args])
    bad = [type(a).__name__ for a, c in zip(args, codes) if c == "P" and not hasattr(a, "data")]
    if bad:
        raise TypeError(f"{plan.name}: arguments must be CuPy arrays or NumPy int32/int64/float32 scalars; got {bad}")
    return codes


# ---------------------------------------------------------------------------------------
# The attention kernels' launch: one AttentionParams struct (kernels/params.py) by value.

_ready: dict[tuple[int, str, str, int], int] = {}  # (device, source, name, shared bytes) -> CUfunction


def _function_ptr(plan) -> int:
    """The CUfunction of a plan's instantiation on the current device, its shared-memory limit raised
    (and, for plans that ask, the largest shared-memory carveout) once, not per call."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), plan.source, plan.name, plan.shared_bytes)
    ptr = _ready.get(key)
    if ptr is None:
        fn = get_function(plan.source, plan.name)
        set_shared_limit(fn, plan.shared_bytes)
        if plan.max_carveout:
            try:  # a hint: the tiles are sized for two blocks per SM and the kernels need little L1
                fn.preferred_shared_memory_carveout = 100
            except Exception:  # pragma: no cover - older drivers may refuse it
                pass
        ptr = _ready[key] = fn.kernel.ptr
    return ptr


class _Ready:
    """A kernel launch made ready for repeated calls: its plan, an argument buffer with the parameter-pointer
    array into it (built once), and the function, resolved (compiled, limits raised) at the first launch on
    the device of the plan. Queuing it is one driver call; the driver copies the arguments during the call,
    so the buffer may be rewritten at once."""

    __slots__ = ("plan", "buffer", "_argv", "_argv_ptr", "_fn", "_dims")

    def __init__(self, plan, buffer, offsets: list[int]) -> None:
        import ctypes

        self.plan = plan
        self.buffer = buffer
        base = ctypes.addressof(buffer)
        self._argv = (ctypes.c_void_p * max(1, len(offsets)))(*(base + at for at in offsets))
        self._argv_ptr = ctypes.addressof(self._argv)
        self._fn = 0
        self._dims = (*plan.grid, *plan.block, plan.shared_bytes)

    def _queue(self, stream: int) -> None:
        if not self._fn:
            self._fn = _function_ptr(self.plan)
        cupy_module().cuda.driver.launchKernel(self._fn, *self._dims, stream, self._argv_ptr, 0)


class Launch(_Ready):
    """An attention kernel's launch: one parameter, a private copy of the ``AttentionParams`` bytes whose
    pointer fields the caller rewrites per call. A repeated call then costs one ``struct.pack_into`` and one
    driver call (no buffers built, nothing converted).

    A plan with ``tensor_maps`` takes ``TmaParams`` (the maps after the AttentionParams): its buffer is 128-byte
    aligned, as the driver's encoder wants the maps, and ``maps`` (a ``tensor_map.MapWriter``) writes them per call
    from the mapped arrays' addresses (``family.Runner``); None for every other plan."""

    __slots__ = ("maps", "_raw")

    def __init__(self, plan, params: bytes) -> None:
        import ctypes

        self.maps = self._raw = None
        specs = getattr(plan, "tensor_maps", ())
        if not specs:
            super().__init__(plan, ctypes.create_string_buffer(bytes(params), len(params)), [0])
            return
        from .params import TENSOR_MAP_ALIGN, TMA_PARAMS
        from .tensor_map import MapWriter

        if len(params) != TMA_PARAMS.itemsize:
            raise ValueError(f"{plan.name}: TMA maps need TmaParams bytes ({TMA_PARAMS.itemsize}), got {len(params)}")
        self._raw = ctypes.create_string_buffer(len(params) + TENSOR_MAP_ALIGN)
        at = -ctypes.addressof(self._raw) % TENSOR_MAP_ALIGN
        buffer = (ctypes.c_char * len(params)).from_buffer(self._raw, at)
        ctypes.memmove(buffer, bytes(params), len(params))
        super().__init__(plan, buffer, [0])
        self.maps = MapWriter(ctypes.addressof(buffer), specs)

    def fire(self, stream: int) -> None:
        """Queue the kernel on ``stream`` with the buffer as it is now."""
        self._queue(stream)


class ArgsLaunch(_Ready):
    """A launch with positional arguments (``struct`` codes: "P" a CuPy array's pointer, "i", "q", "f", "I", "Q"
    scalars) packed into one buffer laid out as the C ABI lays out the kernel's parameters (native alignment)."""

    __slots__ = ("_struct", "_arrays", "offsets")

    def __init__(self, plan, codes: str) -> None:
        import ctypes
        import struct

        self._struct = struct.Struct("@" + codes)
        # Parameter i starts where native alignment puts it: the size of the prefix with it, less its own size.
        offsets = [struct.calcsize("@" + codes[: i + 1]) - struct.calcsize("@" + c) for i, c in enumerate(codes)]
        super().__init__(plan, ctypes.create_string_buffer(max(1, self._struct.size)), offsets)
        self._arrays = tuple(i for i, c in enumerate(codes) if c == "P")
        self.offsets = tuple(offsets)  # of each parameter in the buffer

    def pack(self, args: tuple) -> None:
        values = list(args)
        for i in self._arrays:
            values[i] = args[i].data.ptr
        self._struct.pack_into(self.buffer, 0, *values)

    def fire(self, stream: int, args: tuple) -> None:
        """Pack ``args`` and queue the kernel."""
        self.pack(args)
        self._queue(stream)

    def queue(self, stream: int) -> None:
        """Queue the kernel with the buffer as it is now (its owner rewrites what changes: ``linear._PlainForward``)."""
        self._queue(stream)


def _arg_codes() -> dict[type, str]:
    import numpy as np

    return {np.int32: "i", np.int64: "q", np.float32: "f", np.uint32: "I", np.uint64: "Q"}


_ARG_CODES = _arg_codes()  # anything else is an array, passed by its pointer
_args_launches: dict[int, ArgsLaunch] = {}  # id(plan) -> its launch
_packing = threading.Lock()  # one thread packs and queues a shared buffer at a time


def launch_params(plan, params: bytes | bytearray) -> None:
    """Launch ``plan`` once with one struct argument (the bytes of ``AttentionParams``) on the current
    stream."""
    import cupy

    Launch(plan, params).fire(cupy.cuda.get_current_stream().ptr)


# ---------------------------------------------------------------------------------------
# Compile without a GPU (CI): NVRTC straight to a cubin for one architecture.


class CompileError(RuntimeError):
    pass


@dataclass(frozen=True)
class ResourceUsage:
    """What ptxas reported for one kernel instantiation on one architecture."""

    source: str
    name: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_static: int
    log: str
    # ptxas C7512: it serialised the kernel's wgmma (each waits for the one before), e.g. for want of registers
    # to keep an asynchronous product's operands live; the kernel then runs, but a step's products no longer overlap.
    wgmma_serialized: bool = False

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def line(self) -> str:
        serialized = ", wgmma serialized" if self.wgmma_serialized else ""
        return (
            f"{self.name} [{self.arch}]: {self.registers} registers, {self.shared_static} B static smem, "
            f"{self.stack_frame} B stack, {self.spill_stores}/{self.spill_loads} B spill st/ld{serialized}"
        )


def _int(pattern: str, log: str) -> int:
    m = re.search(pattern, log)
    return int(m.group(1)) if m else 0


def nvrtc_compile(source: str, name: str, arch: str) -> ResourceUsage:
    """Compile ``name`` from ``source`` for ``arch`` (e.g. "sm_80", "sm_90a") and parse ptxas -v."""
    return nvrtc_compile_many(source, [name], arch)[0]


def nvrtc_compile_many(source: str, names: list[str], arch: str) -> list[ResourceUsage]:
    """Compile several instantiations of one source in one NVRTC program (the front end runs once) and
    parse what ptxas -v says of each entry."""
    from cupy.cuda import nvrtc

    with _nvrtc_program(source, names, arch, [f"-arch={arch}", "-ftz=true", "-Xptxas=-v"]) as prog:
        log = nvrtc.getProgramLog(prog)
        lowered = [nvrtc.getLoweredName(prog, name) for name in names]
    return [_usage(source, name, arch, low, log) for name, low in zip(names, lowered)]


def nvrtc_cubin(source: str, names: list[str], arch: str) -> bytes:
    """The cubin of ``names`` from ``source`` for ``arch``, compiled as a run-time call compiles it (the source's
    own options, no -ftz): for CI's checks of the SASS (tests/test_sass.py) without a GPU."""
    from cupy.cuda import nvrtc

    with _nvrtc_program(source, names, arch, [f"-arch={ARCH_SPECIFIC.get(base_source(source), arch)}"]) as prog:
        return nvrtc.getCUBIN(prog)


@contextlib.contextmanager
def _nvrtc_program(source: str, names: list[str], arch: str, options: list[str]) -> Iterator[Any]:
    """An NVRTC program of ``source`` with ``names`` compiled (compile_options() + ``options``), destroyed after."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(read_source(source), source if source == base_source(source) else "flex_user.cu", [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [*compile_options(), *options])
        except nvrtc.NVRTCError as e:
            raise CompileError(f"{source}: {names} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        yield prog
    finally:
        nvrtc.destroyProgram(prog)


def _usage(source: str, name: str, arch: str, lowered: str, log: str) -> ResourceUsage:
    # Keep only the lines about this entry (a module may hold several kernels).
    start = log.find(f"Compiling entry function '{lowered}'")
    part = log[start:] if start >= 0 else log
    nxt = part.find("Compiling entry function", 10)
    part = part[:nxt] if nxt > 0 else part
    serialized = any("wgmma.mma_async instructions are serialized" in line and f"'{lowered}'" in line
                     for line in log.splitlines())
    return ResourceUsage(
        source=source,
        name=name,
        arch=arch,
        wgmma_serialized=serialized,
        registers=_int(r"Used (\d+) registers", part),
        spill_stores=_int(r"(\d+) bytes spill stores", part),
        spill_loads=_int(r"(\d+) bytes spill loads", part),
        stack_frame=_int(r"(\d+) bytes stack frame", part),
        shared_static=_int(r"(\d+) bytes smem", part),
        log=part,
    )
