"""Hopper forward and backward on warpgroup MMA (wgmma, sm_90a) for fp16/bf16.

Geometry comes from ``plans.wgmma``. The forward writes the same o and lse as the mma forward; the
backward is the mma family's three launches with a wgmma main kernel, so either family's backward runs
on either family's forward output. Unaligned rows go to the mma family (and on to the portable one).
"""
from __future__ import annotations

from typing import Any

from .. import _dtypes
from .._layout import rows_aligned
from ..plans import DeviceLimits
from ..plans import wgmma as plans
from ..validation import AttentionProblem
from . import mma

NAME = "wgmma"


def supports(p: AttentionProblem, limits: DeviceLimits) -> bool:
    """fp16/bf16 on compute capability 9.0 with 32 < D <= 128, D a multiple of 8."""
    return _dtypes.is_half(p.dtype) and p.d % 8 == 0 and plans.forward_config(p.d, limits) is not None


def instantiations() -> list[tuple[str, str]]:
    return plans.instantiations()


def forward(
    q: Any, k: Any, v: Any, o: Any, lse: Any, p: AttentionProblem, config: plans.ForwardConfig | None = None
) -> None:
    """``config`` overrides the tile configuration (benchmarks and tests of other variants)."""
    if not rows_aligned(q, k, v, o):
        return mma.forward(q, k, v, o, lse, p)  # which hands unaligned rows on to the portable family
    b, hq, nq, d = q.shape
    plan = plans.plan_forward(b, hq, nq, d, mma._ctype(p), DeviceLimits.current(), config, causal=p.causal)
    mma.launch_forward(plan, q, k, v, o, lse, p)


def backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, dq: Any, dk: Any, dv: Any, p: AttentionProblem,
    config: plans.BackwardConfig | None = None,
) -> None:  # fmt: skip
    """``config`` overrides the tile configuration (benchmarks and tests of other variants)."""
    limits = DeviceLimits.current()
    if not rows_aligned(do, q, k, v, o, dq, dk, dv) or (config or plans.backward_config(p.d, limits)) is None:
        return mma.backward(do, q, k, v, o, lse, dq, dk, dv, p)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    plan = plans.plan_backward(b, hq, hk, nq, nk, d, mma._ctype(p), limits, config, causal=p.causal)
    mma.launch_backward(plan, do, q, k, v, o, lse, dq, dk, dv, p)
