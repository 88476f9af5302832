"""The float64 reference's attention variants (issue 13: sliding window, softcap, ALiBi, attention sinks)
against formulas written independently here: a per-row loop that applies scale -> softcap -> ALiBi ->
window/causal mask -> softmax (with the sink) one score at a time, central finite differences of
L = sum(o * do), and identities between variants. The tiled (FlashAttention) formulation is checked
against the plain one, and the public API on NumPy arrays against the reference rounded once.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from conftest import DTYPES, TOL_GRAD, TOL_OUT, random_qkv, rel_err

import cupyflash as cf
from cupyflash import reference as ref

# ---------------------------------------------------------------------------- the independent formulas


def visible_naive(i, j, nq, nk, causal, window):
    """Is key j visible to query i? Written from issue 13's sentence, not from Variant."""
    left, right = (-1, -1) if window is None else window
    left = -1 if left is None else left
    right = -1 if right is None else right
    if causal:
        right = 0
    diag = i + nk - nq
    if left >= 0 and j < diag - left:
        return False
    if right >= 0 and j > diag + right:
        return False
    return True


def _slope(slopes, b, h):
    if slopes is None:
        return 0.0
    slopes = np.asarray(slopes, dtype=np.float64)
    return float(slopes[h] if slopes.ndim == 1 else slopes[b][h])


def naive_variant_attention(q, k, v, causal=False, scale=None, window=None, softcap=0.0, slopes=None, sinks=None):
    """One query row at a time, one score at a time, in float64 (Python floats)."""
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
            slope = _slope(slopes, b, h)
            for i in range(nq):
                logits = {}
                for j in range(nk):
                    s = scale * float(np.dot(q[b][h, i].astype(np.float64), K[j]))
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    s -= slope * abs(i + nk - nq - j)
                    if visible_naive(i, j, nq, nk, causal, window):
                        logits[j] = s
                sink = None if sinks is None else float(sinks[h])
                if not logits and sink is None:
                    o[b][h, i] = 0.0
                    lse[b][h, i] = -np.inf
                    continue
                mx = max(list(logits.values()) + ([sink] if sink is not None else []))
                w = {j: math.exp(s - mx) for j, s in logits.items()}
                total = sum(w.values()) + (math.exp(sink - mx) if sink is not None else 0.0)
                o[b][h, i] = sum((w[j] * V[j] for j in w), np.zeros(d)) / total
                lse[b][h, i] = mx + math.log(total)
    return o, lse


def assert_lse_close(lse, expect, tol):
    """Same -inf entries, finite elsewhere and within tol."""
    assert lse.shape == expect.shape
    assert not np.isnan(lse).any()
    masked = np.isneginf(expect)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    assert rel_err(lse[~masked], expect[~masked]) < tol


# ---------------------------------------------------------------------------- cases

# A case: (batch, hq, hk, nq, nk, d) and a variant spec:
# causal, window, softcap, alibi ("head": (Hq,), "batch": (*batch, Hq)), sinks (bool), scale.
SHAPES = {
    "mha": ((2,), 2, 2, 11, 11, 8),
    "gqa-nq<nk": ((1,), 4, 2, 7, 19, 16),
    "mqa-nq>nk": ((1,), 3, 1, 19, 7, 8),
    "two-batch": ((2, 3), 2, 1, 6, 9, 4),
    "no-batch": ((), 2, 1, 9, 9, 5),
}

SPECS = {
    "window-2-3": dict(window=(2, 3)),
    "window-0-0": dict(window=(0, 0)),
    "window-huge": dict(window=(1000, 1000)),
    "window-left-only": dict(window=(3, -1)),
    "window-right-only": dict(window=(-1, 2)),
    "window-none-side": dict(window=(None, 1)),
    "window-5-0": dict(window=(5, 0)),
    "window-0-4": dict(window=(0, 4)),
    "causal-window-4": dict(causal=True, window=(4, -1)),
    "causal-window-4-7": dict(causal=True, window=(4, 7)),  # right is 0 under causal
    "softcap-30": dict(softcap=30.0, scale=20.0),
    "softcap-0.7": dict(softcap=0.7),
    "alibi-head": dict(alibi="head"),
    "alibi-batch": dict(alibi="batch"),
    "alibi-causal": dict(alibi="head", causal=True),
    "sinks": dict(sinks=True),
    "sinks-causal": dict(sinks=True, causal=True),
    "sinks-window-0-0": dict(sinks=True, window=(0, 0)),
    "all": dict(window=(3, 2), softcap=1.5, alibi="batch", sinks=True, scale=1.3),
    "all-causal": dict(causal=True, window=(4, -1), softcap=2.0, alibi="head", sinks=True),
    "softcap-alibi": dict(softcap=1.0, alibi="head"),
}

