"""GPU accuracy of KV-cache attention (issue 15) and of merge_attention_states, against the float64 reference.

Kernels: float16/bfloat16 cases run the tensor-core kernel (decode_split_mma) unless the spec says
kernel="fma"; float32 cases run the FMA kernel (decode_split). The mma cases cover its three warp layouts
(M <= 16 packed rows: 4 key-split warps; M <= 32: 2 x 2; M <= 64: 4 row strips), D = 64/128/256 (Q fragments in
registers, and reloaded at 256) and page sizes that are and are not powers of two.

Every case: random cache_seqlens including 0 and the full cache, 0/1/several new keys appended in place,
contiguous or paged caches (shuffled block tables, page sizes 1/16/64/256), GQA/MQA, the variants, split-KV
forced on and off. The output allocations are poisoned: the memory pool is handed NaN-filled blocks of the
outputs' sizes just before the call, so a row the kernels never write shows up as NaN.

Bounds (as tests/test_variants_gpu.py): float32 relative error <= 1e-5 (o); float16/bfloat16 FlashAttention's
criterion max|o - o_ref| <= 2 max|o_naive - o_ref| + floor, the naive implementation in the input dtype on the
gathered keys of each sequence. The cache after the append equals the reference's update exactly.
"""
from __future__ import annotations

import numpy as np
import pytest

from conftest import DTYPES, HAS_GPU, requires_gpu
from test_kvcache import make_cache
from test_variants_gpu import _alibi_slopes, assert_fa_criterion, assert_float32_close, naive_attention

import cupyflash as cf
from cupyflash import kvcache_reference as kref

pytestmark = [requires_gpu, pytest.mark.gpu]

if HAS_GPU:
    import cupy


