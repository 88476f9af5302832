"""GPU accuracy of the attention variants (issue 13: sliding window, softcap, ALiBi, attention sinks) in every kernel
family, against the float64 NumPy reference.

Each case reaches one family explicitly through the public API (``kernel=...``), forward and backward; outputs
cannot be poisoned through the API, so every result is checked to be NaN-free instead (lse: finite or -inf).

Bounds (issue 13, "Accuracy"):
- float32: relative error <= 1e-5 (o) and 1e-4 (dq, dk, dv, dsinks) against the float64 reference;
- float16/bfloat16: FlashAttention's own criterion, max|x - x_ref| <= 2x (o) / 3x (grads, dsinks) the error
  max|x_naive - x_ref| of a same-dtype naive implementation on the same inputs, plus FlashAttention's floor
  2 * max|(x_ref + 0.3 - 0.3) - x_ref| in the dtype (the rounding error of a value of that size).

The naive implementation materialises the scores and rounds every intermediate (scores, capped scores, biases,
probabilities, products) to the input dtype. Its matmuls are float32 GEMMs on the (exactly representable) 16-bit
inputs whose results are rounded to the dtype once: the same as a 16-bit cuBLAS GEMM with float32 accumulation,
which is what FlashAttention's naive PyTorch reference runs. It is written in float32 CuPy with explicit rounding
for both 16-bit types because CuPy's bfloat16 support does not cover matmul and most elementwise math; the
bfloat16 rounding is done on the float32 bits (round to nearest even). Softmaxes are computed in float32 and
rounded once, as PyTorch's half-precision softmax (forward and backward) does.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import (
    DTYPES, HAS_GPU, TOL_GRAD, TOL_OUT, random_qkv, rel_err, requires_gpu, needs_hopper as _needs_hopper
)

import cupyflash
from cupyflash import reference

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy


#: Head dims each family takes (mma and wgmma need D % 8 == 0; wgmma 32 < D <= 128), spread over the cases.
FAMILY_DIMS = {
    "portable": [32, 59, 64, 96, 128, 192, 256],
    "mma": [32, 64, 96, 128, 192, 256],
    "wgmma": [64, 96, 128],
}


def family_cases():
    """(kernel, dtype name) pairs each family supports."""
    return (
        [("portable", d) for d in DTYPES]
        + [("mma", "float16"), ("mma", "bfloat16")]
        + [pytest.param("wgmma", t, marks=_needs_hopper) for t in ("float16", "bfloat16")]
    )


def _unpack(case):
    return (case.values, case.marks) if hasattr(case, "values") else (case, ())


# (id, (B, Hq, Hk, Nq, Nk), spec). spec: causal, window, softcap, alibi ("head": (Hq,) slopes, "batch": (B, Hq)),
# sinks, scale, logits (a factor on q).
CASES = [
    ("window-0-0", (1, 2, 2, 128, 128), dict(window=(0, 0))),
    ("window-0-0-nq>nk", (2, 2, 1, 200, 77), dict(window=(0, 0))),
    ("window-0-0-nq<nk", (1, 4, 2, 77, 200), dict(window=(0, 0))),
    ("window-16-16", (2, 2, 2, 256, 256), dict(window=(16, 16))),
    ("window-beyond-n", (1, 2, 2, 150, 150), dict(window=(500, 400))),
    ("window-31-0", (1, 2, 2, 300, 300), dict(window=(31, 0))),
    ("window-right-only-nq<nk", (2, 2, 2, 100, 250), dict(window=(-1, 7))),
    ("window-left-only-nq>nk", (2, 2, 2, 250, 100), dict(window=(7, -1))),
    ("window-0-1-softcap-alibi", (1, 4, 2, 96, 96), dict(window=(0, 1), alibi="head", softcap=30.0)),
    ("causal-window-64", (1, 2, 2, 257, 257), dict(causal=True, window=(64, -1))),
    ("causal-window-20-5-gqa", (2, 4, 2, 190, 130), dict(causal=True, window=(20, 5))),  # right = 0 under causal
    ("softcap-30", (2, 2, 2, 200, 200), dict(softcap=30.0)),
    ("softcap-50-causal-nq<nk", (1, 2, 2, 150, 300), dict(softcap=50.0, causal=True)),
    ("softcap-30-large-logits", (1, 2, 2, 160, 160), dict(softcap=30.0, scale=1.0)),  # scores ~ N(0, D): capped
    ("softcap-50-gqa-nq>nk", (1, 8, 2, 300, 100), dict(softcap=50.0, logits=4.0)),
    ("alibi-head", (2, 4, 4, 200, 200), dict(alibi="head")),
    ("alibi-batch-causal-nq<nk", (2, 2, 2, 130, 260), dict(alibi="batch", causal=True)),
    ("alibi-head-gqa-nq>nk", (1, 8, 2, 300, 100), dict(alibi="head")),
    ("alibi-batch-mqa-nq<nk", (2, 4, 1, 64, 257), dict(alibi="batch")),
    # the one-sided strips fold ALiBi's slope into the exponential's scale when it is > 0; else the general form
    ("alibi-causal-negative-scale", (1, 2, 2, 160, 160), dict(alibi="batch", causal=True, scale=-0.05)),
    ("sinks", (2, 2, 2, 200, 200), dict(sinks=True)),
    ("sinks-causal-nq>nk", (2, 3, 1, 250, 100), dict(sinks=True, causal=True)),  # keyless rows: sink only
    ("sinks-gqa-nq<nk", (1, 6, 2, 100, 300), dict(sinks=True)),
    ("sinks-window-0-0-nq>nk", (1, 2, 2, 150, 60), dict(sinks=True, window=(0, 0))),
    ("window-softcap-alibi-sinks-gqa", (2, 4, 2, 180, 220),
     dict(window=(32, 8), softcap=30.0, alibi="batch", sinks=True)),
    ("causal-softcap-alibi-mqa", (1, 4, 1, 300, 300), dict(causal=True, softcap=50.0, alibi="head")),
    ("window-left-sinks-softcap-nq>nk", (2, 2, 2, 220, 180), dict(window=(64, -1), sinks=True, softcap=30.0)),
    ("causal-window-alibi-sinks-nq1", (2, 2, 2, 1, 257), dict(causal=True, window=(10, 0), alibi="head", sinks=True)),
    ("window-0-0-softcap-alibi-sinks-nk1", (1, 2, 2, 257, 1),
     dict(window=(0, 0), softcap=50.0, alibi="head", sinks=True)),
]  # fmt: skip


def variant_params():
    out = []
    for f, fcase in enumerate(family_cases()):
        (kernel, dtype_name), marks = _unpack(fcase)
        dims = FAMILY_DIMS[kernel]
        for i, (name, shape, spec) in enumerate(CASES):
            d = dims[(i + f) % len(dims)]  # each family sees every D of its own over the cases
            out.append(pytest.param(kernel, dtype_name, shape, spec, d, marks=marks,
                                    id=f"{kernel}-{dtype_name}-{name}-d{d}"))  # fmt: skip
    return out


# ---------------------------------------------------------------------------- inputs and the rules written here


def _alibi_slopes(rng, kind, b, hq):
    if kind == "head":  # ALiBi's geometric slopes 2^(-8 (h + 1) / Hq)
        return (2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)).astype(np.float32)
    return rng.uniform(0.01, 0.3, (b, hq)).astype(np.float32)


def make_inputs(rng, dtype_name, shape, spec, d):
    b, hq, hk, nq, nk = shape
    dtype = DTYPES[dtype_name]
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, dtype, spec.get("logits", 1.0))
    do = rng.standard_normal(q.shape).astype(dtype)
    slopes = _alibi_slopes(rng, spec["alibi"], b, hq) if spec.get("alibi") else None
    sinks = rng.uniform(-1.0, 2.5, hq).astype(np.float32) if spec.get("sinks") else None
    kw = {"window_size": spec.get("window"), "softcap": spec.get("softcap", 0.0), "alibi_slopes": slopes,
          "sinks": sinks}  # fmt: skip
    return q, k, v, do, spec.get("causal", False), spec.get("scale"), kw


def visible_mask(nq, nk, causal, window):
    """(Nq, Nk) bool from issue 13's rule: i + Nk - Nq - left <= j <= i + Nk - Nq + right, -1 = unbounded."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    diag = np.arange(nq)[:, None] + (nk - nq)
    j = np.arange(nk)[None, :]
    vis = np.ones((nq, nk), dtype=bool)
    if left >= 0:
        vis &= j >= diag - left
    if right >= 0:
        vis &= j <= diag + right
    return vis


