"""GPU: the one-launch backward (issue 12): when one key tile covers Nk, the tensor-core main kernel owns its query
rows' dQ (``kOwnDQ``, cuda_src/dq_own.cuh): it computes Delta itself, stores dQ instead of adding it, and zeroes
the rows its loop does not visit.

Each case is planned through the family's own plan first (``BackwardPlan.own_dq`` must hold, so the path is reached
on purpose), then run into NaN-poisoned dq, dk, dv and checked against the float64 reference by FlashAttention's
criterion (test_variants_gpu.check_case's rules, here with given outputs). Shapes: Nq > Nk under causal (rows with
no key, which only the zeroing writes), GQA and MQA, a window, many query tiles against one key tile, sinks
(dsinks from the kernel's own Delta) and softcap; every backward kernel: mma key-major (D = 32, 64, 256) and 2-D
(D = 128), wgmma (D = 64, 128). Deterministic: the kernel adds nothing, so 5 repeats compare bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, TOL_GRAD, random_qkv, rel_err, requires_gpu, needs_hopper as _needs_hopper

import test_variants_gpu as tv
import cupyflash
from cupyflash import plans, reference
from cupyflash.validation import check_backward

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy


# (id, (B, Hq, Hk, Nq, Nk), spec): Nk <= every kernel's key tile here (Bc >= 32: mma D = 256 has Bc = 32)
SHAPES = [
    ("causal-nq>nk", (2, 4, 2, 300, 29), dict(causal=True)),
    ("mqa-many-query-tiles", (1, 4, 1, 1000, 31), {}),
    ("window-gqa", (2, 6, 2, 130, 32), dict(window=(7, 3))),
    ("sinks-softcap", (1, 4, 4, 77, 20), dict(sinks=True, softcap=20.0, causal=True)),
]
FAMILIES = [
    ("mma", "float16", (64, 32, 128, 256)),
    ("mma", "bfloat16", (128, 64)),
    pytest.param("wgmma", "bfloat16", (64, 128), marks=_needs_hopper),
    pytest.param("wgmma", "float16", (128, 64), marks=_needs_hopper),
]


def _cases():
    out = []
    for fam in FAMILIES:
        (kernel, dtype, dims), marks = (fam.values, fam.marks) if hasattr(fam, "values") else (fam, ())
        for i, (name, shape, spec) in enumerate(SHAPES):
            d = dims[i % len(dims)]
            out.append(pytest.param(kernel, dtype, shape, spec, d, marks=marks, id=f"{kernel}-{dtype}-{name}-d{d}"))
    return out


def _family(kernel):
    from cupyflash.kernels import dispatch

    return dispatch.families()[kernel]


def _assert_owns_dq(kernel, p, b, d):
    from cupyflash.kernels.tensorcore import ctype

    planner = plans.wgmma if kernel == "wgmma" else plans.mma
    plan = planner.plan_backward(b, p.hq, p.hk, p.nq, p.nk, d, ctype(p), plans.DeviceLimits.current(),
                                 variant=p.variant)  # fmt: skip
    assert plan.own_dq and plan.main.name.endswith(", true>"), plan.main.name


@pytest.mark.parametrize("kernel,dtype_name,shape,spec,d", _cases())
def test_own_dq_matches_reference(kernel, dtype_name, shape, spec, d, rng):
    q, k, v, do, causal, scale, kw = tv.make_inputs(rng, dtype_name, shape, spec, d)
    if kw["sinks"] is None:  # given outputs, poisoned: every element of dq (visited rows or not) must be written
        qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
        kwd = tv._device_kw(kw)
        o, lse = cupyflash.attention_forward(qd, kd, vd, causal, scale, kernel=kernel, **kwd)
        p = check_backward(dod, qd, kd, vd, o, lse, causal=causal, scale=scale, **kwd)
        _assert_owns_dq(kernel, p, shape[0], d)
        fam = _family(kernel)
        runs = []
        for _ in range(5):
            dq, dk, dv = (cupy.full(x.shape, np.nan, x.dtype) for x in (qd, kd, vd))
            fam.backward(dod, qd, kd, vd, o, lse, dq, dk, dv, p)
            runs.append([x.get() for x in (dq, dk, dv)])
        for later in runs[1:]:  # nothing is added in a varying order
            for a, b in zip(runs[0], later):
                assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
        ro, rlse = reference.attention_forward(q, k, v, causal, scale, **kw)
        rgrads = reference.attention_backward(do, q, k, v, ro, rlse, causal, scale, **kw)
        naive = tv.naive_attention(q, k, v, do, causal, scale, kw, dtype_name)
        for i, name in enumerate(("dq", "dk", "dv")):
            got = runs[0][i].astype(np.float64)
            assert np.isfinite(got).all(), f"{name} has NaN/inf (unwritten elements)"
            tv.assert_fa_criterion(f"{kernel} {dtype_name} {name}", got, rgrads[i], naive[i + 1], dtype_name, 3)
        keyless = ~tv.visible_mask(shape[3], shape[4], causal, kw["window_size"]).any(axis=1)
        if keyless.any():
            assert np.all(runs[0][0][..., keyless, :] == 0), "rows that see no key must get dq = 0"
    else:  # dsinks comes back through the API (its buffer is the API's); check_case checks all of it
        qd = cupy.asarray(q)
        p = check_backward(qd, qd, cupy.asarray(k), cupy.asarray(v), qd, cupy.zeros(qd.shape[:-1], np.float32),
                           causal=causal, scale=scale, **tv._device_kw(kw))  # fmt: skip
        _assert_owns_dq(kernel, p, shape[0], d)
        tv.check_case(kernel, dtype_name, q, k, v, do, causal, scale, kw)


@pytest.mark.parametrize("kernel,dtype_name", [("mma", "bfloat16"), pytest.param("wgmma", "bfloat16", marks=_needs_hopper)])
def test_own_dq_deterministic_flag(kernel, dtype_name, rng):
    """deterministic=True on a one-tile backward takes the same single launch (no turn counters needed)."""
    q, k, v = random_qkv(rng, (2,), 4, 2, 200, 64, 64, DTYPES[dtype_name])
    do = rng.standard_normal(q.shape).astype(q.dtype)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    o, lse = cupyflash.attention_forward(qd, kd, vd, True, kernel=kernel)
    a = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, True, kernel=kernel, deterministic=True)
    b = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, True, kernel=kernel)
    for x, y in zip(a, b):
        assert np.array_equal(x.get().view(np.uint8), y.get().view(np.uint8))
    ro, rlse = reference.attention_forward(q, k, v, True)
    rgrads = reference.attention_backward(do, q, k, v, ro, rlse, True)
    for x, r in zip(a, rgrads):
        assert rel_err(x.get(), r) <= TOL_GRAD[dtype_name]
