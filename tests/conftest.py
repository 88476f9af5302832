"""Shared fixtures: the GPU skip, random inputs, and the accuracy bounds (ARCHITECTURE.md, "What correct means")."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from cupyflash import _dtypes


def _gpu_reason() -> str | None:
    try:
        import cupy
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:
        return f"no usable CUDA device ({type(e).__name__})"
    return None


GPU_REASON = _gpu_reason()
HAS_GPU = GPU_REASON is None
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason=f"GPU test: {GPU_REASON}")


def _is_hopper() -> bool:
    import cupy

    return cupy.cuda.Device().compute_capability == "90"


#: The wgmma family's kernels are compiled for sm_90a: its tests run on a compute capability 9.0 device only.
HOPPER = HAS_GPU and _is_hopper()
needs_hopper = pytest.mark.skipif(not HOPPER, reason="the wgmma family needs compute capability 9.0 (sm_90a)")

DTYPES = {"float32": _dtypes.FLOAT32, "float16": _dtypes.FLOAT16, "bfloat16": _dtypes.BFLOAT16}

# Relative-error bounds (ARCHITECTURE.md, "What correct means"): float32 kernels against the float64 reference; the
# 16-bit bounds are the fixed ones used where torch is absent.
TOL_OUT = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
TOL_GRAD = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.6e-2}


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64; NaN or inf anywhere fails every bound."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    den = np.linalg.norm(ref)
    num = np.linalg.norm(x - ref)
    return float(num / den) if den > 0 else float(num)


def random_qkv(rng: np.random.Generator, batch, hq, hk, nq, nk, d, dtype, scale_logits: float = 1.0):
    """Fresh standard-normal q, k, v (host arrays, rounded to dtype)."""
    q = (rng.standard_normal((*batch, hq, nq, d)) * scale_logits).astype(dtype)
    k = rng.standard_normal((*batch, hk, nk, d)).astype(dtype)
    v = rng.standard_normal((*batch, hk, nk, d)).astype(dtype)
    return q, k, v


@pytest.fixture
def rng(request) -> np.random.Generator:
    # A different stream per test, derived from its id, so failures reproduce.
    seed = zlib.crc32(request.node.nodeid.encode())
    return np.random.default_rng(seed)
