"""The one place that turns a CUDA source plus template arguments into a compiled function.

Every kernel family names its instantiation as a C++ name expression such as
``"flash_fwd<__half, 128>"``; this module compiles it through ``cupy.RawModule`` (NVRTC),
caches the result per device, raises the dynamic shared-memory limit, and, for CI, compiles
the same instantiation for a chosen architecture without a GPU and reports what ptxas saw.
"""
from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

STD = "-std=c++17"


@functools.cache
def source_dir() -> Path:
    """Folder of the .cu/.cuh files (installed as package data cupyflash.cuda_src)."""
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


@functools.cache
def read_source(source: str) -> str:
    return (source_dir() / source).read_text()


@functools.cache
def _cuda_include_dirs() -> tuple[str, ...]:
    import cupy

    root = cupy.cuda.get_cuda_path()
    inc = Path(root) / "include" if root else None
    return (str(inc),) if inc is not None and (inc / "cuda_fp16.h").exists() else ()


def compile_options() -> tuple[str, ...]:
    incs = (str(source_dir()), *_cuda_include_dirs())
    return (STD, *(f"-I{d}" for d in incs), f"-DCUPYFLASH_SOURCE_HASH={_source_hash()}")


#: Sources built for one architecture-specific target: wgmma exists only in sm_90a, which CuPy's own
#: ``-arch=sm_90`` does not enable (NVRTC keeps the "a" target when both are given).
ARCH_SPECIFIC: dict[str, str] = {"wgmma_forward.cu": "sm_90a", "wgmma_backward.cu": "sm_90a"}


def source_options(source: str) -> tuple[str, ...]:
    arch = ARCH_SPECIFIC.get(source)
    return (*compile_options(), f"-arch={arch}") if arch else compile_options()


_functions: dict[tuple[int, str, str], object] = {}


def get_function(source: str, name: str):
    """The compiled ``cupy.RawKernel`` for one instantiation, on the current device.

    Compiled once per device and process (CuPy's disk cache also keeps the cubin across
    processes); never rebuilt per call.
    """
    import cupy

    dev = cupy.cuda.Device().id
    key = (dev, source, name)
    fn = _functions.get(key)
    if fn is None:
        module = cupy.RawModule(code=read_source(source), options=source_options(source), name_expressions=[name])
        fn = _functions[key] = module.get_function(name)
    return fn


def set_shared_limit(fn, nbytes: int) -> None:
    """Let ``fn`` use ``nbytes`` of dynamic shared memory (needed past 48 KB)."""
    if nbytes > 48 * 1024 and fn.max_dynamic_shared_size_bytes < nbytes:
        fn.max_dynamic_shared_size_bytes = nbytes


def launch(fn, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple, shared_bytes: int = 0) -> None:
    """Launch on the current CuPy stream, raising the shared limit first when needed."""
    set_shared_limit(fn, shared_bytes)
    fn(grid, block, args, shared_mem=shared_bytes)


def launch_plan(plan, args: tuple) -> None:
    """Launch one ``plans.LaunchPlan`` (its instantiation, grid, block and shared bytes)."""
    launch(get_function(plan.source, plan.name), plan.grid, plan.block, args, plan.shared_bytes)


def element_strides(x) -> tuple:
    """Element strides of the (b, h, n) axes of a (B, H, N, D) view, or of all axes of (B, H, N),
    as the int64 kernel arguments every family takes (the last dim of a 4-D view is unit)."""
    import numpy as np

    return tuple(np.int64(s // x.itemsize) for s in x.strides[:3])


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

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def line(self) -> str:
        return (
            f"{self.name} [{self.arch}]: {self.registers} registers, {self.shared_static} B static smem, "
            f"{self.stack_frame} B stack, {self.spill_stores}/{self.spill_loads} B spill st/ld"
        )


def _int(pattern: str, log: str) -> int:
    m = re.search(pattern, log)
    return int(m.group(1)) if m else 0


def nvrtc_compile(source: str, name: str, arch: str) -> ResourceUsage:
    """Compile ``name`` from ``source`` for ``arch`` (e.g. "sm_80", "sm_90a") and parse ptxas -v."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(read_source(source), source, [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        opts = [*compile_options(), f"-arch={arch}", "-ftz=true", "-Xptxas=-v"]
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise CompileError(f"{source}: {name} for {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from None
        log = nvrtc.getProgramLog(prog)
        lowered = nvrtc.getLoweredName(prog, name)
    finally:
        nvrtc.destroyProgram(prog)
    # Keep only the lines about this entry (a module may hold helper kernels too).
    start = log.find(f"Compiling entry function '{lowered}'")
    part = log[start:] if start >= 0 else log
    nxt = part.find("Compiling entry function", 10)
    part = part[:nxt] if nxt > 0 else part
    return ResourceUsage(
        source=source,
        name=name,
        arch=arch,
        registers=_int(r"Used (\d+) registers", part),
        spill_stores=_int(r"(\d+) bytes spill stores", part),
        spill_loads=_int(r"(\d+) bytes spill loads", part),
        stack_frame=_int(r"(\d+) bytes stack frame", part),
        shared_static=_int(r"(\d+) bytes smem", part),
        log=log,
    )
