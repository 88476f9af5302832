"""Tensor-core FlashAttention-2 kernels (mma.sync, ldmatrix, cp.async) on sm_80+: fp16/bf16, and float32 as 3xTF32
(m16n8k8 .tf32 on hi/lo split operands, about float32's accuracy; cuda_src/mma_tf32.cuh) up to D = 128.

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
_ROW_ALIGN = 8  # elements per 16 bytes of a 16-bit row (float32 rows keep the same rule: 32-byte multiples)


def supports(p: AttentionProblem, limits: DeviceLimits) -> str | None:
    f32 = np.dtype(p.dtype) == _dtypes.FLOAT32
    if not (_dtypes.is_half(p.dtype) or f32):
        return f"needs float32, float16 or bfloat16 (got {p.dtype})"
    if limits.compute_capability < MIN_COMPUTE_CAPABILITY:
        return f"needs sm_80 or newer (this device is sm_{limits.compute_capability})"
    if p.d % _ROW_ALIGN:
        return f"needs a head dim that is a multiple of 8 (got D={p.d})"
    if f32 and p.d > plans.MAX_D_F32:
        return f"float32 on tensor cores needs D <= {plans.MAX_D_F32} (got D={p.d})"
    bwd = plans.backward_config(p.d, limits, 4) if f32 else None
    if bwd is not None and plans.query_parts(p.group, p.nq, bwd.br, p.varlen) is None:
        most = plans.MAX_ROWS_F32 * (1 if p.varlen else plans.MAX_Q_PARTS)
        return (f"float32 on tensor cores needs (Hq / Hk) x Nq <= {most}{' for varlen packs' if p.varlen else ''} "
                f"(got {p.group} x {p.nq}): past it the backward's dK/dV sums drift toward the 1e-4 bound")
    if f32 and p.variant.flex is not None:  # NVRTC 13.5: D = 64 with a block mask and a score_mod spilled 328 B
        return "runs mask_mod/score_mod snippets in float16/bfloat16 only (the float32 forward at 255 registers spills)"
    elem = plans.ELEM_OF[ctype(p)]
    if plans.forward_config(p.d, limits, elem) is None or plans.backward_config(p.d, limits, elem) is None:
        return f"has no tile configuration for D={p.d} within {limits.max_shared_per_block} B of shared memory"
    return None


def instantiations() -> list[tuple[str, str]]:
    return plans.instantiations()


def forward_plan(
    p: AttentionProblem, g: Geometry, limits: DeviceLimits, config: plans.ForwardConfig | None = None
) -> CallPlan:
    """``config`` overrides the tile configuration (benchmarks and tests of other variants)."""
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