FORWARD_CASES = [
    pytest.param(shape, spec, id=f"{shape}-{spec}")
    for spec in SPECS
    for shape in SHAPES
    # the two-batch shape only where the batched slopes matter, to keep the loop short
    if shape != "two-batch" or spec in ("alibi-batch", "all", "sinks", "window-2-3")
]


def make_variant(rng, spec, batch, hq):
    """Keyword arguments for the library and for the naive loop."""
    spec = dict(spec)
    slopes = sinks = None
    if spec.get("alibi") == "head":
        slopes = rng.uniform(0.0, 0.6, hq).astype(np.float32)
    elif spec.get("alibi") == "batch":
        slopes = rng.uniform(0.0, 0.6, (*batch, hq)).astype(np.float32)
    if spec.get("sinks"):
        sinks = rng.uniform(-1.0, 2.5, hq).astype(np.float32)
    kw = {"window_size": spec.get("window"), "softcap": spec.get("softcap", 0.0), "alibi_slopes": slopes,
          "sinks": sinks}  # fmt: skip
    naive = {"window": spec.get("window"), "softcap": spec.get("softcap", 0.0), "slopes": slopes, "sinks": sinks}
    return spec.get("causal", False), spec.get("scale"), kw, naive


def make_case(rng, shape, spec, dtype=np.float64):
    batch, hq, hk, nq, nk, d = SHAPES[shape]
    q, k, v = random_qkv(rng, batch, hq, hk, nq, nk, d, dtype)
    causal, scale, kw, naive = make_variant(rng, SPECS[spec], batch, hq)
    return q, k, v, causal, scale, kw, naive


# ---------------------------------------------------------------------------- plain reference vs naive


@pytest.mark.parametrize("shape,spec", FORWARD_CASES)
def test_plain_forward_matches_naive(rng, shape, spec):
    q, k, v, causal, scale, kw, naive = make_case(rng, shape, spec)
    o, lse = ref.attention_forward(q, k, v, causal, scale, **kw)
    o_n, lse_n = naive_variant_attention(q, k, v, causal, scale, **naive)
    assert o.dtype == np.float64 and lse.dtype == np.float64
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    assert np.isfinite(o).all()
    assert np.abs(o - o_n).max(initial=0) <= 1e-13 * max(1.0, np.abs(o_n).max(initial=0))
    assert_lse_close(lse, lse_n, 1e-13)
    np.testing.assert_array_equal(ref.attention(q, k, v, causal, scale, **kw), o)


def test_variants_change_the_result(rng):
    """Each keyword really enters: the naive comparisons above are not all of the plain call."""
    q, k, v = random_qkv(rng, (1,), 2, 2, 12, 12, 8, np.float64)
    o0, lse0 = ref.attention_forward(q, k, v, False, 3.0)
    for kw in ({"window_size": (2, 2)}, {"softcap": 1.0}, {"alibi_slopes": np.float32([0.5, 0.25])},
               {"sinks": np.float32([2.5, 3.0])}):  # fmt: skip
        o, lse = ref.attention_forward(q, k, v, False, 3.0, **kw)
        assert rel_err(o, o0) > 1e-3, kw
        assert rel_err(lse, lse0) > 1e-4, kw


def test_softcap_bounds_every_score(rng):
    """With softcap c and nothing else, |s| < c, so lse - log(Nk) lies in (-c, c)."""
    q, k, v = random_qkv(rng, (1,), 2, 2, 10, 13, 8, np.float64, scale_logits=10.0)
    cap = 2.0
    _, lse = ref.attention_forward(q, k, v, False, 5.0, softcap=cap)
    assert np.all(np.abs(lse - math.log(13)) < cap)
    _, lse_raw = ref.attention_forward(q, k, v, False, 5.0)
    assert np.abs(lse_raw - math.log(13)).max() > cap  # the cap really bit


