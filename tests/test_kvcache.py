"""KV-cache attention and the log-sum-exp merge on the CPU: the NumPy reference against dense attention on the
gathered cache, merge against attention over the union of keys, the in-place append, the checks, the
decode plans and the DecodeParams layout (through NVRTC, no GPU)."""
from __future__ import annotations

import re

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import kvcache_reference as kref
from cupyflash import reference as ref
from cupyflash.kvcache_validation import check_kvcache

# ---------------------------------------------------------------------------- merge


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_merge_equals_attention_over_the_union(rng, parts):
    b, h, nq, nk, d = 2, 3, 4, 37, 16
    q = rng.standard_normal((b, h, nq, d))
    k = rng.standard_normal((b, h, nk, d))
    v = rng.standard_normal((b, h, nk, d))
    cuts = np.sort(rng.choice(np.arange(1, nk), parts - 1, replace=False)) if parts > 1 else []
    bounds = [0, *cuts, nk]
    os, ls = zip(*(ref.attention_forward(q, k[..., a:e, :], v[..., a:e, :]) for a, e in zip(bounds, bounds[1:])))
    o, lse = kref.merge_attention_states(np.stack(os), np.stack(ls))
    o_ref, lse_ref = ref.attention_forward(q, k, v)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)


def test_merge_ignores_empty_parts_and_empty_rows_give_zero(rng):
    o = rng.standard_normal((3, 2, 8))
    lse = rng.standard_normal((3, 2))
    o[1] = np.nan  # an empty part's output is never read
    lse[1] = -np.inf
    lse[:, 1] = -np.inf  # row 1: no part saw a key
    out, l = kref.merge_attention_states(o, lse)
    w = np.exp(lse[[0, 2], 0] - lse[[0, 2], 0].max())
    np.testing.assert_allclose(out[0], (w[:, None] * o[[0, 2], 0]).sum(0) / w.sum(), rtol=1e-12)
    assert np.all(out[1] == 0) and l[1] == -np.inf


def test_merge_numpy_backend_rounds_once(rng):
    o = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    lse = rng.standard_normal((2, 5, 3)).astype(np.float32)
    out, l = cf.merge_attention_states(o, lse)
    assert out.dtype == np.float32 and l.dtype == np.float32 and out.shape == (5, 3, 8) and l.shape == (5, 3)


