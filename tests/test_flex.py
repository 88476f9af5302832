"""User snippets (issue 17 part 3: mask_mod, score_mod, score_mod_grad, aux, create_block_mask) without a GPU.

- checks: bad snippet text, aux and keyword combinations are refused before anything is compiled or launched;
- NVRTC (no GPU needed): a snippet that does not compile raises SnippetError showing the snippet's own line;
- the generated source's layout, and the launches' retargeting onto it (recorded, not run);
- the NumPy reference with Python twins against independent formulations (mask arrays, built-in softcap/ALiBi),
  finite differences through score_mod, and create_block_mask's NumPy version against a brute-force count.
"""
from __future__ import annotations

import numpy as np
import pytest

import cupyflash as cf
from cupyflash import flex, reference
from cupyflash.flex import SnippetError
from cupyflash.flex_block_mask import block_divisor
from cupyflash.validation import check_attention, check_backward
from test_compile import NVRTC_REASON
from test_launch_abi import planned  # noqa: F401  (a fixture: launches recorded, H100 limits)

needs_nvrtc = pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON))


def _qkv(rng, b=2, hq=4, hk=2, nq=37, nk=45, d=16):
    q = rng.standard_normal((b, hq, nq, d))
    k = rng.standard_normal((b, hk, nk, d))
    v = rng.standard_normal((b, hk, nk, d))
    return q, k, v


# ---------------------------------------------------------------------------- checks


@pytest.mark.parametrize("text, words", [
    ("q_idx >= kv_idx # x", "preprocessor"),
    ("asm(0) || true", "'asm'"),
    ("const_cast<int*>(&q_idx)[0] == 0", "'const_cast'"),
    ("cf_p.nq > 0", "'cf_p'"),
    ("(q_idx >= kv_idx", "unbalanced"),
    ("q_idx >= kv_idx)", "unbalanced"),
    ("q_idx >= kv_idx; true", "expression has no ';'"),
    ('q_idx > "a"[0]', "string literals"),
    ("   ", "empty"),
])  # fmt: skip
def test_snippet_text_is_refused(text, words):
    with pytest.raises(SnippetError, match=words):
        flex.check_text("mask_mod", text)


def test_score_is_not_in_score_mod_grad():
    with pytest.raises(SnippetError, match="new_score"):
        flex.check_text("score_mod_grad", "1 - score * score")


@pytest.mark.parametrize("aux, error, words", [
    ({"score": 1.0}, ValueError, r"C\+\+ identifier"),
    ({"int": 1.0}, ValueError, r"C\+\+ identifier"),
    ({"cf_x": 1.0}, ValueError, r"C\+\+ identifier"),
    ({"x": 2**40}, ValueError, "int32"),
    ({"x": np.zeros((2,), np.complex64)}, TypeError, "dtype"),
    ({"x": np.zeros((1, 1, 1, 1, 1), np.float32)}, ValueError, "1 to 4 dims"),
    ({f"a{i}": 1.0 for i in range(9)}, ValueError, "at most 8"),
    ({"x": "text"}, TypeError, "ndarray"),
    ([1.0], TypeError, "dict"),
])  # fmt: skip
def test_aux_is_checked(aux, error, words):
    with pytest.raises(error, match=words):
        flex.check_aux(aux, "numpy")


