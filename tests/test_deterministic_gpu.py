"""GPU: ``deterministic=True`` makes the backward bitwise reproducible (issue 16), in every kernel family.

Each case runs one family's backward 50 times on the same inputs (outputs NaN-poisoned before every launch)
and requires every repeat to equal the first bit for bit; the first is also checked against the float64
reference (the bounds of tests/conftest.py), so a fixed but wrong order would not pass. Shapes cover GQA/MQA,
causal, Nq != Nk, D = 64/128/256 (the mma family's key-major and 2-D kernels and its small-smem fallback), a
window, and sinks (dsinks through the API). Every family adds dQ in key-tile order through ordered turns
(cuda_src/dq_turns.cuh); the portable family's separate dQ pass (no atomics at all) is checked too.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, TOL_GRAD, random_qkv, rel_err, requires_gpu, needs_hopper as _needs_hopper

import cupyflash
from cupyflash import reference
from cupyflash.validation import check_backward

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy


REPEATS = 50

# (id, (B, Hq, Hk, Nq, Nk), causal, window)
SHAPES = [
    ("plain", (2, 4, 4, 512, 512), False, None),
    ("gqa-causal-nq<nk", (1, 8, 2, 384, 640), True, None),
    ("mqa-nq>nk", (2, 4, 1, 640, 384), False, None),
    ("causal-nq>nk-ragged", (1, 4, 2, 333, 200), True, None),
    ("window-gqa", (1, 6, 2, 448, 448), False, (96, 32)),
]
FAMILIES = [
    ("portable", "float32", (64, 128, 256)),
    ("portable", "bfloat16", (64,)),
    ("mma", "float16", (64, 128, 256)),
    ("mma", "bfloat16", (128,)),
    pytest.param("wgmma", "bfloat16", (64, 128), marks=_needs_hopper),
    pytest.param("wgmma", "float16", (128,), marks=_needs_hopper),
]


def _cases():
    out = []
    for fam in FAMILIES:
        (kernel, dtype, dims), marks = (fam.values, fam.marks) if hasattr(fam, "values") else (fam, ())
        for i, (name, shape, causal, window) in enumerate(SHAPES):
            d = dims[i % len(dims)]
            out.append(pytest.param(kernel, dtype, shape, causal, window, d, marks=marks,
                                    id=f"{kernel}-{dtype}-{name}-d{d}"))  # fmt: skip
    return out


def _family(kernel):
    from cupyflash.kernels import dispatch

    return dispatch.families()[kernel]


def _repeat_backward(kernel, q, k, v, do, causal, window, **options):
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    p = check_backward(dod, qd, kd, vd, qd, cupy.zeros(qd.shape[:-1], np.float32), causal=causal, window_size=window)
    o, lse = cupyflash.attention_forward(qd, kd, vd, causal, window_size=window, kernel=kernel)
    fam = _family(kernel)
    first = None
    for r in range(REPEATS):
        dq, dk, dv = (cupy.full(x.shape, np.nan, x.dtype) for x in (qd, kd, vd))
        fam.backward(dod, qd, kd, vd, o, lse, dq, dk, dv, p, deterministic=True, **options)
        grads = [x.get() for x in (dq, dk, dv)]
        if first is None:
            first = grads
            continue
        for name, a, b in zip(("dq", "dk", "dv"), first, grads):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{name} differs in repeat {r}"
    return o.get(), lse.get(), first


def _check_accuracy(dtype, q, k, v, do, o, lse, grads, causal, window):
    ro, rlse = reference.attention_forward(q, k, v, causal, window_size=window)
    ref = reference.attention_backward(do, q, k, v, ro, rlse, causal, window_size=window)
    for name, x, r in zip(("dq", "dk", "dv"), grads, ref):
        err = rel_err(x, r)
        assert err <= TOL_GRAD[dtype], f"{name}: relative error {err:.2e} > {TOL_GRAD[dtype]:.0e}"


@pytest.mark.parametrize("kernel, dtype, shape, causal, window, d", _cases())
def test_backward_is_bitwise_reproducible(kernel, dtype, shape, causal, window, d, rng):
    b, hq, hk, nq, nk = shape
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, DTYPES[dtype])
    do = rng.standard_normal(q.shape).astype(DTYPES[dtype])
    o, lse, grads = _repeat_backward(kernel, q, k, v, do, causal, window)
    _check_accuracy(dtype, q, k, v, do, o, lse, grads, causal, window)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_portable_separate_dq_pass_is_reproducible(dtype, rng):
    q, k, v = random_qkv(rng, (1,), 4, 2, 300, 520, 64, DTYPES[dtype])
    do = rng.standard_normal(q.shape).astype(DTYPES[dtype])
    o, lse, grads = _repeat_backward("portable", q, k, v, do, True, None, dq_strategy="separate")
    _check_accuracy(dtype, q, k, v, do, o, lse, grads, True, None)


def test_mma_fallback_tiles_are_reproducible(rng):
    """The small-smem configuration (Br = 64 at D = 64) has its own turn slots per query tile."""
    from cupyflash.plans import mma as mma_plans

    q, k, v = random_qkv(rng, (1,), 4, 2, 300, 520, 64, DTYPES["float16"])
    do = rng.standard_normal(q.shape).astype(np.float16)
    o, lse, grads = _repeat_backward("mma", q, k, v, do, True, None, config=mma_plans.BACKWARD_FALLBACKS[64])
    _check_accuracy("float16", q, k, v, do, o, lse, grads, True, None)


@pytest.mark.parametrize("kernel", ["portable", "mma", pytest.param("wgmma", marks=_needs_hopper)])
def test_api_with_sinks_is_reproducible(kernel, rng):
    """Through the API (dsinks included: summed without atomics), and through attention_vjp's keyword."""
    dtype = np.float32 if kernel == "portable" else np.float16
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (2,), 4, 2, 260, 300, 64, dtype))
    do = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
    sinks = cupy.asarray(rng.uniform(-1.0, 2.0, 4).astype(np.float32))
    o, vjp = cupyflash.attention_vjp(q, k, v, True, sinks=sinks, kernel=kernel, deterministic=True)
    first = [x.get() for x in vjp(do)]
    for _ in range(REPEATS - 1):
        for a, b in zip(first, vjp(do)):
            assert np.array_equal(a.view(np.uint8), b.get().view(np.uint8))
    lse = cupyflash.attention_forward(q, k, v, True, sinks=sinks, kernel=kernel)[1]
    ref = reference.attention_backward(do.get(), q.get(), k.get(), v.get(), o.get(), lse.get(), True, sinks=sinks.get())
    tol = TOL_GRAD["float32" if kernel == "portable" else "float16"]
    for name, x, r in zip(("dq", "dk", "dv", "dsinks"), first, ref):
        assert rel_err(x, r) <= tol, name


