"""What the two tensor-core families (mma, wgmma) share on the launch side: their forward main kernels
take the same params, and their backwards are the same three launches around a family's main kernel
(``plans.tensorcore``)."""
from __future__ import annotations

import numpy as np

from .. import _dtypes
from ..plans.tensorcore import BackwardPlan, ForwardPlan, with_rows
from ..validation import AttentionProblem
from .family import CallPlan, Geometry, Scratch, base_params, call_plan, scratch_rows


def ctype(p: AttentionProblem) -> str:
    return _dtypes.CTYPE[np.dtype(p.dtype)]


def forward_call(plan: ForwardPlan, p: AttentionProblem, g: Geometry) -> CallPlan:
    """The forward main kernel's call (the wgmma family's forward takes the same params)."""
    return call_plan([plan.main], base_params(p, g, plan.heads_on_x))


def backward_call(plan: BackwardPlan, p: AttentionProblem, g: Geometry, deterministic: bool = False) -> CallPlan:
    """Delta, the main kernel, the dQ conversion (the wgmma family's main kernel takes the same params), or the
    main kernel alone where it owns dQ (``BackwardPlan.own_dq``).
    ``deterministic``: one zeroed turn counter per (batch, query head, query tile of the main kernel), so
    the key tiles add into dQ in a fixed order (``cuda_src/dq_turns.cuh``)."""
    if p.varlen:  # the per-row launches and scratch cover the packed (Hq, total_q) rows
        plan = with_rows(plan, scratch_rows(p, g))
    if plan.own_dq:  # one key tile per kv head: the main kernel does Delta and dQ (one launch; deterministic)
        return call_plan([plan.main], base_params(p, g, plan.heads_on_x), [Scratch("delta", plan.rows)])
    scratch = [Scratch("delta", plan.rows), Scratch("dq_accum", plan.rows * p.d)]  # zeroed by the Delta kernel
    if deterministic:
        scratch.append(Scratch("dq_turns", g.batch * p.hq * -(-p.nq // plan.config.br), zeroed=True))
    return call_plan([plan.delta, plan.main, plan.convert], base_params(p, g, plan.heads_on_x), scratch)
