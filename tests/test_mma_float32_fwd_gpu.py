"""GPU: the mma family's float32 forward (every product as 3xTF32 on tensor cores, cuda_src/mma_tf32.cuh) against the
float64 reference, reached explicitly (``kernel="mma"``, or the family's entry point).

Each case runs on fresh random inputs into NaN-poisoned o and lse (the entry point's given outputs; the API's
outputs through a poisoned memory pool) and asks (DESIGN.md 4):

- o: relative error ||o - o_ref|| / ||o_ref|| <= 1e-5;
- lse: -inf exactly where the reference has it, elsewhere within rtol 1e-5 and atol 1e-5 elementwise;
- rows that see no key: o = 0.

The cases are chosen to need few kernels (each is an NVRTC compile of several seconds): the plain and causal
kernels of every float32 tile (D = 32, 40, 64, 96, 128: padded 32, 64, 96, 128), then one kernel per other policy.
``python benchmarks/dev_mma_f32.py --warm`` compiles them all in parallel first (CuPy's disk cache).
D = 59 and D = 192 are refused by kernel="mma" with the family's reason (rows of 59 floats are not 16-byte
multiples; float32 on tensor cores stops at D = 128) and run on the portable family under "auto".
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import HAS_GPU, rel_err, requires_gpu
from test_variants_gpu import visible_mask
from test_varlen_gpu import make_pack, poison_pool

import cupyflash
from cupyflash import reference
from cupyflash.validation import check_attention

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

_SM80 = HAS_GPU and int(cupy.cuda.Device().compute_capability) >= 80
pytestmark.append(pytest.mark.skipif(not _SM80, reason="the mma family needs compute capability 8.0 or newer"))

TOL = 1e-5
F32 = np.float32


def _mma():
    from cupyflash.kernels import dispatch

    return dispatch.families()["mma"]


def _qkv(rng, b, hq, hk, nq, nk, d):
    return [rng.standard_normal(s).astype(F32) for s in ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d))]


def run_forward(q, k, v, causal=False, scale=None, seed=None, config=None, **kw):
    """The mma family's forward of host arrays into NaN-poisoned o and lse; host results."""
    from cupyflash.plans import DeviceLimits

    dev = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    p = check_attention(qd, kd, vd, causal=causal, scale=scale, **dev)
    assert _mma().supports(p, DeviceLimits.current()) is None
    arrays = {n: dev[a] for n, a in (("alibi", "alibi_slopes"), ("sinks", "sinks"), ("mask", "mask"),
                                     ("bias", "bias")) if dev.get(a) is not None}  # fmt: skip
    o = cupy.full(q.shape, np.nan, F32)
    lse = cupy.full(q.shape[:-1], np.nan, F32)
    options = {} if seed is None else {"dropout_seed": seed}
    if config is not None:
        options["config"] = config
    _mma().forward(qd, kd, vd, o, lse, p, variant_arrays=arrays, **options)
    return o.get(), lse.get()


def assert_forward_close(o, lse, ro, rlse, keyless=None):
    assert np.isfinite(o).all(), "o has NaN/inf (an element left unwritten?)"
    assert not np.isnan(lse).any() and not np.isposinf(lse).any(), "lse has NaN/+inf"
    masked = np.isneginf(rlse)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    if (~masked).any():
        # Elementwise, as tests/test_gpu_attention.py: a norm-relative bound is ill-conditioned where lse is near 0
        # (one key: lse is that key's score; measured 3e-7 off at lse = 0.0187).
        np.testing.assert_allclose(lse[~masked], rlse[~masked], rtol=TOL, atol=TOL)
    e = rel_err(o, ro)
    assert e <= TOL, f"o: rel err {e:.3g}"
    if keyless is not None and keyless.any():
        assert np.all(o[..., keyless, :] == 0)


def check(rng, shape, d, causal=False, scale=None, logits=1.0, window=None, **kw):
    """Forward of fresh inputs of shape (B, Hq, Hk, Nq, Nk) x d against the reference."""
    b, hq, hk, nq, nk = shape
    q, k, v = _qkv(rng, b, hq, hk, nq, nk, d)
    q = (q * F32(logits)).astype(F32)
    if window is not None:
        kw["window_size"] = window
    o, lse = run_forward(q, k, v, causal, scale, **kw)
    ro, rlse = reference.attention_forward(q, k, v, causal, scale, **kw)
    keyless = None if kw.get("mask") is not None else ~visible_mask(nq, nk, causal, window).any(axis=1)
    assert_forward_close(o, lse, ro, rlse, keyless)


# ---------------------------------------------------------------------------- shapes: plain and causal kernels

