"""GPU accuracy of block masks whose FULL tiles skip mask_mod (issue 17 speed: flex_policy.cuh's FlexMask).

With ``block_mask=`` the kernels evaluate mask_mod in the mask policy, only in tiles that the built-in mask or the
block mask's states call partial (there they read the block mask's bits, or run mask_mod where it has none); tiles
made of FULL blocks run as unmasked tiles. These cases mix EMPTY, PARTIAL
and FULL blocks (asserted) with a mask_mod that depends on (b, h): per batch documents, a per-(batch, query head)
first visible key ``lo(b, h)`` that differs between the query heads of one GQA group (so a key-major backward that
asks partial() or visible() with the wrong head of its group gets other dK/dV), and the first 8 keys visible to
every query (an interior run of EMPTY blocks in the later documents' rows). Block sizes aligned with the kernel
tiles (64), finer (32: a tile covers several blocks) and misaligned (48: a tile covers part of a block). Each family
is reached explicitly (``run_family``: its entry points, NaN-poisoned outputs), forward and backward, GQA,
Nq != Nk, against the float64 reference with the snippets' Python twins (tolerances as tests/test_flex_gpu.py:
float32 1e-5 / 1e-4 relative, FlashAttention's criterion against a same-dtype naive implementation otherwise).
The D = 128 cases reach the mma family's 2-D backward and wgmma's D = 128 configuration.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, requires_gpu, HOPPER
from test_flex_gpu import _dev, _inputs, check_against_reference, naive, run_family
from test_variants_gpu import assert_fa_criterion, assert_float32_close

import cupyflash
from cupyflash import flex, reference
from cupyflash.flex_block_mask import EMPTY, FULL, PARTIAL
from cupyflash.validation import check_attention

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

_hopper = pytest.mark.skipif(not HOPPER, reason="wgmma needs sm_90a")
#: (family, dtype, head dim, built-in mask and snippets, block size): a representative sweep, not the cross product
#: (each row compiles its own forward and backward kernels): every family, NoMask/Causal/Window, with and without
#: score_mod, block sizes aligned (64), finer (32) and misaligned (48) against the kernels' tiles.
CASES = [
    ("portable", "float32", 64, "causal", 64),
    ("portable", "float32", 64, "window-score", 48),
    ("mma", "bfloat16", 64, "causal", 64),
    ("mma", "bfloat16", 128, "window-score", 32),
    pytest.param("wgmma", "float16", 64, "causal", 64, marks=_hopper),
    pytest.param("wgmma", "float16", 64, "window-score", 48, marks=_hopper),
    pytest.param("wgmma", "bfloat16", 128, "none", 32, marks=_hopper),
]
SHAPE = (2, 4, 2, 320, 392)  # B, Hq, Hk (GQA: 2 query heads per kv head), Nq, Nk
WINDOW = (150, 40)

MASK_CPP = "(doc(b, q_idx) == doc(b, kv_idx) && kv_idx >= lo(b, h)) || kv_idx < 8"
SCORE_CPP = "score * scl(h)"


def make_case(base, rng):
    """(C++ keywords, twin keywords, reference keywords of the built-in mask) for one case."""
    b, hq, _, nq, nk = SHAPE
    # Document ids per key position (queries read them bottom-right aligned, below): 4 documents cut near 120, 180
    # and 230 per batch, so that every (b, h) has FULL blocks (in the last document, past every lo), EMPTY ones
    # (its rows against the first documents' keys) and PARTIAL ones, at every block size here.
    cuts = np.array([120, 180, 230]) + rng.integers(-8, 9, (b, 3))
    doc = np.stack([np.searchsorted(c, np.arange(nk), side="right") for c in cuts]).astype(np.int32)
    lo = rng.integers(0, 40, (b, hq)).astype(np.int32)
    lo[:, 1::2] += rng.integers(130, 200, (b, hq // 2))  # a group's query heads differ (the first document's rows)
    off = nk - nq  # a query's document: that of its bottom-right aligned key position
    qdoc = doc[:, off:]
    cpp = {"mask_mod": MASK_CPP.replace("doc(b, q_idx)", "doc(b, q_idx + Nk - Nq)"), "aux": {"doc": doc, "lo": lo}}
    twin = {"mask_mod": lambda b_, h, i, j: ((qdoc[b_, i] == doc[b_, j]) & (j >= lo[b_, h])) | (j < 8)}
    if base == "window-score":
        scl = rng.uniform(0.5, 1.5, hq).astype(np.float32)
        cpp.update(score_mod=SCORE_CPP, score_mod_grad="scl(h)")
        cpp["aux"]["scl"] = scl
        twin.update(score_mod=lambda s, b_, h, i, j: s * scl[h],
                    score_mod_grad=lambda ns, b_, h, i, j: np.zeros_like(ns) + scl[h])  # fmt: skip
    builtin = {"causal": base == "causal", "window_size": WINDOW if base == "window-score" else None}
    return cpp, twin, builtin


def _with_window(twin, window):
    """The twins with the built-in window folded into mask_mod (the naive implementation knows causal only)."""
    if window is None:
        return twin
    nq, nk = SHAPE[3], SHAPE[4]
    left, right = window
    mm = twin["mask_mod"]
    rule = lambda b_, h, i, j: mm(b_, h, i, j) & (j >= i + nk - nq - left) & (j <= i + nk - nq + right)  # noqa: E731
    return {**twin, "mask_mod": rule}


@pytest.mark.parametrize("bits", [True, False], ids=["bits", "mask_mod"])
@pytest.mark.parametrize("kernel, dtype_name, d, base, block", CASES)
def test_full_tiles_skip_mask_mod(kernel, dtype_name, d, base, block, bits, rng, monkeypatch):
    """Partial tiles read the block mask's bits (FlexMask<..., true>, the default) or, past BITS_BUDGET (forced to 0
    here), run mask_mod per pair; the device's bits equal the twin's (NumPy) bit for bit."""
    from cupyflash import flex_block_mask

    dtype = DTYPES[dtype_name]
    b, hq, _, nq, nk = SHAPE
    cpp, twin, builtin = make_case(base, rng)
    q, k, v, do = _inputs(rng, SHAPE, dtype, d)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    cppd = _dev(cpp)
    if not bits:
        monkeypatch.setattr(flex_block_mask, "BITS_BUDGET", 0)
    bm = cupyflash.create_block_mask(cppd["mask_mod"], b, hq, nq, nk, aux=cppd["aux"], block_size=block)
    twin_bm = cupyflash.create_block_mask(twin["mask_mod"], b, hq, nq, nk, block_size=block)
    assert (bm.bits_q is not None) == bits
    states = cupy.asnumpy(bm.states)
    np.testing.assert_array_equal(states, twin_bm.states)
    for name in ("full_kv", "full_q") + (("bit_index", "bits_q", "bits_k") if bits else ()):
        np.testing.assert_array_equal(cupy.asnumpy(getattr(bm, name)), getattr(twin_bm, name))
    for state in (EMPTY, PARTIAL, FULL):  # every (b, h) mixes the three
        assert (states == state).any(axis=(2, 3)).all(), f"state {state} missing in some (b, h)"
    for h in range(0, hq, 2):  # the query heads of a GQA group have different tables in every batch
        assert all(not np.array_equal(states[i, h], states[i, h + 1]) for i in range(b))

    causal, window = builtin["causal"], builtin["window_size"]
    got = run_family(kernel, qd, kd, vd, dod, causal, {**cppd, "window_size": window}, block_mask=bm)
    check_against_reference(dtype_name, q, k, v, do, causal, {**twin, "window_size": window}, got,
                            naive_twin=_with_window(twin, window))  # fmt: skip


@pytest.mark.parametrize("kernel, dtype_name", [("portable", "float32"), ("mma", "bfloat16"),
                                                pytest.param("wgmma", "float16", marks=_hopper)])  # fmt: skip
def test_full_blocks_skip_mask_mod(kernel, dtype_name, rng):
    """The skip itself: a block mask whose every block claims FULL (its states, ranges and runs overwritten) makes every
    kernel run no mask_mod at all, so the result is plain causal attention although mask_mod hides most pairs. (The
    kernels of the causal case above: no new compile.)"""
    dtype = DTYPES[dtype_name]
    b, hq, _, nq, nk = SHAPE
    cpp, _, _ = make_case("causal", rng)
    q, k, v, do = _inputs(rng, SHAPE, dtype, 64)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    cppd = _dev(cpp)
    bm = cupyflash.create_block_mask(cppd["mask_mod"], b, hq, nq, nk, aux=cppd["aux"], block_size=64)
    assert (bm.states != FULL).any()
    bm.states[...] = FULL
    bm.kv_range[..., 0], bm.kv_range[..., 1] = 0, bm.states.shape[3]
    bm.q_range[..., 0], bm.q_range[..., 1] = 0, bm.states.shape[2]
    bm.full_kv[...] = bm.kv_range
    bm.full_q[...] = bm.q_range
    o, lse, dq, dk, dv = run_family(kernel, qd, kd, vd, dod, True, cppd, block_mask=bm)
    o_ref, lse_ref = reference.attention_forward(q, k, v, True)
    g_ref = reference.attention_backward(do, q, k, v, o_ref, lse_ref, True)[:3]
    np.testing.assert_allclose(lse, lse_ref, atol=2e-3 if dtype_name != "float32" else 1e-5)
    if dtype_name == "float32":
        assert_float32_close("o", o, o_ref, 1e-5)
        for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref):
            assert_float32_close(name, x, r, 1e-4)
        return
    n_o, *n_g = naive(q, k, v, do, True, {}, dtype)
    assert_fa_criterion("o", o, o_ref, n_o, dtype_name, 2)
    for name, x, r, n in zip(("dq", "dk", "dv"), (dq, dk, dv), g_ref, n_g):
        assert_fa_criterion(name, x, r, n, dtype_name, 3)


#: (dtype, head dim, built-in mask, block size): a mask_mod with its block mask on each wgmma forward (s21: the
#: warp-specialised one takes them, plans.wgmma.lockstep_by_default sends such calls there at D = 128 and at D = 64
#: where rows visit many keys; the small problem here would go to the lockstep kernel at D = 64).
WGMMA_FORWARD_CASES = [
    ("float16", 64, "causal", 64),
    ("bfloat16", 64, "none", 48),
    ("bfloat16", 128, "causal", 32),
    ("float16", 128, "none", 64),
]


@_hopper
@pytest.mark.parametrize("ws", [True, False], ids=["ws", "lockstep"])
@pytest.mark.parametrize("dtype_name, d, base, block", WGMMA_FORWARD_CASES)
def test_wgmma_forwards_with_a_block_mask(ws, dtype_name, d, base, block, rng):
    """Each wgmma forward reached explicitly (its configuration) with FlexMask: o by FlashAttention's criterion
    against the float64 reference with the twins, lse within 2e-3 (-inf and o = 0 where the reference's is)."""
    from cupyflash.kernels import wgmma
    from cupyflash.plans import wgmma as plans

    dtype = DTYPES[dtype_name]
    b, hq, _, nq, nk = SHAPE
    cpp, twin, builtin = make_case(base, rng)
    q, k, v, do = _inputs(rng, SHAPE, dtype, d)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    cppd = _dev(cpp)
    bm = cupyflash.create_block_mask(cppd["mask_mod"], b, hq, nq, nk, aux=cppd["aux"], block_size=block)
    causal = builtin["causal"]
    p = check_attention(qd, kd, vd, causal=causal, block_mask=bm, **cppd)
    config = (plans.WS_FORWARD_CONFIGS if ws else plans.FORWARD_CONFIGS)[d]
    o = cupy.full(qd.shape, np.nan, qd.dtype)
    lse = cupy.full(qd.shape[:-1], np.nan, np.float32)
    wgmma.forward(qd, kd, vd, o, lse, p, variant_arrays={**flex.aux_arrays(cppd["aux"]), **bm.pointers()},
                  config=config)  # fmt: skip
    o, lse = cupy.asnumpy(o), cupy.asnumpy(lse)
    o_ref, lse_ref = reference.attention_forward(q, k, v, causal, **twin)
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=2e-3)
    assert np.all(lse[~fin] == -np.inf) and np.all(o[~fin] == 0)
    assert_fa_criterion("o", o, o_ref, naive(q, k, v, do, causal, twin, dtype)[0], dtype_name, 2)
