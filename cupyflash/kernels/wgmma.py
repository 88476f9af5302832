"""Hopper forward and backward on warpgroup MMA (wgmma, sm_90a) for fp16/bf16.

Geometry comes from ``plans.wgmma``. The forward writes the same o and lse as the mma forward; the
backward is the tensor-core families' three launches (``plans.tensorcore``) with a wgmma main kernel,
so either family's backward runs on either family's forward output.
"""
from __future__ import annotations

import numpy as np

from .. import _dtypes
from ..plans import DeviceLimits
from ..plans import wgmma as plans
from ..validation import AttentionProblem
from .family import CallPlan, Geometry, entry_points
from .tensor_map import TensorMapSpec, view_spec
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
                              total=p.total_q if p.varlen else None,
                              maps=lambda cfg: forward_tma_maps(p, g, cfg.br, cfg.bc), nk=p.nk)  # fmt: skip
    return forward_call(plan, p, g)


def backward_plan(
    p: AttentionProblem, g: Geometry, limits: DeviceLimits, config: plans.BackwardConfig | None = None,
    deterministic: bool = False,
) -> CallPlan:
    plan = plans.plan_backward(g.batch, p.hq, p.hk, p.nq, p.nk, p.d, ctype(p), limits, config, p.variant,
                               total=p.total_k if p.varlen else None,
                               maps=lambda cfg: tma_maps(p, g, cfg.br))  # fmt: skip
    return backward_call(plan, p, g, deterministic, limits.sm_count)


def tma_maps(p: AttentionProblem, g: Geometry, rows: int) -> tuple[TensorMapSpec, TensorMapSpec] | str:
    """The TMA maps of q and dout (boxes of ``rows`` rows) for the backward's loader (``plans.wgmma.uses_tma``), or
    why the call's views have none: packed (varlen) rows, a row, head or batch stride that is not a positive multiple
    of 16 bytes, or a base or sub-batch address off 16 bytes."""
    return _view_maps(p, g, (("q", p.hq, p.nq, rows), ("dout", p.hq, p.nq, rows)))


def forward_tma_maps(p: AttentionProblem, g: Geometry, br: int, bc: int) -> tuple[TensorMapSpec, ...] | str:
    """The TMA maps of q (boxes of ``br`` rows), k and v (``bc`` rows) for the ws forward's producer
    (``plans.wgmma.uses_tma_forward``), or why the call's views have none (as ``tma_maps``)."""
    return _view_maps(p, g, (("q", p.hq, p.nq, br), ("k", p.hk, p.nk, bc), ("v", p.hk, p.nk, bc)))


def _view_maps(p: AttentionProblem, g: Geometry, views: tuple[tuple[str, int, int, int], ...]
               ) -> tuple[TensorMapSpec, ...] | str:  # fmt: skip
    """The maps of (pointer, heads, rows of the sequence, rows of a box) views, or why there are none."""
    if p.varlen:
        return "varlen: packed sequences (the maps are of dense (B, H, N, D) views)"
    if not g.aligned or any(off.get(n, 0) % 16 for off in g.offsets for n, *_ in views):
        return "rows not 16-byte aligned"
    out = []
    for name, heads, n, rows in views:
        spec = view_spec(name, ctype(p), np.dtype(p.dtype).itemsize, g.batch, heads, n, p.d, g.strides[name], rows)
        if isinstance(spec, str):
            return f"{name}: {spec}"
        out.append(spec)
    return tuple(out)


# Entry points with given outputs, for tests and benchmarks (the API goes through cuda_backend's cache).
forward, backward = entry_points(__name__)
