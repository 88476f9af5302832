"""GPU time of one decode call against its split count (issue 15): calls queued behind a spin kernel (the host out
of the way, as the overhead suite's GPU column), bf16, Hq 32 / Hk 8, D 128, Nq 1 (or argv[1]). GPU machine:
    python benchmarks/dev_decode_splits.py [NQ]"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cupy, numpy as np
import cupyflash
from cupyflash.bench import overhead, timing
from cupyflash.kernels import decode
from cupyflash.plans import DeviceLimits

bf16 = cupy.dtype("bfloat16")
rng = cupy.random.default_rng(0)
NQ = int(sys.argv[1]) if len(sys.argv) > 1 else 1
for b, s in ((1, 4096), (1, 16384), (1, 131072), (8, 32768), (128, 1024), (64, 4096)):
    q = rng.standard_normal((b, 32, NQ, 128), dtype=np.float32).astype(bf16)
    kc, vc = (rng.standard_normal((b, 8, s, 128), dtype=np.float32).astype(bf16) for _ in range(2))
    lens = cupy.full((b,), s, dtype=cupy.int32)
    row = []
    for splits in (0, 1, 2, 4, 8, 16, 24, 33, 48, 64, 128):
        t = overhead.Timed(lambda: cupyflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits),
                           cupy.cuda.Device().synchronize, timing.CupyClock())
        try:
            us = min(overhead.queued_us(t, 60.0, calls=50) for _ in range(3))
        except Exception as e:
            us = float("nan")
        row.append(f"{splits}:{us:.1f}")
    floor = 2 * b * 8 * s * 128 * 2 / 3.0e12 * 1e6
    print(f"Nq={NQ} B={b} S={s} (copy floor {floor:.1f} us at 3 TB/s) auto->{row[0]}  " + " ".join(row[1:]), flush=True)
    del q, kc, vc
