"""``python -m cupyflash.info``: what this installation will do on this machine.

Prints versions, the GPU (or why there is none), NVRTC and the CUDA headers it compiles
against, where CuPy keeps compiled kernels, and which kernel family runs each dtype and head
dim here. The first thing to paste into a bug report, and a check that an install worked.

    python -m cupyflash.info              # this machine
    python -m cupyflash.info --device h100  # the kernel table for a named GPU, no GPU needed
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

#: Head dims of DESIGN.md section 4, the ones the tests cover.
HEAD_DIMS = (16, 32, 40, 64, 80, 96, 128, 160, 192, 256)
#: Named GPUs whose limits plans/ knows, for ``--device``.
PRESETS = ("T4", "A100", "RTX4090", "H100")


def _row(label: str, value: str) -> None:
    print(f"{label:<13}{value}")


def _version(module: str) -> str:
    try:
        mod = __import__(module)
    except Exception as e:  # not installed, or broken: say which, do not stop
        return f"not importable ({type(e).__name__}: {e})".splitlines()[0]
    return str(getattr(mod, "__version__", "?"))


def _try(fn: Any, *args: Any) -> str:
    """fn(*args) as text, or the first line of why it failed: info must never stop half way."""
    try:
        return str(fn(*args))
    except Exception as e:
        return f"unavailable ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})"


def _nvrtc() -> str:
    from cupy.cuda import nvrtc

    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


def _headers() -> str:
    from .kernels.build import _cuda_include_dirs

    from ._cuda_env import cuda_include_dir

    dirs = _cuda_include_dirs()
    if dirs:
        return dirs[0]
    elsewhere = cuda_include_dir()
    if elsewhere:  # CUDA 12 pip wheels: see _cuda_env.cuda_include_dir
        return f"not on the kernels' include path, though cuda_fp16.h is in {elsewhere}"
    return "cuda_fp16.h not found: the kernels will not compile (pip install \".[cuda13]\")"


def _kernel_cache() -> str:
    if os.environ.get("CUPY_CACHE_IN_MEMORY") == "1":
        return "in memory only (CUPY_CACHE_IN_MEMORY=1)"
    return os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache"))


def _device() -> tuple[str, Any]:
    """A description of the current GPU and its plans.DeviceLimits, or why there is none."""
    from ._cuda_env import gpu_status

    reason = gpu_status()
    if reason is not None:
        return f"no GPU: {reason}", None
    import cupy

    from .plans import DeviceLimits

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    limits = DeviceLimits.current()
    rt, drv = cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion()
    return (
        f"{name} (device {dev.id}, sm_{limits.compute_capability}, {limits.sm_count} SMs, "
        f"{props['totalGlobalMem'] / 2**30:.0f} GiB; CUDA runtime {rt}, driver {drv})",
        limits,
    )


def kernel_table(limits: Any) -> list[str]:
    """Which family ``kernel="auto"`` runs for each dtype (rows) and head dim (columns).

    Asks the dispatch table itself with a problem built from tiny NumPy arrays, so the
    answer is the one a real call gets (up to alignment, which a call checks at launch).
    """
    import numpy as np

    from . import _dtypes
    from .kernels import dispatch
    from .validation import check_attention

    lines = ["dtype     " + "".join(f"{'D=' + str(d):>10}" for d in HEAD_DIMS)]
    for dtype in _dtypes.SUPPORTED:
        cells = []
        for d in HEAD_DIMS:
            x = np.zeros((1, 1, 1, d), dtype=dtype)
            try:
                fam = dispatch.select(check_attention(x, x, x), limits)
                cells.append(str(getattr(fam, "NAME", getattr(fam, "name", fam))))
            except (TypeError, ValueError):
                cells.append("-")
        lines.append(f"{np.dtype(dtype).name:<10}" + "".join(f"{c:>10}" for c in cells))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=[p.lower() for p in PRESETS], type=str.lower,
                    help="show the kernel table for this GPU instead of the one here")  # fmt: skip
    args = ap.parse_args(argv)

    import cupyflash

    _row("cupyflash", f"{cupyflash.__version__} ({os.path.dirname(cupyflash.__file__)})")
    _row("python", f"{platform.python_version()} ({sys.executable})")
    _row("numpy", _version("numpy"))
    _row("cupy", _version("cupy"))
    device, limits = _device()
    _row("device", device)
    _row("nvrtc", _try(_nvrtc))
    _row("cuda headers", _try(_headers))
    _row("kernel cache", _kernel_cache())
    print("numpy arrays run the NumPy backend on the CPU (float64 inside), GPU or not")
    if args.device:
        from . import plans

        limits = getattr(plans, args.device.upper())
        print(f"kernel families for {args.device.upper()} (sm_{limits.compute_capability}), kernel='auto':")
    elif limits is not None:
        print(f"kernel families on this device (sm_{limits.compute_capability}), kernel='auto':")
    else:
        print("kernel families: none here without a GPU (try --device h100 to see a GPU's table)")
        return 0
    for line in kernel_table(limits):
        print("  " + line)
    if limits.compute_capability == 90:
        print("  " + wgmma_backward_copies(probe_driver=not args.device))
        print("  " + wgmma_forward_copies())
    return 0


def wgmma_backward_copies(probe_driver: bool = True) -> str:
    """How the wgmma backward's loader copies Q_i/dO_i (plans.wgmma.TMA, uses_tma), and whether the driver's TMA
    encoder is there (libcuda's cuTensorMapEncodeTiled, looked up through ctypes)."""
    from .kernels import tensor_map
    from .plans import wgmma

    if not (wgmma.LOADER and wgmma.TMA):
        return "wgmma backward: the loader copies Q_i/dO_i by cp.async (plans.wgmma.TMA or LOADER off)"
    line = "wgmma backward: the loader copies Q_i/dO_i by TMA on dense calls with 16-byte strides, else by cp.async"
    if probe_driver:
        found = _try(lambda: tensor_map.driver_functions() and "found")
        line += f" (libcuda's TMA encoder: {found})"
    return line


def wgmma_forward_copies() -> str:
    """How the warp-specialised wgmma forward's producer copies Q_i/K_t/V_t (plans.wgmma.TMA_FORWARD,
    uses_tma_forward)."""
    from .plans import wgmma

    if not wgmma.TMA_FORWARD:
        return "wgmma ws forward: the producer copies Q_i/K_t/V_t by cp.async (plans.wgmma.TMA_FORWARD off)"
    return "wgmma ws forward: the producer copies Q_i/K_t/V_t by TMA on dense calls with 16-byte strides, else by " \
           "cp.async"


if __name__ == "__main__":
    sys.exit(main())
