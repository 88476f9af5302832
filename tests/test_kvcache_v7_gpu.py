"""GPU tests of decode v7's copy paths in decode_split_mma (issue 15), each reached explicitly on the same keys.

Whole 64-key tiles of a contiguous cache, and of a paged cache with power-of-two pages, take the short path
(cuda_src/decode_mma.cuh, load_kv_mma: slot = key or its low bits, the L2 hint on bases passed through a shuffle);
a sequence's last partial tile, and every tile of pages of other sizes, take the general path. With the split count
fixed, every form of the cache puts the same bytes in the same shared-memory tiles, so o and lse must be bit for
bit equal across: a contiguous cache, a strided view of (B, S, Hk, D) storage, pages of 64, 32 and 1 (short path),
and pages of 48 (general path), at lengths that end on a tile and inside one. The contiguous result is also held to
the float64 reference, and the plan's one-block-an-SM split count (B = 1, a contiguous cache) runs the reference
cases of tests/test_kvcache_gpu.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, requires_gpu
from test_kvcache import make_cache
from test_kvcache_gpu import _poison
from test_kvcache_gpu import test_attention_with_kvcache as check_case
from test_variants_gpu import assert_fa_criterion, naive_attention

import cupyflash as cf
from cupyflash import kvcache_reference as kref

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy


@pytest.mark.parametrize("causal", [False, True])
def test_copy_paths_agree_bit_for_bit(rng, causal):
    b, hq, hk, d, cap = 3, 8, 2, 128, 768  # 768 keys: 12 tiles of 64, 16 pages of 48, 24 of 32
    dt = DTYPES["bfloat16"]
    lk = rng.standard_normal((b, hk, cap, d)).astype(dt)
    lv = rng.standard_normal((b, hk, cap, d)).astype(dt)
    q = cupy.asarray(rng.standard_normal((b, hq, 1, d)).astype(dt))
    lens = np.array([cap, 700, 64 * 5], np.int32)  # whole tiles only; a last tile of 60 keys; tiles only again
    forms = {"contiguous": (cupy.asarray(lk), cupy.asarray(lv), None)}
    k_store, v_store = (cupy.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (lk, lv))
    forms["(B, S, Hk, D) view"] = (k_store.transpose(0, 2, 1, 3), v_store.transpose(0, 2, 1, 3), None)
    for page in (64, 32, 1, 48):
        _, kp, table = make_cache(rng, b, hk, cap, d, dt, page, logical=lk)
        _, vp, _ = make_cache(rng, b, hk, cap, d, dt, page, logical=lv, table=table)
        forms[f"pages of {page}"] = (cupy.asarray(kp), cupy.asarray(vp), cupy.asarray(table))
    got = {}
    for name, (kc, vc, table) in forms.items():
        _poison((q.shape, q.dtype), (q.shape[:-1], np.float32))
        o, lse = cf.attention_with_kvcache(q, kc, vc, cache_seqlens=cupy.asarray(lens), block_table=table,
                                           causal=causal, num_splits=3, kernel="mma")  # fmt: skip
        got[name] = (o.get(), lse.get())
    o0, lse0 = got["contiguous"]
    for name, (o, lse) in got.items():
        assert o.tobytes() == o0.tobytes(), f"o of {name} differs from the contiguous cache's"
        assert lse.tobytes() == lse0.tobytes(), f"lse of {name} differs from the contiguous cache's"
    # and the contiguous result within FlashAttention's criterion of the float64 reference
    qh = q.get()
    ro, rlse = kref.attention_with_kvcache(qh, lk, lv, cache_seqlens=lens, causal=causal)
    np.testing.assert_allclose(lse0, rlse, rtol=2e-3, atol=1e-4)
    for bi in range(b):
        nk = int(lens[bi])
        naive = naive_attention(qh[bi : bi + 1], lk[bi : bi + 1, :, :nk], lv[bi : bi + 1, :, :nk],
                                np.ones_like(qh[bi : bi + 1]), causal, None,
                                {"window_size": None, "softcap": 0.0, "alibi_slopes": None, "sinks": None},
                                "bfloat16")[0]  # fmt: skip
        assert_fa_criterion(f"o[{bi}] (nk={nk})", o0[bi : bi + 1].astype(np.float64), ro[bi : bi + 1], naive,
                            "bfloat16", 2)  # fmt: skip


# (id, (B, Hq, Hk, Nq, capacity, Nnew, page_size or None, D), spec, dtype, num_splits), as test_kvcache_gpu.CASES:
# the plan's own split count (num_splits 0) where v7 and v8 changed it (B = 1 on a contiguous cache: 16 splits),
# whole tiles only (a capacity of 64 x 40 and no new keys), and pages of 32 and 48.
CASES = [
    ("b1-contig-auto-splits", (1, 32, 8, 1, 64 * 40, 0, None, 128), {}, "bfloat16", 0),
    ("b1-contig-auto-splits-causal-sinks", (1, 32, 8, 1, 64 * 40 + 9, 1, None, 128), dict(causal=True, sinks=True),
     "bfloat16", 0),
    ("paged32-softcap-window", (2, 8, 2, 2, 640, 2, 32, 128), dict(softcap=30.0, window=(200, 0)), "float16", 0),
    ("paged48-alibi", (2, 8, 2, 1, 600, 1, 48, 128), dict(alibi="head"), "bfloat16", 2),
]  # fmt: skip


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in CASES])
def test_v7_cases_against_reference(rng, case):
    _, shape, spec, dtype_name, num_splits = case
    check_case(rng, shape, spec, dtype_name, num_splits)
