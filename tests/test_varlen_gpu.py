"""GPU side of packed variable-length batches (issue 14): every kernel family reached explicitly, forward and
backward, against the float64 reference run per sequence, with the criterion of tests/test_variants_gpu.py:

- float32: relative error <= 1e-5 (o) and 1e-4 (dq, dk, dv, dsinks) over the whole pack;
- float16/bfloat16: FlashAttention's criterion, max|x - x_ref| <= 2x (o) / 3x (grads) the error of the same-dtype
  naive implementation (``naive_attention`` of test_variants_gpu, run per sequence) plus FlashAttention's floor.

Outputs are poisoned through the memory pool: before each call, NaN-filled arrays of every output's size are
allocated and freed, so the pool hands those very blocks to the kernels' outputs; a row a kernel forgets to
write stays NaN and fails the finiteness checks.

Every family (portable, mma, wgmma) runs packed batches, forward and backward, through ``seq_geometry``.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, HAS_GPU, TOL_GRAD, TOL_OUT, rel_err, requires_gpu
from test_variants_gpu import assert_fa_criterion, assert_float32_close, family_cases, naive_attention

import cupyflash
from cupyflash import reference

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

#: Head dim per family (mma/wgmma need D % 8 == 0, wgmma 32 < D <= 128), rotated over the cases.
FAMILY_DIMS = {"portable": [40, 64, 128], "mma": [64, 96, 128], "wgmma": [64, 128]}

# (id, query lengths, key lengths, Hq, Hk, spec). Lengths: 0 and 1, multiples of no tile, Nq_b != Nk_b, one long
# sequence among short ones, GQA/MQA; spec as in test_variants_gpu (causal, window, softcap, alibi, sinks, scale).
CASES = [
    ("plain-equal", [128, 128, 128], [128, 128, 128], 2, 2, {}),
    ("causal-mixed", [0, 1, 77, 300, 5, 129], [0, 1, 77, 300, 5, 129], 4, 2, dict(causal=True)),
    ("causal-nq!=nk", [33, 190, 1, 64], [70, 100, 9, 200], 4, 1, dict(causal=True)),
    ("one-long", [17, 1029, 3, 65], [17, 1029, 3, 65], 2, 2, dict(causal=True)),
    ("empty-keys", [40, 7, 100], [0, 50, 100], 2, 1, {}),
    ("window", [250, 33, 0, 97], [180, 33, 12, 97], 4, 2, dict(window=(20, 5))),
    ("causal-window-left", [300, 65, 2], [300, 80, 2], 2, 2, dict(causal=True, window=(64, -1))),
    ("softcap", [129, 31, 200], [140, 31, 150], 2, 2, dict(softcap=30.0)),
    ("alibi-seq", [90, 1, 257], [130, 1, 200], 4, 2, dict(alibi="seq", causal=True)),
    ("sinks", [120, 0, 60, 5], [60, 30, 0, 200], 3, 1, dict(sinks=True, causal=True)),
    ("all", [150, 2, 77, 300], [170, 40, 60, 310], 4, 2,
     dict(window=(32, 8), softcap=30.0, alibi="head", sinks=True)),
]  # fmt: skip


def case_params():
    out = []
    for f, fcase in enumerate(family_cases()):
        (kernel, dtype_name), marks = (fcase.values, fcase.marks) if hasattr(fcase, "values") else (fcase, ())
        dims = FAMILY_DIMS[kernel]
        for i, case in enumerate(CASES):
            d = dims[(i + f) % len(dims)]
            out.append(pytest.param(kernel, dtype_name, case, d, marks=marks,
                                    id=f"{kernel}-{dtype_name}-{case[0]}-d{d}"))  # fmt: skip
    return out


# ---------------------------------------------------------------------------- inputs


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def make_pack(rng, dtype_name, case, d):
    _, lq, lk, hq, hk, spec = case
    dtype = DTYPES[dtype_name]
    cu_q, cu_k = cu(lq), cu(lk)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = rng.standard_normal((tq, hq, d)).astype(dtype)
    k = rng.standard_normal((tk, hk, d)).astype(dtype)
    v = rng.standard_normal((tk, hk, d)).astype(dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    slopes = None
    if spec.get("alibi") == "head":
        slopes = (2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)).astype(np.float32)
    elif spec.get("alibi") == "seq":
        slopes = rng.uniform(0.01, 0.3, (len(lq), hq)).astype(np.float32)
    sinks = rng.uniform(-1.0, 2.5, hq).astype(np.float32) if spec.get("sinks") else None
    kw = {"window_size": spec.get("window"), "softcap": spec.get("softcap", 0.0), "alibi_slopes": slopes,
          "sinks": sinks}  # fmt: skip
    packing = (cu_q, cu_k, max(lq), max(lk))
    return q, k, v, do, packing, spec.get("causal", False), spec.get("scale"), kw


def _dev(x):
    return cupy.asarray(x) if isinstance(x, np.ndarray) else x


def poison_pool(*shapes_dtypes):
    """Allocate blocks of each (shape, dtype)'s size filled with 0xFF bytes (NaN in float32, float16 and bfloat16)
    and free them: the pool gives them to the next arrays of those sizes, so outputs start as NaN."""
    blocks = [cupy.full(int(np.prod(shape)) * np.dtype(dtype).itemsize, 0xFF, dtype=cupy.uint8)
              for shape, dtype in shapes_dtypes]  # fmt: skip
    cupy.cuda.Device().synchronize()
    del blocks


def naive_pack(q, k, v, do, packing, causal, scale, kw, dtype_name):
    """The same-dtype naive implementation run per sequence, reassembled into packed (o, dq, dk, dv[, dsinks])."""
    cu_q, cu_k = packing[:2]
    hq = q.shape[1]
    out = [np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)]
    dsinks = np.zeros(hq)
    for b in range(len(cu_q) - 1):
        qr, kr = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if qr.stop == qr.start:
            continue  # no queries: nothing out, zero gradients for the keys
        dense = lambda x: x[None].transpose(0, 2, 1, 3)  # noqa: E731 - (N, H, D) -> (1, H, N, D)
        slopes = kw["alibi_slopes"]
        kw_b = {**kw, "alibi_slopes": None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])}
        res = naive_attention(dense(q[qr]), dense(k[kr]), dense(v[kr]), dense(do[qr]), causal, scale, kw_b,
                              dtype_name)  # fmt: skip
        for x, r, rows in zip(out, res[:4], (qr, qr, kr, kr)):
            x[rows] = r[0].transpose(1, 0, 2)
        if kw["sinks"] is not None:
            dsinks += res[4]
    return out + ([dsinks] if kw["sinks"] is not None else [])


# ---------------------------------------------------------------------------- the check


def check_pack(kernel, dtype_name, q, k, v, do, packing, causal, scale, kw, vjp=False):
    dev = [cupy.asarray(x) for x in (q, k, v, do)]
    qd, kd, vd, dod = dev
    pk = (cupy.asarray(packing[0]), cupy.asarray(packing[1]), packing[2], packing[3])
    kwd = {n: _dev(x) for n, x in kw.items()}
    hq, tq = q.shape[1], q.shape[0]
    poison_pool((q.shape, q.dtype), ((hq, tq), np.float32))
    if vjp:
        o, fn = cupyflash.attention_varlen_vjp(qd, kd, vd, *pk, causal, scale, kernel=kernel, **kwd)
        lse = cupyflash.attention_varlen_forward(qd, kd, vd, *pk, causal, scale, kernel=kernel, **kwd)[1]
    else:
        o, lse = cupyflash.attention_varlen_forward(qd, kd, vd, *pk, causal, scale, kernel=kernel, **kwd)
    poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
    if vjp:
        grads = fn(dod)
    else:
        grads = cupyflash.attention_varlen_backward(dod, qd, kd, vd, o, lse, *pk, causal, scale, kernel=kernel,
                                                    **kwd)  # fmt: skip
    assert_pack_close(kernel, dtype_name, q, k, v, do, packing, causal, scale, kw, o, lse, grads)


def assert_pack_close(kernel, dtype_name, q, k, v, do, packing, causal, scale, kw, o, lse, grads):
    """The device results (o, lse and the gradients, CuPy arrays) against the float64 reference (see the module)."""
    hq, tq = q.shape[1], q.shape[0]
    with_sinks = kw["sinks"] is not None
    assert len(grads) == (4 if with_sinks else 3)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == np.float32 and lse.shape == (hq, tq)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    o, lse = o.get().astype(np.float64), lse.get().astype(np.float64)
    got = [g.get().astype(np.float64) for g in grads]
    assert np.isfinite(o).all(), "o has NaN/inf (a row left unwritten?)"
    assert not np.isnan(lse).any() and not np.isposinf(lse).any(), "lse has NaN/+inf"
    for name, g in zip(("dq", "dk", "dv", "dsinks"), got):
        assert np.isfinite(g).all(), f"{name} has NaN/inf (a row left unwritten?)"

    ro, rlse = reference.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    rgrads = reference.attention_varlen_backward(do, q, k, v, ro, rlse, *packing, causal, scale, **kw)
    masked = np.isneginf(rlse)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    np.testing.assert_allclose(lse[~masked], rlse[~masked], rtol=1e-5 if dtype_name == "float32" else 2e-3,
                               atol=1e-4)  # fmt: skip
    names = ["o", "dq", "dk", "dv", "dsinks"]
    outs, refs = [o] + got, [ro] + list(rgrads)
    if dtype_name == "float32":
        for name, x, r, tol in zip(names, outs, refs, [TOL_OUT["float32"]] + [TOL_GRAD["float32"]] * 4):
            assert_float32_close(f"{kernel} {name}", x, r, tol)
        return
    naive = naive_pack(q, k, v, do, packing, causal, scale, kw, dtype_name)
    for i, (name, x, r, n) in enumerate(zip(names[:4], outs, refs, naive)):
        assert_fa_criterion(f"{kernel} {dtype_name} {name}", x, r, n, dtype_name, 2 if i == 0 else 3)
    if with_sinks:  # as in test_variants_gpu: the naive error counted is at least what O's rounding makes
        ds_own_o = reference.attention_varlen_backward(do, q, k, v, o, rlse, *packing, causal, scale, **kw)[3]
        inherent = np.abs(ds_own_o - refs[4]).max(initial=0.0)
        naive_ds = refs[4] + np.sign(naive[4] - refs[4]) * np.maximum(np.abs(naive[4] - refs[4]), inherent)
        assert_fa_criterion(f"{kernel} {dtype_name} dsinks", outs[4], refs[4], naive_ds, dtype_name, 3)


# ---------------------------------------------------------------------------- accuracy sweep (the kernels)


@pytest.mark.parametrize("kernel,dtype_name,case,d", case_params())
def test_varlen(kernel, dtype_name, case, d, rng):
    q, k, v, do, packing, causal, scale, kw = make_pack(rng, dtype_name, case, d)
    check_pack(kernel, dtype_name, q, k, v, do, packing, causal, scale, kw)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_strided_views_seqused_k_and_vjp(kernel, dtype_name, rng):
    """q/k/v as strided views (every other head of a wider array), seqused_k, every variant, through the vjp."""
    case = ("strided", [70, 3, 200], [90, 40, 220], 4, 2, dict(window=(40, 3), softcap=30.0, alibi="seq", sinks=True))
    q, k, v, do, packing, causal, scale, kw = make_pack(rng, dtype_name, case, 64)
    used = np.array([60, 0, 211], np.int32)
    qd, kd, vd = (cupy.asarray(np.repeat(x, 2, axis=1))[:, ::2] for x in (q, k, v))  # heads 2 apart: a view
    assert not qd.flags.c_contiguous
    pk = (cupy.asarray(packing[0]), cupy.asarray(packing[1]), packing[2], packing[3])
    kwd = {n: _dev(x) for n, x in kw.items()}
    o, fn = cupyflash.attention_varlen_vjp(qd, kd, vd, *pk, causal, scale, kernel=kernel,
                                           seqused_k=cupy.asarray(used), **kwd)  # fmt: skip
    grads = fn(cupy.asarray(do))
    ro, rlse = reference.attention_varlen_forward(q, k, v, *packing, causal, scale, seqused_k=used, **kw)
    rgrads = reference.attention_varlen_backward(do, q, k, v, ro, rlse, *packing, causal, scale, seqused_k=used, **kw)
    tol_o, tol_g = TOL_OUT[dtype_name], TOL_GRAD[dtype_name]
    assert_float32_close("o", o.get(), ro, tol_o)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
        assert_float32_close(name, g.get(), r, tol_g if name != "dsinks" else 3 * tol_g)
    unused = np.r_[60:90, 90:130, 130 + 211:130 + 220]
    assert not grads[1].get()[unused].any() and not grads[2].get()[unused].any()


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_wrong_cu_seqlens_stay_inside_the_arrays(kernel, dtype_name, rng):
    """Values that break the contract (past total, negative, decreasing, longer than max_seqlen) must not fault:
    the device clips every sequence to [0, total) and to max_seqlen (run this file under compute-sanitizer to
    see every access), and validate=True names the problem."""
    q, k, v, do, packing, causal, scale, kw = make_pack(rng, dtype_name, CASES[1], 64)
    tq, tk = q.shape[0], k.shape[0]
    for cu_q, cu_k in (([0, 5, tq + 300, tq], [0, 900, 3, tk]), ([0, -7, 40, tq], [0, 2**30, -2**30, tk])):
        cu_q = np.array(cu_q + [tq] * (len(packing[0]) - len(cu_q)), np.int32)
        cu_k = np.array(cu_k + [tk] * (len(packing[1]) - len(cu_k)), np.int32)
        pk = (cupy.asarray(cu_q), cupy.asarray(cu_k), 64, 64)  # max_seqlen smaller than real lengths too
        o, lse = cupyflash.attention_varlen_forward(*(cupy.asarray(x) for x in (q, k, v)), *pk, causal,
                                                    kernel=kernel)  # fmt: skip
        grads = cupyflash.attention_varlen_backward(cupy.asarray(do), *(cupy.asarray(x) for x in (q, k, v)), o, lse,
                                                    *pk, causal, kernel=kernel)  # fmt: skip
        cupy.cuda.Device().synchronize()  # a fault surfaces here
        with pytest.raises(ValueError, match="bad varlen packing"):
            cupyflash.attention_varlen_forward(*(cupy.asarray(x) for x in (q, k, v)), *pk, causal, kernel=kernel,
                                               validate=True)  # fmt: skip
        del grads


# ---------------------------------------------------------------------------- host checks and validate (run today)


def _small(rng):
    q, k, v, do, packing, causal, scale, kw = make_pack(rng, "float32", CASES[2], 32)
    args = [cupy.asarray(x) for x in (q, k, v)]
    return args, [cupy.asarray(packing[0]), cupy.asarray(packing[1]), packing[2], packing[3]]


def test_host_checks_on_cupy_arrays(rng):
    (q, k, v), (cu_q, cu_k, mq, mk) = _small(rng)
    with pytest.raises(TypeError, match="cu_seqlens_q must be a cupy array like q"):
        cupyflash.attention_varlen_forward(q, k, v, cu_q.get(), cu_k, mq, mk)
    with pytest.raises(TypeError, match="cu_seqlens_k.dtype must be int32"):
        cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_k.astype(cupy.int64), mq, mk)
    with pytest.raises(TypeError, match="max_seqlen_q must be a Python int"):
        cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_k, cupy.asarray(mq), mk)
    with pytest.raises(TypeError, match="arrays must all be NumPy or all be CuPy"):
        cupyflash.attention_varlen_forward(q, k.get(), v, cu_q, cu_k, mq, mk)


@pytest.mark.parametrize("bad", ["start", "end", "decreasing", "max_seqlen", "seqused_k"])
def test_validate_checks_values_on_the_device(rng, bad):
    (q, k, v), (cu_q, cu_k, mq, mk) = _small(rng)
    used = None
    if bad == "start":
        cu_q = cu_q + 1
    elif bad == "end":
        cu_k = cu_k.copy()
        cu_k[-1] -= 1
    elif bad == "decreasing":
        cu_q = cupy.asarray(np.array([0, 40, 30, 100, int(cu_q[-1])], np.int32))  # B + 1 = 5 entries
    elif bad == "max_seqlen":
        mk = 10
    else:
        used = cupy.asarray(np.array([71, 0, 0, 0], np.int32))  # sequence 0 has 70 keys
    message = {"start": r"cu_seqlens_q\[0\] must be 0", "end": "cu_seqlens_k\\[-1\\] must equal total_k",
               "decreasing": "cu_seqlens_q must be non-decreasing", "max_seqlen": "longer than max_seqlen_k = 10",
               "seqused_k": "seqused_k must be in"}[bad]  # fmt: skip
    with pytest.raises(ValueError, match=message):
        cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_k, mq, mk, seqused_k=used, validate=True)


def test_validate_passes_a_good_pack(rng):
    (q, k, v), pk = _small(rng)
    o, lse = cupyflash.attention_varlen_forward(q, k, v, *pk, validate=True)
    assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
@pytest.mark.parametrize("causal", [False, True])
def test_equal_lengths_match_the_dense_kernel(kernel, dtype_name, causal, rng):
    """A pack of equal sequences is a dense batch: each family's kernels give the dense call's o and lse bit for
    bit (same tiles, same order of operations), and its gradients up to the dQ atomics' order."""
    b, n, hq, hk, d = 3, 100, 4, 2, 64
    dt = DTYPES[dtype_name]
    q = cupy.asarray(rng.standard_normal((b * n, hq, d)).astype(dt))
    k = cupy.asarray(rng.standard_normal((b * n, hk, d)).astype(dt))
    v = cupy.asarray(rng.standard_normal((b * n, hk, d)).astype(dt))
    do = cupy.asarray(rng.standard_normal((b * n, hq, d)).astype(dt))
    cu_q = cupy.asarray(cu([n] * b))
    o, lse = cupyflash.attention_varlen_forward(q, k, v, cu_q, cu_q, n, n, causal, kernel=kernel)
    dense = lambda x: x.reshape(b, n, *x.shape[1:]).transpose(0, 2, 1, 3)  # noqa: E731 - a strided view
    o_d, lse_d = cupyflash.attention_forward(dense(q), dense(k), dense(v), causal, kernel=kernel)
    np.testing.assert_array_equal(dense(o).get(), o_d.get())
    np.testing.assert_array_equal(lse.get(), lse_d.get().transpose(1, 0, 2).reshape(hq, b * n))
    grads = cupyflash.attention_varlen_backward(do, q, k, v, o, lse, cu_q, cu_q, n, n, causal, kernel=kernel)
    grads_d = cupyflash.attention_backward(dense(do), dense(q), dense(k), dense(v), o_d, lse_d, causal,
                                           kernel=kernel)  # fmt: skip
    # dk, dv: the same sums in the same order; dq: float32 atomics, whose order differs run to run
    for name, g, g_d in zip(("dq", "dk", "dv"), grads, grads_d):
        err = rel_err(dense(g).get(), g_d.get().astype(np.float64))
        assert err <= (1e-6 if dtype_name == "float32" else 4e-3), f"{name}: {err:.3g}"
