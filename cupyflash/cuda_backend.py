"""The CUDA host path: CuPy arrays in, kernels queued on the current device and stream, arrays out.

Everything a call does that depends only on its *signature* (array types, dtypes, shapes, strides, row
alignment, the keyword arguments, the device) is done once and cached: argument checks, the family
choice, the (B, H, N, D) views, the launch plans and the parameter bytes. A repeated call then costs a
dictionary lookup, its output allocations and one driver call per launch. The checks are functions of
the signature alone, so a cached signature has passed them; a new one runs them before anything is
allocated or launched.

Plain calls (every variant keyword at its default, kernel "auto": the common small call of issue 12) have a
shorter way in: ``api`` asks ``plain_forward`` / ``plain_backward`` first, which look the cached entry up by the
arrays' and causal/scale's part of the key alone and go straight to the outputs and the launch; a miss returns
None and the call takes the full path, which stores such entries (see ``_forward_cache``).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ._layout import views_of
from .kernels import dispatch
from .kernels.build import cupy_module
from .kernels.family import SCORE_ARRAYS, CallPlan, Geometry, Runner, run
from .plans import DeviceLimits
from .validation import AttentionProblem, check_attention, check_backward, score_shape

_FLOAT32 = np.dtype(np.float32)
_SCALARS = frozenset((type(None), bool, int, float, str))


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
    inner = {n: a[1][-1] // a[2] for n, a in arrays.items() if n in SCORE_ARRAYS}
    direct = "dbias" in arrays and owns_every_pair(*arrays["dbias"][:2])
    return Geometry(b, strides, offsets, _aligned(arrays), inner, direct)


def owns_every_pair(full: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Does a score-shaped array seen as ``full`` (its broadcast view: stride 0 where it broadcasts) give every
    (b, h, q, k) of the problem an element of its own? Then nothing sums into its elements (dbias is stored)."""
    return all(s != 0 or n == 1 for n, s in zip(full, strides))


def dbias_direct(bias_shape: tuple[int, ...], full: tuple[int, ...]) -> bool:
    """dbias of a bias of this shape is stored directly (in the bias's dtype): it has the problem's full shape."""
    return (1,) * (len(full) - len(bias_shape)) + tuple(bias_shape) == tuple(full)


def _aligned(arrays: dict[str, tuple[tuple[int, ...], tuple[int, ...], int, int]]) -> bool:
    """Every row of every array starts on a 16-byte boundary: aligned bases, and every stride but the
    last dim's (of a size > 1 axis) a multiple of 16 bytes. (lse rows are read one float at a time.)"""
    for name, (shape, strides, _, ptr_mod) in arrays.items():
        if name in ("lse", "alibi") or name in SCORE_ARRAYS:  # read one element at a time
            continue
        if ptr_mod:
            return False
        if any(n > 1 and s % 16 for n, s in zip(shape[:-1], strides[:-1])):
            return False
    return True


class _Prepared:
    """A checked signature: the problem, its family, its views, its launch plan, its outputs' layout and the plan's
    ``Runner`` for the call's pointer names. ``scratch_at``: where the plan's scratch sits in the outputs' one
    allocation (None: the runner takes it from the pool)."""

    __slots__ = ("p", "family", "geometry", "plan", "copy", "outputs", "run", "scratch_at")

    def __init__(self, p: AttentionProblem, family: Any, geometry: Geometry, plan: CallPlan | None,
                 copy: tuple[str, ...], outputs: tuple, run: Runner | None = None,
                 scratch_at: int | None = None):  # fmt: skip
        self.p, self.family, self.geometry, self.plan, self.copy = p, family, geometry, plan, copy
        self.outputs, self.run, self.scratch_at = outputs, run, scratch_at

    @property
    def plain(self) -> bool:
        """Can the plain calls' short path run it (``plain_forward``): a launch, and no input to copy first."""
        return self.plan is not None and not self.copy


#: A call whose outputs total at most this many bytes takes them from one pool allocation, viewed as arrays
#: (a view costs ~2 µs, a cupy.empty ~5 µs): tiny calls are bound by the host (issue 12). Their lifetimes are
#: then tied (the block is freed when the last of them goes), which at this size costs nothing.
SHARED_OUTPUT_BYTES = 1 << 20


