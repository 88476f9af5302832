"""Causal linear attention: cupyflash's chunked kernels against a naive masked-matmul version in
CuPy (S = Q K^T, S *= tril, O = S V, and the matching backward), CUDA events, median of runs.

    python benchmarks/dev_linear.py [--dtype float16] [--budget 150] [--compile-only]

The naive version materialises N x N scores, in head slices sized to stay within a few GB.
For 16-bit inputs ours is timed with the default TF32 tensor-core tiles ("ours") and with the
FFMA tiles ("ffma"). ``--compile-only`` fills CuPy's kernel cache for every linear kernel in
parallel processes (so later runs keep compilation out of their first calls).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

SHAPES = [(4, 16, 8192, 64), (4, 16, 8192, 128), (1, 16, 32768, 64)]
SLICE_BYTES = 2 << 30  # one N x N buffer of a head slice


def naive(q, k, v, tril, do=None):
    """o (and dq, dk, dv when do is given) of causal linear attention, scale 1, slice by slice."""
    import cupy

    b, h, n, d = q.shape
    q3, k3, v3 = (x.reshape(b * h, n, d) for x in (q, k, v))
    g = max(1, SLICE_BYTES // (n * n * q.itemsize))
    o = cupy.empty_like(q3)
    grads = None if do is None else tuple(cupy.empty_like(q3) for _ in range(3))
    do3 = None if do is None else do.reshape(b * h, n, d)
    for s in range(0, b * h, g):
        sl = slice(s, s + g)
        a = cupy.matmul(q3[sl], k3[sl].transpose(0, 2, 1))
        a *= tril
        cupy.matmul(a, v3[sl], out=o[sl])
        if do is not None:
            dq, dk, dv = grads
            cupy.matmul(a.transpose(0, 2, 1), do3[sl], out=dv[sl])
            da = cupy.matmul(do3[sl], v3[sl].transpose(0, 2, 1))
            da *= tril
            cupy.matmul(da, k3[sl], out=dq[sl])
            cupy.matmul(da.transpose(0, 2, 1), q3[sl], out=dk[sl])
            del da
        del a
    if do is None:
        return o.reshape(q.shape)
    return tuple(x.reshape(q.shape) for x in (o, *grads))


def _compile_one(job: tuple[str, str]) -> str:
    from cupyflash.kernels import build

    build.get_function(*job)
    return job[1]


def compile_all() -> None:
    import multiprocessing as mp

    from cupyflash.kernels import linear

    jobs = linear.instantiations()
    with mp.get_context("spawn").Pool(min(16, len(jobs))) as pool:
        done = pool.map(_compile_one, jobs, chunksize=1)
    print(f"compiled {len(done)} linear kernel instantiations")


def main() -> None:
    import cupy

    import cupyflash.linear_api as cf
    from cupyflash import _dtypes
    from cupyflash.bench.timing import CachePlan, CupyClock, measure

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--budget", type=float, default=150.0, help="seconds; later shapes are skipped past it")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    if args.compile_only:
        compile_all()
        return
    from cupyflash.kernels import linear
    dtype = {"float32": _dtypes.FLOAT32, "float16": _dtypes.FLOAT16, "bfloat16": _dtypes.BFLOAT16}[args.dtype]
    clock = CupyClock()
    t0 = time.time()
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"device: {dev}, dtype {args.dtype}, causal, scale 1; times are CUDA-event medians (ms)")
    print(f"{'B':>2} {'H':>3} {'N':>6} {'D':>4} | {'fwd ours':>9} {'ffma':>8} {'naive':>9} {'x':>6} | "
          f"{'f+b ours':>9} {'ffma':>8} {'naive':>9} {'x':>6}")
    rng = np.random.default_rng(0)
    for b, h, n, d in SHAPES:
        if time.time() - t0 > args.budget:
            print(f"{b:>2} {h:>3} {n:>6} {d:>4} | skipped (time budget)")
            continue
        shape = (b, h, n, d)

        def unit(x):
            return (x / cupy.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)

        q = unit(cupy.asarray(rng.standard_normal(shape, dtype=np.float32)))
        k = unit(cupy.asarray(rng.standard_normal(shape, dtype=np.float32)))
        v = cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
        do = cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
        kw = dict(runs=10, min_runs=3, max_seconds=2.0)

        def ours_f(i):
            return cf.linear_attention(q, k, v, causal=True)

        def ours_fb(i):
            cf.linear_attention(q, k, v, causal=True)
            return cf.linear_attention_backward(do, q, k, v, causal=True)

        p = cf.check_linear(q, k, v, causal=True)

        def ffma_f(i):
            return linear.forward(q, k, v, None, None, p, tensor_cores=False)

        def ffma_fb(i):
            linear.forward(q, k, v, None, None, p, tensor_cores=False)
            return linear.backward(do, q, k, v, None, None, p, tensor_cores=False)

        t_of = measure(ours_f, clock, plan=CachePlan(1, 0), **kw).median_ms
        t_ofb = measure(ours_fb, clock, plan=CachePlan(1, 0), **kw).median_ms
        t_ff = measure(ffma_f, clock, plan=CachePlan(1, 0), **kw).median_ms
        t_ffb = measure(ffma_fb, clock, plan=CachePlan(1, 0), **kw).median_ms
        try:
            tril = cupy.tri(n, dtype=dtype)
            t_nf = measure(lambda i: naive(q, k, v, tril), clock, plan=CachePlan(1, 0), **kw).median_ms
            t_nfb = measure(lambda i: naive(q, k, v, tril, do), clock, plan=CachePlan(1, 0), **kw).median_ms
            # sanity: ours agrees with the naive result on this shape
            o_naive = naive(q[:1, :2], k[:1, :2], v[:1, :2], tril).astype(np.float32)
            o_ours = cf.linear_attention(q[:1, :2], k[:1, :2], v[:1, :2], causal=True).astype(np.float32)
            err = float(cupy.linalg.norm(o_ours - o_naive) / cupy.linalg.norm(o_naive))
            del tril
        except cupy.cuda.memory.OutOfMemoryError:
            t_nf = t_nfb = float("nan")
            err = float("nan")
        cupy.get_default_memory_pool().free_all_blocks()
        print(
            f"{b:>2} {h:>3} {n:>6} {d:>4} | {t_of:9.3f} {t_ff:8.3f} {t_nf:9.3f} {t_nf / t_of:6.1f} | "
            f"{t_ofb:9.3f} {t_ffb:8.3f} {t_nfb:9.3f} {t_nfb / t_ofb:6.1f}   (ours vs naive rel diff {err:.1e})",
            flush=True,
        )


if __name__ == "__main__":
    main()
