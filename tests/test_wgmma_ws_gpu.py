"""GPU: the warp-specialised Hopper forward (``wgmma_flash_fwd_ws``, cuda_src/wgmma_forward_ws.cu) against the
float64 reference and the lockstep forward (``wgmma_flash_fwd``).

Each kernel is reached explicitly through the wgmma family's entry point with a configuration
(``plans.wgmma.WS_FORWARD_CONFIGS`` / ``FORWARD_CONFIGS``): the warp-specialised forward is opt-in and the default
dispatch does not reach it. Outputs are NaN-poisoned before each launch, inputs are fresh random ones.

- Hangs: a deadlocked ring or turn barrier would hang the process, so the first test is a tiny smoke launch of
  each configuration, and every launch here waits for its completion event with a deadline (``_finish``): past it
  the test process prints which launch hung and exits at once (a hung kernel cannot be cancelled).
- Accuracy: o by FlashAttention's criterion (test_variants_gpu.assert_fa_criterion: the error against the float64
  reference at most 2x that of a same-dtype naive implementation, plus the dtype's floor); lse within 2e-3 and
  -inf exactly where the reference has it (rows that see no key: o = 0); with dropout (the naive implementation
  has none) the fixed relative bound of tests/conftest.py.
- Against the lockstep kernel on the same inputs: o within the same criterion (its distance to the lockstep o at
  most 2x the naive implementation's error plus the floor; at D = 128 both tile Br = Bc = 128 and run the same
  per-warpgroup arithmetic, at D = 64 the tiles differ), lse within 1e-5 relative, -inf at the same rows.

The instantiations the module launches are compiled in parallel once the smoke test has passed.
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, TOL_OUT, random_qkv, rel_err, requires_gpu, needs_hopper as _needs_hopper
from test_variants_gpu import assert_fa_criterion, fa_floor, naive_attention
from test_varlen_gpu import poison_pool

from cupyflash import reference
from cupyflash.plans import wgmma as plans
from cupyflash.validation import check_attention
from cupyflash.variants import Variant

if HAS_GPU:
    import cupy

pytestmark = [requires_gpu, pytest.mark.gpu, _needs_hopper]

WS = plans.WS_FORWARD_CONFIGS
LOCKSTEP = plans.FORWARD_CONFIGS
CTYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}

#: Seconds a launch may take once compiled (the largest problem here runs in milliseconds).
DEADLINE_S = 30.0


def _finish(what: str) -> None:
    """Wait for the work queued so far, or end the process if it does not finish in DEADLINE_S (a deadlock)."""
    done = cupy.cuda.Event(block=False, disable_timing=True)
    done.record()
    start = time.monotonic()
    while not done.done:
        if time.monotonic() - start > DEADLINE_S:
            print(f"\nFATAL: {what} did not finish in {DEADLINE_S:.0f} s: the warp-specialised forward hangs "
                  "(deadlock); exiting", file=sys.stderr, flush=True)  # fmt: skip
            os._exit(3)
        time.sleep(0.001)


def _forward(config, q, k, v, p, arrays=None, seed=None):
    """o, lse of the wgmma family's forward with ``config``, both poisoned with NaN before the launch."""
    from cupyflash.kernels import build, wgmma

    o = cupy.full(q.shape, np.nan, q.dtype)
    lse = cupy.full(q.shape[:-1], np.nan, np.float32)
    opts = {"config": config}
    if seed is not None:
        opts["dropout_seed"] = seed
    name = config.name(CTYPES[np.dtype(q.dtype).name], p.variant.cpp_policy)
    build.get_function(config.source, name)  # compiled before the deadline starts
    if config.ws:  # and its producer by TMA (kTma), which the plan takes where the views have maps
        build.get_function(config.source, config.name(CTYPES[np.dtype(q.dtype).name], p.variant.cpp_policy, True))
    wgmma.forward(q, k, v, o, lse, p, variant_arrays=arrays or {}, **opts)
    _finish(f"{name} on q {q.shape}, k {k.shape}")
    return o, lse


def _host(x):
    return cupy.asnumpy(x).astype(np.float64)


