"""GPU: the warp-specialised forward's producer copying Q_i, K_t and V_t by TMA (``kTma``, plans.wgmma.uses_tma_forward:
the default where the ws forward runs and the call's q, k and v have TMA maps) against the same producer copying by
cp.async (plans.wgmma.TMA_FORWARD off) and the float64 reference.

Each path is reached explicitly: the test flips plans.wgmma.TMA_FORWARD, keeps every call on the ws forward
(lockstep_by_default off), clears the forward's plan cache, and checks the kernel the call planned (``kTma``: its
name's last flag, three maps) or not. Both paths put the same tiles in shared memory (rows past Nq/Nk and columns
past d zero) and the consumers run the same products in the same order, so o and lse must be bitwise equal. Outputs
start as NaN (the pool poisoned). Cases: ragged N (1000), a query tile shorter than Br over several key tiles, GQA
with Nq != Nk, causal, windows (persistent blocks where narrow), softcap, ALiBi, (B, N, H, D) views, padded head dims
(96, 40), D = 64 and 128, bf16 and fp16.

A wrong transaction count on a FULL barrier hangs the kernel rather than failing: run under a timeout,
    timeout 300 python -m pytest -q tests/test_wgmma_tma_fwd_gpu.py
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, TOL_OUT, rel_err, requires_gpu, needs_hopper as _needs_hopper
from test_varlen_gpu import poison_pool
from test_wgmma_loader_gpu import _keywords
from test_wgmma_tma_gpu import _array

import cupyflash
from cupyflash import reference
from cupyflash.plans import wgmma as plans

if HAS_GPU:
    import cupy

pytestmark = [requires_gpu, pytest.mark.gpu, _needs_hopper]

#: (id, d, (b, hq, hk, nq, nk), causal, keywords, layout, dtype); layout "bhnd" or "bnhd" (a transposed view)
CASES = [
    ("ragged-causal-d128", 128, (2, 4, 4, 1000, 1000), True, {}, "bhnd", "bfloat16"),
    ("ragged-plain-d64", 64, (2, 4, 4, 1000, 1000), False, {}, "bhnd", "bfloat16"),
    ("gqa-d128-f16", 128, (2, 8, 2, 1000, 777), False, {}, "bhnd", "float16"),
    ("gqa-bnhd-d64", 64, (2, 6, 3, 700, 900), True, {}, "bnhd", "bfloat16"),
    ("short-q-d128", 128, (1, 4, 2, 17, 300), False, {}, "bhnd", "bfloat16"),
    ("window-d128", 128, (2, 4, 2, 1000, 1000), True, {"window_size": (200, 0)}, "bhnd", "bfloat16"),  # persistent
    ("window2-d64-f16", 64, (2, 4, 2, 1000, 1000), False, {"window_size": (300, 300)}, "bnhd", "float16"),
    ("window-long-d128", 128, (1, 4, 4, 3000, 3000), True, {"window_size": (2500, 0)}, "bhnd", "float16"),
    ("softcap-d128", 128, (1, 4, 2, 333, 461), False, {"softcap": 20.0}, "bhnd", "bfloat16"),
    ("softcap-causal-d64-f16", 64, (2, 4, 4, 1000, 1000), True, {"softcap": 30.0}, "bhnd", "float16"),
    ("alibi-bnhd-d128", 128, (1, 4, 4, 1000, 1000), True, {"alibi_slopes": True}, "bnhd", "bfloat16"),
    ("padded-d96", 96, (2, 4, 2, 461, 333), False, {}, "bhnd", "float16"),
    ("padded-d40", 40, (2, 4, 2, 517, 600), True, {}, "bnhd", "bfloat16"),
]


def _main_kernels() -> list:
    from cupyflash import cuda_backend

    plans_cached = {id(prep.plan): prep.plan for prep in cuda_backend._forward_cache.values()
                    if getattr(prep, "plan", None) is not None}  # (a plan may sit under two keys)
    return [lp for plan in plans_cached.values() for lp, _ in plan.launches if lp.name.startswith("wgmma_flash_fwd")]


def _is_tma(name: str) -> bool:
    return name.rsplit(">, ", 1)[-1] in ("false, true>", "true, true>")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tma_and_cp_async_producers_agree(case, rng, monkeypatch):
    from cupyflash import cuda_backend

    _, d, (b, hq, hk, nq, nk), causal, kw, layout, dtype = case
    dt = DTYPES[dtype]
    host = [rng.standard_normal(s).astype(dt) for s in ((b, hq, nq, d), (b, hk, nk, d), (b, hk, nk, d))]
    q, k, v = (_array(x, layout) for x in host)
    call, ref_kw = _keywords(kw, b, hq, nq, nk, rng)
    monkeypatch.setattr(plans, "lockstep_by_default", lambda *args: False)  # the ws forward for every case
    out = {}
    for tma in (True, False):
        monkeypatch.setattr(plans, "TMA_FORWARD", tma)
        cuda_backend._forward_cache.clear()
        poison_pool(((b, hq, nq, d), dt), ((b, hq, nq), np.float32))
        o, lse = cupyflash.attention_forward(q, k, v, causal, kernel="wgmma", **call)
        cupy.cuda.Device().synchronize()
        (main,) = _main_kernels()
        assert main.name.startswith("wgmma_flash_fwd_ws<"), main.name
        assert _is_tma(main.name) == tma and len(main.tensor_maps) == 3 * tma, main.name
        out[tma] = (o.get(), lse.get())
    cuda_backend._forward_cache.clear()
    for i, name in enumerate(("o", "lse")):
        assert np.array_equal(out[True][i].view(np.uint8), out[False][i].view(np.uint8)), name
    ref_o, ref_lse = reference.attention_forward(host[0], host[1], host[2], causal, **ref_kw)
    assert rel_err(out[True][0], ref_o) <= TOL_OUT[dtype], f"o: {rel_err(out[True][0], ref_o):.2e}"
    assert np.allclose(out[True][1], ref_lse, atol=1e-3, rtol=1e-4), "lse"


def test_repeated_calls_replace_the_maps_addresses(rng):
    """The second call of a signature only replaces the maps' addresses (tensor_map.MapWriter): with other arrays of
    the same layout it must compute their outputs, not the first call's."""
    from cupyflash import cuda_backend

    cuda_backend._forward_cache.clear()
    b, h, n, d = 1, 4, 1000, 128
    dt = DTYPES["bfloat16"]
    runs = []
    for _ in range(2):
        q, k, v = (cupy.asarray(rng.standard_normal((b, h, n, d)).astype(dt)) for _ in range(3))
        o, lse = cupyflash.attention_forward(q, k, v, True, kernel="wgmma")
        runs.append(((q, k, v), o.get(), lse.get()))
    assert any(lp.tensor_maps for lp in _main_kernels())
    for arrays, o, lse in runs:
        ref_o, ref_lse = reference.attention_forward(*(x.get() for x in arrays), True)
        assert rel_err(o, ref_o) <= TOL_OUT["bfloat16"], f"o: {rel_err(o, ref_o):.2e}"
        assert np.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4)
    cuda_backend._forward_cache.clear()
