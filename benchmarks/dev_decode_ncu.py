"""One decode step of ours and one of SDPA cuDNN on the same bf16 cache (issue 15), for ncu to compare the two
kernels (grid, occupancy, DRAM throughput, L2 hit rate). GPU machine:
    ncu --clock-control none -k regex:"decode_split_mma|sdpa|fprop|fmha|flash" --section SpeedOfLight \\
        --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \\
        python benchmarks/dev_decode_ncu.py B NK
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(b: int, nk: int) -> None:
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    import cupyflash as cf
    from cupyflash.bench.decode import HK, HQ, D
    from cupyflash.bench.device import to_torch

    rng = cupy.random.default_rng(0)
    q = rng.standard_normal((b, HQ, 1, D), dtype=cupy.float32).astype("bfloat16")
    k, v = (rng.standard_normal((b, HK, nk, D), dtype=cupy.float32).astype("bfloat16") for _ in range(2))
    cf.attention_with_kvcache(q, k, v, cache_seqlens=nk)
    cupy.cuda.Device().synchronize()
    tq, tk, tv = (to_torch(x) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
