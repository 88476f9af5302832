"""Portable FlashAttention kernels (SIMT, float32 arithmetic): any dtype, D <= 256, sm_60+.

The launch geometry comes from ``plans.portable``; this module turns a problem into the family's
``CallPlan``s (``kernels/family.py``). Unaligned rows are fine: the kernels use 16-byte vector loads
only where ``params.vec`` says every row allows them.

``DQ_STRATEGY`` picks how the backward accumulates dQ: ``"atomic"`` (float32 atomics from the
dK/dV kernel, then one conversion) or ``"separate"`` (a second kernel over Q_i tiles that
recomputes dS and writes dQ once). The environment variable ``CUPYFLASH_PORTABLE_DQ`` sets
the default; ``backward_plan(..., dq_strategy=...)`` overrides it. On an H200 (fp32) the
atomics were faster in every measured shape (D=128, N=4096: 27.2 vs 21.7 TFLOP/s; D=64 causal,
N=1024..4096: 19-28 vs 16-22), as the separate pass recomputes S and dP (7 tile products, not 5).
The deterministic backward keeps the strategy: its atomics take ordered turns (``cuda_src/dq_turns.cuh``);
the separate pass is deterministic as it is.
"""
from __future__ import annotations


import os

import numpy as np

from .. import _dtypes
from ..plans import DeviceLimits, dq_head_group
from ..plans import portable as plans
from ..validation import MAX_HEAD_DIM, AttentionProblem
from .family import CallPlan, Geometry, Scratch, base_params, call_plan, entry_points, scratch_rows

NAME = "portable"
NEEDS_ALIGNED_ROWS = False
DQ_STRATEGY: plans.DqStrategy = os.environ.get("CUPYFLASH_PORTABLE_DQ", "atomic")  # type: ignore[assignment]
MIN_COMPUTE_CAPABILITY = 60


def supports(p: AttentionProblem, limits: DeviceLimits) -> str | None:
    if np.dtype(p.dtype) not in _dtypes.SUPPORTED:
        return f"does not take {p.dtype}"
    if not 1 <= p.d <= MAX_HEAD_DIM:
        return f"needs 1 <= D <= {MAX_HEAD_DIM} (got D={p.d})"
    if limits.compute_capability < MIN_COMPUTE_CAPABILITY:
        return f"needs sm_60 or newer (this device is sm_{limits.compute_capability})"
    return None


def instantiations() -> list[tuple[str, str]]:
    return plans.instantiations()


def _shape(p: AttentionProblem, g: Geometry) -> plans.Shape:
    return plans.Shape(b=g.batch, hq=p.hq, hk=p.hk, nq=p.nq, nk=p.nk, d=p.d, dtype=np.dtype(p.dtype), variant=p.variant,
                       total_q=p.total_q, total_k=p.total_k)  # fmt: skip


def _vec(p: AttentionProblem, g: Geometry) -> int:
    """16-byte loads and stores are safe: aligned rows and D a multiple of 16 bytes."""
    return int(g.aligned and (p.d * np.dtype(p.dtype).itemsize) % 16 == 0)


def forward_plan(p: AttentionProblem, g: Geometry, limits: DeviceLimits) -> CallPlan:
    s = _shape(p, g)
    plan = plans.forward_plan(s, limits)
    return call_plan([plan.launch], base_params(p, g, plans.heads_fastest(s.query_heads), vec=_vec(p, g)))


def backward_plan(
    p: AttentionProblem, g: Geometry, limits: DeviceLimits, dq_strategy: plans.DqStrategy | None = None,
    deterministic: bool = False,
) -> CallPlan:
    """Delta (and lse in log2 units), dK/dV (with dQ atomics, or followed by the dQ pass), the dQ conversion.
    ``deterministic``: the atomics go in key-tile order (ordered turns, ``cuda_src/dq_turns.cuh``), or, with
    ``dq_strategy="separate"``, the dQ pass writes each row once."""
    strategy = dq_strategy or DQ_STRATEGY
    s = _shape(p, g)
    rows = scratch_rows(p, g)
    plan = plans.backward_plan(s, limits, strategy, rows)
    scratch = [Scratch("lse_log2", rows), Scratch("delta", rows)]
    if strategy == "atomic":
        scratch.append(Scratch("dq_accum", rows * s.d, zeroed=True))
        if deterministic:  # one turn counter per (batch, query head, query tile of the dK/dV kernel)
            scratch.append(Scratch("dq_turns", s.b * s.hq * -(-s.nq // plan.kv_tile.cols), zeroed=True))
    # The kv and dq kernels' grids put heads fastest under the same rule (B*Hk <= B*Hq).
    params = base_params(p, g, plans.heads_fastest(s.query_heads), vec=_vec(p, g))
    kv_on_x = plans.heads_fastest(s.key_heads)
    extra = {}
    if deterministic and strategy == "atomic":  # the grid order of the ordered turns (cuda_src/dq_turns.cuh)
        extra["dq_head_group"] = dq_head_group(s.key_heads, limits.sm_count, p.variant.longest_first, kv_on_x)
    kv_params = base_params(p, g, kv_on_x, vec=_vec(p, g), **extra)
    launches = [(plan.delta, params.to_bytes()), (plan.kv, kv_params.to_bytes()), (plan.dq, params.to_bytes())]
    return CallPlan(tuple(launches), tuple(scratch))


# Entry points with given outputs, for tests and benchmarks (the API goes through cuda_backend's cache).
forward, backward = entry_points(__name__)
