"""The CUDA host path: CuPy arrays in, kernels queued on the current device and stream, arrays out.

Everything a call does that depends only on its *signature* (array types, dtypes, shapes, strides, row
alignment, the keyword arguments, the device) is done once and cached: argument checks, the family
choice, the (B, H, N, D) views, the launch plans and the parameter bytes. A repeated call then costs a
dictionary lookup, its output allocations and one driver call per launch. The checks are functions of
the signature alone, so a cached signature has passed them; a new one runs them before anything is
allocated or launched.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ._layout import views_of
from .kernels import dispatch
from .kernels.family import CallPlan, Geometry, run
from .plans import DeviceLimits
from .validation import AttentionProblem, check_attention, check_backward

_FLOAT32 = np.dtype(np.float32)


def _array_key(x: Any) -> tuple:
    # Everything the checks and the plans read of an array: its kind, dtype, shape, strides, and
    # whether its base pointer is 16-byte aligned (strides are in the key already).
    return (type(x), x.dtype, x.shape, x.strides, x.data.ptr % 16 == 0)


def _contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out, step = [], itemsize
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _geometry(p: AttentionProblem, arrays: dict[str, tuple[tuple[int, ...], tuple[int, ...], int, int]]) -> Geometry:
    """(B, H, N, D) views of named arrays given as (shape, byte strides, itemsize, base pointer % 16)."""
    b, strides, offsets = views_of({n: a[:3] for n, a in arrays.items()}, len(p.batch))
    return Geometry(b, strides, offsets, _aligned(arrays))


def _aligned(arrays: dict[str, tuple[tuple[int, ...], tuple[int, ...], int, int]]) -> bool:
    """Every row of every array starts on a 16-byte boundary: aligned bases, and every stride but the
    last dim's (of a size > 1 axis) a multiple of 16 bytes. (lse rows are read one float at a time.)"""
    for name, (shape, strides, _, ptr_mod) in arrays.items():
        if name in ("lse", "alibi"):  # read one float at a time
            continue
        if ptr_mod:
            return False
        if any(n > 1 and s % 16 for n, s in zip(shape[:-1], strides[:-1])):
            return False
    return True


class _Prepared:
    """A checked signature: the problem, its family, its views and its launch plan."""

    __slots__ = ("p", "family", "geometry", "plan", "copy")

    def __init__(self, p: AttentionProblem, family: Any, geometry: Geometry, plan: CallPlan | None,
                 copy: tuple[str, ...]):  # fmt: skip
        self.p, self.family, self.geometry, self.plan, self.copy = p, family, geometry, plan, copy


_forward_cache: dict[tuple, _Prepared] = {}
_backward_cache: dict[tuple, _Prepared] = {}


def _needs_copy(x: Any) -> bool:
    """Kernels need a contiguous last dim; any other layout is taken as it is."""
    return x.shape[-1] > 1 and x.strides[-1] != x.itemsize


def _layout_entry(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, ptr_mod: int, copy: bool):
    if copy:  # it will be a fresh contiguous copy
        return shape, _contiguous_strides(shape, itemsize), itemsize, 0
    return shape, strides, itemsize, ptr_mod


def _prepare(
    p: AttentionProblem, kernel: str, inputs: dict[str, Any], outputs: dict[str, tuple[tuple[int, ...], np.dtype]],
    make_plan: Callable[[Any, AttentionProblem, Geometry, DeviceLimits], CallPlan], extra: dict[str, Any],
) -> _Prepared:
    limits = DeviceLimits.current()
    copy = tuple(n for n, x in inputs.items() if n != "lse" and _needs_copy(x))  # lse is read through its strides
    layout = {
        n: _layout_entry(x.shape, x.strides, x.itemsize, x.data.ptr % 16, n in copy) for n, x in inputs.items()
    }
    for n, (shape, dt) in outputs.items():
        layout[n] = (shape, _contiguous_strides(shape, dt.itemsize), dt.itemsize, 0)
    if "alibi" in extra:  # sinks are one (Hq,) vector for every batch: no view needed
        layout["alibi"] = _head_layout(extra["alibi"], len(p.batch))
    g = _geometry(p, layout)
    family = dispatch.select(p, limits, kernel, g.aligned)  # raises before anything is allocated
    empty = p.nq == 0 or p.nk == 0 or p.batch_size == 0 or p.hq == 0  # answered without a launch
    return _Prepared(p, family, g, None if empty else make_plan(family, p, g, limits), copy)


def _inputs(prep: _Prepared, arrays: dict[str, Any]) -> dict[str, Any]:
    if not prep.copy:
        return arrays
    import cupy

    return {n: (cupy.ascontiguousarray(x) if n in prep.copy else x) for n, x in arrays.items()}