def test_alibi_is_a_bias_on_the_scores(rng):
    """ALiBi with slope m equals adding -m |i + Nk - Nq - j| to the logits: o from an explicit softmax."""
    q, k, v = random_qkv(rng, (), 2, 2, 5, 8, 4, np.float64)
    slopes = np.float32([0.3, 1.25])
    o, lse = ref.attention_forward(q, k, v, False, 0.9, alibi_slopes=slopes)
    i, j = np.arange(5)[:, None], np.arange(8)[None, :]
    s = 0.9 * q @ k.swapaxes(-1, -2) - slopes.astype(np.float64)[:, None, None] * np.abs(i + 3 - j)
    expect_lse = np.log(np.exp(s).sum(-1))
    np.testing.assert_allclose(lse, expect_lse, rtol=1e-14)
    np.testing.assert_allclose(o, np.exp(s - expect_lse[..., None]) @ v, rtol=1e-12, atol=1e-14)


def test_sink_is_a_key_with_value_zero(rng):
    """A sink equals one extra key whose score is the sink logit and whose value is 0."""
    q, k, v = random_qkv(rng, (2,), 2, 2, 6, 7, 4, np.float64)
    sinks = np.float32([0.75, -1.5])
    o, lse = ref.attention_forward(q, k, v, False, 1.0, sinks=sinks)
    # an extra key e with q . e = sink for every query: put it in an extra dim
    q2 = np.concatenate([q, np.ones(q.shape[:-1] + (1,))], axis=-1)
    k2 = np.concatenate([np.concatenate([k, np.zeros(k.shape[:-1] + (1,))], axis=-1),
                         np.zeros(k.shape[:-2] + (1, 5))], axis=-2)  # fmt: skip
    k2[..., -1, -1] = sinks.astype(np.float64)[None, :]
    v2 = np.concatenate([np.concatenate([v, np.zeros(v.shape[:-1] + (1,))], axis=-1),
                         np.zeros(v.shape[:-2] + (1, 5))], axis=-2)  # fmt: skip
    o2, lse2 = ref.attention_forward(q2, k2, v2, False, 1.0)
    np.testing.assert_allclose(o, o2[..., :4], rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(lse, lse2, rtol=1e-13)


def test_batched_slopes_equal_per_batch_calls(rng):
    q, k, v = random_qkv(rng, (2, 3), 4, 2, 7, 9, 8, np.float64)
    slopes = rng.uniform(0, 1, (2, 3, 4)).astype(np.float32)
    sinks = rng.standard_normal(4).astype(np.float32)
    do = rng.standard_normal(q.shape)
    kw = {"window_size": (3, 1), "softcap": 2.0}
    o, lse = ref.attention_forward(q, k, v, False, None, alibi_slopes=slopes, sinks=sinks, **kw)
    dq, dk, dv, ds = ref.attention_backward(do, q, k, v, o, lse, False, None, alibi_slopes=slopes, sinks=sinks, **kw)
    ds_sum = np.zeros(4)
    for b in np.ndindex(2, 3):
        ob, lb = ref.attention_forward(q[b], k[b], v[b], False, None, alibi_slopes=slopes[b], sinks=sinks, **kw)
        np.testing.assert_allclose(o[b], ob, rtol=0, atol=1e-14)
        np.testing.assert_allclose(lse[b], lb, rtol=0, atol=1e-13)
        g = ref.attention_backward(do[b], q[b], k[b], v[b], ob, lb, False, None, alibi_slopes=slopes[b], sinks=sinks,
                                   **kw)  # fmt: skip
        for x, y in zip((dq[b], dk[b], dv[b]), g[:3]):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-13)
        ds_sum += g[3]
    # dsinks sums over every batch element
    np.testing.assert_allclose(ds, ds_sum, rtol=1e-12)


