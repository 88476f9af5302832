"""Run the breadth features' kernels once on small odd shapes, with hostile index arrays; for compute-sanitizer.

    compute-sanitizer --tool memcheck python tests/gpu_smoke_breadth.py

Varlen calls get random cu_seqlens (empty and one-token sequences, lengths past max_seqlen_*); KV-cache calls
get cache_seqlens and block tables that hold out-of-range values (the kernels clamp them); dropout and the
deterministic backward run in every family. The point is that no access leaves the arrays whatever the index
arrays hold, so results of the hostile calls are not checked; the well-formed ones must be finite.
Not collected by pytest (no test_ prefix). Exits non-zero if a well-formed result is non-finite.
"""
from __future__ import annotations

import sys

import cupy
import numpy as np

import cupyflash
from cupyflash import _dtypes


def _finite(*xs) -> bool:
    return all(bool(cupy.isfinite(x.astype(np.float32)).all()) for x in xs)


def main() -> int:
    rng = np.random.default_rng(1)
    bad = 0
    families = ["portable", "mma"] + (["wgmma"] if cupy.cuda.Device().compute_capability == "90" else [])
    for kernel in families:
        dtype = _dtypes.BFLOAT16 if kernel != "portable" else np.float32
        for d, causal in ((64, True), (128, False)):
            lens_q = rng.choice([0, 1, 5, 17, 70, 130], size=5)
            lens_k = rng.choice([0, 1, 9, 33, 70, 140], size=5)
            cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
            cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
            tq, tk = int(cu_q[-1]), int(cu_k[-1])
            q = cupy.asarray(rng.standard_normal((tq, 4, d)).astype(dtype))
            k = cupy.asarray(rng.standard_normal((tk, 2, d)).astype(dtype))
            v = cupy.asarray(rng.standard_normal((tk, 2, d)).astype(dtype))
            do = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
            for label, mq, mk, kw in (("well-formed", int(lens_q.max()), int(lens_k.max()), {}),
                                      ("variants", int(lens_q.max()), int(lens_k.max()),
                                       dict(window_size=(7, 3), softcap=15.0,
                                            sinks=cupy.asarray(rng.standard_normal(4).astype(np.float32)))),
                                      ("max_seqlen too small", 8, 8, {})):  # fmt: skip
                args = (cupy.asarray(cu_q), cupy.asarray(cu_k), mq, mk)
                o, lse = cupyflash.attention_varlen_forward(q, k, v, *args, causal=causal, kernel=kernel, **kw)
                g = cupyflash.attention_varlen_backward(do, q, k, v, o, lse, *args, causal=causal, kernel=kernel, **kw)
                ok = _finite(o, *g) or label == "max_seqlen too small"
                print(f"varlen {kernel:8s} d={d} causal={causal} {label}: {'ok' if ok else 'NON-FINITE'}")
                bad += not ok
            # Garbage cu_seqlens: decreasing, past the totals, negative. Only memory safety is asserted.
            junk = cupy.asarray(np.array([0, tq + 50, 3, -7, tq, tq * 3], np.int32))
            junk_k = cupy.asarray(np.array([0, -5, tk + 99, 2, tk, tk], np.int32))
            o, lse = cupyflash.attention_varlen_forward(q, k, v, junk, junk_k, 64, 64, causal=causal, kernel=kernel)
            cupyflash.attention_varlen_backward(do, q, k, v, o, lse, junk, junk_k, 64, 64, causal=causal, kernel=kernel)
            print(f"varlen {kernel:8s} d={d} causal={causal} garbage cu_seqlens: ran")
        # Dropout and the deterministic backward.
        q = cupy.asarray(rng.standard_normal((1, 4, 37, 64)).astype(dtype))
        k = cupy.asarray(rng.standard_normal((1, 2, 53, 64)).astype(dtype))
        v = cupy.asarray(rng.standard_normal((1, 2, 53, 64)).astype(dtype))
        do = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
        for kw in (dict(dropout_p=0.2, dropout_seed=7), dict(deterministic=True)):
            fkw = {n: x for n, x in kw.items() if n != "deterministic"}
            o, lse = cupyflash.attention_forward(q, k, v, causal=True, kernel=kernel, **fkw)
            g = cupyflash.attention_backward(do, q, k, v, o, lse, causal=True, kernel=kernel, **kw)
            ok = _finite(o, *g)
            print(f"dense  {kernel:8s} {sorted(kw)}: {'ok' if ok else 'NON-FINITE'}")
            bad += not ok
    # KV cache: contiguous and paged (page sizes 1 and 16), append, rotary; then hostile lengths and tables.
    hq, hk, d, b = 8, 2, 128, 3
    for dtype in (_dtypes.BFLOAT16, np.float32):
        for page in (None, 1, 16):
            cap = 96
            if page is None:
                kc = cupy.asarray(rng.standard_normal((b, hk, cap, d)).astype(dtype))
                table = None
            else:
                pages = b * cap // page
                kc = cupy.asarray(rng.standard_normal((pages, hk, page, d)).astype(dtype))
                table = cupy.asarray(rng.permutation(pages).reshape(b, cap // page).astype(np.int32))
            vc = kc.copy()
            q = cupy.asarray(rng.standard_normal((b, hq, 2, d)).astype(dtype))
            kn = cupy.asarray(rng.standard_normal((b, hk, 2, d)).astype(dtype))
            vn = cupy.asarray(rng.standard_normal((b, hk, 2, d)).astype(dtype))
            cos = cupy.asarray(np.cos(rng.random((cap, 16))).astype(np.float32))
            sin = cupy.asarray(np.sin(rng.random((cap, 16))).astype(np.float32))
            lens = cupy.asarray(np.array([0, 37, cap - 2], np.int32))
            o, lse = cupyflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                                      causal=True, rotary_cos=cos, rotary_sin=sin, num_splits=3)
            ok = _finite(o)
            print(f"kvcache {str(dtype):8s} page={page}: {'ok' if ok else 'NON-FINITE'}")
            bad += not ok
            hostile = cupy.asarray(np.array([-40, cap + 500, 2**30], np.int32))
            bad_table = None if table is None else cupy.asarray(
                rng.integers(-2**20, 2**20, size=table.shape).astype(np.int32))
            cupyflash.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=hostile, block_table=bad_table,
                                             causal=True, num_splits=2)
            print(f"kvcache {str(dtype):8s} page={page} hostile lengths/table: ran")
    # A bias broadcast over a batch of 3 with its gradient: the backward's grid reads batches fastest
    # (params.batch_inner) in every family. And float32 rows of 62 elements: the portable forward's 4-byte
    # cp.async path (its pipelined K/V tiles; 16-byte copies need rows of a multiple of 4 floats).
    for kernel in families:
        dtype = _dtypes.BFLOAT16 if kernel != "portable" else np.float32
        for d in (64, 62) if kernel == "portable" else (64,):
            q = cupy.asarray(rng.standard_normal((3, 4, 70, d)).astype(dtype))
            k = cupy.asarray(rng.standard_normal((3, 2, 90, d)).astype(dtype))
            v = cupy.asarray(rng.standard_normal((3, 2, 90, d)).astype(dtype))
            do = cupy.asarray(rng.standard_normal(q.shape).astype(dtype))
            bias = cupy.asarray(rng.standard_normal((4, 70, 90)).astype(dtype))
            o, lse = cupyflash.attention_forward(q, k, v, causal=True, bias=bias, kernel=kernel)
            grads = cupyflash.attention_backward(do, q, k, v, o, lse, causal=True, bias=bias, bias_grad=True,
                                                 kernel=kernel)  # fmt: skip
            ok = _finite(o, *grads)
            print(f"batch-broadcast bias + dbias {kernel:8s} D={d}: {'ok' if ok else 'NON-FINITE'}")
            bad += not ok
    cupy.cuda.Device().synchronize()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