def _check(dtype_name, q, k, v, causal, scale, kw, got, lock, dropout=None):
    """got = (o, lse) of the warp-specialised kernel, lock = the lockstep one's, against the reference and each
    other."""
    o, lse = (_host(x) for x in got)
    lo, llse = (_host(x) for x in lock)
    for name, x, y in (("ws", o, lse), ("lockstep", lo, llse)):
        assert np.isfinite(x).all(), f"{name} o has NaN/inf (a row left unwritten?)"
        assert not np.isnan(y).any() and not np.isposinf(y).any(), f"{name} lse has NaN/+inf"
    drop = {} if dropout is None else {"dropout_p": dropout[0], "dropout_seed": dropout[1]}
    ro, rlse = reference.attention_forward(q, k, v, causal, scale, **kw, **drop)
    masked = np.isneginf(rlse)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    np.testing.assert_array_equal(np.isneginf(llse), masked)
    np.testing.assert_allclose(lse[~masked], rlse[~masked], rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose(lse[~masked], llse[~masked], rtol=1e-5, atol=1e-5)
    if masked.any():
        assert np.all(o[masked] == 0), "rows that see no key must give o = 0"
    if dropout is not None:  # the naive implementation has no dropout: the fixed bound
        assert rel_err(o, ro) <= TOL_OUT[dtype_name], f"o: rel err {rel_err(o, ro):.3g}"
        assert rel_err(o, lo) <= TOL_OUT[dtype_name], f"o vs lockstep: rel err {rel_err(o, lo):.3g}"
        return
    naive_o = naive_attention(q, k, v, np.zeros(q.shape, q.dtype), causal, scale, kw, dtype_name)[0]
    assert_fa_criterion(f"ws {dtype_name} o", o, ro, naive_o, dtype_name, 2)
    # the lockstep kernel's o as the reference point: within the same bound of it
    bound = 2 * float(np.abs(naive_o - ro).max(initial=0.0)) + fa_floor(ro, dtype_name)
    diff = float(np.abs(o - lo).max(initial=0.0))
    assert diff <= bound, f"ws o differs from the lockstep o by {diff:.3g} > {bound:.3g}"


def _run(d, dtype_name, shape, causal, rng, scale=None, kw=None, dropout=None, logits=1.0):
    """Both kernels (the warp-specialised and the lockstep configuration of the padded head dim) on one problem."""
    kw = {"window_size": None, "softcap": 0.0, "alibi_slopes": None, "sinks": None, **(kw or {})}
    b, hq, hk, nq, nk = shape
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, DTYPES[dtype_name], logits)
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    kwd = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    drop = {} if dropout is None else {"dropout_p": dropout[0]}
    p = check_attention(qd, kd, vd, causal=causal, scale=scale, **kwd, **drop)
    assert plans.ws_unsupported(p.variant) is None
    arrays = {n: kwd[key] for n, key in (("alibi", "alibi_slopes"), ("sinks", "sinks")) if kwd[key] is not None}
    seed = None if dropout is None else dropout[1]
    pd = plans.padded_head_dim(d)
    got = _forward(WS[pd], qd, kd, vd, p, arrays, seed)
    lock = _forward(LOCKSTEP[pd], qd, kd, vd, p, arrays, seed)
    _check(dtype_name, q, k, v, causal, scale, kw, got, lock, dropout)


# ---------------------------------------------------------------------------- cases

# (B, Hq, Hk, Nq, Nk), D, causal; each case runs at D and through the other padded head dim (_other_d)
SHAPES = [
    ((1, 2, 2, 1, 1), 128, False),
    ((1, 2, 2, 77, 77), 128, True),
    ((2, 2, 2, 1000, 1000), 128, True),
    ((2, 4, 2, 100, 300), 72, True),  # Nq < Nk, GQA; D pads (to 128; 40 to 64)
    ((2, 8, 2, 300, 100), 128, False),  # Nq > Nk, GQA
    ((1, 4, 1, 1, 1000), 128, False),  # MQA, one query
    ((1, 3, 1, 150, 40), 128, True),  # the first 110 rows see no key
    ((1, 2, 1, 300, 40), 128, True),  # whole query tiles see no key: no key tile at all
    ((1, 2, 2, 2048, 2048), 128, False),  # 16 key tiles: the ring's barriers through many phases
]  # fmt: skip


def _other_d(d):
    return 40 if d == 72 else 64


