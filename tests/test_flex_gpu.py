"""GPU accuracy of user snippets (issue 17 part 3: mask_mod, score_mod, score_mod_grad, aux, block_mask) in every
kernel family, forward and backward.

The kernels run the C++ snippet; the float64 NumPy reference runs its Python twin (the same function written with
NumPy on broadcast index arrays), and each case lists the two side by side. Outputs are NaN-poisoned before each
launch (o, lse, dq, dk, dv; dsinks is a zeroed accumulator by design); each family is reached explicitly through
its entry point, and once through the public API (``kernel=...``, which also builds the block mask on the GPU).

Bounds (tests/test_variants_gpu.py): float32 relative error <= 1e-5 (o) and 1e-4 (gradients) against the
reference; float16/bfloat16 FlashAttention's criterion against a same-dtype naive implementation with the same
twins (2x for o, 3x for gradients, plus its rounding floor). To keep compile time small (< 2 min with every
compile on an H100), D = 64 and one dtype per family (portable float32, mma bfloat16, wgmma float16), three
snippet sets:

- doc-t5: a packed batch of documents (aux int32 (B, N) document ids), causal, a T5-style bucketed relative bias
  from an aux (Hq, 32) table (a function body), GQA, sinks, with a block mask (and without: equal results);
- prefix-lm: keys before a per-batch prefix length (aux int32 (B,)) or causal, Nq != Nk, with its block mask;
- softcap-alibi: softcap and ALiBi written as a score_mod (slopes from aux, the cap an aux scalar) against the
  built-in softcap + ALiBi kernels of the same family (within rounding) and against the reference;
- with dropout and the deterministic backward (portable float32, prefix-lm).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, requires_gpu, HOPPER
from test_variants_gpu import assert_fa_criterion, assert_float32_close

import cupyflash
from cupyflash import flex, reference
from cupyflash.validation import check_attention

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

D = 64
FAMILIES = [("portable", "float32"), ("mma", "bfloat16"),
            pytest.param("wgmma", "float16", marks=pytest.mark.skipif(not HOPPER, reason="wgmma needs sm_90a"))]
NB = 32  # T5 buckets


def _family(kernel):
    from cupyflash.kernels import mma, portable, wgmma

    return {"portable": portable, "mma": mma, "wgmma": wgmma}[kernel]


def _doc_ids(rng, b, n, docs):
    out = np.empty((b, n), np.int32)
    for i in range(b):
        cuts = np.sort(rng.choice(np.arange(1, n), docs - 1, replace=False))
        out[i] = np.searchsorted(cuts, np.arange(n), side="right")
    return out


def _t5_bucket(rel):
    """T5's bidirectional bucket of a relative position (NumPy twin of the C++ body below): 16 buckets per sign,
    8 exact, then log-spaced up to distance 128."""
    n = np.abs(rel)
    # 2 log2(n / 8) is an integer at n = 16, 32, 64: the 1e-3 keeps float32 (C++) and float64 on the same side
    big = 8 + np.floor(2 * np.log2(np.maximum(n, 1) / 8.0) + 1e-3).astype(np.int64)
    return np.where(rel > 0, 16, 0) + np.where(n < 8, n, np.minimum(big, 15))


T5_CPP = """{
  const int rel = kv_idx - q_idx;
  const int n = abs(rel);
  int bucket = n < 8 ? n : min(8 + (int)floorf(2.f * log2f((float)n / 8.f) + 1e-3f), 15);
  bucket += rel > 0 ? 16 : 0;
  return score + table(h, bucket);
}"""


def make_case(name, rng, dtype):
    """(shape, causal, keyword args for the kernels (C++ snippets, CuPy aux), the same for the reference (twins,
    NumPy aux), a twin of the builtin comparison kernel's keywords or None)."""
    if name == "doc-t5":
        b, hq, hk, nq, nk = 2, 4, 2, 300, 300
        doc = _doc_ids(rng, b, nq, 5)
        table = rng.standard_normal((hq, NB)).astype(np.float32)
        sinks = rng.uniform(-1, 2, hq).astype(np.float32)
        cpp = dict(mask_mod="doc(b, q_idx) == doc(b, kv_idx)", score_mod=T5_CPP, score_mod_grad="1.f",
                   aux={"doc": doc, "table": table}, sinks=sinks)  # fmt: skip
        twin = dict(mask_mod=lambda b_, h, i, j: doc[b_, i] == doc[b_, j],
                    score_mod=lambda s, b_, h, i, j: s + table[h, _t5_bucket(j - i)],
                    score_mod_grad=lambda ns, b_, h, i, j: np.ones_like(ns), sinks=sinks)  # fmt: skip
        return (b, hq, hk, nq, nk), True, cpp, twin, None, (b, None)
    if name == "prefix-lm":
        b, hq, hk, nq, nk = 2, 2, 2, 200, 260
        prefix = np.array([37, 150], np.int32)
        cpp = dict(mask_mod="kv_idx < prefix(b) || kv_idx <= q_idx + Nk - Nq", aux={"prefix": prefix})
        twin = dict(mask_mod=lambda b_, h, i, j: (j < prefix[b_]) | (j <= i + nk - nq))
        return (b, hq, hk, nq, nk), False, cpp, twin, None, (b, None)
    if name == "softcap-alibi":
        b, hq, hk, nq, nk = 1, 4, 2, 150, 170
        slopes = rng.uniform(0.02, 0.3, hq).astype(np.float32)
        cap = 8.0
        cpp = dict(score_mod="cap * tanhf(score / cap) - slope(h) * fabsf((float)(q_idx + Nk - Nq - kv_idx))",
                   score_mod_grad="{ const float t = (new_score + slope(h) * fabsf((float)(q_idx + Nk - Nq - kv_idx))) "
                                  "/ cap; return 1.f - t * t; }",
                   aux={"slope": slopes, "cap": cap})  # fmt: skip
        dist = lambda i, j: np.abs(i + nk - nq - j)  # noqa: E731
        twin = dict(score_mod=lambda s, b_, h, i, j: cap * np.tanh(s / cap) - slopes[h] * dist(i, j),
                    score_mod_grad=lambda ns, b_, h, i, j: 1 - ((ns + slopes[h] * dist(i, j)) / cap) ** 2)
        builtin = dict(softcap=cap, alibi_slopes=slopes)
        return (b, hq, hk, nq, nk), True, cpp, twin, builtin, None
    raise KeyError(name)


def _dev(kw):
    out = {}
    for n, x in kw.items():
        if n == "aux":
            out[n] = {a: (cupy.asarray(v) if isinstance(v, np.ndarray) else v) for a, v in x.items()}
        else:
            out[n] = cupy.asarray(x) if isinstance(x, np.ndarray) else x
    return out


def _round(dtype):
    return lambda x: np.asarray(x, np.float32).astype(dtype).astype(np.float32)


def naive(q, k, v, do, causal, twin, dtype):
    """o, dq, dk, dv of a materialised implementation rounded to ``dtype`` at every step, with the twins."""
    R = _round(dtype)
    b, hq, nq, d = q.shape
    hk, nk = k.shape[1], k.shape[2]
    g = hq // hk
    f = lambda x: np.asarray(x, np.float32)  # noqa: E731
    Q, dO = f(q), f(do)
    K, V = np.repeat(f(k), g, axis=1), np.repeat(f(v), g, axis=1)
    S = R(R(Q @ K.swapaxes(-1, -2)) * np.float32(1 / np.sqrt(d)))
    bi = np.arange(b).reshape(b, 1, 1, 1)
    hi = np.arange(hq).reshape(1, hq, 1, 1)
    ii, jj = np.arange(nq)[:, None], np.arange(nk)[None, :]
    if twin.get("score_mod"):
        S = R(twin["score_mod"](S, bi, hi, ii, jj))
    vis = np.ones((nq, nk), bool) if not causal else (jj <= ii + nk - nq)
    if twin.get("mask_mod"):
        vis = vis & twin["mask_mod"](bi, hi, ii, jj)
    S = np.where(vis, S, -np.inf)
    m = S.max(-1, keepdims=True)
    sinks = twin.get("sinks")
    if sinks is not None:
        m = np.maximum(m, sinks.reshape(1, hq, 1, 1))
    ms = np.where(np.isfinite(m), m, 0)
    E = np.exp(S - ms)
    l = E.sum(-1, keepdims=True) + (np.exp(sinks.reshape(1, hq, 1, 1) - ms) if sinks is not None else 0)
    P = R(E / np.where(l > 0, l, 1))
    O = R(P @ V)
    dV = R(P.swapaxes(-1, -2) @ dO)
    dP = R(dO @ V.swapaxes(-1, -2))
    Delta = (dO * O).sum(-1, keepdims=True)
    dS = R(P * (dP - Delta))
    if twin.get("score_mod"):
        dS = R(dS * twin["score_mod_grad"](np.where(np.isfinite(S), S, 0), bi, hi, ii, jj))
    sc = np.float32(1 / np.sqrt(d))
    dQ = R(dS @ K * sc)
    dK = R(dS.swapaxes(-1, -2) @ Q * sc).reshape(b, hk, g, nk, d).sum(2)
    dV = dV.reshape(b, hk, g, nk, d).sum(2)
    return O, dQ, dK, dV


def run_family(kernel, qd, kd, vd, dod, causal, cpp, block_mask=None):
    """Forward and backward through one family's entry points with NaN-poisoned outputs."""
    fam = _family(kernel)
    kw = {n: x for n, x in cpp.items() if n != "sinks"}
    sinks = cpp.get("sinks")
    p = check_attention(qd, kd, vd, causal=causal, sinks=sinks, block_mask=block_mask, **kw)
    arrays = flex.aux_arrays(kw.get("aux"))
    if block_mask is not None:
        arrays.update(block_mask.pointers())
    if sinks is not None:
        arrays["sinks"] = sinks
    o = cupy.full(qd.shape, np.nan, qd.dtype)
    lse = cupy.full(qd.shape[:-1], np.nan, np.float32)
    fam.forward(qd, kd, vd, o, lse, p, variant_arrays=arrays)
    grads = [cupy.full(x.shape, np.nan, x.dtype) for x in (qd, kd, vd)]
    bwd_arrays = dict(arrays)
    if sinks is not None:
        bwd_arrays["dsinks"] = cupy.zeros(sinks.shape, np.float32)
    fam.backward(dod, qd, kd, vd, o, lse, *grads, p, variant_arrays=bwd_arrays)
    return [cupy.asnumpy(x) for x in (o, lse, *grads)]


def _inputs(rng, shape, dtype, d=D):
    b, hq, hk, nq, nk = shape
    q = rng.standard_normal((b, hq, nq, d)).astype(dtype)
    k = rng.standard_normal((b, hk, nk, d)).astype(dtype)
    v = rng.standard_normal((b, hk, nk, d)).astype(dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, do


def check_against_reference(dtype_name, q, k, v, do, causal, twin, got, naive_twin=None):
    """``got`` (o, lse, dq, dk, dv) against the reference with the keywords ``twin``, and for 16 bits against the
    naive implementation with ``naive_twin`` (default: ``twin``; the naive one knows no built-in window)."""
    o, lse, dq, dk, dv = got
    ref_kw = {n: x for n, x in twin.items()}
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal, **ref_kw)
    g_ref = reference.attention_backward(do, q, k, v, o_ref, lse_ref, causal, **ref_kw)[:3]
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=2e-3 if dtype_name != "float32" else 1e-5)
    assert np.all(lse[~fin] == -np.inf)
    if dtype_name == "float32":
        assert_float32_close("o", o, o_ref, 1e-5)
        for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref):
            assert_float32_close(name, x, r, 1e-4)
        return
    dtype = DTYPES[dtype_name]
    n_o, *n_g = naive(q, k, v, do, causal, twin if naive_twin is None else naive_twin, dtype)
    assert_fa_criterion("o", o, o_ref, n_o, dtype_name, 2)
    for name, x, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref, n_g):
        assert_fa_criterion(name, x, r, n, dtype_name, 3)


