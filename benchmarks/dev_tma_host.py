"""Host cost of the backward's TMA maps (kernels/tensor_map.py), on the GPU machine (libcuda and a context needed):
- the driver's cuTensorMapEncodeTiled and cuTensorMapReplaceAddress through ctypes, us a call (a launch's first call
  encodes its two maps, every later one replaces their two addresses);
- a small cached backward (B = 1, H = 1, N = 256, D = 128: two key tiles, so the loader runs, and short kernels) through
  the API, wall us a call, TMA on and off alternately (its GPU time is the same few kernels either way).
    python benchmarks/dev_tma_host.py [--calls 2000] [--rounds 7]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def us_per_call(fn, calls: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return min(times)


def main() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.kernels import tensor_map
    from cupyflash.plans import wgmma as plans

    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    x = cp.zeros((1, 8, 4096, 128), dtype=cp.dtype("bfloat16"))
    spec = tensor_map.view_spec("q", "__nv_bfloat16", 2, 1, 8, 4096, 128, (8 * 4096 * 128, 4096 * 128, 128), 64)
    raw = ctypes.create_string_buffer(256)
    at = ctypes.addressof(raw) + (-ctypes.addressof(raw) % 128)
    writer = tensor_map.MapWriter(at - tensor_map.MAP_OFFSETS["q"], [spec])
    ptr = x.data.ptr
    encode = us_per_call(lambda: (setattr(writer, "_encoded", False), writer([ptr])), a.calls, a.rounds)
    writer([ptr])
    replace = us_per_call(lambda: writer([ptr]), a.calls, a.rounds)
    print(f"MapWriter, one map: encode {encode:.2f} us, replace address {replace:.2f} us (a call writes two)")

    bf16 = cp.dtype("bfloat16")
    rng = cp.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, 1, 256, 128), dtype=cp.float32).astype(bf16) for _ in range(4))
    o, lse = cf.attention_forward(q, k, v)
    out = {}
    for r in range(a.rounds):
        for tma in (True, False):
            plans.TMA = tma
            cuda_backend._backward_cache.clear()
            cf.attention_backward(do, q, k, v, o, lse)  # plans the signature
            cp.cuda.Device().synchronize()
            t = us_per_call(lambda: cf.attention_backward(do, q, k, v, o, lse), a.calls // 4, 1)
            cp.cuda.Device().synchronize()
            out.setdefault(tma, []).append(t)
    plans.TMA = True
    print(f"cached backward N=256 D=128, wall us a call (least of {a.rounds}): TMA {min(out[True]):.2f}, "
          f"cp.async {min(out[False]):.2f}; medians {statistics.median(out[True]):.2f} / "
          f"{statistics.median(out[False]):.2f}")


if __name__ == "__main__":
    main()