# (id, (B, Hq, Hk, Nq, Nk), causal, keywords; "alibi": "head" or "batch" slopes, sinks: True)
VARIANTS = [
    ("window-16-16", (2, 2, 2, 256, 256), False, dict(window_size=(16, 16))),
    ("window-0-0-nq>nk", (2, 2, 1, 200, 77), False, dict(window_size=(0, 0))),
    ("causal-window-64", (1, 2, 2, 1000, 1000), True, dict(window_size=(64, -1))),
    ("softcap-30-causal-nq<nk", (1, 2, 2, 150, 300), True, dict(softcap=30.0)),
    ("alibi-head", (2, 4, 4, 200, 200), False, dict(alibi_slopes="head")),
    ("alibi-batch-causal", (2, 2, 2, 130, 260), True, dict(alibi_slopes="batch")),
    ("sinks", (2, 2, 2, 200, 200), False, dict(sinks=True)),
    ("sinks-causal-nq>nk", (2, 3, 1, 250, 100), True, dict(sinks=True)),  # keyless rows: the sink only
    ("window-softcap-alibi-sinks-gqa", (2, 4, 2, 180, 220), False,
     dict(window_size=(32, 8), softcap=30.0, alibi_slopes="batch", sinks=True)),
]  # fmt: skip

# (id, (B, Hq, Hk, Nq, Nk), causal, keywords), dropout p = 0.17
DROPOUT_CASES = [
    ("plain", (2, 2, 2, 333, 333), False, {}),
    ("causal-softcap-gqa", (1, 4, 2, 300, 300), True, dict(softcap=30.0)),
]  # fmt: skip

#: Variants run in bfloat16 at D = 128 and in float16 at D = 64.
VARIANT_DTYPE = {128: "bfloat16", 64: "float16"}

# The persistent form (ForwardConfig.persistent): (id, (B, Hq, Hk, Nq, Nk), causal, keywords, dropout p, SMs). The
# grid is min(query tiles, SMs): the few SMs given here make each block walk many query tiles, the ring's index and
# the turns running on across them.
PERSISTENT_CASES = [
    ("causal-window-64", (2, 4, 2, 700, 700), True, dict(window_size=(64, 0)), 0.0, 5),
    ("window-nq>nk-keyless-tiles", (1, 3, 1, 600, 100), True, dict(window_size=(40, 0)), 0.0, 4),  # rows < 500: none
    ("window-softcap-alibi-sinks-gqa", (2, 4, 2, 300, 500), False,
     dict(window_size=(32, 8), softcap=30.0, alibi_slopes="batch", sinks=True), 0.0, 3),
    ("window-dropout", (2, 2, 2, 333, 333), False, dict(window_size=(50, 10)), 0.17, 3),
    ("causal", (2, 2, 2, 900, 900), True, {}, 0.0, 7),  # short dense rows (persistent_by_default)
    ("full-one-sm", (1, 3, 3, 400, 257), False, {}, 0.0, 1),
]  # fmt: skip


def _variant_kw(rng, spec, b, hq):
    kw = dict(spec)
    if kw.get("alibi_slopes") == "head":
        kw["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)).astype(np.float32)
    elif kw.get("alibi_slopes") == "batch":
        kw["alibi_slopes"] = rng.uniform(0.01, 0.3, (b, hq)).astype(np.float32)
    if kw.get("sinks"):
        kw["sinks"] = rng.uniform(-1.0, 2.5, hq).astype(np.float32)
    return kw


def _instantiations() -> set[tuple[str, str]]:
    """(source, name) of every kernel the module launches."""
    def policy(causal, kw, dropout=0.0):
        return Variant.of(causal, kw.get("window_size"), kw.get("softcap", 0.0), "alibi_slopes" in kw, "sinks" in kw,
                          dropout=dropout).cpp_policy  # fmt: skip

    want = []  # (padded D, dtype, policy)
    for _, _, causal in SHAPES:
        want += [(pd, dt, policy(causal, {})) for pd in (64, 128) for dt in CTYPES]
    for _, _, causal, kw in VARIANTS:
        want += [(pd, dt, policy(causal, kw)) for pd, dt in VARIANT_DTYPE.items()]
    for _, _, causal, kw in DROPOUT_CASES:
        want += [(pd, "bfloat16", policy(causal, kw, 0.17)) for pd in (64, 128)]
    want += [(pd, "bfloat16", policy(causal, {}, 0.17)) for pd in (64, 128) for causal in (False, True)]
    out = {(cfg.source, cfg.name(CTYPES[dt], pol)) for pd, dt, pol in want for cfg in (WS[pd], LOCKSTEP[pd])}
    for _, _, causal, kw, dropout, _ in PERSISTENT_CASES:
        pol = policy(causal, kw, dropout)
        out |= {(cfg.source, cfg.name(CTYPES[dt], pol)) for pd, dt in VARIANT_DTYPE.items()
                for cfg in (WS[pd], LOCKSTEP[pd], replace(WS[pd], persistent=True))}  # fmt: skip
        out |= {(cfg.source, cfg.name(CTYPES[VARIANT_DTYPE[64]], pol))
                for cfg in (plans.WS_FEW_TILES_D64, replace(plans.WS_FEW_TILES_D64, persistent=False))}  # fmt: skip
    # the API's few-tiles call (test_persistent_by_default_through_the_api)
    out |= {(plans.FORWARD_WS_SOURCE, plans.WS_FEW_TILES_D64.name(CTYPES["bfloat16"], policy(True, {})))}
    # the ws forwards' producer by TMA too (kTma: the plans' default on dense calls with mappable views)
    out |= {(source, name[:-1] + (", false, true>" if name.endswith(">>") else ", true>"))
            for source, name in out if source == plans.FORWARD_WS_SOURCE}
    return out


@pytest.fixture(scope="module")
def compiled():
    """Every instantiation of the module, compiled in parallel (NVRTC runs outside the GIL). A failure is left to
    the test that launches the kernel, which compiles it again and reports it."""
    from cupyflash.kernels import build

    def build_one(job):
        try:
            build.get_function(*job)
        except Exception:  # noqa: BLE001 - reported by the launching test
            pass

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(build_one, sorted(_instantiations())))


