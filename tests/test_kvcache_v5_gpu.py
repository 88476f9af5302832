"""GPU tests of decode v5's switches (issue 15; decode_split_mma's kFlags, kernels/decode.py MMA_FLAGS): bulk copies
("mma_bulk", sm_90+: K/V rows by cp.async.bulk into padded shared rows, one mbarrier per ring slot), the fast ends
("mma_ring_fast": Q by 16-byte cp.async ahead of the K/V copies, the split merge 8 loads deep), and both
("mma_bulk_fast"). Against the float64 reference with the checks and bounds of tests/test_kvcache_gpu.py (poisoned
outputs, the cache after the append bit-identical), and bit for bit against the kernel as before v5
(kernel="mma_ring"): the switches change how bytes arrive, not the arithmetic or its order. The cases reach what the
bulk path does differently: rows past a split's end (not copied; V rows zeroed), D below its padded width (K columns
zeroed once), every page-size class, strided caches, splits, long rows (many phases of each slot's barrier), and all
three warp layouts (two ring stages at 64 rows where the ring has three); and q rows the fast ends cannot copy
(unaligned: the plain loads). Bulk cases skip below compute capability 9.0."""
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

    from cupyflash.plans import DeviceLimits

    BULK = DeviceLimits.current().compute_capability >= 90
else:
    BULK = False

needs_bulk = pytest.mark.skipif(not BULK, reason="bulk copies need compute capability >= 9.0")


# (id, (B, Hq, Hk, Nq, capacity, Nnew, page_size or None, D), spec, dtype, num_splits), as test_kvcache_gpu.CASES.
CASES = [
    ("bulk-contig-gqa", (3, 8, 2, 1, 300, 1, None, 128), {}, "bfloat16", 0),
    ("bulk-contig-splits-sinks", (2, 8, 2, 1, 64 * 40 + 17, 1, None, 128), dict(sinks=True), "bfloat16", 40),
    ("bulk-paged1-causal", (2, 16, 4, 1, 700, 1, 1, 128), dict(causal=True), "bfloat16", 0),
    ("bulk-paged16-window-softcap", (3, 8, 2, 2, 1000, 2, 16, 128), dict(window=(150, 0), softcap=30.0), "float16",
     3),
    ("bulk-paged48-not-pow2", (2, 8, 2, 1, 500, 0, 48, 128), {}, "bfloat16", 2),
    ("bulk-paged256-alibi", (2, 8, 1, 1, 1100, 1, 256, 128), dict(alibi="head"), "bfloat16", 0),
    ("bulk-d96-pad-columns", (2, 8, 2, 1, 333, 1, 16, 96), dict(causal=True), "bfloat16", 2),
    ("bulk-d64-rows32-window-sinks", (2, 8, 2, 8, 333, 0, None, 64), dict(window=(60, 5), sinks=True), "float16", 0),
    ("bulk-spec16-causal-split", (2, 8, 2, 16, 900, 16, 16, 128), dict(causal=True), "bfloat16", 3),
    ("bulk-d256-paged64-sinks", (2, 8, 2, 1, 900, 0, 64, 256), dict(sinks=True), "bfloat16", 4),
    ("bulk-d256-spec16-causal", (1, 8, 2, 16, 500, 16, None, 256), dict(causal=True, sinks=True), "bfloat16", 2),
    ("bulk-d40-rotary", (2, 4, 2, 1, 200, 1, None, 40), dict(rotary="halves"), "float16", 0),
]  # fmt: skip


def _skip_without(kernel):
    if "bulk" in kernel and not BULK:
        pytest.skip("bulk copies need compute capability >= 9.0")


#: Reference checks: every case on bulk copies with the fast ends; the fast ends alone on the cases they touch most
#: (splits: the merge's 8-way unroll; Q rows of a few heads and of 64 packed rows).
REFERENCE = [(c, "mma_bulk_fast") for c in CASES] + [
    (c, "mma_ring_fast") for c in CASES if c[0] in ("bulk-contig-splits-sinks", "bulk-spec16-causal-split",
                                                    "bulk-d256-spec16-causal", "bulk-d40-rotary")]  # fmt: skip


@pytest.mark.parametrize("case, kernel", [pytest.param(c, k, id=f"{c[0]}-{k}") for c, k in REFERENCE])
def test_v5_against_reference(rng, case, kernel):
    _skip_without(kernel)
    _, shape, spec, dtype_name, num_splits = case
    check_case(rng, shape, {**spec, "kernel": kernel}, dtype_name, num_splits)


