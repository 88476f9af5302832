"""Where a decode step's per-call time goes beyond its GPU time (issue 15): for two of the decode suite's shapes,
events around one call into an idle GPU for (1) attention_with_kvcache, (2) its launch step alone (the cached
signature's _launch), (3) the decode kernel's fire alone, and SDPA cuDNN; the host time of one call (perf_counter,
no synchronise); the GPU time of queued calls. GPU machine:
    python benchmarks/dev_decode_percall.py
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cupyflash.bench.decode import HK, HQ, D, gpu_ms, median_ms  # noqa: E402


def host_us(fn, runs: int = 200) -> float:
    import cupy

    times = []
    for _ in range(runs):
        cupy.cuda.Device().synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    cupy.cuda.Device().synchronize()
    return float(np.median(times)) * 1e6


def main() -> None:
    import cupy

    import cupyflash as cf
    from cupyflash import kvcache

    bf16 = cupy.dtype("bfloat16")
    rng = cupy.random.default_rng(0)
    for nq, b, nk in ((1, 8, 32768), (1, 128, 1024), (1, 1, 131072)):
        q = rng.standard_normal((b, HQ, nq, D), dtype=cupy.float32).astype(bf16)
        k, v = (rng.standard_normal((b, HK, nk, D), dtype=cupy.float32).astype(bf16) for _ in range(2))
        step = lambda: cf.attention_with_kvcache(q, k, v, cache_seqlens=nk)  # noqa: E731
        step()
        prep = next(p for key, p in kvcache._prepared.items() if p.p.batch == b and p.p.capacity == nk)
        arrays = (q, k, v, None, None, nk, None, None, None, None, None, None)
        launch = lambda: kvcache._launch(prep, *arrays)  # noqa: E731
        stream = cupy.cuda.get_current_stream().ptr
        fire = lambda: prep.decode.fire(stream)  # noqa: E731  (pointers as the last call wrote them)
        row = {"call": median_ms(step), "_launch": median_ms(launch), "fire": median_ms(fire),
               "gpu": gpu_ms(step), "host_call_us": host_us(step), "host_fire_us": host_us(fire)}  # fmt: skip
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel
            from torch.nn.functional import scaled_dot_product_attention

            from cupyflash.bench.device import to_torch

            tq, tk, tv = (to_torch(x) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                sd = lambda: scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731
                sd()
                torch.cuda.synchronize()
                row["cudnn"] = median_ms(sd)
                row["host_cudnn_us"] = host_us(lambda: (sd(), None)[1])
        except Exception as e:  # noqa: BLE001
            print("SDPA:", type(e).__name__, e)
        print(f"Nq={nq} B={b} Nk={nk}: " + "  ".join(f"{k_} {v_:.3f}" for k_, v_ in row.items()), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