@pytest.mark.parametrize("kernel, dtype_name", FAMILIES)
@pytest.mark.parametrize("case", ["doc-t5", "prefix-lm", "softcap-alibi"])
def test_snippets(kernel, dtype_name, case, rng):
    dtype = DTYPES[dtype_name]
    shape, causal, cpp, twin, builtin, bm_dims = make_case(case, rng, dtype)
    q, k, v, do = _inputs(rng, shape, dtype)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    cppd = _dev(cpp)
    bm = None
    if bm_dims is not None:  # the block mask, built on the GPU from the C++ snippet, equals the twin's
        bm = cupyflash.create_block_mask(cpp["mask_mod"], bm_dims[0], bm_dims[1], shape[3], shape[4],
                                         aux=cppd.get("aux"), block_size=64)  # fmt: skip
        twin_bm = cupyflash.create_block_mask(twin["mask_mod"], bm_dims[0], bm_dims[1], shape[3], shape[4],
                                              block_size=64)  # fmt: skip
        np.testing.assert_array_equal(cupy.asnumpy(bm.states), twin_bm.states)
        np.testing.assert_array_equal(cupy.asnumpy(bm.kv_range), twin_bm.kv_range)
        np.testing.assert_array_equal(cupy.asnumpy(bm.q_range), twin_bm.q_range)
        np.testing.assert_array_equal(cupy.asnumpy(bm.full_kv), twin_bm.full_kv)
        np.testing.assert_array_equal(cupy.asnumpy(bm.full_q), twin_bm.full_q)
        assert bm.sparsity() > 0
    # prefix-lm runs with its block mask only; doc-t5 without and with (equal results); softcap-alibi has none
    got = run_family(kernel, qd, kd, vd, dod, causal, cppd, block_mask=bm if case == "prefix-lm" else None)
    check_against_reference(dtype_name, q, k, v, do, causal, twin, got)
    if case == "doc-t5":
        with_bm = run_family(kernel, qd, kd, vd, dod, causal, cppd, block_mask=bm)
        # skipped tiles are fully masked: o and lse within rounding (the online softmax adds nothing for them)
        np.testing.assert_allclose(with_bm[0].astype(np.float64), got[0].astype(np.float64), rtol=0, atol=1e-5)
        np.testing.assert_allclose(with_bm[1], got[1], rtol=0, atol=1e-5)
        check_against_reference(dtype_name, q, k, v, do, causal, twin, with_bm)
    if builtin is not None:  # the same score written as a snippet and built in: equal within rounding
        b_kw = _dev(builtin)
        o_b, lse_b = cupyflash.attention_forward(qd, kd, vd, causal, kernel=kernel, **b_kw)
        g_b = cupyflash.attention_backward(dod, qd, kd, vd, o_b, lse_b, causal, kernel=kernel, **b_kw)
        tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype_name]
        for name, x, r in zip(("o", "dq", "dk", "dv"), (got[0], *got[2:]), (o_b, *g_b)):
            r = cupy.asnumpy(r).astype(np.float64)
            e = np.linalg.norm(x.astype(np.float64) - r) / np.linalg.norm(r)
            assert e <= tol, f"{name}: snippet vs built-in rel err {e:.3g}"


