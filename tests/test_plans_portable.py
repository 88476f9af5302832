"""CPU tests of the portable kernels' launch plans, plus a spill check on a few instantiations."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from conftest import DTYPES, TOL_GRAD, TOL_OUT, random_qkv, rel_err, requires_gpu
from cupyflash import _dtypes
from cupyflash.plans import A100, H100, RTX4090, T4, DeviceLimits, cdiv
from cupyflash.plans import portable as pp
from cupyflash.variants import Variant

POL = Variant().cpp_policy

DEVICES = {"A100": A100, "H100": H100, "RTX4090": RTX4090, "T4": T4}
SHAPES = [
    pp.Shape(b=1, hq=1, hk=1, nq=1, nk=1, d=1, dtype=_dtypes.FLOAT32),
    pp.Shape(b=2, hq=8, hk=2, nq=1000, nk=17, d=40, dtype=_dtypes.FLOAT16),
    pp.Shape(b=4, hq=16, hk=16, nq=4096, nk=4096, d=128, dtype=_dtypes.FLOAT32),
    pp.Shape(b=3, hq=6, hk=1, nq=65, nk=300, d=256, dtype=_dtypes.BFLOAT16),
    pp.Shape(b=4, hq=12, hk=12, nq=1024, nk=1024, d=64, dtype=_dtypes.FLOAT32),
    pp.Shape(b=1, hq=2, hk=2, nq=33, nk=33, d=160, dtype=_dtypes.FLOAT32),
]
NAMES = set(pp.instantiations())


PADS = [(1, 32), (32, 32), (33, 64), (64, 64), (65, 128), (128, 128), (129, 256), (256, 256)]


@pytest.mark.parametrize("d, want", PADS)
def test_padded_d(d, want):
    assert pp.padded_d(d) == want


def test_padded_d_rejects_too_large():
    with pytest.raises(ValueError, match="257"):
        pp.padded_d(257)


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.dtype}-d{s.d}-{s.nq}x{s.nk}")
def test_forward_plan(dev, shape):
    limits = DEVICES[dev]
    plan = pp.forward_plan(shape, limits)
    lp = plan.launch
    assert plan.d_pad >= shape.d and plan.d_pad in pp.D_PADS
    assert lp.grid == (cdiv(shape.nq, plan.tile.rows), shape.b * shape.hq, 1)
    assert lp.grid[0] * plan.tile.rows >= shape.nq > (lp.grid[0] - 1) * plan.tile.rows  # every row, no idle block
    assert lp.block == (plan.tile.threads, 1, 1) and plan.tile.threads % 32 == 0
    assert 0 < lp.shared_bytes <= limits.max_shared_per_block
    assert lp.shared_bytes == pp.forward_smem(plan.d_pad, plan.tile)
    assert (lp.source, lp.name) in NAMES
    assert pp.ctype(shape.dtype) in lp.name


@pytest.mark.parametrize("strategy", ["atomic", "separate"])
@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.dtype}-d{s.d}-{s.nq}x{s.nk}")
def test_backward_plan(dev, shape, strategy):
    limits = DEVICES[dev]
    plan = pp.backward_plan(shape, limits, strategy)
    assert plan.dq_strategy == strategy
    for lp in plan.launches:
        assert (lp.source, lp.name) in NAMES
        assert lp.shared_bytes <= limits.max_shared_per_block
    # Delta: one warp per query row.
    rows = shape.b * shape.hq * shape.nq
    assert plan.delta.grid[0] * plan.delta.block[0] // 32 >= rows
    # dK/dV: every key row of every kv head.
    kv = plan.kv
    bc = int(kv.name.split(",")[2])
    assert kv.grid == (cdiv(shape.nk, bc), shape.b * shape.hk, 1)
    if strategy == "separate":
        br = int(plan.dq.name.split(",")[2])
        assert plan.dq.grid == (cdiv(shape.nq, br), shape.b * shape.hq, 1)
        assert "portable_bwd_dq<" in plan.dq.name
    else:
        assert "convert" in plan.dq.name and plan.dq.grid[0] >= 1


def test_backward_plan_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="dq_strategy"):
        pp.backward_plan(SHAPES[0], H100, "magic")  # type: ignore[arg-type]


def test_fast_tiles_on_big_parts():
    # The first (fastest) configuration is the one that runs on H100-class parts.
    for dp in pp.D_PADS:
        s = pp.Shape(1, 1, 1, 10, 10, dp, _dtypes.FLOAT32)
        assert pp.forward_plan(s, H100).tile == pp.FORWARD_TILES[dp][0]
        assert pp.kv_smem(dp, pp.KV_TILES[dp][0]) <= H100.max_shared_per_block
        assert pp.dq_smem(dp, pp.DQ_TILES[dp][0]) <= H100.max_shared_per_block
        assert pp.forward_smem(dp, pp.FORWARD_TILES[dp][0]) <= A100.max_shared_per_block


def test_forward_kv_buffers():
    # Two cp.async K/V buffers (issue 12): float32 on sm_80+ where min_blocks blocks still share an SM.
    f32 = pp.Shape(4, 12, 12, 256, 256, 64, _dtypes.FLOAT32)
    plan = pp.forward_plan(f32, H100)
    assert plan.tile.kv_bufs == 2 and plan.launch.max_carveout
    assert "<float, 64, 64, 64, 8, 16, 3, 2," in plan.launch.name
    assert pp.blocks_by_smem(plan.launch.shared_bytes, H100) == 3
    assert pp.forward_plan(f32, A100).tile.kv_bufs == 1  # 68 KB a block: 2 on its 164 KB, not 3
    assert pp.forward_plan(f32, RTX4090).tile.kv_bufs == 1
    assert pp.forward_plan(f32, T4).tile.kv_bufs == 1  # no cp.async before sm_80
    assert pp.forward_plan(pp.Shape(1, 1, 1, 9, 9, 32, _dtypes.FLOAT32), RTX4090).tile.kv_bufs == 2
    for dtype in (_dtypes.FLOAT16, _dtypes.BFLOAT16):  # 16-bit inputs are converted on the way in
        assert pp.forward_plan(pp.Shape(1, 1, 1, 9, 9, 64, dtype), H100).tile.kv_bufs == 1
    # D=128 takes a narrower tile to keep two blocks with two buffers (measured 2.6% ahead); D=256 one buffer
    d128 = pp.forward_plan(pp.Shape(1, 1, 1, 9, 9, 128, _dtypes.FLOAT32), H100)
    assert d128.tile == pp.Tile(64, 32, 8, min_blocks=2, kv_bufs=2)
    assert pp.blocks_by_smem(d128.launch.shared_bytes, H100) == 3
    assert pp.forward_plan(pp.Shape(1, 1, 1, 9, 9, 128, _dtypes.BFLOAT16), H100).tile == pp.Tile(64, 64, 8)
    assert pp.forward_plan(pp.Shape(1, 1, 1, 9, 9, 256, _dtypes.FLOAT32), H100).tile.kv_bufs == 1
    assert not any(", 2, cupyflash::" in n and "<float," not in n for _, n in NAMES if "portable_fwd<" in n)


def test_every_d_pad_fits_64kb_parts():
    small = DeviceLimits(compute_capability=60, sm_count=20, max_shared_per_block=64 * 1024)
    for dp, dtype in itertools.product(pp.D_PADS, _dtypes.SUPPORTED):
        s = pp.Shape(1, 1, 1, 10, 10, dp, dtype)
        assert pp.forward_plan(s, small).launch.shared_bytes <= small.max_shared_per_block
        for lp in pp.backward_plan(s, small, "separate").launches:
            assert lp.shared_bytes <= small.max_shared_per_block


def test_tile_tables_are_consistent():
    # What the kernels' static_asserts demand, checked before any compile.
    for table in (pp.FORWARD_TILES, pp.KV_TILES, pp.DQ_TILES):
        assert set(table) == set(pp.D_PADS)
        for dp, tiles in table.items():
            for t in tiles:
                assert t.rows % t.tm == 0 and t.cols % t.lanes == 0 and t.cols % 4 == 0
                assert dp % t.lanes == 0 and t.lanes <= 32 and t.threads % 32 == 0
                assert t.threads <= 1024


def test_instantiations_unique_and_cover_dtypes():
    names = pp.instantiations()
    assert len(names) == len(set(names))
    for ct in ("float", "__half", "__nv_bfloat16"):
        assert any(f"portable_fwd<{ct}," in n for _, n in names)
        assert any(f"portable_bwd_kv<{ct}," in n for _, n in names)
        assert any(f"portable_bwd_dq<{ct}," in n for _, n in names)
        assert (pp.BACKWARD_SOURCE, pp.delta_name(ct)) in names


def test_kernels_module_interface():
    from cupyflash.kernels import portable
    from cupyflash.validation import AttentionProblem
    from cupyflash.variants import Variant

    assert portable.NAME == "portable"
    assert portable.instantiations() == pp.instantiations()
    p = AttentionProblem((2,), 4, 2, 10, 10, 256, _dtypes.BFLOAT16, Variant(True), 0.1, "cupy")
    assert portable.supports(p, T4) is None
    assert "sm_60" in portable.supports(p, DeviceLimits(52, 10, 48 * 1024))


# A few instantiations compiled by NVRTC for real architectures (no GPU needed): the
# biggest register tiles of each kernel must not spill. The exhaustive check is test_compile.
COMPILE_CASES = [
    (pp.FORWARD_SOURCE, pp.fwd_name("float", 128, pp.FORWARD_TILES[128][0], POL), "sm_80"),
    (pp.FORWARD_SOURCE, pp.fwd_name("__nv_bfloat16", 256, pp.FORWARD_TILES[256][0], POL), "sm_90a"),
    (pp.BACKWARD_SOURCE, pp.kv_name("float", 128, pp.KV_TILES[128][0], POL), "sm_90a"),
    (pp.BACKWARD_SOURCE, pp.dq_name("__half", 64, pp.DQ_TILES[64][0], POL), "sm_75"),
]


@pytest.mark.parametrize("source, name, arch", COMPILE_CASES)
def test_compiles_without_spills(source, name, arch):
    build = pytest.importorskip("cupyflash.kernels.build")
    try:
        from cupy.cuda import nvrtc  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        pytest.skip(f"NVRTC unavailable: {e}")
    usage = build.nvrtc_compile(source, name, arch)
    assert not usage.spills, usage.line()
    assert usage.stack_frame == 0, usage.line()
    assert 0 < usage.registers <= 255, usage.line()


def test_vec_check_on_host():
    from cupyflash.kernels.family import Geometry
    from cupyflash.kernels.portable import _vec
    from cupyflash.validation import AttentionProblem

    def prob(d, dtype=_dtypes.FLOAT32):
        return AttentionProblem((2,), 4, 4, 10, 10, d, dtype, Variant(), 0.1, "cupy")

    def geo(aligned):
        return Geometry(2, {}, ({},), aligned)

    assert _vec(prob(64), geo(True))
    assert not _vec(prob(62), geo(True))  # D not a multiple of 4 floats
    assert not _vec(prob(64), geo(False))  # some row not 16-byte aligned
    assert _vec(prob(8, _dtypes.FLOAT16), geo(True)) and not _vec(prob(4, _dtypes.FLOAT16), geo(True))


# ---------------------------------------------------------------------------- on a GPU
# The family's own entry points, with each backward dQ strategy and both load paths
# (16-byte vectors; scalar for D that is not a multiple of 16 bytes). Skips without a GPU.

GPU_CASES = [
    # (dtype, batch, hq, hk, nq, nk, d, causal)
    ("float32", 2, 4, 2, 130, 77, 64, True),  # GQA, Nq > Nk: rows with no visible key
    ("float32", 1, 2, 2, 65, 200, 126, False),  # D % 4 != 0: scalar loads
    ("float16", 1, 4, 1, 100, 100, 128, True),  # MQA
    ("bfloat16", 2, 2, 2, 33, 50, 40, False),
    ("float16", 1, 2, 2, 40, 40, 36, True),  # D % 8 != 0: scalar loads of halves
]


@requires_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["atomic", "separate"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0]}-d{c[6]}-{c[4]}x{c[5]}{'-causal' if c[7] else ''}")
def test_portable_kernels_gpu(rng, case, strategy):
    import cupy

    from cupyflash import reference
    from cupyflash.kernels import portable
    from cupyflash.validation import check_attention

    dtn, b, hq, hk, nq, nk, d, causal = case
    dtype = DTYPES[dtn]
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    p = check_attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), causal=causal)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    o = cupy.full(q.shape, np.nan, dtype=dtype)
    lse = cupy.full(q.shape[:-1], np.nan, dtype=np.float32)
    portable.forward(qd, kd, vd, o, lse, p)
    f64 = [x.astype(np.float64) for x in (q, k, v, do)]
    o_ref, lse_ref = reference.attention_forward(*f64[:3], causal=causal)
    assert rel_err(cupy.asnumpy(o), o_ref) < TOL_OUT[dtn]
    lse_h = cupy.asnumpy(lse)
    masked = np.isneginf(lse_ref)
    if causal and nq > nk:
        assert masked.any()  # the case reaches rows that see no key
    assert np.array_equal(np.isneginf(lse_h), masked)
    assert np.allclose(lse_h[~masked], lse_ref[~masked], rtol=1e-5, atol=1e-5)

    dq, dk, dv = (cupy.full(x.shape, np.nan, dtype=dtype) for x in (q, k, v))
    portable.backward(dod, qd, kd, vd, o, lse, dq, dk, dv, p, dq_strategy=strategy)
    refs = reference.attention_backward(f64[3], *f64[:3], o_ref, lse_ref, causal=causal)
    for got, ref in zip((dq, dk, dv), refs):
        assert rel_err(cupy.asnumpy(got), ref) < TOL_GRAD[dtn]
    if masked.any():  # rows that see no key get exactly zero dq
        assert np.all(cupy.asnumpy(dq)[masked] == 0)