def test_merge_checks():
    o = np.zeros((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="lse_parts must have"):
        cf.merge_attention_states(o, np.zeros((2, 4), np.float32))
    with pytest.raises(TypeError, match="lse_parts.dtype"):
        cf.merge_attention_states(o, np.zeros((2, 3), np.float16))
    with pytest.raises(ValueError, match="at least one part"):
        cf.merge_attention_states(np.zeros((0, 3, 8), np.float32), np.zeros((0, 3), np.float32))


# ---------------------------------------------------------------------------- KV cache: the reference


def make_cache(rng, b, hk, cap, d, dtype=np.float64, page_size=None, extra_pages=3, logical=None, table=None):
    """A logical cache (B, Hk, cap, D) and its storage: contiguous, or shuffled pages plus a block table.
    ``logical`` and ``table``: store these keys, under this table (a V cache beside its K cache), instead of new."""
    if logical is None:
        logical = rng.standard_normal((b, hk, cap, d)).astype(dtype)
    if page_size is None:
        return logical, logical.copy(), None
    per_seq = -(-cap // page_size)
    n_pages = b * per_seq + extra_pages
    pages = rng.standard_normal((n_pages, hk, page_size, d)).astype(dtype)
    if table is None:
        table = rng.permutation(n_pages)[: b * per_seq].reshape(b, per_seq).astype(np.int32)
    for bi in range(b):
        for j in range(per_seq):
            n = min(page_size, cap - j * page_size)
            pages[table[bi, j], :, :n] = logical[bi, :, j * page_size : j * page_size + n]
    return logical, pages, table


def dense_expected(q, logical, kn, vn, lens, causal=False, **variant):
    """Attention of each sequence over its cached keys followed by the new ones (independent of pages)."""
    b = q.shape[0]
    o = np.zeros(q.shape)
    lse = np.zeros(q.shape[:-1])
    for bi in range(b):
        K = logical[0][bi, :, : lens[bi]]
        V = logical[1][bi, :, : lens[bi]]
        if kn is not None:
            K = np.concatenate([K, kn[bi]], axis=1)
            V = np.concatenate([V, vn[bi]], axis=1)
        kw = dict(variant)
        if kw.get("alibi_slopes") is not None and kw["alibi_slopes"].ndim == 2:
            kw["alibi_slopes"] = kw["alibi_slopes"][bi]
        o[bi], lse[bi] = ref.attention_forward(q[bi], K, V, causal, **kw)
    return o, lse


@pytest.mark.parametrize("page_size", [None, 1, 16, 5])
@pytest.mark.parametrize("n_new", [0, 1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_reference_against_dense_attention(rng, page_size, n_new, causal):
    b, hq, hk, nq, d, cap = 4, 4, 2, 2, 8, 40
    lk, kc, table = make_cache(rng, b, hk, cap, d, page_size=page_size)
    lv, vc, _ = make_cache(rng, b, hk, cap, d, page_size=page_size)
    if table is not None:  # both caches share the block table
        vc = np.zeros_like(kc)
        for bi in range(b):
            for j in range(table.shape[1]):
                n = min(page_size, cap - j * page_size)
                vc[table[bi, j], :, :n] = lv[bi, :, j * page_size : j * page_size + n]
    lens = np.array([0, cap - n_new, 7, 19][:b], dtype=np.int32)  # empty, full, partial
    q = rng.standard_normal((b, hq, nq, d))
    kn = vn = None
    if n_new:
        kn = rng.standard_normal((b, hk, n_new, d))
        vn = rng.standard_normal((b, hk, n_new, d))
    kc0, vc0 = kc.copy(), vc.copy()
    o, lse = kref.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, causal=causal)
    o_ref, lse_ref = dense_expected(q, (lk, lv), kn, vn, lens, causal)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    # The append wrote exactly the new slots.
    changed = np.argwhere(np.any(kc != kc0, axis=(1, 3)) | np.any(vc != vc0, axis=(1, 3)))
    expect = set()
    for bi in range(b):
        for i in range(n_new):
            pos = lens[bi] + i
            expect.add((table[bi, pos // page_size], pos % page_size) if table is not None else (bi, pos))
    assert {tuple(x) for x in changed} <= expect


def test_reference_variants_and_batch_index(rng):
    b, hq, hk, nq, d, cap = 3, 4, 1, 3, 8, 30
    rows = 5
    kc = rng.standard_normal((rows, hk, cap, d))
    vc = rng.standard_normal((rows, hk, cap, d))
    idx = np.array([4, 0, 2], np.int32)
    lens = np.array([10, 0, 26], np.int32)
    q = rng.standard_normal((b, hq, nq, d))
    kn = rng.standard_normal((b, hk, 2, d))
    vn = rng.standard_normal((b, hk, 2, d))
    variant = dict(window_size=(5, 1), softcap=3.0, alibi_slopes=rng.random((b, hq)).astype(np.float32),
                   sinks=rng.standard_normal(hq).astype(np.float32))  # fmt: skip
    logical = (kc[idx].copy(), vc[idx].copy())
    o, lse = kref.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, cache_batch_idx=idx, **variant)
    o_ref, lse_ref = dense_expected(q, logical, kn, vn, lens, **variant)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    assert np.array_equal(kc[idx[0], :, 10:12], kn[0]) and np.array_equal(vc[idx[2], :, 26:28], vn[2])


def test_numpy_backend_matches_reference_and_updates_in_place(rng):
    b, hq, hk, nq, d, cap = 2, 8, 2, 1, 16, 64
    kc = rng.standard_normal((b, hk, cap, d)).astype(np.float32)
    vc = rng.standard_normal((b, hk, cap, d)).astype(np.float32)
    q = rng.standard_normal((b, hq, nq, d)).astype(np.float32)
    kn = rng.standard_normal((b, hk, 1, d)).astype(np.float32)
    vn = rng.standard_normal((b, hk, 1, d)).astype(np.float32)
    kr, vr = kc.copy(), vc.copy()
    o, lse = cf.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=np.array([5, 63], np.int32), causal=True)
    o_ref, lse_ref = kref.attention_with_kvcache(q, kr, vr, kn, vn, cache_seqlens=np.array([5, 63], np.int32),
                                                 causal=True)  # fmt: skip
    assert o.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_allclose(o, o_ref, rtol=1e-6, atol=1e-6)
    assert np.array_equal(kc, kr) and np.array_equal(vc, vr)
    assert np.array_equal(kc[1, :, 63], kn[1, :, 0])


def test_int_cache_seqlens(rng):
    kc = rng.standard_normal((2, 1, 16, 8))
    vc = rng.standard_normal((2, 1, 16, 8))
    q = rng.standard_normal((2, 2, 1, 8))
    o1, _ = kref.attention_with_kvcache(q, kc, vc, cache_seqlens=9)
    o2, _ = kref.attention_with_kvcache(q, kc, vc, cache_seqlens=np.array([9, 9], np.int32))
    np.testing.assert_array_equal(o1, o2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary_against_complex_rotation(rng, interleaved, causal):
    """Rotary in the reference = q and the new k multiplied by e^(i theta_pos) as complex pairs, then plain
    KV-cache attention (q rows advance their position only under causal/local masks)."""
    b, hq, hk, nq, d, cap, rd, n_new = 2, 4, 2, 3, 16, 24, 12, 3
    theta = rng.uniform(0, 2 * np.pi, (cap, rd // 2))
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    kc = rng.standard_normal((b, hk, cap, d))
    vc = rng.standard_normal((b, hk, cap, d))
    q = rng.standard_normal((b, hq, nq, d))
    kn = rng.standard_normal((b, hk, n_new, d))
    vn = rng.standard_normal((b, hk, n_new, d))
    lens = np.array([0, cap - n_new], np.int32)

    def rot(x, pos):  # x (..., N, d), pos (N,)
        x = x.copy()
        e = np.cos(theta[pos]).astype(np.float32) + 1j * np.sin(theta[pos]).astype(np.float32)
        if interleaved:
            z = (x[..., 0:rd:2] + 1j * x[..., 1:rd:2]) * e
            x[..., 0:rd:2], x[..., 1:rd:2] = z.real, z.imag
        else:
            z = (x[..., : rd // 2] + 1j * x[..., rd // 2 : rd]) * e
            x[..., : rd // 2], x[..., rd // 2 : rd] = z.real, z.imag
        return x

    step = int(causal)
    q_rot = np.stack([rot(q[i], lens[i] + step * np.arange(nq)) for i in range(b)])
    k_rot = np.stack([rot(kn[i], lens[i] + np.arange(n_new)) for i in range(b)])
    kr, vr = kc.copy(), vc.copy()
    o_ref, lse_ref = kref.attention_with_kvcache(q_rot, kr, vr, k_rot, vn, cache_seqlens=lens, causal=causal)
    o, lse = kref.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, causal=causal, rotary_cos=cos,
                                         rotary_sin=sin, rotary_interleaved=interleaved)  # fmt: skip
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(kc, kr, rtol=1e-12, atol=1e-12)
    assert np.array_equal(vc, vr)


# ---------------------------------------------------------------------------- checks


def _args(rng=None, b=2, hq=4, hk=2, nq=1, d=8, cap=16):
    z = np.zeros
    return dict(q=z((b, hq, nq, d), np.float32), k_cache=z((b, hk, cap, d), np.float32),
                v_cache=z((b, hk, cap, d), np.float32))  # fmt: skip


@pytest.mark.parametrize(
    "change, err, match",
    [
        (dict(q=np.zeros((2, 3, 1, 8), np.float32)), ValueError, "multiple of key/value heads"),
        (dict(v_cache=np.zeros((2, 2, 15, 8), np.float32)), ValueError, "same shape"),
        (dict(k_cache=np.zeros((2, 2, 16, 8), np.float16)), TypeError, "k_cache.dtype"),
        (dict(k=np.zeros((2, 2, 1, 8), np.float32)), ValueError, "given together"),
        (dict(k=np.zeros((2, 2, 17, 8), np.float32), v=np.zeros((2, 2, 17, 8), np.float32)), ValueError, "do not fit"),
        (dict(k=np.zeros((2, 4, 1, 8), np.float32), v=np.zeros((2, 4, 1, 8), np.float32)), ValueError, "Nnew"),
        (dict(cache_seqlens=np.zeros(2, np.int64)), TypeError, "int32"),
        (dict(cache_seqlens=np.zeros(3, np.int32)), ValueError, "cache_seqlens must have shape"),
        (dict(cache_seqlens=17), ValueError, "0..16"),
        (dict(cache_seqlens=True), TypeError, "bool"),
        (dict(block_table=np.zeros((2, 2), np.int64)), TypeError, "block_table.dtype"),
        (dict(block_table=np.zeros((3, 2), np.int32)), ValueError, "block_table must have shape"),
        (dict(cache_batch_idx=np.zeros(2, np.int32), block_table=np.zeros((2, 2), np.int32)), ValueError, "paged"),
        (dict(k_cache=np.zeros((3, 2, 16, 8), np.float32), v_cache=np.zeros((3, 2, 16, 8), np.float32)), ValueError,
         "cache_batch_idx"),
        (dict(num_splits=-1), ValueError, "num_splits"),
        (dict(rotary_cos=np.zeros((16, 4), np.float32)), ValueError, "together"),
        (dict(rotary_cos=np.zeros((16, 5), np.float32), rotary_sin=np.zeros((16, 5), np.float32)), ValueError,
         "rotary_dim"),
        (dict(rotary_cos=np.zeros((15, 4), np.float32), rotary_sin=np.zeros((15, 4), np.float32)), ValueError,
         "cover"),
        (dict(rotary_cos=np.zeros((16, 4)), rotary_sin=np.zeros((16, 4))), TypeError, "float32"),
        (dict(rotary_interleaved=1), TypeError, "rotary_interleaved"),
        (dict(sinks=np.zeros(3, np.float32)), ValueError, "sinks must have shape"),
    ],
)
def test_checks(change, err, match):
    args = {**_args(), "cache_seqlens": 3, **change}
    with pytest.raises(err, match=match):
        cf.attention_with_kvcache(**args)


def test_page_size_limit():
    args = _args()
    args.update(k_cache=np.zeros((4, 2, 257, 8), np.float32), v_cache=np.zeros((4, 2, 257, 8), np.float32))
    with pytest.raises(ValueError, match="page_size"):
        cf.attention_with_kvcache(**args, cache_seqlens=0, block_table=np.zeros((2, 1), np.int32))


@pytest.mark.parametrize(
    "keywords, match",
    [
        (dict(cache_seqlens=np.array([3, 16], np.int32)), r"cache_seqlens\[1\] = 16"),
        (dict(cache_seqlens=np.array([-1, 0], np.int32)), r"cache_seqlens\[0\] = -1"),
        (dict(cache_seqlens=np.array([3, 4], np.int32), block_table=np.array([[0, 9], [1, 2]], np.int32)), None),
        (dict(cache_seqlens=np.array([9, 4], np.int32), block_table=np.array([[0, 9], [1, 2]], np.int32)),
         r"block_table\[0, 1\] = 9"),
        (dict(cache_seqlens=np.array([3, 4], np.int32), cache_batch_idx=np.array([0, 2], np.int32)),
         r"cache_batch_idx\[1\] = 2"),
    ],
)
def test_validate_checks_values(keywords, match):
    args = _args(cap=16)
    if "block_table" in keywords:  # 4 pages of 8 keys, 2 pages per sequence: capacity 16
        args.update(k_cache=np.zeros((4, 2, 8, 8), np.float32), v_cache=np.zeros((4, 2, 8, 8), np.float32))
    args["k"] = np.zeros((2, 2, 1, 8), np.float32)
    args["v"] = np.zeros((2, 2, 1, 8), np.float32)
    if match is None:  # the unused page 9 of sequence 0 is not checked
        cf.attention_with_kvcache(**args, **keywords, validate=True)
        return
    with pytest.raises(ValueError, match=match):
        cf.attention_with_kvcache(**args, **keywords, validate=True)


# ---------------------------------------------------------------------------- plans and the ABI


def _problem(b=8, hq=32, hk=8, nq=1, d=128, cap=32768, dtype=np.float16, page_size=None, **kw):
    from cupyflash import _dtypes

    dt = _dtypes.BFLOAT16 if dtype == "bf16" else np.dtype(dtype)
    q = np.zeros((b, hq, nq, d), np.float32).astype(dt)
    if page_size:
        kc = np.zeros((1, hk, page_size, d), np.float32).astype(dt)
        table = np.zeros((b, cap // page_size), np.int32)
        return check_kvcache(q, kc, kc, cache_seqlens=0, block_table=table, **kw)
    kc = np.lib.stride_tricks.as_strided(np.zeros(1, dt), (b, hk, cap, d), (0, 0, 0, dt.itemsize))
    return check_kvcache(q, kc, kc, cache_seqlens=0, **kw)


@pytest.mark.parametrize("shape", [(8, 1, 32768), (64, 1, 4096), (1, 1, 131072), (128, 1, 1024), (8, 16, 32768)])
def test_plans_for_the_issue_shapes(shape):
    from cupyflash.kernels import decode
    from cupyflash.plans import H100

    b, nq, cap = shape
    p = _problem(b=b, nq=nq, cap=cap)
    pl = decode.plan(p, H100)
    blocks = b * 8 * pl.m_chunks
    assert pl.decode.grid == (b, 8 * pl.m_chunks, pl.splits)
    assert pl.km >= min(64, 4 * nq) and pl.decode.shared_bytes <= H100.max_shared_per_block
    # the GPU filled: one more split would give more blocks than SMs, or the splits ran out
    assert blocks * (pl.splits + 1) > H100.sm_count or pl.splits == 128 or pl.splits * 4 * pl.kbc >= cap
    assert pl.append is None


@pytest.mark.parametrize("shape, splits", [((8, 1, 32768), 4), ((64, 1, 4096), 1), ((1, 1, 131072), 16),
                                           ((128, 1, 1024), 1), ((8, 16, 32768), 4)])  # fmt: skip
def test_mma_plans_for_the_issue_shapes(shape, splits):
    """bf16 runs the tensor-core kernel: one 16-row strip at Nq = 1 (4 packed rows), four at Nq = 16 (64 rows), a
    three-stage ring with two blocks per H100 SM; the splits fill one wave of 2 x 132 resident blocks, at most 16
    at Nq = 1 on a contiguous cache (B = 1: 16 splits, 128 blocks; B = 8: 4 splits, 256 blocks)."""
    from cupyflash.kernels import decode
    from cupyflash.plans import H100

    b, nq, cap = shape
    pl = decode.plan(_problem(b=b, nq=nq, cap=cap, dtype="bf16"), H100)
    assert pl.kernel == "mma" and "decode_split_mma<__nv_bfloat16, 128, " in pl.decode.name
    assert (pl.km, pl.stages, pl.splits) == (16 if nq == 1 else 64, 3, splits)
    assert pl.decode.shared_bytes == decode.mma_smem_bytes(128, pl.km // 16, 3) <= H100.max_shared_per_block
    assert decode.blocks_per_sm(pl.decode.shared_bytes, H100) == 2 and pl.decode.max_carveout
    assert b * 8 * pl.splits <= 2 * H100.sm_count or pl.splits == 1


def test_split_model_caps_contiguous_caches_at_one_merge_batch():
    """Decode v8: at Nq = 1 a contiguous cache's splits fill two blocks an SM but stop at 16, one L2 round trip of
    the merge (B = 1: 16 splits, not 33; B = 8: 4); a paged cache (measured slower at 16 splits: its copies read the
    table) and Nq = 16 fill the 264 slots; D = 64 (four blocks an SM by shared memory) is counted at two."""
    from cupyflash.kernels import decode
    from cupyflash.plans import H100

    def splits(**kw):
        return decode.plan(_problem(dtype="bf16", **kw), H100).splits

    assert decode.CONTIGUOUS_SPLITS == 16
    assert (splits(b=1, cap=131072), splits(b=1, cap=131072, page_size=16)) == (16, 33)
    assert (splits(b=8, cap=32768), splits(b=8, cap=32768, page_size=16)) == (4, 4)
    assert (splits(b=2, cap=65536), splits(b=4, cap=32768), splits(b=16, cap=16384)) == (16, 8, 2)
    assert splits(b=1, cap=131072, d=64) == 16
    assert splits(b=1, nq=16, cap=131072) == 33


def test_kernel_choice():
    """float32 caches take the FMA kernel (mma would round its operands), 16-bit ones tensor cores; "fma" forces
    the FMA kernel, "mma" refuses float32; D = 256 on a 99 KB part falls back to the FMA kernel."""
    from cupyflash.kernels import decode
    from cupyflash.plans import A100, H100, RTX4090

    assert decode.plan(_problem(dtype=np.float32), H100).kernel == "fma"
    assert decode.plan(_problem(), H100).kernel == "mma"
    forced = decode.plan(_problem(), H100, kernel="fma")
    assert forced.kernel == "fma" and "decode_split<__half, 128, 4, 64" in forced.decode.name
    with pytest.raises(ValueError, match="16-bit"):
        decode.plan(_problem(dtype=np.float32), H100, kernel="mma")
    with pytest.raises(ValueError, match="kernel"):
        decode.plan(_problem(), H100, kernel="wgmma")
    for limits in (A100, H100):
        for nq in (1, 3, 16, 40):
            for d in (24, 64, 96, 256):
                pl = decode.plan(_problem(b=2, nq=nq, d=d, cap=4096), limits)
                assert pl.kernel == "mma" and pl.decode.shared_bytes <= limits.max_shared_per_block
                assert pl.km == 16 * next(w for w in (1, 2, 4) if 16 * w >= min(4 * nq, 64))
                assert pl.m_chunks == -(-4 * nq // pl.km)
    assert decode.plan(_problem(b=2, d=256, cap=4096), RTX4090).kernel == "fma"


def test_choose_splits_fills_a_wave():
    from cupyflash.kernels.decode import choose_splits
    from cupyflash.plans import H100

    assert choose_splits(8, 2048, H100, 0, 2) == 33  # 264 blocks: one full wave
    assert choose_splits(300, 2048, H100, 0, 2) == 1  # more blocks than slots
    assert choose_splits(8, 20, H100, 0, 2) == 5  # at least four tiles per split
    assert choose_splits(8, 2048, H100, 6, 2) == 6  # the caller's count
    assert choose_splits(8, 2048, H100, 0, 2, max_splits=16) == 16  # a cap: the plan's for contiguous caches


def test_numpy_bfloat16_call():
    """The NumPy backend takes bfloat16 arrays (the signature cache must not touch their buffers)."""
    from cupyflash import _dtypes

    rng = np.random.default_rng(0)
    q, kc, vc = (rng.standard_normal(s).astype(_dtypes.BFLOAT16) for s in ((2, 4, 1, 16), (2, 2, 8, 16), (2, 2, 8, 16)))
    o, lse = cf.attention_with_kvcache(q, kc, vc, cache_seqlens=5)
    want, _ = kref.attention_with_kvcache(q, kc, vc, cache_seqlens=5)
    assert o.dtype == q.dtype and np.abs(o.astype(np.float64) - want).max() < 1e-2


def test_kernel_keyword_checks():
    args = _args()
    with pytest.raises(ValueError, match="kernel"):
        cf.attention_with_kvcache(**args, cache_seqlens=3, kernel="wgmma")
    with pytest.raises(TypeError, match="NumPy"):
        cf.attention_with_kvcache(**args, cache_seqlens=3, kernel="mma")


def test_plan_respects_num_splits_and_shared_limit():
    from cupyflash.kernels import decode
    from cupyflash.plans import A100, RTX4090

    p = _problem(b=1, cap=4096)
    assert decode.plan(p, A100, num_splits=1).splits == 1
    assert decode.plan(p, A100, num_splits=7).splits == 7
    p32 = _problem(b=1, nq=16, d=256, cap=4096, dtype=np.float32)
    pl = decode.plan(p32, A100)
    assert pl.kbc == 32 and pl.decode.shared_bytes <= A100.max_shared_per_block
    with pytest.raises(ValueError, match="shared memory"):
        decode.plan(p32, RTX4090)


def test_unsupported_head_dims():
    from cupyflash.kernels import decode

    assert decode.unsupported(_problem(d=12)) is not None
    assert decode.unsupported(_problem(d=24)) is None
    assert decode.unsupported(_problem(d=12, dtype=np.float32)) is None


from test_compile import NVRTC_REASON  # noqa: E402

needs_nvrtc = pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON))


@needs_nvrtc
def test_decode_params_layout_matches_cpp():
    from test_launch_abi import probe_values

    from cupyflash.kernels.decode import DECODE_PARAMS

    names = []
    for name in DECODE_PARAMS.names:
        dt, off = DECODE_PARAMS.fields[name][:2]
        names.append((name, off))
    exprs = ["sizeof(cupyflash::DecodeParams)"] + [
        f"__builtin_offsetof(cupyflash::DecodeParams, {n})" for n, _ in names
    ]
    try:
        raw = probe_values("decode.cu", exprs)
    except AssertionError as e:
        if "__builtin_offsetof" not in str(e):
            raise
        pytest.skip("this NVRTC has no __builtin_offsetof for the layout probe")
    assert raw[0] == DECODE_PARAMS.itemsize
    assert raw[1:] == [off for _, off in names]


@needs_nvrtc
def test_mma_shared_bytes_match_cpp():
    """The plan's shared-memory size of decode_split_mma is DecodeMmaSmem<...>::kBytes (through NVRTC)."""
    from test_launch_abi import probe_values

    from cupyflash.kernels import decode

    configs = [(d, w, s) for d in (64, 128, 256) for w in decode.MMA_ROW_WARPS for s in decode.MMA_STAGES]
    exprs = [f"cupyflash::DecodeMmaSmem<__half, {d}, {w}, {s}>::kBytes" for d, w, s in configs]
    raw = probe_values("decode.cu", exprs)
    assert raw == [decode.mma_smem_bytes(d, w, s) for d, w, s in configs]


@needs_nvrtc
def test_decode_kernels_take_one_struct():
    from test_launch_abi import _ptx

    from cupyflash.kernels import decode

    names = [n for _, n in decode.instantiations() if "decode_split" in n or "kv_append" in n][:2]
    ptx, lowered = _ptx(decode.SOURCE, names)
    for name in names:
        head = ptx[ptx.index(f".entry {lowered[name]}(") :]
        head = head[: head.index(")")]
        params = re.findall(r"\.param \.align (\d+) \.b8 \w+\[(\d+)\]|\.param \.\w+ \w+", head)
        assert len(params) == 1 and int(params[0][1]) == decode.DECODE_PARAMS.itemsize, f"{name}: {head}"


def _host_stand_ins(monkeypatch) -> list:
    """The KV-cache host path on host stand-ins (H100 limits, host arrays): the struct-argument launches recorded
    as (plan, argument bytes)."""
    import cupy
    from test_launch_abi import _empty

    from cupyflash import cuda_backend, kvcache, plans
    from cupyflash.kernels import build

    seen = []
    monkeypatch.setattr(build.Launch, "fire", lambda self, stream: seen.append((self.plan, bytes(self.buffer))))
    monkeypatch.setattr(plans.DeviceLimits, "current", classmethod(lambda cls: plans.H100))
    monkeypatch.setattr(cupy, "empty", _empty)
    monkeypatch.setattr(cupy, "zeros", _empty)
    monkeypatch.setattr(cuda_backend, "_empty_outputs", lambda layout: [_empty(s, dt) for s, dt, *_ in layout[1]])
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: type("S", (), {"ptr": 0})())
    monkeypatch.setattr(kvcache, "_workspace", {})  # host stand-ins must not stay in the device workspace cache
    return seen


def test_host_path_fills_decode_params(monkeypatch):
    """The CUDA host path on host stand-ins: launches recorded, the struct decoded field by field."""
    from test_launch_abi import _DeviceArray

    from cupyflash import kvcache
    from cupyflash.kernels import decode

    seen = _host_stand_ins(monkeypatch)
    dev = lambda x: np.ascontiguousarray(x).view(_DeviceArray)  # noqa: E731
    b, hq, hk, nq, d, page, per_seq = 2, 8, 2, 3, 64, 16, 16
    q = dev(np.zeros((b, hq, nq, d), np.float16))
    store = dev(np.zeros((9, page, hk, d), np.float16))  # (pages, slot, head, D) storage seen as (pages, head, slot, D)
    kc = store.transpose(0, 2, 1, 3).view(_DeviceArray)
    kn = dev(np.zeros((b, hk, 2, d), np.float16))
    lens = dev(np.array([3, 40], np.int32))
    table = dev(np.zeros((b, per_seq), np.int32))
    sinks = dev(np.zeros(hq, np.float32))
    problem = check_kvcache(q, kc, kc, kn, kn, cache_seqlens=lens, block_table=table, causal=True, sinks=sinks)
    arrays = dict(q=q, k_cache=kc, v_cache=kc, k=kn, v=kn, cache_seqlens=lens, block_table=table,
                  cache_batch_idx=None, alibi=None, sinks=sinks)  # fmt: skip
    prep = kvcache._prepare(problem, arrays, 4)  # four splits of the 256 keys' four tiles
    o, lse = kvcache._launch(prep, *(arrays.get(n) for n in kvcache.ARRAY_NAMES))
    (append, args0), (split, args1) = seen
    assert "kv_append<__half>" in append.name and append.grid == (b, hk, 1)
    assert "decode_split_mma<__half, 64, 1, 4, cupyflash::Policy<cupyflash::Causal" in split.name
    assert args0 == args1
    rec = np.frombuffer(args1, decode.DECODE_PARAMS)[0]
    assert rec["kc_s"].tolist() == (page * hk * d, d, hk * d)  # element strides of the transposed view
    assert rec["k_cache"] == kc.ctypes.data and rec["block_table"] == table.ctypes.data
    assert rec["cache_seqlens"] == lens.ctypes.data and rec["cache_batch_idx"] == 0
    assert (rec["n_new"], rec["page_size"], rec["num_pages"], rec["pages_per_seq"], rec["m_rows"]) == (2, 16, 9, 16, 12)
    a = rec["attn"]
    assert (a["hq"], a["hk"], a["group"], a["nq"], a["nk"], a["d"]) == (hq, hk, 4, nq, page * per_seq, d)
    assert a["sinks"] == sinks.ctypes.data and a["q"] == q.ctypes.data
    assert a["o"] == o.ctypes.data and a["lse"] == lse.ctypes.data
    # Several splits, merged inside the decode launch (decode v3): no third launch; the partials and the arrival
    # counters (zero: every launch leaves them so) come from the stream's workspace.
    assert split.grid[2] > 1 and len(seen) == 2
    assert rec["o_part"] != 0 and rec["lse_part"] != 0 and rec["split_count"] != 0
    ws = next(w for w in kvcache._workspace.values())
    assert (rec["o_part"], rec["lse_part"], rec["split_count"]) == tuple(x.ctypes.data for x in ws)
    assert ws[0].shape == (split.grid[2], b * hq * nq, d) and ws[2].shape == (b * split.grid[1],)
    assert ws[2].dtype == np.int32 and not ws[2].any()
    # A second call with other arrays reuses the launches: only the pointers differ, written in place.
    q2, kn2, lens2 = dev(np.zeros_like(q)), dev(np.zeros_like(kn)), dev(np.array([1, 2], np.int32))
    arrays2 = dict(arrays, q=q2, k=kn2, v=kn2, cache_seqlens=lens2)
    o2, _ = kvcache._launch(prep, *(arrays2.get(n) for n in kvcache.ARRAY_NAMES))
    (_, again0), (_, again1) = seen[2:]
    assert again0 == again1
    rec2 = np.frombuffer(again1, decode.DECODE_PARAMS)[0]
    assert (rec2["attn"]["q"], rec2["attn"]["o"]) == (q2.ctypes.data, o2.ctypes.data)
    assert (rec2["k_new"], rec2["v_new"]) == (kn2.ctypes.data, kn2.ctypes.data)
    assert rec2["cache_seqlens"] == lens2.ctypes.data
    assert rec2["o_part"] == rec["o_part"]  # the workspace is the same on the same stream
    for name in decode.DECODE_PARAMS.names:  # everything but the pointers is as the first call left it
        if name not in ("attn", "k_new", "v_new", "cache_seqlens"):
            assert rec2[name] == rec[name], name
    same = [n for n in decode.PARAMS.names if n not in ("q", "o", "lse")]
    assert all(np.all(rec2["attn"][n] == a[n]) for n in same)


def test_host_path_int_seqlens_and_rotary(monkeypatch):
    """An int cache_seqlens is written per call into every launch; with rotary, rotate_q reads q as given and the
    append and decode launches read the rotated dense copy."""
    from test_launch_abi import _DeviceArray

    from cupyflash import kvcache
    from cupyflash.kernels import decode

    seen = _host_stand_ins(monkeypatch)
    dev = lambda x: np.ascontiguousarray(x).view(_DeviceArray)  # noqa: E731
    b, hq, hk, nq, d, cap = 2, 4, 2, 1, 64, 128
    qkv = dev(np.zeros((b, nq, 3, hq, d), np.float16))  # q a strided view
    q = qkv[:, :, 0].transpose(0, 2, 1, 3).view(_DeviceArray)
    kc = dev(np.zeros((b, hk, cap, d), np.float16))
    kn = dev(np.zeros((b, hk, 1, d), np.float16))
    cos, sin = dev(np.ones((cap, 16), np.float32)), dev(np.zeros((cap, 16), np.float32))
    kw = dict(cache_seqlens=5, causal=True, rotary_cos=cos, rotary_sin=sin)
    problem = check_kvcache(q, kc, kc, kn, kn, **kw)
    arrays = dict(q=q, k_cache=kc, v_cache=kc, k=kn, v=kn, cache_seqlens=5, block_table=None, cache_batch_idx=None,
                  alibi=None, sinks=None, rotary_cos=cos, rotary_sin=sin)  # fmt: skip
    prep = kvcache._prepare(problem, arrays, 1)
    for lens in (5, 77):
        seen.clear()
        kvcache._launch(prep, *(dict(arrays, cache_seqlens=lens).get(n) for n in kvcache.ARRAY_NAMES))
        (rot, r0), (app, r1), (dec, r2) = seen
        assert "rotate_q" in rot.name and "kv_append" in app.name and "decode_split" in dec.name
        recs = [np.frombuffer(r, decode.DECODE_PARAMS)[0] for r in (r0, r1, r2)]
        assert all(r["seqlen_const"] == lens and r["cache_seqlens"] == 0 for r in recs)
        assert recs[0]["attn"]["q"] == q.ctypes.data and recs[0]["attn"]["q_s"].tolist() == _elems(q)
        q_rot = recs[0]["q_rot"]
        assert q_rot != 0 and all(r["attn"]["q"] == q_rot for r in recs[1:])
        assert all(r["attn"]["q_s"].tolist() == (hq * nq * d, nq * d, d) for r in recs[1:])
        assert all(r["rotary_cos"] == cos.ctypes.data and r["rotary_sin"] == sin.ctypes.data for r in recs)


def _elems(x):
    return tuple(s // x.itemsize for s in x.strides[:3])


def test_pointer_writer_matches_the_struct_layout():
    from cupyflash import kvcache
    from cupyflash.kernels import decode

    names = kvcache.CALL_POINTERS + kvcache.ROTARY_POINTERS
    writer = decode.PointerWriter(names)
    assert len(writer.runs) < len(names)  # adjacent fields share a pack_into
    buf = bytearray(np.full((), 7, decode.DECODE_PARAMS).tobytes())
    values = tuple(1000 + i for i in range(len(names)))
    writer.write(buf, values)
    rec = np.frombuffer(bytes(buf), decode.DECODE_PARAMS)[0]
    untouched = np.frombuffer(np.full((), 7, decode.DECODE_PARAMS).tobytes(), decode.DECODE_PARAMS)[0]
    for name, value in zip(names, values):
        got = rec["attn"][name[5:]] if name.startswith("attn.") else rec[name]
        assert got == value, name
    assert rec["attn"]["k"] == untouched["attn"]["k"] and rec["n_new"] == untouched["n_new"]
    decode.write_seqlen_const(buf, -3)
    assert np.frombuffer(bytes(buf), decode.DECODE_PARAMS)[0]["seqlen_const"] == -3


def test_signature_cache_key():
    """NumPy calls are not cached; an int cache_seqlens enters the key by kind, not by value."""
    from cupyflash import kvcache

    args = _args()
    arrays = dict(args, k=None, v=None, cache_seqlens=3, block_table=None, cache_batch_idx=None, alibi=None, sinks=None)
    scalars = (False, None, None, 0.0, False, 0)
    assert kvcache._signature(tuple(arrays.get(n) for n in kvcache.ARRAY_NAMES), scalars) is None
    p = check_kvcache(**args, cache_seqlens=3)
    kvcache._check_seqlen_const(p, 16)
    with pytest.raises(ValueError, match="0..16"):
        kvcache._check_seqlen_const(p, 17)


def test_bench_suite_decode_arguments():
    from cupyflash.bench.run import _decode_args

    assert _decode_args(["--suite", "decode", "--json", "x.json"]) == ["--json", "x.json"]
    assert _decode_args(["--suite=decode", "--quick"]) == ["--quick"]
    assert _decode_args(["--suite", "grid"]) is None
