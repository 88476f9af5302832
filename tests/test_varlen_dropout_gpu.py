"""GPU: attention dropout on packed (varlen) calls (issue 16), every kernel family reached explicitly.

- The mask: with each sequence's V = the identity (V rows e_j, j counted within the sequence; D >= every Nk_b),
  o[i, h, :Nk_b] = P_ij Z_ij, nonzero exactly where P_ij was kept, so each family's mask is read back per
  sequence and compared element for element with ``cupyflash.dropout_mask(B, Hq, Nq_b, Nk_b)[b]``: the kernels
  key sequence b by batch index b and its own rows and columns (empty sequences, 1-row ones, several tiles).
- Forward and backward against the float64 varlen reference with dropout (tests/test_varlen_dropout.py checks
  it against the formula with the mask): float32 relative error <= 1e-5 (o) / 1e-4 (grads), 16-bit the fixed
  bounds of tests/conftest.py, as tests/test_dropout_gpu.py; outputs NaN-poisoned through the pool
  (test_varlen_gpu.poison_pool) and checked finite.
- With ``deterministic=True`` too: repeats are bitwise equal.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import DTYPES, HAS_GPU, TOL_GRAD, TOL_OUT, rel_err, requires_gpu, needs_hopper as _needs_hopper
from test_varlen_gpu import _dev, cu, make_pack, poison_pool

import cupyflash
from cupyflash import reference

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

FAMILIES = [
    ("portable", "float32"),
    ("portable", "bfloat16"),
    ("mma", "float16"),
    ("mma", "bfloat16"),
    pytest.param("wgmma", "float16", marks=_needs_hopper),
    pytest.param("wgmma", "bfloat16", marks=_needs_hopper),
]


# ---------------------------------------------------------------------------- the mask, read back


@pytest.mark.parametrize("kernel,dtype_name", FAMILIES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_mask_is_each_sequences_dropout_mask(kernel, dtype_name, causal, rng):
    lq, lk, hq, hk, d = [200, 1, 0, 130, 37], [64, 5, 9, 40, 64], 4, 2, 64
    dt = DTYPES[dtype_name]
    p_drop, seed = 0.3, int(rng.integers(0, 2**63)) * 2 + 1  # the seed's high word too
    cu_q, cu_k = cu(lq), cu(lk)
    q = rng.standard_normal((int(cu_q[-1]), hq, d)).astype(dt)
    k = rng.standard_normal((int(cu_k[-1]), hk, d)).astype(dt)
    v = np.zeros((int(cu_k[-1]), hk, d), dt)
    for b, n in enumerate(lk):  # V = I within each sequence
        v[cu_k[b] + np.arange(n), :, np.arange(n)] = 1
    pk = (cupy.asarray(cu_q), cupy.asarray(cu_k), max(lq), max(lk))
    poison_pool((q.shape, dt), ((hq, q.shape[0]), np.float32))
    o, _ = cupyflash.attention_varlen_forward(*(cupy.asarray(x) for x in (q, k, v)), *pk, causal, kernel=kernel,
                                              dropout_p=p_drop, dropout_seed=seed)  # fmt: skip
    o = o.get()
    assert np.isfinite(o).all()
    for b, (nq, nk) in enumerate(zip(lq, lk)):
        got = o[cu_q[b]:cu_q[b + 1], :, :nk].transpose(1, 0, 2) != 0  # (Hq, Nq_b, Nk_b)
        want = cupyflash.dropout_mask(len(lq), hq, nq, nk, p_drop, seed)[b]
        if causal:  # hidden pairs have P = 0 whatever the mask
            want &= np.arange(nk)[None, :] <= np.arange(nq)[:, None] + nk - nq
        assert np.array_equal(got, want), f"sequence {b}: {int((got != want).sum())} of {got.size} differ"
        assert not o[cu_q[b]:cu_q[b + 1], :, nk:].any()


# ---------------------------------------------------------------------------- against the reference

# (id, query lengths, key lengths, Hq, Hk, spec) in make_pack's form
CASES = [
    ("causal-gqa", [0, 1, 77, 300, 5, 129], [0, 1, 77, 300, 5, 129], 4, 2, dict(causal=True)),
    ("nq!=nk-mqa", [33, 190, 1, 64], [70, 100, 9, 200], 4, 1, {}),
    ("window-sinks", [120, 0, 60, 5], [60, 30, 0, 200], 3, 1, dict(window=(32, 8), sinks=True)),
    ("softcap-alibi", [150, 2, 77], [170, 40, 60], 4, 2, dict(softcap=30.0, alibi="seq", causal=True)),
]  # fmt: skip
DIMS = (64, 128)


def _cases():
    out = []
    for f, fam in enumerate(FAMILIES):
        (kernel, dtype), marks = (fam.values, fam.marks) if hasattr(fam, "values") else (fam, ())
        for i, case in enumerate(CASES if dtype == "float32" else CASES[f % 2::2]):  # 16-bit: two cases each
            d = DIMS[(i + f) % 2]
            out.append(pytest.param(kernel, dtype, case, d, marks=marks, id=f"{kernel}-{dtype}-{case[0]}-d{d}"))
    return out


def _run(kernel, q, k, v, do, packing, causal, scale, kw, drop, deterministic=False):
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    pk = (cupy.asarray(packing[0]), cupy.asarray(packing[1]), packing[2], packing[3])
    kwd = {n: _dev(x) for n, x in kw.items()}
    poison_pool((q.shape, q.dtype), ((q.shape[1], q.shape[0]), np.float32))
    o, lse = cupyflash.attention_varlen_forward(qd, kd, vd, *pk, causal, scale, kernel=kernel, **kwd, **drop)
    poison_pool((q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype))
    grads = cupyflash.attention_varlen_backward(dod, qd, kd, vd, o, lse, *pk, causal, scale, kernel=kernel,
                                                deterministic=deterministic, **kwd, **drop)  # fmt: skip
    return o.get(), lse.get(), [g.get() for g in grads]


@pytest.mark.parametrize("kernel,dtype_name,case,d", _cases())
def test_forward_and_backward_match_reference(kernel, dtype_name, case, d, rng):
    q, k, v, do, packing, causal, scale, kw = make_pack(rng, dtype_name, case, d)
    drop = dict(dropout_p=0.17, dropout_seed=int(rng.integers(0, 2**62)))
    o, lse, grads = _run(kernel, q, k, v, do, packing, causal, scale, kw, drop)
    assert np.isfinite(o).all() and not np.isnan(lse).any()
    ro, rlse = reference.attention_varlen_forward(q, k, v, *packing, causal, scale, **kw, **drop)
    rgrads = reference.attention_varlen_backward(do, q, k, v, o, lse, *packing, causal, scale, **kw, **drop)
    assert rel_err(o, ro) <= TOL_OUT[dtype_name], f"o: {rel_err(o, ro):.2e}"
    finite = np.isfinite(rlse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert np.allclose(lse[finite], rlse[finite], rtol=1e-4, atol=1e-4)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, rgrads):
        assert np.isfinite(g).all(), f"{name} has NaN/inf (a row left unwritten?)"
        err = rel_err(g, r)
        assert err <= TOL_GRAD[dtype_name], f"{name}: {err:.2e}"


@pytest.mark.parametrize("kernel,dtype_name", [("portable", "float32"), ("mma", "bfloat16"),
                                               pytest.param("wgmma", "float16", marks=_needs_hopper)])  # fmt: skip
def test_deterministic_with_dropout_is_bitwise_reproducible(kernel, dtype_name, rng):
    q, k, v, do, packing, causal, scale, kw = make_pack(rng, dtype_name, CASES[0], 64)
    drop = dict(dropout_p=0.3, dropout_seed=2024)
    first = _run(kernel, q, k, v, do, packing, causal, scale, kw, drop, deterministic=True)
    for r in range(5):
        again = _run(kernel, q, k, v, do, packing, causal, scale, kw, drop, deterministic=True)
        for name, a, b in zip(("o", "lse", "grads"), first, again):
            for x, y in zip(a if name == "grads" else [a], b if name == "grads" else [b]):
                assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), f"{name} differs in repeat {r}"
    other = _run(kernel, q, k, v, do, packing, causal, scale, kw, dict(dropout_p=0.3, dropout_seed=2025))
    assert not np.array_equal(first[0], other[0]), "another seed must drop differently"
