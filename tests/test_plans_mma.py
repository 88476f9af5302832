"""Launch plans of the tensor-core ("mma") family, on the CPU (test_compile checks every instantiation for spills)."""
from __future__ import annotations


import numpy as np
import pytest

from cupyflash import _dtypes
from cupyflash.kernels import mma as family
from cupyflash.plans import A100, H100, RTX4090, T4, DeviceLimits, cdiv
from cupyflash.plans import mma as plans
from cupyflash.validation import AttentionProblem
from cupyflash.variants import Variant

POL = Variant().cpp_policy

DEVICES = {"A100": A100, "H100": H100, "RTX4090": RTX4090}


def problem(d=64, dtype=_dtypes.FLOAT16, hq=8, hk=2, nq=1000, nk=777, causal=False) -> AttentionProblem:
    return AttentionProblem((2,), hq, hk, nq, nk, d, np.dtype(dtype), Variant(causal), 1.0 / np.sqrt(d), "cupy")


@pytest.mark.parametrize("d, want", [(1, 32), (32, 32), (40, 64), (64, 64), (72, 96), (96, 96), (128, 128),
                                     (136, 192), (160, 192), (200, 256), (256, 256), (257, None)])  # fmt: skip
def test_padded_head_dim(d, want):
    assert plans.padded_head_dim(d) == want


@pytest.mark.parametrize("name", DEVICES)
def test_forward_configs_fit_every_sm80_part(name):
    limits = DEVICES[name]
    for pd, cfg in plans.FORWARD_CONFIGS.items():
        assert cfg.d == pd
        assert cfg.shared_bytes <= limits.max_shared_per_block, (name, cfg)
        assert plans.forward_config(pd, limits) == cfg


def test_backward_configs_fit_datacenter_parts():
    for limits in (A100, H100):
        for pd, cfg in plans.BACKWARD_CONFIGS.items():
            assert cfg.d == pd
            assert plans.backward_config(pd, limits) == cfg, (limits, cfg)


def test_backward_falls_back_to_smaller_tiles_where_smem_is_short():
    for pd, small in plans.BACKWARD_FALLBACKS.items():
        main = plans.BACKWARD_CONFIGS[pd]
        assert small.d == pd and small.shared_bytes < main.shared_bytes
        limits = DeviceLimits(compute_capability=89, sm_count=128, max_shared_per_block=small.shared_bytes)
        assert plans.backward_config(pd, limits) == small
        assert plans.backward_config(pd, RTX4090) == (main if main.shared_bytes <= RTX4090.max_shared_per_block
                                                      else small)  # fmt: skip
    assert plans.backward_config(64, RTX4090) is not None  # D = 64 keeps the mma backward on 99 KB parts


def test_backward_config_absent_where_smem_is_short():
    # 99 KB parts take the portable backward for the larger head dims (kernels.mma.backward checks).
    small = DeviceLimits(compute_capability=89, sm_count=128, max_shared_per_block=64 * 1024)
    assert plans.backward_config(128, small) is None
    assert plans.backward_config(128, RTX4090) == (
        plans.BACKWARD_CONFIGS[128] if plans.BACKWARD_CONFIGS[128].shared_bytes <= RTX4090.max_shared_per_block else None
    )
    with pytest.raises(ValueError, match="no mma backward configuration"):
        plans.plan_backward(1, 1, 1, 10, 10, 128, "__half", small)


