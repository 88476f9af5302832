"""Where dropout's cost is, per pass (issue 16): the forward and the backward timed apart, without and with dropout
0.1, per family, in one process (CUDA events, median of 30 after warm-up). bf16, B*N = 16k, H*D = 2048.
GPU machine:
    python benchmarks/dev_dropout_split.py [--d 64 128] [--n 2048 8192] [--kernels wgmma mma]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cupyflash.bench.decode import median_ms  # noqa: E402  (CUDA events, the median after warm-up)


def _compile_one(job: tuple[int, bool, str, bool]) -> None:
    """One small call of a (D, causal, family, dropout) combination: compiles its kernels into CuPy's disk cache."""
    import cupy

    import cupyflash as cf

    d, causal, kernel, drop = job
    kw = dict(dropout_p=0.1, dropout_seed=1) if drop else {}
    q, k, v = (cupy.random.default_rng(0).standard_normal((1, 2, 256, d), dtype=cupy.float32).astype("bfloat16")
               for _ in range(3))  # fmt: skip
    o, lse = cf.attention_forward(q, k, v, causal=causal, kernel=kernel, **kw)
    cf.attention_backward(o, q, k, v, o, lse, causal=causal, kernel=kernel, **kw)
    cupy.cuda.Device().synchronize()


def precompile(ds, kernels) -> None:
    """Every combination's kernels compiled in parallel processes first (NVRTC takes seconds per kernel)."""
    import itertools
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    jobs = list(itertools.product(ds, (False, True), kernels, (False, True)))
    with ProcessPoolExecutor(max_workers=min(16, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile_one, jobs))


def main() -> None:
    import cupy

    import cupyflash as cf

    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--kernels", nargs="+", default=["wgmma", "mma"])
    a = ap.parse_args()
    precompile(a.d, a.kernels)
    rng = cupy.random.default_rng(0)
    bf16 = cupy.dtype("bfloat16")
    for d in a.d:
        for n in a.n:
            b, h = 16384 // n, 2048 // d
            q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cupy.float32).astype(bf16) for _ in range(4))
            for causal in (False, True):
                for kernel in a.kernels:
                    t = {}
                    for label, kw in (("base", {}), ("drop", dict(dropout_p=0.1, dropout_seed=1))):
                        o, lse = cf.attention_forward(q, k, v, causal=causal, kernel=kernel, **kw)
                        t[label, "fwd"] = median_ms(lambda: cf.attention_forward(q, k, v, causal=causal, kernel=kernel,
                                                                                 **kw))  # fmt: skip
                        t[label, "bwd"] = median_ms(lambda: cf.attention_backward(do, q, k, v, o, lse, causal=causal,
                                                                                  kernel=kernel, **kw))  # fmt: skip
                    fb, fd, bb, bd = t["base", "fwd"], t["drop", "fwd"], t["base", "bwd"], t["drop", "bwd"]
                    print(f"D={d} N={n} causal={int(causal)} {kernel}: fwd {fb:.3f}->{fd:.3f} ({fb / fd:.2f}x)  "
                          f"bwd {bb:.3f}->{bd:.3f} ({bb / bd:.2f}x)  total {(fb + bb) / (fd + bd):.2f}x", flush=True)
            cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
