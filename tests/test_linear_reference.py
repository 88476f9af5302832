"""Linear attention on the CPU: the float64 reference against a loop formula and finite
differences, the chunked mirror of the kernels, argument checks, the NumPy backend, launch
plans, and an NVRTC compile of every linear kernel instantiation (sm_80, sm_90a, no spills)."""
from __future__ import annotations

import itertools
import os
from concurrent.futures import ProcessPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from conftest import DTYPES

import cupyflash.linear_api as api
import cupyflash.linear_validation as checks
from cupyflash import linear_reference as ref
from cupyflash.plans import LaunchPlan
from cupyflash.plans import linear as plans

# (batch, hq, hk, nq, nk, d, causal, mask shape or None, decay)
CASES = [
    ((2,), 4, 2, 5, 7, 3, True, None, True),  # GQA, Nq < Nk, decay
    ((), 2, 1, 6, 4, 5, True, (6, 4), False),  # MQA, Nq > Nk (rows that see nothing), 2-D mask
    ((2,), 2, 2, 4, 4, 3, False, (1, 2, 1, 4), False),  # mask broadcast over batch and queries
    ((2, 1), 3, 1, 1, 5, 2, True, None, True),  # N = 1 query, two batch dims
    ((1,), 2, 2, 5, 5, 4, False, (1, 5, 5), False),  # mask broadcast over heads
    ((2,), 2, 1, 3, 6, 2, True, (2, 2, 3, 6), True),  # full mask with causal and decay
    ((), 1, 1, 7, 7, 1, False, None, False),  # D = 1, non-causal
]
IDS = ["gqa-decay", "mqa-nq>nk-mask2d", "mask-bcast", "nq1", "mask-heads", "full-mask-decay", "d1"]


def make(rng, batch, hq, hk, nq, nk, d, causal, mshape, dec, dtype=np.float64):
    q = rng.standard_normal((*batch, hq, nq, d)).astype(dtype)
    k = rng.standard_normal((*batch, hk, nk, d)).astype(dtype)
    v = rng.standard_normal((*batch, hk, nk, d)).astype(dtype)
    mask = rng.uniform(-1, 1, mshape) if mshape is not None else None
    decay = rng.uniform(0.3, 1.0, hq) if dec else None
    return q, k, v, mask, decay


