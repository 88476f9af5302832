"""Launch plans and dispatch of the Hopper kernels ("wgmma" family), on the CPU."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cupyflash import _dtypes
from cupyflash.kernels import dispatch
from cupyflash.kernels import wgmma as family
from cupyflash.plans import A100, H100, RTX4090, DeviceLimits, cdiv
from cupyflash.plans import mma as mma_plans
from cupyflash.plans import wgmma as plans
from cupyflash.validation import AttentionProblem
from cupyflash.variants import BUILTIN, DROPOUT, Variant

POL = Variant().cpp_policy


def problem(d=64, dtype=_dtypes.FLOAT16, hq=8, hk=2, nq=1000, nk=777, causal=False) -> AttentionProblem:
    return AttentionProblem((2,), hq, hk, nq, nk, d, np.dtype(dtype), Variant(causal), 1.0 / np.sqrt(d), "cupy")


@pytest.mark.parametrize("d, want", [(1, None), (32, None), (33, 64), (64, 64), (72, 128), (96, 128), (128, 128),
                                     (136, None)])  # fmt: skip
def test_padded_head_dim(d, want):
    assert plans.padded_head_dim(d) == want


def test_configs_fit_hopper_and_match_the_kernel_layout():
    for pd, cfg in plans.FORWARD_CONFIGS.items():
        assert cfg.d == pd and cfg.br == 64 * cfg.warpgroups and cfg.threads == 128 * cfg.warpgroups
        assert cfg.bc in (64, 128) and cfg.stages >= 3  # the kernel's static_asserts
        # Q_i, then a ring of K_j and V_j tiles, plus 1 KB to align the base to the swizzle period.
        assert cfg.shared_bytes == (cfg.br + 2 * cfg.stages * cfg.bc) * pd * 2 + 1024
        assert cfg.min_blocks * cfg.shared_bytes <= 228 * 1024  # an H100/H200 SM's shared memory
        assert plans.forward_config(pd, H100, ws=False) == cfg and not cfg.ws and cfg.source == plans.FORWARD_SOURCE
    assert plans.FORWARD_CONFIGS[64].name("__half", POL) == f"wgmma_flash_fwd<__half, 64, 64, 2, 4, 2, {POL}>"


def test_ws_configs_fit_hopper_and_match_the_kernel_layout():
    """The warp-specialised forward (wgmma_flash_fwd_ws): a producer warpgroup beside 2 or 3 consumers, one block
    per SM, Q_i, the K/V ring and its 4 * stages mbarriers (8 bytes each) plus the 1 KB alignment slack."""
    for pd, cfg in plans.WS_FORWARD_CONFIGS.items():
        assert cfg.ws and cfg.d == pd and cfg.source == plans.FORWARD_WS_SOURCE and cfg.min_blocks == 1
        assert cfg.warpgroups in (2, 3) and cfg.br == 64 * cfg.warpgroups and cfg.threads == 128 * (cfg.warpgroups + 1)
        assert cfg.bc in (64, 128) and cfg.stages >= 2
        assert cfg.shared_bytes == (cfg.br + 2 * cfg.stages * cfg.bc) * pd * 2 + 32 * cfg.stages + 1024
        assert cfg.shared_bytes <= H100.max_shared_per_block
        assert plans.forward_config(pd, H100, ws=True) == cfg
    name = plans.WS_FORWARD_CONFIGS[128].name("__half", POL)
    assert name == f"wgmma_flash_fwd_ws<__half, 128, 128, 2, 3, {POL}>"
    for bad in (dict(warpgroups=1), dict(warpgroups=4), dict(min_blocks=2), dict(stages=1)):
        with pytest.raises(ValueError, match="warp-specialised"):
            plans.ForwardConfig(128, bc=128, ws=True, **bad)


def test_ws_default_and_explicit_choice(monkeypatch):
    """WS_DEFAULT picks the forward per head dim (both on, measured faster); ws= or an explicit config picks either;
    calls with score arrays always get the lockstep kernel's array configuration (the warp-specialised one stages no
    score tiles); causal D = 64 calls shorter than WS_MIN_CAUSAL_ROWS_D64 keep the lockstep kernel."""
    assert all(plans.WS_DEFAULT.values())
    causal = Variant(causal=True)
    short, long = plans.WS_MIN_CAUSAL_ROWS_D64 - 1, plans.WS_MIN_CAUSAL_ROWS_D64
    nk = 4 * plans.PERSISTENT_MAX_KEYS  # (rows of many keys: one tile a block, not persistent)

    def config(nq, d, variant=Variant()):
        return plans.plan_forward(1, 8, nq, d, "__half", H100, variant=variant, nk=nk).config

    assert config(short, 64, causal) == plans.FORWARD_CONFIGS[64]
    assert config(long, 64, causal) == plans.WS_FORWARD_CONFIGS[64]
    assert config(short, 64) == plans.WS_FORWARD_CONFIGS[64]
    assert config(short, 128, causal) == plans.WS_FORWARD_CONFIGS[128]
    for pd in (64, 128):
        want = plans.WS_FORWARD_CONFIGS[pd] if plans.WS_DEFAULT[pd] else plans.FORWARD_CONFIGS[pd]
        assert plans.forward_config(pd, H100) == want
        assert plans.forward_config(pd - 8, H100) == want  # padded head dims
        monkeypatch.setattr(plans, "WS_DEFAULT", {**plans.WS_DEFAULT, pd: not plans.WS_DEFAULT[pd]})
        assert plans.forward_config(pd, H100) != want
        monkeypatch.undo()
        arrays = Variant(mask=True)
        assert plans.forward_config(pd, H100, arrays, ws=True) == plans.ARRAY_FORWARD_CONFIGS[pd]
        ws = plans.plan_forward(2, 8, 1000, pd, "__nv_bfloat16", H100, plans.WS_FORWARD_CONFIGS[pd])
        lock = plans.plan_forward(2, 8, 1000, pd, "__nv_bfloat16", H100, plans.FORWARD_CONFIGS[pd])
        for plan, cfg in ((ws, plans.WS_FORWARD_CONFIGS[pd]), (lock, plans.FORWARD_CONFIGS[pd])):
            assert plan.config == cfg and plan.main.source == cfg.source
            assert plan.main.name == cfg.name("__nv_bfloat16", POL) and plan.main.block == (cfg.threads, 1, 1)
            assert plan.main.shared_bytes == cfg.shared_bytes and plan.main.grid == (cdiv(1000, cfg.br), 16, 1)
        with pytest.raises(ValueError, match="mask/bias array"):
            plans.plan_forward(2, 8, 1000, pd, "__nv_bfloat16", H100, plans.WS_FORWARD_CONFIGS[pd], variant=arrays)
    assert plans.forward_config(128, DeviceLimits(compute_capability=90, sm_count=132,
                                                  max_shared_per_block=200 * 1024), ws=True) is None


def test_only_compute_capability_9_0():
    for limits in (A100, RTX4090):
        assert plans.forward_config(64, limits) is None
        assert family.supports(problem(), limits) is not None
    blackwell = DeviceLimits(compute_capability=100, sm_count=148, max_shared_per_block=227 * 1024)
    assert family.supports(problem(), blackwell) is not None  # sm_90a code does not run there


def test_supports():
    assert family.supports(problem(), H100) is None
    assert family.supports(problem(d=128, dtype=_dtypes.BFLOAT16), H100) is None
    assert family.supports(problem(d=40), H100) is None
    assert family.supports(problem(d=32), H100) is not None  # stays with mma: padding to 64 would double the work
    assert family.supports(problem(d=160), H100) is not None
    assert family.supports(problem(d=44), H100) is not None  # rows of D % 8 != 0 elements
    assert family.supports(problem(dtype=_dtypes.FLOAT32), H100) is not None
    small = DeviceLimits(compute_capability=90, sm_count=132, max_shared_per_block=200 * 1024)
    assert family.supports(problem(d=128), small) is not None  # D = 128 needs 225 KB


def test_dispatch_prefers_wgmma_on_hopper_only():
    assert dispatch.select(problem(), H100) is family
    assert dispatch.select(problem(d=32), H100).NAME == "mma"
    assert dispatch.select(problem(), A100).NAME == "mma"
    assert dispatch.select(problem(dtype=_dtypes.FLOAT32), H100).NAME == "mma"  # 3xTF32
    with pytest.raises(TypeError, match="sm_90"):
        dispatch.select(problem(), A100, "wgmma")


def test_backward_configs_fit_hopper_and_match_the_kernel_layout():
    for pd, cfg in plans.BACKWARD_CONFIGS.items():
        assert cfg.d == pd and cfg.bc == 64 * cfg.warpgroups == 128 and cfg.threads == 256
        # dQ_i is split by rows (Br = Bc) or by 64-column slabs (Br = 64, D = 128): the kernel's static_asserts.
        assert cfg.br == cfg.bc or (cfg.br == 64 and pd == 64 * cfg.warpgroups)
        # K_j, V_j, the Q_i/dO_i ring, dS^T, lse and Delta per step, 1 KB to align the base.
        tiles = 2 * cfg.bc * pd + 2 * cfg.stages * cfg.br * pd + cfg.bc * cfg.br
        assert cfg.shared_bytes == 2 * tiles + 8 * cfg.stages * cfg.br + 1024 <= 227 * 1024
        assert plans.backward_config(pd, H100) == cfg
    assert plans.BACKWARD_CONFIGS[64].name("__half", POL) == f"wgmma_flash_bwd<__half, 64, 128, 2, 2, {POL}>"
    for limits in (A100, RTX4090):
        assert plans.backward_config(64, limits) is None
    assert plans.backward_config(32, H100) is None and plans.backward_config(136, H100) is None


def test_plan_backward_wraps_the_mma_helpers():
    cfg = plans.BACKWARD_CONFIGS[128]
    plan = plans.plan_backward(3, 12, 4, 1000, 900, 100, "__nv_bfloat16", H100)
    assert plan.config == cfg and plan.rows == 3 * 12 * 1000
    assert plan.main.grid == (cdiv(900, cfg.bc), 12, 1) and not plan.heads_on_x
    # with the loader warpgroup (the default: test_backward_loader_where_it_applies)
    assert plan.main.block == (384, 1, 1) and plan.main.shared_bytes == cfg.shared_bytes + cfg.loader_bytes
    assert plan.main.source == plans.BACKWARD_SOURCE and plan.main.name == cfg.name("__nv_bfloat16", POL, loader=True)
    ref = mma_plans.plan_backward(3, 12, 4, 1000, 900, 100, "__nv_bfloat16", H100)
    assert (plan.delta, plan.convert) == (ref.delta, ref.convert)  # the mma family's helpers
    causal = plans.plan_backward(3, 12, 4, 1000, 900, 100, "__nv_bfloat16", H100, variant=Variant(True))
    assert causal.main.grid == (12, cdiv(900, cfg.bc), 1) and causal.heads_on_x
    with pytest.raises(ValueError, match="no wgmma backward configuration"):
        plans.plan_backward(1, 1, 1, 10, 10, 64, "__half", A100)


def test_plan_forward_geometry():
    cfg = plans.forward_config(128, H100)  # the default (WS_DEFAULT) at D = 128
    nk = 4 * plans.PERSISTENT_MAX_KEYS  # (rows of many keys: one tile a block, not persistent)
    plan = plans.plan_forward(3, 12, 1000, 72, "__nv_bfloat16", H100, nk=nk)
    assert plan.config == cfg
    assert plan.main.grid == (cdiv(1000, cfg.br), 36, 1) and not plan.heads_on_x
    assert plan.main.block == (cfg.threads, 1, 1) and plan.main.shared_bytes == cfg.shared_bytes
    assert plan.main.source == cfg.source and plan.main.name == cfg.name("__nv_bfloat16", POL)
    causal = plans.plan_forward(3, 12, 1000, 72, "__nv_bfloat16", H100, variant=Variant(True), nk=nk)
    assert causal.main.grid == (36, cdiv(1000, cfg.br), 1) and causal.heads_on_x
    assert causal.heads_on_x == plans._heads_first(True, 36, H100.sm_count)
    # 256 heads: one head's tiles together
    many = plans.plan_forward(16, 16, 1024, 128, "__half", H100, variant=Variant(True), nk=nk)
    assert not many.heads_on_x and many.main.grid == (cdiv(1024, cfg.br), 256, 1)
    with pytest.raises(ValueError, match="no wgmma forward configuration"):
        plans.plan_forward(1, 1, 10, 64, "__half", A100)


def test_instantiations_cover_every_config_once():
    inst = family.instantiations()
    from cupyflash.variants import BUILTIN

    n_configs = len(plans.FORWARD_CONFIGS) + len(plans.WS_FORWARD_CONFIGS) + len(plans.BACKWARD_CONFIGS)
    # dtypes x policies x configs, and the backwards with the loader: D = 128 every policy, D = 64 all but ModScore
    loaders = sum(plans.uses_loader(d, v, own=False) for v in BUILTIN for d in plans.BACKWARD_CONFIGS)
    assert loaders == len(BUILTIN) + sum(v.score_name != "ModScore" for v in BUILTIN) == 15
    # and the persistent ws forwards of every built-in policy (short calls and narrow windows run persistent), with
    # D = 64's few-tiles one for the policies with a mask (causal, window)
    persistent = len(plans.WS_FORWARD_CONFIGS) * len(BUILTIN) + sum(v.causal or v.window is not None for v in BUILTIN)
    # every loader kernel twice: copying by cp.async and by TMA (kTma); every ws forward too (its producer's kTma)
    ws = len(plans.WS_FORWARD_CONFIGS)
    assert len(inst) == len(set(inst)) == 2 * (len(BUILTIN) * (n_configs + ws) + 2 * loaders + 2 * persistent)
    assert sum(src == plans.BACKWARD_SOURCE and name.endswith(", true, true>") for src, name in inst) == 2 * loaders
    ws_tma = [name for src, name in inst if src == plans.FORWARD_WS_SOURCE and name.endswith(", true>")
              and name.rsplit(">, ", 1)[1] in ("false, true>", "true, true>")]  # fmt: skip
    assert len(ws_tma) == 2 * (len(BUILTIN) * ws + persistent)
    assert {src for src, _ in inst} == {plans.FORWARD_SOURCE, plans.FORWARD_WS_SOURCE, plans.BACKWARD_SOURCE}
    from cupyflash.kernels.build import ARCH_SPECIFIC

    assert ARCH_SPECIFIC[plans.FORWARD_SOURCE] == ARCH_SPECIFIC[plans.BACKWARD_SOURCE] == plans.ARCH
    assert ARCH_SPECIFIC[plans.FORWARD_WS_SOURCE] == plans.ARCH


def test_backward_grid_order_under_causal():
    """Heads fastest only while at most half an SM count of kv heads is in flight (plans.wgmma._heads_first)."""
    cfg = plans.BACKWARD_CONFIGS[64]
    few = plans.plan_backward(2, 32, 32, 8192, 8192, 64, "__half", H100, variant=Variant(True))  # 64 kv heads
    many = plans.plan_backward(4, 32, 32, 4096, 4096, 64, "__half", H100, variant=Variant(True))  # 128 kv heads
    assert few.heads_on_x and few.main.grid == (64, cdiv(8192, cfg.bc), 1)
    assert not many.heads_on_x and many.main.grid == (cdiv(4096, cfg.bc), 128, 1)
    assert not plans.plan_backward(2, 32, 32, 8192, 8192, 64, "__half", H100).heads_on_x  # non-causal
    gqa = plans.plan_backward(4, 32, 8, 4096, 4096, 64, "__half", H100, variant=Variant(True))  # 32 kv heads
    assert gqa.heads_on_x
    huge = plans.plan_backward(70000, 1, 1, 64, 64, 64, "__half", H100)  # B*Hk past gridDim.y
    assert huge.heads_on_x and huge.main.grid[0] == 70000


# ---------------------------------------------------------------------- staged mask/bias tiles (issue 17 speed)

STAGED_CASES = [Variant(mask=True), Variant(bias="__nv_bfloat16"), Variant(causal=True, mask=True, bias="__half"),
                Variant(mask=True, bias="float"), Variant(bias="float", dropout=0.1)]  # fmt: skip


@pytest.mark.parametrize("variant", STAGED_CASES, ids=lambda v: f"mask={v.mask}-bias={v.bias}")
@pytest.mark.parametrize("d", [64, 128])
def test_array_plans_stage_score_tiles_where_they_fit(variant, d):
    """A call with mask/bias arrays gets the staged ArrayScore<..., Br, Bc> and the tiles' shared memory (two slots
    in the forward, one per ring slot in the backward) exactly when that fits an H100 block; else the unstaged
    policy and the kernel's own size. The forward's array configuration keeps two blocks per SM at D = 64 with a
    16-bit bias."""
    fwd = plans.plan_forward(2, 4, 1000, d, "__nv_bfloat16", H100, variant=variant).main
    bwd = plans.plan_backward(2, 4, 2, 1000, 1000, d, "__nv_bfloat16", H100, variant=variant).main
    fcfg, bcfg = plans.ARRAY_FORWARD_CONFIGS[d], plans.BACKWARD_CONFIGS[d]
    for main, cfg, slots in ((fwd, fcfg, 2), (bwd, bcfg, bcfg.stages)):
        staged = cfg.shared_bytes + slots * variant.score_tile_bytes(cfg.br, cfg.bc)
        fits = staged <= H100.max_shared_per_block
        assert main.shared_bytes == (staged if fits else cfg.shared_bytes) <= H100.max_shared_per_block
        tile = f", {cfg.br}, {cfg.bc}>"
        assert (tile in main.name) == fits and main.name.count("ArrayScore<") == 1
    assert f"<__nv_bfloat16, {d}, {fcfg.bc}, 2, {fcfg.stages}," in fwd.name  # the array configuration
    if d == 64 and variant.bias != "float":
        assert 2 * fwd.shared_bytes <= 228 * 1024 or (variant.mask and variant.bias)
    # the plain problem keeps the plain configuration (lockstep or warp-specialised, WS_DEFAULT) and policy
    plain = plans.plan_forward(2, 4, 1000, d, "__nv_bfloat16", H100, nk=16384).main  # (not persistent)
    assert plain.name == plans.forward_config(d, H100).name("__nv_bfloat16", Variant().cpp_policy)


def test_score_tile_bytes_by_hand():
    v = Variant(mask=True, bias="__nv_bfloat16")
    assert v.score_tile_bytes(128, 64) == 128 * (64 * 2 + 16) + 128 * (64 + 16)
    assert Variant(bias="float").score_tile_bytes(64, 128) == 64 * (128 * 4 + 16)
    assert Variant(mask=True).score_tile_bytes(64, 128) == 64 * (128 + 16)
    assert Variant(causal=True).score_tile_bytes(64, 64) == 0
    score = "cupyflash::ArrayScore<cupyflash::PlainScore, float, true, false, 128, 64>"
    assert Variant(mask=True).staged_policy(128, 64) == f"cupyflash::Policy<cupyflash::NoMask, {score}>"


from test_compile import NVRTC_REASON  # noqa: E402


@pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON))
def test_score_tile_bytes_match_cpp():
    """Variant.score_tile_bytes is ScoreTile<...>::kBytes of the staged ArrayScore (through NVRTC), so the plans
    ask for the shared memory the kernels lay out."""
    from test_launch_abi import probe_values

    combos = [(v, r, c) for v in STAGED_CASES for r, c in ((128, 64), (64, 128), (128, 128))]
    exprs = [f"cupyflash::score_tile_bytes<cupyflash::{v._score_name((r, c))}>()" for v, r, c in combos]
    raw = probe_values("attention_policy.cuh", exprs, "compute_90a")
    assert raw == [v.score_tile_bytes(r, c) for v, r, c in combos]


@pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON))
def test_ws_layout_matches_cpp():
    """The warp-specialised kernel's threads and ring barriers (through NVRTC) are what its configurations launch and
    lay out, and its setmaxnreg split stays within the register file."""
    from test_launch_abi import probe_values

    cfgs = list(plans.WS_FORWARD_CONFIGS.values())
    exprs = []
    for cfg in cfgs:
        regs = f"WsRegs<{cfg.warpgroups}>"
        exprs += [f"{regs}::kThreads", f"cupyflash::ws::Ring<{cfg.stages}>::kBytes",
                  f"{regs}::kProducerRegs + {cfg.warpgroups} * {regs}::kConsumerRegs", f"{regs}::kLaunchRegs"]
    raw = probe_values(plans.FORWARD_WS_SOURCE, exprs, "compute_90a")
    for i, cfg in enumerate(cfgs):
        threads, ring_bytes, split, launch = raw[4 * i : 4 * i + 4]
        assert threads == cfg.threads and ring_bytes == 32 * cfg.stages
        assert cfg.shared_bytes == (cfg.br + 2 * cfg.stages * cfg.bc) * cfg.d * 2 + ring_bytes + 1024
        assert launch * threads <= 65536 and split <= launch * (cfg.warpgroups + 1)


def test_ws_unsupported_gives_reasons_and_falls_back():
    """The warp-specialised forward takes the built-in policies and user snippets; what it does not take (score
    arrays) has a reason, and a call of it gets the lockstep kernel even where the switch asks for the
    warp-specialised one."""
    from cupyflash import flex

    spec = flex.FlexSpec(mask_mod="q_idx >= kv_idx")
    for v in (*BUILTIN, *DROPOUT, Variant.of(False, None, 0.0, False, True), Variant(flex=spec),
              Variant(causal=True, flex=spec, block_mask=(("bm_size", 64),), block_keys=9000)):  # fmt: skip
        assert plans.ws_unsupported(v) is None, v
        assert plans.forward_config(128, H100, v, ws=True) == plans.WS_FORWARD_CONFIGS[128]
    arrays = plans.ARRAY_FORWARD_CONFIGS
    for v in (Variant(mask=True), Variant(bias="float")):
        assert "mask/bias" in plans.ws_unsupported(v)
        assert plans.forward_config(64, H100, v, ws=True) == arrays[64]
        with pytest.raises(ValueError, match="warp-specialised"):
            plans.plan_forward(1, 2, 100, 64, "__half", H100, plans.WS_FORWARD_CONFIGS[64], variant=v)


def test_narrow_windows_keep_the_lockstep_forward_at_d64():
    """lockstep_by_default for sliding windows: at D = 64 a window of fewer than WS_MIN_WINDOW_KEYS_D64 keys a row
    (both sides bounded; causal is right = 0) keeps the lockstep kernel (its tile in the persistent ws forward,
    WS_FEW_TILES_D64, where the call may run persistent), a wider or one-sided-unbounded one takes the
    warp-specialised forward; D = 128 always takes it."""
    narrow = plans.WS_MIN_WINDOW_KEYS_D64 - 1
    cases = [  # (variant, head dim, warp-specialised?)
        (Variant.of(True, (narrow - 1, 0), 0.0, False, False), 64, False),  # left + 1 keys
        (Variant.of(True, (narrow, 0), 0.0, False, False), 64, True),
        (Variant.of(False, (100, narrow - 101), 0.0, False, False), 64, False),  # left + right + 1
        (Variant.of(False, (100, narrow - 100), 0.0, False, False), 64, True),
        (Variant.of(False, (100, -1), 0.0, False, False), 64, True),  # unbounded on the right
        (Variant.of(True, (255, 0), 30.0, True, False), 64, False),  # softcap and ALiBi alike
        (Variant.of(True, (255, 0), 0.0, False, False), 128, True),
    ]
    for v, d, ws in cases:
        assert plans.lockstep_by_default(d, 16384, v) is not ws, (v, d)
        want = (plans.WS_FORWARD_CONFIGS if ws else plans.FORWARD_CONFIGS)[d]
        got = plans.plan_forward(1, 8, 16384, d, "__nv_bfloat16", H100, variant=replace(v, dropout=0.1)).config
        assert got == want, (v, d)  # (with dropout: not persistent)
        got = plans.plan_forward(1, 8, 16384, d, "__nv_bfloat16", H100, variant=v).config
        assert got == (replace(want, persistent=min(v.window) >= 0 and sum(v.window) < 2048) if ws  # bounded, narrow
                       else plans.WS_FEW_TILES_D64), (v, d)  # fmt: skip


def test_persistent_ws_forward_for_short_rows(monkeypatch):
    """persistent_by_default: a dense ws call whose rows meet at most PERSISTENT_MAX_KEYS keys (Nk, or a window's
    left + right + 1 where both sides are bounded) runs persistent (at most a block an SM, the plain grid's order
    kept in the kernel's dense_tile_coord; Q_EMPTY's 8 bytes more), nothing else does: longer rows, a wide window or
    one unbounded on a side over long rows, varlen packs, block masks, dropout, the lockstep kernel; PERSISTENT =
    False turns it off; an explicit configuration may ask for it on any dense call but not on varlen or block masks."""
    from cupyflash import flex

    most = plans.PERSISTENT_MAX_KEYS
    window = Variant.of(True, (1024, 0), 0.0, False, False)
    base = plans.WS_FORWARD_CONFIGS[128]
    plan = plans.plan_forward(2, 16, 16384, 128, "__nv_bfloat16", H100, variant=window)
    assert plan.config == replace(base, persistent=True)
    assert plan.main.grid == (H100.sm_count, 1, 1) and plan.heads_on_x == plans._heads_first(False, 32, 132, 128)
    assert plan.main.shared_bytes == base.shared_bytes + 8
    assert plan.main.name == base.name("__nv_bfloat16", window.cpp_policy)[:-1] + ", true>"
    small = plans.plan_forward(1, 2, 300, 128, "__nv_bfloat16", H100, variant=window)
    assert small.config.persistent and small.main.grid == (2 * cdiv(300, base.br), 1, 1)  # fewer tiles than SMs
    spec = flex.FlexSpec(mask_mod="q_idx >= kv_idx")
    block = Variant(window=(1024, 0), flex=spec, block_mask=(("bm_size", 64),), block_keys=9000)
    wide = Variant.of(True, (most, 0), 0.0, False, False)  # one key too many
    one_sided = Variant.of(False, (-1, 64), 0.0, False, False)
    causal, full, softcap = Variant(causal=True), Variant(), Variant(softcap=30.0)
    for v, nk in ((Variant.of(True, (most - 1, 0), 0.0, False, False), 16384), (window, 16384), (causal, most),
                  (full, 1024), (softcap, 700), (one_sided, most), (wide, most)):  # fmt: skip
        assert plans.keys_a_row(v, nk) <= most and plans.persistent_by_default(v, False, nk), (v, nk)
        assert plans.plan_forward(8, 16, nk, 128, "__nv_bfloat16", H100, variant=v).config.persistent, (v, nk)
    assert plans.plan_forward(8, 16, 1024, 128, "__nv_bfloat16", H100, variant=full, nk=most + 1).main.grid[1] > 1
    dropout = Variant(causal=True, window=(64, 0), dropout=0.1)
    for v, total, nk in ((causal, None, most + 1), (full, None, 16384), (one_sided, None, 16384),
                         (window, 16384, 16384), (block, None, 16384), (wide, None, 16384), (full, 1024, 1024),
                         (dropout, None, 1024)):  # fmt: skip
        assert not plans.persistent_by_default(v, total is not None, nk), v
        plan = plans.plan_forward(2, 16, nk, 128, "__nv_bfloat16", H100, variant=v, total=total)
        assert not plan.config.persistent and plan.main.grid[1] > 1, v
    with pytest.raises(ValueError, match="persistent"):
        plans.plan_forward(2, 16, 4096, 128, "__half", H100, replace(base, persistent=True), window, total=4096)
    with pytest.raises(ValueError, match="persistent"):
        plans.plan_forward(2, 16, 4096, 128, "__half", H100, replace(base, persistent=True), block)
    with pytest.raises(ValueError, match="persistent form"):
        plans.ForwardConfig(128, bc=128, persistent=True)
    forced = plans.plan_forward(2, 16, 4096, 128, "__half", H100, replace(base, persistent=True), Variant(causal=True))
    assert forced.main.grid == (H100.sm_count, 1, 1)
    monkeypatch.setattr(plans, "PERSISTENT", False)
    assert not plans.plan_forward(2, 16, 16384, 128, "__nv_bfloat16", H100, variant=window).config.persistent
    assert not plans.plan_forward(8, 16, 1024, 128, "__nv_bfloat16", H100, variant=full).config.persistent


def test_snippets_take_the_ws_forward_with_a_block_mask_that_visits_many_keys():
    """lockstep_by_default for user snippets: a mask_mod with its block mask runs on the warp-specialised forward at
    D = 128, and at D = 64 where its rows visit WS_MIN_BLOCK_KEYS_D64 keys or more on average (the measured cases);
    a score_mod, or a mask_mod without a block mask, keeps the lockstep kernel (not timed on the ws one)."""
    from cupyflash import flex

    mask = flex.FlexSpec(mask_mod="doc(b, q_idx) == doc(b, kv_idx)", aux=(flex.AuxSlot("doc", "int", 2),))
    scored = flex.FlexSpec(mask_mod=mask.mask_mod, score_mod="score * 2.f", aux=mask.aux)
    bm = (("bm_size", 64),)
    few, many = plans.WS_MIN_BLOCK_KEYS_D64 - 1, plans.WS_MIN_BLOCK_KEYS_D64
    cases = [  # (variant, head dim, warp-specialised?)
        (Variant(causal=True, flex=mask, block_mask=bm, block_keys=many), 64, True),
        (Variant(causal=True, flex=mask, block_mask=bm, block_keys=few), 64, False),
        (Variant(causal=True, flex=mask, block_mask=bm, block_keys=few), 128, True),
        (Variant(flex=mask, block_mask=bm, block_keys=many), 128, True),
        (Variant(causal=True, flex=mask), 128, False),  # no block mask
        (Variant(causal=True, flex=mask, block_mask=bm), 128, False),  # visited keys not known (0)
        (Variant(causal=True, flex=scored, block_mask=bm, block_keys=many), 128, False),
        (Variant(causal=True, flex=scored, block_mask=bm, block_keys=many), 64, False),
    ]
    for v, d, ws in cases:
        assert plans.lockstep_by_default(d, 16384, v) is not ws, (v, d)
        want = (plans.WS_FORWARD_CONFIGS if ws else plans.FORWARD_CONFIGS)[d]
        assert plans.plan_forward(1, 8, 16384, d, "__nv_bfloat16", H100, variant=v).config == want, (v, d)


@pytest.mark.parametrize("d", [64, 128])
def test_backward_keep_bit_drawer_with_plain_dropout_only(d):
    """Dropout on plain scores gets the backward's keep-bit drawer (a third warpgroup, and its ring in shared memory
    after the kernel's tiles); softcap/ALiBi scores and calls without dropout do not."""
    cfg = plans.BACKWARD_CONFIGS[d]
    for variant in (Variant(dropout=0.1), Variant(causal=True, dropout=0.5), Variant(window=(9, 0), dropout=0.1)):
        plan = plans.plan_backward(2, 8, 2, 1000, 1000, d, "__nv_bfloat16", H100, variant=variant)
        assert plans.uses_drawer(cfg, variant)
        assert plan.main.block == (384, 1, 1) and plan.main.name == cfg.name("__nv_bfloat16", variant.cpp_policy,
                                                                             drawer=True)  # fmt: skip
        assert plan.main.name.endswith(", false, true>")
        assert plan.main.shared_bytes == cfg.shared_bytes + cfg.keep_ring_bytes() <= 227 * 1024
    bits = 8 if d == 64 else 4  # KeepBits<Br / 8>: 8 n8 tiles or fewer fit 32 bits
    assert cfg.keep_ring_bytes() == plans.KEEP_SLOTS * (256 * bits + 16) + 16
    for variant in (Variant(causal=True, softcap=30.0, dropout=0.1), Variant(alibi=True, dropout=0.1)):
        plan = plans.plan_backward(2, 8, 2, 1000, 1000, d, "__nv_bfloat16", H100, variant=variant)
        assert not plans.uses_drawer(cfg, variant)
        assert plan.main.block == (256, 1, 1) and plan.main.name == cfg.name("__nv_bfloat16", variant.cpp_policy)
    assert not plans.uses_drawer(cfg, Variant())  # (it takes the loader instead)
    own = plans.plan_backward(1, 2, 2, 128, 128, d, "__half", H100, variant=Variant(dropout=0.1))
    assert own.own_dq and own.main.name.endswith(", true, true>")


