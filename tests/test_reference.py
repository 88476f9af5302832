"""The float64 reference against formulas written independently here: a per-row loop,
log-sum-exp computed directly, K/V copied per head, and central finite differences.
The tiled (FlashAttention) formulation is checked against the plain one."""
from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import DTYPES, random_qkv, rel_err

from cupyflash import reference as ref

# (batch, hq, hk, nq, nk, d, causal, scale)
CASES = [
    ((), 1, 1, 1, 1, 8, False, None),
    ((2,), 2, 2, 17, 17, 16, False, None),
    ((2,), 2, 2, 17, 17, 16, True, None),
    ((1,), 4, 2, 17, 33, 32, True, None),  # GQA, Nq < Nk: the causal diagonal sits to the right
    ((1,), 4, 1, 33, 17, 40, True, None),  # MQA, Nq > Nk: the first 16 rows see no key
    ((1,), 4, 1, 33, 17, 40, False, None),
    ((2, 3), 3, 1, 5, 9, 64, False, 0.3),  # two batch dims
    ((1,), 2, 2, 100, 100, 24, True, 10.0),  # large logits
    ((1,), 6, 3, 100, 1, 80, False, None),
    ((1,), 2, 1, 1, 100, 128, True, None),
    ((), 1, 1, 9, 12, 256, True, None),
]


def case_id(c) -> str:
    batch, hq, hk, nq, nk, d, causal, scale = c
    return f"b{'x'.join(map(str, batch)) or '-'}-h{hq}/{hk}-n{nq}x{nk}-d{d}{'-causal' if causal else ''}" + (
        f"-s{scale}" if scale else ""
    )


def make_inputs(rng, case, dtype=np.float64):
    batch, hq, hk, nq, nk, d, causal, scale = case
    q, k, v = random_qkv(rng, batch, hq, hk, nq, nk, d, dtype)
    return q, k, v, causal, scale


def naive_attention(q, k, v, causal, scale):
    """One query row at a time: scores, mask, max-subtracted softmax, weighted sum of V."""
    *batch, hq, nq, d = q.shape
    hk, nk = k.shape[-3], k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = np.zeros(q.shape)
    lse = np.zeros(q.shape[:-1])
    for b in np.ndindex(*batch):
        for h in range(hq):
            kv = h // (hq // hk)
            K = k[b][kv].astype(np.float64)
            V = v[b][kv].astype(np.float64)
            for i in range(nq):
                scores = [scale * float(np.dot(q[b][h, i].astype(np.float64), K[j])) for j in range(nk)]
                keys = [j for j in range(nk) if not (causal and j > i + nk - nq)]
                if not keys:
                    o[b][h, i] = 0.0
                    lse[b][h, i] = -np.inf
                    continue
                mx = max(scores[j] for j in keys)
                w = {j: math.exp(scores[j] - mx) for j in keys}
                total = sum(w.values())
                o[b][h, i] = sum(w[j] * V[j] for j in keys) / total
                lse[b][h, i] = mx + math.log(total)
    return o, lse


def assert_lse_close(lse, expect, tol):
    """Same -inf rows, and the finite entries within tol (rel_err rejects any inf)."""
    assert lse.shape == expect.shape
    assert not np.isnan(lse).any()
    masked = np.isneginf(expect)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    assert rel_err(lse[~masked], expect[~masked]) < tol


def masked_rows(nq, nk, causal) -> np.ndarray:
    """Query rows that see no key under the bottom-right aligned mask."""
    if nk == 0:
        return np.ones(nq, dtype=bool)
    return np.arange(nq) < (nq - nk) if causal else np.zeros(nq, dtype=bool)


# ---------------------------------------------------------------------------- forward


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_plain_forward_matches_naive(rng, case):
    q, k, v, causal, scale = make_inputs(rng, case)
    o, lse = ref.attention_forward(q, k, v, causal, scale)
    o_naive, lse_naive = naive_attention(q, k, v, causal, scale)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    assert rel_err(o, o_naive) < 1e-13
    assert_lse_close(lse, lse_naive, 1e-13)
    np.testing.assert_array_equal(ref.attention(q, k, v, causal, scale), o)


def test_lse_is_log_sum_exp_of_scaled_scores(rng):
    q, k, v = random_qkv(rng, (2,), 4, 2, 13, 21, 32, np.float64)
    scale = 0.7
    _, lse = ref.attention_forward(q, k, v, False, scale)
    kk = np.repeat(k, 2, axis=-3)
    s = scale * np.einsum("bhid,bhjd->bhij", q, kk)
    assert rel_err(lse, np.log(np.exp(s).sum(axis=-1))) < 1e-14
    # natural log, not log2: exp(S - lse) is a probability distribution per row
    np.testing.assert_allclose(np.exp(s - lse[..., None]).sum(axis=-1), 1.0, rtol=1e-13)


