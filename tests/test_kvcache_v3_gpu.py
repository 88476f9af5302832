"""GPU tests of decode v3's paths (issue 15): the split merge inside the decode launch (each row chunk's last
split block merges; arrival counters reset by it), many splits (more than 32: the merge hands the split weights
out in several rounds), the B = 1 long row, and page size 1 (block-table entries fetched a tile ahead), on both
decode kernels, against the float64 reference with the same checks and bounds as tests/test_kvcache_gpu.py
(poisoned outputs, the cache after the append bit-identical, FlashAttention's criterion for 16-bit dtypes,
float32 relative error <= 1e-5)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import HAS_GPU, requires_gpu
from test_kvcache_gpu import _case_inputs
from test_kvcache_gpu import test_attention_with_kvcache as check_case

import cupyflash as cf

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy

# (id, (B, Hq, Hk, Nq, capacity, Nnew, page_size or None, D), spec, dtype, num_splits), as test_kvcache_gpu.CASES.
CASES = [
    # the merge inside the launch: 40 splits (two rounds of 32 split weights), with sinks joining there once
    ("merge40-mma-sinks", (2, 8, 2, 1, 64 * 40, 1, None, 128), dict(sinks=True), "bfloat16", 40),
    # 200 splits on the FMA kernel (float32), causal: the empty sequence's splits all saw no key
    ("merge200-fma-f32-causal", (2, 4, 2, 2, 64 * 200, 2, None, 128), dict(causal=True), "float32", 200),
    # 64 packed rows (16 rows a warp in the merge) and 80 rows (two row chunks, two counters per sequence)
    ("merge36-mma-spec16-paged16", (1, 8, 2, 16, 64 * 36, 16, 16, 128), dict(causal=True), "bfloat16", 36),
    ("merge9-two-row-chunks", (2, 16, 1, 5, 2000, 5, 16, 128), dict(causal=True, sinks=True), "bfloat16", 9),
    # B = 1, one long row: the automatic split count (128 splits of 4 tiles: four rounds of weights)
    ("b1-long-auto-splits", (1, 8, 2, 1, 32768, 1, None, 128), {}, "bfloat16", 0),
    # page size 1: every key its own page, at each D's copy layout (4, 8, 16 rows per thread and tile)
    ("paged1-gqa-auto", (2, 16, 4, 1, 3000, 1, 1, 128), {}, "bfloat16", 0),
    ("paged1-d64-causal-split", (2, 8, 2, 4, 700, 4, 1, 64), dict(causal=True), "float16", 5),
    ("paged1-d256-window-sinks", (1, 4, 1, 2, 900, 2, 1, 256), dict(window=(300, 0), sinks=True), "bfloat16", 3),
    ("paged1-fma-f32-split", (2, 4, 2, 1, 600, 1, 1, 64), {}, "float32", 4),
]  # fmt: skip


@pytest.mark.parametrize("shape, spec, dtype_name, num_splits", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_decode_v3_paths(rng, shape, spec, dtype_name, num_splits):
    check_case(rng, shape, spec, dtype_name, num_splits)


def _counters() -> list:
    from cupyflash import kvcache

    return [ws[2] for ws in kvcache._workspace.values()]


@pytest.mark.parametrize("kernel", ["mma", "fma"])
def test_split_counters_are_left_at_zero(rng, kernel):
    """Every split launch leaves its arrival counters at zero (the merging block resets them), so calls after it
    merge again: three calls give bit-identical results, and no counter is left nonzero."""
    q, kc, vc, kn, vn, lens, table, causal, kw = _case_inputs(rng, (3, 8, 2, 1, 64 * 37, 0, 16, 128), {}, "bfloat16")
    args = (cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc))
    outs = []
    for _ in range(3):
        o, lse = cf.attention_with_kvcache(*args, cache_seqlens=cupy.asarray(lens), block_table=cupy.asarray(table),
                                           num_splits=37, kernel=kernel)  # fmt: skip
        outs.append((o.get(), lse.get()))
    for o, lse in outs[1:]:
        np.testing.assert_array_equal(o.view(np.uint16), outs[0][0].view(np.uint16))
        np.testing.assert_array_equal(lse, outs[0][1])
    assert all(int(c.max()) == 0 and int(c.min()) == 0 for c in _counters())


def test_graph_replays_merge_in_one_launch(rng):
    """A captured split decode step (append, decode with its in-launch merge) replayed several times: every replay
    equals the direct call (the counters are reset inside the graph's own launch)."""
    b, hq, hk, cap, d = 2, 8, 2, 64 * 40, 128
    kc = cupy.asarray(rng.standard_normal((b, hk, cap, d)).astype(np.float16))
    vc = cupy.asarray(rng.standard_normal((b, hk, cap, d)).astype(np.float16))
    q = cupy.asarray(rng.standard_normal((b, hq, 1, d)).astype(np.float16))
    kn = cupy.asarray(rng.standard_normal((b, hk, 1, d)).astype(np.float16))
    lens = cupy.asarray(np.array([1000, cap - 1], np.int32))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step = lambda: cf.attention_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=lens, num_splits=40)  # noqa: E731
        want = step()[0].copy()
        stream.begin_capture()
        o, _ = step()
        graph = stream.end_capture()
        for _ in range(3):
            o.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            np.testing.assert_array_equal(o.get(), want.get())
