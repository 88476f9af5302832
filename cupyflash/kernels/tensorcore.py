"""What the two tensor-core families (mma, wgmma) share on the launch side: their forward main kernels
take the same params, and their backwards are the same three launches around a family's main kernel
(``plans.tensorcore``)."""
from __future__ import annotations

import numpy as np

from .. import _dtypes
from ..plans import dq_head_group
from ..plans.tensorcore import BackwardPlan, ForwardPlan, with_rows
from ..validation import AttentionProblem
from .family import CallPlan, Geometry, Scratch, base_params, call_plan, scratch_rows


def ctype(p: AttentionProblem) -> str:
    return _dtypes.CTYPE[np.dtype(p.dtype)]


def forward_call(plan: ForwardPlan, p: AttentionProblem, g: Geometry) -> CallPlan:
    """The forward main kernel's call (the wgmma family's forward takes the same params)."""
    return call_plan([plan.main], base_params(p, g, plan.heads_on_x))


def backward_call(plan: BackwardPlan, p: AttentionProblem, g: Geometry, deterministic: bool = False,
                  sm_count: int = 0) -> CallPlan:  # fmt: skip
    """Delta, the main kernel, the dQ conversion (the wgmma family's main kernel takes the same params), or the
    main kernel alone where it owns dQ (``BackwardPlan.own_dq``).
    ``deterministic``: one zeroed turn counter per (batch, query head, query tile of the main kernel), so
    the key tiles add into dQ in a fixed order (``cuda_src/dq_turns.cuh``), in the grid order of
    ``plans.dq_head_group`` (``sm_count``: the device's)."""
    if p.varlen:  # the per-row launches and scratch cover the packed (Hq, total_q) rows
        plan = with_rows(plan, scratch_rows(p, g))
    # float32 query parts (plans.mma.query_parts): each part's partial dK/dV, summed by the combine launch
    parts = [Scratch("kv_part", 2 * plan.q_parts * g.batch * p.hk * p.nk * p.d)] if plan.q_parts > 1 else []
    if plan.own_dq:  # one key tile per kv head: the main kernel does Delta and dQ (one launch; deterministic; one
        # query part, with_query_parts)
        return call_plan(plan.launches, base_params(p, g, plan.heads_on_x, q_parts=plan.q_parts),
                         [Scratch("delta", plan.rows)])  # fmt: skip
    scratch = [Scratch("delta", plan.rows), Scratch("dq_accum", plan.rows * p.d), *parts]  # dq_accum: Delta zeroes it
    if deterministic:
        scratch.append(Scratch("dq_turns", g.batch * p.hq * -(-p.nq // plan.config.br), zeroed=True))
    extra = {}
    if deterministic:
        heads = plan.main.grid[0] if plan.heads_on_x else plan.main.grid[1]
        extra["dq_head_group"] = dq_head_group(heads, sm_count, p.variant.longest_first, plan.heads_on_x)
    return call_plan(plan.launches, base_params(p, g, plan.heads_on_x, q_parts=plan.q_parts, **extra), scratch)
