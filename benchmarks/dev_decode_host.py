"""Where a decode call's host time goes (issue 15): attention_with_kvcache at B=1, Hq=32, Hk=8, cache 4096, D=128
(the overhead suite's decode row), per call and by cProfile. GPU machine: python benchmarks/dev_decode_host.py"""
import cProfile, io, os, pstats, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cupy, numpy as np
import cupyflash

def per_call(f, n=3000):
    for _ in range(50): f()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(n): f()
    host = time.perf_counter() - t
    cupy.cuda.Device().synchronize()
    return host / n * 1e6

rng = cupy.random.default_rng(0)
bf16 = cupy.dtype('bfloat16')
q = rng.standard_normal((1, 32, 1, 128), dtype=np.float32).astype(bf16)
kc, vc = (rng.standard_normal((1, 8, 4096, 128), dtype=np.float32).astype(bf16) for _ in range(2))
lens = cupy.full((1,), 4096, dtype=cupy.int32)
call = lambda: cupyflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
print(f"attention_with_kvcache host {per_call(call):.2f} us/call (queueing only)")
print(f"cupy.empty x2        {per_call(lambda: (cupy.empty((1, 32, 1, 128), bf16), cupy.empty((1, 32, 1), np.float32))):.2f} us")
pr = cProfile.Profile(); pr.enable()
for _ in range(2000): call()
pr.disable(); s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats('tottime').print_stats(25); print(s.getvalue()[-6000:])