def _output_layout(specs: list[tuple[tuple[int, ...], np.dtype]]) -> tuple:
    """(total bytes, ((shape, dtype, offset), ...)) with 256-byte aligned parts, or (None, specs) past the size."""
    at, parts = 0, []
    for shape, dt in specs:
        parts.append((shape, dt, at))
        at += -(-math.prod(shape) * dt.itemsize // 256) * 256
    return (at, tuple(parts)) if at <= SHARED_OUTPUT_BYTES else (None, tuple(specs))


def _with_scratch(layout: tuple, plan: CallPlan | None) -> tuple[tuple, int | None]:
    """The outputs' layout grown by the plan's scratch when both still fit one allocation, and the scratch's offset
    in it (one pool allocation a call instead of two; the scratch then lives as long as the outputs, which at this
    size costs nothing); else ``(layout, None)``."""
    total, parts = layout
    need = 0 if plan is None else plan.scratch_layout[0]
    if total is None or not need or total + need > SHARED_OUTPUT_BYTES:
        return layout, None
    return (total + need, parts), total  # total is a multiple of 256: the scratch's parts stay 256-byte aligned


def _empty_outputs(layout: tuple) -> list[Any]:
    """The outputs of a layout (``_output_layout``): views of one pool allocation (the first at its start), or each
    its own ``cupy.empty``."""
    cupy = cupy_module()
    total, parts = layout
    if total is None:
        return [cupy.empty(shape, dtype=dt) for shape, dt in parts]
    memory = cupy.cuda.alloc(max(total, 1))
    ndarray = cupy.ndarray  # memptr passed by position: CuPy's keyword path costs ~0.5 us more an array
    return [ndarray(shape, dt, memory + at if at else memory) for shape, dt, at in parts]


#: Prepared signatures. A key is ``(signature, rest)`` (``_forward_signature``, ``_forward_rest``); a plain call's
#: entry (every variant keyword at its default, kernel "auto": ``rest == _PLAIN_FORWARD``) is also stored under
#: its signature alone, which ``plain_forward`` looks up. Only a call that passed the checks is ever stored, and
#: clearing a cache clears both kinds of entry. Likewise the backward's.
_forward_cache: dict[tuple, _Prepared] = {}
_backward_cache: dict[tuple, _Prepared] = {}


def _device() -> int:
    return cupy_module().cuda.runtime.getDevice()


def _forward_signature(q: Any, k: Any, v: Any, qp: int, kp: int, vp: int, causal: Any, scale: Any,
                       device: int) -> tuple:  # fmt: skip
    """What the checks and plans read of the arguments every forward has, as one flat tuple: causal's and
    scale's types and values (True == 1 == 1.0 must not share a cache entry: the checks tell them apart), the
    device, and per array (base pointers qp, kp, vp) what ``_array_key`` takes."""
    return (type(causal), causal, type(scale), scale, device,
            type(q), q.dtype, q.shape, q.strides, qp % 16 == 0,
            type(k), k.dtype, k.shape, k.strides, kp % 16 == 0,
            type(v), v.dtype, v.shape, v.strides, vp % 16 == 0)  # fmt: skip


def _forward_rest(kernel: Any, window_size: Any, softcap: Any, alibi_slopes: Any, sinks: Any, mask: Any, bias: Any,
                  dropout_p: Any, mask_mod: Any, score_mod: Any, score_mod_grad: Any, aux: Any,
                  block_mask: Any) -> tuple:  # fmt: skip
    """The rest of a forward's signature: the kernel and the variant keywords (the dropout seed is not in it: it is
    checked per call and written into the params per call)."""
    return (kernel, _key_of(window_size), _key_of(softcap), _key_of(alibi_slopes), _key_of(sinks), _key_of(mask),
            _key_of(bias), _key_of(dropout_p), *_flex_key(mask_mod, score_mod, score_mod_grad, aux, block_mask))


def _backward_signature(q: Any, k: Any, v: Any, o: Any, lse: Any, do: Any, ptrs: tuple[int, ...], causal: Any,
                        scale: Any, device: int) -> tuple:  # fmt: skip
    """``_forward_signature`` of the backward's six arrays (``ptrs``: their base pointers, in this order: that of
    their pointer fields, ``_BACKWARD_INPUTS``)."""
    qp, kp, vp, op, lp, dop = ptrs
    return (type(causal), causal, type(scale), scale, device,
            type(q), q.dtype, q.shape, q.strides, qp % 16 == 0,
            type(k), k.dtype, k.shape, k.strides, kp % 16 == 0,
            type(v), v.dtype, v.shape, v.strides, vp % 16 == 0,
            type(o), o.dtype, o.shape, o.strides, op % 16 == 0,
            type(lse), lse.dtype, lse.shape, lse.strides, lp % 16 == 0,
            type(do), do.dtype, do.shape, do.strides, dop % 16 == 0)  # fmt: skip


#: The backward's input arrays by pointer field, in struct order (the order of its runner's first pointers).
_BACKWARD_INPUTS = ("q", "k", "v", "o", "lse", "dout")


def _backward_rest(kernel: Any, window_size: Any, softcap: Any, alibi_slopes: Any, sinks: Any, mask: Any, bias: Any,
                   bias_grad: Any, dropout_p: Any, deterministic: Any, mask_mod: Any, score_mod: Any,
                   score_mod_grad: Any, aux: Any, block_mask: Any) -> tuple:  # fmt: skip
    return (kernel, _key_of(window_size), _key_of(softcap), _key_of(alibi_slopes), _key_of(sinks), _key_of(mask),
            _key_of(bias), _key_of(bias_grad), _key_of(dropout_p), bool(deterministic),
            *_flex_key(mask_mod, score_mod, score_mod_grad, aux, block_mask))  # fmt: skip


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
    names: tuple[str, ...],
) -> _Prepared:
    """``names``: the pointer fields a call of this signature passes its runner, in its order."""
    limits = DeviceLimits.current()
    copy = tuple(n for n, x in inputs.items() if n != "lse" and _needs_copy(x))  # lse is read through its strides
    layout = {
        n: _layout_entry(x.shape, x.strides, x.itemsize, x.data.ptr % 16, n in copy) for n, x in inputs.items()
    }
    for n, (shape, dt) in outputs.items():
        layout[n] = (shape, _contiguous_strides(shape, dt.itemsize), dt.itemsize, 0)
    layout.update(_extra_layout(p, extra, layout))
    g = _geometry(p, layout)
    family = dispatch.select(p, limits, kernel, g.aligned)  # raises before anything is allocated
    empty = p.nq == 0 or p.nk == 0 or p.batch_size == 0 or p.hq == 0  # answered without a launch
    plan = None if empty else _flex_plan(p, make_plan(family, p, g, limits))
    layout = _output_layout([spec for n, spec in outputs.items() if n != "dbias"])  # dbias: zeroed, apart
    layout, scratch_at = _with_scratch(layout, plan)
    return _Prepared(p, family, g, plan, copy, layout, None if plan is None else plan.runner(g, names), scratch_at)