def test_gqa_equals_mha_with_repeated_kv(rng):
    q, k, v = random_qkv(rng, (2,), 6, 2, 9, 12, 8, np.float64)
    do = rng.standard_normal(q.shape)
    kr, vr = np.repeat(k, 3, axis=-3), np.repeat(v, 3, axis=-3)
    kw = {"window_size": (2, 4), "softcap": 1.5, "alibi_slopes": rng.uniform(0, 1, (2, 6)).astype(np.float32),
          "sinks": rng.standard_normal(6).astype(np.float32)}  # fmt: skip
    o, lse = ref.attention_forward(q, k, v, False, 2.0, **kw)
    o_r, lse_r = ref.attention_forward(q, kr, vr, False, 2.0, **kw)
    np.testing.assert_allclose(o, o_r, rtol=0, atol=1e-14)
    np.testing.assert_allclose(lse, lse_r, rtol=0, atol=1e-13)
    dq, dk, dv, ds = ref.attention_backward(do, q, k, v, o, lse, False, 2.0, **kw)
    dq_r, dk_r, dv_r, ds_r = ref.attention_backward(do, q, kr, vr, o_r, lse_r, False, 2.0, **kw)
    assert rel_err(dq, dq_r) < 1e-13
    assert rel_err(dk, dk_r.reshape(2, 2, 3, 12, 8).sum(axis=2)) < 1e-13
    assert rel_err(dv, dv_r.reshape(2, 2, 3, 12, 8).sum(axis=2)) < 1e-13
    assert rel_err(ds, ds_r) < 1e-13


# ---------------------------------------------------------------------------- identities and masked rows


@pytest.mark.parametrize("nq,nk", [(9, 9), (5, 12), (12, 5)])
def test_window_identities(rng, nq, nk):
    q, k, v = random_qkv(rng, (2,), 2, 1, nq, nk, 8, np.float64)
    do = rng.standard_normal(q.shape)
    causal = ref.attention_forward(q, k, v, True)
    plain = ref.attention_forward(q, k, v, False)
    same = [
        (ref.attention_forward(q, k, v, True, window_size=(-1, -1)), causal),
        (ref.attention_forward(q, k, v, True, window_size=None), causal),
        (ref.attention_forward(q, k, v, True, window_size=(-1, 5)), causal),  # causal: right = 0
        (ref.attention_forward(q, k, v, False, window_size=(-1, 0)), causal),
        (ref.attention_forward(q, k, v, False, window_size=(-1, -1)), plain),
        (ref.attention_forward(q, k, v, False, window_size=(nq + nk, nq + nk)), plain),
        (ref.attention_forward(q, k, v, False, window_size=(10**9, 10**9)), plain),
        (ref.attention_forward(q, k, v, True, window_size=(3, 5)), ref.attention_forward(q, k, v, False,
                                                                                           window_size=(3, 0))),
        (ref.attention_forward(q, k, v, False, window_size=(nq + nk, 0)), causal),
    ]  # fmt: skip
    for n, ((o, lse), (o_e, lse_e)) in enumerate(same):
        np.testing.assert_allclose(o, o_e, rtol=0, atol=1e-15, err_msg=str(n))
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_e))
        np.testing.assert_allclose(lse, lse_e, rtol=1e-15, err_msg=str(n))
    # and the backward agrees with causal's
    o, lse = causal
    g = ref.attention_backward(do, q, k, v, o, lse, True)
    g_w = ref.attention_backward(do, q, k, v, o, lse, False, window_size=(-1, 0))
    for x, y in zip(g, g_w):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-14)


