"""Inference: attention against a KV cache with in-place append (contiguous or paged caches, split-KV), and
the log-sum-exp merge of partial attention results. The array type picks the backend as elsewhere: CuPy
arrays run cuda_src/decode.cu, NumPy arrays run ``kvcache_reference`` (float64, rounded once)."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from . import cuda_backend, kvcache_reference  # cuda_backend imports CuPy only when a call needs it
from .kvcache_validation import KVCacheProblem, check_kvcache, check_merge, check_values
from .variants import LOG2E

_FLOAT32 = np.dtype(np.float32)


def merge_attention_states(o_parts: Any, lse_parts: Any) -> tuple[Any, Any]:
    """Combine attention results over disjoint key sets by their log-sum-exp.

    Args:
        o_parts: ``(P, ..., D)``: part p's softmax-normalised output over its keys (float32, float16 or
            bfloat16).
        lse_parts: float32 ``(P, ...)``: part p's log-sum-exp (natural log); ``-inf`` for a part that saw
            no key, which then weighs nothing.

    Returns:
        ``o`` ``(..., D)`` in o_parts' dtype and ``lse`` float32 ``(...)``: exactly the attention over the
        union of the keys (``o = sum_p exp(lse_p - lse) o_p``, ``lse = log sum_p exp(lse_p)``); a row whose
        parts are all ``-inf`` gives ``o = 0``, ``lse = -inf``. As FlashInfer's ``merge_state`` and
        FlashAttention's split-KV combine: for split-KV decode, cascade (shared-prefix) attention and
        context parallelism.
    """
    p = check_merge(o_parts, lse_parts)
    if p.xp == "numpy":
        o, lse = kvcache_reference.merge_attention_states(o_parts, lse_parts)
        return o.astype(p.dtype), lse.astype(np.float32)
    import cupy

    from .kernels import decode

    d = p.shape[-1]
    rows = int(np.prod(p.shape[:-1]))
    o = cupy.empty(p.shape, dtype=p.dtype)
    lse = cupy.empty(p.shape[:-1], dtype=_FLOAT32)
    if o.size == 0:
        return o, lse
    decode.launch_merge(cupy.ascontiguousarray(o_parts), cupy.ascontiguousarray(lse_parts), o, lse, None, rows,
                        p.parts, d)  # fmt: skip
    return o, lse


def attention_with_kvcache(
    q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *, cache_seqlens: Any, block_table: Any = None,
    cache_batch_idx: Any = None, causal: bool = False, scale: float | None = None,
    window_size: tuple[int, int] | None = None, softcap: float = 0.0, alibi_slopes: Any = None, sinks: Any = None,
    rotary_cos: Any = None, rotary_sin: Any = None, rotary_interleaved: bool = False, num_splits: int = 0,
    kernel: str = "auto", validate: bool = False,
) -> tuple[Any, Any]:  # fmt: skip
    """Attention of new query rows against a KV cache, appending new keys/values in place first (decode).

    Args:
        q: ``(B, Hq, Nq, D)``: Nq = 1 for decoding, a few for speculative decoding.
        k_cache, v_cache: contiguous ``(B_cache, Hk, S, D)`` (strided views of ``(B_cache, S, Hk, D)`` storage
            work without a copy), or, with ``block_table``, paged ``(num_pages, Hk, page_size, D)`` with
            ``page_size`` in 1..256. Same dtype as q; the last dim contiguous (they are written in place).
        k, v: ``(B, Hk, Nnew, D)`` or None: written into the caches at positions ``cache_seqlens[b] ..
            cache_seqlens[b] + Nnew - 1`` of each sequence (no other slot is touched), before attention.
        cache_seqlens: int32 ``(B,)`` or a Python int: keys each sequence holds before this call. Attention
            runs over ``cache_seqlens[b] + Nnew`` keys.
        block_table: int32 ``(B, max_pages_per_seq)``: page of each run of page_size keys (paged caches).
        cache_batch_idx: int32 ``(B,)``: the cache row of each batch row (contiguous caches; default b).
        causal: key j hidden from query i when ``j > i + Nk_b - Nq`` (bottom-right aligned, Nk_b =
            cache_seqlens[b] + Nnew). window_size, softcap, alibi_slopes (``(Hq,)`` or ``(B, Hq)``), sinks
            (``(Hq,)``): as in ``attention_forward``, with Nk = Nk_b.
        rotary_cos, rotary_sin: float32 ``(seqlen_ro, rotary_dim / 2)`` with seqlen_ro >= the cache's capacity:
            rotary embedding of the first rotary_dim dims of the new keys (at their positions cache_seqlens[b] + i,
            before they are written) and of q (row i at cache_seqlens[b] + i under causal or a window, else every
            row at cache_seqlens[b]: FlashAttention's rule). rotary_interleaved: pairs (2j, 2j + 1) (GPT-J)
            instead of halves (j, j + rotary_dim / 2) (GPT-NeoX).
        num_splits: key-range splits of the CUDA kernel (0: automatic, 1: none); the result does not depend
            on it beyond rounding.
        kernel: the CUDA decode kernel: ``"auto"`` (tensor cores for float16/bfloat16 caches, FMA units for
            float32), ``"mma"`` (tensor cores; 16-bit dtypes only) or ``"fma"`` (the float32-arithmetic kernel,
            any dtype: a reference point for tests and benchmarks). NumPy arrays take only ``"auto"``.
        validate: check the contents of cache_seqlens, block_table and cache_batch_idx (one device-to-host
            copy) and raise ValueError for an out-of-range value. Without it, values are the caller's
            contract (as in FlashAttention): out-of-range ones give wrong results but never an access outside
            the arrays (the kernels clamp every index).

    Returns:
        ``o`` (q's shape and dtype) and ``lse`` (float32 ``(B, Hq, Nq)``, natural log).

    Forward only. Everything the CUDA path allocates is sized from the shapes alone and it never
    synchronises with the host (without ``validate``), so a decode step can be captured in a CUDA graph.
    """
    # The arrays in the order _launch takes them.
    arrays = (q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_batch_idx, alibi_slopes, sinks,
              rotary_cos, rotary_sin)  # fmt: skip
    key = None
    if not validate:
        key = _signature(arrays, (causal, scale, window_size, softcap, rotary_interleaved, num_splits, kernel))
        prep = None if key is None else _prepared.get(key)
        if prep is not None:  # a CuPy call whose signature passed the checks before
            if prep.p.seqlen_const is not None:
                _check_seqlen_const(prep.p, cache_seqlens)
            return _launch(prep, *arrays)
    keywords = dict(cache_seqlens=cache_seqlens, block_table=block_table, cache_batch_idx=cache_batch_idx,
                    causal=causal, scale=scale, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                    sinks=sinks, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
                    num_splits=num_splits, kernel=kernel)  # fmt: skip
    p = check_kvcache(q, k_cache, v_cache, k, v, **keywords)
    if validate:
        check_values(p, cache_seqlens, block_table, cache_batch_idx)
    if p.xp == "numpy":
        o, lse = kvcache_reference.attention_with_kvcache(q, k_cache, v_cache, k, v, **keywords)
        return o.astype(p.dtype), lse.astype(np.float32)
    prep = _prepare(p, dict(zip(ARRAY_NAMES, arrays)), int(num_splits), kernel)
    if key is not None:
        _prepared[key] = prep
    return _launch(prep, *arrays)


# ---------------------------------------------------------------------------- the CUDA path


def _elems(x: Any) -> tuple[int, int, int]:
    return tuple(int(s) // x.itemsize for s in x.strides[:3])  # type: ignore[return-value]


def _rows_aligned(x: Any) -> bool:
    return x.data.ptr % 16 == 0 and all(n <= 1 or s % 16 == 0 for n, s in zip(x.shape[:3], x.strides[:3]))


#: The arrays of a call, in the order ``_launch`` takes them (``alibi`` is ``alibi_slopes``).
ARRAY_NAMES = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "cache_batch_idx", "alibi",
               "sinks", "rotary_cos", "rotary_sin")  # fmt: skip

#: Pointers written per call into the append and decode launches' DecodeParams, in struct order (each of the
#: PointerWriter's runs is then a slice of the values): CALL_POINTERS, ROTARY_POINTERS with rotary, SPLIT_POINTERS.
CALL_POINTERS = ("attn.q", "attn.o", "attn.lse", "attn.alibi", "attn.sinks", "k_new", "v_new", "k_cache", "v_cache",
                 "cache_seqlens", "block_table", "cache_batch_idx", "o_part", "lse_part")  # fmt: skip
ROTARY_POINTERS = ("rotary_cos", "rotary_sin", "q_rot")
SPLIT_POINTERS = ("split_count",)

_workspace: dict[tuple, tuple[Any, Any, Any]] = {}


class _Prepared:
    """A checked signature made ready for repeated calls: the problem, its plan, the static DecodeParams bytes,
    the output layout, and the launches (``build.Launch``, each with its own argument buffer) whose pointers are
    written in place per call. Split partials are merged inside the decode launch (its last block per row chunk),
    so a call queues at most three kernels (rotate, append, decode). The split-KV workspace is looked up once per
    stream."""

    __slots__ = ("p", "plan", "record", "rotate", "append", "decode", "pointers", "write_const", "workspace",
                 "outputs")  # fmt: skip

    def __init__(self, p: KVCacheProblem, plan: Any, record: np.ndarray):
        from .kernels import build, decode

        self.p, self.plan, self.record = p, plan, record
        rotary = plan.rotate_q is not None
        names = CALL_POINTERS + (ROTARY_POINTERS if rotary else ()) + SPLIT_POINTERS
        self.pointers = decode.PointerWriter(names)
        self.write_const = decode.write_seqlen_const  # an int cache_seqlens, per call
        self.rotate = self.append = None
        base = record.tobytes()
        if rotary:  # rotate_q reads q as given; the decode kernel reads the rotated dense copy
            self.rotate = build.Launch(plan.rotate_q, base)
            dense = record.copy()
            dense["attn"]["q_s"] = (p.hq * p.nq * p.d, p.nq * p.d, p.d)
            base = dense.tobytes()
        if plan.append is not None:
            self.append = build.Launch(plan.append, base)
        self.decode = build.Launch(plan.decode, base)
        # o, lse (and rotary's q_rot) from one pool allocation when small: the host path of a decode step counts
        shape = (p.batch, p.hq, p.nq, p.d)
        specs = [(shape, p.dtype), (shape[:3], _FLOAT32)] + ([(shape, p.dtype)] if rotary else [])
        self.outputs = cuda_backend._output_layout(specs)
        self.workspace: dict[int, tuple[int, int, int, Any]] = {}  # stream -> (o_part, lse_part, split_count, arrays)

    def workspace_for(self, stream: int) -> tuple[int, int, int]:
        """The split-KV partials' and arrival counters' pointers on ``stream`` (zeros without splits): static size,
        cached per device, stream and shape, so a captured CUDA graph keeps using the same memory. The counters
        start at zero and every launch leaves them at zero (the merging block resets its own), so they are shared
        by the calls queued on one stream one after another."""
        got = self.workspace.get(stream)
        if got is None:
            if self.plan.splits == 1:
                got = (0, 0, 0, None)
            else:
                import cupy

                pl, rows = self.plan, self.p.batch * self.p.hq * self.p.nq
                chunks = self.p.batch * self.p.hk * pl.m_chunks
                wkey = (cupy.cuda.runtime.getDevice(), stream, pl.splits, rows, self.p.d, chunks)
                ws = _workspace.get(wkey)
                if ws is None:
                    ws = _workspace[wkey] = (cupy.empty((pl.splits, rows, self.p.d), _FLOAT32),
                                             cupy.empty((pl.splits, rows), _FLOAT32),
                                             cupy.zeros((chunks,), np.int32))  # fmt: skip
                got = (ws[0].data.ptr, ws[1].data.ptr, ws[2].data.ptr, ws)
            self.workspace[stream] = got
        return got[0], got[1], got[2]


_prepared: dict[tuple, _Prepared] = {}

# A signature's launches share their argument buffers: one thread writes and queues them at a time.
_launching = threading.Lock()


def _signature(arrays: tuple, scalars: tuple) -> tuple | None:
    """Everything the checks and the plan read (dtypes, shapes, strides, alignment, keyword values, the device), or
    None for calls that are not all CuPy arrays (not cached: NumPy calls, and subclasses of cupy.ndarray, which take
    the checked path every time). ``arrays`` in ``ARRAY_NAMES`` order, ``scalars`` = (causal, scale, window_size,
    softcap, rotary_interleaved, num_splits, kernel). An int cache_seqlens enters by kind only: its value is
    range-checked per call, so a decode loop does not grow the cache. Written out for a decode step's host time:
    _array_key's fields less the type, which ``type(x) is ndarray`` fixes."""
    q = arrays[0]
    if isinstance(q, np.ndarray) or not hasattr(q, "data"):  # before CuPy is imported: NumPy needs none
        return None
    cupy = cuda_backend.cupy_module()
    ndarray, key_of = cupy.ndarray, cuda_backend._key_of
    keys: list[Any] = [None]  # the device, once every array is known to be CuPy's
    add = keys.append
    for i, x in enumerate(arrays):
        if x is None:
            add(None)
        elif type(x) is ndarray:
            add((x.dtype, x.shape, x.strides, x.data.ptr % 16 == 0))
        elif i == 5 and isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
            add("int")
        else:
            return None
    for x in scalars:
        add(key_of(x))
    keys[0] = cupy.cuda.runtime.getDevice()
    return tuple(keys)


def _check_seqlen_const(p: KVCacheProblem, s: Any) -> None:
    if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or not 0 <= s <= p.capacity - p.n_new:
        raise ValueError(f"cache_seqlens = {s!r} must be in 0..{p.capacity - p.n_new} (cache of {p.capacity} keys, "
                         f"{p.n_new} new)")  # fmt: skip


def _prepare(p: KVCacheProblem, arrays: dict[str, Any], num_splits: int, kernel: str = "auto") -> _Prepared:
    """The static part of a call: plan, DecodeParams without pointers, and the launches made ready (raises for what
    the kernel cannot run)."""
    from .kernels import decode
    from .plans import DeviceLimits

    q, k_cache, v_cache, k = arrays["q"], arrays["k_cache"], arrays["v_cache"], arrays["k"]
    reason = decode.unsupported(p)
    if reason is None and not (_rows_aligned(k_cache) and _rows_aligned(v_cache)):
        reason = "the decode kernel reads 16-byte rows: k_cache/v_cache need 16-byte aligned rows (base and strides)"
    if reason is not None:
        raise ValueError(reason)
    plan = decode.plan(p, DeviceLimits.current(), num_splits, kernel)
    rec = np.zeros((), decode.DECODE_PARAMS)
    a = rec["attn"]
    a["q_s"] = _elems(q)
    a["o_s"] = (p.hq * p.nq * p.d, p.nq * p.d, p.d)  # o is allocated dense
    a["lse_s"] = (p.hq * p.nq, p.nq, 1)
    for name, value in dict(rows=p.batch * p.hq * p.nq, batch=p.batch, hq=p.hq, hk=p.hk, group=p.group, nq=p.nq,
                            nk=p.capacity, d=p.d, scale=p.scale, scale_log2=p.scale * LOG2E, heads_fastest=1, vec=1,
                            **p.variant.params(p.scale, p.nq, p.capacity)).items():  # fmt: skip
        a[name] = value
    alibi = arrays["alibi"]
    if alibi is not None:
        a["alibi_sb"] = p.hq if alibi.ndim == 2 else 0
    rec["kc_s"], rec["vc_s"] = _elems(k_cache), _elems(v_cache)
    if k is not None:
        rec["kn_s"], rec["vn_s"] = _elems(k), _elems(arrays["v"])
    if arrays["block_table"] is not None:
        rec["bt_stride"] = arrays["block_table"].strides[0] // 4
    for name, value in dict(n_new=p.n_new, page_size=p.page_size, num_pages=p.num_pages,
                            pages_per_seq=p.pages_per_seq, m_rows=p.group * p.nq, rotary_dim=p.rotary_dim,
                            rotary_interleaved=int(p.rotary_interleaved), rotary_rows=p.rotary_rows,
                            rotary_q_step=p.rotary_q_step).items():  # fmt: skip
        rec[name] = value
    return _Prepared(p, plan, rec)


def _launch(prep: _Prepared, q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, cache_seqlens: Any,
            block_table: Any, cache_batch_idx: Any, alibi: Any, sinks: Any, rotary_cos: Any,
            rotary_sin: Any) -> tuple[Any, Any]:  # fmt: skip
    """Allocate o and lse, write this call's pointers (and an int cache_seqlens) into the launches' own buffers,
    queue them. Nothing is converted or rebuilt per call."""
    cupy = cuda_backend.cupy_module()
    p = prep.p
    o, lse, *rest = cuda_backend._empty_outputs(prep.outputs)
    if o.size == 0:
        return o, lse
    stream = cupy.cuda.get_current_stream().ptr
    o_part, lse_part, split_count = prep.workspace_for(stream)
    const = p.seqlen_const is not None
    # In the PointerWriter's names' order (CALL_POINTERS, ROTARY_POINTERS with rotary, SPLIT_POINTERS).
    values: tuple[int, ...] = (
        q.data.ptr, o.data.ptr, lse.data.ptr, 0 if alibi is None else alibi.data.ptr,
        0 if sinks is None else sinks.data.ptr, 0 if k is None else k.data.ptr, 0 if v is None else v.data.ptr,
        k_cache.data.ptr, v_cache.data.ptr, 0 if const else cache_seqlens.data.ptr,
        0 if block_table is None else block_table.data.ptr, 0 if cache_batch_idx is None else cache_batch_idx.data.ptr,
        o_part, lse_part)  # fmt: skip
    q_rot = rest[0] if rest else None
    if q_rot is not None:
        values += (rotary_cos.data.ptr, rotary_sin.data.ptr, q_rot.data.ptr)
    values += (split_count,)
    with _launching:
        if q_rot is not None:  # rotate_q reads q as given; append and decode read the rotated dense copy
            prep.pointers.write(prep.rotate.buffer, values)
            if const:
                prep.write_const(prep.rotate.buffer, int(cache_seqlens))
            prep.rotate.fire(stream)
            values = (q_rot.data.ptr, *values[1:])
        for launch in (prep.append, prep.decode):
            if launch is None:
                continue
            prep.pointers.write(launch.buffer, values)
            if const:
                prep.write_const(launch.buffer, int(cache_seqlens))
            launch.fire(stream)
    return o, lse
