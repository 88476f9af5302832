"""Decode GPU time, ours against SDPA cuDNN in the same process (issue 15), for A/B runs of the decode kernel:
the decode suite's shapes, each cell the GPU time of calls queued behind a spin kernel (bench.decode.gpu_ms) and
ours per call too. GPU machine:
    python benchmarks/dev_decode_gpu.py [LABEL]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cupyflash.bench.decode import HK, HQ, SHAPES, D, gpu_ms, median_ms  # noqa: E402


def main(label: str) -> None:
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    import cupyflash as cf
    from cupyflash.bench import timing
    from cupyflash.bench.device import to_torch

    bf16 = cupy.dtype("bfloat16")
    rng = cupy.random.default_rng(0)
    for nq, b, nk in SHAPES:
        q = rng.standard_normal((b, HQ, nq, D), dtype=cupy.float32).astype(bf16)
        k, v = (rng.standard_normal((b, HK, nk, D), dtype=cupy.float32).astype(bf16) for _ in range(2))
        step = lambda: cf.attention_with_kvcache(q, k, v, cache_seqlens=nk)  # noqa: E731
        ours_call, ours_gpu = median_ms(step), gpu_ms(step)
        tq, tk, tv = (to_torch(x) for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            sd = lambda: scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731
            sd()
            torch.cuda.synchronize()
            cudnn_gpu = gpu_ms(sd, torch.cuda.synchronize, timing.TorchClock())
        print(f"[{label}] Nq={nq} B={b} Nk={nk}: ours call {ours_call:.3f} GPU {ours_gpu:.3f} | cuDNN GPU "
              f"{cudnn_gpu:.3f} | vs cuDNN GPU {cudnn_gpu / ours_gpu:.3f}x", flush=True)
        del q, k, v, tq, tk, tv
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