def _key_of(x: Any) -> Any:
    """A hashable stand-in for a keyword argument: arrays by their signature, lists as tuples, and
    always the type (True == 1 == 1.0 must not share a cache entry: the checks tell them apart)."""
    if x is None:
        return None
    if hasattr(x, "data") and hasattr(x, "strides"):
        return _array_key(x)
    if isinstance(x, list):
        return (list, tuple(_key_of(e) for e in x))
    if isinstance(x, tuple):
        return (tuple, tuple(_key_of(e) for e in x))
    return (type(x), x)


def _variant_arrays(alibi_slopes: Any, sinks: Any) -> dict[str, Any]:
    out = {}
    if alibi_slopes is not None:
        out["alibi"] = alibi_slopes
    if sinks is not None:
        out["sinks"] = sinks
    return out


def _head_layout(x: Any, nbatch: int) -> tuple:
    """A per-head vector as an array the views understand: (*batch, Hq) -> (*batch, Hq, 1); (Hq,) -> a
    batch stride of 0 (every batch reads the same slopes)."""
    if x.ndim == 1:
        return ((1,) * nbatch + (x.shape[0], 1), (0,) * nbatch + (x.itemsize, x.itemsize), x.itemsize, x.data.ptr % 16)
    return (x.shape + (1,), x.strides + (x.itemsize,), x.itemsize, x.data.ptr % 16)


def forward(q: Any, k: Any, v: Any, causal: Any, scale: Any, kernel: str, window_size: Any = None,
            softcap: Any = 0.0, alibi_slopes: Any = None, sinks: Any = None, dropout_p: Any = 0.0,
            dropout_seed: int | None = None) -> tuple[Any, Any]:  # fmt: skip
    """``dropout_seed`` is checked by the caller and not part of the signature: it is written per call."""
    import cupy

    key = (kernel, _key_of(causal), _key_of(scale), _key_of(window_size), _key_of(softcap), _key_of(alibi_slopes),
           _key_of(sinks), _key_of(dropout_p), cupy.cuda.runtime.getDevice(), _array_key(q), _array_key(k),
           _array_key(v))  # fmt: skip
    extra = _variant_arrays(alibi_slopes, sinks)
    prep = _forward_cache.get(key)
    if prep is None:
        p = check_attention(q, k, v, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                            alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p)  # fmt: skip
        outputs = {"o": (q.shape, p.dtype), "lse": (q.shape[:-1], _FLOAT32)}
        prep = _prepare(p, kernel, {"q": q, "k": k, "v": v}, outputs, lambda f, p, g, lim: f.forward_plan(p, g, lim),
                        extra)  # fmt: skip
        _forward_cache[key] = prep
    p = prep.p
    o = cupy.empty(q.shape, dtype=p.dtype)
    lse = cupy.empty(q.shape[:-1], dtype=_FLOAT32)
    if prep.plan is None and o.size == 0:
        return o, lse
    if prep.plan is None:  # no key at all: every row is fully masked (its sink alone, if any, takes the softmax)
        o.fill(0)
        if sinks is None:
            lse.fill(-np.inf)
        else:
            lse[...] = sinks.reshape(-1, 1).astype(np.float32)
        return o, lse
    x = _inputs(prep, {"q": q, "k": k, "v": v})
    ptrs = {n: a.data.ptr for n, a in x.items()}
    ptrs.update({n: a.data.ptr for n, a in extra.items()})
    run(prep.plan, prep.geometry, {**ptrs, "o": o.data.ptr, "lse": lse.data.ptr}, _seed_of(p, dropout_seed))
    return o, lse


def _seed_of(p: AttentionProblem, seed: int | None) -> int | None:
    """The seed to write into the params: only with dropout, where one is required."""
    if not p.variant.dropout > 0:
        return None
    if seed is None:
        raise ValueError("dropout_seed is required when dropout_p > 0")
    return seed


def backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: Any, scale: Any, kernel: str,
             window_size: Any = None, softcap: Any = 0.0, alibi_slopes: Any = None, sinks: Any = None,
             dropout_p: Any = 0.0, dropout_seed: int | None = None, deterministic: bool = False):  # fmt: skip
    import cupy

    key = (kernel, _key_of(causal), _key_of(scale), _key_of(window_size), _key_of(softcap), _key_of(alibi_slopes),
           _key_of(sinks), _key_of(dropout_p), cupy.cuda.runtime.getDevice(),
           *(_array_key(x) for x in (do, q, k, v, o, lse)), bool(deterministic))  # fmt: skip
    extra = _variant_arrays(alibi_slopes, sinks)
    prep = _backward_cache.get(key)
    if prep is None:
        p = check_backward(do, q, k, v, o, lse, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p)  # fmt: skip
        outputs = {"dq": (q.shape, p.dtype), "dk": (k.shape, p.dtype), "dv": (v.shape, p.dtype)}
        inputs = {"dout": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}
        prep = _prepare(p, kernel, inputs, outputs,
                        lambda f, p, g, lim: f.backward_plan(p, g, lim, deterministic=bool(deterministic)), extra)
        _backward_cache[key] = prep
    p = prep.p
    dq = cupy.empty(q.shape, dtype=p.dtype)
    dk = cupy.empty(k.shape, dtype=p.dtype)
    dv = cupy.empty(v.shape, dtype=p.dtype)
    dsinks = None if sinks is None else cupy.zeros((p.hq,), dtype=_FLOAT32)
    grads = (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
    if prep.plan is None:
        for g in (dq, dk, dv):
            g.fill(0)
        if dsinks is not None and p.nq and p.batch_size:  # every row is its sink alone: P_sink = 1
            delta = (do.astype(np.float32) * o.astype(np.float32)).sum(axis=-1)
            dsinks[...] = -delta.reshape(-1, p.hq, p.nq).sum(axis=(0, 2))
        return grads
    x = _inputs(prep, {"dout": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    ptrs = {n: a.data.ptr for n, a in x.items()}
    ptrs.update({n: a.data.ptr for n, a in extra.items()})
    if dsinks is not None and not deterministic:
        ptrs["dsinks"] = dsinks.data.ptr
    run(prep.plan, prep.geometry, {**ptrs, "dq": dq.data.ptr, "dk": dk.data.ptr, "dv": dv.data.ptr},
        _seed_of(p, dropout_seed))
    if dsinks is not None and deterministic:  # the kernels' per-row atomics would add in any order
        dsinks[...] = _dsinks(do, o, lse, sinks, p.hq)
    return grads


def _dsinks(do: Any, o: Any, lse: Any, sinks: Any, hq: int) -> Any:
    """d sink_h = -sum over batch and rows of P_sink * Delta (P_sink = exp(sink_h - lse), 0 where lse = -inf),
    by CuPy's reductions, whose order is fixed."""
    import cupy

    delta = (do.astype(np.float32) * o.astype(np.float32)).sum(axis=-1)
    lse32 = lse.astype(np.float32)
    share = cupy.where(lse32 == -np.inf, np.float32(0), cupy.exp(sinks.reshape(-1, 1) - lse32)) * delta
    return -share.reshape(-1, hq, share.shape[-1]).sum(axis=(0, 2))


# ---------------------------------------------------------------------------- one family, given outputs


def _layout_of(arrays: dict[str, Any]) -> dict[str, tuple]:
    return {n: (x.shape, x.strides, x.itemsize, x.data.ptr % 16) for n, x in arrays.items()}


def forward_into(family: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, p: AttentionProblem, **options: Any) -> None:
    """Run ``family``'s forward into the given o and lse (no cache, no dispatch): how tests reach each
    family explicitly, and how benchmarks pass a tile configuration (``options``). The arrays must have
    a contiguous last dim; the family must support the call."""
    arrays = {"q": q, "k": k, "v": v, "o": o, "lse": lse}
    g = _geometry(p, _layout_of(arrays))
    if family.NEEDS_ALIGNED_ROWS and not g.aligned:
        raise ValueError(f"the {family.NAME} family needs 16-byte aligned rows")
    seed = options.pop("dropout_seed", None)
    run(family.forward_plan(p, g, DeviceLimits.current(), **options), g, {n: x.data.ptr for n, x in arrays.items()},
        _seed_of(p, seed))


def backward_into(
    family: Any, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, dq: Any, dk: Any, dv: Any, p: AttentionProblem,
    **options: Any,
) -> None:  # fmt: skip
    """Run ``family``'s backward into the given dq, dk, dv (see ``forward_into``)."""
    arrays = {"dout": do, "q": q, "k": k, "v": v, "o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    g = _geometry(p, _layout_of(arrays))
    if family.NEEDS_ALIGNED_ROWS and not g.aligned:
        raise ValueError(f"the {family.NAME} family needs 16-byte aligned rows")
    seed = options.pop("dropout_seed", None)
    run(family.backward_plan(p, g, DeviceLimits.current(), **options), g, {n: x.data.ptr for n, x in arrays.items()},
        _seed_of(p, seed))
