"""The GPU the benchmark runs on: whether there is one, what it and the library versions are
(copied into every record), memory release between shapes, and CuPy/torch interop."""
from __future__ import annotations

import datetime
import platform
import sys
from typing import Any


def gpu_unavailable_reason() -> str | None:
    """None with a usable GPU, else one line a user can act on (cupyflash.gpu_status)."""
    from .._cuda_env import gpu_status

    return gpu_status()


def require_gpu() -> None:
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"python -m cupyflash.bench needs a CUDA GPU: {reason}. (--help and --list work without one.)")


def environment() -> dict[str, Any]:
    import cupy
    import numpy

    import cupyflash

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    versions = {
        "cupyflash": cupyflash.__version__,
        "cupy": cupy.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
    }
    if "torch" in sys.modules:
        versions["torch"] = sys.modules["torch"].__version__
    return {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": dev.compute_capability,
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def cupy_dtype(name: str) -> Any:
    from .. import _dtypes

    return {"float32": _dtypes.FLOAT32, "float16": _dtypes.FLOAT16, "bfloat16": _dtypes.BFLOAT16}[name]


def free_device_memory() -> None:
    import cupy

    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def to_torch(x: Any) -> Any:
    """A torch tensor on the same memory as CuPy array ``x`` (DLPack, no copy)."""
    import torch

    try:
        return torch.from_dlpack(x)
    except Exception:
        import cupy

        if str(x.dtype) != "bfloat16":
            raise
        return torch.from_dlpack(x.view(cupy.uint16)).view(torch.bfloat16)