def test_shared_bytes_match_the_kernel_layout():
    # Swizzled tiles (width % 64 == 0) have no padding; others one 16-byte chunk per row.
    cfg = plans.ForwardConfig(128, br=128, bc=64, warps=8, stages=2)
    assert cfg.shared_bytes == (128 + 2 * 2 * 64) * 128 * 2
    cfg96 = plans.ForwardConfig(96, br=128, bc=64, warps=8, stages=2)
    assert cfg96.shared_bytes == (128 + 4 * 64) * 104 * 2
    b = plans.BackwardConfig(64, br=64, key_warps=8)
    assert b.bc == 128 and b.threads == 256
    assert b.shared_bytes == 2 * 128 * 64 * 2 + 4 * 64 * 64 * 2 + 128 * 64 * 2 + 4 * 64 * 4
    b2 = plans.Backward2DConfig(128, br=64, bc=128)
    assert b2.threads == 256
    # K_j, V_j; the Q_i/dO_i ring; P^T and dS^T; the lse/Delta ring. It fits an A100's 163 KB.
    assert b2.shared_bytes == 2 * 128 * 128 * 2 + 4 * 64 * 128 * 2 + 2 * 128 * 64 * 2 + 4 * 64 * 4
    assert b2.shared_bytes <= A100.max_shared_per_block
    assert b2.name("__half", POL) == f"mma_flash_bwd2d<__half, 128, 64, 128, 8, 4, 4, 2, 2, 1, false, {POL}>"


