"""The public API on NumPy arrays: NumPy results of the input dtype (lse float32) that are the
float64 reference rounded once, for float32, float16 and bfloat16."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import DTYPES, TOL_GRAD, TOL_OUT, random_qkv, rel_err

import cupyflash as cf
from cupyflash import reference as ref

# (batch, hq, hk, nq, nk, d, causal)
SHAPES = [
    ((2,), 4, 4, 17, 17, 32, False),
    ((2,), 4, 2, 33, 17, 40, True),  # GQA, Nq > Nk: fully masked rows
    ((2, 3), 2, 1, 9, 20, 64, True),  # MQA, two batch dims, Nq < Nk
    ((), 1, 1, 1, 5, 16, False),  # one query row (with one key dq and dk would be exactly 0)
]
SHAPE_IDS = ["mha", "gqa-causal-nq>nk", "mqa-2batch-causal", "nq1"]


def assert_rounded_from(x, exact, dtype):
    """Each element of x is exact rounded to dtype: |x - exact| <= u |exact| (+ subnormal slack)."""
    fi = ml_dtypes.finfo(dtype)
    u = float(fi.eps) / 2
    tiny = float(fi.smallest_subnormal)
    x64 = np.asarray(x, dtype=np.float64)
    assert np.isfinite(x64).all()
    bound = u * np.abs(exact) + tiny
    worst = np.max(np.abs(x64 - exact) - bound, initial=-np.inf)
    assert worst <= 0, f"off by more than rounding to {np.dtype(dtype)}"


def assert_lse_rounded_from(lse, exact):
    assert lse.dtype == np.float32
    masked = np.isneginf(exact)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    assert_rounded_from(lse[~masked], exact[~masked], np.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_forward(rng, dtype, shape):
    *dims, causal = shape
    dt = DTYPES[dtype]
    q, k, v = random_qkv(rng, *dims, dt)
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    o, lse = cf.attention_forward(q, k, v, causal)
    assert type(o) is np.ndarray and type(lse) is np.ndarray
    assert o.dtype == dt and o.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == q.shape[:-1]
    o64, lse64 = ref.attention_forward(q, k, v, causal)
    assert_rounded_from(o, o64, dt)
    assert_lse_rounded_from(lse, lse64)
    assert rel_err(o, o64) < TOL_OUT[dtype]
    np.testing.assert_array_equal(cf.attention(q, k, v, causal), o)
    for x, x0 in ((q, q0), (k, k0), (v, v0)):
        np.testing.assert_array_equal(x, x0)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_backward(rng, dtype, shape):
    *dims, causal = shape
    dt = DTYPES[dtype]
    q, k, v = random_qkv(rng, *dims, dt)
    do = rng.standard_normal(q.shape).astype(dt)
    o, lse = cf.attention_forward(q, k, v, causal)
    grads = cf.attention_backward(do, q, k, v, o, lse, causal)
    # exactly the reference on the arguments given (the rounded o and lse) ...
    expect = ref.attention_backward(do, q, k, v, o, lse, causal)
    for name, g, e, like in zip(("dq", "dk", "dv"), grads, expect, (q, k, v)):
        assert type(g) is np.ndarray and g.dtype == dt and g.shape == like.shape, name
        assert_rounded_from(g, e, dt)
    # ... and close to the gradients of exact attention (o and lse never rounded)
    _, vjp64 = ref.attention_vjp(q, k, v, causal)
    for name, g, e in zip(("dq", "dk", "dv"), grads, vjp64(do)):
        assert np.linalg.norm(e) > 0.1, name
        assert rel_err(g, e) < TOL_GRAD[dtype], name


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_vjp_equals_backward(rng, dtype):
    dt = DTYPES[dtype]
    q, k, v = random_qkv(rng, (2,), 4, 2, 12, 15, 24, dt)
    do = rng.standard_normal(q.shape).astype(dt)
    for causal, scale in ((False, None), (True, 0.4)):
        o_v, vjp = cf.attention_vjp(q, k, v, causal, scale)
        o, lse = cf.attention_forward(q, k, v, causal, scale)
        np.testing.assert_array_equal(o_v, o)
        for g_v, g in zip(vjp(do), cf.attention_backward(do, q, k, v, o, lse, causal, scale)):
            assert g_v.dtype == dt
            np.testing.assert_array_equal(g_v, g)


def test_fully_masked_rows(rng):
    q, k, v = random_qkv(rng, (1,), 2, 1, 10, 4, 16, np.float16)
    do = rng.standard_normal(q.shape).astype(np.float16)
    o, lse = cf.attention_forward(q, k, v, True)
    assert np.all(o[..., :6, :] == 0) and np.all(np.isneginf(lse[..., :6]))
    assert np.isfinite(lse[..., 6:]).all()
    dq, dk, dv = cf.attention_backward(do, q, k, v, o, lse, True)
    assert np.all(dq[..., :6, :] == 0)
    assert all(np.isfinite(g.astype(np.float32)).all() for g in (dq, dk, dv))
    assert np.abs(dv.astype(np.float32)).max() > 0


def test_strided_views(rng):
    """A (B, N, H, D) array seen as (B, H, N, D) gives the same result as a contiguous copy."""
    bnhd = [rng.standard_normal((2, 11, 4, 16)).astype(np.float32) for _ in range(3)]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in bnhd)
    assert not q.flags.c_contiguous
    o, lse = cf.attention_forward(q, k, v, True)
    o_c, lse_c = cf.attention_forward(*(np.ascontiguousarray(x) for x in (q, k, v)), True)
    np.testing.assert_array_equal(o, o_c)
    np.testing.assert_array_equal(lse, lse_c)


@pytest.mark.parametrize("batch,nq,nk", [((2,), 0, 5), ((2,), 5, 0), ((0,), 4, 4)], ids=["nq0", "nk0", "b0"])
def test_empty_sizes(rng, batch, nq, nk):
    q, k, v = random_qkv(rng, batch, 2, 1, nq, nk, 8, np.float16)
    o, lse = cf.attention_forward(q, k, v)
    assert o.shape == q.shape and o.dtype == np.float16 and lse.shape == q.shape[:-1] and lse.dtype == np.float32
    assert np.all(o == 0)
    if nk == 0:
        assert np.all(np.isneginf(lse))
    grads = cf.attention_backward(q, q, k, v, o, lse)
    for g, like in zip(grads, (q, k, v)):
        assert g.shape == like.shape and g.dtype == np.float16 and np.all(g == 0)
