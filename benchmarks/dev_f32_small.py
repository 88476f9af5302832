"""float32 on the mma family at small grids: the plan's choice (plans.mma.small_grid), the table's tiles and
smaller ones that give more blocks, through the public API (plans.mma's tables swapped, the plan caches cleared).
Each cell: GPU microseconds per call with the host out of the way (the overhead suite's ``queued_us``: 100 calls
queued behind a spin kernel), median of 5, the configurations alternated over two rounds (best of the two). GPU
machine:
    python benchmarks/dev_f32_small.py > $OUT/f32_small.txt
    python benchmarks/dev_f32_small.py --bc32 > $OUT/f32_bc32.txt   # the D = 64 forward with Bc 32
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (B, H, N, D, causal): the overhead suite's float32 row first (issue 12: <= 25 us forward, <= 45 us backward).
SHAPES = [(4, 12, 256, 64, False), (4, 12, 256, 64, True), (1, 16, 512, 64, False), (2, 8, 1024, 64, False),
          (1, 8, 1024, 64, False), (4, 12, 256, 128, False), (2, 8, 512, 128, False)]


# --bc32: the D = 64 forward with Br 128 x Bc 32 (8 warps) beside the table, forward only, small and large grids.
BC32_SHAPES = [(4, 12, 256, 64, False), (4, 12, 256, 64, True), (2, 16, 1024, 64, False), (4, 12, 1024, 64, True),
               (4, 12, 2048, 64, True), (2, 16, 4096, 64, False), (4, 12, 4096, 64, True)]


def main() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.bench import overhead, timing
    from cupyflash.plans import mma
    from cupyflash.plans.mma import BackwardConfig, ForwardConfig

    fwd_alts = {64: [mma.FORWARD_CONFIGS_F32[64], ForwardConfig(64, br=64, bc=64, warps=4, elem=4),
                     ForwardConfig(64, br=64, bc=32, warps=4, elem=4)],
                128: [mma.FORWARD_CONFIGS_F32[128], ForwardConfig(128, br=64, bc=32, warps=4, elem=4)]}
    bwd_alts = {64: [mma.BACKWARD_CONFIGS_F32[64], BackwardConfig(64, br=32, key_warps=4, elem=4),
                     BackwardConfig(64, br=64, key_warps=4, elem=4), BackwardConfig(64, br=32, key_warps=8, elem=4)],
                128: [mma.BACKWARD_CONFIGS_F32[128], BackwardConfig(128, br=32, key_warps=4, elem=4),
                      BackwardConfig(128, br=16, key_warps=4, elem=4)]}
    bc32 = "--bc32" in sys.argv
    if bc32:
        fwd_alts = {64: [mma.FORWARD_CONFIGS_F32[64], ForwardConfig(64, br=128, bc=32, warps=8, elem=4),
                         ForwardConfig(64, br=128, bc=32, warps=8, stages=3, elem=4)]}
    fwd0, bwd0 = dict(mma.FORWARD_CONFIGS_F32), dict(mma.BACKWARD_CONFIGS_F32)
    small0 = dict(mma.SMALL_GRID_FORWARD_F32), dict(mma.SMALL_GRID_BACKWARD_F32)

    def choose(pass_: str, d: int, cfg) -> None:
        """cfg None: the plan as shipped; else the table entry forced (no small-grid rule)."""
        mma.FORWARD_CONFIGS_F32.update(fwd0)
        mma.BACKWARD_CONFIGS_F32.update(bwd0)
        for table, saved in zip((mma.SMALL_GRID_FORWARD_F32, mma.SMALL_GRID_BACKWARD_F32), small0):
            table.clear()
            if cfg is None:
                table.update(saved)
        if cfg is not None:
            (mma.FORWARD_CONFIGS_F32 if pass_ == "fwd" else mma.BACKWARD_CONFIGS_F32)[d] = cfg
        cuda_backend._forward_cache.clear()  # plans are cached per call signature
        cuda_backend._backward_cache.clear()

    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()} ({sms} SMs); float32, GPU us per call "
          "(queued, median of 5, best of 2 rounds); blocks = the main kernel's grid", flush=True)
    rng = cp.random.default_rng(0)
    for b, h, n, d, causal in BC32_SHAPES if bc32 else SHAPES:
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32) for _ in range(4))
        o, lse = cf.attention_forward(q, k, v, causal)
        passes = [("fwd", [None, *fwd_alts[d]])] + ([] if bc32 else [("bwd", [None, *bwd_alts[d]])])
        for pass_, alts in passes:
            if pass_ == "fwd":
                call = lambda: cf.attention_forward(q, k, v, causal)  # noqa: E731
            else:
                call = lambda: cf.attention_backward(do, q, k, v, o, lse, causal)  # noqa: E731
            t = overhead.Timed(call, cp.cuda.Device().synchronize, timing.CupyClock())
            best: dict[int, float] = {}
            for rnd in range(2):
                for i in (range(len(alts)) if rnd == 0 else reversed(range(len(alts)))):
                    choose(pass_, d, alts[i])
                    try:
                        _, host = overhead.wall_us(t, calls=100, warmup=5, repeats=3)
                        us = statistics.median(overhead.queued_us(t, host) for _ in range(5))
                    except Exception as e:  # noqa: BLE001 - a configuration that does not build or fit is a row
                        print(f"  {pass_} {alts[i]}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                        us = float("inf")
                    best[i] = min(best.get(i, us), us)
            choose(pass_, d, None)
            base = best[1]
            for i, cfg in enumerate(alts):
                if cfg is None:
                    print(f"B={b} H={h} N={n} D={d} {'causal' if causal else 'full  '} {pass_} plan : "
                          f"{best[0]:7.1f} us ({base / best[0]:.2f}x the table)", flush=True)
                    continue
                tiles = (n + (cfg.br if pass_ == "fwd" else cfg.bc) - 1) // (cfg.br if pass_ == "fwd" else cfg.bc)
                print(f"B={b} H={h} N={n} D={d} {'causal' if causal else 'full  '} {pass_} "
                      f"{'table' if i == 1 else 'alt  '} {cfg}: blocks {b * h * tiles}, {best[i]:7.1f} us "
                      f"({base / best[i]:.2f}x the table)", flush=True)


if __name__ == "__main__":
    main()
