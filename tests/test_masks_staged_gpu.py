"""The Hopper kernels' staged mask/bias tiles (issue 17 speed; cuda_src/score_tile.cuh) against the float64 reference.

The wgmma forward and backward copy each step's tile of the score arrays into shared memory (cp.async where a row is
contiguous and 16-byte aligned, element by element otherwise) when the plan finds room (plans/tensorcore.py,
``staged_policy``; the float32 mma forward's staging: test_mma_float32_fwd_gpu.py). test_masks_gpu.py covers D = 64
with rows that are mostly misaligned; these cases reach the other paths explicitly: aligned rows (every chunk a
cp.async, zero-filled past Nq and Nk), a mask broadcast over queries (one row for all), a transposed bias (the
element path), a float32 bias beside 16-bit inputs, a mask or a bias alone, full-shape (dbias stored) and broadcast
(dbias added), at D = 64 and 128; each case asserts which of the two kernels staged its tiles. Same accuracy bounds
and poisoned outputs as test_masks_gpu.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import HAS_GPU, requires_gpu, needs_hopper as _needs_hopper
from test_masks_gpu import check, make_inputs, run_family

from cupyflash.plans import DeviceLimits
from cupyflash.plans import wgmma as plans
from cupyflash.validation import check_attention

pytestmark = [requires_gpu, pytest.mark.gpu, _needs_hopper]

if HAS_GPU:
    import cupy

# (id, (B, Hq, Hk, Nq, Nk), spec, how): spec as test_masks_gpu.make_inputs; how: "float32-bias" (the bias in float32
# whatever the inputs), "transposed-bias" (a view whose key axis is strided: the element path).
CASES = [
    ("aligned-full-bias-and-mask-causal", (2, 4, 2, 150, 192),
     dict(causal=True, mask=(2, 4, 150, 192), mask_p=0.85, bias=(2, 4, 150, 192)), None),
    ("aligned-bias-alone-gqa", (2, 4, 2, 130, 256), dict(bias=(2, 4, 130, 256)), None),
    ("query-broadcast-mask-alone-ragged", (2, 4, 4, 150, 170), dict(mask=(2, 1, 1, 170), mask_p=0.8), None),
    ("float32-bias-and-mask-window-softcap", (1, 4, 2, 140, 200),
     dict(window=(40, 10), softcap=30.0, mask=(1, 4, 140, 200), mask_p=0.9, bias=(4, 140, 200)), "float32-bias"),
    # broadcast biases (dbias added into an f32 accumulator): over the batch (the benchmark's case), over batch and
    # queries with misaligned rows
    ("batch-broadcast-bias-aligned", (2, 4, 2, 128, 192), dict(bias=(1, 4, 128, 192)), None),
    ("head-bias-misaligned-causal", (2, 4, 2, 150, 170), dict(causal=True, bias=(4, 150, 170)), None),
    ("transposed-bias-causal-nq>nk", (2, 2, 1, 160, 128), dict(causal=True, bias=(2, 2, 160, 128)),
     "transposed-bias"),
]  # fmt: skip


def _inputs(rng, dtype_name, shape, spec, how, d):
    q, k, v, do, causal, kw = make_inputs(rng, dtype_name, shape, spec, D=d)
    if how == "float32-bias":
        kw["bias"] = kw["bias"].astype(np.float32) * np.float32(1.25)  # values off the 16-bit grid
    return q, k, v, do, causal, kw


def _device_bias(kw, how):
    if how != "transposed-bias":
        return None
    t = cupy.asarray(np.ascontiguousarray(np.swapaxes(kw["bias"], -1, -2)))
    view = t.swapaxes(-1, -2)
    assert view.strides[-1] != view.itemsize
    return view


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,shape,spec,how", CASES, ids=[c[0] for c in CASES])
def test_staged_score_tiles(name, shape, spec, how, dtype_name, d, rng):
    if dtype_name == "float16" and name != CASES[0][0]:
        pytest.skip("float16 runs the first case only (the staging is the same code for both 16-bit types)")
    q, k, v, do, causal, kw = _inputs(rng, dtype_name, shape, spec, how, d)
    # Which kernels stage: the forward always (its array configuration has room), the backward where it fits.
    device_kw = {a: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for a, x in kw.items()}
    p = check_attention(*(cupy.asarray(x) for x in (q, k, v)), causal=causal, **device_kw)
    limits = DeviceLimits.current()
    b, hq, hk, nq, nk = shape
    fwd = plans.plan_forward(b, hq, nq, d, "T", limits, variant=p.variant).main
    bwd = plans.plan_backward(b, hq, hk, nq, nk, d, "T", limits, variant=p.variant).main
    fcfg, bcfg = plans.ARRAY_FORWARD_CONFIGS[d], plans.BACKWARD_CONFIGS[d]
    assert f", {fcfg.br}, {fcfg.bc}>" in fwd.name
    tiles = bcfg.stages * p.variant.score_tile_bytes(bcfg.br, bcfg.bc)
    bwd_staged = bcfg.shared_bytes + tiles <= limits.max_shared_per_block
    assert (f", {bcfg.br}, {bcfg.bc}>" in bwd.name) == bwd_staged
    if how == "transposed-bias":
        view = _device_bias(kw, how)
        # run_family converts kw's host arrays; hand it the strided device view through a host copy of its values
        # and check the layout the kernels see is the strided one
        kw = {**kw, "bias": cupy.asnumpy(view)}
        o, lse, grads = _run_with_device_bias(q, k, v, do, causal, kw, view)
    else:
        o, lse, grads = run_family("wgmma", q, k, v, do, causal, kw)
    check("wgmma", dtype_name, q, k, v, do, causal, kw, o, lse, grads)


def _run_with_device_bias(q, k, v, do, causal, kw, bias_view):
    """Through the public API with the strided bias view itself (never copied), dbias in its shape and dtype."""
    import cupyflash

    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    extra = {a: cupy.asarray(kw[a]) for a in ("mask", "alibi_slopes", "sinks") if kw.get(a) is not None}
    o, lse = cupyflash.attention_forward(qd, kd, vd, causal, kernel="wgmma", bias=bias_view,
                                         window_size=kw["window_size"], softcap=kw["softcap"], **extra)  # fmt: skip
    grads = cupyflash.attention_backward(dod, qd, kd, vd, o, lse, causal, kernel="wgmma", bias=bias_view,
                                         bias_grad=True, window_size=kw["window_size"], softcap=kw["softcap"],
                                         **extra)  # fmt: skip
    assert grads[3].shape == bias_view.shape and grads[3].dtype == bias_view.dtype
    return o, lse, list(grads)