@pytest.mark.parametrize("d", [64, 128])
def test_backward_loader_where_it_applies(d, monkeypatch):
    """The backward's loader warpgroup (a third warpgroup; in shared memory its mbarriers, a second dS^T buffer and
    the dQ tile of its bulk adds) runs every call without dropout, mask/bias arrays or dQ ownership, at D = 64 on plain
    scores, ALiBi alone and softcap alone (the two together spill there); LOADER = False gives every call the lockstep
    kernel."""
    from cupyflash.flex import FlexSpec

    cfg = plans.BACKWARD_CONFIGS[d]
    assert cfg.loader_bytes == cfg.bc * cfg.br * 2 + cfg.br * (4 * d + 32) + 2 * (cfg.stages + 1) * 8 + 144
    doc = FlexSpec(mask_mod="q_idx >= kv_idx")
    plain = (Variant(), Variant(causal=True), Variant(window=(9, 3)), Variant(causal=True, flex=doc,
             block_mask=(("bm_size", 64),), block_bits=True))  # fmt: skip
    plain += (Variant(causal=True, alibi=True), Variant(softcap=30.0))  # AlibiScore, SoftcapScore: LOADER_SCORES_D64
    scored = (Variant(causal=True, softcap=1.0, alibi=True), Variant(window=(9, 3), softcap=5.0, alibi=True))
    score_mod = Variant(flex=FlexSpec(score_mod="score * 0.5f", score_mod_grad="0.5f"))
    without = (Variant(dropout=0.1), Variant(causal=True, mask=True), score_mod)
    for variant in plain + scored + without:
        plan = plans.plan_backward(2, 8, 2, 1000, 1000, d, "__nv_bfloat16", H100, variant=variant)
        loader = variant in plain or (d == 128 and variant in scored)
        assert plans.uses_loader(d, variant, own=False) is loader, variant
        assert plan.main.name.endswith(", false, false, true>") is loader, (variant, plan.main.name)
        if loader:
            assert plan.main.block == (384, 1, 1) and plan.main.name == cfg.name("__nv_bfloat16", variant.cpp_policy,
                                                                                 loader=True)  # fmt: skip
            assert plan.main.shared_bytes == cfg.shared_bytes + cfg.loader_bytes <= 227 * 1024
        monkeypatch.setattr(plans, "LOADER", False)
        plan = plans.plan_backward(2, 8, 2, 1000, 1000, d, "__nv_bfloat16", H100, variant=variant)
        assert not plan.main.name.endswith(", false, false, true>") and not plans.uses_loader(d, variant, False)
        monkeypatch.setattr(plans, "LOADER", True)
    own = plans.plan_backward(1, 2, 2, 128, 128, d, "__half", H100)
    assert own.own_dq and own.main.block == (256, 1, 1) and not plans.uses_loader(d, Variant(), own=True)
    # the kernels CI compiles: lockstep for every policy, and with the loader where the plans give it one
    names = [name for _, name in plans.instantiations(("__half",), plain[:3] + scored + plain[4:])]
    assert sum(name.endswith(", false, false, true>") for name in names) == 5 * 2 + 2


@pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON))
def test_backward_loader_pipe_matches_cpp():
    """The loader's mbarriers take what BackwardConfig.loader_bytes gives them (ws::Pipe<kStages> and ws::Pipe<1>)."""
    from test_launch_abi import probe_values

    for cfg in plans.BACKWARD_CONFIGS.values():
        ring, dq = probe_values(plans.BACKWARD_SOURCE, [f"cupyflash::ws::Pipe<{cfg.stages}>::kBytes",
                                                        "cupyflash::ws::Pipe<1>::kBytes"], "compute_90a")  # fmt: skip
        assert ring + dq + 144 + cfg.bc * cfg.br * 2 + cfg.br * (4 * cfg.d + 32) == cfg.loader_bytes


@pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON))
def test_backward_drawer_layout_matches_cpp():
    """The drawer's ring (slots, bits a lane, barriers) and register split (through NVRTC) are what the plans lay
    out: 384 threads whose launch registers cover the drawer's 24 and the compute warpgroups' share."""
    from test_launch_abi import probe_values

    exprs = ["kKeepSlots", f"cupyflash::ws::Pipe<{plans.KEEP_SLOTS}>::kBytes", "sizeof(cupyflash::mma::KeepBits<16>)",
             "sizeof(cupyflash::mma::KeepBits<8>)", "DrawerRegs::kLaunchRegs", "DrawerRegs::kProducerRegs",
             "DrawerRegs::kConsumerRegs"]  # fmt: skip
    slots, pipe, bits16, bits8, launch, drawer, compute = probe_values(plans.BACKWARD_SOURCE, exprs, "compute_90a")
    assert slots == plans.KEEP_SLOTS and pipe == 16 * slots and (bits16, bits8) == (8, 4)
    assert launch * 384 <= 65536 and drawer + 2 * compute <= 3 * launch and compute == 240


