"""Linear-attention kernels on the GPU against the float64 reference.

q and k rows have unit L2 norm (with no softmax, magnitudes grow with N otherwise); v and dO are
standard normal. Bounds: relative error 1e-5 for float32, 1e-2 for float16/bfloat16, for o and
every gradient. Outputs are NaN-poisoned before each launch; both paths (chunked, masked) are
reached explicitly.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, HAS_GPU, rel_err, requires_gpu

import cupyflash.linear_api as api
from cupyflash.plans import DeviceLimits
import cupyflash.linear_validation as checks
from cupyflash import linear_reference as ref

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

    from cupyflash.kernels import linear

TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
DT = list(DTYPES)
# (dtype, tile implementation): 16-bit inputs run tensor cores by default (the fused 16-bit walk on
# the chunked path, TF32 tiles on the masked path) and keep the FFMA tiles reachable; float32
# always runs FFMA.
IMPLS = [("float32", "ffma"), ("float16", "tc"), ("float16", "ffma"), ("bfloat16", "tc"), ("bfloat16", "ffma")]
IMPL_IDS = [f"{d}-{i}" for d, i in IMPLS]


def _unit_rows(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def inputs(rng, batch, hq, hk, nq, nk, d, dtype):
    q = _unit_rows(rng.standard_normal((*batch, hq, nq, d))).astype(dtype)
    k = _unit_rows(rng.standard_normal((*batch, hk, nk, d))).astype(dtype)
    v = rng.standard_normal((*batch, hk, nk, d)).astype(dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, do


def _poisoned(shape, dtype):
    return cupy.full(shape, np.nan, dtype=dtype)


def check(rng, dtype_name, batch, hq, hk, nq, nk, d, causal, *, mask_shape=None, mask_kind="float", decay=False,
          path="auto", mask_grad=False, scale=0.75, impl="ffma"):
    dtype = DTYPES[dtype_name]
    q, k, v, do = inputs(rng, batch, hq, hk, nq, nk, d, dtype)
    mask = None
    if mask_shape is not None:
        mask = rng.uniform(size=mask_shape) > 0.3 if mask_kind == "bool" else rng.uniform(-1, 1, mask_shape)
        mask = mask.astype(np.float32) if mask_kind == "float" else mask
    lam = rng.uniform(0.9, 1.0, hq).astype(np.float32) if decay else None
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    md = cupy.asarray(mask) if mask is not None else None
    ld = cupy.asarray(lam) if lam is not None else None
    p = checks.check_linear(qd, kd, vd, causal=causal, mask=md, decay=ld, scale=scale)
    tc = impl == "tc"
    assert linear._tensor_cores(p, tc, DeviceLimits.current()) == tc  # the variant asked for is the one that runs
    o = _poisoned(q.shape, dtype)
    linear.forward(qd, kd, vd, md, ld, p, path=path, out=o, tensor_cores=tc)
    grads_out = (_poisoned(q.shape, dtype), _poisoned(k.shape, dtype), _poisoned(v.shape, dtype))
    got = linear.backward(dod, qd, kd, vd, md, ld, p, mask_grad, path=path, out=grads_out, tensor_cores=tc)
    want_o = ref.linear_attention(q, k, v, causal, mask, lam, scale)
    want = ref.linear_attention_backward(do, q, k, v, causal, mask, lam, scale, mask_grad=mask_grad)
    names = ["o", "dq", "dk", "dv", "dmask"]
    errs = [rel_err(o.get(), want_o)] + [rel_err(g.get(), w) for g, w in zip(got, want)]
    for name, e in zip(names, errs):
        assert e <= TOL[dtype_name], f"{dtype_name} {impl} {path} {name}: rel err {e:.3g} > {TOL[dtype_name]}"
    if mask_grad:
        assert got[3].shape == mask.shape
    return o, got


# ---------------------------------------------------------------------------- chunked (state form)

CHUNKED = [
    # batch, hq, hk, nq, nk, d, causal, decay
    ((2,), 4, 4, 300, 300, 64, True, True),
    ((1,), 4, 1, 130, 257, 128, True, False),  # MQA, Nq < Nk
    ((2,), 4, 2, 300, 77, 40, True, True),  # GQA, Nq > Nk (rows that see nothing), odd D
    ((), 2, 2, 1, 1, 16, True, False),  # N = 1
    ((2,), 2, 1, 150, 90, 256, False, False),  # two column blocks of D, non-causal
    ((3,), 2, 2, 65, 129, 17, False, False),
    ((1,), 2, 2, 1000, 1000, 96, True, True),
    ((1,), 4, 2, 200, 170, 17, True, True),  # rows not 16-byte aligned: plain loads, not cp.async
]
CHUNKED_IDS = ["mha-decay", "mqa-nq<nk", "gqa-nq>nk-d40", "n1", "d256-noncausal", "odd-noncausal", "n1000-decay",
               "unaligned-d17-decay"]


@pytest.mark.parametrize("dtype_name,impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("case", CHUNKED, ids=CHUNKED_IDS)
def test_chunked(rng, dtype_name, impl, case):
    *shape, causal, decay = case
    check(rng, dtype_name, *shape, causal, decay=decay, path="chunked", impl=impl)


def _fused_tiles():
    from cupyflash.plans import linear as lp

    return [(dk, dv, st) for dk, dv in lp.FUSED_SHAPES for st in lp.fused_stage_counts(dk)]


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("dk,dv,stages", _fused_tiles(), ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_fused_tiles(rng, monkeypatch, dtype_name, dk, dv, stages, causal):
    # Every fused-walk instantiation, forced: GQA (the reverse passes sum heads), Nq > Nk, a head
    # dim short of DK (zero padding, two column blocks when DV = 32) and a partial last chunk.
    monkeypatch.setattr(linear, "FUSED_DV", dv)
    monkeypatch.setattr(linear, "FUSED_STAGES", stages)
    seen = []
    real = linear._launch
    monkeypatch.setattr(linear, "_launch", lambda plan, args: (seen.append(plan.name), real(plan, args)))
    check(rng, dtype_name, (2,), 4, 2, 150, 140, dk - 8, causal, decay=causal, path="chunked", impl="tc")
    assert seen and all(n.endswith(f", {dk}, {dv}, {stages}>") for n in seen), seen


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("segments,sub_len,slots", [(2, None, 3), (3, None, 4), (5, None, 4), (2, 2, 2), (3, 2, 2)])
@pytest.mark.parametrize("hk,nq,decay", [(4, 300, True), (2, 257, True), (4, 320, False)], ids=["mha", "gqa", "nodecay"])
def test_fused_segments(rng, monkeypatch, dtype_name, segments, sub_len, slots, hk, nq, decay):
    # Causal walks split into segments (the state kernel sums slots of chunks, then each segment
    # walks from the decayed sum of the slots before it): 5 chunks of keys in runs of 3 + 2 (slots
    # of 1 chunk, or 4 + 1 with slots of 2), 2 + 2 + 1 (slots of 1 or 2) and 1 each; Nq != Nk; under
    # GQA only the forward passes split (the reverse ones sum heads and stay whole).
    monkeypatch.setattr(linear, "FUSED_SEGMENTS", segments)
    monkeypatch.setattr(linear, "FUSED_SUB_LEN", sub_len)
    seen = []
    real = linear._launch
    monkeypatch.setattr(linear, "_launch", lambda plan, args: (seen.append((plan.name, plan.grid)), real(plan, args)))
    check(rng, dtype_name, (2,), 4, hk, nq, 300, 64, True, decay=decay, path="chunked", impl="tc")
    walks = [grid[2] for name, grid in seen if name.startswith("linear_fused_walk")]
    states = [grid[2] for name, grid in seen if name.startswith("linear_fused_state")]
    assert segments in walks and states and set(states) == {slots}, seen


def test_host_decay(rng):
    # Host rates (NumPy array or list) with CuPy inputs: the same values as a CuPy decay, so the
    # same bits out; a CuPy decay with NumPy inputs is a mixed-kind error.
    q, k, v, do = (cupy.asarray(x) for x in inputs(rng, (2,), 4, 2, 300, 300, 64, DTYPES["bfloat16"]))
    lam = rng.uniform(0.9, 1.0, 4).astype(np.float32)
    want = api.linear_attention(q, k, v, causal=True, decay=cupy.asarray(lam))
    want_g = api.linear_attention_backward(do, q, k, v, causal=True, decay=cupy.asarray(lam))
    def same(a, b):  # bit for bit
        return bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())

    for host in (lam, lam.tolist()):
        assert same(api.linear_attention(q, k, v, causal=True, decay=host), want)
        got = api.linear_attention_backward(do, q, k, v, causal=True, decay=host)
        assert all(same(g, w) for g, w in zip(got, want_g))
    # the device copy of host rates is cached by value: new values are new rates
    lam2 = (lam * 0.97).astype(np.float32)
    assert same(api.linear_attention(q, k, v, causal=True, decay=lam2),
                api.linear_attention(q, k, v, causal=True, decay=cupy.asarray(lam2)))  # fmt: skip
    assert not same(api.linear_attention(q, k, v, causal=True, decay=lam2), want)
    with pytest.raises(TypeError, match="all be NumPy or all be CuPy"):
        api.linear_attention(q.get(), k.get(), v.get(), causal=True, decay=cupy.asarray(lam))


# ---------------------------------------------------------------------------- masked (tiled)

MASKED = [
    # batch, hq, hk, nq, nk, d, causal, mask shape, mask kind, decay
    ((2,), 4, 2, 200, 150, 64, True, (200, 150), "bool", True),
    ((1,), 4, 4, 90, 333, 128, False, (1, 4, 1, 333), "float", False),
    ((2,), 2, 1, 130, 130, 32, True, (2, 2, 130, 130), "float", False),
    ((), 2, 2, 1, 70, 256, False, (70,), "float", False),
    ((2, 2), 2, 2, 65, 40, 24, False, (2, 1, 1, 65, 40), "float", False),  # broadcast over the inner batch dim
]
MASKED_IDS = ["gqa-causal-bool-decay", "heads-keys", "full-mask", "nq1-d256", "two-batch-dims"]


@pytest.mark.parametrize("dtype_name,impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("case", MASKED, ids=MASKED_IDS)
def test_masked(rng, dtype_name, impl, case):
    *shape, causal, mshape, kind, decay = case
    check(rng, dtype_name, *shape, causal, mask_shape=mshape, mask_kind=kind, decay=decay, mask_grad=True, impl=impl)


@pytest.mark.parametrize("dtype_name,impl", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("causal,decay", [(True, True), (False, False)])
def test_masked_path_without_mask(rng, dtype_name, impl, causal, decay):
    # The tiled kernel with only causal/decay weights must agree with the reference too.
    check(rng, dtype_name, (2,), 4, 2, 140, 100, 64, causal, decay=decay, path="masked", impl=impl)


def test_default_tile_choice(rng):
    from cupyflash.plans import DeviceLimits

    cc = DeviceLimits.current().compute_capability
    for name in DT:
        q, k, v, _ = (cupy.asarray(x) for x in inputs(rng, (1,), 2, 2, 8, 8, 16, DTYPES[name]))
        p = checks.check_linear(q, k, v)
        assert linear._tensor_cores(p, None, DeviceLimits.current()) == (name != "float32" and cc >= 80)


def test_forward_bit_identical(rng):
    for path, mshape in (("chunked", None), ("masked", (257, 257))):
        dtype = DTYPES["bfloat16"]
        q, k, v, _ = (cupy.asarray(x) for x in inputs(rng, (2,), 4, 2, 257, 257, 64, dtype))
        m = cupy.asarray(rng.uniform(size=mshape).astype(np.float32)) if mshape else None
        lam = cupy.asarray(np.full(4, 0.99, np.float32))
        p = checks.check_linear(q, k, v, causal=True, mask=m, decay=lam)
        a = linear.forward(q, k, v, m, lam, p, path=path)
        b = linear.forward(q, k, v, m, lam, p, path=path)
        assert a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------------- public API on CuPy


def test_public_api_cupy(rng):
    import cupyflash.linear_api as cf

    dtype = DTYPES["float32"]
    q, k, v, do = inputs(rng, (2,), 4, 2, 100, 100, 64, dtype)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    # (B, N, H, D) storage seen through a transpose: strided views run without a copy
    qt = cupy.ascontiguousarray(qd.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    lam = cupy.asarray(np.array([0.9, 0.95, 0.99, 1.0], np.float32))
    o, vjp = cf.linear_attention_vjp(qt, kd, vd, causal=True, decay=lam, scale=0.5)
    assert isinstance(o, cupy.ndarray) and o.dtype == dtype
    assert rel_err(o.get(), ref.linear_attention(q, k, v, True, None, lam.get(), 0.5)) <= 1e-5
    for g, w in zip(vjp(dod), ref.linear_attention_backward(do, q, k, v, True, None, lam.get(), 0.5)):
        assert rel_err(g.get(), w) <= 1e-5
    mask = cupy.asarray(rng.uniform(size=(100, 100)) > 0.5)
    dq, dk, dv, dm = cf.linear_attention_backward(dod, qd, kd, vd, mask=mask, mask_grad=True)
    assert dm.dtype == np.float32 and dm.shape == (100, 100)
    want = ref.linear_attention_backward(do, q, k, v, mask=mask.get(), mask_grad=True)
    assert rel_err(dm.get(), want[3]) <= 1e-5


def test_public_api_errors(rng):
    import cupyflash.linear_api as cf

    q, k, v, _ = inputs(rng, (1,), 2, 2, 8, 8, 16, DTYPES["float32"])
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    with pytest.raises(TypeError, match="all be NumPy or all be CuPy"):
        cf.linear_attention(qd, kd, v)
    with pytest.raises(TypeError, match="all be NumPy or all be CuPy"):
        cf.linear_attention(qd, kd, vd, mask=np.ones((8, 8)))
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        cf.linear_attention(qd, kd, vd, causal=True, decay=cupy.asarray([0.5, 2.0]))
    with pytest.raises(ValueError, match="path must be one of"):
        linear.forward(qd, kd, vd, None, None, checks.check_linear(qd, kd, vd), path="fast")


def test_empty_and_keyless(rng):
    import cupyflash.linear_api as cf

    dtype = DTYPES["float16"]
    q, k, v, do = (cupy.asarray(x) for x in inputs(rng, (2,), 2, 2, 5, 3, 32, dtype))
    k0, v0 = k[:, :, :0], v[:, :, :0]
    o = cf.linear_attention(q, k0, v0)
    assert o.shape == q.shape and bool(cupy.all(o == 0))
    dq, dk, dv = cf.linear_attention_backward(do, q, k0, v0)
    assert bool(cupy.all(dq == 0)) and dk.shape == k0.shape
