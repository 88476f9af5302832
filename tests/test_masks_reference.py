"""Masks and biases (issue 17) on the CPU: the reference (plain and tiled) against an independent formula with
broadcasting along every dim, dbias against finite differences and against the reduction of a full-shape dbias,
fully masked rows, the NumPy backend, argument checks and the host-side layout of broadcast arrays."""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import reference
from cupyflash.cuda_backend import _score_layout

B, HQ, HK, NQ, NK, D = 2, 4, 2, 13, 19, 8

#: Shapes broadcastable to (B, Hq, Nq, Nk): every dim broadcast somewhere, fewer dims than the scores too.
SHAPES = [
    (B, HQ, NQ, NK),  # full
    (NQ, NK),  # one matrix for every batch and head (T5-style relative bias)
    (HQ, NQ, NK),  # per head, shared by the batch
    (B, 1, NQ, NK),  # per batch (AlphaFold-style pair bias), shared by the heads
    (B, 1, 1, NK),  # key padding
    (1, HQ, NQ, 1),  # per query row
    (NK,),  # one row for everything
    (B, HQ, 1, 1),  # per (batch, head) scalar
]

VARIANTS = [
    dict(),
    dict(causal=True),
    dict(window_size=(4, 2)),
    dict(softcap=2.0),
    dict(causal=True, softcap=3.0, alibi=True),
    dict(window_size=(6, -1), sinks=True),
    dict(softcap=2.0, alibi=True, sinks=True),
]


def _inputs(rng, dtype=np.float64, nq=NQ, nk=NK):
    q = rng.standard_normal((B, HQ, nq, D)).astype(dtype)
    k = rng.standard_normal((B, HK, nk, D)).astype(dtype)
    v = rng.standard_normal((B, HK, nk, D)).astype(dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, do


def _variant_kw(rng, spec):
    kw = {n: spec[n] for n in ("causal", "window_size", "softcap") if n in spec}
    if spec.get("alibi"):
        kw["alibi_slopes"] = rng.uniform(0.05, 0.5, (B, HQ)).astype(np.float32)
    if spec.get("sinks"):
        kw["sinks"] = rng.uniform(-1.0, 1.5, HQ).astype(np.float32)
    return kw


def _mask(rng, shape, p=0.7):
    m = rng.random(shape) < p
    return m


def _bias(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------------------- the independent formula


def formula(q, k, v, causal=False, window_size=None, softcap=0.0, alibi_slopes=None, sinks=None, mask=None,
            bias=None, scale=None):  # fmt: skip
    """o, lse and P from issue 17's words, written directly: expanded K/V per query head, the whole score matrix,
    scale -> softcap -> ALiBi -> bias -> built-in mask AND mask -> softmax with the sink."""
    b, hq, nq, d = q.shape
    hk, nk = k.shape[-3], k.shape[-2]
    g = hq // hk
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    K = np.repeat(k.astype(np.float64), g, axis=1)
    V = np.repeat(v.astype(np.float64), g, axis=1)
    S = scale * np.einsum("bhid,bhjd->bhij", q.astype(np.float64), K)
    if softcap:
        S = softcap * np.tanh(S / softcap)
    i = np.arange(nq)[:, None] + (nk - nq)
    j = np.arange(nk)[None, :]
    if alibi_slopes is not None:
        S = S - np.asarray(alibi_slopes, np.float64).reshape(-1, hq, 1, 1) * np.abs(i - j)
    if bias is not None:
        S = S + np.broadcast_to(bias.astype(np.float64), S.shape)
    left, right = (-1, -1) if window_size is None else window_size
    if causal:
        right = 0
    vis = np.ones((nq, nk), bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    vis = np.broadcast_to(vis, S.shape)
    if mask is not None:
        vis = vis & np.broadcast_to(mask, S.shape)
    S = np.where(vis, S, -np.inf)
    cols = [S]
    if sinks is not None:
        cols.append(np.broadcast_to(np.asarray(sinks, np.float64).reshape(1, hq, 1, 1), (b, hq, nq, 1)))
    full = np.concatenate(cols, axis=-1)
    m = full.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(full - m)
    l = e.sum(axis=-1, keepdims=True)
    P = np.where(l > 0, e / np.where(l > 0, l, 1.0), 0.0)[..., :nk]
    lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    return P @ V, lse, P


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: "-".join(s) or "plain")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reference_matches_formula(spec, shape, rng):
    q, k, v, _ = _inputs(rng)
    kw = _variant_kw(rng, spec)
    mask, bias = _mask(rng, shape), _bias(rng, shape)
    o_f, lse_f, _ = formula(q, k, v, mask=mask, bias=bias, **kw)
    o, lse = reference.attention_forward(q, k, v, mask=mask, bias=bias, **kw)
    np.testing.assert_allclose(o, o_f, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_f))
    fin = np.isfinite(lse_f)
    np.testing.assert_allclose(lse[fin], lse_f[fin], rtol=1e-12, atol=1e-12)
    ot, lset = reference.tiled_attention_forward(q, k, v, block_q=4, block_k=8, mask=mask, bias=bias, **kw)
    np.testing.assert_allclose(ot, o_f, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lset), np.isneginf(lse_f))


