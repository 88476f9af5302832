"""The deterministic backward's grid order (issue 16): causal rows keep 0.70-0.82x of the default backward at
N >= 4k while non-causal keep 0.86-0.99x. GPU time of the default backward and of the deterministic one with
``dq_head_group`` forced to several values (heads per group of dq_grid_coord), wgmma and mma, bf16, B=1 H=16
N=16384. GPU machine:
    python benchmarks/dev_det_order.py
"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cupy, numpy as np
import cupyflash
from cupyflash import cuda_backend as cb
from cupyflash.kernels import tensorcore

bf16 = cupy.dtype("bfloat16")
rng = cupy.random.default_rng(0)
original = tensorcore.dq_head_group


def ms(f, runs=7):
    f()
    times = []
    for _ in range(runs):
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record(); f(); e.record(); e.synchronize()
        times.append(cupy.cuda.get_elapsed_time(s, e))
    return float(np.median(times))


for d in (128, 64):
    q, k, v, do = (rng.standard_normal((1, 16, 16384, d), dtype=np.float32).astype(bf16) for _ in range(4))
    for causal in (True, False):
        for kernel in ("wgmma", "mma"):
            o, lse = cupyflash.attention_forward(q, k, v, causal=causal, kernel=kernel)
            run = lambda det: cupyflash.attention_backward(do, q, k, v, o, lse, causal=causal, kernel=kernel,
                                                           deterministic=det)
            base = ms(lambda: run(False))
            cells = []
            for group in (None, 1, 2, 4, 8, 16):
                tensorcore.dq_head_group = original if group is None else (lambda *a, g=group: g)
                cb._backward_cache.clear()
                t = ms(lambda: run(True))
                cells.append(f"{'auto' if group is None else group}:{t:.3f} ({base / t:.2f}x)")
            tensorcore.dq_head_group = original
            cb._backward_cache.clear()
            print(f"D={d} causal={int(causal)} {kernel}: default {base:.3f} ms | det " + " ".join(cells), flush=True)
    del q, k, v, do