@pytest.mark.parametrize("tiled", [False, True], ids=["plain", "tiled"])
@pytest.mark.parametrize(
    "nq,nk,causal,window,dead_rows",
    [
        (10, 4, False, (0, 0), range(6)),  # row i sees key i - 6
        (10, 4, False, (0, 1), range(5)),
        (10, 4, True, (2, -1), range(6)),
        (6, 10, False, (0, 0), ()),  # every row sees key i + 4
        (5, 5, False, (-1, -1), ()),
        (5, 0, False, (1, 1), range(5)),  # no key at all
    ],
    ids=["w00-nq>nk", "w01-nq>nk", "causal-w2", "w00-nq<nk", "dense", "nk0"],
)
def test_rows_without_keys(rng, tiled, nq, nk, causal, window, dead_rows):
    """No key and no sink: o = 0, lse = -inf, zero dq and no influence on dk/dv. With a sink: o = 0, lse = sink."""
    q, k, v = random_qkv(rng, (2,), 4, 2, nq, nk, 8, np.float64)
    do = rng.standard_normal(q.shape)
    sinks = np.float32([0.5, -2.0, 3.0, 0.0])
    dead = np.zeros(nq, dtype=bool)
    dead[list(dead_rows)] = True
    blocks = {"block_q": 3, "block_k": 2}
    fwd = (lambda *a, **kw: ref.tiled_attention_forward(*a, **blocks, **kw)) if tiled else ref.attention_forward
    bwd = (lambda *a, **kw: ref.tiled_attention_backward(*a, **blocks, **kw)) if tiled else ref.attention_backward
    for snk in (None, sinks):
        with np.errstate(all="raise"):
            o, lse = fwd(q, k, v, causal, None, window_size=window, sinks=snk)
            grads = bwd(do, q, k, v, o, lse, causal, None, window_size=window, sinks=snk)
        assert len(grads) == (3 if snk is None else 4)
        dq, dk, dv = grads[:3]
        assert np.all(o[..., dead, :] == 0.0)
        if snk is None:
            assert np.all(np.isneginf(lse[..., dead]))
        else:
            expect = np.broadcast_to(snk.astype(np.float64)[:, None], lse.shape[-2:])
            np.testing.assert_allclose(lse[..., dead], np.broadcast_to(expect[:, dead], lse[..., dead].shape),
                                       rtol=1e-15)  # fmt: skip
            assert np.isfinite(lse).all()
        assert np.isfinite(lse[..., ~dead]).all() and np.isfinite(o).all()
        assert np.all(dq[..., dead, :] == 0.0)
        for g in grads:
            assert np.isfinite(g).all()
        if dead.any():  # dead rows do not reach dk, dv (or dsinks: their o = 0 makes Delta = 0)
            do2 = do.copy()
            do2[..., dead, :] = rng.standard_normal(do2[..., dead, :].shape)
            g2 = bwd(do2, q, k, v, o, lse, causal, None, window_size=window, sinks=snk)
            for a, b in zip(g2[1:], grads[1:]):
                np.testing.assert_allclose(a, b, rtol=0, atol=1e-15)


def test_sink_with_no_keys_matches_naive(rng):
    q, k, v = random_qkv(rng, (1,), 2, 2, 4, 0, 8, np.float64)
    sinks = np.float32([1.0, -0.5])
    o, lse = ref.attention_forward(q, k, v, sinks=sinks)
    assert np.all(o == 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks.astype(np.float64)[:, None], lse.shape))


def test_tiled_skips_only_tiles_outside_the_window(rng, monkeypatch):
    """Tiles the tiled reference skips hold no visible pair, and a narrow window skips most of them."""
    nq, nk, bq, bk = 48, 40, 8, 4
    q, k, v = random_qkv(rng, (1,), 1, 1, nq, nk, 4, np.float64)
    window = (5, 2)
    seen = []
    visible = ref._visible

    def spy(xp, rows, cols, p):
        seen.append((int(rows[0]), int(cols[0])))
        return visible(xp, rows, cols, p)

    monkeypatch.setattr(ref, "_visible", spy)
    ref.tiled_attention_forward(q, k, v, False, None, bq, bk, window_size=window)
    tiles = {(i, j) for i in range(0, nq, bq) for j in range(0, nk, bk)}
    for i0, j0 in tiles - set(seen):
        for i in range(i0, min(i0 + bq, nq)):
            for j in range(j0, min(j0 + bk, nk)):
                assert not visible_naive(i, j, nq, nk, False, window), (i0, j0)
    assert len(set(seen)) < len(tiles) / 2
    fwd_tiles = sorted(seen)
    o, lse = ref.attention_forward(q, k, v, window_size=window)
    seen.clear()
    ref.tiled_attention_backward(q, q, k, v, o, lse, False, None, bq, bk, window_size=window)
    assert sorted(seen) == fwd_tiles