def test_keyword_combinations_are_checked(rng):
    q, k, v = (x.astype(np.float32) for x in _qkv(rng))
    mm = "q_idx >= kv_idx"
    with pytest.raises(TypeError, match="all be C"):
        check_attention(q, k, v, mask_mod=mm, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match="score_mod_grad needs a score_mod"):
        check_attention(q, k, v, score_mod_grad="1")
    with pytest.raises(ValueError, match="aux is read by"):
        check_attention(q, k, v, aux={"x": 1.0})
    with pytest.raises(ValueError, match="do not combine with mask="):
        check_attention(q, k, v, mask_mod=mm, mask=np.ones((37, 45), bool))
    with pytest.raises(ValueError, match="block_mask needs the mask_mod"):
        check_attention(q, k, v, block_mask=cf.create_block_mask(lambda b, h, i, j: i >= j, None, None, 37, 45))
    with pytest.raises(ValueError, match="made for"):
        check_attention(q, k, v, mask_mod=mm, block_mask=cf.create_block_mask(lambda b, h, i, j: i >= j, None, None,
                                                                             37, 46))  # fmt: skip
    with pytest.raises(TypeError, match="create_block_mask"):
        check_attention(q, k, v, mask_mod=mm, block_mask=np.zeros(3))
    o, lse = cf.attention_forward(q, k, v, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match="needs score_mod_grad"):
        check_backward(q, q, k, v, o, lse, score_mod="score")
    with pytest.raises(NotImplementedError, match="softcap"):
        check_backward(q, q, k, v, o, lse, softcap=5.0, score_mod="score", score_mod_grad="1")
    with pytest.raises(TypeError, match="cannot run C"):  # the reference takes twins only
        reference.attention_forward(q, k, v, mask_mod=mm)
    with pytest.raises(ValueError, match="score_mod_grad"):
        cf.attention_vjp(q, k, v, score_mod=lambda s, b, h, i, j: s)


# ---------------------------------------------------------------------------- NVRTC and the generated source


def test_generated_source_layout():
    spec = flex.FlexSpec(mask_mod="q_idx >= kv_idx", score_mod="{ float t = score; return t * alpha; }",
                         score_mod_grad="alpha", aux=(flex.AuxSlot("alpha", "float", 0), flex.AuxSlot("tab", "float", 2)))
    text = flex.generate(spec)
    assert "struct User {" in text and "kMask = true" in text and "kScore = true" in text
    for kind in flex.SNIPPETS:
        assert f'#line 1 "{kind}"' in text
    assert "const float alpha = static_cast<float>(cf_p.aux_x[0]);" in text
    assert "const AuxArray<float, 2> tab(&cf_p, 1, cf_p.aux1);" in text
    assert flex.source_of(spec, "mma_forward.cu").endswith('#include "mma_forward.cu"\n')
    # every #line that returns to the generated file names the line that follows it
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#line") and flex._FILE in line:
            assert int(line.split()[1]) == i + 2
    assert flex.generate(flex.FlexSpec(mask_mod="true")).count("kScore = false") == 1


@needs_nvrtc
@pytest.mark.parametrize("arch", ["compute_80", "compute_90a"])
def test_snippets_compile(arch):
    spec = flex.FlexSpec(mask_mod="doc(b, q_idx) == doc(b, kv_idx) && q_idx < Nq", score_mod="score + s * tab(h, 3)",
                         score_mod_grad="{ if (new_score > 0.f) return 1.f; return 1.f; }",
                         aux=(flex.AuxSlot("doc", "int", 2), flex.AuxSlot("tab", "__nv_bfloat16", 2),
                              flex.AuxSlot("s", "float", 0)))  # fmt: skip
    flex.check(spec, arch)


@needs_nvrtc
def test_compile_error_shows_the_snippet_line():
    spec = flex.FlexSpec(mask_mod="q_idx >= kv_idx", score_mod="score\n  + undefined_name(q_idx)\n  * 2.f",
                         score_mod_grad="1")  # fmt: skip
    with pytest.raises(SnippetError) as e:
        flex.check(spec)
    msg = str(e.value)
    assert msg.startswith("score_mod: does not compile: line 2")
    assert "undefined_name" in msg and ">> 2 |   + undefined_name(q_idx)" in msg
    assert "NVRTC's log" in msg


