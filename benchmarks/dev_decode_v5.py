"""Decode v5 (issue 15): every decode_split_mma flag combination against SDPA cuDNN in one process, on the decode
suite's shapes; each cell the GPU time of calls queued behind a spin kernel (bench.decode.gpu_ms), measured twice
in alternating order so the spread shows. GPU machine:
    python benchmarks/dev_decode_v5.py > $OUT/decode_v5.txt
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cupyflash.bench.decode import HK, HQ, SHAPES, D, gpu_ms  # noqa: E402

KERNELS = ("mma_ring", "mma_ring_fast", "mma_bulk", "mma_bulk_fast")


def main() -> None:
    import cupy
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    import cupyflash as cf
    from cupyflash.bench import timing
    from cupyflash.bench.device import to_torch

    bf16 = cupy.dtype("bfloat16")
    rng = cupy.random.default_rng(0)
    print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; Hq={HQ} Hk={HK} D={D} bf16; GPU ms "
          "(median), two rounds; ratio = cuDNN / ours (>1: ours faster)", flush=True)
    for nq, b, nk in SHAPES:
        q = rng.standard_normal((b, HQ, nq, D), dtype=cupy.float32).astype(bf16)
        k, v = (rng.standard_normal((b, HK, nk, D), dtype=cupy.float32).astype(bf16) for _ in range(2))
        outs = {}
        for kern in KERNELS:
            outs[kern] = cf.attention_with_kvcache(q, k, v, cache_seqlens=nk, kernel=kern)[0]
        same = all(bool((outs[x] == outs[KERNELS[0]]).all()) for x in KERNELS)
        tq, tk, tv = (to_torch(x) for x in (q, k, v))
        times: dict[str, list[float]] = {x: [] for x in KERNELS + ("cudnn",)}
        for rnd in range(2):
            order = KERNELS if rnd == 0 else KERNELS[::-1]
            for kern in order:
                times[kern].append(gpu_ms(lambda kern=kern: cf.attention_with_kvcache(q, k, v, cache_seqlens=nk,
                                                                                     kernel=kern)))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                sd = lambda: scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731
                sd()
                torch.cuda.synchronize()
                times["cudnn"].append(gpu_ms(sd, torch.cuda.synchronize, timing.TorchClock()))
        cud = min(times["cudnn"])
        cells = " | ".join(f"{x} {min(t):.4f} ({max(t):.4f}) {cud / min(t):.3f}x" for x, t in times.items()
                           if x != "cudnn")
        print(f"Nq={nq} B={b} Nk={nk}: cuDNN {cud:.4f} ({max(times['cudnn']):.4f}) | {cells} | bit-equal {same}",
              flush=True)
        del q, k, v, tq, tk, tv, outs
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
