"""Where a paged decode step loses against the contiguous cache (issue 15: page size 16 within 10%): GPU time
queued behind a spin kernel (host out of the way) and per-call event time, bf16, Hq 32 / Hk 8, D 128, Nq 1, for
the contiguous cache with an int and with an array cache_seqlens, page sizes 16 and 1 with a shuffled and with an
in-order block table, and the split counts around the automatic one. GPU machine:
    python benchmarks/dev_decode_paged.py
"""
import os, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cupy, numpy as np
import cupyflash
from cupyflash.bench import decode as bench_decode, overhead, timing
from cupyflash.kernels import decode
from cupyflash.kvcache import _prepared

bf16 = cupy.dtype("bfloat16")
rng = cupy.random.default_rng(0)
host_rng = np.random.default_rng(0)


def gpu_us(f):
    t = overhead.Timed(f, cupy.cuda.Device().synchronize, timing.CupyClock())
    return min(overhead.queued_us(t, 80.0, calls=30) for _ in range(3))


def in_order(k, v, page):
    b, hk, nk, d = k.shape
    per = nk // page
    kp = k.reshape(b, hk, per, page, d).transpose(0, 2, 1, 3, 4).reshape(b * per, hk, page, d).copy()
    vp = v.reshape(b, hk, per, page, d).transpose(0, 2, 1, 3, 4).reshape(b * per, hk, page, d).copy()
    return kp, vp, cupy.arange(b * per, dtype=cupy.int32).reshape(b, per)


for b, s in ((8, 32768), (64, 4096), (1, 131072), (128, 1024)):
    q = rng.standard_normal((b, 32, 1, 128), dtype=np.float32).astype(bf16)
    kc, vc = (rng.standard_normal((b, 8, s, 128), dtype=np.float32).astype(bf16) for _ in range(2))
    lens = cupy.full((b,), s, dtype=cupy.int32)
    cases = {"contig int": lambda: cupyflash.attention_with_kvcache(q, kc, vc, cache_seqlens=s),
             "contig array": lambda: cupyflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)}
    paged = {}
    for page in (16, 1):
        paged[f"p{page} shuffled"] = bench_decode._paged(kc, vc, page, host_rng)
        if page == 16:
            paged[f"p{page} in order"] = in_order(kc, vc, page)
    for name, (kp, vp, table) in paged.items():
        cases[name] = (lambda kp=kp, vp=vp, table=table:
                       cupyflash.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table))
    out = []
    for name, f in cases.items():
        f()
        splits = list(_prepared.values())[-1].plan.splits
        out.append(f"{name} [{splits} splits] gpu {gpu_us(f):.1f} call {bench_decode.median_ms(f) * 1e3:.1f}")
    kp, vp, table = paged["p16 shuffled"]
    for sp in (1, 2, 3, 4, 6, 8, 12, 16):
        f = lambda: cupyflash.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=sp)
        g = lambda: cupyflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=sp)
        out.append(f"splits {sp}: p16 {gpu_us(f):.1f} contig {gpu_us(g):.1f}")
    floor = 2 * b * 8 * s * 128 * 2 / 3.0e12 * 1e6
    print(f"B={b} S={s} (floor {floor:.1f} us at 3 TB/s)\n  " + "\n  ".join(out), flush=True)
    del q, kc, vc, paged, cases
    _prepared.clear()
    cupy.get_default_memory_pool().free_all_blocks()