def test_default_scale_is_inverse_sqrt_d(rng):
    q, k, v = random_qkv(rng, (1,), 2, 2, 7, 9, 48, np.float64)
    o, lse = ref.attention_forward(q, k, v)
    o2, lse2 = ref.attention_forward(q, k, v, False, 1 / math.sqrt(48))
    np.testing.assert_array_equal(o, o2)
    np.testing.assert_array_equal(lse, lse2)
    o3, _ = ref.attention_forward(q, k, v, False, 1.0)
    assert rel_err(o3, o) > 1e-3  # scale really enters


def test_gqa_equals_mha_with_repeated_kv(rng):
    q, k, v = random_qkv(rng, (2,), 6, 2, 11, 14, 16, np.float64)
    do = rng.standard_normal(q.shape)
    kr, vr = np.repeat(k, 3, axis=-3), np.repeat(v, 3, axis=-3)
    for causal in (False, True):
        o, lse = ref.attention_forward(q, k, v, causal)
        o_r, lse_r = ref.attention_forward(q, kr, vr, causal)
        np.testing.assert_allclose(o, o_r, rtol=0, atol=1e-14)
        np.testing.assert_allclose(lse, lse_r, rtol=0, atol=1e-13)
        dq, dk, dv = ref.attention_backward(do, q, k, v, o, lse, causal)
        dq_r, dk_r, dv_r = ref.attention_backward(do, q, kr, vr, o_r, lse_r, causal)
        assert rel_err(dq, dq_r) < 1e-13
        # each kv head's gradient sums its group's query heads
        assert rel_err(dk, dk_r.reshape(2, 2, 3, 14, 16).sum(axis=2)) < 1e-13
        assert rel_err(dv, dv_r.reshape(2, 2, 3, 14, 16).sum(axis=2)) < 1e-13


def test_causal_mask_is_bottom_right_aligned(rng):
    # Nq == Nk: the usual lower triangle; the first row sees key 0 only.
    q, k, v = random_qkv(rng, (), 1, 1, 6, 6, 8, np.float64)
    o = ref.attention(q, k, v, True)
    np.testing.assert_allclose(o[0, 0], v[0, 0], rtol=1e-14)
    # Nq < Nk: the last query sees every key, like the non-causal output.
    q, k, v = random_qkv(rng, (), 1, 1, 4, 10, 8, np.float64)
    o_c, o_n = ref.attention(q, k, v, True), ref.attention(q, k, v, False)
    np.testing.assert_allclose(o_c[0, -1], o_n[0, -1], rtol=1e-13)
    assert rel_err(o_c[0, 0], o_n[0, 0]) > 1e-3
    # Keys above the diagonal do not matter: changing them leaves o unchanged.
    k2, v2 = k.copy(), v.copy()
    k2[0, 7:] += 5.0  # query 0 sees keys 0..6
    v2[0, 7:] -= 3.0
    np.testing.assert_array_equal(ref.attention(q, k2, v2, True)[0, 0], ref.attention(q, k, v, True)[0, 0])
    assert rel_err(ref.attention(q, k2, v2, True)[0, -1], o_c[0, -1]) > 1e-3


def test_large_logits_stay_finite(rng):
    q, k, v = random_qkv(rng, (1,), 2, 2, 50, 70, 64, np.float64)
    for blocks in ((64, 64), (16, 8)):
        o, lse = ref.tiled_attention_forward(q, k, v, True, 10.0, *blocks)
        assert np.isfinite(o).all() and np.isfinite(lse).all()
        assert lse.max() > 300  # exp() of these logits would overflow without the running max
    o_p, lse_p = ref.attention_forward(q, k, v, True, 10.0)
    assert rel_err(o, o_p) < 1e-13
    assert_lse_close(lse, lse_p, 1e-14)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_low_precision_inputs_compute_in_float64(rng, dtype):
    q, k, v = random_qkv(rng, (2,), 4, 2, 9, 11, 16, DTYPES[dtype])
    q0 = q.copy()
    o, lse = ref.attention_forward(q, k, v, True)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    o64, lse64 = ref.attention_forward(*(x.astype(np.float64) for x in (q, k, v)), True)
    np.testing.assert_array_equal(o, o64)
    np.testing.assert_array_equal(lse, lse64)
    np.testing.assert_array_equal(q, q0)  # inputs untouched


# ---------------------------------------------------------------------------- masked rows, empty sizes


