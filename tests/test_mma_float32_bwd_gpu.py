"""GPU: the mma family's float32 backward (3xTF32 on tensor cores: cuda_src/mma_bwd_tf32.cuh) against the float64
NumPy reference.

The backward alone is under test: o and lse are the reference's (float64, rounded to float32), as a float32 forward
would hand them over; then ``kernel="mma"`` runs the backward, its outputs NaN-poisoned first (the family's entry
point, or the memory pool's next blocks filled with NaN bytes for calls through the API). Bound (DESIGN.md 4):
relative error <= 1e-4 for dq, dk, dv, dsinks and dbias; results NaN-free. Covered: every padded head dim of the float32
tables (32, 64, 96, 128) and multiples of 8 below them (40, 72, 120; D = 59 is refused: rows of 16-byte multiples),
N = 1 .. 1000 (one key tile: the kernel that owns dQ; more: the three launches), Nq != Nk both ways, causal, GQA/MQA,
scale 10, window + softcap + ALiBi + sinks, a float32 bias with bias_grad (broadcast over the batch: atomics; full
shape with a mask: stored), dropout (the forward's seed), deterministic=True (bitwise identical runs), varlen packs,
two fallback tiles (99 KB parts) forced on this GPU, and query parts (past 4096 query rows a kv head: Nq up to 8192,
GQA 4 x 4096, an empty part, with deterministic, bias_grad, dropout). The cases share instantiations (about 13 main kernels,
most of the file's time is their NVRTC compiles).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, TOL_GRAD, random_qkv, requires_gpu
from test_varlen_gpu import poison_pool
from test_variants_gpu import assert_float32_close

import cupyflash
from cupyflash import reference
from cupyflash.validation import check_backward

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

F32 = DTYPES["float32"]
TOL = TOL_GRAD["float32"]
GRADS = ("dq", "dk", "dv", "dsinks", "dbias")


def _mma():
    from cupyflash.kernels import mma

    return mma


def _ref_forward(q, k, v, causal, scale, **kw):
    """The reference's o and lse, float64 (for the reference backward) and float32 (handed to the kernels)."""
    ro, rlse = reference.attention_forward(q, k, v, causal, scale, **kw)
    return ro, rlse, ro.astype(np.float32), rlse.astype(np.float32)


def _check_grads(got, ref, names=GRADS, tol=TOL):
    assert len(got) == len(ref)
    for name, g, r in zip(names, got, ref):
        g = g.get() if hasattr(g, "get") else g
        assert np.isfinite(np.asarray(g, np.float64)).all(), f"{name} has NaN/inf"
        assert_float32_close(f"mma float32 {name}", g, r, tol)


def backward_poisoned(q, k, v, do, causal=False, scale=None, config=None, **options):
    """dq, dk, dv of the mma family's float32 backward through its entry point (outputs NaN first), and the
    reference's."""
    ro, rlse, o, lse = _ref_forward(q, k, v, causal, scale)
    qd, kd, vd, dod, od, lsed = (cupy.asarray(x) for x in (q, k, v, do, o, lse))
    p = check_backward(dod, qd, kd, vd, od, lsed, causal=causal, scale=scale)
    dq, dk, dv = (cupy.full(x.shape, np.nan, F32) for x in (qd, kd, vd))
    if config is not None:
        options["config"] = config
    _mma().backward(dod, qd, kd, vd, od, lsed, dq, dk, dv, p, **options)
    ref = reference.attention_backward(do, q, k, v, ro, rlse, causal, scale)
    return [dq, dk, dv], ref


def backward_api(q, k, v, do, causal=False, scale=None, **kw):
    """The gradients of cupyflash.attention_backward(kernel="mma") on NaN-filled pool blocks, and the reference's."""
    ro, rlse, o, lse = _ref_forward(q, k, v, causal, scale, **{n: x for n, x in kw.items() if n != "bias_grad"})
    dev = lambda x: cupy.asarray(x) if isinstance(x, np.ndarray) else x  # noqa: E731
    qd, kd, vd, dod, od, lsed = (cupy.asarray(x) for x in (q, k, v, do, o, lse))
    kwd = {n: dev(x) for n, x in kw.items()}
    shapes = [(q.shape, F32), (k.shape, F32), (v.shape, F32)]
    if kw.get("bias") is not None:
        shapes.append((kw["bias"].shape, kw["bias"].dtype))
    poison_pool(*shapes)
    got = cupyflash.attention_backward(dod, qd, kd, vd, od, lsed, causal, scale, kernel="mma", **kwd)
    ref = reference.attention_backward(do, q, k, v, ro, rlse, causal, scale, **kw)
    return list(got), list(ref)


def _inputs(rng, b, hq, hk, nq, nk, d, logits=1.0):
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, F32, logits)
    return q, k, v, rng.standard_normal(q.shape).astype(F32)