def test_tile_shapes_are_what_the_kernels_assert():
    for cfg in plans.FORWARD_CONFIGS.values():
        assert cfg.br % (16 * cfg.warps) == 0 and cfg.bc % 16 == 0 and cfg.d % 16 == 0
        assert cfg.stages >= 2 and cfg.threads <= 1024
    for cfg in [*plans.BACKWARD_CONFIGS.values(), *plans.BACKWARD_FALLBACKS.values()]:
        if isinstance(cfg, plans.Backward2DConfig):
            # Every warp tile (S^T/dP^T, dK/dV, dQ) is a whole number of 16 x 16 blocks.
            for rows, rw, cols in ((cfg.bc, cfg.s_key_warps, cfg.br), (cfg.bc, cfg.v_key_warps, cfg.d),
                                   (cfg.br, cfg.q_row_warps, cfg.d)):  # fmt: skip
                assert cfg.warps % rw == 0 and (rows // rw) % 16 == 0 and (cols // (cfg.warps // rw)) % 16 == 0
            continue
        assert (cfg.d // cfg.d_split) % 16 == 0 and cfg.br % 16 == 0
        row_warps = min(cfg.br // 16, cfg.warps)
        assert cfg.warps % row_warps == 0 and (cfg.d // (cfg.warps // row_warps)) % 16 == 0


def test_plan_forward_geometry():
    plan = plans.plan_forward(3, 12, 1000, 72, "__nv_bfloat16", H100)
    cfg = plans.FORWARD_CONFIGS[96]
    assert plan.config == cfg
    assert plan.main.grid == (cdiv(1000, cfg.br), 36, 1) and not plan.heads_on_x
    causal = plans.plan_forward(3, 12, 1000, 72, "__nv_bfloat16", H100, variant=Variant(True))
    assert causal.main.grid == (36, cdiv(1000, cfg.br), 1) and causal.heads_on_x
    many = plans.plan_forward(4096, 32, 1000, 72, "__nv_bfloat16", H100)  # B*H past gridDim.y's limit
    assert many.main.grid == (4096 * 32, cdiv(1000, cfg.br), 1) and many.heads_on_x
    assert plan.main.block == (cfg.threads, 1, 1)
    assert plan.main.shared_bytes == cfg.shared_bytes
    assert plan.main.name == (
        f"mma_flash_fwd<__nv_bfloat16, 96, {cfg.br}, {cfg.bc}, {cfg.warps}, {cfg.stages}, {cfg.min_blocks}, {POL}>"
    )
    assert plan.main.source == "mma_forward.cu"


def test_plan_backward_geometry():
    plan = plans.plan_backward(2, 8, 2, 1000, 777, 128, "__half", H100)
    cfg = plans.BACKWARD_CONFIGS[128]
    assert plan.main.grid == (cdiv(777, cfg.bc), 4, 1) and not plan.heads_on_x
    causal = plans.plan_backward(2, 8, 2, 1000, 777, 128, "__half", H100, variant=Variant(True))
    assert causal.main.grid == (4, cdiv(777, cfg.bc), 1) and causal.heads_on_x
    assert plan.main.block == (cfg.threads, 1, 1)
    assert plan.rows == 2 * 8 * 1000
    # Delta: 16 lanes a row at D = 128 (16 rows a block); the conversion 32 (8 rows a block)
    assert plan.delta.grid == (cdiv(16000, 16), 1, 1) and plan.delta.block == (256, 1, 1)
    assert plan.convert.grid == (cdiv(16000, 8), 1, 1) and plan.convert.block == (256, 1, 1)
    assert plan.delta.name == "mma_bwd_delta<__half, 16>" and plan.convert.name == "mma_bwd_dq_convert<__half, 32>"
    for d, lanes, clanes in ((32, 8, 16), (64, 8, 16), (96, 16, 32), (128, 16, 32), (192, 32, 32), (256, 32, 32)):
        pd = plans.plan_backward(1, 2, 2, 100, 300, d, "__half", H100)
        assert pd.delta_lanes == lanes and pd.delta.name == f"mma_bwd_delta<__half, {lanes}>"
        assert pd.delta.grid == (cdiv(200, 256 // lanes), 1, 1) and lanes * 8 >= d
        assert pd.convert_lanes == clanes and pd.convert.name == f"mma_bwd_dq_convert<__half, {clanes}>"
        assert pd.convert.grid == (cdiv(200, 256 // clanes), 1, 1)


def test_supports():
    assert family.supports(problem(), H100) is None
    assert family.supports(problem(dtype=_dtypes.BFLOAT16, d=256), A100) is None
    assert family.supports(problem(d=40), RTX4090) is None
    assert family.supports(problem(dtype=_dtypes.FLOAT32), H100) is None  # 3xTF32
    assert family.supports(problem(dtype=_dtypes.FLOAT32, d=128), RTX4090) is None  # fallback tiles on 99 KB
    assert "float32 on tensor cores needs D <= 128" in family.supports(problem(dtype=_dtypes.FLOAT32, d=136), H100)
    # float32: (Hq / Hk) x Nq query rows a kv head, over at most MAX_Q_PARTS parts of MAX_ROWS_F32 (query_parts)
    most = plans.MAX_Q_PARTS * plans.MAX_ROWS_F32
    assert family.supports(problem(dtype=_dtypes.FLOAT32, hq=1, hk=1, nq=most), H100) is None
    assert family.supports(problem(dtype=_dtypes.FLOAT32, hq=8, hk=2, nq=most // 4), H100) is None
    assert f"(Hq / Hk) x Nq <= {most} (got 4 x {most // 4 + 1})" in family.supports(
        problem(dtype=_dtypes.FLOAT32, hq=8, hk=2, nq=most // 4 + 1), H100)
    assert family.supports(problem(dtype=_dtypes.FLOAT16, hq=8, hk=1, nq=10 * most), H100) is None  # 16-bit: exact
    assert family.supports(problem(dtype=np.float64), H100) is not None
    assert family.supports(problem(), T4) is not None
    assert family.supports(problem(d=41), H100) is not None  # rows of D % 8 != 0 elements: portable family


def test_float32_dispatch():
    # kernel="auto" takes the mma family for float32 on sm_80+ up to D = 128 (3xTF32 forward and backward), the
    # portable one past it or below sm_80; kernel="mma" says why not
    from cupyflash.kernels import dispatch

    f32 = problem(dtype=_dtypes.FLOAT32)
    for limits in (A100, H100, RTX4090):
        assert dispatch.select(f32, limits).NAME == "mma"
        assert dispatch.select(f32, limits, "mma") is family
    assert dispatch.select(f32, T4).NAME == "portable"
    assert dispatch.select(problem(d=192, dtype=_dtypes.FLOAT32), H100).NAME == "portable"
    with pytest.raises(TypeError, match="float32 on tensor cores needs D <= 128"):
        dispatch.select(problem(dtype=_dtypes.FLOAT32, d=136), H100, "mma")


def test_rows_aligned_checks_pointer_and_strides():
    from cupyflash.cuda_backend import _aligned

    def arr(shape, strides, ptr_mod=0):  # element strides of a 16-bit array
        return (shape, tuple(2 * s for s in strides), 2, ptr_mod)

    assert _aligned({"q": arr((2, 4, 100, 64), (4 * 100 * 64, 100 * 64, 64, 1))})
    # (B, N, H, D) memory seen as (B, H, N, D): row stride H*D = 4*64, still 16-byte multiples.
    assert _aligned({"q": arr((2, 4, 100, 64), (100 * 4 * 64, 64, 4 * 64, 1))})
    assert not _aligned({"q": arr((2, 4, 100, 64), (4 * 100 * 64, 100 * 64, 64, 1), ptr_mod=8)})
    assert not _aligned({"q": arr((2, 4, 100, 40), (4 * 100 * 44, 100 * 44, 44, 1))})  # 88-byte rows
    # A stride of a size-1 axis is never used, so it may be anything.
    assert _aligned({"q": arr((1, 4, 100, 64), (3, 100 * 64, 64, 1))})


@pytest.mark.parametrize("name", DEVICES)
def test_float32_forward_configs_fit_every_sm80_part(name):
    limits = DEVICES[name]
    assert sorted(plans.FORWARD_CONFIGS_F32) == [32, 64, 96, 128] and plans.MAX_D_F32 == 128
    for pd, table in plans.FORWARD_CONFIGS_F32.items():
        cfg = plans.forward_config(pd, limits, elem=4)  # the table's, else the first fallback that fits
        assert cfg in (table, *plans.FORWARD_FALLBACKS_F32.get(pd, ())), (name, pd)
        assert cfg == table or table.shared_bytes > limits.max_shared_per_block
        assert cfg.d == pd and cfg.elem == 4
        assert cfg.br % (16 * cfg.warps) == 0 and cfg.bc % 16 == 0 and cfg.stages >= 2
        assert cfg.shared_bytes <= limits.max_shared_per_block, (name, cfg)
        for d in range(pd - 24, pd + 1, 8):  # every D padded to pd
            if d > 0:
                assert plans.forward_config(d, limits, elem=4) == cfg
    for d in (136, 192, 256):
        assert plans.forward_config(d, limits, elem=4) is None


def test_float32_tiles_are_twice_as_wide():
    # A float tile of D columns is the 16-bit TileLayout of 2 D columns (swizzled for every D % 32 == 0).
    cfg = plans.ForwardConfig(64, br=128, bc=64, warps=4, elem=4)
    assert cfg.width == 128
    assert cfg.shared_bytes == (128 + 2 * 2 * 64) * 64 * 4 == 96 * 1024
    cfg96 = plans.ForwardConfig(96, br=64, bc=32, warps=4, elem=4)
    assert cfg96.shared_bytes == (64 + 4 * 32) * 96 * 4  # 192 16-bit units a row: swizzled, no padding
    assert plans.FORWARD_CONFIGS_F32[128].shared_bytes == (128 + 4 * 32) * 128 * 4
    assert cfg.name("float", POL) == f"mma_flash_fwd<float, 64, 128, 64, 4, 2, 1, {POL}>"
    with pytest.raises(ValueError, match="4-byte elements"):
        plans.FORWARD_CONFIGS[64].name("float", POL)
    with pytest.raises(ValueError, match="2-byte elements"):
        cfg.name("__half", POL)


def test_plan_forward_float32():
    plan = plans.plan_forward(3, 12, 1000, 72, "float", H100)
    cfg = plans.FORWARD_CONFIGS_F32[96]
    assert plan.config == cfg
    assert plan.main.grid == (cdiv(1000, cfg.br), 36, 1) and plan.main.block == (cfg.threads, 1, 1)
    assert plan.main.shared_bytes == cfg.shared_bytes
    assert plan.main.name == cfg.name("float", POL)
    with pytest.raises(ValueError, match="no mma forward configuration"):
        plans.plan_forward(1, 1, 10, 192, "float", H100)


def test_supports_float32_up_to_d128():
    f32 = _dtypes.FLOAT32
    for d in (8, 16, 40, 64, 96, 128):
        assert family.supports(problem(d=d, dtype=f32), H100) is None, d
        for limits in DEVICES.values():  # where the 16-bit types go, float32 goes (its fallback tiles fit 99 KB)
            if family.supports(problem(d=d), limits) is None:
                assert family.supports(problem(d=d, dtype=f32), limits) is None, (d, limits)
    for d in (136, 192, 256):
        assert "D <= 128" in family.supports(problem(d=d, dtype=f32), H100)
    assert family.supports(problem(d=60, dtype=f32), H100) is not None  # D % 8
    flex = AttentionProblem((2,), 8, 2, 100, 100, 64, np.dtype(f32), Variant(flex=object()), 0.125, "cupy")
    assert "mask_mod/score_mod" in family.supports(flex, H100)
    assert family.supports(problem(dtype=f32), T4) is not None


def test_instantiations_cover_every_config_once():
    inst = family.instantiations()
    assert len(inst) == len(set(inst))
    names = {n for _, n in inst}
    for ct in ("__half", "__nv_bfloat16"):
        for cfg in plans.FORWARD_CONFIGS.values():
            assert cfg.name(ct, POL) in names
        for cfg in plans.BACKWARD_CONFIGS.values():
            assert cfg.name(ct, POL) in names
        assert {f"mma_bwd_delta<{ct}, {n}>" for n in (8, 16, 32)} <= names
        assert {f"mma_bwd_dq_convert<{ct}, {n}>" for n in (16, 32)} <= names
    from cupyflash.variants import BUILTIN

    mains = len(plans.FORWARD_CONFIGS) + len(plans.BACKWARD_CONFIGS) + len(plans.BACKWARD_FALLBACKS)
    f32_fwd = plans.forward_configs_f32()
    f32 = len(plans.backward_configs_f32())
    # dtypes x (main kernels x policies + 3 Deltas, 2 converts), float32's forwards x policies, and its backward the
    # same way as a 16-bit dtype, with 2 combines of query parts
    assert len(inst) == 2 * (mains * len(BUILTIN) + 5) + (len(f32_fwd) + f32) * len(BUILTIN) + 5 + 2
    assert {(plans.BACKWARD_SOURCE, f"mma_bwd_kv_combine<float, {n}>") for n in (16, 32)} <= set(inst)
    for v in BUILTIN:
        for cfg in f32_fwd:
            assert (plans.FORWARD_SOURCE, cfg.name("float", v.cpp_policy)) in inst
    for cfg in plans.backward_configs_f32():
        assert cfg.name("float", POL) in names
    assert {f"mma_bwd_delta<float, {n}>" for n in (8, 16, 32)} <= names
    assert {f"mma_bwd_dq_convert<float, {n}>" for n in (16, 32)} <= names


# ---------------------------------------------------------------------------- float32 (3xTF32) backward


def test_float32_backward_tables():
    assert set(plans.BACKWARD_CONFIGS_F32) == {32, 64, 96, 128}  # D <= 128 (kernels.mma.MAX_D_F32)
    for pd, cfg in plans.BACKWARD_CONFIGS_F32.items():
        assert cfg.d == pd and cfg.elem == 4 and cfg.d_split == 1
        assert plans.backward_config(pd, H100, elem=4) == cfg
        # one block of 8 warps an SM on an H100 (the smem of two does not fit, except at D = 32)
        assert cfg.warps == 8 and cfg.shared_bytes <= H100.max_shared_per_block
    for pd, cfgs in plans.BACKWARD_FALLBACKS_F32.items():
        for cfg in cfgs:
            assert cfg.d == pd and cfg.elem == 4 and cfg.shared_bytes < plans.BACKWARD_CONFIGS_F32[pd].shared_bytes
    for d in (192, 256, 257):
        assert plans.backward_config(d, H100, elem=4) is None
    # A100: the tables but D = 128; 99 KB parts: a fallback at every D but 32
    assert [plans.backward_config(d, A100, elem=4) for d in (32, 64, 96, 128)] == [
        *(plans.BACKWARD_CONFIGS_F32[d] for d in (32, 64, 96)), plans.BACKWARD_FALLBACKS_F32[128][0]]
    for d in (64, 96, 128):
        cfg = plans.backward_config(d, RTX4090, elem=4)
        assert cfg in plans.BACKWARD_FALLBACKS_F32[d] and cfg.shared_bytes <= RTX4090.max_shared_per_block
    assert plans.backward_config(32, RTX4090, elem=4) == plans.BACKWARD_CONFIGS_F32[32]
    # the 16-bit tables are unchanged by elem's default
    assert plans.backward_config(64, H100) == plans.BACKWARD_CONFIGS[64]


def test_float32_shared_bytes_are_float_tiles():
    # K_j, V_j and the Q_i/dO_i ring in rows of 4 d bytes (TileLayout<2 d>), dS^T in floats, the lse/Delta ring
    b = plans.BackwardConfig(64, br=64, key_warps=8, elem=4)
    assert b.shared_bytes == 2 * 128 * 64 * 4 + 4 * 64 * 64 * 4 + 128 * 64 * 4 + 4 * 64 * 4
    b16 = plans.BackwardConfig(128, br=16, key_warps=2, elem=4)  # dS^T of 32 16-bit units a row: padded by one chunk
    assert b16.shared_bytes == 2 * 32 * 128 * 4 + 4 * 16 * 128 * 4 + 32 * (32 + 8) * 2 + 4 * 16 * 4
    assert b.name("float", POL) == f"mma_flash_bwd<float, 64, 64, 8, 1, 2, 1, 1, {POL}>"


def test_float32_tiles_are_what_the_kernel_asserts():
    for cfg in plans.backward_configs_f32():
        kds = cfg.d // cfg.d_split
        row_warps = min(cfg.br // 16, cfg.warps)
        assert kds % 16 == 0 and cfg.br % 16 == 0 and (cfg.br // 8) % (2 * cfg.dp_chunks) == 0
        assert cfg.warps % row_warps == 0 and (cfg.d // (cfg.warps // row_warps)) % 8 == 0  # n8 dQ tiles


def test_plan_backward_float32():
    plan = plans.plan_backward(8, 8, 2, 1000, 2777, 128, "float", H100)  # 16 x 22 blocks: no small grid
    cfg = plans.BACKWARD_CONFIGS_F32[128]
    assert plan.config == cfg and plan.main.shared_bytes == cfg.shared_bytes
    assert plan.main.name == cfg.name("float", POL) and plan.main.grid == (cdiv(2777, cfg.bc), 16, 1)
    # Delta: a 16-byte load holds 4 floats, so twice the lanes of a 16-bit row; the conversion as for 16 bits
    for d, lanes, clanes in ((32, 8, 16), (40, 16, 16), (64, 16, 16), (72, 32, 32), (128, 32, 32)):
        pd = plans.plan_backward(1, 2, 2, 100, 300, d, "float", H100)
        assert pd.delta_lanes == lanes and pd.delta.name == f"mma_bwd_delta<float, {lanes}>" and lanes * 4 >= d
        assert pd.convert.name == f"mma_bwd_dq_convert<float, {clanes}>"
    own = plans.plan_backward(1, 2, 2, 100, 100, 64, "float", H100)
    assert own.own_dq and own.main.name == plans.BACKWARD_CONFIGS_F32[64].name("float", POL, own_dq=True)
    with pytest.raises(ValueError, match="no mma backward configuration"):
        plans.plan_backward(1, 1, 1, 10, 10, 192, "float", H100)


@pytest.mark.parametrize("group, nq, br, want", [
    (1, 4096, 64, 1), (1, 4097, 64, 2), (1, 8192, 64, 2), (1, 8193, 64, 3), (1, 16384, 64, 4), (1, 16385, 64, None),
    (4, 1024, 64, 1), (4, 4096, 64, 4), (8, 2048, 32, 4), (8, 2049, 32, None), (64, 64, 64, 1), (65, 64, 64, None),
])  # fmt: skip
def test_query_parts(group, nq, br, want):
    """The fewest parts whose blocks each sum at most MAX_ROWS_F32 rows (group x the part's query tiles x Br)."""
    assert plans.query_parts(group, nq, br) == want
    if want is not None:
        per = cdiv(cdiv(nq, br), want)  # the kernel's tiles a part (mma_bwd_tf32.cuh query_part)
        assert group * per * br <= plans.MAX_ROWS_F32 and cdiv(cdiv(nq, br), per) <= want
        assert want == 1 or group * cdiv(cdiv(nq, br), want - 1) * br > plans.MAX_ROWS_F32
    assert plans.query_parts(group, nq, br, varlen=True) == (1 if want == 1 else None)


def test_plan_backward_float32_query_parts():
    """Past MAX_ROWS_F32 rows a kv head the float32 main grid gets a z axis of parts, and a combine launch sums the
    parts' dK/dV over every (b, kv head, key) row; 16-bit plans and short float32 ones have neither."""
    cfg = plans.BACKWARD_CONFIGS_F32[64]
    plan = plans.plan_backward(2, 8, 2, 4096, 3000, 64, "float", H100)  # group 4 x 4096 rows: 4 parts
    assert plan.q_parts == 4 and plan.main.grid == (cdiv(3000, cfg.bc), 2 * 2, 4)
    assert plan.combine.name == "mma_bwd_kv_combine<float, 16>" and plan.combine.block == (256, 1, 1)
    assert plan.combine.grid == (cdiv(2 * 2 * 3000, 256 // 16), 1, 1)
    assert plan.launches == (plan.delta, plan.main, plan.convert, plan.combine)
    # One key tile would own dQ (dq_own.cuh), but that block visits every query row: with parts it does not
    one = plans.plan_backward(1, 1, 1, 8192, 100, 128, "float", H100)
    assert not one.own_dq and one.q_parts == 2 and one.main.name == one.config.name("float", POL)  # (small grid)
    assert one.launches == (one.delta, one.main, one.convert, one.combine)
    assert one.combine.name == "mma_bwd_kv_combine<float, 32>"
    assert plans.plan_backward(1, 1, 1, 4096, 100, 128, "float", H100).own_dq  # one part: owns dQ as before
    for short in (plans.plan_backward(2, 8, 2, 1024, 3000, 64, "float", H100),
                  plans.plan_backward(2, 8, 1, 65536, 3000, 64, "__half", H100)):  # fmt: skip
        assert short.q_parts == 1 and short.combine is None and short.main.grid[2] == 1
        assert short.launches == (short.delta, short.main, short.convert)
    with pytest.raises(ValueError, match="past 4 parts"):
        plans.plan_backward(1, 8, 1, 4096, 100, 64, "float", H100)
    with pytest.raises(ValueError, match="past 4 parts"):  # varlen packs take one part
        plans.plan_backward(3, 2, 2, 4100, 4100, 64, "float", H100, total=9000)


@pytest.mark.parametrize("d", [64, 128])
def test_float32_small_grids_take_the_half_tiles(d):  # D = 128: the backward only
    """A float32 grid of table tiles that fills at most half the SMs (all of them under causal) takes the small-grid
    tiles, twice the blocks; larger grids, 16-bit calls, an explicit config and a backward that owns dQ keep theirs."""
    fwd = plans.FORWARD_CONFIGS_F32[d]
    small_fwd = plans.SMALL_GRID_FORWARD_F32.get(d, fwd)
    bwd, small_bwd = plans.BACKWARD_CONFIGS_F32[d], plans.SMALL_GRID_BACKWARD_F32[d]
    assert small_fwd.br * 2 == fwd.br or d == 128
    assert small_bwd.bc * 2 == bwd.bc
    causal = Variant(causal=True)
    for b, h, n, variant, small in ((1, 16, 512, Variant(), True), (4, 12, 256, Variant(), False),
                                    (4, 12, 256, causal, True), (4, 12, 512, causal, False)):
        f = plans.plan_forward(b, h, n, d, "float", H100, variant=variant)
        assert f.config == (small_fwd if small else fwd)
        assert f.main.grid[0] * f.main.grid[1] == b * h * cdiv(n, f.config.br)
        k = plans.plan_backward(b, h, h, n, n, d, "float", H100, variant=variant)
        assert k.config == (small_bwd if small else bwd) and not k.own_dq
        assert k.main.grid[0] * k.main.grid[1] == b * h * cdiv(n, k.config.bc)
    assert plans.small_grid(66, False, 132) and not plans.small_grid(67, False, 132)
    assert plans.small_grid(132, True, 132) and not plans.small_grid(133, True, 132)
    assert plans.plan_forward(1, 16, 512, d, "__half", H100).config == plans.FORWARD_CONFIGS[d]
    assert plans.plan_forward(1, 16, 512, d, "float", H100, config=fwd).config == fwd
    own = plans.plan_backward(1, 2, 2, 100, 100, d, "float", H100)  # one key tile: one launch, the table's tile
    assert own.own_dq and own.config == bwd
    names = {n for _, n in plans.instantiations()}
    assert small_fwd.name("float", POL) in names and small_bwd.name("float", POL) in names


def test_float32_forward_stages_score_arrays_where_they_fit():
    """float32 with mask/bias arrays names ArrayScore<..., Br, Bc> and adds a tile a ring slot to the shared memory
    where that fits; the 16-bit forward and parts short of shared memory read the arrays through L1."""
    from cupyflash.variants import ARRAYS

    for v in ARRAYS:
        for d in (64, 128):
            cfg = plans.FORWARD_CONFIGS_F32[d]
            f = plans.plan_forward(4, 16, 2048, d, "float", H100, variant=v)
            assert f.config == cfg
            assert f.main.name == cfg.name("float", v.staged_policy(cfg.br, cfg.bc))
            assert f.main.shared_bytes == cfg.shared_bytes + cfg.stages * v.score_tile_bytes(cfg.br, cfg.bc)
            short = plans.plan_forward(4, 16, 2048, d, "float", RTX4090, variant=v)
            assert short.main.name == short.config.name("float", v.cpp_policy)
            assert short.main.shared_bytes == short.config.shared_bytes <= RTX4090.max_shared_per_block
            half = plans.plan_forward(4, 16, 2048, d, "__nv_bfloat16", H100, variant=v)
            assert half.main.name == plans.FORWARD_CONFIGS[d].name("__nv_bfloat16", v.cpp_policy)
    plain = plans.plan_forward(4, 16, 2048, 64, "float", H100)
    assert plain.main.shared_bytes == plans.FORWARD_CONFIGS_F32[64].shared_bytes


@pytest.mark.parametrize("d, variant, staged", [(64, Variant(bias="float"), True), (64, Variant(mask=True), True),
                                                (64, Variant(mask=True, bias="float"), False),
                                                (128, Variant(mask=True), True), (128, Variant(bias="float"), False)])
def test_float32_backward_stages_score_arrays_where_they_fit(d, variant, staged):
    """The float32 backward stages a tile a Q_i/dO_i ring slot where it fits beside its tiles on an H100 (a float32
    bias at D = 64 fills the 227 KB exactly); the 16-bit backward never does."""
    cfg = plans.BACKWARD_CONFIGS_F32[d]
    b = plans.plan_backward(4, 16, 16, 2048, 2048, d, "float", H100, variant=variant)
    assert b.config == cfg
    tiles = cfg.stages * variant.score_tile_bytes(cfg.br, cfg.bc)
    if staged:
        assert b.main.name == cfg.name("float", variant.staged_policy(cfg.br, cfg.bc))
        assert b.main.shared_bytes == cfg.shared_bytes + tiles <= H100.max_shared_per_block
    else:
        assert cfg.shared_bytes + tiles > H100.max_shared_per_block
        assert b.main.name == cfg.name("float", variant.cpp_policy) and b.main.shared_bytes == cfg.shared_bytes
    half = plans.plan_backward(4, 16, 16, 2048, 2048, d, "__nv_bfloat16", H100, variant=variant)
    assert half.main.name == plans.BACKWARD_CONFIGS[d].name("__nv_bfloat16", variant.cpp_policy)
