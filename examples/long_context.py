"""Long context: causal attention forward and backward at N = 131072 in O(N) memory.

    python examples/long_context.py            # B=1, H=8, N=131072, D=128, bfloat16
    python examples/long_context.py --n 16384  # small enough that naive attention fits too

FlashAttention never forms the N x N score matrix: it streams K and V tiles past each block of
queries, keeping a running max and sum, so memory grows with N, not N^2. Naive attention at
this length would need the full (B, H, N, N) matrix: 8 * 131072^2 * 2 bytes = 256 GiB in
bfloat16, more than any single GPU has.
"""
from __future__ import annotations

import argparse
import math
import sys

import numpy as np

import cupyflash as cf
from cupyflash import _dtypes
from cupyflash import gpu_status

if __name__ == "__main__" and (_reason := gpu_status()) is not None:
    print(f"skipped: long_context.py needs an NVIDIA GPU (no GPU: {_reason})")
    sys.exit(0)

import cupy as cp  # noqa: E402


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def time_ms(fn) -> tuple[object, float]:
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, cp.cuda.get_elapsed_time(start, end)


def check_last_rows(q, k, v, o, rows: int = 4) -> float:
    """Relative error of o's last ``rows`` query rows of head 0 against float64 attention
    computed directly: those rows see (almost) every key, so they exercise the whole length."""
    n, d = q.shape[-2], q.shape[-1]
    Q = q[0, 0, -rows:].astype(cp.float64)
    K, V = k[0, 0].astype(cp.float64), v[0, 0].astype(cp.float64)
    S = (Q @ K.T) / math.sqrt(d)  # (rows, N)
    i = cp.arange(n - rows, n)[:, None]
    S = cp.where(cp.arange(n)[None, :] > i, -cp.inf, S)  # causal: key j hidden from query i when j > i
    P = cp.exp(S - S.max(axis=1, keepdims=True))
    ref = (P / P.sum(axis=1, keepdims=True)) @ V
    got = o[0, 0, -rows:].astype(cp.float64)
    return float(cp.linalg.norm(got - ref) / cp.linalg.norm(ref))


def naive_attention(q, k, v):
    """softmax(q k^T / sqrt(D), causal) v with the whole score matrix materialised."""
    n, d = q.shape[-2], q.shape[-1]
    S = (q @ k.swapaxes(-1, -2)).astype(cp.float32)
    S *= np.float32(1 / math.sqrt(d))
    S += cp.triu(cp.full((n, n), -cp.inf, dtype=cp.float32), k=1)
    S -= S.max(axis=-1, keepdims=True)
    cp.exp(S, out=S)
    S /= S.sum(axis=-1, keepdims=True)
    return S.astype(q.dtype) @ v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=131072, help="sequence length (default 131072)")
    args = ap.parse_args()
    B, H, N, D = 1, 8, args.n, 128
    dtype = _dtypes.BFLOAT16
    pool = cp.get_default_memory_pool()
    free0, total = cp.cuda.runtime.memGetInfo()

    # Compile the kernels on a small problem first, so the timings below are the kernels alone.
    rng = cp.random.default_rng(0)
    small = [rng.standard_normal((1, 1, 256, D), dtype=cp.float32).astype(dtype) for _ in range(4)]
    o_s, lse_s = cf.attention_forward(*small[:3], causal=True)
    cf.attention_backward(small[3], *small[:3], o_s, lse_s, causal=True)
    del small, o_s, lse_s
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()

    q, k, v, do = (rng.standard_normal((B, H, N, D), dtype=cp.float32).astype(dtype) for _ in range(4))
    (o, lse), t_fwd = time_ms(lambda: cf.attention_forward(q, k, v, causal=True))
    (dq, dk, dv), t_bwd = time_ms(lambda: cf.attention_backward(do, q, k, v, o, lse, causal=True))
    held = pool.total_bytes()  # CuPy keeps freed blocks pooled: this is the high-water mark
    free1, _ = cp.cuda.runtime.memGetInfo()

    flops = 4 * B * H * N * N * D / 2  # causal: half the score matrix
    per_q = q.nbytes
    device = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"].decode()
    print(f"B={B} H={H} N={N} D={D} bfloat16 causal on {device}")
    print(f"forward  {t_fwd:9.1f} ms  {flops / t_fwd / 1e9:6.1f} TFLOP/s")
    print(f"backward {t_bwd:9.1f} ms  {2.5 * flops / t_bwd / 1e9:6.1f} TFLOP/s")
    print(f"peak device memory: {gib(held)} in CuPy's pool (driver: {gib(free0 - free1)} of {gib(total)} used), "
          f"= {held / per_q:.1f} x the size of q ({gib(per_q)}): O(N)")
    finite = all(bool(cp.isfinite(x.astype(cp.float32)).all()) for x in (o, dq, dk, dv))
    err = check_last_rows(q, k, v, o)
    print(f"last query rows vs float64: relative error {err:.2e}; outputs and gradients finite: {finite}")

    scores = B * H * N * N * 2  # the (B, H, N, N) score matrix alone, in bfloat16
    need = B * H * N * N * (2 + 4 + 2) + N * N * 4  # bf16 scores, float32 softmax, bf16 P; the mask
    print(f"naive attention needs the N x N scores: {B}*{H}*{N}^2*2 bytes = {gib(scores)} "
          f"({gib(need)} with its softmax temporaries)")
    del dq, dk, dv, lse
    pool.free_all_blocks()
    free, _ = cp.cuda.runtime.memGetInfo()
    if need > 0.9 * free:
        print(f"naive attention skipped: {gib(need)} > {gib(free)} free of {gib(total)} on this device")
    else:
        o_naive, t_naive = time_ms(lambda: naive_attention(q, k, v))
        a, b = o_naive.astype(cp.float32), o.astype(cp.float32)
        diff = float(cp.linalg.norm(a - b) / cp.linalg.norm(a))
        print(f"naive attention: {t_naive:.1f} ms ({flops / t_naive / 1e9:.1f} TFLOP/s), "
              f"peak {gib(pool.total_bytes())}; relative difference to cupyflash {diff:.2e}")
    ok = finite and err < 1.6e-2  # the bfloat16 bound cupyflash's tests use
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
