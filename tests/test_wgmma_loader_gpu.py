"""GPU: the wgmma backward with its loader warpgroup (``kLoader``, plans.wgmma.uses_loader: the default where it
applies) against the lockstep kernel (plans.wgmma.LOADER off) and the float64 reference.

Each kernel is reached explicitly: the test flips plans.wgmma.LOADER, clears the backward's plan cache, and checks
that the plan it gets has the loader's third warpgroup (384 threads) or not (256). Both kernels run the same
products in the same order, so dK and dV must be bitwise equal (dQ too under deterministic turns, whose red.add
path both take; otherwise the loader adds dQ by bulk reductions and the adds land in any order) and every gradient
within the reference's bound (tests/conftest.py's TOL_GRAD).
Outputs start as NaN (the memory pool poisoned before each call); inputs are fresh random ones: GQA, Nq != Nk,
ragged last tiles, several key tiles and query steps per block, each built-in score that takes the loader, sinks,
and a user mask_mod with its block mask (bits of mixed tiles).
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, TOL_GRAD, random_qkv, rel_err, requires_gpu, needs_hopper as _needs_hopper
from test_varlen_gpu import poison_pool

import cupyflash
from cupyflash import reference
from cupyflash.plans import H100
from cupyflash.plans import wgmma as plans
from cupyflash.validation import check_backward

if HAS_GPU:
    import cupy

pytestmark = [requires_gpu, pytest.mark.gpu, _needs_hopper]

DOC_MASK = "doc(b, q_idx) == doc(b, kv_idx)"

#: (id, D, causal, keywords, deterministic): every case takes the loader by default (asserted below).
CASES = [
    ("plain-d64", 64, False, {}, False),
    ("causal-d128", 128, True, {}, False),
    ("window-d64", 64, True, {"window_size": (100, 0)}, False),
    ("window-d128", 128, False, {"window_size": (70, 40)}, False),
    ("softcap-d128", 128, True, {"softcap": 20.0}, False),
    ("softcap-d64", 64, False, {"softcap": 20.0}, False),
    ("alibi-d128", 128, False, {"alibi_slopes": True}, False),
    ("alibi-d64", 64, True, {"alibi_slopes": True}, False),
    ("sinks-d64", 64, True, {"sinks": True}, False),
    ("determ-d64", 64, True, {}, True),
    ("determ-d128", 128, False, {"softcap": 20.0}, True),
    ("docmask-d64", 64, True, {"mask_mod": DOC_MASK}, False),
    ("docmask-d128", 128, False, {"mask_mod": DOC_MASK}, False),
]


def _keywords(kw: dict, b: int, hq: int, nq: int, nk: int, rng) -> tuple[dict, dict]:
    """(the call's keywords as CuPy arrays, the reference's as NumPy ones): random ALiBi slopes and sinks, and a
    document mask over keys and queries (the same documents, aligned at the end) with its block mask."""
    call, ref = dict(kw), dict(kw)
    if kw.get("alibi_slopes"):
        slopes = rng.uniform(0.01, 0.5, hq).astype(np.float32)
        call["alibi_slopes"], ref["alibi_slopes"] = cupy.asarray(slopes), slopes
    if kw.get("sinks"):
        sinks = rng.standard_normal(hq).astype(np.float32)
        call["sinks"], ref["sinks"] = cupy.asarray(sinks), sinks
    if "mask_mod" in kw:
        assert nq == nk, "the document mask indexes keys and queries alike"
        cuts = np.sort(rng.choice(np.arange(1, nk), 4, replace=False))
        doc = np.broadcast_to(np.searchsorted(cuts, np.arange(nk), side="right").astype(np.int32), (b, nk)).copy()
        call["aux"] = {"doc": cupy.asarray(doc)}
        call["block_mask"] = cupyflash.create_block_mask(DOC_MASK, b, None, nq, nk, aux=call["aux"])
        assert call["block_mask"].bits_q is not None, "mixed tiles keep their bits"
        del ref["mask_mod"]
        ref["mask"] = (doc[:, None, :, None] == doc[:, None, None, :])
    return call, ref


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_loader_and_lockstep_backwards_agree(case, rng, monkeypatch):
    from cupyflash import cuda_backend

    _, d, causal, kw, deterministic = case
    b, hq, hk = 2, 4, 2
    nq, nk = (517, 517) if "mask_mod" in kw else (333, 461) if d == 64 else (461, 333)
    dt = DTYPES["bfloat16"]
    q, k, v = (cupy.asarray(x) for x in random_qkv(rng, (b,), hq, hk, nq, nk, d, dt))
    do = cupy.asarray(rng.standard_normal(q.shape).astype(dt))
    call, ref_kw = _keywords(kw, b, hq, nq, nk, rng)
    o, lse = cupyflash.attention_forward(q, k, v, causal, kernel="wgmma", **call)
    variant = check_backward(do, q, k, v, o, lse, causal=causal, **call).variant
    out = {}
    for loader in (True, False):
        monkeypatch.setattr(plans, "LOADER", loader)
        cuda_backend._backward_cache.clear()
        plan = plans.plan_backward(b, hq, hk, nq, nk, d, "__nv_bfloat16", H100, variant=variant)
        assert plan.main.block == ((384 if loader else 256), 1, 1), plan.main.name
        poison_pool(*(((x.shape), dt) for x in (q, k, v)))
        grads = cupyflash.attention_backward(do, q, k, v, o, lse, causal, kernel="wgmma",
                                             deterministic=deterministic, **call)  # fmt: skip
        out[loader] = [g.get() for g in grads]
    cuda_backend._backward_cache.clear()
    for i in (0, 1, 2) if deterministic else (1, 2):
        assert np.array_equal(out[True][i].view(np.uint8), out[False][i].view(np.uint8)), ("dq", "dk", "dv")[i]
    ref = reference.attention_backward(do.get(), q.get(), k.get(), v.get(), o.get(), lse.get(), causal, **ref_kw)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), out[True], ref):
        tol = TOL_GRAD["bfloat16"] if name != "dsinks" else 1e-3
        assert rel_err(g, r) <= tol, f"{name}: {rel_err(g, r):.2e}"
    assert len(out[True]) == len(ref)
