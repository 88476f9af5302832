"""cupyflash: exact, fused, IO-aware attention (FlashAttention) for CuPy arrays."""
from __future__ import annotations

__version__ = "0.1.0"

from . import reference
from ._cuda_env import gpu_status
from .api import attention, attention_backward, attention_forward, attention_vjp
from .kvcache import attention_with_kvcache, merge_attention_states
from .varlen_api import (
    attention_varlen,
    attention_varlen_backward,
    attention_varlen_forward,
    attention_varlen_vjp,
)
from .dropout import dropout_mask, effective_dropout_p
from .dropout import dropout_mask
from .flex import SnippetError
from .flex_block_mask import BlockMask, create_block_mask
from .linear_api import (
    linear_attention,
    linear_attention_backward,
    linear_attention_forward,
    linear_attention_vjp,
)

__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "attention_vjp",
    "attention_with_kvcache",
    "merge_attention_states",
    "attention_varlen",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "attention_varlen_vjp",
    "dropout_mask",
    "effective_dropout_p",
    "create_block_mask",
    "BlockMask",
    "SnippetError",
    "linear_attention",
    "linear_attention_forward",
    "linear_attention_backward",
    "linear_attention_vjp",
    "reference",
    "gpu_status",
    "__version__",
]