@pytest.mark.parametrize("kernel, dtype_name", FAMILIES)
def test_public_api_with_block_mask(kernel, dtype_name, rng):
    """Through cupyflash.attention_vjp (the host cache, the aux and block-mask pointers of every call), twice."""
    dtype = DTYPES[dtype_name]
    shape, causal, cpp, twin, _, _ = make_case("doc-t5", rng, dtype)
    q, k, v, do = _inputs(rng, shape, dtype)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    cppd = _dev(cpp)
    bm = cupyflash.create_block_mask(cpp["mask_mod"], shape[0], None, shape[3], shape[4], aux=cppd["aux"])
    for _ in range(2):
        o, vjp = cupyflash.attention_vjp(qd, kd, vd, causal, kernel=kernel, block_mask=bm, **cppd)
        lse = cupyflash.attention_forward(qd, kd, vd, causal, kernel=kernel, block_mask=bm, **cppd)[1]
        dq, dk, dv, _dsinks = vjp(dod)
        got = [cupy.asnumpy(x) for x in (o, lse, dq, dk, dv)]
        check_against_reference(dtype_name, q, k, v, do, causal, twin, got)


def test_snippet_error_before_launch():
    q = cupy.asarray(np.random.default_rng(0).standard_normal((1, 1, 8, 64)).astype(np.float32))
    with pytest.raises(cupyflash.SnippetError, match="line 1"):
        cupyflash.attention(q, q, q, mask_mod="q_idx >= undefined_kv", kernel="portable")


