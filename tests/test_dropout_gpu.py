"""GPU: attention dropout (issue 16) against the float64 reference with ``dropout_mask``'s mask.

- The mask itself: with V = I (D = Nk) the output is P * Z, nonzero exactly where P_ij was kept, so each
  family's mask is read back and compared element for element with ``cupyflash.dropout_mask`` (multi-tile
  shapes, GQA, batches that run as separate sub-batch launches); kept fractions and independence follow
  from the mask's CPU tests once they are equal.
- Forward and backward against the reference (which the CPU tests check against the formula with the mask):
  float32 relative error <= 1e-5 (o) / 1e-4 (grads); 16-bit: the fixed bounds of tests/conftest.py.
  Outputs are NaN-poisoned before each launch (family entry points) or checked NaN-free (API).
- Same seed, same bits; another seed, another mask; attention_vjp draws a seed and its backward keeps it.
- The thresholds' ends: p = 0.001 rounds to 0/256 (everything kept, scale 1) and p = 0.999 to 255/256; the masks
  still equal ``dropout_mask`` (whose p is ``effective_dropout_p(p)``, as the reference's).

Every family is reached explicitly; the mma family at D = 64 (key-major backward), D = 128 (2-D backward),
D = 32 (a 128-key forward strip: 64 keep bits per lane) and D = 256 (a 16-key forward strip: one 16 x 16 block,
drawn by both lanes of a pair; a key-major backward split over d); wgmma (Hopper only) at D = 64 and 128.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import (
    DTYPES, HAS_GPU, TOL_GRAD, TOL_OUT, random_qkv, rel_err, requires_gpu, needs_hopper as _needs_hopper
)

import cupyflash
from cupyflash import reference
from cupyflash.validation import check_attention

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

DROPOUT_FAMILIES = [("portable", "float32"), ("portable", "float16"), ("portable", "bfloat16"), ("mma", "float16"),
                    ("mma", "bfloat16"), pytest.param("wgmma", "float16", marks=_needs_hopper),
                    pytest.param("wgmma", "bfloat16", marks=_needs_hopper)]  # fmt: skip


def _family(kernel):
    from cupyflash.kernels import dispatch

    return dispatch.families()[kernel]


def _poisoned(shape, dtype):
    return cupy.full(shape, np.nan, dtype=dtype)


def _forward(kernel, q, k, v, p, seed):
    o, lse = _poisoned(q.shape, q.dtype), _poisoned(q.shape[:-1], np.float32)
    _family(kernel).forward(q, k, v, o, lse, p, dropout_seed=seed)
    return o, lse


def _unpack(case):
    return (case.values, case.marks) if hasattr(case, "values") else (case, ())


def _spread(cases, per_family):
    """Each (family, dtype) takes ``per_family`` of ``cases`` in turn (NVRTC compiles every new policy, dtype
    and D: the whole cross product would take many minutes), so that together they see every case."""
    out, i = [], 0
    for fam in DROPOUT_FAMILIES:
        (kernel, dtype), marks = _unpack(fam)
        n = len(cases) if kernel == "portable" and dtype == "float32" else per_family
        for _ in range(n):
            case = cases[i % len(cases)]
            i += 1
            out.append(pytest.param(kernel, dtype, *case, marks=marks, id=f"{kernel}-{dtype}-{i}"))
    return out


# (batch, Hq, Hk, Nq, causal, p, Nk = D); the tensor-core families get D = 64/128 (wgmma takes D <= 128).
MASK_CASES = [((2,), 3, 3, 200, False, 0.5, 64), ((1,), 4, 2, 130, True, 0.1, 128), ((2,), 2, 1, 300, False, 0.3, 128),
              ((1,), 2, 2, 70, True, 0.17, 64)]  # fmt: skip


@pytest.mark.parametrize("kernel, dtype, batch, hq, hk, nq, causal, p_drop, nk", _spread(MASK_CASES, 2))
def test_kernel_mask_is_dropout_mask(kernel, dtype, batch, hq, hk, nq, causal, p_drop, nk, rng):
    d = nk  # V = I: the output row is P * Z
    dt = DTYPES[dtype]
    q = cupy.asarray(rng.standard_normal((*batch, hq, nq, d)).astype(dt))
    k = cupy.asarray(rng.standard_normal((*batch, hk, nk, d)).astype(dt))
    v = cupy.asarray(np.broadcast_to(np.eye(nk, dtype=dt), (*batch, hk, nk, d)).copy())
    seed = int(rng.integers(0, 2**63)) * 2 + 1  # exercises the seed's high word
    p = check_attention(q, k, v, causal=causal, dropout_p=p_drop)
    o, _ = _forward(kernel, q, k, v, p, seed)
    got = o.get() != 0
    want = cupyflash.dropout_mask(batch, hq, nq, nk, p_drop, seed)
    if causal:  # hidden pairs have P = 0 whatever the mask
        want &= np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {got.size} mask elements differ"


def _mask_of_kernel(kernel, dtype, batch, hq, hk, nq, nk, causal, p_drop, seed, rng):
    """The keep mask a family's forward applied (V = I, D = Nk), and dropout_mask's (causal pairs hidden)."""
    dt = DTYPES[dtype]
    q = cupy.asarray(rng.standard_normal((*batch, hq, nq, nk)).astype(dt))
    k = cupy.asarray(rng.standard_normal((*batch, hk, nk, nk)).astype(dt))
    v = cupy.asarray(np.broadcast_to(np.eye(nk, dtype=dt), (*batch, hk, nk, nk)).copy())
    o, _ = _forward(kernel, q, k, v, check_attention(q, k, v, causal=causal, dropout_p=p_drop), seed)
    want = cupyflash.dropout_mask(batch, hq, nq, nk, p_drop, seed)
    if causal:
        want &= np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq
    return o.get() != 0, want


THRESHOLD_FAMILIES = [("portable", "float32"), ("mma", "bfloat16"), pytest.param("wgmma", "bfloat16", marks=_needs_hopper)]


@pytest.mark.parametrize("kernel, dtype", THRESHOLD_FAMILIES)
@pytest.mark.parametrize("p_drop", [0.001, 0.999])
def test_threshold_ends(kernel, dtype, p_drop, rng):
    """p = 0.001 keeps everything (threshold 0: the kernels' byte comparison has a case of its own), p = 0.999
    keeps 1/256."""
    got, want = _mask_of_kernel(kernel, dtype, (2,), 2, 1, 96, 64, False, p_drop, 2**64 - 3, rng)
    assert want.all() if p_drop < 0.002 else want.mean() < 0.02
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {got.size} mask elements differ"


@pytest.mark.parametrize("d", [32, 256])
def test_mma_strip_ends(d, rng):
    """The mma forward's longest strip (D = 32: Bc = 128, 64 keep bits per lane) and shortest (D = 256: Bc = 16,
    one block drawn by both lanes of a pair); at D = 256 the backward too (key-major, split over d)."""
    got, want = _mask_of_kernel("mma", "bfloat16", (1,), 2, 2, 150, d, True, 0.3, 12345, rng)
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {got.size} mask elements differ"
    if d != 256:
        return
    q, k, v = random_qkv(rng, (2,), 4, 2, 100, 90, d, DTYPES["bfloat16"])
    do = rng.standard_normal(q.shape).astype(q.dtype)
    drop = dict(dropout_p=0.17, dropout_seed=99)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    o, lse = cupyflash.attention_forward(qd, kd, vd, True, kernel="mma", **drop)
    grads = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, True, kernel="mma", **drop)
    ro, _ = reference.attention_forward(q, k, v, True, **drop)
    rgrads = reference.attention_backward(do, q, k, v, o.get(), lse.get(), True, **drop)
    assert rel_err(o.get(), ro) <= TOL_OUT["bfloat16"]
    for name, g, r in zip(("dq", "dk", "dv"), grads, rgrads):
        assert rel_err(g.get(), r) <= TOL_GRAD["bfloat16"], name


def test_sub_batch_launches_continue_the_batch_index(rng):
    """Leading dims that cannot merge run as one launch per sub-batch: the mask keys on the global index."""
    nk = d = 32
    base = cupy.asarray(rng.standard_normal((3, 2, 2, 70, d)).astype(np.float32))
    q = base.transpose(1, 0, 2, 3, 4)  # (2, 3, H, N, D): batch strides that do not merge
    k = cupy.asarray(rng.standard_normal((2, 3, 2, nk, d)).astype(np.float32))
    v = cupy.asarray(np.broadcast_to(np.eye(nk, dtype=np.float32), (2, 3, 2, nk, d)).copy())
    o = cupyflash.attention(q, k, v, dropout_p=0.3, dropout_seed=77, kernel="portable")
    assert np.array_equal(o.get() != 0, cupyflash.dropout_mask((2, 3), 2, 70, nk, 0.3, 77))


# (B, Hq, Hk, Nq, Nk), variant keywords
CASES = [
    ((2, 4, 4, 150, 150), {}),
    ((1, 8, 2, 130, 260), {"causal": True}),
    ((2, 2, 2, 120, 200), {"sinks": True, "causal": True}),
    ((2, 4, 1, 260, 97), {"window_size": (32, 16)}),
    ((1, 4, 2, 190, 190), {"softcap": 30.0, "alibi": True}),
]


def _variant(rng, spec, hq):
    kw = {k: v for k, v in spec.items() if k not in ("alibi", "sinks", "causal")}
    if spec.get("alibi"):
        kw["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)).astype(np.float32)
    if spec.get("sinks"):
        kw["sinks"] = rng.uniform(-1.0, 2.0, hq).astype(np.float32)
    return spec.get("causal", False), kw


# With two cases per (family, dtype), float32 portable sees all, mma all but the window, wgmma all but sinks.
FB_CASES = [(shape, spec, d) for (shape, spec), d in zip(CASES, (64, 128, 64, 128, 128))]


@pytest.mark.parametrize("kernel, dtype, shape, spec, d", _spread(FB_CASES, 2))
def test_forward_and_backward_match_reference(kernel, dtype, shape, spec, d, rng):
    b, hq, hk, nq, nk = shape
    dt = DTYPES[dtype]
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, dt)
    do = rng.standard_normal(q.shape).astype(dt)
    causal, kw = _variant(rng, spec, hq)
    drop = dict(dropout_p=0.17, dropout_seed=int(rng.integers(0, 2**62)))
    dev = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    o, lse = cupyflash.attention_forward(qd, kd, vd, causal, kernel=kernel, **dev, **drop)
    grads = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, kernel=kernel, **dev, **drop)
    ro, rlse = reference.attention_forward(q, k, v, causal, **kw, **drop)
    rgrads = reference.attention_backward(do, q, k, v, o.get(), lse.get(), causal, **kw, **drop)
    assert rel_err(o.get(), ro) <= TOL_OUT[dtype]
    finite = np.isfinite(rlse)
    assert np.allclose(lse.get()[finite], rlse[finite], rtol=1e-4, atol=1e-4)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
        err = rel_err(g.get(), r)
        assert err <= TOL_GRAD[dtype], f"{name}: {err:.2e}"


@pytest.mark.parametrize("kernel, dtype", DROPOUT_FAMILIES[:2])
def test_given_outputs_poisoned(kernel, dtype, rng):
    """The family entry points with NaN-filled outputs: every element is written."""
    dt = DTYPES[dtype]
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (2,), 4, 2, 200, 170, 64, dt))
    do = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    p = check_attention(q, k, v, causal=True, dropout_p=0.25)
    o, lse = _forward(kernel, q, k, v, p, 5)
    dq, dk, dv = _poisoned(q.shape, dt), _poisoned(k.shape, dt), _poisoned(v.shape, dt)
    _family(kernel).backward(do, q, k, v, o, lse, dq, dk, dv, p, dropout_seed=5)
    ro, rlse = reference.attention_forward(q.get(), k.get(), v.get(), True, dropout_p=0.25, dropout_seed=5)
    ref = reference.attention_backward(do.get(), q.get(), k.get(), v.get(), o.get(), lse.get(), True,
                                       dropout_p=0.25, dropout_seed=5)  # fmt: skip
    assert rel_err(o.get(), ro) <= TOL_OUT[dtype]
    for g, r in zip((dq, dk, dv), ref):
        assert rel_err(g.get(), r) <= TOL_GRAD[dtype]


def test_same_seed_same_bits_other_seed_other_mask(rng):
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (2,), 4, 4, 128, 128, 64, np.float16))
    a = cupyflash.attention(q, k, v, dropout_p=0.1, dropout_seed=1)
    b = cupyflash.attention(q, k, v, dropout_p=0.1, dropout_seed=1)
    c = cupyflash.attention(q, k, v, dropout_p=0.1, dropout_seed=2)
    assert np.array_equal(a.get().view(np.uint16), b.get().view(np.uint16))
    assert not np.array_equal(a.get(), c.get())


def test_vjp_draws_a_seed_and_keeps_it(rng):
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (1,), 2, 2, 96, 96, 64, np.float32))
    do = cupy.asarray(rng.standard_normal(q.shape).astype(np.float32))
    cupy.random.seed(11)
    o, vjp = cupyflash.attention_vjp(q, k, v, dropout_p=0.2)
    grads = vjp(do)
    cupy.random.seed(11)
    seed = cupyflash.api.draw_seed(q)
    o2, lse2 = cupyflash.attention_forward(q, k, v, dropout_p=0.2, dropout_seed=seed)
    assert np.array_equal(o.get(), o2.get())
    want = cupyflash.attention_backward(do, q, k, v, o2, lse2, dropout_p=0.2, dropout_seed=seed)
    for g, w in zip(grads, want):
        assert np.array_equal(g.get(), w.get())




@pytest.mark.parametrize("kernel, dtype, d", [("portable", "float32", 64), ("mma", "bfloat16", 64),
                                              pytest.param("wgmma", "bfloat16", 64, marks=_needs_hopper),
                                              pytest.param("wgmma", "bfloat16", 128, marks=_needs_hopper)])  # fmt: skip
def test_dropout_with_mask_and_bias_arrays(kernel, dtype, d, rng):
    """Dropout on top of mask/bias arrays (issue 17 with issue 16): the keep mask applies after the softmax of the
    masked, biased scores, and dbias is the gradient of the score with the dropout in it. wgmma stages the arrays'
    tiles in shared memory (the forward at both head dims and the D = 128 backward; the D = 64 backward has no room
    for both arrays and reads them as before)."""
    b, hq, hk, nq, nk = 2, 4, 2, 150, 192
    dt = DTYPES[dtype]
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, dt)
    do = rng.standard_normal(q.shape).astype(dt)
    kw = {"mask": rng.random((b, 1, 1, nk)) < 0.85, "bias": (rng.standard_normal((hq, nq, nk)) * 2.0).astype(dt)}
    drop = dict(dropout_p=0.17, dropout_seed=int(rng.integers(0, 2**62)))
    dev = {n: cupy.asarray(x) for n, x in kw.items()}
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    o, lse = cupyflash.attention_forward(qd, kd, vd, True, kernel=kernel, **dev, **drop)
    grads = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, True, kernel=kernel, bias_grad=True, **dev, **drop)
    ro, rlse = reference.attention_forward(q, k, v, True, **kw, **drop)
    rgrads = reference.attention_backward(do, q, k, v, o.get(), lse.get(), True, bias_grad=True, **kw, **drop)
    assert rel_err(o.get(), ro) <= TOL_OUT[dtype]
    finite = np.isfinite(rlse)
    assert np.array_equal(np.isfinite(lse.get()), finite)
    assert np.allclose(lse.get()[finite], rlse[finite], rtol=1e-4, atol=1e-4)
    assert len(grads) == len(rgrads) == 4 and grads[3].shape == kw["bias"].shape
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, rgrads):
        err = rel_err(g.get(), r)
        assert err <= TOL_GRAD[dtype], f"{name}: {err:.2e}"


@_needs_hopper
@pytest.mark.parametrize("d, causal, deterministic", [(64, False, False), (64, True, True), (128, True, False),
                                                      (128, False, True)])  # fmt: skip
def test_wgmma_backward_drawer_and_in_warp_draws_agree(d, causal, deterministic, rng, monkeypatch):
    """The wgmma backward's two ways to the keep bits, each reached explicitly: the drawer warpgroup's ring (the
    plans' choice for plain scores) and the compute warpgroups' own draws (plans.wgmma.DRAWER_HEAD_DIMS emptied).
    The same bits give bitwise the same dK and dV (and dQ under deterministic), on poisoned outputs, and the
    reference's gradients within tolerance; several key tiles and query steps, GQA, Nq != Nk, a ragged last tile."""
    from cupyflash import cuda_backend
    from cupyflash.plans import H100
    from cupyflash.plans import wgmma as wgmma_plans

    dt = DTYPES["bfloat16"]
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (2,), 4, 2, 333, 461, d, dt))
    do = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    drop = dict(dropout_p=0.17, dropout_seed=2024)
    p = check_attention(q, k, v, causal=causal, dropout_p=0.17)
    o, lse = _forward("wgmma", q, k, v, p, 2024)
    out = {}
    for drawer in (True, False):
        monkeypatch.setattr(wgmma_plans, "DRAWER_HEAD_DIMS", frozenset({d}) if drawer else frozenset())
        cuda_backend._backward_cache.clear()
        plan = wgmma_plans.plan_backward(2, 4, 2, 333, 461, d, "__nv_bfloat16", H100, variant=p.variant)
        assert plan.main.block == ((384 if drawer else 256), 1, 1)
        grads = [_poisoned(x.shape, dt) for x in (q, k, v)]
        _family("wgmma").backward(do, q, k, v, o, lse, *grads, p, dropout_seed=2024, deterministic=deterministic)
        out[drawer] = [g.get() for g in grads]
    cuda_backend._backward_cache.clear()
    for i in (0, 1, 2) if deterministic else (1, 2):
        assert np.array_equal(out[True][i].view(np.uint16), out[False][i].view(np.uint16))
    ref = reference.attention_backward(do.get(), q.get(), k.get(), v.get(), o.get(), lse.get(), causal, **drop)
    for g, r in zip(out[True], ref):
        assert rel_err(g, r) <= TOL_GRAD["bfloat16"]

