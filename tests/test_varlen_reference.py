"""Packed variable-length batches (issue 14) on the CPU: the reference per sequence against a formula
written independently here (one score matrix over the whole pack, masked block-diagonally with each
sequence's own bottom-right causal/window rule), central finite differences, identities with the dense
API, the NumPy backend, and every host check.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import DTYPES, rel_err
from test_variants_reference import assert_rounded_from, numerical_grads

import cupyflash as cf
from cupyflash import reference as ref

# ---------------------------------------------------------------------------- the independent formula


def naive_packed(q, k, v, cu_q, cu_k, causal=False, scale=None, window=None, softcap=0.0, slopes=None,
                 sinks=None, seqused_k=None):  # fmt: skip
    """o (total_q, Hq, D), lse (Hq, total_q): the whole (total_q x total_k) score matrix per head, hidden
    outside each sequence's diagonal block, in float64."""
    total_q, hq, d = q.shape
    total_k, hk, _ = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cu_q, cu_k = np.asarray(cu_q, np.int64), np.asarray(cu_k, np.int64)
    seq_q = np.searchsorted(cu_q, np.arange(total_q), side="right") - 1  # sequence of each query row
    seq_k = np.searchsorted(cu_k, np.arange(total_k), side="right") - 1
    nq_b = np.diff(cu_q)
    nk_b = np.diff(cu_k) if seqused_k is None else np.asarray(seqused_k, np.int64)
    i = (np.arange(total_q) - cu_q[seq_q])[:, None]  # position inside its own sequence
    j = (np.arange(total_k) - cu_k[seq_k])[None, :]
    b = seq_q[:, None]
    diag = i + nk_b[b] - nq_b[b]
    left, right = (-1, -1) if window is None else window
    right = 0 if causal else right
    vis = (seq_q[:, None] == seq_k[None, :]) & (j < nk_b[seq_k][None, :])
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    o = np.zeros(q.shape)
    lse = np.zeros((hq, total_q))
    for h in range(hq):
        kv = h // (hq // hk)
        s = scale * q[:, h].astype(np.float64) @ k[:, kv].astype(np.float64).T
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        if slopes is not None:
            sl = np.asarray(slopes, np.float64)
            slope = sl[h] if sl.ndim == 1 else sl[seq_q, h][:, None]
            s = s - slope * np.abs(diag - j)
        s = np.where(vis, s, -np.inf)
        if sinks is not None:
            s = np.concatenate([s, np.full((total_q, 1), float(sinks[h]))], axis=1)
        m = s.max(axis=1, keepdims=True) if s.shape[1] else np.full((total_q, 1), -np.inf)
        m0 = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m0)
        den = e.sum(axis=1, keepdims=True)
        p = e / np.where(den > 0, den, 1.0)
        vals = v[:, kv].astype(np.float64)
        if sinks is not None:
            vals = np.concatenate([vals, np.zeros((1, d))])
        o[:, h] = p @ vals
        lse[h] = np.where(den[:, 0] > 0, m[:, 0] + np.log(np.where(den[:, 0] > 0, den[:, 0], 1.0)), -np.inf)
    return o, lse


# ---------------------------------------------------------------------------- cases

# (lengths of query sequences, of key sequences): 0 and 1, multiples of no tile, Nq_b != Nk_b, one long
LENGTHS = {
    "equal": ([5, 9, 3], [5, 9, 3]),
    "empty-and-one": ([0, 1, 7, 0, 4], [3, 1, 0, 2, 6]),
    "nq!=nk": ([6, 2, 11], [3, 8, 11]),
    "one-long": ([2, 37, 1, 3], [2, 41, 1, 5]),
}
SPECS = {
    "plain": {},
    "causal": dict(causal=True),
    "window": dict(window=(3, 1)),
    "causal-window": dict(causal=True, window=(2, -1)),
    "softcap": dict(softcap=0.9, scale=1.7),
    "alibi-head": dict(alibi="head"),
    "alibi-seq": dict(alibi="seq", causal=True),
    "sinks": dict(sinks=True, causal=True),
    "all": dict(window=(4, 2), softcap=1.3, alibi="seq", sinks=True, scale=1.2),
}


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def make_case(rng, lengths, spec, hq=4, hk=2, d=8, dtype=np.float64):
    lq, lk = LENGTHS[lengths] if isinstance(lengths, str) else lengths
    cu_q, cu_k = cu(lq), cu(lk)
    q = rng.standard_normal((int(cu_q[-1]), hq, d)).astype(dtype)
    k = rng.standard_normal((int(cu_k[-1]), hk, d)).astype(dtype)
    v = rng.standard_normal((int(cu_k[-1]), hk, d)).astype(dtype)
    slopes = None
    if spec.get("alibi") == "head":
        slopes = rng.uniform(0.05, 0.6, hq).astype(np.float32)
    elif spec.get("alibi") == "seq":
        slopes = rng.uniform(0.05, 0.6, (len(lq), hq)).astype(np.float32)
    kw = dict(window_size=spec.get("window"), softcap=spec.get("softcap", 0.0), alibi_slopes=slopes,
              sinks=rng.standard_normal(hq).astype(np.float32) if spec.get("sinks") else None)  # fmt: skip
    packing = (cu_q, cu_k, max(lq, default=0), max(lk, default=0))
    return q, k, v, packing, spec.get("causal", False), spec.get("scale"), kw