@pytest.mark.parametrize("mask_shape,bias_shape", [(SHAPES[4], SHAPES[3]), (SHAPES[5], SHAPES[1]),
                                                   (SHAPES[0], SHAPES[6]), (SHAPES[7], SHAPES[2])])  # fmt: skip
def test_mask_and_bias_of_different_shapes(mask_shape, bias_shape, rng):
    q, k, v, _ = _inputs(rng)
    mask, bias = _mask(rng, mask_shape), _bias(rng, bias_shape)
    o_f, lse_f, _ = formula(q, k, v, causal=True, mask=mask, bias=bias)
    o, lse = reference.attention_forward(q, k, v, True, mask=mask, bias=bias)
    np.testing.assert_allclose(o, o_f, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- dbias


def _loss(q, k, v, do, kw, bias):
    o, _ = reference.attention_forward(q, k, v, bias=bias, **kw)
    return float((o * do).sum())


@pytest.mark.parametrize("spec", [VARIANTS[0], VARIANTS[4], VARIANTS[5]], ids=["plain", "causal-softcap-alibi",
                                                                                "window-sinks"])  # fmt: skip
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3], SHAPES[4], SHAPES[6]], ids=lambda s: "x".join(map(str, s)))
def test_dbias_finite_differences(spec, shape, rng):
    q, k, v, do = _inputs(rng, nq=6, nk=7)
    shape = tuple(6 if n == NQ else 7 if n == NK else n for n in shape)
    kw = _variant_kw(rng, spec)
    mask = _mask(rng, (B, 1, 6, 7), 0.8)
    kw["mask"] = mask
    bias = _bias(rng, shape)
    o, lse = reference.attention_forward(q, k, v, bias=bias, **kw)
    grads = reference.attention_backward(do, q, k, v, o, lse, bias=bias, bias_grad=True, **kw)
    dbias = grads[-1]
    assert dbias.shape == bias.shape
    eps = 1e-6
    num = np.zeros_like(bias)
    for idx in np.ndindex(bias.shape):
        bp, bm = bias.copy(), bias.copy()
        bp[idx] += eps
        bm[idx] -= eps
        num[idx] = (_loss(q, k, v, do, kw, bp) - _loss(q, k, v, do, kw, bm)) / (2 * eps)
    np.testing.assert_allclose(dbias, num, rtol=1e-6, atol=1e-8)
    tiled = reference.tiled_attention_backward(do, q, k, v, o, lse, block_q=4, block_k=3, bias=bias, bias_grad=True,
                                               **kw)  # fmt: skip
    np.testing.assert_allclose(tiled[-1], dbias, rtol=1e-12, atol=1e-12)
    for a, b in zip(tiled[:-1], grads[:-1]):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
