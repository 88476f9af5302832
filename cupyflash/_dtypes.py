"""The dtypes cupyflash accepts, and their names on the CUDA side."""
from __future__ import annotations

import numpy as np

try:  # NumPy has no bfloat16 of its own; ml_dtypes registers one that CuPy understands.
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)

SUPPORTED: tuple[np.dtype, ...] = tuple(d for d in (FLOAT32, FLOAT16, BFLOAT16) if d is not None)

#: C++ type of each dtype in cuda_src (see cuda_src/common.cuh).
CTYPE: dict[np.dtype, str] = {FLOAT32: "float", FLOAT16: "__half"}
if BFLOAT16 is not None:
    CTYPE[BFLOAT16] = "__nv_bfloat16"


def is_half(dtype: np.dtype) -> bool:
    """True for the 16-bit float types that tensor cores take."""
    return np.dtype(dtype) in (FLOAT16, BFLOAT16)