# ---------------------------------------------------------------------------- shapes

# (D, N, causal): N <= 128 has one key tile (the kernel that owns dQ), longer ones the three launches.
GRID = [(32, 1000, False), (40, 333, False), (64, 1, False), (64, 100, False), (64, 1000, True), (72, 333, True),
        (96, 1000, True), (120, 100, False), (128, 17, False), (128, 1000, True)]


@pytest.mark.parametrize("d, n, causal", GRID)
def test_head_dims_and_lengths(d, n, causal, rng):
    q, k, v, do = _inputs(rng, 1, 2, 2, n, n, d)
    got, ref = backward_poisoned(q, k, v, do, causal)
    _check_grads(got, ref)


def test_head_dim_not_a_multiple_of_8_is_refused(rng):
    """D = 59: float32 rows of 236 bytes are not 16-byte multiples (cp.async chunks): kernel="mma" says so, and the
    portable family runs the call."""
    q, k, v, do = _inputs(rng, 1, 2, 2, 70, 70, 59)
    ro, rlse, o, lse = _ref_forward(q, k, v, False, None)
    args = [cupy.asarray(x) for x in (do, q, k, v, o, lse)]
    with pytest.raises(TypeError, match="multiple of 8"):
        cupyflash.attention_backward(*args, False, kernel="mma")
    got = cupyflash.attention_backward(*args, False)
    _check_grads(got, reference.attention_backward(do, q, k, v, ro, rlse, False))


@pytest.mark.parametrize("nq, nk, causal", [(100, 300, True), (300, 100, False), (1, 257, False), (257, 1, False),
                                            (129, 1000, True)])  # fmt: skip
def test_unequal_lengths(nq, nk, causal, rng):
    q, k, v, do = _inputs(rng, 2, 2, 2, nq, nk, 64)
    got, ref = backward_poisoned(q, k, v, do, causal)
    _check_grads(got, ref)


@pytest.mark.parametrize("hq, hk, d", [(8, 2, 128), (4, 1, 64)])
def test_gqa_mqa(hq, hk, d, rng):
    q, k, v, do = _inputs(rng, 2, hq, hk, 200, 150, d)
    got, ref = backward_poisoned(q, k, v, do, True)
    _check_grads(got, ref)


def test_large_logits(rng):
    q, k, v, do = _inputs(rng, 1, 2, 2, 300, 300, 64)
    got, ref = backward_poisoned(q, k, v, do, False, 10.0)
    _check_grads(got, ref)


def _fallbacks():
    from cupyflash.plans import mma as plans

    # 99 KB parts' D = 64, 128; the small-grid tiles (plans.mma.small_grid) and the D = 64 table's, forced
    return [plans.BACKWARD_FALLBACKS_F32[64][0], plans.BACKWARD_FALLBACKS_F32[128][-1],
            *plans.SMALL_GRID_BACKWARD_F32.values(), plans.BACKWARD_CONFIGS_F32[64], plans.BACKWARD_CONFIGS_F32[128]]


@pytest.mark.parametrize("cfg", _fallbacks(), ids=lambda c: f"d{c.d}-br{c.br}-kw{c.key_warps}")
def test_fallback_tiles(cfg, rng):
    """Tiles that parts with less shared memory (sm_86/89) get, and the small-grid and table tiles, forced on this
    GPU (Br = 16: dS^T unswizzled); D below the padded one (zero-filled columns) and GQA."""
    q, k, v, do = _inputs(rng, 1, 4, 2, 300, 260, cfg.d - 8)
    got, ref = backward_poisoned(q, k, v, do, True, config=cfg)
    _check_grads(got, ref)


# ---------------------------------------------------------------------------- variants (through the API)

# (id, (B, Hq, Hk, Nq, Nk), D, keywords). ALiBi "head": (Hq,) slopes, "batch": (B, Hq).
VARIANTS = [
    ("window-softcap-alibi-sinks-gqa", (2, 4, 2, 180, 220), 64,
     dict(window_size=(32, 8), softcap=30.0, alibi="batch", sinks=True)),
    ("window-softcap-alibi-head-nq>nk", (1, 8, 2, 300, 200), 64,
     dict(window_size=(40, 40), softcap=20.0, alibi="head")),
    ("sinks-nq<nk", (2, 2, 2, 150, 300), 64, dict(sinks=True)),
    # causal ALiBi alone: the one-sided strips' slope / scale form (mma_softmax.cuh), forward and backward
    ("alibi-causal-head-nq<nk", (2, 4, 2, 200, 260), 64, dict(causal=True, alibi="head")),
    ("alibi-causal-batch", (1, 4, 4, 300, 300), 128, dict(causal=True, alibi="batch")),
    ("sinks-one-tile", (2, 4, 2, 100, 90), 64, dict(sinks=True)),  # the kernel that owns dQ adds dsinks itself
    ("sinks-causal-nq>nk", (2, 3, 1, 250, 200), 128, dict(sinks=True, causal=True)),  # keyless rows: sink only
]  # fmt: skip


