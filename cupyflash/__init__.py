"""cupyflash: exact, fused, IO-aware attention (FlashAttention) for CuPy arrays."""
from __future__ import annotations

__version__ = "0.1.0"

from . import reference
from .api import attention, attention_backward, attention_forward, attention_vjp

__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "attention_vjp",
    "reference",
    "__version__",
]