# ---------------------------------------------------------------------------- tests (the smoke test first)


@pytest.mark.parametrize("d", [128, 64])
def test_smoke_no_hang(d, rng):
    """One tiny launch of each warp-specialised configuration (two key tiles, causal): a deadlock shows here, in
    seconds, before anything else runs."""
    _run(d, "bfloat16", (1, 2, 2, 77, 200), True, rng)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", SHAPES, ids=lambda c: f"b{c[0][0]}-h{c[0][1]}x{c[0][2]}-{c[0][3]}x{c[0][4]}-"
                         f"d{c[1]}-{'causal' if c[2] else 'full'}")  # fmt: skip
@pytest.mark.parametrize("at_64", [False, True], ids=["d128", "d64"])
def test_shapes(at_64, case, dtype_name, rng, compiled):
    shape, d, causal = case
    _run(_other_d(d) if at_64 else d, dtype_name, shape, causal, rng)


@pytest.mark.parametrize("d", [128, 64])
def test_large_logits(d, rng, compiled):
    _run(d, "bfloat16", (1, 2, 2, 300, 300), False, rng, scale=10.0)


@pytest.mark.parametrize("case", VARIANTS, ids=[c[0] for c in VARIANTS])
@pytest.mark.parametrize("d", [128, 64])
def test_variants(d, case, rng, compiled):
    _, shape, causal, spec = case
    _run(d, VARIANT_DTYPE[d], shape, causal, rng, kw=_variant_kw(rng, spec, shape[0], shape[1]))


@pytest.mark.parametrize("case", DROPOUT_CASES, ids=[c[0] for c in DROPOUT_CASES])
@pytest.mark.parametrize("d", [128, 64])
def test_dropout(d, case, rng, compiled):
    """Dropout (issue 16): the same seed draws the same keep bits as the lockstep kernel and the reference."""
    _, shape, causal, kw = case
    _run(d, "bfloat16", shape, causal, rng, kw=kw, dropout=(0.17, int(rng.integers(0, 2**62))))


@pytest.fixture
def ws_switch(monkeypatch):
    """on(flag): the plans' opt-in switch (WS_DEFAULT) set at both head dims, the host's plan caches cleared so
    that no plan of the other setting is reused (and cleared again afterwards)."""
    from cupyflash import cuda_backend, varlen_cuda

    caches = (cuda_backend._forward_cache, varlen_cuda._forward_cache)

    def on(flag: bool) -> None:
        monkeypatch.setattr(plans, "WS_DEFAULT", {64: flag, 128: flag})
        for cache in caches:
            cache.clear()

    yield on
    monkeypatch.undo()
    for cache in caches:
        cache.clear()


