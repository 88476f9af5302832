"""GPU accuracy of masks and biases (issue 17) in every kernel family, forward and backward (with dbias), against
the float64 NumPy reference.

Each case reaches one family explicitly: through the family's entry point with NaN-poisoned outputs (o, lse, dq,
dk, dv; dsinks and a broadcast bias's dbias are zeroed accumulators by design; a full-shape bias's dbias is the
output itself, stored pair by pair: NaN-poisoned too unless the built-in mask skips tiles, whose pairs the
caller zeroes), and once through the public API (``kernel=...``), which also covers the host cache and dbias's
conversion to the bias's dtype.

Bounds (as tests/test_variants_gpu.py, issue 13/17 "Accuracy"): float32 relative error <= 1e-5 (o) and 1e-4 (dq,
dk, dv, dsinks, dbias); float16/bfloat16 FlashAttention's criterion against a same-dtype naive implementation
(2x for o, 3x for gradients, plus its rounding floor). The naive implementation here is test_variants_gpu's with
the bias added (rounded to the dtype) after softcap and ALiBi, the mask ANDed with the built-in one, and dbias the
dtype-rounded dS summed to the bias's shape.

To keep the file's compile time small every case of a (family, dtype) uses D = 64 and one of two policies:
(Causal, bias of the input dtype) and (Window + softcap + ALiBi + sinks, bias of the input dtype); a call without
a bias compiles the float-bias kernels, so the mask-only case runs for float32 only.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, requires_gpu
from test_variants_gpu import (
    _device_kw,
    _rounder,
    _unpack,
    assert_fa_criterion,
    assert_float32_close,
    family_cases,
    visible_mask,
)

from cupyflash import reference
from cupyflash.validation import check_attention, check_backward

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

D = 64

# (id, (B, Hq, Hk, Nq, Nk), spec). spec: causal, window, softcap, alibi, sinks; mask/bias: a shape broadcastable
# to (B, Hq, Nq, Nk) (None: no such array); mask_p: the fraction of True; keyless: query rows whose mask is all
# False (fully masked rows).
CASES = [
    ("causal-keypad-mask-head-bias", (2, 4, 2, 150, 170),
     dict(causal=True, mask=(2, 1, 1, 170), mask_p=0.85, bias=(4, 150, 170))),
    ("window-softcap-alibi-sinks-gqa-full-mask-pair-bias", (2, 4, 2, 130, 110),
     dict(window=(24, 8), softcap=30.0, alibi=True, sinks=True, mask=(2, 4, 130, 110), mask_p=0.8,
          bias=(2, 1, 130, 110))),
    ("causal-nq>nk-fully-masked-rows-key-bias", (1, 2, 2, 200, 90),
     dict(causal=True, mask=(1, 1, 200, 1), keyless=(150, 151, 199), bias=(90,))),
    # mask only for float32 (its kernels are the float-bias ones: no extra compile); a (Hq, 1, Nk) bias otherwise
    ("causal-full-mask-head-key-bias-mqa", (2, 4, 1, 97, 97),
     dict(causal=True, mask=(1, 4, 97, 97), mask_p=0.6, bias=(4, 1, 97), no_bias_for="float32")),
    # Full-shape biases: dbias stored in the bias's dtype, one element per pair (no atomics, no accumulator).
    ("full-bias-full-mask", (2, 4, 2, 150, 170), dict(mask=(2, 4, 150, 170), mask_p=0.85, bias=(2, 4, 150, 170))),
    ("causal-nq>nk-full-bias-keyless-rows", (2, 4, 2, 130, 110),
     dict(causal=True, mask=(2, 4, 130, 110), keyless=(100, 129), bias=(2, 4, 130, 110))),
    ("window-softcap-alibi-full-bias-b1", (1, 2, 1, 200, 180),
     dict(window=(32, 16), softcap=30.0, alibi=True, bias=(1, 2, 200, 180))),
]  # fmt: skip


def _family(kernel):
    from cupyflash.kernels import mma, portable, wgmma

    return {"portable": portable, "mma": mma, "wgmma": wgmma}[kernel]


def masks_params():
    out = []
    for fcase in family_cases():
        (kernel, dtype_name), marks = _unpack(fcase)
        for name, shape, spec in CASES:
            out.append(pytest.param(kernel, dtype_name, shape, spec, marks=marks, id=f"{kernel}-{dtype_name}-{name}"))
    return out


def make_inputs(rng, dtype_name, shape, spec, D=D):
    b, hq, hk, nq, nk = shape
    dtype = DTYPES[dtype_name]
    q = rng.standard_normal((b, hq, nq, D)).astype(dtype)
    k = rng.standard_normal((b, hk, nk, D)).astype(dtype)
    v = rng.standard_normal((b, hk, nk, D)).astype(dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    kw = {"window_size": spec.get("window"), "softcap": spec.get("softcap", 0.0), "alibi_slopes": None, "sinks": None,
          "mask": None, "bias": None}  # fmt: skip
    if spec.get("alibi"):
        kw["alibi_slopes"] = rng.uniform(0.01, 0.3, (b, hq)).astype(np.float32)
    if spec.get("sinks"):
        kw["sinks"] = rng.uniform(-1.0, 2.5, hq).astype(np.float32)
    if spec.get("mask"):
        mask = rng.random(spec["mask"]) < spec.get("mask_p", 0.9)
        if spec.get("keyless"):
            mask = np.ones(spec["mask"], bool)
            mask[..., list(spec["keyless"]), :] = False
        kw["mask"] = mask
    if spec.get("bias") and spec.get("no_bias_for") != dtype_name:
        kw["bias"] = (rng.standard_normal(spec["bias"]) * 2.0).astype(dtype)  # scores ~ N(0, 1) + a bias of std 2
    return q, k, v, do, spec.get("causal", False), kw


def naive(q, k, v, do, causal, kw, dtype_name):
    """o, dq, dk, dv[, dsinks][, dbias] of a materialised implementation in the input dtype."""
    R = _rounder(dtype_name)
    f32 = lambda x: cupy.asarray(np.asarray(x, dtype=np.float32))  # noqa: E731 - 16-bit values are exact
    b, hq, nq, d = q.shape
    hk, nk = k.shape[-3], k.shape[-2]
    group = hq // hk
    scale = np.float32(1.0 / np.sqrt(d))
    Q, dO = f32(q), f32(do)
    K, V = cupy.repeat(f32(k), group, axis=-3), cupy.repeat(f32(v), group, axis=-3)
    S = R(R(Q @ K.swapaxes(-1, -2)) * scale)
    cap = float(kw["softcap"])
    if cap > 0:
        T = R(cupy.tanh(R(S / np.float32(cap))))
        S = R(np.float32(cap) * T)
    if kw["alibi_slopes"] is not None:
        slopes = f32(kw["alibi_slopes"]).reshape(-1, hq, 1, 1)
        dist = cupy.asarray(np.abs(np.arange(nq)[:, None] + (nk - nq) - np.arange(nk)[None, :]).astype(np.float32))
        S = R(S - R(slopes * dist))
    if kw["bias"] is not None:
        S = R(S + f32(kw["bias"]))
    vis = cupy.asarray(visible_mask(nq, nk, causal, kw["window_size"]))
    if kw["mask"] is not None:
        vis = vis & cupy.asarray(kw["mask"])
    S = cupy.where(vis, S, np.float32(-np.inf))
    m = S.max(axis=-1, keepdims=True)
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
    dV = R((P.swapaxes(-1, -2) @ dO).reshape(b, hk, group, nk, d).sum(axis=2))
    dP = R(dO @ V.swapaxes(-1, -2))
    Delta = (P * dP).sum(axis=-1, keepdims=True)
    dS_score = R(P * (dP - Delta))
    dS = R(dS_score * R(1.0 - T * T)) if cap > 0 else dS_score
    dQ = R(R(dS @ K) * scale)
    dK = R(R((dS.swapaxes(-1, -2) @ Q).reshape(b, hk, group, nk, d).sum(axis=2)) * scale)
    out = [O, dQ, dK, dV]
    if sink is not None:
        out.append(-R(R(e_sink / ls) * Delta).sum(axis=(0, 2, 3)))
    if kw["bias"] is not None:
        shape = kw["bias"].shape
        red = dS_score.sum(axis=tuple(range(4 - len(shape))))
        red = red.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)
        out.append(R(red))
    return [cupy.asnumpy(x).astype(np.float64) for x in out]


def _poisoned(shape, dtype):
    return cupy.full(shape, np.nan, dtype=dtype)


def run_family(kernel, q, k, v, do, causal, kw):
    """Forward and backward through the family's entry points into NaN-poisoned outputs."""
    fam = _family(kernel)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    kwd = _device_kw(kw)
    p = check_attention(qd, kd, vd, causal=causal, **kwd)
    arrays = {n: kwd[a] for n, a in (("alibi", "alibi_slopes"), ("sinks", "sinks"), ("mask", "mask"),
                                     ("bias", "bias")) if kwd[a] is not None}  # fmt: skip
    o, lse = _poisoned(q.shape, q.dtype), _poisoned(q.shape[:-1], np.float32)
    fam.forward(qd, kd, vd, o, lse, p, variant_arrays=arrays)
    dq, dk, dv = _poisoned(q.shape, q.dtype), _poisoned(k.shape, k.dtype), _poisoned(v.shape, v.dtype)
    acc = dict(arrays)
    extra = []
    if kw["sinks"] is not None:
        acc["dsinks"] = cupy.zeros((q.shape[-3],), np.float32)
        extra.append(acc["dsinks"])
    if kw["bias"] is not None:
        acc["dbias"] = dbias_buffer(kw["bias"], (*q.shape[:-1], k.shape[-2]), causal or kw["window_size"] is not None)
        extra.append(acc["dbias"])
    pb = check_backward(dod, qd, kd, vd, o, lse, causal=causal, bias_grad=kw["bias"] is not None, **kwd)
    fam.backward(dod, qd, kd, vd, o, lse, dq, dk, dv, pb, variant_arrays=acc)
    return o, lse, [dq, dk, dv, *extra]