def _device_kw(kw):
    return {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}


# ---------------------------------------------------------------------------- the same-dtype naive implementation


def _rounder(dtype_name):
    """x (float32 CuPy) -> x rounded to the dtype, kept in float32."""
    if dtype_name == "float16":
        return lambda x: x.astype(cupy.float16).astype(cupy.float32)
    if dtype_name == "bfloat16":
        half, one, top = np.uint32(0x7FFF), np.uint32(1), np.uint32(0xFFFF0000)

        def to_bf16(x):  # round to nearest even on the float32 bits (no NaNs reach here)
            u = cupy.ascontiguousarray(x, dtype=cupy.float32).view(cupy.uint32)
            u = (u + half + ((u >> np.uint32(16)) & one)) & top
            return u.view(cupy.float32)

        return to_bf16
    return lambda x: x


def naive_attention(q, k, v, do, causal, scale, kw, dtype_name):
    """o, dq, dk, dv (and dsinks) of a materialised implementation in the input dtype (see the module docstring).
    Host 16-bit arrays in, host float64 arrays out."""
    R = _rounder(dtype_name)
    f32 = lambda x: cupy.asarray(np.asarray(x, dtype=np.float32))  # noqa: E731 - 16-bit values are exact
    b, hq, nq, d = q.shape
    hk, nk = k.shape[-3], k.shape[-2]
    group = hq // hk
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    Q, dO = f32(q), f32(do)
    K, V = cupy.repeat(f32(k), group, axis=-3), cupy.repeat(f32(v), group, axis=-3)  # (B, Hq, Nk, D)
    S = R(R(Q @ K.swapaxes(-1, -2)) * np.float32(scale))
    cap = float(kw["softcap"])
    if cap > 0:
        T = R(cupy.tanh(R(S / np.float32(cap))))
        S = R(np.float32(cap) * T)
    if kw["alibi_slopes"] is not None:
        slopes = f32(kw["alibi_slopes"]).reshape(-1, hq, 1, 1)
        dist = cupy.asarray(np.abs(np.arange(nq)[:, None] + (nk - nq) - np.arange(nk)[None, :]).astype(np.float32))
        S = R(S - R(slopes * dist))
    vis = cupy.asarray(visible_mask(nq, nk, causal, kw["window_size"]))
    S = cupy.where(vis, S, np.float32(-np.inf))
    # softmax in float32 over the keys and the sink, rounded once
    m = S.max(axis=-1, keepdims=True) if nk else cupy.full((b, hq, nq, 1), -cupy.inf, dtype=cupy.float32)
    sink = None if kw["sinks"] is None else f32(kw["sinks"]).reshape(1, hq, 1, 1)
    if sink is not None:
        m = cupy.maximum(m, sink)
    m = cupy.where(cupy.isfinite(m), m, np.float32(0.0))
    E = cupy.exp(S - m)
    ls = E.sum(axis=-1, keepdims=True)
    if sink is not None:
        e_sink = cupy.exp(sink - m)
        ls = ls + e_sink
    ls = cupy.where(ls > 0, ls, np.float32(1.0))
    P = R(E / ls)
    O = R(P @ V)
    # backward, each product rounded to the dtype; softmax's backward in float32, rounded once
    dV = R((P.swapaxes(-1, -2) @ dO).reshape(b, hk, group, nk, d).sum(axis=2))
    dP = R(dO @ V.swapaxes(-1, -2))
    Delta = (P * dP).sum(axis=-1, keepdims=True)  # the sink's dP is 0 (its value is 0)
    dS = R(P * (dP - Delta))
    if cap > 0:
        dS = R(dS * R(1.0 - T * T))
    dQ = R(R(dS @ K) * np.float32(scale))
    dK = R(R((dS.swapaxes(-1, -2) @ Q).reshape(b, hk, group, nk, d).sum(axis=2)) * np.float32(scale))
    out = [O, dQ, dK, dV]
    if sink is not None:
        P_sink = R(e_sink / ls)
        out.append(-R(P_sink * Delta).sum(axis=(0, 2, 3)))
    return [cupy.asnumpy(x).astype(np.float64) for x in out]


