"""Hopper forward on warpgroup MMA (wgmma, sm_90a) for fp16/bf16; the backward is the mma family's.

Geometry comes from ``plans.wgmma``. The forward writes the same o and lse as the mma forward, so
the FlashAttention-2 backward of ``kernels.mma`` runs on its output unchanged.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import _dtypes
from .._layout import rows_aligned
from ..plans import DeviceLimits
from ..plans import wgmma as plans
from ..validation import AttentionProblem
from . import mma
from .build import element_strides as _strides

NAME = "wgmma"

backward = mma.backward


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
    nk = k.shape[2]
    ctype = _dtypes.CTYPE[np.dtype(p.dtype)]
    plan = plans.plan_forward(b, hq, nq, d, ctype, DeviceLimits.current(), config, causal=p.causal)
    args = (
        q, k, v, o, lse,
        np.int32(nq), np.int32(nk), np.int32(d), np.int32(hq), np.int32(p.group),
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        *_strides(lse),
        np.float32(p.scale * mma.LOG2E), np.int32(p.causal), np.int32(plan.heads_on_x),
    )  # fmt: skip
    mma._launch(plan.main, args)
