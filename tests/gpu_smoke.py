"""Run every kernel once on small odd shapes; meant for compute-sanitizer.

    compute-sanitizer --tool memcheck  python tests/gpu_smoke.py
    compute-sanitizer --tool racecheck python tests/gpu_smoke.py
    compute-sanitizer --tool initcheck python tests/gpu_smoke.py

Not collected by pytest (no test_ prefix). Exits non-zero if any result is non-finite.
"""
from __future__ import annotations

import sys

import cupy
import numpy as np

import cupyflash
from cupyflash import _dtypes


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    # float32 runs on the mma family too (3xTF32, plans.mma.MAX_ROWS_F32).
    cases = [("portable", dt) for dt in _dtypes.SUPPORTED] + [("mma", dt) for dt in _dtypes.SUPPORTED]
    if cupy.cuda.Device().compute_capability == "90":
        cases += [("wgmma", _dtypes.FLOAT16), ("wgmma", _dtypes.BFLOAT16)]
    for kernel, dtype in cases:
        for (hq, hk, nq, nk, d, causal) in [(2, 1, 17, 33, 40, True), (2, 2, 33, 17, 64, True), (1, 1, 70, 70, 128, False),
                                               (2, 1, 70, 100, 128, True), (1, 1, 70, 130, 64, False)]:
            q = cupy.asarray(rng.standard_normal((1, hq, nq, d)).astype(dtype))
            k = cupy.asarray(rng.standard_normal((1, hk, nk, d)).astype(dtype))
            v = cupy.asarray(rng.standard_normal((1, hk, nk, d)).astype(dtype))
            do = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
            # The last shape reaches wgmma's warp-specialised forward at D = 64 (plans.wgmma.WS_DEFAULT).
            # The plain call, then every variant policy at once: a window, softcap, ALiBi and sinks.
            slopes = cupy.asarray(rng.random(hq).astype(np.float32))
            sinks = cupy.asarray(rng.standard_normal(hq).astype(np.float32))
            # Masks and biases (issue 17) read through broadcast strides: a key-padding mask and a per-head bias
            # with its gradient (the atomics address the bias's own shape).
            mask = cupy.asarray(rng.random((1, 1, 1, nk)) < 0.8)
            bias = cupy.asarray(rng.standard_normal((hq, 1, nk)).astype(dtype))
            # Full-shape ones too: their rows are prefetched a tile ahead, and dbias is stored into the output
            # pair by pair (left uninitialised where no tile is skipped: initcheck sees any element not written).
            full_mask = cupy.asarray(rng.random((1, hq, nq, nk)) < 0.8)
            full_bias = cupy.asarray(rng.standard_normal((1, hq, nq, nk)).astype(dtype))
            for label, kw in (("plain", {}), ("variants", dict(window_size=(9, 5), softcap=20.0,
                                                                alibi_slopes=slopes, sinks=sinks)),
                              ("masks", dict(mask=mask, bias=bias, softcap=20.0)),
                              ("full masks", dict(mask=full_mask, bias=full_bias))):  # fmt: skip
                o, lse = cupyflash.attention_forward(q, k, v, causal=causal, kernel=kernel, **kw)
                bkw = dict(kw, bias_grad=True) if "bias" in kw else kw
                grads = cupyflash.attention_backward(do, q, k, v, o, lse, causal=causal, kernel=kernel, **bkw)
                finite = all(bool(cupy.isfinite(x.astype(np.float32)).all()) for x in (o, *grads))
                print(f"{kernel:8s} {str(dtype):8s} hq={hq} hk={hk} nq={nq} nk={nk} d={d} causal={causal} {label}: "
                      f"{'ok' if finite else 'NON-FINITE'}")
                bad += not finite
    # float32 query parts on the mma family (plans.mma.query_parts): group 4 x 1100 query rows a kv head, 2 parts, their
    # partial dK/dV in scratch and the combine launch; with a full bias and its gradient too.
    q, do = (cupy.asarray(rng.standard_normal((1, 4, 1100, 64)).astype(np.float32)) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((1, 1, 200, 64)).astype(np.float32)) for _ in range(2))
    full_bias = cupy.asarray(rng.standard_normal((1, 4, 1100, 200)).astype(np.float32))
    for label, kw in (("plain", {}), ("bias", dict(bias=full_bias))):
        o, lse = cupyflash.attention_forward(q, k, v, causal=True, kernel="mma", **kw)
        bkw = dict(kw, bias_grad=True) if kw else kw
        grads = cupyflash.attention_backward(do, q, k, v, o, lse, causal=True, kernel="mma", **bkw)
        finite = all(bool(cupy.isfinite(x).all()) for x in (o, *grads))
        print(f"mma      float32  query parts {label}: {'ok' if finite else 'NON-FINITE'}")
        bad += not finite
    # A mask_mod with its block mask (issue 17) on each wgmma forward the plan picks: the warp-specialised one at
    # D = 128, and at D = 64 past plans.wgmma.WS_MIN_BLOCK_KEYS_D64 visited keys a row (the first nk - 50 keys seen by
    # every query), the lockstep one at D = 64 with few keys; causal, and documents of 40 keys that end mid-tile
    # (EMPTY, PARTIAL and FULL blocks).
    if cupy.cuda.Device().compute_capability == "90":
        for d, nk, seen in ((128, 300, 8), (64, 300, 8), (64, 6200, 6150)):
            q, do = (cupy.asarray(rng.standard_normal((1, 2, 70, d)).astype(np.float16)) for _ in range(2))
            k, v = (cupy.asarray(rng.standard_normal((1, 1, nk, d)).astype(np.float16)) for _ in range(2))
            snippet = {"mask_mod": f"doc(b, kv_idx) == doc(b, q_idx + Nk - Nq) || kv_idx < {seen}",
                       "aux": {"doc": cupy.asarray((np.arange(nk) // 40)[None].astype(np.int32))}}
            bm = cupyflash.create_block_mask(snippet["mask_mod"], 1, None, 70, nk, aux=snippet["aux"])
            o, lse = cupyflash.attention_forward(q, k, v, causal=True, block_mask=bm, **snippet)
            grads = cupyflash.attention_backward(do, q, k, v, o, lse, causal=True, block_mask=bm, **snippet)
            finite = all(bool(cupy.isfinite(x.astype(np.float32)).all()) for x in (o, *grads))
            print(f"wgmma    float16  block mask d={d} nk={nk} ({bm.visited_keys_causal} keys a row): "
                  f"{'ok' if finite else 'NON-FINITE'}")
            bad += not finite
    try:
        from cupyflash import linear_attention_backward, linear_attention_forward
    except ImportError:
        linear_attention_forward = None
    if linear_attention_forward is not None:
        # (mask, causal, decay, N): masked tiles, the chunked/fused walk with and without decay,
        # non-causal, and N = 600 (10 chunks, which the fused walk splits into segments).
        variants = [("mask", True, False, 37), (None, True, False, 37), (None, True, True, 600), (None, False, False, 37)]
        for dtype in _dtypes.SUPPORTED:
            for mask, causal, decay, n in variants:
                q = cupy.asarray(rng.standard_normal((1, 2, n, 32)).astype(dtype))
                k = cupy.asarray(rng.standard_normal((1, 1, n, 32)).astype(dtype))
                v = cupy.asarray(rng.standard_normal((1, 1, n, 32)).astype(dtype))
                m = None if mask is None else cupy.asarray(rng.random((n, n)))
                lam = cupy.asarray([0.9, 0.99]) if decay else None
                o = linear_attention_forward(q, k, v, causal=causal, mask=m, decay=lam)
                do = cupy.asarray(rng.standard_normal(o.shape).astype(dtype))
                grads = linear_attention_backward(do, q, k, v, causal=causal, mask=m, decay=lam)
                finite = all(bool(cupy.isfinite(x.astype(np.float32)).all()) for x in (o, *grads))
                print(f"linear   {str(dtype):8s} mask={mask} causal={causal} decay={decay} n={n}: "
                      f"{'ok' if finite else 'NON-FINITE'}")
                bad += not finite
    # KV-cache decode (issue 15): both decode kernels, a contiguous and two paged caches (a page size that is no
    # power of two), 4 and 20 packed rows, a split and none, the variant policies; every cache slot past the
    # sequences holds random data, so a read outside a sequence's keys shows up here as well as in memcheck.
    for kernel, dtype in [("mma", _dtypes.FLOAT16), ("mma", _dtypes.BFLOAT16), ("fma", _dtypes.BFLOAT16),
                          ("auto", np.dtype(np.float32))]:  # fmt: skip
        for page, nq, d, splits in [(None, 1, 128, 0), (3, 5, 40, 3), (16, 1, 64, 1)]:
            b, hq, hk, cap = 3, 8, 2, 96
            shape = (b, hk, cap, d) if page is None else (b * cap // page + 2, hk, page, d)
            kc = cupy.asarray(rng.standard_normal(shape).astype(dtype))
            vc = cupy.asarray(rng.standard_normal(shape).astype(dtype))
            table = None if page is None else cupy.asarray(
                rng.permutation(shape[0])[: b * cap // page].reshape(b, cap // page).astype(np.int32))
            q = cupy.asarray(rng.standard_normal((b, hq, nq, d)).astype(dtype))
            kn = cupy.asarray(rng.standard_normal((b, hk, nq, d)).astype(dtype))
            lens = cupy.asarray(np.array([0, 41, cap - nq], np.int32))
            for label, kw in (("plain", {}), ("variants", dict(causal=True, window_size=(30, 0), softcap=20.0,
                                                                alibi_slopes=cupy.asarray(rng.random(hq).astype(np.float32)),
                                                                sinks=cupy.asarray(rng.standard_normal(hq).astype(np.float32))))):  # fmt: skip
                o, lse = cupyflash.attention_with_kvcache(q, kc, vc, kn, kn, cache_seqlens=lens, block_table=table,
                                                          num_splits=splits, kernel=kernel, **kw)  # fmt: skip
                finite = bool(cupy.isfinite(o.astype(np.float32)).all())
                print(f"decode {kernel:4s} {str(dtype):8s} page={page} nq={nq} d={d} splits={splits} {label}: "
                      f"{'ok' if finite else 'NON-FINITE'}")
                bad += not finite
    # Decode v3: many splits merged inside the decode launch (40 > 32: the merge hands out split weights in two
    # rounds) on a page-size-1 cache (block-table entries fetched a tile ahead), then hostile lengths and tables.
    for kernel, dtype in [("mma", _dtypes.BFLOAT16), ("fma", np.dtype(np.float32))]:
        b, hq, hk, cap, d = 2, 8, 2, 64 * 40, 128
        kc = cupy.asarray(rng.standard_normal((b * cap + 3, hk, 1, d)).astype(dtype))
        vc = cupy.asarray(rng.standard_normal((b * cap + 3, hk, 1, d)).astype(dtype))
        table = cupy.asarray(rng.permutation(b * cap + 3)[: b * cap].reshape(b, cap).astype(np.int32))
        q = cupy.asarray(rng.standard_normal((b, hq, 1, d)).astype(dtype))
        sinks = cupy.asarray(rng.standard_normal(hq).astype(np.float32))
        for label, lens, tab in (("ok", np.array([cap - 1, 700], np.int32), table),
                                 ("hostile", np.array([-9, 2**30], np.int32),
                                  cupy.asarray(rng.integers(-2**20, 2**20, size=(b, cap)).astype(np.int32)))):
            o, lse = cupyflash.attention_with_kvcache(q, kc, vc, cache_seqlens=cupy.asarray(lens), block_table=tab,
                                                      sinks=sinks, num_splits=40, kernel=kernel)  # fmt: skip
            finite = bool(cupy.isfinite(o.astype(np.float32)).all())
            print(f"decode {kernel:4s} {str(dtype):8s} page=1 splits=40 {label}: {'ok' if finite else 'NON-FINITE'}")
            bad += not finite
    cupy.cuda.Device().synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