def dbias_buffer(bias, full, skips_tiles):
    """dbias as a caller of a family's backward gives it: for a full-shape bias the output itself in the bias's
    dtype, NaN-poisoned (every pair of every visited tile is stored) or zeroed where the built-in mask skips whole
    tiles; for a broadcast bias a zeroed float32 accumulator."""
    if (1,) * (len(full) - bias.ndim) + bias.shape != tuple(full):
        return cupy.zeros(bias.shape, np.float32)
    return cupy.zeros(bias.shape, bias.dtype) if skips_tiles else _poisoned(bias.shape, bias.dtype)


def check(kernel, dtype_name, q, k, v, do, causal, kw, o, lse, grads):
    o, lse = o.get().astype(np.float64), lse.get().astype(np.float64)
    got = [g.get().astype(np.float64) for g in grads]
    assert np.isfinite(o).all(), "o has NaN/inf (poisoned output not fully written?)"
    assert not np.isnan(lse).any() and not np.isposinf(lse).any(), "lse has NaN/+inf"
    for i, g in enumerate(got):
        assert np.isfinite(g).all(), f"gradient {i} has NaN/inf"
    ro, rlse = reference.attention_forward(q, k, v, causal, **kw)
    rgrads = reference.attention_backward(do, q, k, v, ro, rlse, causal, bias_grad=kw["bias"] is not None, **kw)
    masked = np.isneginf(rlse)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    np.testing.assert_allclose(lse[~masked], rlse[~masked], rtol=1e-5 if dtype_name == "float32" else 2e-3,
                               atol=1e-4)  # fmt: skip
    if masked.any():  # fully masked rows: o = 0, dq = 0
        assert np.all(o[masked] == 0) and np.all(got[0][masked] == 0)
    names = ["o", "dq", "dk", "dv"] + (["dsinks"] if kw["sinks"] is not None else []) + (
        ["dbias"] if kw["bias"] is not None else [])
    outs, refs = [o] + got, [ro] + list(rgrads)
    assert len(outs) == len(refs) == len(names)
    if dtype_name == "float32":
        for i, (name, x, r) in enumerate(zip(names, outs, refs)):
            assert_float32_close(f"{kernel} {name}", x, r, 1e-5 if i == 0 else 1e-4)
        return
    nv = naive(q, k, v, do, causal, kw, dtype_name)
    for i, (name, x, r, n) in enumerate(zip(names, outs, refs, nv)):
        if name == "dsinks":  # as test_variants_gpu: Delta takes O as stored; count that rounding as inherent
            own = reference.attention_backward(do, q, k, v, outs[0], rlse, causal, **kw)[3]
            inherent = np.abs(own - r).max(initial=0.0)
            n = r + np.sign(n - r) * np.maximum(np.abs(n - r), inherent)
        assert_fa_criterion(f"{kernel} {dtype_name} {name}", x, r, n, dtype_name, 2 if i == 0 else 3)


