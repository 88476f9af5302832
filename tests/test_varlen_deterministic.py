"""``deterministic=`` on the packed (varlen) backward (issue 16) on the CPU: the keyword's checks, the NumPy
backend taking it, and the host side of the ordered dQ turns (cuda_src/dq_turns.cuh) for a pack.

In a varlen launch, a backward block works on sequence b (``seq_geometry``) and query rows i0 within it, and
``dq_turn_slot`` indexes the counters as ``(b * Hq + h) * ceil(p.nq / Br) + i0 / Br`` with p.nq = max_seqlen_q:
the host must allocate B * Hq * ceil(max_seqlen_q / Br) zeroed ints, Br being the query tile of the kernel that
adds into dQ (the tensor-core main kernel's, the portable dK/dV kernel's). The GPU side is
tests/test_varlen_deterministic_gpu.py.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_varlen_reference import make_case

import cupyflash as cf


@pytest.mark.parametrize("bad", [1, 0, "yes", None, np.int32(1)])
def test_deterministic_must_be_bool(rng, bad):
    q, k, v, packing, causal, scale, kw = make_case(rng, "one-long", {}, dtype=np.float32)
    o, lse = cf.attention_varlen_forward(q, k, v, *packing, causal, scale)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cf.attention_varlen_backward(o, q, k, v, o, lse, *packing, causal, scale, deterministic=bad)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cf.attention_varlen_vjp(q, k, v, *packing, causal, scale, deterministic=bad)


def test_deterministic_is_not_a_forward_keyword(rng):
    q, k, v, packing, *_ = make_case(rng, "one-long", {}, dtype=np.float32)
    with pytest.raises(TypeError, match="deterministic"):
        cf.attention_varlen_forward(q, k, v, *packing, deterministic=True)


@pytest.mark.parametrize("spec", [dict(causal=True), dict(window=(4, 2), softcap=1.3, alibi="seq", sinks=True)])
def test_numpy_backend_takes_deterministic(rng, spec):
    """The NumPy backend is deterministic already: the keyword changes nothing, through the vjp too."""
    q, k, v, packing, causal, scale, kw = make_case(rng, "empty-and-one", spec, dtype=np.float32)
    do = rng.standard_normal(q.shape).astype(np.float32)
    o, lse = cf.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw)
    plain = cf.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, **kw)
    det = cf.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, deterministic=True, **kw)
    o_v, vjp = cf.attention_varlen_vjp(q, k, v, *packing, causal, scale, deterministic=np.bool_(True), **kw)
    np.testing.assert_array_equal(o_v, o)
    assert len(det) == len(plain) == (4 if kw["sinks"] is not None else 3)
    for a, b, c in zip(plain, det, vjp(do)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


# ---------------------------------------------------------------------------- the kernels' host plan (no GPU needed)


def _pack_plan_inputs(rng, dtype, d):
    from cupyflash.kernels.family import Geometry
    from cupyflash.varlen_cuda import _kernel_problem
    from cupyflash.varlen_validation import check_varlen

    q, k, v, (cu_q, cu_k, mq, mk), causal, scale, kw = make_case(rng, "one-long", {"causal": True}, dtype=dtype)
    vp = check_varlen(q, k, v, cu_q, cu_k, mq, mk, causal=causal, scale=scale, **kw)
    p = replace(_kernel_problem(vp), d=d)
    hq = p.hq
    strides = {n: (0, d, 2 * d) for n in ("q", "k", "v", "dk", "dv")}
    strides.update({n: (0, d, hq * d) for n in ("o", "dout", "dq")}, lse=(0, p.total_q, 1))
    return vp, p, Geometry(vp.batch_size, strides, ({},), True)


def _turn_counters(plan):
    sizes = {s.field: s for s in plan.scratch}
    assert "dq_turns" in sizes and sizes["dq_turns"].zeroed, "the counters must start at 0 every launch"
    return sizes["dq_turns"].size


def test_portable_turn_counters_cover_every_sequence_query_tile(rng):
    from cupyflash.kernels import portable
    from cupyflash.kernels.params import PARAMS
    from cupyflash.plans import DeviceLimits
    from cupyflash.plans import portable as plans_portable

    vp, p, g = _pack_plan_inputs(rng, np.float32, 64)
    limits = DeviceLimits(90, 132, 227 * 1024)
    plain = portable.backward_plan(p, g, limits, dq_strategy="atomic")
    assert "dq_turns" not in {s.field for s in plain.scratch}
    det = portable.backward_plan(p, g, limits, dq_strategy="atomic", deterministic=True)
    br = plans_portable.backward_plan(portable._shape(p, g), limits, "atomic", p.hq * p.total_q).kv_tile.cols
    assert (vp.batch_size, vp.max_seqlen_q) == (4, 37)
    assert _turn_counters(det) == 4 * p.hq * -(-37 // br)  # B sequences x Hq x ceil(max_seqlen_q / Br)
    kv_rec = np.frombuffer(det.launches[1][1], PARAMS)[0]
    assert kv_rec["dq_head_group"] >= 1 and kv_rec["batch"] == 4 and kv_rec["nq"] == 37
    # The separate dQ pass has no atomics, so no turns.
    sep = portable.backward_plan(p, g, limits, dq_strategy="separate", deterministic=True)
    assert "dq_turns" not in {s.field for s in sep.scratch}


@pytest.mark.parametrize("family", ["mma", "wgmma"])
@pytest.mark.parametrize("d", [64, 128])
def test_tensor_core_turn_counters_cover_every_sequence_query_tile(rng, family, d):
    from cupyflash.kernels import mma, wgmma
    from cupyflash.kernels.params import PARAMS
    from cupyflash.plans import DeviceLimits

    fam = {"mma": mma, "wgmma": wgmma}[family]
    vp, p, g = _pack_plan_inputs(rng, np.float16, d)
    limits = DeviceLimits(90, 132, 227 * 1024)
    assert fam.supports(p, limits) is None
    det = fam.backward_plan(p, g, limits, deterministic=True)
    names = {s.field for s in det.scratch}
    if "dq_accum" not in names:  # the main kernel owns dQ (no atomics): deterministic as it is
        assert "dq_turns" not in names
        return
    br = fam.plans.backward_config(d, limits).br
    assert _turn_counters(det) == vp.batch_size * p.hq * -(-vp.max_seqlen_q // br)
    rec = np.frombuffer(det.launches[1][1], PARAMS)[0]
    assert rec["dq_head_group"] >= 1 and rec["batch"] == vp.batch_size and rec["nq"] == vp.max_seqlen_q
    plain = fam.backward_plan(p, g, limits)
    assert "dq_turns" not in {s.field for s in plain.scratch}