def test_dropout_and_deterministic_with_snippets(rng):
    """Dropout (a third policy member) and the deterministic backward ride along: portable float32 against the
    reference with the same seed, and two deterministic backwards bit for bit."""
    shape, causal, cpp, twin, _, _ = make_case("prefix-lm", rng, np.float32)
    q, k, v, do = _inputs(rng, shape, np.float32)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    cppd = _dev(cpp)
    seed = 1234
    o, lse = cupyflash.attention_forward(qd, kd, vd, causal, kernel="portable", dropout_p=0.1, dropout_seed=seed,
                                         **cppd)  # fmt: skip
    g = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, kernel="portable", dropout_p=0.1,
                                     dropout_seed=seed, **cppd)  # fmt: skip
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal, dropout_p=0.1, dropout_seed=seed, **twin)
    g_ref = reference.attention_backward(do, q, k, v, o_ref, lse_ref, causal, dropout_p=0.1, dropout_seed=seed,
                                         **twin)  # fmt: skip
    assert_float32_close("o", cupy.asnumpy(o), o_ref, 1e-5)
    for name, x, r in zip(("dq", "dk", "dv"), g, g_ref):
        assert_float32_close(name, cupy.asnumpy(x), r, 1e-4)
    d1 = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, kernel="portable", dropout_p=0.1,
                                      dropout_seed=seed, deterministic=True, **cppd)  # fmt: skip
    d2 = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, kernel="portable", dropout_p=0.1,
                                      dropout_seed=seed, deterministic=True, **cppd)  # fmt: skip
    for a, b in zip(d1, d2):
        assert cupy.array_equal(a, b)