@needs_nvrtc
@pytest.mark.parametrize("kind, text, words", [
    ("mask_mod", "tab(q_idx)", "too few arguments|static assertion|one index per dimension"),
    ("mask_mod", "q_idx >= kv_idx && aux0 != 0", "undefined"),
    ("score_mod_grad", "new_score * b + P", "undefined"),
])  # fmt: skip
def test_unknown_names_are_compile_errors(kind, text, words):
    spec = flex.FlexSpec(**{kind: text, **({"score_mod": "score"} if kind == "score_mod_grad" else {})},
                         aux=(flex.AuxSlot("tab", "float", 2),))
    with pytest.raises(SnippetError, match=words):
        flex.check(spec)


@needs_nvrtc
def test_launches_compile_from_the_generated_source(planned):
    """The user-policy launches of every family are retargeted onto the snippets' source; the others keep theirs,
    and the aux strides, extents and scalars are in the params."""
    from test_launch_abi import _empty

    from cupyflash import _dtypes
    from cupyflash.kernels import build, dispatch
    from cupyflash.kernels.params import PARAMS

    seen = planned  # launches recorded, on H100 limits (test_launch_abi's fixture)

    for name, dt in (("portable", np.dtype(np.float32)), ("mma", _dtypes.FLOAT16), ("wgmma", _dtypes.BFLOAT16)):
        seen.clear()
        q, k, v = _empty((2, 4, 33, 64), dt), _empty((2, 2, 40, 64), dt), _empty((2, 2, 40, 64), dt)
        tab = _empty((4, 7), np.float32)
        aux = {"tab": tab, "alpha": 0.5}
        p = check_attention(q, k, v, causal=True, mask_mod="q_idx >= kv_idx", score_mod="score + alpha * tab(h, 1)",
                            score_mod_grad="1", aux=aux)  # fmt: skip
        fam = dispatch.families()[name]
        o, lse = _empty(q.shape, dt), _empty(q.shape[:-1], np.float32)
        arrays = flex.aux_arrays(aux)
        fam.forward(q, k, v, o, lse, p, variant_arrays=arrays)
        fam.backward(o, q, k, v, o, lse, _empty(q.shape, dt), _empty(k.shape, dt), _empty(v.shape, dt), p,
                     variant_arrays=arrays)  # fmt: skip
        users = [(lp, b) for lp, b in seen if flex.USER in lp.name]
        assert len(users) == 2 and all("#flex-" not in lp.source for lp, _ in seen if flex.USER not in lp.name)
        for lp, params in users:
            assert lp.source.endswith(f"#flex-{p.variant.flex.key}")
            assert build.read_source(lp.source).endswith(f'#include "{build.base_source(lp.source)}"\n')
            r = np.frombuffer(params, PARAMS)[0]
            assert r["aux0"] == tab.ctypes.data and r["aux1"] == 0
            assert tuple(r["aux_n"][0][:2]) == (4, 7) and tuple(r["aux_s"][0][:2]) == (7, 1)
            assert r["aux_x"][1] == 0.5


# ---------------------------------------------------------------------------- the reference with twins


def _doc_ids(rng, n, docs):
    cuts = np.sort(rng.choice(np.arange(1, n), docs - 1, replace=False))
    return np.searchsorted(cuts, np.arange(n), side="right")


@pytest.mark.parametrize("tiled", [False, True])
def test_mask_mod_twin_equals_the_mask_array(rng, tiled):
    q, k, v = _qkv(rng, nq=45, nk=45)
    do = rng.standard_normal(q.shape)
    doc = np.stack([_doc_ids(rng, 45, 4), _doc_ids(rng, 45, 3)])  # per batch
    mm = lambda b, h, i, j: (doc[b, i] == doc[b, j]) & ((h % 2 == 0) | (j <= i))  # noqa: E731
    mask = np.broadcast_to(mm(np.arange(2)[:, None, None, None], np.arange(4)[None, :, None, None],
                              np.arange(45)[:, None], np.arange(45)[None, :]), (2, 4, 45, 45))  # fmt: skip
    fwd = reference.tiled_attention_forward if tiled else reference.attention_forward
    bwd = reference.tiled_attention_backward if tiled else reference.attention_backward
    kw = {"block_q": 16, "block_k": 32} if tiled else {}
    o1, l1 = fwd(q, k, v, True, mask_mod=mm, **kw)
    o2, l2 = reference.attention_forward(q, k, v, True, mask=mask)
    np.testing.assert_allclose(o1, o2, atol=1e-13)
    np.testing.assert_allclose(l1, l2, atol=1e-13)
    g1 = bwd(do, q, k, v, o1, l1, True, mask_mod=mm, **kw)
    g2 = reference.attention_backward(do, q, k, v, o2, l2, True, mask=mask)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-12)


