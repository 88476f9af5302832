"""The mma family's float32 forward (3xTF32 on tensor cores) against the portable one and PyTorch SDPA EFFICIENT.

For each shape, causal and not: GPU time per call (CUDA events around a batch of calls, median of batches; the
family entry points with given outputs, so neither allocation nor host dispatch is timed), TFLOP/s (forward
4 B H N^2 D, halved for causal), the speed-up of the mma forward over each other, and the relative error of its o
and lse against float64 (the NumPy reference on the first two heads of batch 0), all in this one process. SDPA
EFFICIENT (memory-efficient attention, 3xTF32 on sm_80+ for float32) runs on the same arrays where torch imports.

    python benchmarks/dev_mma_f32.py                  # the table, on stdout (about 1-2 minutes with compiles)
    python benchmarks/dev_mma_f32.py --configs        # also alternative float32 tiles of the mma forward
    python benchmarks/dev_mma_f32.py --warm           # only compile, in parallel, what this script and
                                                      # tests/test_mma_float32_fwd_gpu.py launch (CuPy's disk cache)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

#: (label, B, H, N, D): the llm.c "tiny" shape (the issue's 39.8 us on the portable family, 25 us target) and longer
#: sequences at D = 64 and 128.
SHAPES = [("tiny", 4, 12, 256, 64), ("N1k-d64", 2, 16, 1024, 64), ("N4k-d64", 2, 16, 4096, 64),
          ("N4k-d128", 2, 16, 4096, 128)]  # fmt: skip


def alternatives() -> dict[int, list]:
    """Float32 tiles tried beside the plan's (``--configs``), per padded head dim."""
    from cupyflash.plans.mma import ForwardConfig as C

    return {
        64: [C(64, br=64, bc=64, warps=4, elem=4), C(64, br=128, bc=32, warps=8, elem=4)],
        128: [C(128, br=64, bc=32, warps=4, elem=4), C(128, br=128, bc=16, warps=8, elem=4)],
    }  # fmt: skip


def warm_names() -> list[tuple[str, str]]:
    """(source, name) of the kernels the GPU test file and this script launch: the float32 forwards of every padded
    head dim with the built-in policies and the test's dropout and mask/bias policies, the portable forwards timed
    here."""
    from cupyflash.plans import mma, portable
    from cupyflash.variants import BUILTIN, PLAIN, Variant

    extra = (Variant(dropout=0.1), Variant(causal=True, mask=True, bias="float"), Variant(causal=True, bias="float"))
    out = [(mma.FORWARD_SOURCE, c.name("float", v.cpp_policy)) for v in (*BUILTIN, *extra)
           for c in mma.FORWARD_CONFIGS_F32.values()]  # fmt: skip
    heads = tuple(f"portable_fwd<float, {d}," for d in sorted({d for *_, d in SHAPES}))
    return out + [(src, n) for src, n in portable.instantiations(PLAIN) if n.startswith(heads)]


def _compile(job: tuple[str, str]) -> str:
    from cupyflash.kernels.build import get_function

    t = time.time()
    get_function(*job)
    return f"{time.time() - t:5.1f} s  {job[1]}"


def warm(workers: int) -> None:
    import multiprocessing as mp

    jobs = warm_names()
    t = time.time()
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        for line in pool.map(_compile, jobs):
            print(line, flush=True)
    print(f"compiled {len(jobs)} kernels in {time.time() - t:.0f} s", flush=True)


def sdpa_efficient(q, k, v):
    """A call of PyTorch SDPA EFFICIENT on the same (CuPy) arrays, or None without torch (or without the backend)."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return None
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))

    def call(causal: bool) -> None:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    try:
        call(False)
    except RuntimeError:
        return None
    torch.cuda.synchronize()
    return call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", action="store_true", help="also time alternative float32 tiles")
    ap.add_argument("--warm", action="store_true", help="only compile the test file's and this script's kernels")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--reps", type=int, default=10, help="calls per timed batch")
    args = ap.parse_args()
    if args.warm:
        warm(args.workers)
        return 0

    import cupy as cp

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from dev_wgmma import median_ms

    from cupyflash import reference
    from cupyflash.kernels import mma, portable
    from cupyflash.plans import DeviceLimits
    from cupyflash.plans import mma as mma_plans
    from cupyflash.validation import check_attention

    limits = DeviceLimits.current()
    dev = cp.cuda.Device()
    print(f"# {cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()} (sm_{dev.compute_capability}), float32 "
          f"forward, GPU time per call (CUDA events, median of 15 batches of {args.reps} calls); 'x mma' = this "
          "kernel's time / the first mma row's", flush=True)  # fmt: skip
    print(f"{'shape':<9} {'causal':<6} {'kernel':<30} {'us':>9} {'TFLOP/s':>8} {'x mma':>7} {'o rel err':>10} "
          f"{'lse rel err':>11}", flush=True)  # fmt: skip
    rng = np.random.default_rng(0)
    for label, b, h, n, d in SHAPES:
        q, k, v = (cp.asarray(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(3))
        sub = [x[:1, :2].get() for x in (q, k, v)]  # the reference's part: batch 0, heads 0-1
        sdpa = sdpa_efficient(q, k, v)
        for causal in (False, True):
            p = check_attention(q, k, v, causal=causal)
            ro, rlse = reference.attention_forward(*sub, causal)
            flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
            runs = [(f"mma {_label(mma_plans.forward_config(d, limits, 4))}", mma, {})]
            if args.configs:
                for cfg in alternatives().get(mma_plans.padded_head_dim(d), []):
                    if cfg.shared_bytes <= limits.max_shared_per_block:
                        runs.append((f"mma {_label(cfg)}", mma, {"config": cfg}))
            runs.append(("portable", portable, {}))
            base = None
            for name, fam, options in runs:
                o = cp.full(q.shape, np.nan, np.float32)
                lse = cp.full(q.shape[:-1], np.nan, np.float32)

                def call(fam=fam, o=o, lse=lse, options=options):
                    fam.forward(q, k, v, o, lse, p, **options)

                call()
                err_o = _rel(o[:1, :2].get(), ro)
                fin = np.isfinite(rlse)
                err_l = _rel(lse[:1, :2].get()[fin], rlse[fin])
                ms = median_ms(lambda: [call() for _ in range(args.reps)], warmup=2, iters=15) / args.reps
                base = base or ms
                print(f"{label:<9} {str(causal):<6} {name:<30} {ms * 1e3:9.1f} {flops / ms / 1e9:8.1f} "
                      f"{ms / base:7.2f} {err_o:10.2e} {err_l:11.2e}", flush=True)  # fmt: skip
            if sdpa is not None:
                ms = median_ms(lambda: [sdpa(causal) for _ in range(args.reps)], warmup=2, iters=15) / args.reps
                print(f"{label:<9} {str(causal):<6} {'torch SDPA EFFICIENT':<30} {ms * 1e3:9.1f} "
                      f"{flops / ms / 1e9:8.1f} {ms / base:7.2f}", flush=True)  # fmt: skip
    return 0


def _label(cfg) -> str:
    return f"Br={cfg.br} Bc={cfg.bc} w={cfg.warps} st={cfg.stages}"


def _rel(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref)) if np.isfinite(x).all() else float("inf")


if __name__ == "__main__":
    sys.exit(main())
