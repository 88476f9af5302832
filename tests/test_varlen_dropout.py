"""Attention dropout on packed (varlen) calls (issue 16) on the CPU: the float64 reference, the NumPy backend and
the checks.

The rule: sequence b's keep mask is ``cupyflash.dropout_mask``'s entry for batch index b, with the sequence's
own rows and columns (i, j counted from its first query and key), which is how the kernels key it (the launch's
batch index is the sequence, its tiles' rows and columns are within the sequence). The GPU side is
tests/test_varlen_dropout_gpu.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, rel_err
from test_variants_reference import assert_rounded_from, numerical_grads
from test_varlen_reference import SPECS, make_case

import cupyflash as cf
from cupyflash import reference as ref
from cupyflash.api import draw_seed

SEED = 1234567891011
P_DROP = 0.3


def _probabilities(q, k, causal, scale, kw):
    """P (Hq, Nq, Nk) of one dense (H, N, D) problem, undropped: the reference's o for v = a one-hot row per key
    (o_i = sum_j P_ij v_j, so v = e_j in every column gives P_ij)."""
    hk, nk, d = k.shape
    cols = []
    for j in range(nk):
        v = np.zeros((hk, nk, d))
        v[:, j] = 1.0
        cols.append(ref.attention_forward(q, k, v, causal, scale, **kw)[0][..., 0])
    return np.stack(cols, axis=-1)


def _by_hand(q, k, v, packing, causal, scale, kw, p_drop, seed):
    """o of each sequence from its undropped P times sequence b's mask, cupyflash.dropout_mask(B, ...)[b], over
    1 - p_eff."""
    cu_q, cu_k = packing[:2]
    batch, hq, hk = len(cu_q) - 1, q.shape[1], k.shape[1]
    o = np.zeros(q.shape)
    for b in range(batch):
        qr, kr = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        nq, nk = qr.stop - qr.start, kr.stop - kr.start
        if nq == 0 or nk == 0:
            continue
        slopes = kw["alibi_slopes"]
        kw_b = {**kw, "alibi_slopes": None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])}
        P = _probabilities(q[qr].transpose(1, 0, 2), k[kr].transpose(1, 0, 2), causal, scale, kw_b)
        z = cf.dropout_mask(batch, hq, nq, nk, p_drop, seed)[b] / (1.0 - cf.effective_dropout_p(p_drop))
        vals = v[kr].astype(np.float64)[:, np.arange(hq) // (hq // hk)]  # (Nk, Hq, D)
        o[qr] = np.einsum("hij,jhd->ihd", P * z, vals)
    return o


@pytest.mark.parametrize("spec", ["plain", "causal", "alibi-seq", "all"])
@pytest.mark.parametrize("lengths", ["empty-and-one", "one-long"])
def test_reference_drops_each_sequence_by_its_own_mask(rng, lengths, spec):
    q, k, v, packing, causal, scale, kw = make_case(rng, lengths, SPECS[spec])
    o, lse = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, dropout_p=P_DROP, dropout_seed=SEED,
                                          **kw)  # fmt: skip
    assert rel_err(o, _by_hand(q, k, v, packing, causal, scale, kw, P_DROP, SEED)) < 1e-12
    _, lse0 = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    np.testing.assert_array_equal(lse, lse0)  # lse stays the undropped one
    o_t, lse_t = ref.tiled_attention_varlen_forward(q, k, v, *packing, causal, scale, 4, 8, dropout_p=P_DROP,
                                                    dropout_seed=SEED, **kw)  # fmt: skip
    assert rel_err(o_t, o) < 1e-12
    np.testing.assert_allclose(lse_t[np.isfinite(lse)], lse[np.isfinite(lse)], rtol=1e-12)


def test_equal_sequences_get_different_masks(rng):
    """The mask is keyed by the sequence index: two copies of one sequence in a pack drop differently."""
    q, k, v, packing, causal, scale, kw = make_case(rng, ([9, 9], [12, 12]), {})
    q[9:], k[12:], v[12:] = q[:9], k[:12], v[:12]
    o, _ = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, dropout_p=0.5, dropout_seed=SEED, **kw)
    o0, _ = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    np.testing.assert_array_equal(o0[:9], o0[9:])
    assert not np.array_equal(o[:9], o[9:])


@pytest.mark.parametrize("spec", ["causal", "all"])
def test_backward_matches_finite_differences(rng, spec):
    """The mask does not depend on q, k, v: the dropped attention is smooth and its gradient is the backward's."""
    q, k, v, packing, causal, scale, kw = make_case(rng, ([3, 0, 1, 4], [2, 3, 1, 5]), SPECS[spec], hq=2, hk=1, d=3)
    do = rng.standard_normal(q.shape)
    drop = {"dropout_p": P_DROP, "dropout_seed": SEED}

    def loss(q, k, v, sinks):
        o = ref.attention_varlen(q, k, v, *packing, causal, scale, **{**kw, "sinks": sinks}, **drop)
        return float(np.sum(o * do))

    expect = numerical_grads(loss, [q, k, v, kw["sinks"]], [1e-6, 1e-6, 1e-6, 2.0**-10])
    o, lse = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw, **drop)
    plain = ref.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, **kw, **drop)
    tiled = ref.tiled_attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, 2, 3, **kw, **drop)
    for name, g, g_t, e in zip(("dq", "dk", "dv", "dsinks"), plain, tiled, expect):
        assert np.linalg.norm(e) > 1e-3, name
        tol = 1e-5 if name == "dsinks" else 1e-7
        assert rel_err(g, e) < tol, name
        assert rel_err(g_t, e) < tol, name


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_public_api_rounds_the_reference(rng, dtype):
    dt = DTYPES[dtype]
    q, k, v, packing, causal, scale, kw = make_case(rng, "empty-and-one", SPECS["all"], dtype=dt)
    do = rng.standard_normal(q.shape).astype(dt)
    drop = {"dropout_p": P_DROP, "dropout_seed": SEED}
    o, lse = cf.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw, **drop)
    o64, _ = ref.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw, **drop)
    assert_rounded_from(o, o64, dt)
    grads = cf.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, **kw, **drop)
    exact = ref.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, **kw, **drop)
    for g, e in zip(grads[:3], exact):
        assert_rounded_from(g, e, dt)
    o_v, vjp = cf.attention_varlen_vjp(q, k, v, *packing, causal, scale, **kw, **drop)
    np.testing.assert_array_equal(o_v, o)
    for g, g_v in zip(grads, vjp(do)):
        np.testing.assert_array_equal(g_v, g)


