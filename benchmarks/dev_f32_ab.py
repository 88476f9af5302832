"""float32 on the mma family, for A/B runs of trees in alternating processes (s18: how the 3xTF32 operands reach
the tensor cores). Forward and backward through the public API at issue 12's tiny shape and at larger grids; GPU
microseconds per call with the host out of the way (calls queued behind a spin kernel, median of 5), and the relative
error against a float64 computation of the same call (so a tree that is fast but wrong shows it).
GPU machine:
    for r in 1 2; do for t in old new; do PYTHONPATH=$PWD/<tree of $t> python benchmarks/dev_f32_ab.py $t; done
    done > $OUT/f32_ab.txt
``--quick``: issue 12's two rows and three larger grids only.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import cupyflash as cf  # the tree on PYTHONPATH, imported before this checkout goes first

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (B, H, N, D, causal[, scale]): issue 12's float32 row first (<= 25 us forward, <= 45 us backward); last, the large
# logits of tests/test_mma_float32_bwd_gpu.py::test_large_logits (scale 10), where the splits' errors show most.
SHAPES = [(4, 12, 256, 64, False), (4, 12, 256, 64, True), (2, 16, 1024, 64, False), (2, 8, 4096, 64, False),
          (2, 8, 4096, 64, True), (4, 12, 256, 128, False), (2, 8, 2048, 128, False), (1, 2, 300, 64, False, 10.0)]


def queued_us(fn, calls: int = 50, rounds: int = 5) -> float:
    import cupy as cp

    from cupyflash.bench.overhead import _spin

    fn()
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        fn()
    cp.cuda.Device().synchronize()
    host_ms = (time.perf_counter() - t0) * 1e3 / 10
    out = []
    for _ in range(rounds):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        _spin(3 * calls * host_ms + 1.0)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        out.append(cp.cuda.get_elapsed_time(a, b) / calls * 1e3)
    return statistics.median(out)


def exact(q, k, v, do, causal, scale):
    """o and (dq, dk, dv) in float64 on the GPU (materialised scores)."""
    import cupy as cp

    q, k, v, do = (x.astype(cp.float64) for x in (q, k, v, do))
    n_q, n_k = q.shape[2], k.shape[2]
    s = q @ k.swapaxes(-1, -2) * scale
    if causal:
        s = cp.where(cp.arange(n_k)[None, :] > cp.arange(n_q)[:, None] + (n_k - n_q), -cp.inf, s)
    p = cp.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True)) * scale
    return o, (ds @ k, ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ do)


def rel(x, ref) -> float:
    import cupy as cp

    return float(cp.abs(x.astype(cp.float64) - ref).max() / cp.abs(ref).max())


def main() -> None:
    import cupy as cp

    tag = sys.argv[1]
    shapes = SHAPES if "--quick" not in sys.argv else [SHAPES[i] for i in (0, 1, 2, 5, 6)]
    print(f"# {tag}: {cf.__file__}", flush=True)
    for b, h, n, d, causal, *rest in shapes:
        scale = rest[0] if rest else d ** -0.5
        rng = cp.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32) for _ in range(4))
        o, lse = cf.attention_forward(q, k, v, causal=causal, scale=scale, kernel="mma")
        grads = cf.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, kernel="mma")
        o_ref, g_ref = exact(q, k, v, do, causal, scale)
        err = f"o {rel(o, o_ref):.1e} " + " ".join(f"{nm} {rel(g, r):.1e}" for nm, g, r in zip("qkv", grads, g_ref))
        fwd = queued_us(lambda: cf.attention_forward(q, k, v, causal=causal, scale=scale, kernel="mma"))
        bwd = queued_us(lambda: cf.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, kernel="mma"))
        mask = ("causal" if causal else "full  ") + (f" scale {scale:g}" if rest else "")
        print(f"{tag} B={b} H={h} N={n} D={d} {mask} fwd {fwd:8.1f} us  bwd {bwd:8.1f} us"
              f" | rel err {err}", flush=True)
        q = k = v = do = o = lse = grads = o_ref = g_ref = None
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
