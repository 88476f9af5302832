import cProfile, pstats, sys, time, io
sys.path.insert(0, ".")
import cupy, numpy as np
import cupyflash as cf
from cupyflash.bench import overhead, decode as bd
bf16 = cupy.dtype("bfloat16")
rng = np.random.default_rng(0)
dr = cupy.random.default_rng(0)
for b, nk in ((64, 4096), (8, 32768)):
    q = dr.standard_normal((b, 32, 1, 128), dtype=cupy.float32).astype(bf16)
    k = dr.standard_normal((b, 8, nk, 128), dtype=cupy.float32).astype(bf16)
    v = dr.standard_normal((b, 8, nk, 128), dtype=cupy.float32).astype(bf16)
    kp, vp, table = bd._paged(k, v, 16, rng)
    lens = cupy.full((b,), nk, dtype=cupy.int32)
    f = lambda: cf.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
    f(); cupy.cuda.Device().synchronize()
    overhead._spin(200.0)
    pr = cProfile.Profile(); t0 = time.perf_counter(); pr.enable()
    for _ in range(20): f()
    pr.disable(); dt = (time.perf_counter() - t0) * 1e3
    cupy.cuda.Device().synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8)
    print(f"B={b} paged16: 20 calls queued behind a 200 ms spin took {dt:.1f} ms host"); print(s.getvalue()[:2500])
    print("gpu_ms", bd.gpu_ms(f))
    del q, k, v, kp, vp, table
    cupy.get_default_memory_pool().free_all_blocks()