HEAD_DIMS = [32, 40, 64, 96, 128]  # 40: padded to 64, columns past d zero-filled and never stored
SHAPES = [(1, 1, 1, 1, 1), (2, 2, 2, 17, 17), (1, 4, 2, 100, 333), (2, 3, 1, 333, 100), (1, 2, 2, 1000, 1000),
          (1, 2, 1, 1, 1000), (1, 2, 2, 1000, 1)]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_shapes(d, causal, rng):
    """Odd lengths, Nq != Nk both ways (causal: bottom-right aligned, keyless rows when Nq > Nk), GQA and MQA."""
    for shape in SHAPES:
        check(rng, shape, d, causal)


def _table_and_small_grid_tiles():
    from cupyflash.plans import mma as plans

    return [plans.FORWARD_CONFIGS_F32[64], plans.SMALL_GRID_FORWARD_F32[64], plans.FORWARD_CONFIGS_F32[128]]


@pytest.mark.parametrize("cfg", _table_and_small_grid_tiles(), ids=lambda c: f"d{c.d}-br{c.br}-bc{c.bc}-w{c.warps}")
@pytest.mark.parametrize("causal", [False, True])
def test_table_and_small_grid_tiles(cfg, causal, rng):
    """The tables' tiles and the small-grid one forced, whichever the plan would pick for the shape
    (plans.mma.small_grid: the shapes above are small grids): odd lengths, Nq != Nk both ways, GQA, D below the
    padded one."""
    for shape in ((1, 4, 2, 100, 333), (2, 3, 1, 333, 100), (1, 2, 2, 1000, 1000)):
        for d in (cfg.d, cfg.d - 8):
            b, hq, hk, nq, nk = shape
            q, k, v = _qkv(rng, b, hq, hk, nq, nk, d)
            o, lse = run_forward(q, k, v, causal, config=cfg)
            ro, rlse = reference.attention_forward(q, k, v, causal)
            keyless = ~visible_mask(nq, nk, causal, None).any(axis=1)
            assert_forward_close(o, lse, ro, rlse, keyless)


@pytest.mark.parametrize("d", [64, 128])
def test_large_logits(d, rng):
    check(rng, (1, 2, 2, 300, 300), d, True, scale=10.0)
    check(rng, (1, 2, 2, 300, 300), d, False, logits=4.0)


def test_gqa(rng):
    check(rng, (2, 8, 2, 200, 150), 128, True)
    check(rng, (1, 4, 1, 150, 200), 64, False)


def test_strided_views(rng):
    """(B, N, H, D) memory seen as (B, H, N, D) without a copy: the entry point into poisoned outputs, and the API
    (kernel="mma") bit for bit the same."""
    q, k, v = (rng.standard_normal((2, 130, 4, 64)).astype(F32) for _ in range(3))
    qd, kd, vd = (cupy.asarray(x).transpose(0, 2, 1, 3) for x in (q, k, v))
    p = check_attention(qd, kd, vd, causal=True)
    o = cupy.full(qd.shape, np.nan, F32)
    lse = cupy.full(qd.shape[:-1], np.nan, F32)
    _mma().forward(qd, kd, vd, o, lse, p)
    ro, rlse = reference.attention_forward(*(x.transpose(0, 2, 1, 3) for x in (q, k, v)), True)
    assert_forward_close(o.get(), lse.get(), ro, rlse)
    o2, lse2 = cupyflash.attention_forward(qd, kd, vd, True, kernel="mma")
    assert o2.get().tobytes() == o.get().tobytes() and lse2.get().tobytes() == lse.get().tobytes()


# ---------------------------------------------------------------------------- variants: one kernel each


def test_window_softcap_alibi_sinks(rng):
    """Window + softcap (accurate tanh in float32) + ALiBi per batch and head + sinks, GQA, Nq < Nk and Nq > Nk."""
    for d, (b, hq, hk, nq, nk) in ((64, (2, 4, 2, 180, 220)), (128, (2, 4, 1, 230, 90))):
        kw = dict(window=(32, 8), softcap=30.0, alibi_slopes=rng.uniform(0.01, 0.3, (b, hq)).astype(F32),
                  sinks=rng.uniform(-1.0, 2.5, hq).astype(F32))  # fmt: skip
        check(rng, (b, hq, hk, nq, nk), d, **kw)


def test_window_alone(rng):
    check(rng, (2, 2, 1, 200, 77), 32, window=(0, 0))
    check(rng, (1, 4, 2, 77, 300), 32, window=(31, -1))


def test_causal_softcap(rng):
    check(rng, (1, 2, 2, 150, 300), 96, causal=True, softcap=50.0)
    check(rng, (1, 2, 2, 160, 160), 96, causal=True, softcap=30.0, scale=1.0)  # scores reach the cap