def _poison(*shapes_dtypes):
    """Hand the memory pool NaN-filled blocks of these byte sizes, so the next allocations of the same sizes
    (the outputs) start as NaN; also blocks of their sum (256-byte aligned parts), with and without a last part
    repeated (rotary's q_rot): small outputs come from one allocation (cuda_backend._output_layout)."""
    sizes = [max(1, int(np.prod(s)) * np.dtype(dt).itemsize) for s, dt in shapes_dtypes]
    aligned = [-(-n // 256) * 256 for n in sizes]
    sizes += [sum(aligned), sum(aligned) + aligned[0]]
    blocks = [cupy.full(-(-n // 4), np.nan, dtype=np.float32) for n in sizes]
    del blocks


# (id, (B, Hq, Hk, Nq, capacity, Nnew, page_size or None, D), spec, dtype, num_splits). spec may name the kernel
# ("mma", "fma"; default "auto"). The cases share few instantiations (dtype, padded D, row tile, policy) so that
# the file's compiles stay short.
CASES = [
    ("mha-contig-nnew0-d64", (3, 4, 4, 1, 300, 0, None, 64), {}, "bfloat16", 0),
    ("gqa-contig-nnew1", (4, 8, 2, 1, 1000, 1, None, 128), {}, "bfloat16", 0),
    ("gqa-nosplit", (2, 8, 2, 1, 700, 1, None, 128), {}, "bfloat16", 1),
    ("d80-gqa", (2, 8, 2, 1, 333, 1, None, 80), {}, "bfloat16", 0),
    ("paged1", (3, 4, 1, 1, 90, 1, 1, 128), {}, "bfloat16", 0),
    ("paged256-d256", (2, 4, 1, 1, 1024, 1, 256, 256), {}, "bfloat16", 0),
    ("mqa-contig-nnew3-causal", (3, 8, 1, 2, 257, 2, None, 128), dict(causal=True), "bfloat16", 0),
    ("paged16-causal", (3, 8, 2, 4, 400, 4, 16, 128), dict(causal=True), "bfloat16", 0),
    ("gqa-spec16-causal-split", (2, 8, 2, 16, 700, 16, None, 128), dict(causal=True), "bfloat16", 5),
    ("m-rows-over-64", (2, 16, 1, 5, 300, 5, 16, 128), dict(causal=True), "bfloat16", 0),  # 80 rows: 2 chunks
    ("paged64-window", (2, 8, 2, 2, 640, 2, 64, 128), dict(window=(100, 0)), "float16", 3),
    ("window-sinks-paged16-split", (2, 8, 2, 2, 300, 2, 16, 128), dict(window=(40, 2), sinks=True), "float16", 4),
    ("softcap-alibi-sinks-nosplit", (3, 8, 2, 1, 500, 1, None, 128), dict(softcap=30.0, alibi="batch", sinks=True),
     "bfloat16", 1),  # the sink joins in the decode kernel's own epilogue
    ("contig-f32", (3, 4, 2, 2, 300, 2, None, 128), dict(causal=True), "float32", 0),
    ("causal-sinks-split-f32", (2, 4, 2, 2, 600, 2, None, 128), dict(causal=True, sinks=True), "float32", 6),
    ("alibi-head-causal-f32-d96", (2, 4, 4, 2, 200, 1, None, 96), dict(alibi="head", causal=True), "float32", 0),
    ("paged16-f32-d64", (2, 8, 2, 1, 200, 1, 16, 64), {}, "float32", 4),
    ("rotary-halves-causal-paged16", (3, 8, 2, 4, 320, 4, 16, 128), dict(causal=True, rotary="halves"), "bfloat16",
     0),
    ("rotary-interleaved-partial-f32", (2, 4, 2, 2, 200, 2, None, 64), dict(rotary="interleaved", rotary_dim=32),
     "float32", 0),
    ("rotary-interleaved-window-f16", (2, 4, 1, 2, 300, 1, None, 128), dict(rotary="interleaved", window=(50, 0)),
     "float16", 3),
    # the tensor-core kernel's layouts and the FMA kernel forced on 16-bit caches
    ("mma-rows32-d64-window-alibi", (2, 8, 2, 8, 400, 3, 16, 64), dict(window=(60, 5), alibi="head", kernel="mma"),
     "bfloat16", 0),  # M = 32: 2 row strips x 2 key slices
    ("mma-rows24-causal-nnew3", (2, 16, 2, 3, 300, 3, None, 128), dict(causal=True), "bfloat16", 0),  # 24 of 32 rows
    ("mma-d256-spec16-causal-sinks-split", (1, 8, 2, 16, 500, 16, None, 256), dict(causal=True, sinks=True),
     "bfloat16", 3),  # M = 64 at D = 256: Q reloaded from shared memory
    ("mma-paged3-f16", (2, 8, 2, 1, 300, 1, 3, 128), {}, "float16", 0),  # a page size that is no power of two
    ("mma-softcap-alibi-sinks-paged64-split", (2, 8, 2, 1, 2000, 1, 64, 128),
     dict(softcap=30.0, alibi="batch", sinks=True), "bfloat16", 7),
    ("fma-forced-bf16-gqa", (4, 8, 2, 1, 1000, 1, None, 128), dict(kernel="fma"), "bfloat16", 0),
    ("fma-forced-f16-paged16-causal-split", (3, 8, 2, 4, 400, 4, 16, 128), dict(causal=True, kernel="fma"),
     "float16", 3),
]  # fmt: skip


def _case_inputs(rng, shape, spec, dtype_name):
    b, hq, hk, nq, cap, n_new, page, d = shape
    dt = DTYPES[dtype_name]
    lk, kc, table = make_cache(rng, b, hk, cap, d, dtype=dt, page_size=page)
    lv = rng.standard_normal(lk.shape).astype(dt)
    vc = np.zeros_like(kc) if table is not None else lv.copy()
    if table is not None:
        vc[:] = rng.standard_normal(vc.shape).astype(dt)  # slots no sequence uses hold garbage, not zeros
        for bi in range(b):
            for j in range(table.shape[1]):
                n = min(page, cap - j * page)
                vc[table[bi, j], :, :n] = lv[bi, :, j * page : j * page + n]
    lens = rng.integers(0, cap - n_new + 1, b).astype(np.int32)
    lens[0], lens[-1] = 0, cap - n_new  # an empty and a full cache
    q = rng.standard_normal((b, hq, nq, d)).astype(dt)
    kn = vn = None
    if n_new:
        kn = rng.standard_normal((b, hk, n_new, d)).astype(dt)
        vn = rng.standard_normal((b, hk, n_new, d)).astype(dt)
    kw = {"window_size": spec.get("window"), "softcap": spec.get("softcap", 0.0),
          "alibi_slopes": _alibi_slopes(rng, spec["alibi"], b, hq) if spec.get("alibi") else None,
          "sinks": rng.uniform(-1.0, 2.5, hq).astype(np.float32) if spec.get("sinks") else None}  # fmt: skip
    if spec.get("rotary"):
        rd = spec.get("rotary_dim", d)
        theta = np.arange(cap)[:, None] * 10000.0 ** (-np.arange(rd // 2)[None, :] / (rd // 2))
        kw.update(rotary_cos=np.cos(theta).astype(np.float32), rotary_sin=np.sin(theta).astype(np.float32),
                  rotary_interleaved=spec["rotary"] == "interleaved")  # fmt: skip
    return q, kc, vc, kn, vn, lens, table, spec.get("causal", False), kw


def _dev(x):
    return None if x is None else cupy.asarray(x)


@pytest.mark.parametrize("shape, spec, dtype_name, num_splits", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_attention_with_kvcache(rng, shape, spec, dtype_name, num_splits):
    q, kc, vc, kn, vn, lens, table, causal, kw = _case_inputs(rng, shape, spec, dtype_name)
    kcd, vcd = cupy.asarray(kc), cupy.asarray(vc)
    _poison((q.shape, q.dtype), (q.shape[:-1], np.float32))
    kwd = {n: _dev(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    o, lse = cf.attention_with_kvcache(cupy.asarray(q), kcd, vcd, _dev(kn), _dev(vn), cache_seqlens=cupy.asarray(lens),
                                       block_table=_dev(table), causal=causal, num_splits=num_splits, validate=True,
                                       kernel=spec.get("kernel", "auto"), **kwd)  # fmt: skip
    assert o.dtype == q.dtype and o.shape == q.shape and lse.dtype == np.float32 and lse.shape == q.shape[:-1]
    o, lse = o.get().astype(np.float64), lse.get().astype(np.float64)
    kr, vr = kc.copy(), vc.copy()
    ro, rlse = kref.attention_with_kvcache(q, kr, vr, kn, vn, cache_seqlens=lens, block_table=table, causal=causal,
                                           **kw)  # fmt: skip
    # the append: bit-identical caches, every other slot untouched (rotated keys: float32 arithmetic on the device
    # against float64 here, each rounded once to the dtype, so within one unit in the last place)
    kg = kcd.get()
    np.testing.assert_array_equal(vcd.get().view(np.uint8), vr.view(np.uint8))
    if kw.get("rotary_cos") is None:
        np.testing.assert_array_equal(kg.view(np.uint8), kr.view(np.uint8))
    else:
        bits = {2: np.uint16, 4: np.uint32}[kc.dtype.itemsize]
        untouched = kr.view(bits) == kc.view(bits)
        assert np.array_equal(kg.view(bits)[untouched], kc.view(bits)[untouched])
        ulp = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype_name]
        np.testing.assert_allclose(kg.astype(np.float64), kr.astype(np.float64), rtol=ulp, atol=ulp)
    assert np.isfinite(o).all(), "o has NaN/inf (a row left unwritten?)"
    masked = np.isneginf(rlse)
    np.testing.assert_array_equal(np.isneginf(lse), masked)
    np.testing.assert_allclose(lse[~masked], rlse[~masked], rtol=1e-5 if dtype_name == "float32" else 2e-3, atol=1e-4)
    if dtype_name == "float32":
        assert_float32_close("o", o, ro, 1e-5)
        return
    b = q.shape[0]
    n_new = 0 if kn is None else kn.shape[2]
    for bi in range(b):  # the naive implementation on each sequence's gathered keys
        p = kref.check_kvcache(q, kr, vr, kn, vn, cache_seqlens=lens, block_table=table, causal=causal, **kw)
        nk = int(lens[bi]) + n_new
        K = kref.gather(p, kr, bi, nk, table, None)[None]
        V = kref.gather(p, vr, bi, nk, table, None)[None]
        kwb = {n: kw[n] for n in ("window_size", "softcap", "alibi_slopes", "sinks")}
        if kw["alibi_slopes"] is not None and kw["alibi_slopes"].ndim == 2:
            kwb["alibi_slopes"] = kw["alibi_slopes"][bi : bi + 1]
        qb = q[bi : bi + 1]
        if p.rotary_dim:  # the naive implementation sees q rotated and rounded, as the kernel does
            pos = int(lens[bi]) + np.arange(q.shape[2]) * p.rotary_q_step
            qb = kref.rotate(p, qb, pos, kw["rotary_cos"], kw["rotary_sin"]).astype(q.dtype)
        naive = naive_attention(qb, K, V, np.ones_like(qb), causal, None, kwb, dtype_name)[0]
        assert_fa_criterion(f"o[{bi}] (nk={nk})", o[bi : bi + 1], ro[bi : bi + 1], naive, dtype_name, 2)


@pytest.mark.parametrize("dtype_name", ["float32", "float16"])
def test_splits_agree(rng, dtype_name):
    """Automatic, no and many splits give the same result up to rounding (the merge is exact): float32 on the FMA
    kernel, float16 on the tensor-core kernel (whose float32 partials differ only in rounding before the one
    rounding to float16)."""
    q, kc, vc, kn, vn, lens, table, causal, kw = _case_inputs(rng, (2, 8, 2, 1, 3000, 0, 16, 64), {}, dtype_name)
    args = (cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc))
    outs = [cf.attention_with_kvcache(*args, cache_seqlens=cupy.asarray(lens), block_table=cupy.asarray(table),
                                      num_splits=s)[0].get().astype(np.float64) for s in (0, 1, 2, 17)]  # fmt: skip
    tol = 2e-6 if dtype_name == "float32" else 2e-3
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=tol, atol=tol)


def test_mma_and_fma_kernels_agree(rng):
    """The tensor-core and FMA kernels on the same bfloat16 call (GQA, paged, causal, split): both near the float64
    reference, and near each other (P is rounded to bfloat16 before P V on tensor cores only)."""
    q, kc, vc, kn, vn, lens, table, causal, kw = _case_inputs(rng, (3, 32, 8, 1, 2048, 1, 16, 128),
                                                              dict(causal=True), "bfloat16")  # fmt: skip
    ref, _ = kref.attention_with_kvcache(q, kc.copy(), vc.copy(), kn, vn, cache_seqlens=lens, block_table=table,
                                         causal=True)  # fmt: skip
    outs = {}
    for kernel in ("mma", "fma"):
        kcd, vcd = cupy.asarray(kc), cupy.asarray(vc)  # fresh caches: the append runs again
        o, _ = cf.attention_with_kvcache(cupy.asarray(q), kcd, vcd, cupy.asarray(kn), cupy.asarray(vn),
                                         cache_seqlens=cupy.asarray(lens), block_table=cupy.asarray(table),
                                         causal=True, kernel=kernel)  # fmt: skip
        outs[kernel] = o.get().astype(np.float64)
        assert np.abs(outs[kernel] - ref).max() <= 1e-2 * np.abs(ref).max(), kernel
    assert np.abs(outs["mma"] - outs["fma"]).max() <= 1e-2 * np.abs(ref).max()


def test_kernel_keyword_errors():
    q = cupy.zeros((1, 4, 1, 64), np.float32)
    kc = cupy.zeros((1, 1, 32, 64), np.float32)
    with pytest.raises(ValueError, match="16-bit"):
        cf.attention_with_kvcache(q, kc, kc, cache_seqlens=3, kernel="mma")
    with pytest.raises(ValueError, match="kernel"):
        cf.attention_with_kvcache(q, kc, kc, cache_seqlens=3, kernel="wgmma")


def test_cache_batch_idx_and_strided_cache(rng):
    """cache_batch_idx picks cache rows; a (B_cache, S, Hk, D) storage seen as (B_cache, Hk, S, D) is used in place."""
    b, hq, hk, cap, d = 3, 8, 2, 128, 128
    store = rng.standard_normal((5, cap, hk, d)).astype(np.float16)
    vstore = rng.standard_normal((5, cap, hk, d)).astype(np.float16)
    idx = np.array([4, 1, 2], np.int32)
    lens = np.array([17, 0, 126], np.int32)
    q = rng.standard_normal((b, hq, 1, d)).astype(np.float16)
    kn = rng.standard_normal((b, hk, 2, d)).astype(np.float16)
    vn = rng.standard_normal((b, hk, 2, d)).astype(np.float16)
    ks, vs = cupy.asarray(store), cupy.asarray(vstore)
    o, lse = cf.attention_with_kvcache(cupy.asarray(q), ks.transpose(0, 2, 1, 3), vs.transpose(0, 2, 1, 3),
                                       cupy.asarray(kn), cupy.asarray(vn), cache_seqlens=cupy.asarray(lens),
                                       cache_batch_idx=cupy.asarray(idx))  # fmt: skip
    kr, vr = store.transpose(0, 2, 1, 3).copy(), vstore.transpose(0, 2, 1, 3).copy()
    ro, _ = kref.attention_with_kvcache(q, kr, vr, kn, vn, cache_seqlens=lens, cache_batch_idx=idx)
    np.testing.assert_array_equal(ks.get().transpose(0, 2, 1, 3), kr)
    np.testing.assert_array_equal(vs.get().transpose(0, 2, 1, 3), vr)
    assert np.abs(o.get().astype(np.float64) - ro).max() < 5e-3


@pytest.mark.parametrize("kernel", ["mma", "fma"])
def test_out_of_range_values_stay_inside_the_arrays(rng, kernel):
    """Garbage lengths, pages and rows give garbage results but no fault (the kernels clamp); validate=True names them."""
    b, hq, hk, page, d = 2, 8, 2, 16, 128
    kc = cupy.asarray(rng.standard_normal((4, hk, page, d)).astype(np.float16))
    vc = cupy.asarray(rng.standard_normal((4, hk, page, d)).astype(np.float16))
    q = cupy.asarray(rng.standard_normal((b, hq, 1, d)).astype(np.float16))
    table = cupy.asarray(np.array([[0, 1000], [-5, 3]], np.int32))
    lens = cupy.asarray(np.array([1 << 30, -7], np.int32))
    o, lse = cf.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, kernel=kernel)
    cupy.cuda.get_current_stream().synchronize()
    assert o.shape == q.shape
    idx = cupy.asarray(np.array([7, -3], np.int32))  # contiguous: garbage cache rows
    o, lse = cf.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx, kernel=kernel)
    cupy.cuda.get_current_stream().synchronize()
    with pytest.raises(ValueError, match="cache_seqlens"):
        cf.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, block_table=table, validate=True)


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_merge_attention_states(rng, dtype_name):
    dt = DTYPES[dtype_name]
    o = rng.standard_normal((4, 3, 5, 72)).astype(dt)
    lse = (rng.standard_normal((4, 3, 5)) * 3).astype(np.float32)
    lse[1, 0] = -np.inf
    lse[:, 2, 1] = -np.inf  # a row no part saw
    o[1, 0] = np.nan  # an empty part is never read
    o_dev = cupy.asarray(o)
    _poison(((3, 5, 72), dt), ((3, 5), np.float32))
    out, l = cf.merge_attention_states(o_dev, cupy.asarray(lse))
    ro, rl = kref.merge_attention_states(o, lse)
    out, l = out.get().astype(np.float64), l.get().astype(np.float64)
    assert np.all(out[2, 1] == 0) and l[2, 1] == -np.inf
    np.testing.assert_allclose(l, rl, rtol=1e-6, atol=1e-6)
    tol = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype_name]
    np.testing.assert_allclose(out, ro, rtol=tol, atol=tol)


def test_merge_of_kvcache_splits_is_attention_over_all_keys(rng):
    """Cascade attention: two caches (shared prefix, suffix) merged equal one cache holding both."""
    b, hq, hk, d = 2, 8, 2, 128
    pre = rng.standard_normal((2, b, hk, 200, d)).astype(np.float16)
    suf = rng.standard_normal((2, b, hk, 50, d)).astype(np.float16)
    q = cupy.asarray(rng.standard_normal((b, hq, 1, d)).astype(np.float16))
    o1, l1 = cf.attention_with_kvcache(q, cupy.asarray(pre[0]), cupy.asarray(pre[1]), cache_seqlens=200)
    o2, l2 = cf.attention_with_kvcache(q, cupy.asarray(suf[0]), cupy.asarray(suf[1]), cache_seqlens=50)
    o, _ = cf.merge_attention_states(cupy.stack([o1, o2]), cupy.stack([l1, l2]))
    full = np.concatenate([pre, suf], axis=3)
    of, _ = cf.attention_with_kvcache(q, cupy.asarray(full[0]), cupy.asarray(full[1]), cache_seqlens=250)
    assert np.abs(o.get().astype(np.float64) - of.get().astype(np.float64)).max() < 4e-3


def test_decode_step_in_a_cuda_graph(rng):
    """A decode step (append + split-KV + merge) captured once and replayed gives the direct call's result."""
    b, hq, hk, cap, d = 2, 8, 2, 4096, 128
    kc = cupy.asarray(rng.standard_normal((b, hk, cap, d)).astype(np.float16))
    vc = cupy.asarray(rng.standard_normal((b, hk, cap, d)).astype(np.float16))
    q = cupy.asarray(rng.standard_normal((b, hq, 1, d)).astype(np.float16))
    kn = cupy.asarray(rng.standard_normal((b, hk, 1, d)).astype(np.float16))
    lens = cupy.asarray(np.array([1000, 4000], np.int32))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step = lambda: cf.attention_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=lens)  # noqa: E731
        want = step()[0].copy()  # warm-up on this stream: compiled, workspace cached
        stream.begin_capture()
        o, _ = step()
        graph = stream.end_capture()
        o.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
    np.testing.assert_array_equal(o.get(), want.get())


def test_decode_steps_replayed_from_one_cuda_graph(rng):
    """One captured decode step (append one token, split-KV attention, merge, then ``cache_seqlens += 1`` on the
    device) replayed step after step with new q/k/v written into the same buffers: each replay appends at the
    advanced length and attends over one more key, and every step equals the reference's."""
    b, hq, hk, cap, d, steps = 2, 8, 2, 2048, 128, 5
    dt = np.float32
    kc = rng.standard_normal((b, hk, cap, d)).astype(dt)
    vc = rng.standard_normal((b, hk, cap, d)).astype(dt)
    lens0 = np.array([100, cap - steps - 40], np.int32)
    inputs = [(rng.standard_normal((b, hq, 1, d)).astype(dt), rng.standard_normal((b, hk, 1, d)).astype(dt),
               rng.standard_normal((b, hk, 1, d)).astype(dt)) for _ in range(steps)]  # fmt: skip
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        q, kn, vn = (cupy.empty(x.shape, dt) for x in inputs[0])
        kcd, vcd, lens = cupy.asarray(kc), cupy.asarray(vc), cupy.asarray(lens0)
        # Warm-up on scratch caches of the same signature (compiled, plan and workspace cached for this stream),
        # so that the real cache is first written by the graph.
        scratch = (cupy.zeros_like(kcd), cupy.zeros_like(vcd), cupy.zeros_like(lens))
        cf.attention_with_kvcache(q, scratch[0], scratch[1], kn, vn, cache_seqlens=scratch[2])
        stream.synchronize()
        stream.begin_capture()
        o, lse = cf.attention_with_kvcache(q, kcd, vcd, kn, vn, cache_seqlens=lens)
        cupy.add(lens, 1, out=lens)
        graph = stream.end_capture()
        kr, vr, lr = kc.copy(), vc.copy(), lens0.copy()
        for s, (qh, knh, vnh) in enumerate(inputs):
            for dst, src in ((q, qh), (kn, knh), (vn, vnh)):
                dst[...] = cupy.asarray(src)
            o.fill(np.nan)
            lse.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            ro, rlse = kref.attention_with_kvcache(qh, kr, vr, knh, vnh, cache_seqlens=lr)  # appends to kr, vr
            lr += 1
            assert_float32_close(f"o at step {s}", o.get(), ro, 1e-5)
            np.testing.assert_allclose(lse.get(), rlse, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(lens.get(), lr)
    np.testing.assert_array_equal(kcd.get(), kr)  # exactly the five appended slots of each row changed
    np.testing.assert_array_equal(vcd.get(), vr)


REPEATED = [
    ("contig-append-device-lens", (2, 8, 2, 1, 600, 1, None, 128), dict(causal=True)),
    ("paged16-rotary-sinks-int-lens", (2, 8, 2, 2, 320, 2, 16, 64), dict(causal=True, rotary="halves", sinks=True)),
]


@pytest.mark.parametrize("shape, spec", [pytest.param(*c[1:], id=c[0]) for c in REPEATED])
def test_repeated_calls_write_each_calls_pointers(rng, shape, spec):
    """Calls of one signature reuse their launches' argument buffers: alternating between two sets of arrays
    (A, B, A), every call must read and write its own arrays (no stale pointer, length or workspace)."""
    sets = [_case_inputs(rng, shape, spec, "float32") for _ in range(2)]
    int_lens = spec.get("rotary") is not None  # the paged case passes cache_seqlens as a Python int
    for which in (0, 1, 0):
        q, kc, vc, kn, vn, lens, table, causal, kw = sets[which]
        seqlens = int(lens[1]) if int_lens else lens
        kcd, vcd = cupy.asarray(kc), cupy.asarray(vc)
        kwd = {n: _dev(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
        _poison((q.shape, q.dtype), (q.shape[:-1], np.float32))
        o, lse = cf.attention_with_kvcache(cupy.asarray(q), kcd, vcd, _dev(kn), _dev(vn),
                                           cache_seqlens=seqlens if int_lens else cupy.asarray(seqlens),
                                           block_table=_dev(table), causal=causal, **kwd)  # fmt: skip
        kr, vr = kc.copy(), vc.copy()
        ro, rlse = kref.attention_with_kvcache(q, kr, vr, kn, vn, cache_seqlens=seqlens, block_table=table,
                                               causal=causal, **kw)  # fmt: skip
        assert_float32_close(f"o of set {which}", o.get(), ro, 1e-5)
        np.testing.assert_allclose(lse.get(), rlse, rtol=1e-5, atol=1e-4)
        np.testing.assert_array_equal(vcd.get(), vr)
        if kw.get("rotary_cos") is None:
            np.testing.assert_array_equal(kcd.get(), kr)
        else:  # rotated keys: float32 on the device against float64 here, within one unit in the last place
            np.testing.assert_allclose(kcd.get(), kr, rtol=2.0**-23, atol=2.0**-23)
