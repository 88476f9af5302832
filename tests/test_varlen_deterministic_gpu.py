"""GPU: ``deterministic=True`` makes the packed (varlen) backward bitwise reproducible (issue 16), in every family.

Each case runs one family's ``attention_varlen_backward`` REPEATS times on the same pack, the gradients' memory
NaN-poisoned through the pool before every call (tests/test_varlen_gpu.poison_pool), and requires every repeat to
equal the first bit for bit; the first is also checked against the float64 reference with test_varlen_gpu's
criterion, so a fixed but wrong order (or a turn counter shared by two sequences) would not pass. The packs have
long-tailed lengths: empty sequences, a 1-row one, ones longer than every tile, Nq_b != Nk_b. The dQ adds take
ordered turns per (sequence, query head, query tile) (cuda_src/dq_turns.cuh, the key-tile axis reversed per
sequence); dsinks is summed by CuPy reductions.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import HAS_GPU, requires_gpu, needs_hopper as _needs_hopper
from test_varlen_gpu import _dev, assert_pack_close, make_pack, poison_pool

import cupyflash

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

REPEATS = 20

# (id, query lengths, key lengths, Hq, Hk, spec) in make_pack's form.
CASES = [
    ("causal-gqa-longtail", [0, 1, 3, 17, 64, 250, 700], [0, 1, 3, 17, 64, 250, 700], 4, 2, dict(causal=True)),
    ("mqa-nq!=nk", [0, 130, 2, 9, 400], [5, 0, 77, 9, 520], 4, 1, {}),
    ("causal-nq!=nk", [333, 1, 0, 190], [200, 64, 3, 260], 4, 2, dict(causal=True)),
    ("window-sinks-vjp", [200, 0, 33, 517], [260, 7, 33, 300], 3, 1, dict(window=(64, 16), sinks=True)),
]  # fmt: skip
# (kernel, dtype): every family explicitly; the head dims alternate over the cases so each family sees 64 and 128.
FAMILIES = [
    ("portable", "float32"),
    ("mma", "float16"),
    ("mma", "bfloat16"),
    pytest.param("wgmma", "bfloat16", marks=_needs_hopper),
    pytest.param("wgmma", "float16", marks=_needs_hopper),
]
DIMS = (64, 128)


def _cases():
    out = []
    for f, fam in enumerate(FAMILIES):
        (kernel, dtype), marks = (fam.values, fam.marks) if hasattr(fam, "values") else (fam, ())
        for i, case in enumerate(CASES):
            d = DIMS[(i + f) % len(DIMS)]
            out.append(pytest.param(kernel, dtype, case, d, marks=marks, id=f"{kernel}-{dtype}-{case[0]}-d{d}"))
    return out


def _repeat(kernel, q, k, v, do, packing, causal, scale, kw, vjp):
    """REPEATS deterministic backwards of one pack, each bitwise equal to the first; (o, lse, first grads)."""
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    pk = (cupy.asarray(packing[0]), cupy.asarray(packing[1]), packing[2], packing[3])
    kwd = {n: _dev(x) for n, x in kw.items()}
    o, lse = cupyflash.attention_varlen_forward(qd, kd, vd, *pk, causal, scale, kernel=kernel, **kwd)
    if vjp:
        o_v, fn = cupyflash.attention_varlen_vjp(qd, kd, vd, *pk, causal, scale, kernel=kernel, deterministic=True,
                                                 **kwd)  # fmt: skip
        assert np.array_equal(o_v.get().view(np.uint8), o.get().view(np.uint8))
    else:
        def fn(dod):
            return cupyflash.attention_varlen_backward(dod, qd, kd, vd, o, lse, *pk, causal, scale, kernel=kernel,
                                                       deterministic=True, **kwd)  # fmt: skip
    first = bits = None
    for r in range(REPEATS):
        poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
        grads = fn(dod)
        host = [g.get().view(np.uint8) for g in grads]  # the bits, whatever the dtype
        if first is None:
            first, bits = grads, host
            continue
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), bits, host):
            assert np.array_equal(a, b), f"{name} differs in repeat {r}"
    return o, lse, first


@pytest.mark.parametrize("kernel,dtype_name,case,d", _cases())
def test_varlen_backward_is_bitwise_reproducible(kernel, dtype_name, case, d, rng):
    q, k, v, do, packing, causal, scale, kw = make_pack(rng, dtype_name, case, d)
    o, lse, grads = _repeat(kernel, q, k, v, do, packing, causal, scale, kw, vjp=case[0].endswith("vjp"))
    assert_pack_close(kernel, dtype_name, q, k, v, do, packing, causal, scale, kw, o, lse, grads)


@pytest.mark.parametrize("kernel,dtype_name", [("portable", "float32"), ("mma", "float16"),
                                               pytest.param("wgmma", "bfloat16", marks=_needs_hopper)])  # fmt: skip
def test_grouped_heads_grid_order_is_reproducible(kernel, dtype_name, rng):
    """Non-causal with many kv heads: the turns' grid order puts heads in groups (plans.dq_head_group; a varlen
    grid's head axis holds the kv heads only), one full group and a partial one here."""
    from cupyflash.plans import DeviceLimits, dq_head_group

    sm = DeviceLimits.current().sm_count
    heads = sm // 4 + 7
    assert 1 < dq_head_group(heads, sm, longest_first=False, heads_first=False) < heads
    case = ("grouped", [90, 0, 200], [150, 30, 200], heads, heads, {})
    q, k, v, do, packing, causal, scale, kw = make_pack(rng, dtype_name, case, 64)
    o, lse, grads = _repeat(kernel, q, k, v, do, packing, causal, scale, kw, vjp=False)
    assert_pack_close(kernel, dtype_name, q, k, v, do, packing, causal, scale, kw, o, lse, grads)


def test_deterministic_must_be_bool_on_cupy_arrays(rng):
    q, k, v, do, packing, causal, scale, kw = make_pack(rng, "float32", CASES[2], 64)
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    pk = (cupy.asarray(packing[0]), cupy.asarray(packing[1]), packing[2], packing[3])
    o, lse = cupyflash.attention_varlen_forward(qd, kd, vd, *pk, causal)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cupyflash.attention_varlen_backward(dod, qd, kd, vd, o, lse, *pk, causal, deterministic=1)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        cupyflash.attention_varlen_vjp(qd, kd, vd, *pk, causal, deterministic="yes")