# ---------------------------------------------------------------------------- the checks


def fa_floor(x_ref, dtype_name):
    """FlashAttention's absolute floor: 2 * max|(x_ref + 0.3 - 0.3) - x_ref| with x_ref and each step in the dtype."""
    dt = DTYPES[dtype_name]
    r = np.asarray(x_ref, dtype=np.float64).astype(dt).astype(np.float64)
    y = (r + np.float64(np.float32(0.3))).astype(dt).astype(np.float64)
    y = (y - np.float64(np.float32(0.3))).astype(dt).astype(np.float64)
    return 2.0 * float(np.abs(y - r).max(initial=0.0))


def assert_fa_criterion(name, x, x_ref, x_naive, dtype_name, factor):
    err = float(np.abs(np.asarray(x, np.float64) - x_ref).max(initial=0.0))
    naive_err = float(np.abs(x_naive - x_ref).max(initial=0.0))
    bound = factor * naive_err + fa_floor(x_ref, dtype_name)
    assert err <= bound, f"{name}: max err {err:.3g} > {factor} x naive {naive_err:.3g} + floor"


def assert_float32_close(name, x, x_ref, tol):
    if np.abs(x_ref).max(initial=0.0) <= 1e-9:
        # the exact value is 0 (a row with one key and no sink has P = 1, so dS = 0): the reference holds
        # rounding noise only, where a relative error means nothing
        assert np.abs(np.asarray(x, np.float64)).max(initial=0.0) <= tol, f"{name} not ~0"
        return
    e = rel_err(x, x_ref)
    assert e <= tol, f"{name}: rel err {e:.3g} > {tol:.3g}"