def _flex_check(p: AttentionProblem) -> None:
    """User snippets (issue 17 part 3) must be C++ text here, and compile (SnippetError before any launch)."""
    spec = p.variant.flex
    if spec is None:
        return
    from .flex import FlexSpec, check

    if not isinstance(spec, FlexSpec):
        raise TypeError("with CuPy arrays mask_mod/score_mod/score_mod_grad are CUDA C++ snippets (str); Python "
                        "callables are the NumPy reference's twins")  # fmt: skip
    check(spec)


def _flex_plan(p: AttentionProblem, plan: CallPlan) -> CallPlan:
    """A plan whose user-policy launches compile from the snippets' generated source."""
    if p.variant.flex is None:
        return plan
    from .flex import retarget

    return retarget(plan, p.variant.flex)


def _inputs(prep: _Prepared, arrays: dict[str, Any]) -> dict[str, Any]:
    if not prep.copy:
        return arrays
    import cupy

    return {n: (cupy.ascontiguousarray(x) if n in prep.copy else x) for n, x in arrays.items()}


def _key_of(x: Any) -> Any:
    """A hashable stand-in for a keyword argument: arrays by their signature, lists as tuples, and
    always the type (True == 1 == 1.0 must not share a cache entry: the checks tell them apart)."""
    t = type(x)
    if t in _SCALARS:  # the common case first: a call's keywords are mostly None, bools and numbers
        return (t, x)
    if hasattr(x, "data") and hasattr(x, "strides"):
        return _array_key(x)
    if isinstance(x, list):
        return (list, tuple(_key_of(e) for e in x))
    if isinstance(x, tuple):
        return (tuple, tuple(_key_of(e) for e in x))
    if isinstance(x, dict):  # aux: names in order, arrays by signature, scalars by type and value
        return (dict, tuple((n, _key_of(e)) for n, e in x.items()))
    return (type(x), x)