def naive_of(q, k, v, packing, causal, scale, kw, seqused_k=None):
    return naive_packed(q, k, v, packing[0], packing[1], causal, scale, kw["window_size"], kw["softcap"],
                        kw["alibi_slopes"], kw["sinks"], seqused_k)  # fmt: skip


def assert_lse_equal(lse, expect, tol=1e-12):
    assert lse.shape == expect.shape
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(expect))
    fin = np.isfinite(expect)
    assert np.max(np.abs(lse[fin] - expect[fin]), initial=0.0) <= tol


# ---------------------------------------------------------------------------- forward


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_forward_matches_naive(rng, lengths, spec):
    q, k, v, packing, causal, scale, kw = make_case(rng, lengths, SPECS[spec])
    o_n, lse_n = naive_of(q, k, v, packing, causal, scale, kw)
    o, lse = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    o_t, lse_t = ref.tiled_attention_varlen_forward(q, k, v, *packing, causal, scale, 4, 3, **kw)
    for got, got_lse in ((o, lse), (o_t, lse_t)):
        assert got.shape == q.shape and got_lse.shape == (q.shape[1], q.shape[0])
        np.testing.assert_allclose(got, o_n, rtol=0, atol=1e-12)
        assert_lse_equal(got_lse, lse_n)
    assert ref.attention_varlen(q, k, v, *packing, causal, scale, **kw).shape == q.shape


def test_sequences_do_not_see_each_other(rng):
    """Changing one sequence's keys and values changes only that sequence's outputs."""
    q, k, v, packing, causal, scale, kw = make_case(rng, "nq!=nk", {})
    o, _ = ref.attention_varlen_forward(q, k, v, *packing)
    k2, v2 = k.copy(), v.copy()
    k2[3:11] += 1.0  # sequence 1's keys
    v2[3:11] -= 2.0
    o2, _ = ref.attention_varlen_forward(q, k2, v2, *packing)
    changed = np.abs(o2 - o).max(axis=(1, 2)) > 0
    assert changed[6:8].all()  # sequence 1's queries are rows 6:8 and not changed[:6].any() and not changed[8:].any()


@pytest.mark.parametrize("spec", ["plain", "causal", "all"])
def test_single_sequence_is_dense_attention(rng, spec):
    q, k, v, packing, causal, scale, kw = make_case(rng, ([13], [17]), SPECS[spec])
    kw["alibi_slopes"] = None if kw["alibi_slopes"] is None else kw["alibi_slopes"][0]
    o, lse = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    t = lambda x: x.transpose(1, 0, 2)  # noqa: E731
    o_d, lse_d = ref.attention_forward(t(q), t(k), t(v), causal, scale, **kw)
    np.testing.assert_allclose(o, t(o_d), rtol=0, atol=1e-14)
    assert_lse_equal(lse, lse_d, 1e-14)


def test_equal_lengths_are_a_dense_batch(rng):
    q, k, v, packing, causal, scale, kw = make_case(rng, ([6] * 3, [9] * 3), SPECS["all"])
    o, lse = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    dense = lambda x: x.reshape(3, -1, *x.shape[1:]).transpose(0, 2, 1, 3)  # noqa: E731
    o_d, lse_d = ref.attention_forward(dense(q), dense(k), dense(v), causal, scale, **kw)
    np.testing.assert_allclose(dense(o), o_d, rtol=0, atol=1e-14)
    assert_lse_equal(lse, lse_d.transpose(1, 0, 2).reshape(lse.shape), 1e-14)


