"""The float32 backward with a float32 bias and its gradient at D = 128 (the masks suite's rows: B*N = 16k, H = 16,
a (1, H, N, N) bias): the table's tile (Br 32, the bias read through L1: staged tiles do not fit beside it) against
Br 16 (8 key warps), whose staged tiles fit, through the public API (plans.mma's table swapped, the plan cache
cleared). Each cell: GPU ms per backward call from CUDA events around 5 back-to-back calls, median of 7, the two
alternated twice (best of the two rounds; dev_ws_ab.per_call_ms, which warms up with 3 calls). GPU machine:
    python benchmarks/dev_f32_bias_bwd.py > $OUT/f32_bias_bwd.txt
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev_ws_ab import per_call_ms  # noqa: E402


def main() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.plans import mma
    from cupyflash.plans.mma import BackwardConfig

    table = mma.BACKWARD_CONFIGS_F32[128]
    alts = {"table Br 32 (L1)": table, "Br 16 x 8 key warps (staged)": BackwardConfig(128, br=16, key_warps=8, elem=4)}
    rng = cp.random.default_rng(0)
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; float32 D=128 backward with bias_grad, ms")
    for n in (1024, 2048, 4096):
        b, h = 16384 // n, 16
        q, k, v, do = (rng.standard_normal((b, h, n, 128), dtype=cp.float32) for _ in range(4))
        bias = rng.standard_normal((1, h, n, n), dtype=cp.float32)
        o, lse = cf.attention_forward(q, k, v, bias=bias)
        best: dict[str, float] = {}
        for rnd in range(2):
            for name in (list(alts) if rnd == 0 else list(reversed(alts))):
                mma.BACKWARD_CONFIGS_F32[128] = alts[name]
                cuda_backend._backward_cache.clear()  # plans are cached per call signature
                ms = per_call_ms(lambda: cf.attention_backward(do, q, k, v, o, lse, bias=bias, bias_grad=True),
                                 calls=5, batches=7)
                best[name] = min(best.get(name, ms), ms)
        mma.BACKWARD_CONFIGS_F32[128] = table
        cuda_backend._backward_cache.clear()
        base = best["table Br 32 (L1)"]
        print(f"B={b} H={h} N={n}: " + " | ".join(f"{k_} {t:.3f} ({base / t:.3f}x)" for k_, t in best.items()),
              flush=True)
        q = k = v = do = bias = o = lse = None  # noqa: F841 - free before the next shape
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
