"""GPU accuracy of every attention kernel family against the float64 NumPy reference.

Each test reaches a family explicitly (``kernel=...`` through the public API, or the
family's ``forward``/``backward`` with outputs poisoned by NaN), on fresh random inputs.
Bounds (ARCHITECTURE.md, "What correct means"): float32 1e-5 (o) / 1e-4 (grads); float16/bfloat16 no worse than
2x PyTorch SDPA's error on the same inputs where torch is importable, else fixed bounds.
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

HEAD_DIMS = [16, 32, 40, 64, 80, 96, 128, 160, 192, 256]
SEQ_LENS = [1, 17, 128, 1000]




def family_cases():
    """(kernel, dtype name) pairs each family supports."""
    return (
        [("portable", d) for d in DTYPES]
        + [("mma", "float16"), ("mma", "bfloat16")]
        + [pytest.param("wgmma", t, marks=_needs_hopper) for t in ("float16", "bfloat16")]
    )


def grid_cases():
    """(kernel, dtype name, head dim) for the accuracy grid: wgmma takes 32 < D <= 128 only."""
    out = []
    for case in family_cases():
        values = case.values if hasattr(case, "values") else case
        marks = case.marks if hasattr(case, "marks") else ()
        for d in HEAD_DIMS:
            if values[0] != "wgmma" or 32 < d <= 128:
                out.append(pytest.param(*values, d, marks=marks))
    return out


def _torch_errors(q, k, v, do, causal, scale, ref):
    """SDPA's relative errors (o, dq, dk, dv) on the same inputs, or None without torch.

    The mask is passed explicitly when Nq != Nk, since SDPA's is_causal is top-left aligned.
    """
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    hq, hk = q.shape[-3], k.shape[-3]
    t = [torch.from_dlpack(cupy.asarray(x)).requires_grad_(True) for x in (q, k, v)]
    nq, nk = q.shape[-2], k.shape[-2]
    kw = {"scale": scale}
    if hq != hk:
        kw["enable_gqa"] = True
    if causal and nq == nk:
        kw["is_causal"] = True
    elif causal:
        i = torch.arange(nq, device="cuda")[:, None]
        j = torch.arange(nk, device="cuda")[None, :]
        kw["attn_mask"] = j <= i + (nk - nq)
    try:
        o = torch.nn.functional.scaled_dot_product_attention(*t, **kw)
        o.backward(torch.from_dlpack(cupy.asarray(do)))
    except RuntimeError:
        return None
    outs = [o.detach()] + [x.grad for x in t]
    errs = [rel_err(x.float().cpu().numpy(), r) for x, r in zip(outs, ref)]
    return None if any(not np.isfinite(e) for e in errs) else errs


def _bounds(dtype_name, torch_errs):
    fixed = [TOL_OUT[dtype_name]] + [TOL_GRAD[dtype_name]] * 3
    if dtype_name == "float32" or torch_errs is None:
        return fixed
    return [2 * e for e in torch_errs]


def _poisoned(shape, dtype):
    return cupy.full(shape, np.nan, dtype=dtype)


def run_family(kernel, q, k, v, do, causal, scale, bwd_config=None):
    """Forward and backward through one family, outputs NaN-poisoned first."""
    from cupyflash.kernels import dispatch
    from cupyflash.plans import DeviceLimits

    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    p = check_attention(qd, kd, vd, causal=causal, scale=scale)
    fam = dispatch.families()[kernel]
    assert fam.supports(p, DeviceLimits.current()) is None
    o = _poisoned(qd.shape, qd.dtype)
    lse = _poisoned(qd.shape[:-1], np.float32)
    fam.forward(qd, kd, vd, o, lse, p)
    dq, dk, dv = _poisoned(qd.shape, qd.dtype), _poisoned(kd.shape, kd.dtype), _poisoned(vd.shape, vd.dtype)
    if bwd_config is None:
        fam.backward(dod, qd, kd, vd, o, lse, dq, dk, dv, p)
    else:
        fam.backward(dod, qd, kd, vd, o, lse, dq, dk, dv, p, config=bwd_config)
    return [x.get() for x in (o, lse, dq, dk, dv)]


def check_case(kernel, dtype_name, b, hq, hk, nq, nk, d, causal, rng, scale=None, logits=1.0, bwd_config=None):
    dtype = DTYPES[dtype_name]
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, dtype, logits)
    do = rng.standard_normal(q.shape).astype(dtype)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    o, lse, dq, dk, dv = run_family(kernel, q, k, v, do, causal, scale, bwd_config)
    ro, rlse = reference.attention_forward(q, k, v, causal, scale)
    rdq, rdk, rdv = reference.attention_backward(do, q, k, v, ro, rlse, causal, scale)
    ref = [ro, rdq, rdk, rdv]
    bounds = _bounds(dtype_name, _torch_errors(q, k, v, do, causal, scale, ref) if dtype_name != "float32" else None)
    errs = [rel_err(x, r) for x, r in zip((o, dq, dk, dv), ref)]
    names = ["o", "dq", "dk", "dv"]
    if nk == 1:
        # One key: P = 1 and dP = Delta, so dS = 0 and dQ, dK are exactly zero; the float64
        # reference holds only rounding noise, where a relative error means nothing. Check
        # that dQ and dK are tiny instead, and o and dV against the reference as usual.
        for name, g in (("dq", dq), ("dk", dk)):
            assert np.abs(g.astype(np.float64)).max() <= TOL_GRAD[dtype_name], f"{kernel} {dtype_name} {name} not ~0"
        names, errs, bounds = names[::3], errs[::3], bounds[::3]
    for name, e, bound in zip(names, errs, bounds):
        assert e <= bound, f"{kernel} {dtype_name} {name}: rel err {e:.3g} > {bound:.3g}"
    # lse: -inf exactly where the reference has it, close elsewhere.
    masked = np.isneginf(rlse)
    assert np.array_equal(np.isneginf(lse), masked)
    assert np.allclose(lse[~masked], rlse[~masked], rtol=1e-5 if dtype_name == "float32" else 2e-3, atol=1e-4)
    if masked.any():  # rows that see no key: o = 0 and zero dq, never NaN
        assert np.all(o[masked] == 0) and np.all(dq[masked] == 0)


@pytest.mark.parametrize("kernel,dtype_name,d", grid_cases())
@pytest.mark.parametrize("n", SEQ_LENS)
def test_accuracy_grid(kernel, dtype_name, d, n, rng):
    causal = (n + d) % 2 == 0  # half the grid causal, spread over N and D
    check_case(kernel, dtype_name, 1, 2, 2, n, n, d, causal, rng)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq,nk", [(100, 300), (300, 100), (1, 257), (257, 1), (64, 65)])
def test_unequal_lengths(kernel, dtype_name, nq, nk, causal, rng):
    check_case(kernel, dtype_name, 2, 2, 2, nq, nk, 64, causal, rng)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
@pytest.mark.parametrize("hq,hk", [(8, 2), (4, 1)])
def test_gqa_mqa(kernel, dtype_name, hq, hk, rng):
    check_case(kernel, dtype_name, 2, hq, hk, 200, 150, 128, True, rng)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_large_logits(kernel, dtype_name, rng):
    check_case(kernel, dtype_name, 1, 2, 2, 300, 300, 64, False, rng, scale=10.0)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_fully_masked_rows(kernel, dtype_name, rng):
    # Nq > Nk with the bottom-right causal mask: the first Nq - Nk rows see no key.
    check_case(kernel, dtype_name, 1, 3, 1, 150, 40, 64, True, rng)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_mma_backward_fallback_tiles(dtype_name, causal, rng):
    """The smaller backward tiles that 99 KB parts (RTX 4090) get, forced on this GPU."""
    from cupyflash.plans.mma import BACKWARD_FALLBACKS

    for d, cfg in BACKWARD_FALLBACKS.items():
        check_case("mma", dtype_name, 2, 4, 2, 333, 517, d, causal, rng, bwd_config=cfg)


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_forward_bit_identical(kernel, dtype_name, rng):
    dtype = DTYPES[dtype_name]
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (2,), 4, 2, 333, 517, 96, dtype))
    o1, l1 = cupyflash.attention_forward(q, k, v, causal=True, kernel=kernel)
    o2, l2 = cupyflash.attention_forward(q, k, v, causal=True, kernel=kernel)
    assert o1.tobytes() == o2.tobytes() and l1.tobytes() == l2.tobytes()


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_strided_views_without_copy(kernel, dtype_name, rng, monkeypatch):
    """A (B, N, H, D) array seen as (B, H, N, D), and a batch slice that cannot merge."""
    dtype = DTYPES[dtype_name]
    bnhd = [cupy.asarray(rng.standard_normal((6, 2, 130, 4, 64)).astype(dtype)) for _ in range(3)]
    q, k, v = (x[::2].transpose(0, 1, 3, 2, 4) for x in bnhd)  # batch (3, 2): strides don't merge
    do = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))

    def no_copy(*a, **kw):
        raise AssertionError("a strided view was copied")

    with monkeypatch.context() as m:
        m.setattr(cupy, "ascontiguousarray", no_copy)
        o, lse = cupyflash.attention_forward(q, k, v, causal=True, kernel=kernel)
    dq, dk, dv = cupyflash.attention_backward(do, q, k, v, o, lse, causal=True, kernel=kernel)
    host = [x.get() for x in (q, k, v, do)]
    ro, rlse = reference.attention_forward(*host[:3], True)
    rgrads = reference.attention_backward(host[3], *host[:3], ro, rlse, True)
    assert rel_err(o.get(), ro) <= TOL_OUT[dtype_name]
    for g, r in zip((dq, dk, dv), rgrads):
        assert rel_err(g.get(), r) <= TOL_GRAD[dtype_name]


@pytest.mark.parametrize("kernel,dtype_name", family_cases())
def test_non_default_stream(kernel, dtype_name, rng):
    """Capturing a CUDA graph on a stream fails if any work goes to another stream."""
    dtype = DTYPES[dtype_name]
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (1,), 4, 4, 257, 257, 64, dtype))
    do = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        # Warm-up outside the capture: compiles, and leaves freed blocks in the pool so the
        # captured calls allocate nothing new.
        o, lse = cupyflash.attention_forward(q, k, v, causal=True, kernel=kernel)
        cupyflash.attention_forward(q, k, v, causal=True, kernel=kernel)
        cupyflash.attention_backward(do, q, k, v, o, lse, causal=True, kernel=kernel)
        stream.begin_capture()
        o2, lse2 = cupyflash.attention_forward(q, k, v, causal=True, kernel=kernel)
        dq, dk, dv = cupyflash.attention_backward(do, q, k, v, o2, lse2, causal=True, kernel=kernel)
        graph = stream.end_capture()
        o2.fill(np.nan)
        dq.fill(np.nan)
        graph.launch()
    stream.synchronize()
    assert o2.tobytes() == o.tobytes()
    host = [x.get() for x in (q, k, v, do)]
    ro, rlse = reference.attention_forward(*host[:3], True)
    rdq = reference.attention_backward(host[3], *host[:3], ro, rlse, True)[0]
    assert rel_err(dq.get(), rdq) <= TOL_GRAD[dtype_name]


def test_dispatch_auto_and_explicit(rng):
    from cupyflash.kernels import dispatch
    from cupyflash.plans import DeviceLimits

    lim = DeviceLimits.current()
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (1,), 2, 2, 64, 64, 64, DTYPES["float16"]))
    p = check_attention(q, k, v)
    expected = "wgmma" if lim.compute_capability == 90 else "mma" if lim.compute_capability >= 80 else "portable"
    assert dispatch.select(p, lim).NAME == expected
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    # float32 runs on the mma family (3xTF32) on sm_80+ up to D = 128, on the portable one past it or below sm_80
    assert dispatch.select(check_attention(q32, k32, v32), lim).NAME == ("mma" if lim.compute_capability >= 80
                                                                         else "portable")
    wide = cupy.asarray(rng.standard_normal((1, 2, 64, 136)).astype(np.float32))
    assert dispatch.select(check_attention(wide, wide, wide), lim).NAME == "portable"
    with pytest.raises(TypeError, match="mma" if lim.compute_capability < 80 else "D <= 128"):
        cupyflash.attention(wide, wide, wide, kernel="mma")


def test_empty_and_keyless(rng):
    dtype = DTYPES["float32"]
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (2,), 2, 2, 5, 0, 32, dtype))
    o, lse = cupyflash.attention_forward(q, k, v)
    assert o.shape == q.shape and bool(cupy.all(o == 0)) and bool(cupy.all(cupy.isneginf(lse)))
    q0 = cupy.asarray(rng.standard_normal((2, 2, 0, 32)).astype(dtype))
    o0, lse0 = cupyflash.attention_forward(q0, k, v)
    assert o0.shape == (2, 2, 0, 32) and lse0.shape == (2, 2, 0)


def test_mixing_numpy_and_cupy_is_type_error(rng):
    q, k, v = random_qkv(rng, (1,), 2, 2, 8, 8, 16, DTYPES["float32"])
    with pytest.raises(TypeError, match="all be NumPy or all be CuPy"):
        cupyflash.attention(q, cupy.asarray(k), v)