def test_seqused_k_ignores_the_rest(rng):
    q, k, v, packing, causal, scale, kw = make_case(rng, "nq!=nk", SPECS["causal-window"])
    used = np.array([2, 0, 7], np.int32)
    o, lse = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, seqused_k=used, **kw)
    o_n, lse_n = naive_of(q, k, v, packing, causal, scale, kw, used)
    np.testing.assert_allclose(o, o_n, rtol=0, atol=1e-12)
    assert_lse_equal(lse, lse_n)
    k2 = k.copy()
    k2[[2, 10, 18, 19, 20, 21]] = np.nan  # the unused keys are never read
    o2, _ = ref.tiled_attention_varlen_forward(q, k2, v, *packing, causal, scale, 4, 4, seqused_k=used, **kw)
    np.testing.assert_allclose(o2, o, rtol=0, atol=1e-14)


# ---------------------------------------------------------------------------- backward

FD_LENGTHS = {"mixed": ([3, 0, 1, 4], [2, 3, 1, 5]), "nk=0": ([2, 3], [0, 4])}
FD_SPECS = ["plain", "causal", "causal-window", "softcap", "alibi-seq", "sinks", "all"]


@pytest.mark.parametrize("spec", FD_SPECS)
@pytest.mark.parametrize("lengths", list(FD_LENGTHS))
def test_backward_matches_finite_differences(rng, lengths, spec):
    q, k, v, packing, causal, scale, kw = make_case(rng, FD_LENGTHS[lengths], SPECS[spec], hq=2, hk=1, d=3)
    do = rng.standard_normal(q.shape)

    def loss(q, k, v, sinks):
        o = ref.attention_varlen(q, k, v, *packing, causal, scale, **{**kw, "sinks": sinks})
        return float(np.sum(o * do))

    # sinks are float32: a step of 2**-10 is exact on them
    expect = numerical_grads(loss, [q, k, v, kw["sinks"]], [1e-6, 1e-6, 1e-6, 2.0**-10])
    o, lse = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    plain = ref.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, **kw)
    tiled = ref.tiled_attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, 2, 3, **kw)
    _, vjp = ref.attention_varlen_vjp(q, k, v, *packing, causal, scale, **kw)
    from_vjp = vjp(do)
    n = 3 if kw["sinks"] is None else 4
    assert len(plain) == len(tiled) == len(from_vjp) == n
    for name, g, g_t, g_v, e in zip(("dq", "dk", "dv", "dsinks"), plain, tiled, from_vjp, expect):
        assert g.shape == e.shape, name
        assert np.linalg.norm(e) > 1e-3, name
        tol = 1e-5 if name == "dsinks" else 1e-7
        assert rel_err(g, e) < tol, name
        assert rel_err(g_t, e) < tol, name
        np.testing.assert_array_equal(g_v, g)


def test_backward_with_seqused_k_zeroes_unused_keys(rng):
    q, k, v, packing, causal, scale, kw = make_case(rng, ([3, 2], [4, 5]), SPECS["sinks"], hq=2, hk=1, d=3)
    used = np.array([2, 5], np.int32)
    do = rng.standard_normal(q.shape)

    def loss(q, k, v, sinks):
        o = ref.attention_varlen(q, k, v, *packing, causal, scale, **{**kw, "sinks": sinks}, seqused_k=used)
        return float(np.sum(o * do))

    expect = numerical_grads(loss, [q, k, v, kw["sinks"]], [1e-6, 1e-6, 1e-6, 2.0**-10])
    o, lse = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, seqused_k=used, **kw)
    grads = ref.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, seqused_k=used, **kw)
    assert not grads[1][2:4].any() and not grads[2][2:4].any()
    for name, g, e in zip(("dq", "dk", "dv", "dsinks"), grads, expect):
        assert rel_err(g, e) < (1e-5 if name == "dsinks" else 1e-7), name


# ---------------------------------------------------------------------------- the public API (NumPy backend)