@pytest.mark.parametrize("kernel,dtype_name,shape,spec", masks_params())
def test_masks_and_biases(kernel, dtype_name, shape, spec, rng):
    q, k, v, do, causal, kw = make_inputs(rng, dtype_name, shape, spec)
    o, lse, grads = run_family(kernel, q, k, v, do, causal, kw)
    check(kernel, dtype_name, q, k, v, do, causal, kw, o, lse, grads)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_public_api_strided_bias_and_mask(kernel, dtype_name, rng):
    """Through attention_forward/attention_backward(kernel=...): a bias and a mask that are transposed views (the
    key axis strided, never copied), dbias returned in the bias's dtype and shape; a second call hits the cache."""
    import cupyflash

    q, k, v, do, causal, kw = make_inputs(rng, dtype_name, (2, 4, 2, 150, 170), CASES[0][2])
    bias_t = cupy.asarray(np.ascontiguousarray(np.swapaxes(kw["bias"], -1, -2)))  # (Hq, Nk, Nq)
    mask_t = cupy.asarray(np.ascontiguousarray(np.swapaxes(rng.random((2, 4, 150, 170)) < 0.8, -1, -2)))
    biasd, maskd = bias_t.swapaxes(-1, -2), mask_t.swapaxes(-1, -2)
    assert biasd.strides[-1] != biasd.itemsize and maskd.strides[-1] != 1
    kw = {**kw, "bias": cupy.asnumpy(biasd), "mask": cupy.asnumpy(maskd)}
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    for _ in range(2):
        o, lse = cupyflash.attention_forward(qd, kd, vd, causal, kernel=kernel, mask=maskd, bias=biasd)
        grads = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, kernel=kernel, mask=maskd, bias=biasd,
                                             bias_grad=True)  # fmt: skip
        assert len(grads) == 4 and grads[3].dtype == biasd.dtype and grads[3].shape == biasd.shape
    check(kernel, dtype_name, q, k, v, do, causal, kw, o, lse, grads)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_public_api_full_bias_stored_and_deterministic(kernel, dtype_name, rng):
    """A full-shape bias through the public API: dbias comes back in the bias's dtype and shape straight from the
    kernels (stored per pair, no atomics), so deterministic=True accepts it and two runs agree bit for bit; a
    broadcast bias with deterministic=True is still refused (its dbias sums with atomics)."""
    import cupyflash

    shape, spec = (2, 4, 2, 140, 150), dict(mask=(2, 4, 140, 150), mask_p=0.8, bias=(2, 4, 140, 150))
    q, k, v, do, causal, kw = make_inputs(rng, dtype_name, shape, spec)
    qd, kd, vd, dod, maskd, biasd = (cupy.asarray(x) for x in (q, k, v, do, kw["mask"], kw["bias"]))
    o, lse = cupyflash.attention_forward(qd, kd, vd, causal, kernel=kernel, mask=maskd, bias=biasd)
    runs = [cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, kernel=kernel, mask=maskd, bias=biasd,
                                         bias_grad=True, deterministic=True) for _ in range(2)]  # fmt: skip
    assert runs[0][3].dtype == biasd.dtype and runs[0][3].shape == biasd.shape
    for a, b in zip(*runs):
        assert np.array_equal(a.get().view(np.uint8), b.get().view(np.uint8))
    check(kernel, dtype_name, q, k, v, do, causal, kw, o, lse, runs[0])
    with pytest.raises(NotImplementedError, match="broadcast bias"):
        cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, kernel=kernel, mask=maskd, bias=biasd[0],
                                     bias_grad=True, deterministic=True)  # fmt: skip


@pytest.mark.parametrize("dtype_name", ["bfloat16"])
@pytest.mark.parametrize("bias_shape", [(3, 100, 120), (2, 3, 100, 120)], ids=["broadcast", "full"])
def test_mma_d_split_adds_dbias_once(dtype_name, bias_shape, rng):
    """The mma key-major backward at D = 192 splits dK/dV's columns over 2 warps that recompute the same dS^T: only
    one of them gives dbias (atomics would otherwise add it twice)."""
    from cupyflash.plans.mma import BACKWARD_CONFIGS

    assert BACKWARD_CONFIGS[192].d_split > 1  # the path this test is for
    q, k, v, do, causal, kw = make_inputs(rng, dtype_name, (2, 3, 3, 100, 120), dict(bias=bias_shape), D=192)
    o, lse, grads = run_family("mma", q, k, v, do, causal, kw)
    check("mma", dtype_name, q, k, v, do, causal, kw, o, lse, grads)
