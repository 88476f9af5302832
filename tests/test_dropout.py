"""Attention dropout on the CPU (issue 16): Philox4x32-10, the keep mask, the reference and the NumPy backend.

- Philox against the known-answer vectors of Random123 (Salmon et al., SC 2011; its kat_vectors file) and
  against a scalar pure-Python transcription of the round function;
- the mask against its written rule (one draw per group {i, i+1, i+8, i+9} x {j, j+1, j+8, j+9}, counter
  (group(j), group(i), h, b), byte 2 ((j/8)%2) + (i/8)%2 of word 2 (i%2) + j%2, kept iff >= round(p 256));
- the tensor-core kernels' way of reading it (dropout_bits: lane pairs, shuffled words, keep bits, the byte
  comparison by carries), transcribed lane by lane, against the mask, in both fragment layouts;
- kept fractions within binomial bounds of the effective p, independence across seeds, heads, batches and
  the bytes of one draw;
- the reference (plain and tiled) and the NumPy backend against the formula with ``dropout_mask``'s mask,
  gradients against finite differences; bad input.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cupyflash
from cupyflash import dropout as dropout_rule
from cupyflash import reference
from cupyflash.philox import philox4x32_10

# Random123's kat_vectors, philox4x32 with 10 rounds: (counter, key, expected output).
KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]  # fmt: skip


@pytest.mark.parametrize("counter, key, want", KAT)
def test_philox_known_answers(counter, key, want):
    got = philox4x32_10(np.array(counter, np.uint32), np.array(key, np.uint32))
    assert tuple(int(x) for x in got) == want


def _philox_scalar(c, k):
    """The round function in Python ints, one counter at a time."""
    c, (k0, k1) = list(c), k
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c


def test_philox_vectorised_matches_scalar():
    rng = np.random.default_rng(3)
    counters = rng.integers(0, 2**32, (64, 4), dtype=np.uint64).astype(np.uint32)
    keys = rng.integers(0, 2**32, (64, 2), dtype=np.uint64).astype(np.uint32)
    got = philox4x32_10(counters, keys)
    for c, k, g in zip(counters, keys, got):
        assert [int(x) for x in g] == _philox_scalar([int(x) for x in c], [int(x) for x in k])


def _group(x):
    return (x // 16) * 4 + (x // 2) % 4


def _kept_scalar(seed, p, b, h, i, j):
    """The rule as written in cupyflash/dropout.py, one score at a time."""
    out = _philox_scalar([_group(j), _group(i), h, b], [seed & 0xFFFFFFFF, seed >> 32])
    word = out[2 * (i % 2) + j % 2]
    byte = (word >> (8 * (2 * ((j // 8) % 2) + (i // 8) % 2))) & 0xFF
    return byte >= dropout_rule.threshold(p)


def test_mask_follows_its_rule():
    seed, p = (0x1234_5678 << 32) | 0x9ABC_DEF0, 0.3
    m = cupyflash.dropout_mask((2, 3), 2, 5, 19, p, seed)
    assert m.shape == (2, 3, 2, 5, 19) and m.dtype == bool
    for (b0, b1, h, i, j), kept in np.ndenumerate(m):
        assert kept == _kept_scalar(seed, p, b0 * 3 + b1, h, i, j)
    # rows and columns past the first 16 x 16 block, and a sub-range as the tiled reference asks for it
    rows, cols = np.arange(13, 41), np.arange(30, 51)
    got = dropout_rule.keep(seed, p, np.array([4]), np.array([7]), rows, cols)[0, 0]
    for (r, c), kept in np.ndenumerate(got):
        assert kept == _kept_scalar(seed, p, 4, 7, int(rows[r]), int(cols[c]))


def _carries(w, t):
    """ByteThreshold::carries (dropout.cuh): bit 8k + 7 set iff byte k of w >= t."""
    u = 256 - t
    add = 0x80808080 if t == 0 else (u & 0x7F) * 0x01010101
    top = 0x80808080 if (t == 0 or u & 0x80) else 0
    x = ((w & 0x7F7F7F7F) + add) & 0xFFFFFFFF
    return ((w & x) | ((w | x) & top)) & 0x80808080


def _kept8(w0, w1, t):
    """ByteThreshold::kept8: bit k = byte k of w0 kept, bit 4 + k = byte k of w1."""
    return (((_carries(w1, t) | (_carries(w0, t) >> 4)) * 0x00204081) & 0xFFFFFFFF) >> 24


def test_byte_threshold_by_carries():
    rng = np.random.default_rng(8)
    words = [int(w) for w in rng.integers(0, 2**32, 64, dtype=np.uint64)] + [0, 0xFFFFFFFF, 0x80808080, 0x7F7F7F7F]
    for t in range(256):
        for w0, w1 in zip(words, words[::-1]):
            want = sum(1 << k for k in range(4) if (w0 >> 8 * k) & 0xFF >= t)
            want |= sum(1 << (4 + k) for k in range(4) if (w1 >> 8 * k) & 0xFF >= t)
            assert _kept8(w0, w1, t) == want, (t, hex(w0), hex(w1))


def _strip_bits(seed, p, b, h, row0, col0, nt, key_rows):
    """dropout_bits (mma_softmax.cuh) for all 32 lanes of a warp: the lane pairs (g, g ^ 1) draw one block each,
    keep their two words and shuffle the other two. Returns the keep bits per lane."""
    t_ = dropout_rule.threshold(p)
    blocks = nt // 2

    def draw(lane, m):
        g, t = lane >> 2, lane & 3
        rg, cg = _group(row0 + g), _group(col0 + 16 * m + 2 * t)
        r = _philox_scalar([rg, cg, h, b] if key_rows else [cg, rg, h, b], [seed & 0xFFFFFFFF, seed >> 32])
        odd = g & 1
        if key_rows:  # (own0, own1, give0, give1)
            return (r[1], r[3], r[0], r[2]) if odd else (r[0], r[2], r[1], r[3])
        return (r[2], r[3], r[0], r[1]) if odd else (r[0], r[1], r[2], r[3])

    bits = [0] * 32
    for m in range(0, blocks - 1, 2):
        words = [draw(lane, m + ((lane >> 2) & 1)) for lane in range(32)]
        for lane in range(32):
            own0, own1, _, _ = words[lane]
            _, _, got0, got1 = words[lane ^ 4]  # __shfl_xor_sync(..., 4)
            own, got = _kept8(own0, own1, t_), _kept8(got0, got1, t_)
            pair = (got | own << 8) if (lane >> 2) & 1 else (own | got << 8)
            bits[lane] |= pair << (8 * m)
    if blocks % 2:
        for lane in range(32):
            own0, own1, _, _ = draw(lane, blocks - 1)
            bits[lane] |= _kept8(own0, own1, t_) << (8 * (blocks - 1))
    return bits


@pytest.mark.parametrize("key_rows", [False, True])
@pytest.mark.parametrize("nt, row0, col0, p", [(8, 32, 64, 0.3), (2, 16, 48, 0.5), (6, 0, 96, 0.1), (4, 48, 0, 0.9)])
def test_strip_bits_are_the_mask_in_both_layouts(nt, row0, col0, p, key_rows):
    """Lane (g, t) holds rows row0 + g + 8 (e / 2) and columns col0 + 8n + 2t + e % 2 of the strip; key-major
    strips hold keys in the rows and queries in the columns."""
    seed, b, h = 0xDEADBEEF_0BADF00D, 3, 5
    bits = _strip_bits(seed, p, b, h, row0, col0, nt, key_rows)
    rows = np.arange(row0, row0 + 16)
    cols = np.arange(col0, col0 + 8 * nt)
    mask = dropout_rule.keep(seed, p, np.array([b]), np.array([h]), *((cols, rows) if key_rows else (rows, cols)))[0, 0]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for n in range(nt):
            for e in range(4):
                bit = 8 * (n >> 1) + 4 * (e & 1) + (2 * (e >> 1) + (n & 1) if key_rows else 2 * (n & 1) + (e >> 1))
                r, c = g + 8 * (e >> 1), 8 * n + 2 * t + (e & 1)
                want = mask[c, r] if key_rows else mask[r, c]
                assert bool((bits[lane] >> bit) & 1) == want, (lane, n, e)


@pytest.mark.parametrize("p", [0.1, 0.17, 0.5])
def test_kept_fraction_within_binomial_bounds(p):
    m = cupyflash.dropout_mask(2, 4, 256, 256, p, 2024)
    q = cupyflash.effective_dropout_p(p)  # what the mask drops: p rounded to a multiple of 1/256
    assert q == round(p * 256) / 256
    n = m.size
    sd = math.sqrt(n * q * (1 - q))
    assert abs(int(m.sum()) - n * (1 - q)) <= 5 * sd  # five sigma: fails by chance ~6e-7
    for part in (m[0, 0], m[1, 3], m[:, :, :128, :128], m[:, :, 3::16, 9::16]):  # per head, block, byte slot too
        sd = math.sqrt(part.size * q * (1 - q))
        assert abs(int(part.sum()) - part.size * (1 - q)) <= 5 * sd


def test_masks_independent_across_seeds_heads_batches():
    p = 0.5
    a = cupyflash.dropout_mask(2, 2, 128, 128, p, 1)
    b = cupyflash.dropout_mask(2, 2, 128, 128, p, 2)
    assert np.array_equal(a, cupyflash.dropout_mask(2, 2, 128, 128, p, 1))  # same seed, same mask
    n = a[0, 0].size  # agreement of two independent fair masks: Binomial(n, 1/2)
    pairs = [(a[0, 0], b[0, 0]), (a[0, 0], a[0, 1]), (a[0, 0], a[1, 0]), (a[0, 1], a[1, 1])]
    for x, y in pairs:
        same = int((x == y).sum())
        assert abs(same - n / 2) <= 5 * math.sqrt(n / 4), same
    # scores that share one Philox draw (other bytes of the same word, other words) are independent too
    x = a[..., 0::16, 0::16].ravel()
    for di, dj in ((0, 1), (1, 0), (1, 1), (8, 0), (0, 8), (9, 9)):
        y = a[..., di::16, dj::16].ravel()
        assert abs(int((x == y).sum()) - x.size / 2) <= 5 * math.sqrt(x.size / 4)


def test_p_zero_keeps_everything_and_threshold_edges():
    assert cupyflash.dropout_mask(1, 1, 8, 8, 0.0, 7).all()
    assert dropout_rule.threshold(0.0) == 0
    assert dropout_rule.threshold(0.5) == 128
    assert dropout_rule.threshold(0.1) == 26 and cupyflash.effective_dropout_p(0.1) == 26 / 256
    assert dropout_rule.threshold(np.nextafter(1 / 512, 0.0)) == 0  # below half a level: nothing dropped
    assert dropout_rule.threshold(1 / 512) == 1
    assert dropout_rule.threshold(np.nextafter(1.0, 0.0)) == 255  # at most 255 / 256
    assert dropout_rule.keep_scale(0.5) == 2.0 and dropout_rule.keep_scale(0.001) == 1.0
    assert cupyflash.dropout_mask(1, 2, 40, 40, 0.001, 7).all()
    assert cupyflash.dropout_mask(1, 2, 64, 64, 0.999, 7).mean() < 0.02
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        cupyflash.effective_dropout_p(1.0)


def _inputs(rng, b=2, hq=4, hk=2, nq=24, nk=33, d=8):
    q = rng.standard_normal((b, hq, nq, d))
    k = rng.standard_normal((b, hk, nk, d))
    v = rng.standard_normal((b, hk, nk, d))
    return q, k, v


def _formula(q, k, v, mask, p, causal=False):
    group = q.shape[-3] // k.shape[-3]
    kk, vv = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    s = q @ kk.swapaxes(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        nq, nk = s.shape[-2:]
        s = np.where(np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq, s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    P = e / e.sum(axis=-1, keepdims=True)
    return (P * mask / (1 - cupyflash.effective_dropout_p(p))) @ vv


@pytest.mark.parametrize("causal", [False, True])
def test_reference_forward_is_the_formula_with_the_mask(causal, rng):
    q, k, v = _inputs(rng)
    p, seed = 0.17, 99
    mask = cupyflash.dropout_mask(2, 4, 24, 33, p, seed)
    want = _formula(q, k, v, mask, p, causal)
    o, lse = reference.attention_forward(q, k, v, causal, dropout_p=p, dropout_seed=seed)
    assert np.allclose(o, want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(lse, reference.attention_forward(q, k, v, causal)[1])  # lse is undropped
    to, tlse = reference.tiled_attention_forward(q, k, v, causal, None, 8, 16, dropout_p=p, dropout_seed=seed)
    assert np.allclose(to, o, rtol=1e-12, atol=1e-12) and np.allclose(tlse, lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("variant", [dict(), dict(causal=True, softcap=5.0), dict(window_size=(4, 6))])
def test_reference_gradients_match_finite_differences(variant, rng):
    q, k, v = _inputs(rng, b=1, hq=2, hk=1, nq=7, nk=9, d=4)
    do = rng.standard_normal(q.shape)
    kw = dict(dropout_p=0.3, dropout_seed=12345, **variant)
    o, lse = reference.attention_forward(q, k, v, **kw)
    grads = reference.attention_backward(do, q, k, v, o, lse, **kw)
    tiled = reference.tiled_attention_backward(do, q, k, v, o, lse, block_q=3, block_k=4, **kw)
    for g, t in zip(grads, tiled):
        assert np.allclose(g, t, rtol=1e-11, atol=1e-12)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + eps
            up = (reference.attention_forward(q, k, v, **kw)[0] * do).sum()
            x[idx] = old - eps
            dn = (reference.attention_forward(q, k, v, **kw)[0] * do).sum()
            x[idx] = old
            num[idx] = (up - dn) / (2 * eps)
        assert np.allclose(g, num, rtol=1e-6, atol=1e-7)


def test_numpy_backend_and_vjp(rng):
    q, k, v = (x.astype(np.float32) for x in _inputs(rng))
    do = rng.standard_normal(q.shape).astype(np.float32)
    kw = dict(dropout_p=0.1, dropout_seed=2**64 - 1)
    o, lse = cupyflash.attention_forward(q, k, v, True, **kw)
    ro, rlse = reference.attention_forward(q, k, v, True, **kw)
    assert np.allclose(o, ro, rtol=1e-5, atol=1e-6)
    grads = cupyflash.attention_backward(do, q, k, v, o, lse, True, **kw)
    rgrads = reference.attention_backward(do, q, k, v, o, lse, True, **kw)
    for g, r in zip(grads, rgrads):
        assert np.allclose(g, r, rtol=1e-4, atol=1e-5)
    # vjp without a seed: one is drawn (NumPy's global generator here) and the backward keeps it
    np.random.seed(5)
    o1, vjp = cupyflash.attention_vjp(q, k, v, True, dropout_p=0.1)
    np.random.seed(5)
    seed = cupyflash.api.draw_seed(q)
    assert np.array_equal(o1, cupyflash.attention_forward(q, k, v, True, dropout_p=0.1, dropout_seed=seed)[0])
    lse1 = cupyflash.attention_forward(q, k, v, True)[1]
    want = cupyflash.attention_backward(do, q, k, v, o1, lse1, True, dropout_p=0.1, dropout_seed=seed)
    for g, w in zip(vjp(do), want):
        assert np.array_equal(g, w)
    assert not np.array_equal(cupyflash.attention(q, k, v, dropout_p=0.5), cupyflash.attention(q, k, v, dropout_p=0.5))


@pytest.mark.parametrize("p, seed, err, match", [
    (1.0, 1, ValueError, r"dropout_p must be in \[0, 1\)"),
    (-0.1, 1, ValueError, r"dropout_p must be in \[0, 1\)"),
    (float("nan"), 1, ValueError, r"dropout_p must be in \[0, 1\)"),
    (True, 1, TypeError, "dropout_p must be a real number"),
    ("0.1", 1, TypeError, "dropout_p must be a real number"),
    (0.1, None, ValueError, "dropout_seed is required"),
    (0.1, 1.0, TypeError, "dropout_seed must be an int"),
    (0.1, True, TypeError, "dropout_seed must be an int"),
    (0.1, -1, ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
    (0.1, 2**64, ValueError, r"dropout_seed must be in \[0, 2\*\*64\)"),
])  # fmt: skip
def test_bad_dropout_arguments(p, seed, err, match, rng):
    q, k, v = (x.astype(np.float32) for x in _inputs(rng))
    with pytest.raises(err, match=match):
        cupyflash.attention_forward(q, k, v, dropout_p=p, dropout_seed=seed)
    o, lse = cupyflash.attention_forward(q, k, v)
    with pytest.raises(err, match=match):
        cupyflash.attention_backward(o, q, k, v, o, lse, dropout_p=p, dropout_seed=seed)
    with pytest.raises(err, match=match):
        cupyflash.dropout_mask(1, 1, 4, 4, p, seed)


def test_dropout_mask_bad_shapes():
    with pytest.raises(TypeError, match="nq must be a non-negative int"):
        cupyflash.dropout_mask(1, 1, 4.0, 4, 0.1, 1)
    with pytest.raises(ValueError, match="small shapes"):
        cupyflash.dropout_mask(64, 64, 1024, 1024, 0.1, 1)