def _variant_kw(rng, b, hq, spec):
    kw = dict(spec)
    causal = kw.pop("causal", False)
    alibi = kw.pop("alibi", None)
    if alibi == "head":
        kw["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)).astype(np.float32)
    elif alibi == "batch":
        kw["alibi_slopes"] = rng.uniform(0.01, 0.3, (b, hq)).astype(np.float32)
    if kw.pop("sinks", False):
        kw["sinks"] = rng.uniform(-1.0, 2.5, hq).astype(np.float32)
    return causal, kw


@pytest.mark.parametrize("shape, d, spec", [pytest.param(*c[1:], id=c[0]) for c in VARIANTS])
def test_variants(shape, d, spec, rng):
    b, hq, hk, nq, nk = shape
    causal, kw = _variant_kw(rng, b, hq, spec)
    q, k, v, do = _inputs(rng, b, hq, hk, nq, nk, d)
    got, ref = backward_api(q, k, v, do, causal, **kw)
    _check_grads(got, ref)


@pytest.mark.parametrize("case", ["bias-broadcast-over-batch", "full-bias-mask-causal"])
def test_bias_with_dbias(case, rng):
    """A float32 bias with bias_grad (issue 17): broadcast over the batch (the masks suite's (1, H, N, N) case: dbias
    accumulated by float atomics), and of the full shape with a bool mask, causal (dbias stored per pair)."""
    b, hq, hk, nq, nk, d = 2, 4, 2, 150, 300, 64
    q, k, v, do = _inputs(rng, b, hq, hk, nq, nk, d)
    full = case.startswith("full")
    bshape = (b, hq, nq, nk) if full else (1, hq, nq, nk)
    kw = dict(bias=rng.standard_normal(bshape).astype(F32), bias_grad=True)
    if full:
        kw["mask"] = rng.random((b, hq, nq, nk)) < 0.8
    got, ref = backward_api(q, k, v, do, full, **kw)
    assert got[3].shape == bshape and got[3].dtype == F32
    _check_grads(got, ref, names=("dq", "dk", "dv", "dbias"))


def test_dropout(rng):
    """Dropout with the forward's seed: the backward regenerates the same keep mask (the reference's)."""
    d, causal = 64, True
    q, k, v, do = _inputs(rng, 2, 4, 2, 260, 300, d)
    got, ref = backward_api(q, k, v, do, causal, dropout_p=0.17, dropout_seed=int(rng.integers(0, 2**62)))
    _check_grads(got, ref)


# ---------------------------------------------------------------------------- deterministic, varlen

REPEATS = 3


def assert_reproducible(q, k, v, do, causal):
    """REPEATS deterministic backwards: the first within the bounds, every one bitwise equal to it."""
    first = None
    for _ in range(REPEATS):
        got, ref = backward_poisoned(q, k, v, do, causal, deterministic=True)
        got = [x.get() for x in got]
        if first is None:
            first = got
            _check_grads(got, ref)
            continue
        for name, a, g in zip(GRADS, first, got):
            assert np.array_equal(a.view(np.uint8), g.view(np.uint8)), f"{name} differs between runs"


@pytest.mark.parametrize("d, causal, shape", [(64, True, (1, 4, 2, 300, 520)), (128, True, (2, 4, 2, 700, 1024))])
def test_deterministic_is_bitwise_reproducible(d, causal, shape, rng):
    b, hq, hk, nq, nk = shape
    q, k, v, do = _inputs(rng, b, hq, hk, nq, nk, d)
    assert_reproducible(q, k, v, do, causal)


def test_deterministic_with_sinks_through_the_api(rng):
    q, k, v, do = _inputs(rng, 2, 4, 2, 260, 300, 64)
    sinks = cupy.asarray(rng.uniform(-1.0, 2.0, 4).astype(F32))
    o, lse = (x.astype(np.float32) for x in reference.attention_forward(q, k, v, True, sinks=sinks.get()))
    args = [cupy.asarray(x) for x in (do, q, k, v, o, lse)]
    runs = [[g.get() for g in cupyflash.attention_backward(*args, True, sinks=sinks, kernel="mma", deterministic=True)]
            for _ in range(REPEATS)]  # fmt: skip
    for run in runs[1:]:
        for name, a, g in zip(GRADS, runs[0], run):
            assert np.array_equal(a.view(np.uint8), g.view(np.uint8)), f"{name} differs between runs"


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen(deterministic, rng):
    from cupyflash import varlen_reference

    lq, lk, hq, hk, d = [17, 300, 1, 129], [40, 260, 200, 1], 4, 2, 64
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], hq, d)).astype(F32)
    k = rng.standard_normal((cu_k[-1], hk, d)).astype(F32)
    v = rng.standard_normal((cu_k[-1], hk, d)).astype(F32)
    do = rng.standard_normal(q.shape).astype(F32)
    sinks = rng.uniform(-1.0, 2.0, hq).astype(F32)
    pack = (cu_q, cu_k, max(lq), max(lk))
    ro, rlse = varlen_reference.attention_varlen_forward(q, k, v, *pack, True, sinks=sinks)
    ref = varlen_reference.attention_varlen_backward(do, q, k, v, ro, rlse, *pack, True, sinks=sinks)
    dev = [cupy.asarray(x) for x in (do, q, k, v, ro.astype(F32), rlse.astype(F32))]
    packd = (cupy.asarray(cu_q), cupy.asarray(cu_k), max(lq), max(lk))
    poison_pool((q.shape, F32), (k.shape, F32), (v.shape, F32))
    got = cupyflash.attention_varlen_backward(*dev, *packd, True, sinks=cupy.asarray(sinks), kernel="mma",
                                              deterministic=deterministic)  # fmt: skip
    _check_grads(got, ref)