def test_mask_and_bias(rng):
    b, hq, hk, nq, nk = 2, 4, 2, 150, 230
    mask = rng.random((b, 1, nq, nk)) > 0.3
    mask[:, :, 7] = False  # a row that sees no key: o = 0, lse = -inf
    bias = rng.standard_normal((1, hq, nq, nk)).astype(F32)
    check(rng, (b, hq, hk, nq, nk), 64, True, mask=mask, bias=bias)
    check(rng, (b, hq, hk, nq, nk), 64, True, bias=bias)


def test_dropout(rng):
    """Against the reference with dropout_mask's keep mask for the same seed (lse stays undropped)."""
    b, hq, hk, nq, nk = 2, 4, 2, 190, 270
    q, k, v = _qkv(rng, b, hq, hk, nq, nk, 64)
    seed = int(rng.integers(0, 2**62))
    o, lse = run_forward(q, k, v, False, dropout_p=0.17, seed=seed)
    ro, rlse = reference.attention_forward(q, k, v, False, dropout_p=0.17, dropout_seed=seed)
    assert_forward_close(o, lse, ro, rlse)


def test_varlen(rng):
    """A pack with empty sequences on either side, causal, sinks (the causal D = 64 kernel, per-sequence rows)."""
    case = ("mixed", [0, 1, 77, 300, 5, 129], [3, 1, 90, 300, 0, 140], 4, 2, dict(causal=True, sinks=True))
    q, k, v, _, packing, causal, scale, kw = make_pack(rng, "float32", case, 64)
    hq, tq = q.shape[1], q.shape[0]
    pk = (cupy.asarray(packing[0]), cupy.asarray(packing[1]), packing[2], packing[3])
    dev = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    poison_pool((q.shape, q.dtype), ((hq, tq), F32), ((q.size + hq * tq + 256,), F32))  # apart, or o and lse in one
    o, lse = cupyflash.attention_varlen_forward(*(cupy.asarray(x) for x in (q, k, v)), *pk, causal, scale,
                                                kernel="mma", **dev)  # fmt: skip
    ro, rlse = reference.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    assert_forward_close(o.get(), lse.get(), ro, rlse)


# ---------------------------------------------------------------------------- dispatch and determinism


def test_repeated_runs_are_bit_identical(rng):
    q, k, v = _qkv(rng, 2, 4, 2, 333, 517, 64)
    first = run_forward(q, k, v, True)
    for _ in range(3):
        again = run_forward(q, k, v, True)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))


def test_refusals_and_auto(rng):
    """kernel="mma" refuses D = 192 and D = 59 with the reason, and "auto" runs them on the portable family; "auto"
    runs float32 D = 64 on this family, forward and backward."""
    from cupyflash.kernels import dispatch
    from cupyflash.plans import DeviceLimits

    lim = DeviceLimits.current()
    for d, why in ((192, "float32 on tensor cores needs D <= 128"), (59, "multiple of 8")):
        q, k, v = (cupy.asarray(x) for x in _qkv(rng, 1, 2, 2, 8, 8, d))
        with pytest.raises(TypeError, match=why):
            cupyflash.attention(q, k, v, kernel="mma")
        assert dispatch.select(check_attention(q, k, v), lim).NAME == "portable"
    q, k, v = (cupy.asarray(x) for x in _qkv(rng, 1, 2, 2, 8, 8, 64))
    assert dispatch.select(check_attention(q, k, v), lim).NAME == "mma"


@pytest.mark.parametrize("shape, causal", [((1, 2, 1, 8192, 300), False), ((1, 4, 1, 4096, 500), True)])
def test_past_4096_query_rows(shape, causal, rng):
    """float32 runs here up to (Hq / Hk) x Nq = 16384 since the backward splits long query ranges (query parts);
    the forward sums P V a key tile at a time, so its error does not grow with Nq."""
    check(rng, shape, 64, causal)


def test_auto_takes_float32_up_to_16384_query_rows_a_kv_head(rng):
    from cupyflash.kernels import dispatch
    from cupyflash.plans import DeviceLimits

    lim = DeviceLimits.current()
    for hq, nq, family in ((1, 16384, "mma"), (4, 4096, "mma"), (1, 16385, "portable"), (4, 4097, "portable")):
        q = cupy.asarray(rng.standard_normal((1, hq, nq, 64)).astype(F32))
        k = cupy.asarray(rng.standard_normal((1, 1, 8, 64)).astype(F32))
        assert dispatch.select(check_attention(q, k, k), lim).NAME == family, (hq, nq)