def _extra_layout(p: AttentionProblem, extra: dict[str, Any], layout: dict[str, tuple]) -> dict[str, tuple]:
    """Layout entries of the variant arrays: ALiBi slopes as a per-head view (sinks, one (Hq,) vector for every
    batch, need none), masks and biases (and a dbias accumulator already in ``layout``) as the full score shape
    they broadcast to."""
    out = {}
    if "alibi" in extra:
        out["alibi"] = _head_layout(extra["alibi"], len(p.batch))
    for name in SCORE_ARRAYS:
        if name in extra:
            x = extra[name]
            out[name] = _score_layout(x.shape, x.strides, x.itemsize, x.data.ptr % 16, score_shape(p))
        elif name in layout:
            out[name] = _score_layout(*layout[name], score_shape(p))
    return out


def _score_layout(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, ptr_mod: int,
                  full: tuple[int, ...]) -> tuple:  # fmt: skip
    """A mask or bias seen as the (*batch, Hq, Nq, Nk) array it broadcasts to: stride 0 along every dim it
    broadcasts along (NumPy's rule), its own strides elsewhere. Nothing is expanded or copied."""
    pad = len(full) - len(shape)
    shape, strides = (1,) * pad + tuple(shape), (0,) * pad + tuple(strides)
    bstrides = tuple(0 if n == 1 else s for n, s in zip(shape, strides))
    return full, bstrides, itemsize, ptr_mod


def _flex_key(mask_mod: Any, score_mod: Any, score_mod_grad: Any, aux: Any, block_mask: Any) -> tuple:
    """The user snippets' part of a call's signature (empty without them, so plain keys stay as they were)."""
    if mask_mod is None and score_mod is None and score_mod_grad is None and aux is None and block_mask is None:
        return ()
    return (_key_of(mask_mod), _key_of(score_mod), _key_of(score_mod_grad), _key_of(aux), _key_of(block_mask))


def _variant_arrays(alibi_slopes: Any, sinks: Any, mask: Any = None, bias: Any = None, aux: Any = None,
                    block_mask: Any = None) -> dict[str, Any]:  # fmt: skip
    out = {}
    if aux:
        from .flex import aux_arrays

        out.update(aux_arrays(aux))
    if block_mask is not None:
        out.update(block_mask.pointers())
    if mask is not None:
        out["mask"] = mask
    if bias is not None:
        out["bias"] = bias
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


#: The rest of a plain call's signature: ``api.attention_forward``'s / ``attention_backward``'s defaults.
_PLAIN_FORWARD = _forward_rest("auto", None, 0.0, None, None, None, None, 0.0, None, None, None, None, None)
_PLAIN_BACKWARD = _backward_rest("auto", None, 0.0, None, None, None, None, False, 0.0, False, None, None, None, None,
                                 None)  # fmt: skip


def plain_forward(q: Any, k: Any, v: Any, causal: Any, scale: Any) -> tuple[Any, Any] | None:
    """The forward of a plain call (``api.attention_forward`` with every variant keyword at its default and
    kernel "auto") whose signature is cached: (o, lse); None when it is not (or q, k, v are not arrays with
    device pointers), and the caller then takes the full path, ``forward``.

    Why it is the full path's answer: an entry is stored under the signature alone only by ``forward``, after
    the call passed its checks, for ``rest == _PLAIN_FORWARD`` (the keywords' defaults), so the key this looks up
    is the full path's key minus the part that the caller's test of the defaults fixes. Nothing a plain call
    checks depends on values outside the signature: the dropout seed is None (no dropout)."""
    try:
        qp, kp, vp = q.data.ptr, k.data.ptr, v.data.ptr
        prep = _forward_cache.get(_forward_signature(q, k, v, qp, kp, vp, causal, scale, _device()))
    except Exception:  # not CuPy arrays (NumPy's .data may raise), an unhashable causal or scale: the full path tells
        return None
    if prep is None:
        return None
    o, lse = _empty_outputs(prep.outputs)
    prep.run((qp, kp, vp, o.data.ptr, lse.data.ptr))
    return o, lse


