"""Tensor-core FlashAttention-2 kernels (mma.sync, ldmatrix, cp.async): fp16/bf16 on sm_80+, and float32 as 3xTF32
(m16n8k8 .tf32, hi/lo split operands: about float32's accuracy) up to D = 128.

Geometry comes from ``plans.mma``; this module turns a problem into the family's ``CallPlan``s
(``kernels/family.py``). The kernels copy 16-byte chunks of every row with cp.async, so they need
16-byte aligned rows (``NEEDS_ALIGNED_ROWS``; dispatch sends other calls to the portable family).
"""
from __future__ import annotations

import numpy as np

from .. import _dtypes
from ..plans import DeviceLimits
from ..plans import mma as plans
from ..validation import AttentionProblem
from .family import CallPlan, Geometry, entry_points
from .tensorcore import backward_call, ctype, forward_call

NAME = "mma"
NEEDS_ALIGNED_ROWS = True
MIN_COMPUTE_CAPABILITY = 80
_ROW_ALIGN = 8  # elements per 16 bytes (of fp16/bf16; float32 rows of 8k elements are 32-byte multiples)
#: float32 runs as 3xTF32 (cuda_src/mma_tf32.cuh) up to this head dim (plans.mma.BACKWARD_CONFIGS_F32).
MAX_D_F32 = 128
#: Whether kernel="auto" takes this family for float32 (dispatch.select); until the float32 forward is built it
#: runs float32 only when named (kernel="mma", the backward).
AUTO_FLOAT32 = False


def supports(p: AttentionProblem, limits: DeviceLimits) -> str | None:
    f32 = np.dtype(p.dtype) == _dtypes.FLOAT32
    if not (f32 or _dtypes.is_half(p.dtype)):
        return f"needs float32, float16 or bfloat16 (got {p.dtype})"
    if limits.compute_capability < MIN_COMPUTE_CAPABILITY:
        return f"needs sm_80 or newer (this device is sm_{limits.compute_capability})"
    if p.d % _ROW_ALIGN:
        return f"needs a head dim that is a multiple of 8 (got D={p.d})"
    if f32 and p.d > MAX_D_F32:
        return f"float32 on tensor cores needs D <= {MAX_D_F32} (got D={p.d})"
    if plans.forward_config(p.d, limits) is None or plans.backward_config(p.d, limits, plans.ELEM_OF[ctype(p)]) is None:
        return f"has no tile configuration for D={p.d} within {limits.max_shared_per_block} B of shared memory"
    return None


def instantiations() -> list[tuple[str, str]]:
    return plans.instantiations()


def forward_plan(
    p: AttentionProblem, g: Geometry, limits: DeviceLimits, config: plans.ForwardConfig | None = None
) -> CallPlan:
    """``config`` overrides the tile configuration (benchmarks and tests of other variants)."""
    if ctype(p) == "float":
        raise TypeError("kernel='mma' has no float32 forward yet (its float32 backward runs: attention_backward)")
    plan = plans.plan_forward(g.batch, p.hq, p.nq, p.d, ctype(p), limits, config, p.variant,
                              total=p.total_q if p.varlen else None)  # fmt: skip
    return forward_call(plan, p, g)


def backward_plan(
    p: AttentionProblem, g: Geometry, limits: DeviceLimits, config: plans.AnyBackwardConfig | None = None,
    deterministic: bool = False,
) -> CallPlan:
    plan = plans.plan_backward(g.batch, p.hq, p.hk, p.nq, p.nk, p.d, ctype(p), limits, config, p.variant,
                               total=p.total_k if p.varlen else None)  # fmt: skip
    return backward_call(plan, p, g, deterministic, limits.sm_count)


# Entry points with given outputs, for tests and benchmarks (the API goes through cuda_backend's cache).
forward, backward = entry_points(__name__)
