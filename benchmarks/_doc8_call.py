import sys
import cupy, numpy as np, cupyflash as cf
D = int(sys.argv[1]) if len(sys.argv) > 1 else 64
N, H = 16384, 2048 // D
rng = cupy.random.default_rng(0)
bf16 = cupy.dtype("bfloat16")
q, k, v = (rng.standard_normal((1, H, N, D), dtype=cupy.float32).astype(bf16) for _ in range(3))
host = np.random.default_rng(0)
cuts = np.sort(host.choice(np.arange(1, N), 7, replace=False))
doc = cupy.asarray(np.searchsorted(cuts, np.arange(N), side="right").astype(np.int32)[None])
mm = "doc(b, q_idx) == doc(b, kv_idx)"
bm = cf.create_block_mask(mm, 1, None, N, N, aux={"doc": doc})
for _ in range(2):
    cf.attention_forward(q, k, v, True, mask_mod=mm, aux={"doc": doc}, block_mask=bm)
    cf.attention_forward(q, k, v, True)
cupy.cuda.Device().synchronize()