@pytest.mark.parametrize("spec", ["causal", "all", "alibi-head"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_public_api_rounds_the_reference(rng, dtype, spec):
    dt = DTYPES[dtype]
    q, k, v, packing, causal, scale, kw = make_case(rng, "empty-and-one", SPECS[spec], dtype=dt)
    do = rng.standard_normal(q.shape).astype(dt)
    o, lse = cf.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    o64, lse64 = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    assert o.dtype == dt and lse.dtype == np.float32 and lse.shape == (q.shape[1], q.shape[0])
    assert_rounded_from(o, o64, dt)
    assert_lse_equal(lse, lse64.astype(np.float32).astype(np.float64), 0)
    grads = cf.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, **kw)
    exact = ref.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, **kw)
    assert len(grads) == (4 if kw["sinks"] is not None else 3)
    for g, x, e in zip(grads, (q, k, v), exact):
        assert g.dtype == dt and g.shape == x.shape
        assert_rounded_from(g, e, dt)
    if kw["sinks"] is not None:
        assert grads[3].dtype == np.float32
        np.testing.assert_allclose(grads[3], exact[3], rtol=1e-6, atol=1e-7)
    o_v, vjp = cf.attention_varlen_vjp(q, k, v, *packing, causal, scale, **kw)
    np.testing.assert_array_equal(o_v, o)
    for g, g_v in zip(grads, vjp(do)):
        np.testing.assert_array_equal(g_v, g)
    np.testing.assert_array_equal(cf.attention_varlen(q, k, v, *packing, causal, scale, **kw), o)


def test_public_api_refuses_a_kernel_name_for_numpy(rng):
    q, k, v, packing, *_ = make_case(rng, "equal", {}, dtype=np.float32)
    with pytest.raises(TypeError, match="names a CUDA kernel family"):
        cf.attention_varlen_forward(q, k, v, *packing, kernel="mma")
    with pytest.raises(ValueError, match="kernel must be one of"):
        cf.attention_varlen_forward(q, k, v, *packing, kernel="cuda")


# ---------------------------------------------------------------------------- host checks


def _good(rng):
    q, k, v, (cu_q, cu_k, mq, mk), *_ = make_case(rng, "nq!=nk", {}, dtype=np.float32)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)


def _bad(exc, match, **change):
    def check(rng):
        args = {**_good(rng)}
        keywords = {n: change.pop(n) for n in list(change) if n not in args}
        for n, f in change.items():
            args[n] = f(args[n]) if callable(f) else f
        with pytest.raises(exc, match=match):
            cf.attention_varlen_forward(**args, **keywords)

    return check