def test_score_mod_twins_equal_softcap_and_alibi(rng):
    q, k, v = _qkv(rng)
    q = q * 3
    do = rng.standard_normal(q.shape)
    slopes = rng.uniform(0.05, 0.5, 4)
    nq, nk, c = 37, 45, 4.0
    sm = lambda s, b, h, i, j: c * np.tanh(s / c) - slopes[h] * np.abs(i + nk - nq - j)  # noqa: E731
    sg = lambda ns, b, h, i, j: 1.0 - ((ns + slopes[h] * np.abs(i + nk - nq - j)) / c) ** 2  # noqa: E731
    o1, l1 = reference.attention_forward(q, k, v, True, score_mod=sm, score_mod_grad=sg)
    o2, l2 = reference.attention_forward(q, k, v, True, softcap=c, alibi_slopes=slopes.astype(np.float32))
    np.testing.assert_allclose(o1, o2, atol=1e-6)  # the slopes went through float32 on one side
    g1 = reference.tiled_attention_backward(do, q, k, v, o1, l1, True, block_q=16, block_k=16, score_mod=sm,
                                            score_mod_grad=sg)  # fmt: skip
    g2 = reference.attention_backward(do, q, k, v, o2, l2, True, softcap=c, alibi_slopes=slopes.astype(np.float32))
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_score_mod_backward_matches_finite_differences(rng):
    q, k, v = _qkv(rng, b=1, hq=2, hk=1, nq=9, nk=11, d=4)
    do = rng.standard_normal(q.shape)
    tab = rng.standard_normal((2, 8))
    sm = lambda s, b, h, i, j: 1.5 * s + tab[h, np.minimum(np.abs(i - j), 7)]  # noqa: E731
    sg = lambda ns, b, h, i, j: 1.5 + 0 * ns  # noqa: E731
    mm = lambda b, h, i, j: (i + j) % 5 != 0  # noqa: E731

    def loss(q_):
        return float((reference.attention(q_, k, v, mask_mod=mm, score_mod=sm) * do).sum())

    o, lse = reference.attention_forward(q, k, v, mask_mod=mm, score_mod=sm)
    dq = reference.attention_backward(do, q, k, v, o, lse, mask_mod=mm, score_mod=sm, score_mod_grad=sg)[0]
    eps = 1e-6
    for idx in [(0, 0, 0, 0), (0, 1, 3, 2), (0, 1, 8, 3)]:
        qp, qm = q.copy(), q.copy()
        qp[idx] += eps
        qm[idx] -= eps
        assert abs((loss(qp) - loss(qm)) / (2 * eps) - dq[idx]) < 1e-6


def test_numpy_backend_takes_twins(rng):
    q, k, v = (x.astype(np.float32) for x in _qkv(rng))
    mm = lambda b, h, i, j: j <= i + 3  # noqa: E731
    o, lse = cf.attention_forward(q, k, v, mask_mod=mm, score_mod=lambda s, b, h, i, j: s * 0.5)
    mask = np.arange(45)[None, :] <= np.arange(37)[:, None] + 3
    o2, l2 = reference.attention_forward(q, k, v, scale=0.125, mask=mask)
    assert o.dtype == np.float32
    np.testing.assert_allclose(o, o2, atol=2e-6)
    np.testing.assert_allclose(lse, l2, atol=2e-6)


# ---------------------------------------------------------------------------- block masks


