"""Tiles of the warp-specialised D = 64 forward with dropout (issue 16): the plan's (Bc = 128, three consumer
warpgroups, 160 registers each) against other (Bc, consumers, stages), each without and with dropout 0.1, through
the API with plans.wgmma.WS_FORWARD_CONFIGS[64] replaced. bf16, B*N = 16k, H = 32; GPU ms per call (events around
20 calls, median of 9). Kernels compile first in parallel processes. GPU machine:
    python benchmarks/dev_dropout_ws_cfg.py > $OUT/dropout_ws_cfg.txt
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = [(128, 3, 4), (128, 2, 4), (64, 3, 6), (64, 2, 6)]  # (Bc, consumer warpgroups, stages)


def _use(cfg) -> None:
    from cupyflash import cuda_backend
    from cupyflash.plans import wgmma

    bc, wg, st = cfg
    wgmma.WS_FORWARD_CONFIGS[64] = wgmma.ForwardConfig(64, bc=bc, warpgroups=wg, stages=st, ws=True)
    cuda_backend._forward_cache.clear()


def _compile_one(job) -> None:
    import cupy as cp

    import cupyflash as cf

    cfg, causal, drop = job
    _use(cfg)
    q = cp.random.default_rng(0).standard_normal((1, 2, 4096, 64), dtype=cp.float32).astype("bfloat16")
    kw = {"dropout_p": 0.1, "dropout_seed": 7} if drop else {}
    cf.attention_forward(q, q, q, causal=causal, **kw)
    cp.cuda.Device().synchronize()


def main() -> None:
    import itertools
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    import cupy as cp

    import cupyflash as cf
    from dev_ws_ab import per_call_ms

    jobs = list(itertools.product(CONFIGS, (False, True), (False, True)))
    with ProcessPoolExecutor(max_workers=min(16, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(_compile_one, jobs))
    bf16 = cp.dtype("bfloat16")
    rng = cp.random.default_rng(0)
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16 D=64 forward, ms per call, "
          "(Bc, consumers, stages): plain / dropout 0.1 (ratio)", flush=True)
    for n in (2048, 8192):
        b = 16384 // n
        q, k, v = (rng.standard_normal((b, 32, n, 64), dtype=cp.float32).astype(bf16) for _ in range(3))
        for causal in (False, True):
            cells = []
            for cfg in CONFIGS:
                _use(cfg)
                t0 = per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal))
                t1 = per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal, dropout_p=0.1, dropout_seed=7))
                cells.append(f"{cfg}: {t0:.3f} / {t1:.3f} ({t0 / t1:.3f})")
            print(f"N={n} {'causal' if causal else 'full  '} | " + " | ".join(cells), flush=True)
    _use(CONFIGS[0])


if __name__ == "__main__":
    main()
