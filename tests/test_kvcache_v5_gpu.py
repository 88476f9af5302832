"""GPU tests of decode v5's fast ends in decode_split_mma (issue 15): Q's rows by 16-byte cp.async ahead of the
ring's K/V copies where q and its strides are 16-byte aligned, else plain loads; the split merge 8 loads deep.

Against the float64 reference with the checks and bounds of tests/test_kvcache_gpu.py (poisoned outputs, the cache
after the append bit-identical) on the cases the fast ends touch most: many splits (40: more than 32 and no multiple
of 8, the merge's unrolled loop and its remainder), Q chunks past D (D = 40, 96), 64 packed rows, a rotated q. And
q rows the cp.async path cannot take (a view one element into a wider array; an aligned view whose rows are not 16
bytes apart): the plain loads, bit for bit the result of the same values in a dense q."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import HAS_GPU, requires_gpu
from test_kvcache_gpu import _case_inputs, _poison
from test_kvcache_gpu import test_attention_with_kvcache as check_case

import cupyflash as cf

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy


# (id, (B, Hq, Hk, Nq, capacity, Nnew, page_size or None, D), spec, dtype, num_splits), as test_kvcache_gpu.CASES.
CASES = [
    ("contig-splits40-sinks", (2, 8, 2, 1, 64 * 40 + 17, 1, None, 128), dict(sinks=True), "bfloat16", 40),
    ("paged16-window-softcap-split", (3, 8, 2, 2, 1000, 2, 16, 128), dict(window=(150, 0), softcap=30.0), "float16",
     3),
    ("d96-paged16-causal-split", (2, 8, 2, 1, 333, 1, 16, 96), dict(causal=True), "bfloat16", 2),
    ("spec16-causal-split", (2, 8, 2, 16, 900, 16, 16, 128), dict(causal=True), "bfloat16", 3),
    ("d256-spec16-causal-sinks", (1, 8, 2, 16, 500, 16, None, 256), dict(causal=True, sinks=True), "bfloat16", 2),
    ("d40-rotary", (2, 4, 2, 1, 200, 1, None, 40), dict(rotary="halves"), "float16", 0),
]  # fmt: skip


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in CASES])
def test_fast_ends_against_reference(rng, case):
    _, shape, spec, dtype_name, num_splits = case
    check_case(rng, shape, {**spec, "kernel": "mma"}, dtype_name, num_splits)


def _run(q, kc, vc, lens, table, num_splits):
    _poison((q.shape, q.dtype), (q.shape[:-1], np.float32))
    o, lse = cf.attention_with_kvcache(q, cupy.asarray(kc), cupy.asarray(vc), cache_seqlens=cupy.asarray(lens),
                                       block_table=None if table is None else cupy.asarray(table),
                                       num_splits=num_splits, kernel="mma")  # fmt: skip
    return o.get(), lse.get()


@pytest.mark.parametrize("layout", ["offset-1", "row-pitch-plus-4"])
@pytest.mark.parametrize("shape, dtype_name, num_splits", [
    pytest.param((3, 8, 2, 1, 700, 0, 16, 128), "float16", 3, id="nq1-paged16"),
    pytest.param((2, 8, 2, 16, 500, 0, None, 64), "bfloat16", 2, id="rows64-d64"),
])  # fmt: skip
def test_unaligned_q_takes_the_plain_loads(rng, layout, shape, dtype_name, num_splits):
    """q rows not 16 bytes aligned: its pointer one element in, or an aligned pointer with rows D + 4 elements apart.
    The kernel reads them with plain loads (a 16-byte cp.async there would fault or read the wrong bytes), and the
    result equals, bit for bit, that of the same values in a dense q (Q's cp.async path)."""
    q, kc, vc, _, _, lens, table, _, _ = _case_inputs(rng, shape, {}, dtype_name)
    d = q.shape[-1]
    dense = cupy.asarray(q)
    if layout == "offset-1":
        wide = cupy.full(q.shape[:-1] + (d + 1,), np.nan, q.dtype)
        wide[..., 1:] = dense
        qv = wide[..., 1:]
        assert qv.data.ptr % 16 != 0
    else:
        wide = cupy.full(q.shape[:-1] + (d + 4,), np.nan, q.dtype)
        wide[..., :d] = dense
        qv = wide[..., :d]
        assert qv.data.ptr % 16 == 0 and qv.strides[-2] % 16 != 0
    want = _run(dense, kc, vc, lens, table, num_splits)
    got = _run(qv, kc, vc, lens, table, num_splits)
    assert not np.isnan(want[0].astype(np.float32)).any()
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