def test_dbias_is_the_full_gradient_summed_over_broadcast_dims(shape, rng):
    q, k, v, do = _inputs(rng)
    bias = _bias(rng, shape)
    full = np.ascontiguousarray(np.broadcast_to(bias, (B, HQ, NQ, NK)))
    kw = dict(causal=True, softcap=2.0)
    o, lse = reference.attention_forward(q, k, v, bias=bias, **kw)
    d_small = reference.attention_backward(do, q, k, v, o, lse, bias=bias, bias_grad=True, **kw)[-1]
    d_full = reference.attention_backward(do, q, k, v, o, lse, bias=full, bias_grad=True, **kw)[-1]
    # the reduction written out: sum the leading dims bias lacks, then keep-dims sums where it has 1
    lead = 4 - len(shape)
    red = d_full.sum(axis=tuple(range(lead)))
    red = red.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)
    np.testing.assert_allclose(d_small, red, rtol=1e-12, atol=1e-12)
    # and the full one is P * (dP - Delta) from the formula
    _, _, P = formula(q, k, v, bias=full, **kw)
    Vr = np.repeat(v, HQ // HK, axis=1)
    dP = do @ Vr.swapaxes(-1, -2)
    Delta = (do * o).sum(-1, keepdims=True)
    np.testing.assert_allclose(d_full, P * (dP - Delta), rtol=1e-10, atol=1e-12)


def test_fully_masked_rows(rng):
    q, k, v, do = _inputs(rng)
    mask = _mask(rng, (B, HQ, NQ, NK))
    mask[:, :, 3, :] = False  # row 3 sees nothing
    mask[1, 2, 7, :] = False
    bias = _bias(rng, (HQ, NQ, NK))
    def tiled_fwd(*a, **kw):
        return reference.tiled_attention_forward(*a, block_q=4, block_k=4, **kw)

    def tiled_bwd(*a, **kw):
        return reference.tiled_attention_backward(*a, block_q=4, block_k=4, **kw)

    for fwd, bwd in ((reference.attention_forward, reference.attention_backward), (tiled_fwd, tiled_bwd)):
        o, lse = fwd(q, k, v, mask=mask, bias=bias)
        assert np.all(o[:, :, 3] == 0) and np.all(o[1, 2, 7] == 0)
        assert np.all(np.isneginf(lse[:, :, 3])) and np.isneginf(lse[1, 2, 7])
        assert np.isfinite(lse).sum() == lse.size - B * HQ - 1
        dq, dk, dv, dbias = bwd(do, q, k, v, o, lse, mask=mask, bias=bias, bias_grad=True)
        assert np.all(dq[:, :, 3] == 0) and np.all(dq[1, 2, 7] == 0)
        assert np.all(dbias[:, 3] == 0) and np.all(np.isfinite(dbias))
        assert np.isfinite(dk).all() and np.isfinite(dv).all()


def test_mask_with_sinks_keyless_row_is_its_sink(rng):
    q, k, v, do = _inputs(rng)
    mask = np.ones((NQ, NK), bool)
    mask[0] = False
    sinks = rng.uniform(-1, 1, HQ).astype(np.float32)
    o, lse = reference.attention_forward(q, k, v, mask=mask, sinks=sinks)
    assert np.all(o[:, :, 0] == 0)
    np.testing.assert_allclose(lse[:, :, 0], np.broadcast_to(sinks.astype(np.float64), (B, HQ)), rtol=1e-12)


# ---------------------------------------------------------------------------- the NumPy backend


@pytest.mark.parametrize("bias_dtype", [np.float32, np.float16])
def test_numpy_backend(bias_dtype, rng):
    q, k, v, do = _inputs(rng, np.float32, nq=40, nk=33)
    mask = _mask(rng, (B, 1, 40, 33))
    bias = _bias(rng, (HQ, 1, 33), bias_dtype)
    o, lse = cupyflash.attention_forward(q, k, v, True, mask=mask, bias=bias)
    ro, rlse = reference.attention_forward(q, k, v, True, mask=mask, bias=bias)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(o, ro, rtol=1e-5, atol=1e-6)
    grads = cupyflash.attention_backward(do, q, k, v, o, lse, True, mask=mask, bias=bias, bias_grad=True)
    assert len(grads) == 4 and grads[3].dtype == bias.dtype and grads[3].shape == bias.shape
    rgrads = reference.attention_backward(do, q, k, v, o, lse, True, mask=mask, bias=bias, bias_grad=True)
    tol = 1e-5 if bias_dtype == np.float32 else 2e-3
    for g, r in zip(grads, rgrads):
        assert np.linalg.norm(g.astype(np.float64) - r) <= tol * np.linalg.norm(r)
    o2, vjp = cupyflash.attention_vjp(q, k, v, True, mask=mask, bias=bias, bias_grad=True)
    np.testing.assert_array_equal(o2, o)
    assert len(vjp(do)) == 4
    # without bias_grad the backward returns dq, dk, dv only
    assert len(cupyflash.attention_backward(do, q, k, v, o, lse, True, mask=mask, bias=bias)) == 3


# ---------------------------------------------------------------------------- argument checks


def test_validation(rng):
    q, k, v, do = _inputs(rng, np.float32)
    full = (B, HQ, NQ, NK)
    o, lse = cupyflash.attention_forward(q, k, v)
    with pytest.raises(TypeError, match="mask.dtype must be bool"):
        cupyflash.attention(q, k, v, mask=np.ones(full, np.int8))
    with pytest.raises(TypeError, match="bias.dtype"):
        cupyflash.attention(q, k, v, bias=np.ones(full, np.int32))
    with pytest.raises(TypeError, match="bias.dtype"):
        cupyflash.attention(q, k, v, bias=np.ones(full, np.float64))  # the reference takes float64; the API does not
    with pytest.raises(ValueError, match=r"mask must broadcast to \(\*batch, Hq, Nq, Nk\)"):
        cupyflash.attention(q, k, v, mask=np.ones((B, HQ, NK, NQ), bool))
    with pytest.raises(ValueError, match="bias must broadcast"):
        cupyflash.attention(q, k, v, bias=np.ones((3, B, HQ, NQ, NK), np.float32))  # more dims than the scores
    with pytest.raises(ValueError, match="bias must broadcast"):
        cupyflash.attention(q, k, v, bias=np.ones((HK, NQ, NK), np.float32))  # heads of k, not q
    with pytest.raises(TypeError, match="mask must be a numpy.ndarray or cupy.ndarray"):
        cupyflash.attention(q, k, v, mask=[[True]])
    with pytest.raises(ValueError, match="bias_grad=True needs a bias"):
        cupyflash.attention_backward(do, q, k, v, o, lse, bias_grad=True)
    with pytest.raises(ValueError, match="bias_grad=True needs a bias"):
        reference.attention_backward(do, q, k, v, o, lse, bias_grad=True)
    with pytest.raises(TypeError, match="bias_grad must be a bool"):
        cupyflash.attention_backward(do, q, k, v, o, lse, bias=np.zeros(full, np.float32), bias_grad=1)
    with pytest.raises(ValueError, match="bias_grad=True needs a bias"):
        reference.attention_vjp(q, k, v, bias_grad=True)
    with pytest.raises(ValueError, match="bias_grad=True needs a bias"):
        cupyflash.attention_vjp(q, k, v, bias_grad=True)
    # the reference takes a float64 bias
    reference.attention(q, k, v, bias=np.zeros((NQ, NK)))


def test_score_layout_is_a_broadcast_view_of_the_strides():
    # a (B, 1, 1, Nk) bf16-sized key-padding bias: batch stride kept, head and query strides 0, keys unit
    shape, strides = (B, 1, 1, NK), (NK * 2, NK * 2, NK * 2, 2)
    full, st, item, _ = _score_layout(shape, strides, 2, 0, (B, HQ, NQ, NK))
    assert full == (B, HQ, NQ, NK) and st == (NK * 2, 0, 0, 2) and item == 2
    # fewer dims than the scores: the missing leading dims broadcast
    full, st, _, _ = _score_layout((NQ, 1), (1, 1), 1, 0, (B, HQ, NQ, NK))
    assert st == (0, 0, 1, 0)


def test_params_get_four_strides_per_score_array():
    from cupyflash.kernels.family import Geometry, base_params
    from cupyflash.kernels.params import PARAMS
    from cupyflash.validation import check_attention

    q = np.zeros((B, HQ, NQ, D), np.float32)
    k = np.zeros((B, HK, NK, D), np.float32)
    p = check_attention(q, k, k, mask=np.zeros((NQ, NK), bool))
    g = Geometry(B, {"q": (1, 2, 3), "mask": (0, 0, NK)}, ({"q": 0, "mask": 0},), True, {"mask": 1})
    rec = np.frombuffer(base_params(p, g, True).to_bytes(), PARAMS)[0]
    assert tuple(rec["mask_s"]) == (0, 0, NK, 1) and tuple(rec["q_s"]) == (1, 2, 3)
    assert "ArrayScore<cupyflash::PlainScore, float, true, false>" in p.variant.cpp_policy


def test_host_layout_of_broadcast_arrays_through_the_params():
    """What the CUDA host path writes for a mask and a bias (no GPU needed): the (b, h, q, k) element strides of the
    broadcast views, the dbias accumulator's, and per-sub-batch byte offsets when the batch dims do not merge."""
    from cupyflash.cuda_backend import _contiguous_strides, _extra_layout, _geometry
    from cupyflash.kernels.family import base_params
    from cupyflash.kernels.params import PARAMS
    from cupyflash.validation import check_attention

    batch = (3, 2)
    q = np.zeros((*batch, HQ, NQ, D), np.float32)
    k = np.zeros((*batch, HK, NK, D), np.float32)
    mask = np.zeros((3, 1, 1, NQ, 2 * NK), bool)[..., ::2]  # every other column: a key stride of 2 bytes
    bias = np.zeros((HQ, 1, NK), np.float16)
    p = check_attention(q, k, k, mask=mask, bias=bias)

    def entry(x):
        return (x.shape, x.strides, x.itemsize, 0)

    def device_like(x):  # what the layout reads of a CuPy array
        return type("A", (), {"shape": x.shape, "strides": x.strides, "itemsize": x.itemsize,
                              "data": type("P", (), {"ptr": 0})})()  # fmt: skip

    layout = {"q": entry(q), "k": entry(k), "v": entry(k)}
    layout["dbias"] = (bias.shape, _contiguous_strides(bias.shape, 4), 4, 0)
    layout.update(_extra_layout(p, {"mask": device_like(mask), "bias": device_like(bias)}, layout))
    g = _geometry(p, layout)
    # mask batch dims (3, 1) broadcast over the second: the batch cannot merge with q's, so one sub-call per outer
    # index, each with the mask's and q's own byte offsets
    assert g.batch == 2 and len(g.offsets) == 3
    assert [o["mask"] for o in g.offsets] == [i * mask.strides[0] for i in range(3)]
    assert [o["q"] for o in g.offsets] == [i * q.strides[0] for i in range(3)]
    assert all(o["bias"] == 0 and o["dbias"] == 0 for o in g.offsets)
    rec = np.frombuffer(base_params(p, g, True).to_bytes(), PARAMS)[0]
    assert tuple(rec["mask_s"]) == (0, 0, 2 * NK, 2)  # b (inner batch broadcast), h broadcast, q, k (every other)
    assert tuple(rec["bias_s"]) == (0, NK, 0, 1)
    assert tuple(rec["dbias_s"]) == (0, NK, 0, 1)
    assert "ArrayScore<cupyflash::PlainScore, __half, true, true>" in p.variant.cpp_policy
