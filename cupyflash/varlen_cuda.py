"""The CUDA host path of packed variable-length calls (issue 14).

A pack of B sequences runs as one launch per pass over the grid (query or key tiles of max_seqlen, heads,
sequences): the kernel problem is the dense one with batch B, nq = max_seqlen_q and nk = max_seqlen_k, and
the packed arrays are seen as (B, H, total, D) views with a batch stride of 0. Each block asks
``seq_geometry`` (cuda_src/attention_params.cuh) for its sequence's first rows and lengths in
``cu_seqlens``, exits at once past the sequence's end, and builds its mask from the sequence's own nq, nk;
the rows are clipped on the device, so no value of cu_seqlens reaches outside the arrays. Nothing here
reads cu_seqlens on the host (``validate=True`` does, with one synchronisation).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from .kernels import dispatch
from .kernels.family import Geometry, run
from .plans import DeviceLimits
from .validation import AttentionProblem
from .varlen_validation import VarlenProblem, check_varlen_values

_FLOAT32 = np.dtype(np.float32)


def _kernel_problem(vp: VarlenProblem) -> AttentionProblem:
    return replace(vp.dense, batch=(vp.batch_size,), nq=vp.max_seqlen_q, nk=vp.max_seqlen_k, total_q=vp.total_q,
                   total_k=vp.total_k)  # fmt: skip


def _readable(x: Any) -> Any:
    """Kernels need a unit last-dim stride and step forward through rows and heads; anything else is copied."""
    import cupy

    if x.ndim and (x.strides[-1] != x.itemsize or any(s < 0 for s in x.strides)):
        return cupy.ascontiguousarray(x)
    return x


def _view(x: Any) -> tuple[int, int, int]:
    """Element strides (b, h, n) of a packed (total, H, D) array seen as (B, H, total, D): b = 0."""
    return 0, x.strides[1] // x.itemsize, x.strides[0] // x.itemsize


def _aligned(arrays: dict[str, Any]) -> bool:
    """Every row of every packed array starts on a 16-byte boundary (16-byte vector loads are safe)."""
    for x in arrays.values():
        if x.data.ptr % 16 or any(n > 1 and s % 16 for n, s in zip(x.shape[:-1], x.strides[:-1])):
            return False
    return True


def _geometry(vp: VarlenProblem, packed: dict[str, Any], lse: Any, alibi: Any) -> Geometry:
    strides = {n: _view(x) for n, x in packed.items()}
    strides["lse"] = (0, lse.strides[0] // lse.itemsize, lse.strides[1] // lse.itemsize)  # (Hq, total_q)
    if alibi is not None:  # (Hq,): every sequence reads the same slopes; (B, Hq): one row per sequence
        strides["alibi"] = (0 if alibi.ndim == 1 else alibi.strides[0] // alibi.itemsize, 1, 0)
    return Geometry(vp.batch_size, strides, ({},), _aligned(packed))


def _pointers(arrays: dict[str, Any], cu_seqlens_q: Any, cu_seqlens_k: Any, seqused_k: Any,
              alibi_slopes: Any, sinks: Any) -> dict[str, int]:  # fmt: skip
    ptrs = {n: x.data.ptr for n, x in arrays.items()}
    ptrs.update(cu_seqlens_q=cu_seqlens_q.data.ptr, cu_seqlens_k=cu_seqlens_k.data.ptr)
    for name, x in (("seqused_k", seqused_k), ("alibi", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            ptrs[name] = x.data.ptr
    return ptrs


def _no_launch(vp: VarlenProblem) -> bool:
    """Nothing for a kernel to do: no query rows, or no key any sequence could see."""
    return vp.total_q == 0 or vp.total_k == 0 or vp.max_seqlen_q == 0 or vp.max_seqlen_k == 0


def forward(vp: VarlenProblem, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, kernel: str,
            validate: bool, alibi_slopes: Any, sinks: Any, seqused_k: Any) -> tuple[Any, Any]:  # fmt: skip
    import cupy

    if validate:
        check_varlen_values(cupy, vp, cu_seqlens_q, cu_seqlens_k, seqused_k)
    p = _kernel_problem(vp)
    limits = DeviceLimits.current()
    q, k, v = (_readable(x) for x in (q, k, v))
    o = cupy.empty(q.shape, dtype=p.dtype)
    lse = cupy.empty((p.hq, vp.total_q), dtype=_FLOAT32)
    packed = {"q": q, "k": k, "v": v, "o": o}
    g = _geometry(vp, packed, lse, alibi_slopes)
    family = dispatch.select(p, limits, kernel, g.aligned)  # raises before anything is launched
    if _no_launch(vp):  # every row sees no key: o = 0, lse = its sink (or -inf)
        o.fill(0)
        lse[...] = -np.inf if sinks is None else sinks.reshape(-1, 1)
        return o, lse
    arrays = {**packed, "lse": lse}
    run(family.forward_plan(p, g, limits), g,
        _pointers(arrays, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, sinks))  # fmt: skip
    return o, lse


def backward(vp: VarlenProblem, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, cu_seqlens_q: Any,
             cu_seqlens_k: Any, kernel: str, validate: bool, alibi_slopes: Any, sinks: Any,
             seqused_k: Any) -> tuple[Any, ...]:  # fmt: skip
    import cupy

    if validate:
        check_varlen_values(cupy, vp, cu_seqlens_q, cu_seqlens_k, seqused_k)
    p = _kernel_problem(vp)
    limits = DeviceLimits.current()
    do, q, k, v, o = (_readable(x) for x in (do, q, k, v, o))
    dq = cupy.empty(q.shape, dtype=p.dtype)
    # Keys past seqused_k[b] belong to no problem: no kernel writes them, so they start at 0.
    dk = (cupy.empty if seqused_k is None else cupy.zeros)(k.shape, dtype=p.dtype)
    dv = (cupy.empty if seqused_k is None else cupy.zeros)(v.shape, dtype=p.dtype)
    dsinks = None if sinks is None else cupy.zeros((p.hq,), dtype=_FLOAT32)
    grads = (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
    packed = {"dout": do, "q": q, "k": k, "v": v, "o": o, "dq": dq, "dk": dk, "dv": dv}
    g = _geometry(vp, packed, lse, alibi_slopes)
    family = dispatch.select(p, limits, kernel, g.aligned)
    if _no_launch(vp):  # no row sees a key: zero gradients; a sink alone takes every row (P_sink = exp(s - lse))
        for x in (dq, dk, dv):
            x.fill(0)
        if dsinks is not None and vp.total_q:
            delta = (do.astype(np.float32) * o.astype(np.float32)).sum(axis=-1).T  # (Hq, total_q)
            share = cupy.where(cupy.isfinite(lse), cupy.exp(sinks.reshape(-1, 1) - lse), 0)
            dsinks[...] = -(share * delta).sum(axis=1)
        return grads
    run(family.backward_plan(p, g, limits), g,
        _pointers({**packed, "lse": lse, **({"dsinks": dsinks} if dsinks is not None else {})}, cu_seqlens_q,
                  cu_seqlens_k, seqused_k, alibi_slopes, sinks))  # fmt: skip
    return grads