def test_supports_float32_up_to_d128():
    from cupyflash.plans import DeviceLimits
    from cupyflash.validation import check_attention

    lim = DeviceLimits.current()
    for d, ok in ((8, True), (64, True), (128, True), (136, False), (256, False)):
        q = cupy.zeros((1, 2, 16, d), F32)
        why = _mma().supports(check_attention(q, q, q), lim)
        assert (why is None) == ok, (d, why)
        if not ok:
            assert "D <= 128" in why


# ---------------------------------------------------------------------------- query parts (plans.mma.query_parts)

# (id, (B, Hq, Hk, Nq, Nk), D, causal, parts): past MAX_ROWS_F32 query rows a kv head (group x Nq) the key tiles'
# query tiles are split over blocks whose partial dK/dV a combine launch sums. 2 parts (MHA), 4 (GQA 4 x 4096, D = 128:
# Br = 32), 3 with the first part empty for every key tile (causal with Nq > Nk: its blocks write zero partials), and
# one key tile (where one part would take the kernel that owns dQ; parts take the three launches). Nk is small where
# it may be: the drift is over the queries a block sums.
PARTS = [
    ("mha-8192", (1, 2, 2, 8192, 200), 64, False, 2),
    ("gqa4-4096-d128", (1, 4, 1, 4096, 300), 128, False, 4),
    ("gqa4-causal-nq>nk", (2, 4, 1, 2500, 777), 64, True, 3),
    ("one-key-tile", (1, 2, 2, 6000, 100), 64, False, 2),
]  # fmt: skip


def _parts_of(hq, hk, nq, d):
    from cupyflash.plans import mma as plans

    return plans.query_parts(hq // hk, nq, plans.BACKWARD_CONFIGS_F32[d].br)


@pytest.mark.parametrize("shape, d, causal, parts", [pytest.param(*c[1:], id=c[0]) for c in PARTS])
def test_query_parts(shape, d, causal, parts, rng):
    b, hq, hk, nq, nk = shape
    assert _parts_of(hq, hk, nq, d) == parts  # the case reaches the parts it is named for
    q, k, v, do = _inputs(rng, b, hq, hk, nq, nk, d)
    got, ref = backward_poisoned(q, k, v, do, causal)
    _check_grads(got, ref)


def test_query_parts_deterministic(rng):
    """4 parts with deterministic=True: the parts' dQ adds take their turns within a part, and the combine sums the
    partials in part order, so runs are bitwise identical."""
    b, hq, hk, nq, nk, d = 1, 4, 1, 4096, 520, 64
    assert _parts_of(hq, hk, nq, d) == 4
    q, k, v, do = _inputs(rng, b, hq, hk, nq, nk, d)
    assert_reproducible(q, k, v, do, True)


def test_query_parts_with_bias_grad_and_dropout(rng):
    """Parts through the API with a float32 bias and its gradient (dS per step, unchanged by the split) and dropout
    (dV's partials scaled by 1 / (1 - p) before the combine)."""
    b, hq, hk, nq, nk, d = 1, 2, 1, 4200, 300, 64
    assert _parts_of(hq, hk, nq, d) == 3
    q, k, v, do = _inputs(rng, b, hq, hk, nq, nk, d)
    kw = dict(bias=rng.standard_normal((1, hq, nq, nk)).astype(F32), bias_grad=True)
    got, ref = backward_api(q, k, v, do, False, **kw)
    _check_grads(got, ref, names=("dq", "dk", "dv", "dbias"))
    got, ref = backward_api(q, k, v, do, False, dropout_p=0.1, dropout_seed=int(rng.integers(0, 2**62)))
    _check_grads(got, ref)
