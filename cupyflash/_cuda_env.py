"""Why CuPy cannot run CUDA here, in words a user can act on.

CuPy reports a missing driver as "CUDA driver version is insufficient", which reads like
"upgrade your driver" to someone whose machine has no NVIDIA GPU at all. The entry points
(``python -m cupyflash.bench``, ``python -m cupyflash.info``, the examples) ask
``gpu_status()`` before they touch the GPU and print its one line instead of a traceback.
"""
from __future__ import annotations

import os

#: The install commands, run from a clone of the repository (see README "Set up").
INSTALL_SMALL = 'pip install ".[cuda13]" (".[cuda12]" for a CUDA 12 driver)'
INSTALL_FULL = 'pip install ".[cuda13-full]" (".[cuda12-full]" for CUDA 12)'


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _driver_version() -> int | None:
    """The CUDA version the driver supports (e.g. 13000), 0 without a driver, None if unknown."""
    try:
        import cupy

        return int(cupy.cuda.runtime.driverGetVersion())
    except Exception:
        return None


def _runtime_version() -> int | None:
    try:
        import cupy

        return int(cupy.cuda.runtime.runtimeGetVersion())
    except Exception:
        return None


def _cuda(v: int) -> str:
    return f"CUDA {v // 1000}.{v % 1000 // 10}"


def explain(exc: BaseException) -> str:
    """One line saying what went wrong while starting CUDA through CuPy, and what to do."""
    msg = _first_line(exc)
    text = str(exc)
    if isinstance(exc, ImportError) and (getattr(exc, "name", None) or "").split(".")[0] in ("cupy", "cupy_backends"):
        return f"CuPy is not installed: install it with {INSTALL_SMALL} from the cupyflash checkout ({msg})"
    if isinstance(exc, (ImportError, OSError, RuntimeError)):
        for lib, what in (("cublas", "cuBLAS"), ("cusolver", "cuSOLVER"), ("cusparse", "cuSPARSE"), ("cufft", "cuFFT")):
            if f"lib{lib}" in text.lower():
                return (f"{what} is not installed (the small CUDA extra leaves it out; cupyflash's kernels do not "
                        f"need it, CuPy's matmul and linalg do): run {INSTALL_FULL} ({msg})")
        if "libnvrtc" in text:
            return f"NVRTC, the CUDA compiler cupyflash builds its kernels with, is not installed: run {INSTALL_SMALL} ({msg})"
        if "libcurand" in text:
            return f"cuRAND (cupy.random) is not installed: run {INSTALL_SMALL} ({msg})"
    if "cudaErrorInsufficientDriver" in text or "CUDA_ERROR_NO_DEVICE" in text or "cudaErrorNoDevice" in text:
        driver = _driver_version()
        if driver == 0:
            return f"no NVIDIA driver found (CuPy could not initialise CUDA): {msg}"
        if "cudaErrorInsufficientDriver" in text and driver:
            runtime = _runtime_version()
            need = f", CuPy was built for {_cuda(runtime)}" if runtime else ""
            return (f"the NVIDIA driver supports only {_cuda(driver)}{need}: update the driver or install "
                    f'the CuPy that matches it (".[cuda12]" for CUDA 12) ({msg})')
        return f"no NVIDIA GPU found (the driver sees no CUDA device): {msg}"
    return f"CuPy could not initialise CUDA: {msg}"


def gpu_status() -> str | None:
    """None when CuPy can use a CUDA device here, else the reason it cannot (one line)."""
    try:
        import cupy
    except ImportError as e:
        return explain(e)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError, or a library CuPy failed to load
        return explain(e)
    if count < 1:
        return "no NVIDIA GPU found (the driver sees no CUDA device)"
    return None


def cuda_include_dir() -> str | None:
    """The folder holding cuda_fp16.h and cuda_bf16.h for NVRTC, or None.

    ``cupy.cuda.get_cuda_path()`` finds CUDA 13's pip wheels (one ``nvidia/cu13`` tree) but
    returns None for CUDA 12's, which put each library in its own folder; cuda-pathfinder
    (a CuPy 14 dependency) finds the cudart headers in both layouts and in a system toolkit.
    """
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
    except Exception:  # an older CuPy without cuda-pathfinder: fall back to CuPy's root
        found = None
    candidates = [found]
    try:
        import cupy

        root = cupy.cuda.get_cuda_path()
        candidates.append(os.path.join(root, "include") if root else None)
    except Exception:
        pass
    for d in candidates:
        if d and os.path.exists(os.path.join(d, "cuda_fp16.h")):
            return str(d)
    return None