def test_relative_error_is_well_under_the_bound(rng):
    """The headline figure: 3xTF32 keeps o within a few 1e-7 of float64 at N = 1000 (float32's own level)."""
    q, k, v = _qkv(rng, 1, 4, 4, 1000, 1000, 64)
    o, lse = run_forward(q, k, v)
    ro, rlse = reference.attention_forward(q, k, v)
    print(f"float32 mma forward, N = 1000, D = 64: o rel err {rel_err(o, ro):.2e}, lse {rel_err(lse, rlse):.2e}")
    assert rel_err(o, ro) < 2e-6


# ---------------------------------------------------------------------------- staged mask/bias tiles

def _staged_cases():
    from test_masks_staged_gpu import CASES

    return [c for c in CASES if c[3] != "transposed-bias"]  # the strided view: test_masks_staged_gpu's API path


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name,shape,spec,how", _staged_cases(), ids=[c[0] for c in _staged_cases()])
def test_staged_score_tiles(name, shape, spec, how, d, rng):
    """The float32 kernels' staged mask/bias tiles (plans.mma: one a K/V ring slot in the forward, a Q_i/dO_i slot in
    the backward, where they fit) against the float64 reference, forward and backward: aligned rows (every
    chunk a cp.async, zero-filled past Nq and Nk), a mask broadcast over queries, misaligned rows (element loads),
    a mask or a bias alone, GQA, Nq != Nk; the plan's kernel name says that it staged."""
    from test_masks_gpu import check as check_masks, run_family
    from test_masks_staged_gpu import _inputs

    from cupyflash.plans import DeviceLimits
    from cupyflash.plans import mma as plans

    q, k, v, do, causal, kw = _inputs(rng, "float32", shape, spec, how, d)
    device_kw = {a: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for a, x in kw.items()}
    p = check_attention(*(cupy.asarray(x) for x in (q, k, v)), causal=causal, **device_kw)
    b, hq, hk, nq, nk = shape
    limits = DeviceLimits.current()
    fwd = plans.plan_forward(b, hq, nq, d, "float", limits, variant=p.variant)
    assert f", {fwd.config.br}, {fwd.config.bc}>" in fwd.main.name, fwd.main.name  # staged as the kernel's Br x Bc
    # the backward where its tiles fit beside its own (a float32 bias with a mask never does)
    bwd = plans.plan_backward(b, hq, hk, nq, nk, d, "float", limits, variant=p.variant)
    cfg = bwd.config
    fits = cfg.shared_bytes + cfg.stages * p.variant.score_tile_bytes(cfg.br, cfg.bc) <= limits.max_shared_per_block
    assert (f", {cfg.br}, {cfg.bc}>" in bwd.main.name) == fits, bwd.main.name
    o, lse, grads = run_family("mma", q, k, v, do, causal, kw)
    check_masks("mma", "float32", q, k, v, do, causal, kw, o, lse, grads)


_CUT_PROBE = r'''
#include "mma_tf32.cuh"
using namespace cupyflash::mma;
// One m16n8k8 tf32 product: A = x in column 0 of every row (zeros elsewhere), B = 1 in row 0 of every column, so
// c[row][col] = the value the tensor cores take for A's x of that row. Lane (g, t) holds a[0] = (g, t), a[1] =
// (g + 8, t): x goes where t == 0.
extern "C" __global__ void probe(const unsigned int* x, float* out) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const uint32_t a[4] = {t == 0 ? x[g] : 0u, t == 0 ? x[g + 8] : 0u, 0u, 0u};
  const uint32_t one = __float_as_uint(1.0f);
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  mma_1688_tf32(c, a, t == 0 ? one : 0u, 0u);
  out[g * 2] = c[0];
  out[(g + 8) * 2] = c[2];
}
'''


def test_tf32_operands_are_cut():
    """The float32 backward's split_tf32_cut (cuda_src/mma_tf32.cuh) hands x itself to mma.sync as hi, and lo = x -
    cut(x) with its low bits set, relying on the tensor cores to read a tf32 operand's top 19 bits and ignore the 13
    low ones (cut, not rounded). If a GPU rounded or kept them instead, this fails before any float32 gradient
    drifts."""
    from cupyflash.kernels.build import compile_options

    mod = cupy.RawModule(code=_CUT_PROBE, options=compile_options(), name_expressions=["probe"])
    rng = np.random.default_rng(11)
    vals = (rng.standard_normal(16) * 2.0 ** rng.integers(-20, 20, 16)).astype(F32)
    bits = vals.view(np.uint32) | np.uint32(0x1fff)  # every low bit set: rounding would carry, cutting drops them
    out = cupy.full(32, np.nan, dtype=F32)
    mod.get_function("probe")((1,), (32,), (cupy.asarray(bits), out))
    got = cupy.asnumpy(out)[::2]
    cut = (bits & np.uint32(0xFFFFE000)).view(F32)
    np.testing.assert_array_equal(got, cut)
