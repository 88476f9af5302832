import cupy, numpy as np, cupyflash as cf
rng = np.random.default_rng(0)
for fam, dt, d in (("portable", "float32", 32), ("mma", "bfloat16", 64), ("wgmma", "bfloat16", 64), ("wgmma", "float16", 128)):
    for nq, nk, bs, causal in ((200, 300, 48, False), (300, 300, 64, True), (77, 333, 16, False)):
        doc = cupy.asarray(np.sort(rng.integers(0, 4, (1, max(nq, nk)))).astype(np.int32))
        q, k, v, do = (cupy.asarray(rng.standard_normal((1, 4, n, d)).astype(dt)) for n in (nq, nk, nk, nq))
        mm = "doc(b, q_idx + Nk - Nq) == doc(b, kv_idx)"
        bm = cf.create_block_mask(mm, 1, None, nq, nk, aux={"doc": doc}, block_size=bs)
        o, vjp = cf.attention_vjp(q, k, v, causal, kernel=fam, mask_mod=mm, aux={"doc": doc}, block_mask=bm)
        g = vjp(do)
        cupy.cuda.Device().synchronize()
        print(fam, dt, d, nq, nk, bs, causal, "finite" if all(bool(cupy.isfinite(x.astype(cupy.float32)).all()) for x in (o, *g[:3])) else "NONFINITE", flush=True)