# Turns v2 (cuda_src/dq_turns.cuh): descending turns on a reversed key-tile axis (every case above), and the
# grouped-heads grid order (dq_grid_coord) that non-causal problems get once B*Hk passes an SM count / 4:
# one full group and a partial one here. (kernel, dtype, D) reuse instantiations compiled above.
GROUPED = [
    ("portable", "float32", 64),
    ("mma", "float16", 64),  # the key-major kernel
    ("mma", "bfloat16", 128),  # the 2-D kernel
    pytest.param("wgmma", "bfloat16", 64, marks=_needs_hopper),
]


@pytest.mark.parametrize("kernel, dtype, d", GROUPED)
@pytest.mark.parametrize("window", [None, (100, -1)], ids=["nomask", "window-unbounded-right"])
def test_grouped_heads_grid_order_is_reproducible(kernel, dtype, d, window, rng):
    from cupyflash.plans import DeviceLimits, dq_head_group

    sm = DeviceLimits.current().sm_count
    kv_heads = sm // 4 + 7  # B * Hk: groups of sm // 4 heads, the last one partial
    assert 1 < dq_head_group(kv_heads, sm, longest_first=False, heads_first=False) < kv_heads
    q, k, v = random_qkv(rng, (kv_heads,), 2, 1, 200, 328, d, DTYPES[dtype])
    do = rng.standard_normal(q.shape).astype(DTYPES[dtype])
    o, lse, grads = _repeat_backward(kernel, q, k, v, do, False, window)
    _check_accuracy(dtype, q, k, v, do, o, lse, grads, False, window)


# Turns v3 (cuda_src/dq_turns.cuh): thread 0 reads its turn early (dq_turn_peek) and passes it after the next
# step's opening barrier (dq_turn_pass_late), the last step's after the loop. Long walks (a turn every step, many
# blocks racing for the same query tiles) and one-step walks (Nq inside one query tile: every block's only pass
# is the one after its loop, and every key tile waits on the one after it). Instantiations compiled above.
TENSOR_CORE = [
    ("mma", "float16", 64),  # the key-major kernel
    ("mma", "bfloat16", 128),  # the 2-D kernel
    pytest.param("wgmma", "bfloat16", 64, marks=_needs_hopper),
    pytest.param("wgmma", "float16", 128, marks=_needs_hopper),
]
WALKS = [
    ("long-causal", (1, 8, 2, 1536, 1536), True),
    ("long-gqa", (2, 4, 2, 1024, 1280), False),
    ("one-step", (2, 4, 2, 50, 1100), False),
]


@pytest.mark.parametrize("kernel, dtype, d", TENSOR_CORE)
@pytest.mark.parametrize("shape, causal", [w[1:] for w in WALKS], ids=[w[0] for w in WALKS])
def test_early_read_late_pass_is_reproducible(kernel, dtype, d, shape, causal, rng):
    b, hq, hk, nq, nk = shape
    q, k, v = random_qkv(rng, (b,), hq, hk, nq, nk, d, DTYPES[dtype])
    do = rng.standard_normal(q.shape).astype(DTYPES[dtype])
    o, lse, grads = _repeat_backward(kernel, q, k, v, do, causal, None)
    _check_accuracy(dtype, q, k, v, do, o, lse, grads, causal, None)


def test_deterministic_refuses_bias_grad_before_launch(rng):
    """dbias is summed by float atomics: deterministic=True with bias_grad=True says so instead of breaking the
    promise (nothing launches: the gradients' memory is never touched)."""
    import cupy

    q = cupy.asarray(rng.standard_normal((1, 2, 16, 32)).astype(np.float32))
    bias = cupy.asarray(rng.standard_normal((16, 16)).astype(np.float32))
    o, lse = cupyflash.attention_forward(q, q, q, bias=bias)
    with pytest.raises(NotImplementedError, match="deterministic=True with bias_grad=True"):
        cupyflash.attention_backward(o, q, q, q, o, lse, bias=bias, bias_grad=True, deterministic=True)