def test_switch_through_the_api(rng, ws_switch, compiled):
    """The public API runs the lockstep kernel by default and the warp-specialised one with the switch on, for
    dense calls and varlen packs (bit for bit what the configuration reached explicitly gives)."""
    import cupyflash

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (2,), 4, 2, 333, 517, 128, DTYPES["bfloat16"]))
    p = check_attention(q, k, v, causal=True)
    for flag, cfg in ((False, LOCKSTEP[128]), (True, WS[128])):
        ws_switch(flag)
        o, lse = cupyflash.attention_forward(q, k, v, causal=True, kernel="wgmma")
        _finish("the API's forward")
        o2, lse2 = _forward(cfg, q, k, v, p)
        assert cupy.asnumpy(o).tobytes() == cupy.asnumpy(o2).tobytes(), f"switch {flag}: o"
        assert cupy.asnumpy(lse).tobytes() == cupy.asnumpy(lse2).tobytes(), f"switch {flag}: lse"
    # a varlen pack with the switch on, against the per-sequence reference
    lq, lk = [33, 190, 1, 64], [70, 100, 9, 200]
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    dtype = DTYPES["bfloat16"]
    q, k, v = (rng.standard_normal((int(cu[-1]), h, 128)).astype(dtype) for cu, h in ((cu_q, 4), (cu_k, 1), (cu_k, 1)))
    poison_pool((q.shape, q.dtype), ((4, q.shape[0]), np.float32))  # the API's outputs start as NaN
    o, lse = cupyflash.attention_varlen_forward(*(cupy.asarray(x) for x in (q, k, v, cu_q, cu_k)), max(lq), max(lk),
                                                True, kernel="wgmma")  # fmt: skip
    _finish("the varlen forward")
    kw = {"window_size": None, "softcap": 0.0, "alibi_slopes": None, "sinks": None}
    ro, rlse = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, max(lq), max(lk), True, None, **kw)
    o, lse = _host(o), _host(lse)
    masked = np.isneginf(rlse)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    np.testing.assert_allclose(lse[~masked], rlse[~masked], rtol=2e-3, atol=1e-4)
    assert rel_err(o, ro) <= TOL_OUT["bfloat16"], f"varlen o: rel err {rel_err(o, ro):.3g}"