# ---------------------------------------------------------------------------- tiled vs plain

BLOCKS = [(7, 5), (3, 1), (16, 32), (64, 64)]
TILED_CASES = [
    pytest.param(shape, spec, blocks, id=f"{shape}-{spec}-{blocks[0]}x{blocks[1]}")
    for spec in SPECS
    for shape in ("gqa-nq<nk", "mqa-nq>nk", "two-batch")
    for blocks in BLOCKS
    if shape != "two-batch" or spec in ("alibi-batch", "all")
]


def _close(a, b, tol=1e-12):
    return np.linalg.norm(a - b) <= tol * (np.linalg.norm(b) + 1.0)


@pytest.mark.parametrize("shape,spec,blocks", TILED_CASES)
def test_tiled_forward_matches_plain(rng, shape, spec, blocks):
    q, k, v, causal, scale, kw, _ = make_case(rng, shape, spec)
    o, lse = ref.attention_forward(q, k, v, causal, scale, **kw)
    o_t, lse_t = ref.tiled_attention_forward(q, k, v, causal, scale, *blocks, **kw)
    assert _close(o_t, o), "o"
    assert_lse_close(lse_t, lse, 1e-13)


@pytest.mark.parametrize("shape,spec,blocks", TILED_CASES)
def test_tiled_backward_matches_plain(rng, shape, spec, blocks):
    q, k, v, causal, scale, kw, _ = make_case(rng, shape, spec)
    do = rng.standard_normal(q.shape)
    o, lse = ref.attention_forward(q, k, v, causal, scale, **kw)
    grads = ref.attention_backward(do, q, k, v, o, lse, causal, scale, **kw)
    grads_t = ref.tiled_attention_backward(do, q, k, v, o, lse, causal, scale, *blocks, **kw)
    assert len(grads) == len(grads_t) == (4 if kw["sinks"] is not None else 3)
    for name, g_t, g in zip(("dq", "dk", "dv", "dsinks"), grads_t, grads):
        assert g_t.shape == g.shape, name
        assert _close(g_t, g), name


# ---------------------------------------------------------------------------- backward vs finite differences

FD_SPECS = {
    "softcap": dict(softcap=0.8, scale=1.5),
    "alibi-head": dict(alibi="head"),
    "alibi-batch": dict(alibi="batch"),
    "window": dict(window=(1, 2)),
    "causal-window": dict(causal=True, window=(2, -1)),
    "sinks": dict(sinks=True),
    "sinks-causal-masked": dict(sinks=True, causal=True),
    "all": dict(window=(2, 1), softcap=1.2, alibi="batch", sinks=True, scale=1.4),
}
# (batch, hq, hk, nq, nk, d): GQA with Nq > Nk (dead rows under causal) and Nq < Nk
FD_SHAPES = {"gqa-nq>nk": ((2,), 2, 1, 5, 3, 3), "nq<nk": ((1,), 2, 2, 3, 5, 2)}


def _loss_fn(do, causal, scale, kw):
    def loss(q, k, v, sinks):
        o = ref.attention(q, k, v, causal, scale, **{**kw, "sinks": sinks})
        return float(np.sum(o * do))

    return loss


def numerical_grads(loss, args, eps):
    """Central differences of the scalar loss for every element of each argument (None: skipped)."""
    out = []
    for a, (x, h) in enumerate(zip(args, eps)):
        if x is None:
            out.append(None)
            continue
        g = np.zeros(x.shape)
        for idx in np.ndindex(*x.shape):
            plus, minus = list(args), list(args)
            plus[a], minus[a] = x.copy(), x.copy()
            plus[a][idx] += h
            minus[a][idx] -= h
            g[idx] = (loss(*plus) - loss(*minus)) / (2 * h)
        out.append(g)
    return out