BAD = {
    "q-4d": _bad(ValueError, r"q must have shape \(total, H, D\)", q=lambda q: q[None]),
    "kv-differ": _bad(ValueError, "k and v must have the same shape", v=lambda v: v[:-1]),
    "heads": _bad(ValueError, "positive multiple", k=lambda k: k[:, :1].repeat(3, 1), v=lambda v: v[:, :1].repeat(3, 1)),
    "dtype": _bad(TypeError, r"k.dtype must equal q.dtype", k=lambda k: k.astype(np.float16)),
    "float64": _bad(TypeError, "q.dtype must be one of", q=lambda q: q.astype(np.float64)),
    "cu-int64": _bad(TypeError, "cu_seqlens_q.dtype must be int32", cu_seqlens_q=lambda c: c.astype(np.int64)),
    "cu-list": _bad(TypeError, "cu_seqlens_k must be a numpy.ndarray", cu_seqlens_k=lambda c: c.tolist()),
    "cu-2d": _bad(ValueError, "cu_seqlens_q must be 1-D", cu_seqlens_q=lambda c: c[None]),
    "cu-short": _bad(ValueError, r"B >= 1", cu_seqlens_q=lambda c: c[:1]),
    "cu-lengths-differ": _bad(ValueError, r"cu_seqlens_k must have shape \(4,\)", cu_seqlens_k=lambda c: c[:-1]),
    "cu-strided": _bad(ValueError, "cu_seqlens_q must be contiguous",
                       cu_seqlens_q=lambda c: np.repeat(c, 2)[::2]),
    "max-float": _bad(TypeError, "max_seqlen_q must be a Python int", max_seqlen_q=11.0),
    "max-negative": _bad(ValueError, "max_seqlen_k must be >= 0", max_seqlen_k=-1),
    "max-bool": _bad(TypeError, "max_seqlen_k must be a Python int", max_seqlen_k=True),
    "seqused-len": _bad(ValueError, r"seqused_k must have shape \(3,\)", seqused_k=np.zeros(2, np.int32)),
    "seqused-dtype": _bad(TypeError, "seqused_k.dtype must be int32", seqused_k=np.zeros(3, np.int64)),
    "alibi-shape": _bad(ValueError, r"alibi_slopes must have shape \(4,\) or \(3, 4\)",
                        alibi_slopes=np.zeros((2, 4), np.float32)),
    "sinks-shape": _bad(ValueError, r"sinks must have shape \(4,\)", sinks=np.zeros((3, 4), np.float32)),
    "window": _bad(ValueError, "window_size left must be >= -1", window_size=(-2, 0)),
    "validate": _bad(TypeError, "validate must be a bool", validate=1),
    # values (the NumPy backend always reads them)
    "cu-start": _bad(ValueError, r"cu_seqlens_q\[0\] must be 0", cu_seqlens_q=lambda c: c + 1),
    "cu-end": _bad(ValueError, r"cu_seqlens_k\[-1\] must equal total_k = 22",
                   cu_seqlens_k=np.array([0, 3, 11, 21], np.int32)),
    "cu-decreasing": _bad(ValueError, "cu_seqlens_q must be non-decreasing",
                          cu_seqlens_q=np.array([0, 8, 6, 19], np.int32)),
    "max-too-small": _bad(ValueError, "a key sequence is longer than max_seqlen_k = 10", max_seqlen_k=10),
    "seqused-too-big": _bad(ValueError, r"seqused_k must be in \[0", seqused_k=np.array([3, 9, 0], np.int32)),
    "seqused-negative": _bad(ValueError, r"seqused_k must be in \[0", seqused_k=np.array([3, -1, 0], np.int32)),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused(rng, case):
    BAD[case](rng)


def test_every_value_problem_is_named(rng):
    args = _good(rng)
    args["cu_seqlens_q"] = np.array([1, 8, 6, 20], np.int32)
    args["max_seqlen_q"] = 1
    with pytest.raises(ValueError) as e:
        cf.attention_varlen_forward(**args)
    msg = str(e.value)
    for part in ("cu_seqlens_q[0] must be 0", "cu_seqlens_q[-1] must equal total_q = 19", "non-decreasing",
                 "longer than max_seqlen_q = 1"):
        assert part in msg, part


def test_backward_checks(rng):
    args = _good(rng)
    q = args["q"]
    o, lse = cf.attention_varlen_forward(**args)
    cu_args = [args[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")]
    do = rng.standard_normal(q.shape).astype(np.float32)
    with pytest.raises(ValueError, match=r"lse must have shape \(Hq, total_q\) = \(4, 19\)"):
        cf.attention_varlen_backward(do, q, args["k"], args["v"], o, lse.T.copy(), *cu_args)
    with pytest.raises(TypeError, match="do.dtype must equal q.dtype"):
        cf.attention_varlen_backward(do.astype(np.float16), q, args["k"], args["v"], o, lse, *cu_args)
    with pytest.raises(ValueError, match="o must have q's shape"):
        cf.attention_varlen_backward(do, q, args["k"], args["v"], o[:-1], lse, *cu_args)
    with pytest.raises(TypeError, match="lse.dtype must be float32"):
        cf.attention_varlen_backward(do, q, args["k"], args["v"], o, lse.astype(np.float16), *cu_args)


# ---------------------------------------------------------------------------- the kernels' host plan (no GPU needed)


def _kernel_problem(rng, dtype=np.float32):
    from cupyflash.varlen_cuda import _kernel_problem as kernel_problem
    from cupyflash.varlen_validation import check_varlen

    q, k, v, (cu_q, cu_k, mq, mk), causal, scale, kw = make_case(rng, "one-long", SPECS["all"], dtype=dtype)
    vp = check_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal, scale=scale, **kw)
    return vp, kernel_problem(vp)


def test_kernel_problem_is_the_grid_of_the_pack(rng):
    vp, p = _kernel_problem(rng)
    assert p.varlen and not vp.dense.varlen
    assert (p.batch, p.nq, p.nk, p.total_q, p.total_k) == ((4,), 37, 41, 43, 49)
    assert p.variant == vp.dense.variant and p.variant.alibi and p.variant.sinks


def test_portable_plans_size_rows_by_the_packed_rows(rng):
    from cupyflash.kernels import mma, portable, wgmma
    from cupyflash.kernels.family import Geometry
    from cupyflash.kernels.params import PARAMS
    from cupyflash.plans import DeviceLimits
    from cupyflash.plans import portable as plans_portable

    vp, p = _kernel_problem(rng)
    hq, d = p.hq, p.d
    strides = {n: (0, d, 2 * d) for n in ("q", "k", "v")}
    strides.update(o=(0, d, hq * d), lse=(0, p.total_q, 1), alibi=(hq, 1, 0))
    g = Geometry(4, strides, ({},), True)
    limits = DeviceLimits(90, 132, 227 * 1024)
    fwd = portable.forward_plan(p, g, limits)
    (lp, raw), = fwd.launches
    rec = np.frombuffer(raw, PARAMS)[0]
    assert (rec["batch"], rec["nq"], rec["nk"], rec["total_q"], rec["total_k"]) == (4, 37, 41, 43, 49)
    assert rec["rows"] == hq * 43 and rec["alibi_sb"] == hq and tuple(rec["lse_s"]) == (0, 43, 1)
    # Compact varlen grid (plans.grid_axes): total_q // rows + B virtual query tiles x heads.
    rows = plans_portable.forward_plan(portable._shape(p, g), limits).tile.rows
    assert lp.grid == (43 // rows + 4, hq, 1)
    bstrides = {**strides, "dout": strides["o"], "dq": strides["o"], "dk": (0, d, 2 * d), "dv": (0, d, 2 * d)}
    bwd = portable.backward_plan(p, Geometry(4, bstrides, ({},), True), limits)
    assert {s.field: s.size for s in bwd.scratch} == {"lse_log2": hq * 43, "delta": hq * 43, "dq_accum": hq * 43 * d}
    delta_launch = bwd.launches[0][0]
    assert delta_launch.grid[0] * 8 >= hq * 43 > (delta_launch.grid[0] - 1) * 8  # one warp per packed row



def test_tensor_core_plans_size_rows_by_the_packed_rows(rng):
    """The mma and wgmma backwards: Delta and the dQ conversion run one warp per packed row, the scratch holds
    Hq * total_q rows, and the main grids are compact: heads x (total // tile + B) virtual tiles."""
    from cupyflash.kernels import mma, wgmma
    from cupyflash.kernels.family import Geometry
    from cupyflash.kernels.params import PARAMS
    from cupyflash.plans import DeviceLimits

    from dataclasses import replace

    vp, p = _kernel_problem(rng, np.float16)
    p = replace(p, d=64)  # a head dim both families take
    hq, d = p.hq, p.d
    strides = {n: (0, d, 2 * d) for n in ("q", "k", "v", "dk", "dv")}
    strides.update({n: (0, d, hq * d) for n in ("o", "dout", "dq")}, lse=(0, p.total_q, 1), alibi=(hq, 1, 0))
    g = Geometry(4, strides, ({},), True)
    limits = DeviceLimits(90, 132, 227 * 1024)
    for fam in (mma, wgmma):
        assert fam.supports(p, limits) is None
        bwd = fam.backward_plan(p, g, limits)
        assert {s.field: s.size for s in bwd.scratch} == {"delta": hq * 43, "dq_accum": hq * 43 * d}
        (delta, raw), (main, _), (convert, _) = bwd.launches
        assert convert.grid[0] * 16 >= hq * 43 > (convert.grid[0] - 1) * 16  # packed rows; D = 64: 16 a block
        assert delta.grid[0] * 32 >= hq * 43 > (delta.grid[0] - 1) * 32  # D = 64: 8 lanes, 32 rows a block
        rec = np.frombuffer(raw, PARAMS)[0]
        assert (rec["rows"], rec["total_q"], rec["total_k"], rec["nq"], rec["nk"]) == (hq * 43, 43, 49, 37, 41)
        bc = fam.plans.backward_config(p.d, limits).bc
        heads, tiles = (main.grid[0], main.grid[1]) if main.grid[0] == p.hk else (main.grid[1], main.grid[0])
        assert (heads, tiles) == (p.hk, 49 // bc + 4)  # kv heads on one axis, virtual key tiles on the other
        (fwd, _), = fam.forward_plan(p, g, limits).launches
        assert hq in fwd.grid[:2] and 4 * hq not in fwd.grid[:2]
