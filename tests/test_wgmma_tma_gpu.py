"""GPU: the wgmma backward's loader copying Q_i/dO_i by TMA (``kTma``, plans.wgmma.uses_tma: the default where the
loader runs and the call's q and dout have TMA maps) against the same loader copying by cp.async (plans.wgmma.TMA off)
and the float64 reference.

Each path is reached explicitly: the test flips plans.wgmma.TMA, clears the backward's plan cache, and checks the
main kernel the call planned (``, true, true>``: kLoader, kTma; and its two maps) or not. Both paths put the same
tiles in shared memory (rows past Nq and columns past d zero), so dK and dV, summed in registers in one order, must be
bitwise equal; dQ (bulk adds in any order) within the reference's bound. Outputs start as NaN (the pool poisoned);
cases: ragged Nq (1000), Nq < Br with several key tiles (a box taller than the tensor), GQA with Nq != Nk, causal and
windows, (B, N, H, D) views, padded head dims (96, 40: the box's columns past d), ALiBi, softcap, sinks,
deterministic turns.

A wrong transaction count on the ring's FULL barrier hangs the kernel rather than failing: run under a timeout,
    timeout 900 python -m pytest -q tests/test_wgmma_tma_gpu.py
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, TOL_GRAD, rel_err, requires_gpu, needs_hopper as _needs_hopper
from test_varlen_gpu import poison_pool
from test_wgmma_loader_gpu import _keywords

import cupyflash
from cupyflash import reference
from cupyflash.plans import wgmma as plans

if HAS_GPU:
    import cupy

pytestmark = [requires_gpu, pytest.mark.gpu, _needs_hopper]

#: (id, d, (b, hq, hk, nq, nk), causal, keywords, layout, deterministic); layout "bhnd" or "bnhd" (a transposed view)
CASES = [
    ("ragged-causal-d128", 128, (2, 4, 4, 1000, 1000), True, {}, "bhnd", False),
    ("gqa-window-d128", 128, (2, 8, 2, 1000, 777), True, {"window_size": (200, 0)}, "bhnd", False),
    ("gqa-bnhd-d128", 128, (2, 6, 3, 700, 900), False, {}, "bnhd", False),
    ("short-q-d128", 128, (1, 4, 2, 17, 300), False, {}, "bhnd", False),
    ("window2-d96", 96, (2, 4, 2, 461, 333), False, {"window_size": (70, 40)}, "bhnd", False),
    ("alibi-d128", 128, (1, 4, 4, 1000, 1000), True, {"alibi_slopes": True}, "bnhd", False),
    ("softcap-d128", 128, (1, 4, 2, 333, 461), False, {"softcap": 20.0}, "bhnd", False),
    ("determ-d128", 128, (2, 4, 2, 1000, 1000), True, {}, "bhnd", True),
    ("plain-d64", 64, (2, 4, 2, 333, 461), False, {}, "bhnd", False),
    ("causal-bnhd-d64", 64, (2, 4, 4, 1000, 1000), True, {}, "bnhd", False),
    ("sinks-d40", 40, (2, 4, 2, 517, 600), True, {"sinks": True}, "bhnd", False),
]


def _array(x: np.ndarray, layout: str):
    """x (B, H, N, D) on the device, contiguous or as a (B, N, H, D) array seen through a transpose."""
    if layout == "bhnd":
        return cupy.asarray(x)
    return cupy.ascontiguousarray(cupy.asarray(x).transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def _main_kernels() -> list:
    from cupyflash import cuda_backend

    plans_cached = {id(prep.plan): prep.plan for prep in cuda_backend._backward_cache.values()
                    if getattr(prep, "plan", None) is not None}  # (a plan may sit under two keys)
    return [lp for plan in plans_cached.values() for lp, _ in plan.launches if lp.name.startswith("wgmma_flash_bwd")]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tma_and_cp_async_loaders_agree(case, rng, monkeypatch):
    from cupyflash import cuda_backend

    _, d, (b, hq, hk, nq, nk), causal, kw, layout, deterministic = case
    dt = DTYPES["bfloat16"]
    host = [rng.standard_normal(s).astype(dt) for s in ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d), (b, hq, nq, d))]
    q, k, v, do = (_array(x, layout) for x in host)
    call, ref_kw = _keywords(kw, b, hq, nq, nk, rng)
    o, lse = cupyflash.attention_forward(q, k, v, causal, kernel="wgmma", **call)
    out = {}
    for tma in (True, False):
        monkeypatch.setattr(plans, "TMA", tma)
        cuda_backend._backward_cache.clear()
        poison_pool(*((x.shape, dt) for x in host[:3]))
        grads = cupyflash.attention_backward(do, q, k, v, o, lse, causal, kernel="wgmma",
                                             deterministic=deterministic, **call)  # fmt: skip
        cupy.cuda.Device().synchronize()
        (main,) = _main_kernels()
        assert main.block == (384, 1, 1), main.name  # the loader runs either way
        assert main.name.endswith(", true, true>") == tma and len(main.tensor_maps) == 2 * tma, main.name
        out[tma] = [g.get() for g in grads]
    cuda_backend._backward_cache.clear()
    for i in (0, 1, 2) if deterministic else (1, 2):  # deterministic: dq's red.add order is fixed too
        assert np.array_equal(out[True][i].view(np.uint8), out[False][i].view(np.uint8)), ("dq", "dk", "dv")[i]
    assert rel_err(out[True][0], out[False][0]) <= 1e-2 * TOL_GRAD["bfloat16"], "dq: the two loaders' bulk adds"
    ref = reference.attention_backward(host[3], host[0], host[1], host[2], o.get(), lse.get(), causal, **ref_kw)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), out[True], ref):
        tol = TOL_GRAD["bfloat16"] if name != "dsinks" else 1e-3
        assert rel_err(g, r) <= tol, f"{name}: {rel_err(g, r):.2e}"
    assert len(out[True]) == len(ref)


def test_repeated_calls_replace_the_maps_addresses(rng):
    """The second call of a signature only replaces the maps' addresses (tensor_map.MapWriter): with other arrays of
    the same layout it must compute their gradients, not the first call's."""
    from cupyflash import cuda_backend

    cuda_backend._backward_cache.clear()
    b, h, n, d = 1, 4, 1000, 128
    dt = DTYPES["bfloat16"]
    runs = []
    for _ in range(2):
        q, k, v, do = (cupy.asarray(rng.standard_normal((b, h, n, d)).astype(dt)) for _ in range(4))
        o, lse = cupyflash.attention_forward(q, k, v, True, kernel="wgmma")
        grads = cupyflash.attention_backward(do, q, k, v, o, lse, True, kernel="wgmma")
        runs.append(((do, q, k, v, o, lse), [g.get() for g in grads]))
    assert any(lp.tensor_maps for lp in _main_kernels())
    for arrays, grads in runs:
        ref = reference.attention_backward(*(x.get() for x in arrays), True)
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
            assert rel_err(g, r) <= TOL_GRAD["bfloat16"], f"{name}: {rel_err(g, r):.2e}"
    cuda_backend._backward_cache.clear()