def check_case(kernel, dtype_name, q, k, v, do, causal, scale, kw, to_device=None, vjp=False):
    """Forward and backward through ``kernel`` against the reference (and the naive implementation for 16 bits);
    ``to_device`` makes the device arrays (cupy.asarray when None)."""
    to_device = to_device or cupy.asarray
    qd, kd, vd, dod = (to_device(x) for x in (q, k, v, do))
    kwd = _device_kw(kw)
    if vjp:
        o, fn = cupyflash.attention_vjp(qd, kd, vd, causal, scale, kernel=kernel, **kwd)
        lse = cupyflash.attention_forward(qd, kd, vd, causal, scale, kernel=kernel, **kwd)[1]
        grads = fn(dod)
    else:
        o, lse = cupyflash.attention_forward(qd, kd, vd, causal, scale, kernel=kernel, **kwd)
        grads = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, scale, kernel=kernel, **kwd)
    with_sinks = kw["sinks"] is not None
    assert len(grads) == (4 if with_sinks else 3)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == np.float32 and lse.shape == q.shape[:-1]
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
    if with_sinks:
        assert grads[3].dtype == np.float32 and grads[3].shape == (q.shape[-3],)
    o, lse = o.get().astype(np.float64), lse.get().astype(np.float64)
    got = [g.get().astype(np.float64) for g in grads]
    # NaN-free: o and every gradient finite, lse finite or -inf
    assert np.isfinite(o).all(), "o has NaN/inf"
    assert not np.isnan(lse).any() and not np.isposinf(lse).any(), "lse has NaN/+inf"
    for name, g in zip(("dq", "dk", "dv", "dsinks"), got):
        assert np.isfinite(g).all(), f"{name} has NaN/inf"

    ro, rlse = reference.attention_forward(q, k, v, causal, scale, **kw)
    rgrads = reference.attention_backward(do, q, k, v, ro, rlse, causal, scale, **kw)

    # lse: -inf exactly where the reference has it (rows with no key and no sink), close elsewhere
    masked = np.isneginf(rlse)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    np.testing.assert_allclose(lse[~masked], rlse[~masked], rtol=1e-5 if dtype_name == "float32" else 2e-3,
                               atol=1e-4)  # fmt: skip
    # rows that see no key: o = 0 and dq = 0 (with a sink too: its value is 0), never NaN
    keyless = ~visible_mask(q.shape[-2], k.shape[-2], causal, kw["window_size"]).any(axis=1)
    if keyless.any():
        assert np.all(o[..., keyless, :] == 0) and np.all(got[0][..., keyless, :] == 0)

    names = ["o", "dq", "dk", "dv", "dsinks"]
    outs, refs = [o] + got, [ro] + list(rgrads)
    if dtype_name == "float32":
        tols = [TOL_OUT["float32"]] + [TOL_GRAD["float32"]] * 4
        for name, x, r, tol in zip(names, outs, refs, tols):
            assert_float32_close(f"{kernel} {name}", x, r, tol)
    else:
        naive = naive_attention(q, k, v, do, causal, scale, kw, dtype_name)
        for i, (name, x, r, n) in enumerate(zip(names[:4], outs, refs, naive)):
            assert_fa_criterion(f"{kernel} {dtype_name} {name}", x, r, n, dtype_name, 2 if i == 0 else 3)
        if with_sinks:
            # dsinks = -sum P_sink * rowsum(dO * O) takes O as stored, in the dtype (as every FlashAttention
            # backward's Delta does), while the naive one's Delta is rowsum(P * dP) (softmax's backward) and
            # does not see O's rounding. Where few rows add up (Nk = 1, short windows) that rounding alone can
            # exceed the naive error, so the naive error counted here is at least what the float64 reference
            # itself makes when handed the kernel's O.
            ds_own_o = reference.attention_backward(do, q, k, v, o, rlse, causal, scale, **kw)[3]
            inherent = np.abs(ds_own_o - refs[4]).max(initial=0.0)
            naive_ds = refs[4] + np.sign(naive[4] - refs[4]) * np.maximum(np.abs(naive[4] - refs[4]), inherent)
            assert_fa_criterion(f"{kernel} {dtype_name} dsinks", outs[4], refs[4], naive_ds, dtype_name, 3)