def _run(kernel, q, kc, vc, kn, vn, lens, table, causal, kw, num_splits):
    dev = {k: cupy.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    kcd, vcd = cupy.asarray(kc), cupy.asarray(vc)  # fresh caches: the append runs again
    qd = q if isinstance(q, cupy.ndarray) else cupy.asarray(q)
    _poison((q.shape, q.dtype), (q.shape[:-1], np.float32))
    o, lse = cf.attention_with_kvcache(qd, kcd, vcd, None if kn is None else cupy.asarray(kn),
                                       None if vn is None else cupy.asarray(vn), cache_seqlens=cupy.asarray(lens),
                                       block_table=None if table is None else cupy.asarray(table), causal=causal,
                                       num_splits=num_splits, kernel=kernel, **dev)  # fmt: skip
    return o.get(), lse.get(), kcd.get(), vcd.get()


#: Bit-for-bit checks against the kernel as before v5 ("mma_ring"): every case on both switches, a few on each alone.
BITWISE = [(c, "mma_bulk_fast") for c in CASES if "rotary" not in c[2]] + [
    (c, k) for c in CASES for k in ("mma_bulk", "mma_ring_fast")
    if c[0] in ("bulk-contig-splits-sinks", "bulk-paged1-causal", "bulk-spec16-causal-split")]  # fmt: skip


@pytest.mark.parametrize("case, kernel", [pytest.param(c, k, id=f"{c[0]}-{k}") for c, k in BITWISE])
def test_v5_equals_ring_bit_for_bit(rng, case, kernel):
    _skip_without(kernel)
    _, shape, spec, dtype_name, num_splits = case
    q, kc, vc, kn, vn, lens, table, causal, kw = _case_inputs(rng, shape, spec, dtype_name)
    ring = _run("mma_ring", q, kc, vc, kn, vn, lens, table, causal, kw, num_splits)
    new = _run(kernel, q, kc, vc, kn, vn, lens, table, causal, kw, num_splits)
    assert not np.isnan(new[0].astype(np.float32)).any()
    for r, x in zip(ring, new):
        np.testing.assert_array_equal(r.view(np.uint8), x.view(np.uint8))


@pytest.mark.parametrize("kernel", ["mma_ring_fast", "mma_bulk_fast"])
def test_v5_unaligned_q_takes_the_plain_loads(rng, kernel):
    """q whose rows are not 16-byte aligned (a view one element into a wider array): the fast ends read it with the
    plain 2-byte loads, as before; bit for bit the ring's result."""
    _skip_without(kernel)
    shape = (3, 8, 2, 1, 700, 0, 16, 128)
    q, kc, vc, kn, vn, lens, table, causal, kw = _case_inputs(rng, shape, {}, "float16")
    wide = cupy.zeros(q.shape[:-1] + (q.shape[-1] + 1,), q.dtype)
    wide[..., 1:] = cupy.asarray(q)
    qv = wide[..., 1:]
    assert qv.data.ptr % 16 != 0
    ring = _run("mma_ring", qv, kc, vc, kn, vn, lens, table, causal, kw, 3)
    new = _run(kernel, qv, kc, vc, kn, vn, lens, table, causal, kw, 3)
    for r, x in zip(ring, new):
        np.testing.assert_array_equal(r.view(np.uint8), x.view(np.uint8))


@needs_bulk
def test_bulk_strided_cache_and_long_row(rng):
    """A (B, S, Hk, D) cache viewed as (B, Hk, S, D) (row stride Hk * D), long rows (40 000 and 12 345 keys), the
    plan's own split count, and num_splits = 1 (one block reads a whole row: each ring slot's barrier goes through
    over 200 phases); equal to the ring bit for bit, three calls in a row (the arrival counters and the barriers start
    afresh every launch)."""
    b, hq, hk, s, d = 2, 16, 4, 40000, 128
    dt = np.dtype("float16")
    store_k = cupy.asarray(rng.standard_normal((b, s, hk, d)).astype(dt))
    store_v = cupy.asarray(rng.standard_normal((b, s, hk, d)).astype(dt))
    kc, vc = store_k.transpose(0, 2, 1, 3), store_v.transpose(0, 2, 1, 3)
    q = cupy.asarray(rng.standard_normal((b, hq, 1, d)).astype(dt))
    lens = cupy.asarray(np.array([s, 12345], np.int32))
    for splits in (0, 1):
        outs = {}
        for kernel in ("mma_ring", "mma_bulk_fast", "mma_bulk_fast", "mma_bulk_fast"):
            o, lse = cf.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits, kernel=kernel)
            outs.setdefault(kernel, []).append((o.get(), lse.get()))
        ref = outs["mma_ring"][0]
        for o, lse in outs["mma_bulk_fast"]:
            np.testing.assert_array_equal(o.view(np.uint16), ref[0].view(np.uint16))
            np.testing.assert_array_equal(lse, ref[1])


@needs_bulk
def test_bulk_hostile_tables_stay_inside(rng):
    """Out-of-range lengths and block-table entries (the kernels clamp every index): the bulk path reads inside the
    arrays and gives what the ring gives for the same clamped indices."""
    b, hq, hk, page, per_seq, d = 3, 8, 2, 16, 20, 128
    dt = np.dtype("float16")
    kc = cupy.asarray(rng.standard_normal((7, hk, page, d)).astype(dt))
    vc = cupy.asarray(rng.standard_normal((7, hk, page, d)).astype(dt))
    q = cupy.asarray(rng.standard_normal((b, hq, 1, d)).astype(dt))
    table = cupy.asarray(rng.integers(-50, 50, (b, per_seq)).astype(np.int32))
    lens = cupy.asarray(np.array([-5, 10**6, 77], np.int32))
    got = {}
    for kernel in ("mma_ring", "mma_bulk_fast"):
        o, lse = cf.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, kernel=kernel)
        got[kernel] = (o.get(), lse.get())
    np.testing.assert_array_equal(got["mma_bulk_fast"][0].view(np.uint16), got["mma_ring"][0].view(np.uint16))
    np.testing.assert_array_equal(got["mma_bulk_fast"][1], got["mma_ring"][1])


def test_bulk_refused_without_bulk_copies():
    if BULK:
        pytest.skip("this device has bulk copies")
    q = cupy.zeros((1, 4, 1, 64), np.float16)
    kc = cupy.zeros((1, 1, 32, 64), np.float16)
    with pytest.raises(ValueError, match="bulk"):
        cf.attention_with_kvcache(q, kc, kc, cache_seqlens=3, kernel="mma_bulk_fast")