@pytest.mark.parametrize("shape", list(FD_SHAPES))
@pytest.mark.parametrize("spec", list(FD_SPECS))
def test_backward_matches_finite_differences(rng, spec, shape):
    batch, hq, hk, nq, nk, d = FD_SHAPES[shape]
    q, k, v = random_qkv(rng, batch, hq, hk, nq, nk, d, np.float64)
    causal, scale, kw, _ = make_variant(rng, FD_SPECS[spec], batch, hq)
    do = rng.standard_normal(q.shape)
    sinks = kw["sinks"]
    # sinks must be float32: a step of 2**-10 is exact on them (|sink| < 4), and the central
    # difference's O(h^2) error stays far below the bound
    expect = numerical_grads(_loss_fn(do, causal, scale, kw), [q, k, v, sinks], [1e-6, 1e-6, 1e-6, 2.0**-10])
    o, lse = ref.attention_forward(q, k, v, causal, scale, **kw)
    analytic = ref.attention_backward(do, q, k, v, o, lse, causal, scale, **kw)
    tiled = ref.tiled_attention_backward(do, q, k, v, o, lse, causal, scale, 2, 3, **kw)
    _, vjp = ref.attention_vjp(q, k, v, causal, scale, **kw)
    from_vjp = vjp(do)
    names = ("dq", "dk", "dv", "dsinks")
    assert len(analytic) == len(tiled) == len(from_vjp) == (3 if sinks is None else 4)
    for name, g, g_t, g_v, e in zip(names, analytic, tiled, from_vjp, expect):
        assert g.shape == e.shape, name
        assert np.linalg.norm(e) > 1e-3, name  # the check is not vacuous
        tol = 1e-5 if name == "dsinks" else 1e-7
        assert rel_err(g, e) < tol, name
        assert rel_err(g_t, e) < tol, name
        np.testing.assert_array_equal(g_v, g)


def test_dsinks_formula(rng):
    """dsinks_h = -sum over batch and rows of exp(sink_h - lse) * rowsum(dO * O)."""
    q, k, v = random_qkv(rng, (3,), 4, 2, 6, 9, 8, np.float64)
    sinks = rng.standard_normal(4).astype(np.float32)
    do = rng.standard_normal(q.shape)
    o, lse = ref.attention_forward(q, k, v, True, None, sinks=sinks)
    *_, ds = ref.attention_backward(do, q, k, v, o, lse, True, None, sinks=sinks)
    delta = (do * o).sum(-1)
    expect = -(np.exp(sinks.astype(np.float64)[:, None] - lse) * delta).sum(axis=(0, 2))
    assert ds.shape == (4,)
    np.testing.assert_allclose(ds, expect, rtol=1e-12)


# ---------------------------------------------------------------------------- the public API on NumPy arrays

API_SPECS = ["window-2-3", "causal-window-4", "softcap-30", "alibi-batch", "sinks", "sinks-window-0-0", "all",
             "all-causal"]  # fmt: skip


def assert_rounded_from(x, exact, dtype):
    """Each element of x is exact rounded to dtype: |x - exact| <= u |exact| (+ subnormal slack)."""
    fi = ml_dtypes.finfo(dtype)
    x64 = np.asarray(x, dtype=np.float64)
    assert np.isfinite(x64).all()
    bound = float(fi.eps) / 2 * np.abs(exact) + float(fi.smallest_subnormal)
    assert np.max(np.abs(x64 - exact) - bound, initial=-np.inf) <= 0, f"off by more than rounding to {dtype}"


