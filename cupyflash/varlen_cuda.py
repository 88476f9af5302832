"""The CUDA host path of packed variable-length calls (issue 14).

A pack of B sequences runs as one launch per pass over the grid (query or key tiles of max_seqlen, heads,
sequences): the kernel problem is the dense one with batch B, nq = max_seqlen_q and nk = max_seqlen_k, and
the packed arrays are seen as (B, H, total, D) views with a batch stride of 0. Each block asks
``seq_geometry`` (cuda_src/attention_params.cuh) for its sequence's first rows and lengths in
``cu_seqlens``, exits at once past the sequence's end, and builds its mask from the sequence's own nq, nk;
the rows are clipped on the device, so no value of cu_seqlens reaches outside the arrays. Nothing here
reads cu_seqlens on the host (``validate=True`` does, with one synchronisation).

As for dense calls (cuda_backend), the checks, the family choice, the views and the launch plans depend only
on a call's signature and are cached by it: a repeated call costs a dictionary lookup, its output
allocations and one driver call per launch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import numpy as np

from .cuda_backend import _key_of, _seed_of
from .kernels import dispatch
from .kernels.family import CallPlan, Geometry, run
from .plans import DeviceLimits
from .validation import AttentionProblem
from .varlen_validation import VarlenProblem, check_varlen, check_varlen_backward, check_varlen_values

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


class _Prepared:
    """A checked signature: the varlen problem, the views of its arrays and its launch plan (None: no launch)."""

    __slots__ = ("vp", "geometry", "plan")

    def __init__(self, vp: VarlenProblem, geometry: Geometry, plan: CallPlan | None):
        self.vp, self.geometry, self.plan = vp, geometry, plan


_forward_cache: dict[tuple, _Prepared] = {}
_backward_cache: dict[tuple, _Prepared] = {}


def _signature(kernel: str, arrays: tuple, scalars: tuple) -> tuple | None:
    """The cache key of a call: everything the checks and plans read (as cuda_backend keys dense calls), or
    None when an array is not a CuPy array (the checks then say what is wrong; nothing is cached)."""
    import cupy

    if not all(x is None or isinstance(x, cupy.ndarray) for x in arrays):
        return None
    return (kernel, cupy.cuda.runtime.getDevice(), *(_key_of(x) for x in arrays), *(_key_of(x) for x in scalars))


def _prepare(vp: VarlenProblem, kernel: str, packed: dict[str, Any], lse: Any, alibi: Any,
             make_plan: Callable[[Any, AttentionProblem, Geometry, DeviceLimits], CallPlan]) -> _Prepared:  # fmt: skip
    p = _kernel_problem(vp)
    limits = DeviceLimits.current()
    g = _geometry(vp, packed, lse, alibi)
    family = dispatch.select(p, limits, kernel, g.aligned)  # raises before anything is launched
    return _Prepared(vp, g, None if _no_launch(vp) else make_plan(family, p, g, limits))


def forward(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any,
            causal: Any, scale: Any, kernel: str, validate: bool, seqused_k: Any = None, window_size: Any = None,
            softcap: Any = 0.0, alibi_slopes: Any = None, sinks: Any = None, dropout_p: Any = 0.0,
            dropout_seed: int | None = None) -> tuple[Any, Any]:  # fmt: skip
    """``dropout_seed``: the checked seed (the kernels key sequence b's mask by batch index b)."""
    import cupy

    key = _signature(kernel, (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, sinks),
                     (max_seqlen_q, max_seqlen_k, causal, scale, window_size, softcap, dropout_p))  # fmt: skip
    prep = None if key is None else _forward_cache.get(key)
    vp = prep.vp if prep is not None else check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=scale,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, seqused_k=seqused_k,
        dropout_p=dropout_p)
    if validate:
        check_varlen_values(cupy, vp, cu_seqlens_q, cu_seqlens_k, seqused_k)
    q, k, v = (_readable(x) for x in (q, k, v))
    o = cupy.empty(q.shape, dtype=vp.dense.dtype)
    lse = cupy.empty((vp.dense.hq, vp.total_q), dtype=_FLOAT32)
    packed = {"q": q, "k": k, "v": v, "o": o}
    if prep is None:
        prep = _prepare(vp, kernel, packed, lse, alibi_slopes, lambda f, p, g, lim: f.forward_plan(p, g, lim))
        if key is not None:
            _forward_cache[key] = prep
    if prep.plan is None:  # every row sees no key: o = 0, lse = its sink (or -inf)
        o.fill(0)
        lse[...] = -np.inf if sinks is None else sinks.reshape(-1, 1)
        return o, lse
    run(prep.plan, prep.geometry,
        _pointers({**packed, "lse": lse}, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, sinks),
        _seed_of(vp.dense, dropout_seed))  # fmt: skip
    return o, lse


def backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, cu_seqlens_q: Any, cu_seqlens_k: Any,
             max_seqlen_q: Any, max_seqlen_k: Any, causal: Any, scale: Any, kernel: str, validate: bool,
             seqused_k: Any = None, window_size: Any = None, softcap: Any = 0.0, alibi_slopes: Any = None,
             sinks: Any = None, deterministic: bool = False, dropout_p: Any = 0.0,
             dropout_seed: int | None = None) -> tuple[Any, ...]:  # fmt: skip
    """``deterministic``: the dQ adds take ordered turns per (sequence, query head, query tile)
    (cuda_src/dq_turns.cuh; the family's backward_plan sizes the counters for B sequences of max_seqlen_q rows),
    and dsinks is summed by CuPy reductions after the launches instead of by the kernels' atomics."""
    import cupy

    key = _signature(kernel, (do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes, sinks),
                     (max_seqlen_q, max_seqlen_k, causal, scale, window_size, softcap, dropout_p,
                      bool(deterministic)))  # fmt: skip
    prep = None if key is None else _backward_cache.get(key)
    vp = prep.vp if prep is not None else check_varlen_backward(
        do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=scale,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, seqused_k=seqused_k,
        dropout_p=dropout_p)
    if validate:
        check_varlen_values(cupy, vp, cu_seqlens_q, cu_seqlens_k, seqused_k)
    dtype, hq = vp.dense.dtype, vp.dense.hq
    do, q, k, v, o = (_readable(x) for x in (do, q, k, v, o))
    dq = cupy.empty(q.shape, dtype=dtype)
    # Keys past seqused_k[b] belong to no problem: no kernel writes them, so they start at 0.
    dk = (cupy.empty if seqused_k is None else cupy.zeros)(k.shape, dtype=dtype)
    dv = (cupy.empty if seqused_k is None else cupy.zeros)(v.shape, dtype=dtype)
    dsinks = None if sinks is None else cupy.zeros((hq,), dtype=_FLOAT32)
    grads = (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
    packed = {"dout": do, "q": q, "k": k, "v": v, "o": o, "dq": dq, "dk": dk, "dv": dv}
    if prep is None:
        prep = _prepare(vp, kernel, packed, lse, alibi_slopes,
                        lambda f, p, g, lim: f.backward_plan(p, g, lim, deterministic=bool(deterministic)))
        if key is not None:
            _backward_cache[key] = prep
    if prep.plan is None:  # no row sees a key: zero gradients; a sink alone takes every row (P_sink = exp(s - lse))
        for x in (dq, dk, dv):
            x.fill(0)
        if dsinks is not None and vp.total_q:
            dsinks[...] = _dsinks(do, o, lse, sinks)
        return grads
    kernel_dsinks = dsinks is not None and not deterministic  # the kernels' per-row atomics add in any order
    run(prep.plan, prep.geometry,
        _pointers({**packed, "lse": lse, **({"dsinks": dsinks} if kernel_dsinks else {})}, cu_seqlens_q,
                  cu_seqlens_k, seqused_k, alibi_slopes, sinks), _seed_of(vp.dense, dropout_seed))  # fmt: skip
    if dsinks is not None and deterministic and vp.total_q:
        dsinks[...] = _dsinks(do, o, lse, sinks)
    return grads


def _dsinks(do: Any, o: Any, lse: Any, sinks: Any) -> Any:
    """d sink_h = -sum over every packed row of P_sink * Delta (P_sink = exp(sink_h - lse), 0 where lse = -inf), by
    CuPy's reductions, whose order is fixed; lse is (Hq, total_q)."""
    import cupy

    delta = (do.astype(np.float32) * o.astype(np.float32)).sum(axis=-1).T  # (Hq, total_q)
    share = cupy.where(cupy.isfinite(lse), cupy.exp(sinks.reshape(-1, 1) - lse), 0)
    return -(share * delta).sum(axis=1)
