"""Portable FlashAttention kernels (SIMT, float32 arithmetic): any dtype, D <= 256, sm_60+.

The launch geometry comes from ``plans.portable``; this module only turns arrays into
kernel arguments (pointers, int64 element strides, sizes, the scale) and launches.

``DQ_STRATEGY`` picks how the backward accumulates dQ: ``"atomic"`` (float32 atomics from the
dK/dV kernel, then one conversion) or ``"separate"`` (a second kernel over Q_i tiles that
recomputes dS and writes dQ once). The environment variable ``CUPYFLASH_PORTABLE_DQ`` sets
the default; ``backward(..., dq_strategy=...)`` overrides it per call. On an H200 (fp32) the
atomics were faster in every measured shape (D=128, N=4096: 27.2 vs 21.7 TFLOP/s; D=64 causal,
N=1024..4096: 19-28 vs 16-22), as the separate pass recomputes S and dP (7 tile products, not 5).
"""
from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np

from .. import _dtypes
from ..plans import DeviceLimits
from ..plans import portable as plans
from ..validation import MAX_HEAD_DIM, AttentionProblem
from .._layout import rows_aligned
from .build import element_strides as _strides
from .build import launch_plan as _launch

NAME = "portable"
DQ_STRATEGY: plans.DqStrategy = os.environ.get("CUPYFLASH_PORTABLE_DQ", "atomic")  # type: ignore[assignment]
MIN_COMPUTE_CAPABILITY = 60
LOG2E = 1.4426950408889634


def supports(p: AttentionProblem, limits: DeviceLimits) -> bool:
    return (
        np.dtype(p.dtype) in _dtypes.SUPPORTED
        and 1 <= p.d <= MAX_HEAD_DIM
        and limits.compute_capability >= MIN_COMPUTE_CAPABILITY
    )


def instantiations() -> list[tuple[str, str]]:
    return plans.instantiations()


# ------------------------------------------------------------------------------ helpers


def _vec_ok(d: int, *arrays: Any) -> bool:
    """16-byte loads/stores are safe: aligned bases, and every stride and D a multiple of 16 bytes."""
    return (d * arrays[0].itemsize) % 16 == 0 and rows_aligned(*arrays)


def _batch_chunks(b: int, *arrays: Any) -> Iterator[tuple[Any, ...]]:
    """Slices along the batch axis that keep grid.z within its limit."""
    step = plans.MAX_GRID_YZ
    if b <= step:
        yield arrays
        return
    for b0 in range(0, b, step):
        yield tuple(x[b0 : b0 + step] for x in arrays)


def _shape(q: Any, k: Any, p: AttentionProblem) -> plans.Shape:
    b, hq, nq, d = q.shape
    return plans.Shape(b=b, hq=hq, hk=k.shape[1], nq=nq, nk=k.shape[2], d=d, dtype=np.dtype(p.dtype))


def _scales(p: AttentionProblem) -> tuple[np.float32, np.float32]:
    return np.float32(p.scale * LOG2E), np.float32(p.scale)


# ------------------------------------------------------------------------------ forward


def forward(q: Any, k: Any, v: Any, o: Any, lse: Any, p: AttentionProblem) -> None:
    limits = DeviceLimits.current()
    for qc, kc, vc, oc, lc in _batch_chunks(q.shape[0], q, k, v, o, lse):
        s = _shape(qc, kc, p)
        plan = plans.forward_plan(s, limits)
        scale_log2, _ = _scales(p)
        vec = _vec_ok(s.d, qc, kc, vc, oc)
        args = (
            qc, kc, vc, oc, lc,
            *_strides(qc), *_strides(kc), *_strides(vc), *_strides(oc), *_strides(lc),
            np.int32(s.nq), np.int32(s.nk), np.int32(s.d), np.int32(s.group), np.int32(p.causal),
            scale_log2, np.int32(vec),
        )  # fmt: skip
        _launch(plan.launch, args)


# ------------------------------------------------------------------------------ backward


def backward(
    do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, dq: Any, dk: Any, dv: Any, p: AttentionProblem,
    dq_strategy: plans.DqStrategy | None = None,
) -> None:  # fmt: skip
    import cupy

    strategy = dq_strategy or DQ_STRATEGY
    limits = DeviceLimits.current()
    chunks = _batch_chunks(q.shape[0], do, q, k, v, o, lse, dq, dk, dv)
    for doc, qc, kc, vc, oc, lc, dqc, dkc, dvc in chunks:
        s = _shape(qc, kc, p)
        plan = plans.backward_plan(s, limits, strategy)
        scale_log2, scale = _scales(p)
        vec = np.int32(_vec_ok(s.d, doc, qc, kc, vc, dqc, dkc, dvc))
        sizes = (np.int32(s.nq), np.int32(s.nk), np.int32(s.d), np.int32(s.group), np.int32(p.causal))

        lse2 = cupy.empty((s.b, s.hq, s.nq), dtype=np.float32)
        delta = cupy.empty((s.b, s.hq, s.nq), dtype=np.float32)
        rows = np.int64(s.b * s.hq * s.nq)
        _launch(plan.delta, (oc, doc, lc, lse2, delta, *_strides(oc), *_strides(doc), *_strides(lc),
                             np.int32(s.hq), np.int32(s.nq), np.int32(s.d), rows))  # fmt: skip

        common = (*_strides(qc), *_strides(kc), *_strides(vc), *_strides(doc))
        if strategy == "atomic":
            dq_acc = cupy.zeros((s.b, s.hq, s.nq, s.d), dtype=np.float32)
            _launch(plan.kv, (qc, kc, vc, doc, lse2, delta, dkc, dvc, dq_acc, *common, *_strides(dkc),
                              *_strides(dvc), *sizes, scale_log2, scale, vec))  # fmt: skip
            _launch(plan.dq, (dq_acc, dqc, *_strides(dqc), np.int32(s.hq), np.int32(s.nq), np.int32(s.d),
                              np.int64(dq_acc.size)))  # fmt: skip
        else:
            _launch(plan.kv, (qc, kc, vc, doc, lse2, delta, dkc, dvc, np.uint64(0), *common, *_strides(dkc),
                              *_strides(dvc), *sizes, scale_log2, scale, vec))  # fmt: skip
            _launch(plan.dq, (qc, kc, vc, doc, lse2, delta, dqc, *common, *_strides(dqc),
                              *sizes, scale_log2, scale, vec))  # fmt: skip