@pytest.mark.parametrize("spec", API_SPECS)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_public_api_rounds_the_reference(rng, dtype, spec):
    dt = DTYPES[dtype]
    q, k, v, causal, scale, kw, _ = make_case(rng, "gqa-nq<nk" if "causal" in spec else "mqa-nq>nk", spec, dt)
    do = rng.standard_normal(q.shape).astype(dt)
    o, lse = cf.attention_forward(q, k, v, causal, scale, **kw)
    assert type(o) is np.ndarray and o.dtype == dt and o.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == q.shape[:-1]
    o64, lse64 = ref.attention_forward(q, k, v, causal, scale, **kw)
    assert_rounded_from(o, o64, dt)
    assert rel_err(o, o64) < TOL_OUT[dtype]
    masked = np.isneginf(lse64)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    assert_rounded_from(lse[~masked], lse64[~masked], np.float32)
    np.testing.assert_array_equal(cf.attention(q, k, v, causal, scale, **kw), o)

    grads = cf.attention_backward(do, q, k, v, o, lse, causal, scale, **kw)
    exact = ref.attention_backward(do, q, k, v, o, lse, causal, scale, **kw)
    assert len(grads) == len(exact) == (4 if kw["sinks"] is not None else 3)
    for g, e, x in zip(grads[:3], exact[:3], (q, k, v)):
        assert type(g) is np.ndarray and g.dtype == dt and g.shape == x.shape
        assert_rounded_from(g, e, dt)
    exact_ff = ref.attention_backward(do, q, k, v, o64, lse64, causal, scale, **kw)  # from the exact forward
    for g, e in zip(grads[:3], exact_ff[:3]):
        assert rel_err(g, e) < TOL_GRAD[dtype]
    if kw["sinks"] is not None:
        ds = grads[3]
        assert type(ds) is np.ndarray and ds.dtype == np.float32 and ds.shape == (q.shape[-3],)
        assert_rounded_from(ds, exact[3], np.float32)
        assert rel_err(ds, exact_ff[3]) < TOL_GRAD[dtype] * 10  # o rounded to dtype enters Delta
    o_v, vjp = cf.attention_vjp(q, k, v, causal, scale, **kw)
    np.testing.assert_array_equal(o_v, o)
    for a, b in zip(vjp(do), grads):
        np.testing.assert_array_equal(a, b)


def test_public_api_without_sinks_returns_three(rng):
    q, k, v = random_qkv(rng, (1,), 2, 2, 5, 5, 8, np.float32)
    o, lse = cf.attention_forward(q, k, v, window_size=(1, 1), softcap=5.0, alibi_slopes=np.float32([0.1, 0.2]))
    assert len(cf.attention_backward(q, q, k, v, o, lse, window_size=(1, 1), softcap=5.0,
                                     alibi_slopes=np.float32([0.1, 0.2]))) == 3  # fmt: skip
    out = cf.attention_backward(q, q, k, v, o, lse, sinks=np.zeros(2, np.float32))
    assert len(out) == 4 and out[3].dtype == np.float32 and out[3].shape == (2,)


# ---------------------------------------------------------------------------- the variant's tile rules


def _rule_cases():
    rng = np.random.default_rng(13)
    out = []
    for _ in range(60):
        nq, nk = (int(x) for x in rng.integers(1, 40, 2))
        left, right = (int(x) for x in rng.integers(-1, 12, 2))
        causal = bool(rng.integers(0, 2))
        out.append((nq, nk, causal, (left, right)))
    return out + [(10, 4, False, (0, 0)), (4, 10, False, (0, 0)), (7, 7, True, None), (5, 9, False, None)]


def test_keys_of_and_queries_of_are_tight():
    """Variant.keys_of / queries_of (the tile skipping every kernel family plans with) against brute force:
    the range holds every visible pair and begins and ends on a visible one."""
    from cupyflash.variants import Variant

    for nq, nk, causal, window in _rule_cases():
        var = Variant.of(causal, window, 0.0, False, False)
        vis = np.array([[visible_naive(i, j, nq, nk, causal, window) for j in range(nk)] for i in range(nq)])
        np.testing.assert_array_equal(var.visible(np, np.arange(nq), np.arange(nk), nq, nk), vis)
        for t in (1, 3, 8):
            for q0 in range(0, nq, t):
                k0, k1 = var.keys_of(q0, q0 + t, nq, nk)
                cols = np.flatnonzero(vis[q0 : q0 + t].any(axis=0))
                if cols.size == 0:
                    assert k1 <= k0, (nq, nk, causal, window, q0, t)
                else:
                    assert (k0, k1) == (cols[0], cols[-1] + 1), (nq, nk, causal, window, q0, t)
            for j0 in range(0, nk, t):
                i0, i1 = var.queries_of(j0, min(j0 + t, nk), nq, nk)
                rows = np.flatnonzero(vis[:, j0 : j0 + t].any(axis=1))
                if rows.size == 0:
                    assert i1 <= i0, (nq, nk, causal, window, j0, t)
                else:
                    assert (i0, i1) == (rows[0], rows[-1] + 1), (nq, nk, causal, window, j0, t)