@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled"])
def test_fully_masked_rows_give_zero_and_no_nan(rng, tiled):
    nq, nk = 20, 7  # causal, Nq > Nk: rows 0..12 see no key
    q, k, v = random_qkv(rng, (2,), 4, 2, nq, nk, 16, np.float64)
    do = rng.standard_normal(q.shape)
    fwd = (lambda *a: ref.tiled_attention_forward(*a, block_q=8, block_k=4)) if tiled else ref.attention_forward
    bwd = (lambda *a: ref.tiled_attention_backward(*a, block_q=8, block_k=4)) if tiled else ref.attention_backward
    with np.errstate(all="raise"):  # no overflow/invalid/divide warnings along the way
        o, lse = fwd(q, k, v, True, None)
        dq, dk, dv = bwd(do, q, k, v, o, lse, True, None)
    dead = masked_rows(nq, nk, True)
    assert dead.sum() == 13
    assert np.all(o[..., dead, :] == 0.0)
    assert np.all(np.isneginf(lse[..., dead]))
    assert np.isfinite(lse[..., ~dead]).all() and np.isfinite(o).all()
    assert np.all(dq[..., dead, :] == 0.0)
    # (a row that sees exactly one key has P = 1 and dS = 0: its dq vanishes too, up to rounding)
    assert np.linalg.norm(dq[..., dead.sum() + 1 :, :], axis=-1).min() > 1e-3
    for g in (dq, dk, dv):
        assert np.isfinite(g).all()
    # masked rows contribute nothing to dk/dv: a different dO there changes nothing
    do2 = do.copy()
    do2[..., dead, :] = rng.standard_normal(do2[..., dead, :].shape)
    _, dk2, dv2 = bwd(do2, q, k, v, o, lse, True, None)
    np.testing.assert_array_equal(dk2, dk)
    np.testing.assert_array_equal(dv2, dv)


@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled"])
@pytest.mark.parametrize(
    "batch,nq,nk", [((2,), 0, 5), ((2,), 5, 0), ((0,), 5, 6), ((2, 0), 3, 3)], ids=["nq0", "nk0", "b0", "b2x0"]
)
def test_empty_sizes(rng, tiled, batch, nq, nk):
    q, k, v = random_qkv(rng, batch, 4, 2, nq, nk, 8, np.float64)
    fwd = ref.tiled_attention_forward if tiled else ref.attention_forward
    bwd = ref.tiled_attention_backward if tiled else ref.attention_backward
    o, lse = fwd(q, k, v, True)
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    assert np.all(o == 0.0)
    if nk == 0:
        assert np.all(np.isneginf(lse))
    do = rng.standard_normal(q.shape)
    dq, dk, dv = bwd(do, q, k, v, o, lse, True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    for g in (dq, dk, dv):
        assert np.all(g == 0.0)


# ---------------------------------------------------------------------------- tiled vs plain

BLOCKS = [(64, 64), (16, 32), (32, 16), (7, 5), (13, 128), (3, 1), (200, 200)]
TILED_CASES = [c for c in CASES if c[3] * c[4] <= 100 * 100 and c[5] <= 128]


# tiny tiles on a large problem only cost time
TILED_PARAMS = [
    pytest.param(c, b, id=f"{case_id(c)}-{b[0]}x{b[1]}")
    for c in TILED_CASES
    for b in BLOCKS
    if b[0] * b[1] >= 16 or c[3] * c[4] <= 40 * 40
]


@pytest.mark.parametrize("case,blocks", TILED_PARAMS)
def test_tiled_matches_plain(rng, case, blocks):
    q, k, v, causal, scale = make_inputs(rng, case)
    o, lse = ref.attention_forward(q, k, v, causal, scale)
    o_t, lse_t = ref.tiled_attention_forward(q, k, v, causal, scale, *blocks)
    assert rel_err(o_t, o) < 1e-13
    assert_lse_close(lse_t, lse, 1e-13)
    do = rng.standard_normal(q.shape)
    grads = ref.attention_backward(do, q, k, v, o, lse, causal, scale)
    grads_t = ref.tiled_attention_backward(do, q, k, v, o, lse, causal, scale, *blocks)
    for name, g_t, g in zip(("dq", "dk", "dv"), grads_t, grads):
        assert g_t.shape == g.shape, name
        # absolute floor: with Nk = 1, dq and dk are exactly 0 and both sides are rounding noise
        assert np.linalg.norm(g_t - g) <= 1e-12 * (np.linalg.norm(g) + 1.0), name


def test_tiled_skips_tiles_above_the_diagonal(rng, monkeypatch):
    """Causal tiling computes fewer score tiles, and the skipped ones were really all masked."""
    q, k, v = random_qkv(rng, (1,), 2, 2, 64, 64, 16, np.float64)
    seen = []
    visible = ref._visible

    def spy(xp, rows, cols, p):
        seen.append((int(rows[0]), int(cols[0])))
        return visible(xp, rows, cols, p)

    monkeypatch.setattr(ref, "_visible", spy)
    ref.tiled_attention_forward(q, k, v, True, None, 16, 16)
    assert sorted(seen) == [(i, j) for i in range(0, 64, 16) for j in range(0, 64, 16) if j <= i]
    seen.clear()
    ref.tiled_attention_backward(q, q, k, v, q, np.zeros(q.shape[:-1]), True, None, 16, 16)
    assert sorted(seen) == [(i, j) for i in range(0, 64, 16) for j in range(0, 64, 16) if j <= i]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, None])