def loop_formula(q, k, v, causal, mask, decay, scale):
    """o[b, h, i] = scale * sum_j W (q_i . k_j) v_j, one scalar at a time."""
    *batch, hq, nq, d = q.shape
    hk, nk = k.shape[-3], k.shape[-2]
    group = hq // hk
    full = (*batch, hq, nq, nk)
    m = np.broadcast_to(mask, full) if mask is not None else np.ones(full)
    o = np.zeros(q.shape)
    for bi in itertools.product(*(range(n) for n in batch)):
        for h in range(hq):
            for i in range(nq):
                for j in range(nk):
                    w = m[(*bi, h, i, j)]
                    dist = i + nk - nq - j
                    if causal and dist < 0:
                        continue
                    if decay is not None:
                        w = w * decay[h] ** dist
                    qk = sum(q[(*bi, h, i, t)] * k[(*bi, h // group, j, t)] for t in range(d))
                    o[(*bi, h, i)] += scale * w * qk * v[(*bi, h // group, j)]
    return o


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_matches_loop_formula(rng, case):
    q, k, v, mask, decay = make(rng, *case)
    causal = case[6]
    o = ref.linear_attention(q, k, v, causal=causal, mask=mask, decay=decay, scale=0.8)
    np.testing.assert_allclose(o, loop_formula(q, k, v, causal, mask, decay, 0.8), rtol=1e-12, atol=1e-12)


def _loss(do, **kw):
    return float(np.sum(ref.linear_attention_forward(**kw) * do))


def _fd(x, f, eps=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + eps
        up = f()
        x[idx] = old - eps
        dn = f()
        x[idx] = old
        g[idx] = (up - dn) / (2 * eps)
    return g


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_matches_finite_differences(rng, case):
    q, k, v, mask, decay = make(rng, *case)
    causal = case[6]
    do = rng.standard_normal(q.shape)
    kw = dict(q=q, k=k, v=v, causal=causal, mask=mask, decay=decay, scale=1.3)
    grads = ref.linear_attention_backward(do, q, k, v, causal, mask, decay, 1.3, mask_grad=mask is not None)
    wrt = [q, k, v] + ([mask] if mask is not None else [])
    assert len(grads) == len(wrt)
    for g, x in zip(grads, wrt):
        assert g.shape == x.shape
        num = _fd(x, lambda: _loss(do, **kw))
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", [c for c in CASES if c[7] is None], ids=[i for c, i in zip(CASES, IDS) if c[7] is None])
@pytest.mark.parametrize("chunk", [2, 3, 64])
def test_chunked_mirror_matches_reference(rng, case, chunk):
    q, k, v, _, decay = make(rng, *case)
    causal = case[6]
    do = rng.standard_normal(q.shape)
    o = ref.chunked_forward(q, k, v, causal, decay, 0.9, chunk=chunk)
    np.testing.assert_allclose(o, ref.linear_attention(q, k, v, causal, None, decay, 0.9), rtol=1e-11, atol=1e-12)
    for got, want in zip(ref.chunked_backward(do, q, k, v, causal, decay, 0.9, chunk=chunk),
                         ref.linear_attention_backward(do, q, k, v, causal, None, decay, 0.9)):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


def test_chunked_mirror_long_decay(rng):
    # Many chunks and small lambda: every power in the algorithm keeps a non-negative exponent.
    q, k, v, _, _ = make(rng, (1,), 2, 1, 37, 41, 3, True, None, False)
    decay = np.array([0.05, 0.97])
    o = ref.chunked_forward(q, k, v, True, decay, chunk=4)
    np.testing.assert_allclose(o, ref.linear_attention(q, k, v, True, None, decay), rtol=1e-11, atol=1e-12)


def test_mask_shapes_and_dtypes(rng):
    q, k, v, _, _ = make(rng, (2,), 2, 2, 4, 6, 3, False, None, False)
    m_bool = rng.uniform(size=(4, 6)) > 0.5
    o_bool = ref.linear_attention(q, k, v, mask=m_bool)
    o_float = ref.linear_attention(q, k, v, mask=m_bool.astype(np.float64))
    np.testing.assert_array_equal(o_bool, o_float)
    o_int = ref.linear_attention(q, k, v, mask=m_bool.astype(np.int8))
    np.testing.assert_array_equal(o_int, o_float)
    # an all-ones mask and causal=True give the plain causal result
    np.testing.assert_allclose(
        ref.linear_attention(q, k, v, causal=True, mask=np.ones((1, 1, 6))), ref.linear_attention(q, k, v, causal=True)
    )


def test_decay_one_is_plain_causal(rng):
    q, k, v, _, _ = make(rng, (1,), 2, 2, 5, 5, 3, True, None, False)
    np.testing.assert_allclose(
        ref.linear_attention(q, k, v, causal=True, decay=np.ones(2)), ref.linear_attention(q, k, v, causal=True)
    )


def test_sum_to_shape():
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5)
    assert ref.sum_to_shape(x, (4, 5)).shape == (4, 5)
    np.testing.assert_allclose(ref.sum_to_shape(x, (1, 3, 1, 5)), x.sum(axis=(0, 2), keepdims=True))
    np.testing.assert_allclose(ref.sum_to_shape(x, (3, 1, 1)), x.sum(axis=(0, 2, 3))[:, None, None])


# ---------------------------------------------------------------------------- argument checks


def _qkv(rng, dtype=np.float32):
    q, k, v, _, _ = make(rng, (2,), 4, 2, 5, 6, 8, False, None, False, dtype)
    return q, k, v


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        (dict(mask=np.ones((5, 7))), ValueError, "mask of shape (5, 7)"),
        (dict(mask=np.ones((3, 2, 4, 5, 6))), ValueError, "does not broadcast"),
        (dict(mask=np.ones((5, 6), dtype=np.complex64)), TypeError, "real dtype"),
        (dict(mask=[[1.0]]), TypeError, "mask must be a numpy.ndarray"),
        (dict(decay=np.full(4, 0.5)), ValueError, "decay needs causal=True"),
        (dict(causal=True, decay=np.full(2, 0.5)), ValueError, "decay must have shape (Hq,) = (4,)"),
        (dict(causal=True, decay=np.array([0.5, 0.5, 0.0, 0.5])), ValueError, "(0, 1]"),
        (dict(causal=True, decay=np.array([0.5, 1.5, 0.2, 0.5])), ValueError, "(0, 1]"),
        (dict(causal=True, decay=np.array([0.5, np.nan, 0.2, 0.5])), ValueError, "(0, 1]"),
        (dict(causal=True, decay=np.ones(4, dtype=bool)), TypeError, "decay must have a float"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(scale="2"), TypeError, "scale"),
        (dict(scale=float("inf")), ValueError, "scale must be finite"),
    ],
)
def test_forward_argument_errors(rng, kw, exc, words):
    q, k, v = _qkv(rng)
    for fn in (api.linear_attention, ref.linear_attention):
        with pytest.raises(exc) as e:
            fn(q, k, v, **kw)
        assert words in str(e.value)


def test_decay_as_host_sequence(rng):
    # A list or tuple of rates is host data, like a NumPy array; anything else is refused.
    q, k, v = _qkv(rng)
    lam = [0.9, 0.8, 0.95, 0.7]
    want = api.linear_attention(q, k, v, causal=True, decay=np.array(lam))
    for d in (lam, tuple(lam)):
        np.testing.assert_array_equal(api.linear_attention(q, k, v, causal=True, decay=d), want)
        do = rng.standard_normal(q.shape).astype(q.dtype)
        got = api.linear_attention_backward(do, q, k, v, causal=True, decay=d)
        for g, w in zip(got, api.linear_attention_backward(do, q, k, v, causal=True, decay=np.array(lam))):
            np.testing.assert_array_equal(g, w)
    with pytest.raises(TypeError, match="decay must be a numpy.ndarray or cupy.ndarray"):
        api.linear_attention(q, k, v, causal=True, decay=0.9)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        api.linear_attention(q, k, v, causal=True, decay=[0.9, 0.8, 1.5, 0.7])


def test_shape_and_dtype_errors(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="head dim of k"):
        api.linear_attention(q, k[..., :4], v[..., :4])
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        api.linear_attention(q[:, :3], k, v)
    with pytest.raises(TypeError, match="k.dtype must equal q.dtype"):
        api.linear_attention(q, k.astype(np.float16), v)
    with pytest.raises(TypeError, match="q.dtype must be one of"):
        api.linear_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    # the reference takes float64 (and returns it for every input dtype)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    assert ref.linear_attention(q64, k64, v64).dtype == np.float64
    assert ref.linear_attention(q, k, v).dtype == np.float64


def test_backward_argument_errors(rng):
    q, k, v = _qkv(rng)
    do = rng.standard_normal(q.shape).astype(np.float32)
    with pytest.raises(ValueError, match="mask_grad=True needs a mask"):
        api.linear_attention_backward(do, q, k, v, mask_grad=True)
    with pytest.raises(ValueError, match="mask_grad=True needs a mask"):
        api.linear_attention_vjp(q, k, v, mask_grad=True)
    with pytest.raises(TypeError, match="mask_grad must be a bool"):
        api.linear_attention_backward(do, q, k, v, mask=np.ones((5, 6)), mask_grad="yes")
    with pytest.raises(ValueError, match="do must have q's shape"):
        api.linear_attention_backward(do[..., :3, :], q, k, v)
    with pytest.raises(TypeError, match="do.dtype must equal q.dtype"):
        api.linear_attention_backward(do.astype(np.float16), q, k, v)
    with pytest.raises(TypeError, match="do must be a numpy.ndarray"):
        api.linear_attention_backward(do.tolist(), q, k, v)


# ---------------------------------------------------------------------------- NumPy backend


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_numpy_backend_rounds_reference(rng, dtype):
    dt = DTYPES[dtype]
    q, k, v, mask, decay = make(rng, (2,), 4, 2, 6, 9, 8, True, (4, 1, 9), True, dt)
    do = rng.standard_normal(q.shape).astype(dt)
    o = api.linear_attention(q, k, v, causal=True, mask=mask, decay=decay, scale=0.5)
    assert o.dtype == dt and o.shape == q.shape
    want = ref.linear_attention(q, k, v, True, mask, decay, 0.5)
    np.testing.assert_array_equal(o, want.astype(dt))
    grads = api.linear_attention_backward(do, q, k, v, True, mask, decay, 0.5, mask_grad=True)
    want = ref.linear_attention_backward(do, q, k, v, True, mask, decay, 0.5, mask_grad=True)
    for g, w, x in zip(grads[:3], want, (q, k, v)):
        assert g.dtype == dt and g.shape == x.shape
        np.testing.assert_array_equal(g, w.astype(dt))
    assert grads[3].shape == mask.shape and grads[3].dtype == np.float64  # a float mask keeps its dtype
    np.testing.assert_array_equal(grads[3], want[3])
    o2, vjp = api.linear_attention_vjp(q, k, v, True, mask, decay, 0.5, mask_grad=True)
    np.testing.assert_array_equal(o2, o)
    for a, b in zip(vjp(do), grads):
        np.testing.assert_array_equal(a, b)


def test_numpy_backend_defaults_and_bool_mask(rng):
    q, k, v = _qkv(rng)
    do = rng.standard_normal(q.shape).astype(np.float32)
    np.testing.assert_array_equal(api.linear_attention(q, k, v), api.linear_attention(q, k, v, scale=1.0))
    m = rng.uniform(size=(5, 6)) > 0.3
    *_, dm = api.linear_attention_backward(do, q, k, v, mask=m, mask_grad=True)
    assert dm.dtype == np.float32 and dm.shape == (5, 6)
    assert checks.dmask_dtype(ml_dtypes.bfloat16) == np.dtype(ml_dtypes.bfloat16)
    assert checks.dmask_dtype(np.int32) == np.float32


def test_empty_problems():
    q = np.zeros((2, 0, 4), np.float32)
    k = np.ones((2, 3, 4), np.float32)
    assert api.linear_attention(q, k, k).shape == (2, 0, 4)
    dq, dk, dv = api.linear_attention_backward(q, q, k, k)
    assert dq.shape == q.shape and not np.any(dk) and not np.any(dv)


def test_checks_live_apart_from_the_public_api():
    """The reference and the kernels import the checks, never the public API (no import circle)."""
    import ast
    import inspect

    from cupyflash import linear_reference
    from cupyflash.kernels import linear as kernels

    for mod in (linear_reference, kernels, checks):
        tree = ast.parse(inspect.getsource(mod))
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any(m.endswith("linear_api") for m in imported), (mod.__name__, imported)
    assert set(api.__all__) == {"linear_attention", "linear_attention_forward", "linear_attention_backward",
                                "linear_attention_vjp"}


# ---------------------------------------------------------------------------- plans


def geom(**kw):
    base = dict(batch=2, hq=4, hk=2, nq=100, nk=130, d=64, causal=True, ctype="__half")
    base.update(kw)
    return plans.LinearGeometry(**base)


def test_column_blocks():
    assert [plans.column_block(d) for d in (1, 40, 64, 65, 128, 256)] == [64, 64, 64, 128, 128, 128]
    with pytest.raises(ValueError):
        plans.column_block(0)


def test_chunked_plan_causal():
    g = geom()
    fwd = plans.chunked_plan(g, rev=False)
    assert fwd.state_chunks == fwd.out_chunks == 3  # positions 0..129 in chunks of 64
    assert fwd.state.grid == (2 * 4 * 3, 1, 1) and fwd.state.name == "linear_chunk_state<__half, 64, false>"
    assert fwd.scan.grid == (2 * 4 * 16, 1, 1) and fwd.scan_mode == plans.SCAN_FORWARD
    assert fwd.out.grid == (2 * 4 * 3, 1, 1)
    assert fwd.state_shape == (8, 3, 64, 64) and fwd.state_chunk_stride == 64 * 64
    rev = plans.chunked_plan(g, rev=True)
    assert rev.scan_mode == plans.SCAN_REVERSE and rev.out.grid == (2 * 2 * 3, 1, 1)  # one block per kv head
    for plan in (fwd.state, fwd.scan, fwd.out, rev.out):
        assert isinstance(plan, LaunchPlan) and plan.block == (256, 1, 1) and plan.shared_bytes == 0


def test_chunked_plan_noncausal_and_wide_heads():
    g = geom(causal=False, d=256, ctype="float")
    fwd = plans.chunked_plan(g, rev=False)
    assert fwd.state_chunks == 3 and fwd.out_chunks == 2  # keys for the state, queries for the output
    assert fwd.scan_mode == plans.SCAN_TOTAL and fwd.state_chunk_stride == 0
    assert fwd.state.grid == (2 * 4 * 3, 4 * 2, 1)  # 4 row blocks x 2 column blocks of D = 256
    assert fwd.out.grid == (2 * 4 * 2, 2, 1) and fwd.out.name == "linear_chunk_out<float, 128, false>"
    rev = plans.chunked_plan(g, rev=True)
    assert rev.state_chunks == 2 and rev.out_chunks == 3


def test_masked_plan():
    g = geom(d=96, ctype="__nv_bfloat16", tc=True)
    p = plans.masked_plan(g, rev=False, dmask=True)
    assert p.name == "linear_masked<__nv_bfloat16, 128, true, true>" and p.grid == (2 * 4 * 2, 1, 1)
    assert plans.masked_plan(g, rev=True).grid == (2 * 2 * 3, 1, 1)
    with pytest.raises(ValueError):
        plans.masked_plan(g, rev=True, dmask=True)


def test_tensor_core_choice():
    assert plans.use_tensor_cores("__half", 80) and plans.use_tensor_cores("__nv_bfloat16", 90)
    assert not plans.use_tensor_cores("float", 90)  # TF32 would miss float32's 1e-5 bound
    assert not plans.use_tensor_cores("__half", 75)  # no TF32 mma.sync before sm_80
    with pytest.raises(ValueError):
        geom(ctype="float", tc=True)
    with pytest.raises(ValueError):
        plans.chunked_plan(geom(tc=True), rev=False)  # 16-bit tensor cores take the fused walk


def test_fused_plan():
    from cupyflash.plans import A100, H100, RTX4090

    g = geom(tc=True)  # 3 chunks: too few to split; three stages still let two blocks share an SM
    fp = plans.fused_plan(g, rev=False, limits=H100)
    assert fp.launch.name == "linear_fused_walk<__half, 64, 64, 3>" and fp.launch.grid == (2 * 4, 1, 1)
    assert fp.launch.block == (128, 1, 1) and fp.launch.shared_bytes == plans.fused_shared_bytes(64, 64, 3)
    assert fp.segments == 1 and fp.state is None
    assert plans.fused_plan(g, rev=True, limits=H100).launch.grid == (2 * 2, 1, 1)  # one block per kv head
    big = geom(batch=4, hq=16, hk=16, nq=8192, nk=8192, d=128, ctype="__nv_bfloat16", tc=True)
    fp = plans.fused_plan(big, rev=False, limits=RTX4090)
    assert (fp.dk, fp.dv, fp.stages) == (128, 64, 1)  # 99 KB: two stages of DK = 128, DV = 64 do not fit
    assert plans.fused_plan(big, rev=False, limits=H100).stages == 2
    assert plans.fused_shared_bytes(128, 64, 2) == 2 * (2 * (2 * 64 * 136 + 64 * 72) + 128 * 72) + 4 * 68
    wide = geom(d=200, ctype="__nv_bfloat16", tc=True)
    assert plans.fused_plan(wide, rev=False, limits=A100).launch.name == "linear_fused_walk<__nv_bfloat16, 256, 32, 2>"
    assert plans.fused_plan(wide, rev=False, limits=RTX4090).stages == 1
    assert [plans.fused_dk(d) for d in (1, 64, 65, 128, 129, 256)] == [64, 64, 128, 128, 256, 256]
    with pytest.raises(ValueError):
        plans.fused_plan(wide, rev=False, limits=H100, dv=64)  # no DK = 256, DV = 64 tile
    with pytest.raises(ValueError):
        plans.fused_plan(geom(ctype="float"), rev=False, limits=H100)
    with pytest.raises(ValueError):
        plans.fused_plan(big, rev=False, limits=H100, stages=3)  # three stages only at DK = 64


def test_fused_segments_plan():
    from cupyflash.plans import H100

    long = geom(batch=1, hq=16, hk=16, nq=32768, nk=32768, d=64, ctype="__nv_bfloat16", tc=True)
    fp = plans.fused_plan(long, rev=False, limits=H100)  # 16 blocks: 16 segments of 32 chunks
    assert (fp.dv, fp.segments, fp.seg_len) == (64, 16, 32) and fp.launch.grid == (16, 1, 16)
    # 15 segments x 16 heads = 240 state blocks: one slot per segment already fills 3 x 132
    assert fp.state is not None and fp.state.grid == (16, 1, 15) and fp.u_shape == (1, 16, 15, 1, 64 * 64)
    assert (fp.sub_len, fp.slots) == (32, 15)
    assert fp.state.name == "linear_fused_state<__nv_bfloat16, 64, 64, 2>"
    assert fp.state.shared_bytes == plans.fused_state_bytes(64, 64, 2) == 2 * 2 * (64 * 72 + 64 * 72) + 4 * 68
    full = geom(batch=4, hq=16, hk=16, nq=8192, nk=8192, d=128, ctype="__nv_bfloat16", tc=True)
    fp = plans.fused_plan(full, rev=False, limits=H100)  # 128 blocks -> 256 (2 per SM)
    assert (fp.segments, fp.seg_len) == (2, 66) and fp.launch.grid == (64, 2, 2)
    # the first segment's state in 3 slots of 22 chunks: 3 x 128 state blocks, one wave of 3 per SM
    assert (fp.sub_len, fp.slots) == (22, 3) and fp.state.grid == (64, 2, 3)
    assert plans.fused_plan(full, rev=False, limits=H100, dv=32).segments == 1  # 256 blocks already
    gqa = geom(tc=True)  # 3 chunks: forced segments clamp to the chunks, reverse GQA never splits
    assert plans.fused_plan(gqa, rev=False, limits=H100, segments=5).segments == 3
    assert plans.fused_plan(gqa, rev=True, limits=H100, segments=5).segments == 1
    assert plans.fused_plan(geom(tc=True, causal=False), rev=False, limits=H100, segments=4).segments == 1
    fp = plans.fused_plan(geom(tc=True, nk=300), rev=False, limits=H100, segments=3)  # 5 chunks: 2 + 2 + 1
    assert (fp.segments, fp.seg_len, fp.sub_len, fp.slots) == (3, 2, 1, 4)  # few blocks: 1-chunk slots
    fp = plans.fused_plan(geom(tc=True, nk=300), rev=False, limits=H100, segments=2)  # 3 + 2, slots of 1
    assert (fp.segments, fp.seg_len, fp.sub_len, fp.slots) == (2, 3, 1, 3) and fp.state.grid == (2 * 4, 1, 3)
    seg = plans.fused_plan(geom(batch=4, hq=16, hk=16, nq=4096, nk=4096, tc=True), rev=False, limits=H100)
    # 64 chunks, 64 blocks -> 4 segments of 16; 3 x 132 // (64 x 3) = 2 slots of 8 per segment
    assert (seg.segments, seg.seg_len, seg.sub_len, seg.slots) == (4, 16, 8, 6)


def test_geometry_checks():
    with pytest.raises(ValueError):
        geom(nq=0)
    with pytest.raises(ValueError):
        geom(hq=3)
    assert geom().off == 30 and geom().group == 2


def test_instantiation_list():
    from cupyflash.kernels import linear

    inst = linear.instantiations()
    # scan; float: FFMA, 2 DV x (state, out, masked x 2); 16-bit types: the same FFMA set, TF32 masked
    # (2 DV x 2), the fused walk (3 DK = 64 tiles x 3 ring depths, 4 wider tiles x 2) and its
    # state-only kernel (7 tiles x 2 ring depths)
    assert len(inst) == len(set(inst)) == 1 + 8 + 2 * (8 + 4 + 17 + 14)
    assert ("linear_masked.cu", "linear_masked<float, 64, false, true>") in inst
    assert ("linear_masked.cu", "linear_masked<__half, 128, true, false>") in inst
    assert ("linear_fused.cu", "linear_fused_walk<__nv_bfloat16, 128, 64, 2>") in inst
    assert ("linear_fused.cu", "linear_fused_state<__half, 64, 64, 2>") in inst
    assert ("linear_chunked.cu", "linear_chunk_out<__nv_bfloat16, 128, true>") not in inst
    for _, name in inst:
        assert "<float" not in name or not ("fused" in name or ("true>" in name and "masked" not in name))


# ---------------------------------------------------------------------------- compile (no GPU)


def _nvrtc_reason():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
        return None
    except Exception as e:  # pragma: no cover - depends on the machine
        return f"NVRTC unavailable ({type(e).__name__})"


def _compile(job):
    from cupyflash.kernels.build import CompileError, nvrtc_compile

    source, name, arch = job
    try:
        return nvrtc_compile(source, name, arch)
    except CompileError as e:
        return str(e)


@pytest.fixture(scope="module")
def compiled():
    from cupyflash.kernels import linear

    jobs = [(s, n, a) for s, n in linear.instantiations() for a in ("sm_80", "sm_90a")]
    with ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        return dict(zip(jobs, pool.map(_compile, jobs)))


@pytest.mark.skipif(_nvrtc_reason() is not None, reason=str(_nvrtc_reason()))
def test_every_linear_kernel_compiles_without_spills(compiled):
    bad = []
    for (source, name, arch), res in compiled.items():
        if isinstance(res, str):
            bad.append(res)
        elif res.spills or res.stack_frame > 0:
            bad.append(res.line())
    assert not bad, "\n".join(bad)
    assert len(compiled) == 2 * 95