def test_vjp_and_attention_varlen_draw_one_seed(rng):
    q, k, v, packing, causal, scale, kw = make_case(rng, "nq!=nk", {}, dtype=np.float32)
    np.random.seed(5)
    o, vjp = cf.attention_varlen_vjp(q, k, v, *packing, dropout_p=P_DROP)
    np.random.seed(5)
    seed = draw_seed(q)
    o_seeded, lse = cf.attention_varlen_forward(q, k, v, *packing, dropout_p=P_DROP, dropout_seed=seed)
    np.testing.assert_array_equal(o, o_seeded)
    do = rng.standard_normal(q.shape).astype(np.float32)
    for a, b in zip(vjp(do), cf.attention_varlen_backward(do, q, k, v, o, lse, *packing, dropout_p=P_DROP,
                                                          dropout_seed=seed)):  # fmt: skip
        np.testing.assert_array_equal(a, b)
    np.random.seed(5)
    np.testing.assert_array_equal(cf.attention_varlen(q, k, v, *packing, dropout_p=P_DROP), o)


@pytest.mark.parametrize("bad, exc, match", [
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p=-0.1, dropout_seed=1), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(dropout_p="0.1", dropout_seed=1), TypeError, "dropout_p must be a real number"),
    (dict(dropout_p=0.1), ValueError, "dropout_seed is required"),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed must be an int"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed must be in"),
])  # fmt: skip
def test_bad_dropout_arguments_are_refused(rng, bad, exc, match):
    q, k, v, packing, *_ = make_case(rng, "nq!=nk", {}, dtype=np.float32)
    o, lse = cf.attention_varlen_forward(q, k, v, *packing)
    with pytest.raises(exc, match=match):
        cf.attention_varlen_forward(q, k, v, *packing, **bad)
    with pytest.raises(exc, match=match):
        cf.attention_varlen_backward(o, q, k, v, o, lse, *packing, **bad)
    with pytest.raises(exc, match=match):
        ref.attention_varlen_forward(q, k, v, *packing, **bad)