def forward(q: Any, k: Any, v: Any, causal: Any, scale: Any, kernel: str, window_size: Any = None,
            softcap: Any = 0.0, alibi_slopes: Any = None, sinks: Any = None, mask: Any = None,
            bias: Any = None, dropout_p: Any = 0.0, dropout_seed: int | None = None, mask_mod: Any = None,
            score_mod: Any = None, score_mod_grad: Any = None, aux: Any = None,
            block_mask: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """``dropout_seed`` is checked by the caller and not part of the signature: it is written per call."""
    rest = _forward_rest(kernel, window_size, softcap, alibi_slopes, sinks, mask, bias, dropout_p, mask_mod,
                         score_mod, score_mod_grad, aux, block_mask)  # fmt: skip
    try:
        signature = _forward_signature(q, k, v, q.data.ptr, k.data.ptr, v.data.ptr, causal, scale, _device())
        key: tuple | None = (signature, rest)
        prep = _forward_cache.get(key)
    except Exception:  # not CuPy arrays (NumPy's .data may raise), an unhashable keyword...: the checks say why
        key = prep = None
    extra = _variant_arrays(alibi_slopes, sinks, mask, bias, aux, block_mask)
    if prep is None:
        p = check_attention(q, k, v, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                            alibi_slopes=alibi_slopes, sinks=sinks, mask=mask, bias=bias,
                            dropout_p=dropout_p, mask_mod=mask_mod, score_mod=score_mod, score_mod_grad=score_mod_grad,
                            aux=aux, block_mask=block_mask)  # fmt: skip
        _flex_check(p)
        outputs = {"o": (q.shape, p.dtype), "lse": (q.shape[:-1], _FLOAT32)}
        prep = _prepare(p, kernel, {"q": q, "k": k, "v": v}, outputs, lambda f, p, g, lim: f.forward_plan(p, g, lim),
                        extra, ("q", "k", "v", "o", "lse", *extra))  # fmt: skip
        if key is not None:
            _forward_cache[key] = prep
            if rest == _PLAIN_FORWARD and prep.plain:
                _forward_cache[key[0]] = prep
    p = prep.p
    o, lse = _empty_outputs(prep.outputs)
    if prep.plan is None and o.size == 0:
        return o, lse
    if prep.plan is None:  # no key at all: every row is fully masked (its sink alone, if any, takes the softmax)
        o.fill(0)
        if sinks is None:
            lse.fill(-np.inf)
        else:
            lse[...] = sinks.reshape(-1, 1).astype(np.float32)
        return o, lse
    if prep.copy:
        q, k, v = _inputs(prep, {"q": q, "k": k, "v": v}).values()
    prep.run((q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, *[a.data.ptr for a in extra.values()]),
             _seed_of(p, dropout_seed))
    return o, lse


def _seed_of(p: AttentionProblem, seed: int | None) -> int | None:
    """The seed to write into the params: only with dropout, where one is required."""
    if not p.variant.dropout > 0:
        return None
    if seed is None:
        raise ValueError("dropout_seed is required when dropout_p > 0")
    return seed


def plain_backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: Any, scale: Any) -> tuple | None:
    """``plain_forward``'s twin for ``api.attention_backward`` (also ``bias_grad=False``, ``deterministic=False``):
    (dq, dk, dv) of a cached plain signature, else None."""
    try:
        ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, do.data.ptr)  # _BACKWARD_INPUTS
        prep = _backward_cache.get(_backward_signature(q, k, v, o, lse, do, ptrs, causal, scale, _device()))
    except Exception:  # as in plain_forward
        return None
    if prep is None:
        return None
    dq, dk, dv = grads = _empty_outputs(prep.outputs)
    dqp = dq.data.ptr
    prep.run((*ptrs, dqp, dk.data.ptr, dv.data.ptr), None, None if prep.scratch_at is None else dqp + prep.scratch_at)
    return tuple(grads)


def backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, causal: Any, scale: Any, kernel: str,
             window_size: Any = None, softcap: Any = 0.0, alibi_slopes: Any = None, sinks: Any = None,
             mask: Any = None, bias: Any = None, bias_grad: Any = False, dropout_p: Any = 0.0,
             dropout_seed: int | None = None, deterministic: bool = False, mask_mod: Any = None,
             score_mod: Any = None, score_mod_grad: Any = None, aux: Any = None, block_mask: Any = None):  # fmt: skip
    """``dropout_seed`` and ``deterministic`` are checked by the caller."""
    import cupy

    if deterministic and block_mask is not None:  # ordered dQ turns assume every mask's key tiles form one run
        raise NotImplementedError("deterministic=True with block_mask is not supported yet: the ordered dQ turns "
                                  "assume the key tiles that visit a query tile form one run (built-in masks)")
    if deterministic and bias_grad and not _stores_dbias(q, k, bias):  # (ArrayScore.add_dbias)
        raise NotImplementedError("deterministic=True with bias_grad=True is not supported yet for a broadcast bias: "
                                  "its dbias is accumulated with float atomics, whose order varies from run to run "
                                  "(a bias of the full (*batch, Hq, Nq, Nk) shape is stored, and reproducible)")  # fmt: skip

    rest = _backward_rest(kernel, window_size, softcap, alibi_slopes, sinks, mask, bias, bias_grad, dropout_p,
                          deterministic, mask_mod, score_mod, score_mod_grad, aux, block_mask)  # fmt: skip
    try:
        ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, do.data.ptr)  # _BACKWARD_INPUTS
        signature = _backward_signature(q, k, v, o, lse, do, ptrs, causal, scale, _device())
        key: tuple | None = (signature, rest)
        prep = _backward_cache.get(key)
    except Exception:  # not CuPy arrays (NumPy's .data may raise), an unhashable keyword...: the checks say why
        key = prep = None
    extra = _variant_arrays(alibi_slopes, sinks, mask, bias, aux, block_mask)
    kernel_dsinks = sinks is not None and not deterministic  # the kernels' per-row atomics would add in any order
    if prep is None:
        p = check_backward(do, q, k, v, o, lse, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks, mask=mask, bias=bias,
                           bias_grad=bias_grad, dropout_p=dropout_p, mask_mod=mask_mod, score_mod=score_mod,
                           score_mod_grad=score_mod_grad, aux=aux, block_mask=block_mask)  # fmt: skip
        _flex_check(p)
        outputs = {"dq": (q.shape, p.dtype), "dk": (k.shape, p.dtype), "dv": (v.shape, p.dtype)}
        if bias_grad:  # contiguous in the bias's own shape (broadcast dims: stride 0), see _dbias_buffer
            direct = dbias_direct(bias.shape, score_shape(p))
            outputs["dbias"] = (bias.shape, np.dtype(bias.dtype) if direct else _FLOAT32)
        inputs = {"dout": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}
        # Pointer names in struct order as far as a plain call has them (the runner then packs them as given).
        names = (*_BACKWARD_INPUTS, "dq", "dk", "dv", *extra, *(("dsinks",) if kernel_dsinks else ()),
                 *(("dbias",) if bias_grad else ()))  # fmt: skip
        prep = _prepare(p, kernel, inputs, outputs,
                        lambda f, p, g, lim: f.backward_plan(p, g, lim, deterministic=bool(deterministic)), extra,
                        names)  # fmt: skip
        if key is not None:
            _backward_cache[key] = prep
            if rest == _PLAIN_BACKWARD and prep.plain:
                _backward_cache[key[0]] = prep
    p = prep.p
    dq, dk, dv = _empty_outputs(prep.outputs)
    dsinks = None if sinks is None else cupy.zeros((p.hq,), dtype=_FLOAT32)
    grads = (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
    dbias = _dbias_buffer(bias, p, prep.geometry.dbias_direct) if bias_grad else None
    if prep.plan is None:
        for g in (dq, dk, dv, *(() if dbias is None else (dbias,))):
            g.fill(0)
        if dsinks is not None and p.nq and p.batch_size:  # every row is its sink alone: P_sink = 1
            delta = (do.astype(np.float32) * o.astype(np.float32)).sum(axis=-1)
            dsinks[...] = -delta.reshape(-1, p.hq, p.nq).sum(axis=(0, 2))
        return grads if dbias is None else (*grads, dbias.astype(bias.dtype, copy=False))
    x = _inputs(prep, dict(zip(_BACKWARD_INPUTS, (q, k, v, o, lse, do))))
    dqp = dq.data.ptr
    values = (*[a.data.ptr for a in x.values()], dqp, dk.data.ptr, dv.data.ptr,
              *[a.data.ptr for a in extra.values()], *((dsinks.data.ptr,) if kernel_dsinks else ()),
              *((dbias.data.ptr,) if dbias is not None else ()))  # fmt: skip
    prep.run(values, _seed_of(p, dropout_seed), None if prep.scratch_at is None else dqp + prep.scratch_at)
    if dsinks is not None and deterministic:  # the kernels' per-row atomics would add in any order
        dsinks[...] = _dsinks(do, o, lse, sinks, p.hq)
    return grads if dbias is None else (*grads, dbias.astype(bias.dtype, copy=False))


def _stores_dbias(q: Any, k: Any, bias: Any) -> bool:
    """Before any check: would this bias's gradient be stored (not summed by atomics)? (False when the shapes are
    wrong: the checks then say why.)"""
    if bias is None or q.ndim < 3 or k.ndim < 3:
        return False
    return dbias_direct(tuple(bias.shape), (*q.shape[:-3], q.shape[-3], q.shape[-2], k.shape[-2]))


def _dbias_buffer(bias: Any, p: AttentionProblem, direct: bool) -> Any:
    """What the kernels write dbias into. Direct (every pair owns its element): the output itself in the bias's
    dtype, zeroed only where the built-in mask skips whole tiles (their pairs are never visited; every pair of a
    visited tile is stored, zeros included). Else a zeroed float32 accumulator that atomics add into (converted
    to the bias's dtype afterwards)."""
    import cupy

    if not direct:
        return cupy.zeros(bias.shape, dtype=_FLOAT32)
    skips_tiles = p.variant.causal or p.variant.window is not None
    return (cupy.zeros if skips_tiles else cupy.empty)(bias.shape, dtype=bias.dtype)


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


def forward_into(family: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, p: AttentionProblem,
                 variant_arrays: dict[str, Any] | None = None, **options: Any) -> None:  # fmt: skip
    """Run ``family``'s forward into the given o and lse (no cache, no dispatch): how tests reach each
    family explicitly, and how benchmarks pass a tile configuration (``options``). The arrays must have
    a contiguous last dim; the family must support the call. ``variant_arrays``: the params' variant arrays
    by field name (alibi, sinks, mask, bias) that ``p.variant`` says the call has."""
    arrays = {"q": q, "k": k, "v": v, "o": o, "lse": lse}
    _run_into(family, "forward_plan", arrays, p, variant_arrays or {}, options)


def _run_into(family: Any, plan_of: str, arrays: dict[str, Any], p: AttentionProblem, extra: dict[str, Any],
              options: dict[str, Any]) -> None:  # fmt: skip
    layout = _layout_of(arrays)
    layout.update(_extra_layout(p, extra, layout))
    g = _geometry(p, layout)
    if family.NEEDS_ALIGNED_ROWS and not g.aligned:
        raise ValueError(f"the {family.NAME} family needs 16-byte aligned rows")
    _flex_check(p)
    if "dbias" in extra:
        _check_dbias_buffer(extra["dbias"], extra.get("bias"), g.dbias_direct)
    seed = options.pop("dropout_seed", None)
    ptrs = {n: x.data.ptr for n, x in {**arrays, **extra}.items()}
    plan = _flex_plan(p, getattr(family, plan_of)(p, g, DeviceLimits.current(), **options))
    run(plan, g, ptrs, _seed_of(p, seed))


def _check_dbias_buffer(dbias: Any, bias: Any, direct: bool) -> None:
    """A caller's dbias buffer must be what the kernels will write (see _dbias_buffer): the bias's dtype when it
    has the problem's full shape, float32 (an accumulator, zeroed by the caller) when it broadcasts."""
    if bias is None:
        raise ValueError("dbias needs a bias")
    want = np.dtype(bias.dtype) if direct else _FLOAT32
    if np.dtype(dbias.dtype) != want or tuple(dbias.shape) != tuple(bias.shape):
        kind = "full-shape bias: the gradient itself" if direct else "broadcast bias: a float32 accumulator"
        raise ValueError(f"dbias must have shape {tuple(bias.shape)} and dtype {want} ({kind}); "
                         f"got {tuple(dbias.shape)} {dbias.dtype}")  # fmt: skip


def backward_into(
    family: Any, do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, dq: Any, dk: Any, dv: Any, p: AttentionProblem,
    variant_arrays: dict[str, Any] | None = None, **options: Any,
) -> None:  # fmt: skip
    """Run ``family``'s backward into the given dq, dk, dv (see ``forward_into``); ``variant_arrays`` may also
    hold the gradients' buffers: dsinks (float32, zeroed by the caller) and dbias (the bias's shape; the bias's
    dtype when it has the full (*batch, Hq, Nq, Nk) shape, which every visited pair is stored into, else a
    float32 accumulator zeroed by the caller; see _dbias_buffer)."""
    arrays = {"dout": do, "q": q, "k": k, "v": v, "o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
    _run_into(family, "backward_plan", arrays, p, variant_arrays or {}, options)