def test_few_key_tiles_at_d64_run_the_lockstep_tile_persistent():
    """few_tiles_by_default: D = 64 calls that lockstep_by_default gives the lockstep kernel (causal rows under
    WS_MIN_CAUSAL_ROWS_D64, windows under WS_MIN_WINDOW_KEYS_D64 keys) run WS_FEW_TILES_D64 (two consumers, Br = 128,
    persistent) where they may run persistent; with dropout, a user snippet, a block mask, varlen or rows of many keys
    they keep the lockstep kernel; D = 128 and longer causal rows are not touched."""
    from cupyflash import flex

    few = plans.WS_FEW_TILES_D64
    assert few.persistent and few.ws and few.br == plans.FORWARD_CONFIGS[64].br == 128 and few.d == 64
    causal, narrow = Variant(causal=True), Variant(causal=True, window=(255, 0))
    rows = plans.WS_MIN_CAUSAL_ROWS_D64
    for v, nq, nk in ((causal, rows - 1, rows - 1), (causal, 300, 300), (narrow, 16384, 16384), (narrow, 100, 5000)):
        plan = plans.plan_forward(4, 8, nq, 64, "__half", H100, variant=v, nk=nk)
        assert plan.config == few and plan.main.grid == (min(H100.sm_count, 32 * cdiv(nq, 128)), 1, 1), (v, nq)
        assert plan.main.name == few.name("__half", v.cpp_policy) and plan.main.block == (384, 1, 1)
        assert (plans.FORWARD_WS_SOURCE, plan.main.name) in family.instantiations()
    spec = flex.FlexSpec(mask_mod="q_idx >= kv_idx")
    lockstep = [(replace(causal, dropout=0.1), 1000, 1000, None), (causal, 1000, 16384, None),  # many keys a row
                (causal, 1000, 1000, 4000), (Variant(causal=True, flex=spec), 1000, 1000, None),  # varlen, snippet
                (Variant(causal=True, flex=spec, block_mask=(("bm_size", 64),), block_keys=500), 1000, 1000, None)]
    for v, nq, nk, total in lockstep:
        assert not plans.few_tiles_by_default(64, nq, v, total is not None, nk), v
        assert not plans.plan_forward(4, 8, nq, 64, "__half", H100, variant=v, nk=nk, total=total).config.ws, v
    for v, d, nq in ((causal, 128, 1000), (narrow, 128, 4096), (causal, 64, rows)):  # the ws tiles, persistent
        got = plans.plan_forward(4, 8, nq, d, "__half", H100, variant=v).config
        assert got == replace(plans.WS_FORWARD_CONFIGS[d], persistent=True), (v, d, nq)
