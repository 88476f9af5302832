"""Tensor-core FlashAttention-2 kernels (mma.sync, ldmatrix, cp.async): fp16/bf16 on sm_80+.

Geometry comes from ``plans.mma``; this module checks what the kernels assume of the actual
arrays (16-byte aligned rows for cp.async) and hands anything else to the portable family.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _dtypes
from ..plans import DeviceLimits, LaunchPlan
from ..plans import mma as plans
from ..validation import AttentionProblem
from .._layout import rows_aligned
from . import build
from .build import element_strides as _strides

NAME = "mma"
MIN_COMPUTE_CAPABILITY = 80
LOG2E = 1.4426950408889634
_ROW_ALIGN = 8  # elements per 16 bytes: cp.async copies 16-byte chunks of every row


def supports(p: AttentionProblem, limits: DeviceLimits) -> bool:
    """fp16/bf16 on sm_80+ with D a multiple of 8 and a forward tile that fits in shared memory.

    Unaligned arrays are found at launch and go to the portable family (see ``forward``).
    """
    return (
        _dtypes.is_half(p.dtype)
        and limits.compute_capability >= MIN_COMPUTE_CAPABILITY
        and p.d % _ROW_ALIGN == 0
        and plans.forward_config(p.d, limits) is not None
    )


def instantiations() -> list[tuple[str, str]]:
    return plans.instantiations()


# ------------------------------------------------------------------------------ helpers


_carveout_set: set[int] = set()


def _launch(lp: LaunchPlan, args: tuple) -> None:
    fn = build.get_function(lp.source, lp.name)
    if lp.shared_bytes and id(fn) not in _carveout_set:
        # Ask for the largest shared-memory carveout: the tiles are sized for two blocks per SM, and
        # the kernels need no L1 (cp.async.cg bypasses it).
        try:
            fn.preferred_shared_memory_carveout = 100
        except Exception:  # pragma: no cover - a hint; older drivers may refuse it
            pass
        _carveout_set.add(id(fn))
    build.launch(fn, lp.grid, lp.block, args, lp.shared_bytes)


def _ctype(p: AttentionProblem) -> str:
    return _dtypes.CTYPE[np.dtype(p.dtype)]


# ------------------------------------------------------------------------------ forward


def forward(
    q: Any, k: Any, v: Any, o: Any, lse: Any, p: AttentionProblem, config: plans.ForwardConfig | None = None
) -> None:
    """``config`` overrides the tile configuration (benchmarks and tests of other variants)."""
    if not rows_aligned(q, k, v, o):
        from . import portable

        return portable.forward(q, k, v, o, lse, p)
    b, hq, nq, d = q.shape
    plan = plans.plan_forward(b, hq, nq, d, _ctype(p), DeviceLimits.current(), config, causal=p.causal)
    launch_forward(plan, q, k, v, o, lse, p)


def launch_forward(plan: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, p: AttentionProblem) -> None:
    """The forward main kernel; the wgmma family's takes the same arguments (plan: either family's)."""
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    args = (
        q, k, v, o, lse,
        np.int32(nq), np.int32(nk), np.int32(d), np.int32(hq), np.int32(p.group),
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        *_strides(lse),
        np.float32(p.scale * LOG2E), np.int32(p.causal), np.int32(plan.heads_on_x),
    )  # fmt: skip
    _launch(plan.main, args)


# ------------------------------------------------------------------------------ backward


def backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, dq: Any, dk: Any, dv: Any, p: AttentionProblem,
    config: plans.AnyBackwardConfig | None = None,
) -> None:  # fmt: skip
    limits = DeviceLimits.current()
    if not rows_aligned(do, q, k, v, o, dq, dk, dv) or (config or plans.backward_config(p.d, limits)) is None:
        from . import portable

        return portable.backward(do, q, k, v, o, lse, dq, dk, dv, p)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    plan = plans.plan_backward(b, hq, hk, nq, nk, d, _ctype(p), limits, config, causal=p.causal)
    launch_backward(plan, do, q, k, v, o, lse, dq, dk, dv, p)


def launch_backward(
    plan: plans.BackwardPlan, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, dq: Any, dk: Any, dv: Any,
    p: AttentionProblem,
) -> None:  # fmt: skip
    """Delta, the main kernel, the dQ conversion; the wgmma family's main kernel takes the same arguments."""
    import cupy

    b, hq, nq, d = q.shape
    nk = k.shape[2]
    delta = cupy.empty((b, hq, nq), dtype=np.float32)
    dq_accum = cupy.empty((b, hq, nq, d), dtype=np.float32)  # zeroed by the Delta kernel
    rows = np.int64(plan.rows)

    _launch(plan.delta, (do, o, delta, dq_accum, rows, np.int32(nq), np.int32(d), np.int32(hq),
                         *_strides(do), *_strides(o)))  # fmt: skip
    args = (
        q, k, v, do, lse, delta, dq_accum, dk, dv,
        np.int32(nq), np.int32(nk), np.int32(d), np.int32(hq), np.int32(p.group),
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv),
        *(np.int64(s // lse.itemsize) for s in lse.strides),
        np.float32(p.scale), np.float32(p.scale * LOG2E), np.int32(p.causal), np.int32(plan.heads_on_x),
    )  # fmt: skip
    _launch(plan.main, args)
    _launch(plan.convert, (dq_accum, dq, rows, np.int32(nq), np.int32(d), np.int32(hq), *_strides(dq),
                           np.float32(p.scale)))  # fmt: skip