@pytest.mark.parametrize("softcap", [0.0, 30.0], ids=["masks", "bits"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_dropout_keep_bits_exact(d, causal, softcap, rng, compiled):
    """Every keep bit of the warp-specialised forward equals dropout_mask's (the fixed-bound o check above would
    miss a few wrong bits): with V one-hot on the keys of a 64-key block m (v[j] = e_(j - 64 m) there, 0
    elsewhere), o[i, j - 64 m] = P_ij * keep_ij / ((1 - p) l_i), nonzero exactly where P_ij is kept. One launch per
    block covers every (query, key) of the problem: 192-row (D = 64) or 128-row query tiles, every consumer warp's
    strip, three key tiles through the ring's slots, GQA heads and two batches. Both keep forms: plain scores AND
    packed P with PRMT-built masks (dropout_msbs), softcap's zero P by keep bits (dropout_bits)."""
    from cupyflash import dropout_mask

    b, hq, hk, nq, nk = 2, 4, 2, 450, 300
    q, k, _ = random_qkv(rng, (b,), hq, hk, nq, nk, d, DTYPES["bfloat16"])
    qd, kd = cupy.asarray(q), cupy.asarray(k)
    seed = int(rng.integers(0, 2**62))
    p = check_attention(qd, kd, kd, causal=causal, softcap=softcap, dropout_p=0.17)
    want = dropout_mask(b, hq, nq, nk, 0.17, seed)
    if causal:  # bottom-right aligned: key j is visible to query i iff j <= i + nk - nq
        want &= np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
    pd = plans.padded_head_dim(d)
    for m in range(-(-nk // 64)):
        keys = np.arange(64 * m, min(64 * m + 64, nk))
        v = np.zeros((b, hk, nk, d), np.float32)
        v[:, :, keys, keys - 64 * m] = 1.0
        o, _ = _forward(WS[pd], qd, kd, cupy.asarray(v.astype(DTYPES["bfloat16"])), p, seed=seed)
        got = cupy.asnumpy(o).astype(np.float32)[..., : len(keys)] != 0
        np.testing.assert_array_equal(got, want[..., keys], err_msg=f"keep bits of keys {keys[0]}..{keys[-1]}")


@pytest.fixture
def few_sms(monkeypatch):
    """on(n): the device limits the plans read (plans._cache) with n SMs, so that a persistent grid is n blocks."""
    from cupyflash import plans as plans_pkg

    dev = cupy.cuda.Device().id

    def on(n: int) -> None:
        monkeypatch.setitem(plans_pkg._cache, dev, replace(plans_pkg.DeviceLimits.current(), sm_count=n))

    yield on
    monkeypatch.undo()


#: The persistent forms: each ws tile, and at D = 64 the lockstep kernel's tile (two consumers, plans.WS_FEW_TILES_D64).
PERSISTENT_FORMS = {(128, "ws"): replace(WS[128], persistent=True), (64, "ws"): replace(WS[64], persistent=True),
                    (64, "few-tiles"): plans.WS_FEW_TILES_D64}  # fmt: skip


@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=[c[0] for c in PERSISTENT_CASES])
@pytest.mark.parametrize("d,form", list(PERSISTENT_FORMS), ids=[f"{d}-{f}" for d, f in PERSISTENT_FORMS])
def test_persistent(d, form, case, rng, few_sms, compiled):
    """The persistent ws forward (each of a few blocks walks many query tiles; some with no key tile at all) gives
    o and lse bit for bit equal to the one-tile-a-block ws kernel of its tile (the same arithmetic a tile), and so
    passes the reference checks of _check against the lockstep kernel too."""
    _, shape, causal, spec, dropout_p, sms = case
    dtype_name = VARIANT_DTYPE[d]
    b, hq, hk, nq, nk = shape
    kw = {"window_size": None, "softcap": 0.0, "alibi_slopes": None, "sinks": None,
          **_variant_kw(rng, spec, b, hq)}  # fmt: skip
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, DTYPES[dtype_name])
    qd, kd, vd = (cupy.asarray(x) for x in (q, k, v))
    kwd = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    p = check_attention(qd, kd, vd, causal=causal, dropout_p=dropout_p, **kwd)
    arrays = {n: kwd[key] for n, key in (("alibi", "alibi_slopes"), ("sinks", "sinks")) if kwd[key] is not None}
    seed = int(rng.integers(0, 2**62)) if dropout_p else None
    few_sms(sms)
    cfg = PERSISTENT_FORMS[d, form]
    plan = plans.plan_forward(b, hq, nq, d, CTYPES[dtype_name], plans.DeviceLimits.current(), cfg, p.variant)
    items = b * hq * -(-nq // cfg.br)
    assert plan.main.grid == (min(items, sms), 1, 1) and items > 2 * sms, plan.main.grid
    got = _forward(cfg, qd, kd, vd, p, arrays, seed)
    one = _forward(replace(cfg, persistent=False), qd, kd, vd, p, arrays, seed)
    for name, x, y in zip(("o", "lse"), got, one):
        assert cupy.asnumpy(x).tobytes() == cupy.asnumpy(y).tobytes(), f"persistent {name} differs"
    lock = _forward(LOCKSTEP[d], qd, kd, vd, p, arrays, seed)
    _check(dtype_name, q, k, v, causal, None, kw, got, lock, None if seed is None else (dropout_p, seed))


@pytest.mark.parametrize("d,window", [(128, (64, 0)), (128, None), (64, None)],
                         ids=["window", "short-causal", "short-causal-d64-few-tiles"])  # fmt: skip
def test_persistent_by_default_through_the_api(d, window, rng, compiled):
    """A dense call whose rows meet few keys (a sliding window, or a short sequence) takes the persistent form
    through the API (bit for bit what the configuration reached explicitly gives; at D = 64 causal, the lockstep
    kernel's tile: WS_FEW_TILES_D64); longer rows do not."""
    import cupyflash

    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (2,), 4, 2, 700, 700, d, DTYPES["bfloat16"]))
    p = check_attention(q, k, v, causal=True, window_size=window)
    limits = plans.DeviceLimits.current()
    plan = plans.plan_forward(2, 4, 700, d, CTYPES["bfloat16"], limits, variant=p.variant, nk=700)
    want = plans.WS_FEW_TILES_D64 if d == 64 else replace(WS[128], persistent=True)
    assert plan.config == want and plan.main.grid[1:] == (1, 1)
    long = plans.plan_forward(2, 4, 700, d, CTYPES["bfloat16"], limits, variant=p.variant,
                              nk=plans.PERSISTENT_MAX_KEYS + 1)  # fmt: skip
    assert long.config.persistent == (window is not None)
    o, lse = cupyflash.attention_forward(q, k, v, causal=True, window_size=window, kernel="wgmma")
    _finish("the API's forward")
    o2, lse2 = _forward(want, q, k, v, p)
    assert cupy.asnumpy(o).tobytes() == cupy.asnumpy(o2).tobytes()
    assert cupy.asnumpy(lse).tobytes() == cupy.asnumpy(lse2).tobytes()