# ---------------------------------------------------------------------------- the sweep


@pytest.mark.parametrize("kernel,dtype_name,shape,spec,d", variant_params())
def test_variant(kernel, dtype_name, shape, spec, d, rng):
    q, k, v, do, causal, scale, kw = make_inputs(rng, dtype_name, shape, spec, d)
    check_case(kernel, dtype_name, q, k, v, do, causal, scale, kw)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_strided_views_and_vjp(kernel, dtype_name, rng):
    """(B, N, H, D) arrays seen as (B, H, N, D), every variant at once, through attention_vjp."""

    def bnhd_view(x):
        return cupy.asarray(np.ascontiguousarray(x.swapaxes(-3, -2))).swapaxes(-3, -2)

    spec = dict(window=(40, 3), softcap=30.0, alibi="batch", sinks=True)
    q, k, v, do, causal, scale, kw = make_inputs(rng, dtype_name, (2, 4, 2, 130, 170), spec, 64)
    check_case(kernel, dtype_name, q, k, v, do, causal, scale, kw, to_device=bnhd_view, vjp=True)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_auto_finds_a_family(dtype_name, rng):
    """kernel="auto" runs every combination (here all four variants with causal, GQA and an odd D)."""
    spec = dict(causal=True, window=(50, -1), softcap=50.0, alibi="head", sinks=True)
    q, k, v, do, causal, scale, kw = make_inputs(rng, dtype_name, (2, 4, 2, 140, 200), spec, 72)
    check_case("auto", dtype_name, q, k, v, do, causal, scale, kw)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_sink_rows_without_keys_and_dsinks(kernel, dtype_name, rng):
    """Nq > Nk with a causal window: most rows see only their sink (o = 0, lse = sink, P_sink = 1); dsinks then
    reduces over rows whose sink share is 1, rows whose share is small, and a batch."""
    q, k, v, do, causal, scale, kw = make_inputs(rng, dtype_name, (3, 2, 1, 200, 50), dict(causal=True, window=(4, -1),
                                                 sinks=True), 64)  # fmt: skip
    check_case(kernel, dtype_name, q, k, v, do, causal, scale, kw)
    o, lse = cupyflash.attention_forward(*(cupy.asarray(x) for x in (q, k, v)), causal, kernel=kernel,
                                         **_device_kw(kw))  # fmt: skip
    keyless = ~visible_mask(200, 50, causal, kw["window_size"]).any(axis=1)
    assert keyless.sum() == 150
    np.testing.assert_allclose(lse.get()[..., keyless], np.broadcast_to(kw["sinks"][:, None], (3, 2, 150)),
                               rtol=1e-6, atol=1e-6)


_LONG = {}


def _long_window_inputs(dtype_name):
    """A window of 1024 at N = 4096 (one batch, one head): inputs and the dense-masked float64 reference, made once
    per dtype."""
    if dtype_name not in _LONG:
        rng = np.random.default_rng(4096)
        q, k, v = random_qkv(rng, (1,), 1, 1, 4096, 4096, 64, DTYPES[dtype_name])
        do = rng.standard_normal(q.shape).astype(DTYPES[dtype_name])
        _LONG[dtype_name] = (q, k, v, do)
    return _LONG[dtype_name]


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_long_window(kernel, dtype_name):
    """Window (1024, 0) at N = 4096: tiles outside the band are skipped, tiles inside unmasked, the band's edges
    masked per element; the result is the dense masked reference's."""
    q, k, v, do = _long_window_inputs(dtype_name)
    kw = {"window_size": (1024, 0), "softcap": 0.0, "alibi_slopes": None, "sinks": None}
    check_case(kernel, dtype_name, q, k, v, do, False, None, kw)