def test_tiled_rejects_bad_block_sizes(rng, bad):
    q, k, v = random_qkv(rng, (), 1, 1, 4, 4, 8, np.float64)
    with pytest.raises(ValueError, match="block_q must be a positive int"):
        ref.tiled_attention_forward(q, k, v, block_q=bad)
    o, lse = ref.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="block_k must be a positive int"):
        ref.tiled_attention_backward(q, q, k, v, o, lse, block_k=bad)


# ---------------------------------------------------------------------------- backward vs finite differences

FD_CASES = [
    ((1,), 2, 2, 5, 4, 3, False, None),
    ((1,), 2, 2, 5, 5, 4, True, None),
    ((2,), 4, 2, 3, 6, 3, True, 0.8),  # GQA, Nq < Nk
    ((1,), 3, 1, 6, 3, 2, True, None),  # MQA, Nq > Nk: masked rows
    ((), 1, 1, 4, 4, 3, False, 3.0),  # large-ish logits
]


def numerical_grads(q, k, v, do, causal, scale, eps=1e-6):
    """Central differences of L = sum(o * do) for every element of q, k and v."""

    def loss(qq, kk, vv):
        return float(np.sum(ref.attention(qq, kk, vv, causal, scale) * do))

    grads = []
    args = [q, k, v]
    for a in range(3):
        g = np.zeros(args[a].shape)
        for idx in np.ndindex(*args[a].shape):
            plus = [x.copy() for x in args]
            minus = [x.copy() for x in args]
            plus[a][idx] += eps
            minus[a][idx] -= eps
            g[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        grads.append(g)
    return grads


@pytest.mark.parametrize("case", FD_CASES, ids=case_id)
def test_backward_matches_finite_differences(rng, case):
    q, k, v, causal, scale = make_inputs(rng, case)
    do = rng.standard_normal(q.shape)
    o, lse = ref.attention_forward(q, k, v, causal, scale)
    expect = numerical_grads(q, k, v, do, causal, scale)
    analytic = ref.attention_backward(do, q, k, v, o, lse, causal, scale)
    tiled = ref.tiled_attention_backward(do, q, k, v, o, lse, causal, scale, 2, 3)
    _, vjp = ref.attention_vjp(q, k, v, causal, scale)
    from_vjp = vjp(do)
    for name, g, g_t, g_v, e in zip(("dq", "dk", "dv"), analytic, tiled, from_vjp, expect):
        assert np.linalg.norm(e) > 1e-3, name  # the check is not vacuous
        assert rel_err(g, e) < 1e-7, name
        assert rel_err(g_t, e) < 1e-7, name
        np.testing.assert_array_equal(g_v, g)


def test_backward_uses_the_given_o_for_delta(rng):
    """Delta = rowsum(dO * O) takes o as given (the kernels pass their own o)."""
    q, k, v = random_qkv(rng, (1,), 2, 2, 6, 6, 8, np.float64)
    do = rng.standard_normal(q.shape)
    o, lse = ref.attention_forward(q, k, v)
    dq, dk, dv = ref.attention_backward(do, q, k, v, o, lse)
    o_off = o + 0.01 * rng.standard_normal(o.shape)
    dq2, dk2, dv2 = ref.attention_backward(do, q, k, v, o_off, lse)
    np.testing.assert_array_equal(dv2, dv)  # dV = P^T dO does not involve o
    assert rel_err(dq2, dq) > 1e-4
    assert rel_err(dk2, dk) > 1e-4


def test_vjp_checks_do(rng):
    q, k, v = random_qkv(rng, (1,), 2, 2, 6, 6, 8, np.float32)
    o, vjp = ref.attention_vjp(q, k, v)
    assert o.dtype == np.float64
    with pytest.raises(ValueError, match=r"do must have q's shape \(1, 2, 6, 8\); got \(1, 2, 6, 5\)"):
        vjp(np.ones((1, 2, 6, 5), np.float32))
    with pytest.raises(TypeError, match="do.dtype must equal q.dtype"):
        vjp(np.ones(q.shape, np.float16))
    with pytest.raises(TypeError, match="do must be a numpy.ndarray"):
        vjp(q.tolist())
