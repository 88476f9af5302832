"""Causal linear attention: cupyflash's kernels against fla's Triton ``chunk_linear_attn`` (when
fla-core and torch import) and, on request, a naive masked-matmul version in CuPy, CUDA events,
median of runs, forward and forward+backward.

    python benchmarks/dev_linear.py [--dtypes bfloat16,float16] [--variants 'dv=32;dv=64,seg=1'] [--naive]
    python benchmarks/dev_linear.py --compile-only

"ours" is the default dispatch (16-bit inputs: the fused tensor-core walk with the plan's DV);
``--variants`` adds columns with fused-walk tiles forced; ``--ffma`` adds the FFMA passes. The naive
version materialises N x N scores in head slices sized to stay within a few GB. ``--compile-only``
fills CuPy's kernel cache for every linear kernel in parallel processes (so later runs keep
compilation out of their first calls).
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


def fla_calls(q, k, v, do):
    """(fwd, fwd+bwd) closures of fla's chunk_linear_attn on (B, N, H, D) copies, or None."""
    try:
        import torch
        from fla.ops.linear_attn import chunk_linear_attn

        from cupyflash.bench.device import to_torch
    except Exception as e:  # not installed here
        print(f"fla: not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return None
    leaves = [to_torch(x).transpose(1, 2).contiguous().requires_grad_(True) for x in (q, k, v)]
    g = to_torch(do).transpose(1, 2).contiguous()

    def fwd(i):
        with torch.no_grad():
            return chunk_linear_attn(*leaves, scale=1.0, normalize=False)[0]

    def fwd_bwd(i):
        for x in leaves:
            x.grad = None
        chunk_linear_attn(*leaves, scale=1.0, normalize=False)[0].backward(g)

    return fwd, fwd_bwd


def smoke() -> None:
    """Forward and backward of small GQA problems, causal with decay (Nq > Nk) and non-causal, two
    fused tile shapes: short enough to run under compute-sanitizer."""
    import cupy

    import cupyflash.linear_api as cf
    from cupyflash import _dtypes
    from cupyflash.kernels import linear
    from cupyflash.plans import linear as lp

    rng = np.random.default_rng(1)
    for dk, dv in ((64, 32), (128, 64)):
        assert (dk, dv) in lp.FUSED_SHAPES
        linear.FUSED_DV = dv
        linear.FUSED_SEGMENTS = 3  # the causal walks split into 3 runs of 1 chunk
        for causal in (True, False):
            q = cupy.asarray(rng.standard_normal((1, 4, 150, dk - 8), dtype=np.float32)).astype(_dtypes.BFLOAT16)
            k, v = (cupy.asarray(rng.standard_normal((1, 2, 130, dk - 8), dtype=np.float32)).astype(_dtypes.BFLOAT16)
                    for _ in "kv")
            lam = cupy.asarray(np.full(4, 0.97, np.float32)) if causal else None
            cf.linear_attention(q, k, v, causal=causal, decay=lam)
            cf.linear_attention_backward(q, q, k, v, causal=causal, decay=lam)
    linear.FUSED_DV = linear.FUSED_SEGMENTS = None
    cupy.cuda.Device().synchronize()
    print("smoke: done")


def main() -> None:
    import cupy

    import cupyflash.linear_api as cf
    from cupyflash import _dtypes
    from cupyflash.bench.timing import CachePlan, CupyClock, measure

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--variants", default="", help="fused-walk overrides to time besides the default, e.g. "
                    "'dv=32;dv=64,seg=1' (dv: FUSED_DV, seg: FUSED_SEGMENTS, stages: FUSED_STAGES)")
    ap.add_argument("--ffma", action="store_true", help="also time the FFMA passes")
    ap.add_argument("--naive", action="store_true", help="also time the naive CuPy version (slow)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; later cases are skipped past it")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="one small case of every fused pass (for compute-sanitizer)")
    args = ap.parse_args()
    if args.compile_only:
        compile_all()
        return
    if args.smoke:
        smoke()
        return
    from cupyflash.kernels import linear

    names = {"float32": _dtypes.FLOAT32, "float16": _dtypes.FLOAT16, "bfloat16": _dtypes.BFLOAT16}
    keys = {"dv": "FUSED_DV", "seg": "FUSED_SEGMENTS", "stages": "FUSED_STAGES"}
    variants = [dict((keys[k], int(v)) for k, v in (kv.split("=") for kv in var.split(",")))
                for var in args.variants.split(";") if var]  # fmt: skip
    clock = CupyClock()
    t0 = time.time()
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"device: {dev}; causal, scale 1; CUDA-event medians (ms), fwd / fwd+bwd")
    rng = np.random.default_rng(0)
    kw = dict(runs=20, min_runs=5, max_seconds=1.0)
    rows = []
    for dname in args.dtypes.split(","):
        dtype = names[dname]
        for b, h, n, d in SHAPES:
            if time.time() - t0 > args.budget:
                print(f"{dname} B={b} H={h} N={n} D={d}: skipped (time budget)")
                continue
            shape = (b, h, n, d)

            def unit(x):
                return (x / cupy.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)

            q = unit(cupy.asarray(rng.standard_normal(shape, dtype=np.float32)))
            k = unit(cupy.asarray(rng.standard_normal(shape, dtype=np.float32)))
            v = cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
            do = cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
            p = cf.check_linear(q, k, v, causal=True)
            cols = {}

            def timed(label, f, fb, clk=clock):
                tf = measure(f, clk, plan=CachePlan(1, 0), **kw).median_ms
                tfb = measure(fb, clk, plan=CachePlan(1, 0), **kw).median_ms
                cols[label] = (tf, tfb)

            timed("ours", lambda i: cf.linear_attention(q, k, v, causal=True),
                  lambda i: (cf.linear_attention(q, k, v, causal=True),
                             cf.linear_attention_backward(do, q, k, v, causal=True)))  # fmt: skip
            for var in variants:
                label = ",".join(f"{k[6:].lower()}{v}" for k, v in var.items())
                for k_, v_ in var.items():
                    setattr(linear, k_, v_)
                try:
                    timed(label, lambda i: linear.forward(q, k, v, None, None, p),
                          lambda i: (linear.forward(q, k, v, None, None, p),
                                     linear.backward(do, q, k, v, None, None, p)))  # fmt: skip
                except ValueError as e:
                    print(f"{label}: {e}")
                finally:
                    for k_ in var:
                        setattr(linear, k_, None)
            if args.ffma:
                timed("ffma", lambda i: linear.forward(q, k, v, None, None, p, tensor_cores=False),
                      lambda i: (linear.forward(q, k, v, None, None, p, tensor_cores=False),
                                 linear.backward(do, q, k, v, None, None, p, tensor_cores=False)))  # fmt: skip
            # ours against a float32 naive result on two heads (a sanity check of the timed kernels)
            q2, k2, v2 = (x[:1, :2].astype(np.float32) for x in (q, k, v))
            o_naive = naive(q2, k2, v2, cupy.tri(n, dtype=np.float32))
            o_ours = cf.linear_attention(q[:1, :2], k[:1, :2], v[:1, :2], causal=True).astype(np.float32)
            err = float(cupy.linalg.norm(o_ours - o_naive) / cupy.linalg.norm(o_naive))
            del q2, k2, v2, o_naive
            if args.naive and dname == "float16":  # CuPy's matmul takes no bfloat16
                tril = cupy.tri(n, dtype=dtype)
                try:
                    timed("naive", lambda i: naive(q, k, v, tril), lambda i: naive(q, k, v, tril, do))
                except cupy.cuda.memory.OutOfMemoryError:
                    pass
                del tril
            if not args.no_fla:
                calls = fla_calls(q, k, v, do)
                if calls is not None:
                    from cupyflash.bench.timing import TorchClock

                    try:
                        timed("fla", *calls, clk=TorchClock())
                    except Exception as e:
                        print(f"fla failed: {type(e).__name__}: {str(e).splitlines()[0]}")
            cupy.get_default_memory_pool().free_all_blocks()
            line = f"{dname:8} B={b} H={h:2} N={n:5} D={d:3} | " + " | ".join(
                f"{lab} {tf:7.3f} / {tfb:7.3f}" for lab, (tf, tfb) in cols.items()
            )
            if "fla" in cols:
                f, fb = cols["fla"]
                line += f" | ours/fla {cols['ours'][0] / f:.2f} / {cols['ours'][1] / fb:.2f}"
            print(line + f" | vs naive rel diff {err:.1e}", flush=True)
            rows.append(line)
    print("\nsummary")
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
