"""Hopper forward and backward on warpgroup MMA (wgmma, sm_90a) for fp16/bf16.

Geometry comes from ``plans.wgmma``. The forward writes the same o and lse as the mma forward; the
backward is the tensor-core families' three launches (``plans.tensorcore``) with a wgmma main kernel,
so either family's backward runs on either family's forward output.
"""
from __future__ import annotations


from .. import _dtypes
from ..plans import DeviceLimits
from ..plans import wgmma as plans
from ..validation import AttentionProblem
from .family import CallPlan, Geometry, entry_points
from .tensorcore import backward_call, ctype, forward_call

NAME = "wgmma"
NEEDS_ALIGNED_ROWS = True


def supports(p: AttentionProblem, limits: DeviceLimits) -> str | None:
    if not _dtypes.is_half(p.dtype):
        return f"needs float16 or bfloat16 (got {p.dtype})"
    if limits.compute_capability != plans.COMPUTE_CAPABILITY:
        return f"needs compute capability 9.0 (sm_90a; this device is sm_{limits.compute_capability})"
    if not plans.MIN_D < p.d <= plans.MAX_D or p.d % 8:
        return f"needs {plans.MIN_D} < D <= {plans.MAX_D}, a multiple of 8 (got D={p.d})"
    if plans.forward_config(p.d, limits) is None or plans.backward_config(p.d, limits) is None:
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
    p: AttentionProblem, g: Geometry, limits: DeviceLimits, config: plans.BackwardConfig | None = None,
    deterministic: bool = False,
) -> CallPlan:
    plan = plans.plan_backward(g.batch, p.hq, p.hk, p.nq, p.nk, p.d, ctype(p), limits, config, p.variant,
                               total=p.total_k if p.varlen else None)  # fmt: skip
    return backward_call(plan, p, g, deterministic, limits.sm_count)


# Entry points with given outputs, for tests and benchmarks (the API goes through cuda_backend's cache).
forward, backward = entry_points(__name__)