def test_block_mask_reference_counts_tiles(rng):
    nq, nk, bs = 100, 77, 16
    doc = _doc_ids(rng, 100, 5)
    mm = lambda b, h, i, j: (doc[np.minimum(i, 99)] == doc[np.minimum(j, 99)]) & (j <= i + b + h)  # noqa: E731
    bm = cf.create_block_mask(mm, 2, 3, nq, nk, block_size=bs)
    assert bm.states.shape == (2, 3, 7, 5) and bm.states.dtype == np.uint8
    for b in range(2):
        for h in range(3):
            full = mm(b, h, np.arange(nq)[:, None], np.arange(nk)[None, :])
            for qb in range(7):
                for kb in range(5):
                    tile = full[qb * bs : (qb + 1) * bs, kb * bs : (kb + 1) * bs]
                    want = 0 if not tile.any() else 2 if tile.all() else 1
                    assert bm.states[b, h, qb, kb] == want
            rows = bm.states[b, h] != 0
            for qb in range(7):
                nz = np.flatnonzero(rows[qb])
                want = (nz[0], nz[-1] + 1) if len(nz) else (0, 0)
                assert tuple(bm.kv_range[b, h, qb]) == want
            for kb in range(5):
                nz = np.flatnonzero(rows[:, kb])
                want = (nz[0], nz[-1] + 1) if len(nz) else (0, 0)
                assert tuple(bm.q_range[b, h, kb]) == want
            for table, lines in ((bm.full_kv, bm.states[b, h] == 2), (bm.full_q, (bm.states[b, h] == 2).T)):
                for line, want in zip(table[b, h], lines):  # the longest run of FULL blocks, the first of a tie
                    best = (0, 0)
                    for first in range(len(want)):
                        for last in range(first + 1, len(want) + 1):
                            if want[first:last].all() and last - first > best[1] - best[0]:
                                best = (first, last)
                    assert tuple(line) == best
    assert 0 < bm.sparsity() < 1 and bm.visited() >= 1 - bm.sparsity()
    assert (bm.full_kv[..., 1] > bm.full_kv[..., 0]).any() and bm.full_kv.dtype == bm.full_q.dtype == np.int32
    assert bm.params() == {"bm_size": 16, "bm_nqb": 7, "bm_nkb": 5, "bm_bb": 2, "bm_hb": 3, "bm_magic": 2**31,
                           "bm_magic_shift": 35}  # fmt: skip

    # the mean keys a query row's tile loop visits (the forward's kernel choice, plans.wgmma), counted here per block
    # row: from its first block to its last (clipped to Nk), and that cut at the causal rule's last key of the row
    full, causal = [], []
    for b in range(2):
        for h in range(3):
            for qb in range(7):
                first, last = bm.kv_range[b, h, qb] * bs
                last = min(last, nk)
                causal_end = min(min((qb + 1) * bs, nq) + nk - nq, nk)
                full.append(max(last - first, 0))
                causal.append(max(min(last, causal_end) - first, 0))
    assert bm.visited_keys == round(np.mean(full)) and bm.visited_keys_causal == round(np.mean(causal))
    assert 0 < bm.visited_keys_causal < bm.visited_keys


