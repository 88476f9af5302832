"""The warp-specialised wgmma forward on and off (plans.wgmma.WS_DEFAULT) through the public API, against SDPA cuDNN
and FLASH in the same process: bf16, B*N = 16k, H = 16, D 64/128, N 1k-16k, causal and not. Each cell: GPU time per
call from CUDA events around 20 back-to-back calls (host work overlaps the queue), median of 9 such batches, ws off
and on alternated twice (best of the two rounds). GPU machine:
    python benchmarks/dev_ws_ab.py > $OUT/ws_ab.txt
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CALLS, BATCHES = 20, 9


def per_call_ms(fn, calls: int = CALLS, batches: int = BATCHES) -> float:
    """GPU ms per call: events around ``calls`` back-to-back calls, median of ``batches``, after 3 warm-up calls."""
    import cupy as cp

    for _ in range(3):
        fn()
    times = []
    for _ in range(batches):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / calls)
    return statistics.median(times)


def main() -> None:
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.plans import wgmma

    bf16 = cp.dtype("bfloat16")
    rng = cp.random.default_rng(0)
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16 forward, ms per call (TFLOP/s); "
          "ratios: other / ws-on (>1: ws on faster)", flush=True)
    for d in (64, 128):
        for n in (1024, 2048, 4096, 8192, 16384):
            b, h = 16384 // n, 16
            q, k, v = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(bf16) for _ in range(3))
            tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
            for causal in (False, True):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                t = {"off": [], "on": []}
                for rnd in range(2):
                    for mode in (("off", "on") if rnd == 0 else ("on", "off")):
                        on = mode == "on"
                        wgmma.WS_DEFAULT.update({64: on, 128: on})
                        cuda_backend._forward_cache.clear()  # plans are cached per call signature
                        t[mode].append(per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal)))
                wgmma.WS_DEFAULT.update({64: False, 128: False})
                cuda_backend._forward_cache.clear()
                ref = {}
                for name, be in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FLASH", SDPBackend.FLASH_ATTENTION)):
                    with sdpa_kernel(be):
                        ref[name] = per_call_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
                    torch.cuda.synchronize()
                on, off = min(t["on"]), min(t["off"])
                cells = [f"ws on {on:.3f} ({flops / on / 1e9:.0f})", f"ws off {off:.3f} ({flops / off / 1e9:.0f})"]
                cells += [f"{x} {y:.3f} ({flops / y / 1e9:.0f})" for x, y in ref.items()]
                ratios = f"off/on {off / on:.3f} cuDNN/on {ref['cuDNN'] / on:.3f} FLASH/on {ref['FLASH'] / on:.3f}"
                print(f"D={d} N={n} B={b} {'causal' if causal else 'full'}: " + " | ".join(cells) + " || " + ratios,
                      flush=True)
            del q, k, v, tq, tk, tv
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