@pytest.mark.parametrize("bs", [1, 2, 3, 7, 16, 24, 48, 64, 100, 128, 1000, 4096, 65537])
def test_block_divisor_is_exact(bs, rng):
    """FlexMask's block index (x * m) >> s is x // bs for every int32 index, with m fitting the params' uint32."""
    m, s = block_divisor(bs)
    assert 0 < m < 2**32
    x = np.concatenate([np.arange(3 * bs), rng.integers(0, 2**31, 20000), 2**31 - 1 - np.arange(3 * bs)])
    x = x[x >= 0].astype(object)  # Python ints: the kernel's 64-bit product exactly
    np.testing.assert_array_equal((x * m) >> s, x // bs)


def test_block_mask_visited_keys_reach_the_variant():
    """check_attention carries the keys a row visits under the call's own masks into Variant.block_keys (the grid
    heuristic's input): the block ranges, cut by causal (or a window whose right side is 0), at most a two-sided
    window's width; a call without a block mask has 0."""
    q, k, v = (np.ones((1, 2, 256, 16), np.float32) for _ in range(3))
    mm = lambda b, h, i, j: (j < 32) | (i >= 128)  # noqa: E731  (block rows 0-1: block 0; rows 2-3: all four)
    bm = cf.create_block_mask(mm, None, None, 256, 256)
    assert (bm.visited_keys, bm.visited_keys_causal) == ((64 + 64 + 256 + 256) // 4, (64 + 64 + 192 + 256) // 4)

    def keys(**kw):
        return check_attention(q, k, v, mask_mod=mm, block_mask=bm, **kw).variant.block_keys

    assert keys() == 160 and keys(causal=True) == 144
    assert keys(window_size=(300, 0)) == 144  # right side 0: causal's cut (wider than any row's range)
    assert keys(window_size=(100, 0)) == 101 and keys(window_size=(20, 30)) == 51  # at most left + right + 1
    assert keys(window_size=(-1, 30)) == 160
    assert check_attention(q, k, v, mask_mod=mm).variant.block_keys == 0


@pytest.mark.parametrize("bs", [16, 32, 48, 64])
def test_full_tiles_rule(bs, rng):
    """FlexMask's full-tile decision (BlockMask.full_tiles, the kernels' rule in NumPy) for the kernels' tile and
    strip shapes: a tile it calls full has every pair inside the problem visible (so skipping mask_mod there is exact),
    and when the tile is made of whole blocks, every tile whose pairs are all visible is called full."""
    nq, nk = 300, 333
    doc = _doc_ids(rng, nk, 4)
    lo = rng.integers(0, 120, 3)
    mm = lambda b, h, i, j: ((doc[np.minimum(i + nk - nq, nk - 1)] == doc[j]) & (j >= lo[h])) | (j < 8)  # noqa: E731
    bm = cf.create_block_mask(mm, None, 3, nq, nk, block_size=bs)
    assert {0, 1, 2} <= set(np.unique(bm.states))
    vis = np.broadcast_to(mm(0, np.arange(3)[:, None, None], np.arange(nq)[:, None], np.arange(nk)), (3, nq, nk))
    for rows, cols in [(16, 64), (16, 128), (128, 16), (64, 128), (64, 32), (48, 80)]:
        full = bm.full_tiles(rows, cols)
        assert full.shape == (1, 3, -(-nq // rows), -(-nk // cols))
        aligned = rows % bs == 0 and cols % bs == 0
        for h in range(3):
            for i in range(full.shape[2]):
                for j in range(full.shape[3]):
                    every = vis[h, i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].all()
                    assert every or not full[0, h, i, j], (rows, cols, h, i, j)
                    if aligned:
                        assert full[0, h, i, j] == every, (rows, cols, h, i, j)
    ptrs = bm.pointers()
    assert ptrs["bm_full_kv"] is bm.full_kv and ptrs["bm_full_q"] is bm.full_q and ptrs["bm_kv"] is bm.kv_range


def unpack_bits(bm, rows_are_keys=False):
    """(batch, heads, Nq, Nk) bool of a block mask's bit tables, read as FlexMask<..., true> reads them: a tile's
    index (-1 all, -2 none, else a slot), then bit j of its row's word."""
    index, bits = bm.bit_index, bm.bits_k if rows_are_keys else bm.bits_q
    bb, hb, nqt, nkt = index.shape
    out = np.zeros((bb, hb, nqt * 64, nkt * 64), bool)
    for b, h, qt, kt in np.ndindex(index.shape):
        slot = index[b, h, qt, kt]
        if slot < 0:
            tile = np.full((64, 64), slot == -1)
        else:
            words = bits[64 * slot : 64 * slot + 64]
            tile = ((words[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)).astype(bool)
            tile = tile.T if rows_are_keys else tile
        out[b, h, qt * 64 : qt * 64 + 64, kt * 64 : kt * 64 + 64] = tile
    return out[..., : bm.nq, : bm.nk]


@pytest.mark.parametrize("bs", [16, 48, 64, 128])
def test_block_mask_bits_hold_every_pair(bs, rng):
    """The bits (BlockMask.bits_q / bits_k, FlexMask<..., true>'s reading of partial tiles) give mask_mod's value of
    every pair of the problem in both orientations, at any block size (the bit tiles are 64 x 64 whatever it is);
    tiles whose pairs are all visible or all hidden take no slot; pairs outside the problem read 1."""
    nq, nk = 200, 263
    doc = np.searchsorted(np.array([70, 200]) + rng.integers(-5, 6, 2), np.arange(nk), side="right")
    lo = rng.integers(0, 60, 3)  # (the 64 x 64 tile at (2, 2) lies in the second document: all visible)
    mm = lambda b, h, i, j: ((doc[np.minimum(i, nk - 1)] == doc[j]) & (j >= lo[h] + b)) | (j < 3)  # noqa: E731
    bm = cf.create_block_mask(mm, 2, 3, nq, nk, block_size=bs)
    want = np.broadcast_to(mm(np.arange(2)[:, None, None, None], np.arange(3)[:, None, None], np.arange(nq)[:, None],
                              np.arange(nk)), (2, 3, nq, nk))  # fmt: skip
    assert bm.bit_index.shape == (2, 3, 4, 5) and bm.bit_index.dtype == np.int32 and bm.bits_q.dtype == np.uint64
    np.testing.assert_array_equal(unpack_bits(bm), want)
    np.testing.assert_array_equal(unpack_bits(bm, rows_are_keys=True), want)
    slots = bm.bit_index[bm.bit_index >= 0]
    assert {-2, -1} <= set(np.unique(bm.bit_index)) and sorted(slots) == list(range(len(slots)))
    assert len(bm.bits_q) == len(bm.bits_k) == 64 * len(slots)
    slot = max(bm.bit_index[0, 0, 3])  # a mixed tile of the last query rows: its rows past Nq read all ones
    assert slot >= 0 and all(int(w) == (1 << 64) - 1 for w in bm.bits_q[64 * slot + nq % 64 : 64 * slot + 64])
    ptrs = bm.pointers()
    assert ptrs["bm_bit_index"] is bm.bit_index and ptrs["bm_bits_q"] is bm.bits_q and ptrs["bm_bits_k"] is bm.bits_k


def test_block_mask_bits_budget(monkeypatch, rng):
    """Past BITS_BUDGET a block mask keeps no bits: its pointers leave the bit fields out and the C++ mask policy
    runs mask_mod per pair of partial tiles (FlexMask without its bits flag)."""
    from cupyflash import flex_block_mask

    mm = lambda b, h, i, j: (i + j) % 3 == 0  # noqa: E731  (every tile mixed)
    q, k, v = (np.ones((1, 2, 128, 16), np.float32) for _ in range(3))
    bm = cf.create_block_mask(mm, None, None, 128, 128)
    assert bm.bits_q is not None and check_attention(q, k, v, mask_mod=mm, block_mask=bm).variant.block_bits
    monkeypatch.setattr(flex_block_mask, "BITS_BUDGET", 4 * 1024 - 1)  # four mixed tiles take 4 KB
    bm = cf.create_block_mask(mm, None, None, 128, 128)
    assert bm.bits_q is bm.bits_k is bm.bit_index is None and "bm_bits_q" not in bm.pointers()
    assert not check_attention(q, k, v, mask_mod=mm, block_mask=bm).variant.block_bits


def test_block_mask_moves_mask_mod_into_the_mask_policy():
    """With a block mask the C++ mask policy evaluates mask_mod (FlexMask) and the score keeps score_mod alone (or is
    the built-in rule); without one, FlexScore does both as before."""
    from cupyflash.flex import USER
    from cupyflash.variants import Variant

    mask_only = cf.flex.FlexSpec(mask_mod="q_idx >= kv_idx")
    both = cf.flex.FlexSpec(mask_mod="q_idx >= kv_idx", score_mod="score * 2.f", score_mod_grad="2.f")
    bm = (("bm_size", 64),)
    pol = Variant(causal=True, flex=mask_only, block_mask=bm).cpp_policy
    assert pol == f"cupyflash::Policy<cupyflash::FlexMask<cupyflash::Causal, {USER}>, cupyflash::PlainScore>"
    pol = Variant(softcap=5.0, flex=both, block_mask=bm).cpp_policy
    assert f"FlexMask<cupyflash::NoMask, {USER}>" in pol
    assert f"FlexScore<cupyflash::ModScore, cupyflash::ScoreFns<{USER}>>" in pol
    pol = Variant(causal=True, flex=both).cpp_policy
    assert pol == f"cupyflash::Policy<cupyflash::Causal, cupyflash::FlexScore<cupyflash::PlainScore, {USER}>>"
    pol = Variant(causal=True, flex=mask_only, block_mask=bm, block_bits=True).cpp_policy  # partial tiles read bits
    assert pol == f"cupyflash::Policy<cupyflash::FlexMask<cupyflash::Causal, {USER}, true>, cupyflash::PlainScore>"
    twins = cf.flex.FlexTwins(mask_mod=lambda b, h, i, j: i >= j)  # the reference's: no C++ policy of its own
    assert "BlockMasked<" in Variant(flex=twins, block_mask=bm).mask_name


def test_block_mask_broadcast_and_checks():
    bm = cf.create_block_mask(lambda b, h, i, j: j <= i, None, None, 64, 64, block_size=32)
    assert bm.states.shape == (1, 1, 2, 2) and bm.states[0, 0].tolist() == [[1, 0], [2, 1]]
    with pytest.raises(ValueError, match="block_size"):
        cf.create_block_mask(lambda b, h, i, j: j <= i, None, None, 64, 64, block_size=0)
    with pytest.raises(ValueError, match="B must"):
        cf.create_block_mask(lambda b, h, i, j: j <= i, 0, None, 64, 64)
    with pytest.raises(SnippetError):
        cf.create_block_mask("q_idx >= kv_idx; x", None, None, 64, 64)


def test_block_mask_does_not_change_numpy_results(rng):
    q, k, v = (x.astype(np.float32) for x in _qkv(rng, nq=64, nk=64))
    mm = lambda b, h, i, j: (j < 20) | (j <= i)  # noqa: E731 - prefix-LM
    bm = cf.create_block_mask(mm, None, None, 64, 64, block_size=16)
    o1, l1 = cf.attention_forward(q, k, v, mask_mod=mm, block_mask=bm)
    o2, l2 = cf.attention_forward(q, k, v, mask_mod=mm)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)


@needs_nvrtc
def test_block_mask_kernel_compiles():
    """create_block_mask's generated kernels (the User struct + one block per tile; the mixed tiles' bits) and its
    full-runs kernel build for sm_80 without spills."""
    from cupyflash.flex_block_mask import _BITS_KERNEL, _STATES_KERNEL, RUNS_SOURCE
    from cupyflash.kernels import build

    spec = flex.FlexSpec(mask_mod="doc(b, q_idx) == doc(b, kv_idx)", aux=(flex.AuxSlot("doc", "int", 2),))
    for name, kernel in (("cf_block_states", _STATES_KERNEL), ("cf_block_bits", _BITS_KERNEL)):
        source = build.generated_source(name, spec.key, flex.generate(spec) + kernel)
        usage = build.nvrtc_compile(source, name, "sm_80")
        assert usage.registers > 0 and not usage.spills
    usage = build.nvrtc_compile(RUNS_SOURCE, "cf_full_runs", "sm_80")  # the full runs: one source for every mask
    assert usage.registers > 0 and not usage.spills
