"""GPU: the float32 backward on tensor cores (mma family, 3xTF32) against the portable (SIMT) one and PyTorch's SDPA
EFFICIENT backend (3xTF32 on sm_80+: the same accuracy class), in one process.

    python benchmarks/dev_mma_f32_bwd.py            # the table below (a few minutes with compilation)
    python benchmarks/dev_mma_f32_bwd.py --sweep    # also other float32 tile configurations (plans.mma), D = 64, 128

GPU time of a whole ``attention_backward`` call (Delta, main kernel, dQ conversion; the host's share is not in CUDA
events' span of a call on an idle stream, only the launches' gaps), median of many, CUDA events; o and lse come from
the portable forward. torch: ``torch.autograd.grad`` of an SDPA output made under ``sdpa_kernel(EFFICIENT_ATTENTION)``
(its backward kernel alone), timed with torch's CUDA events; skipped when torch is not importable. TFLOP/s count the
backward as 2.5 x the forward's 4 B H N^2 D (halved under causal). The accuracy column compares dq, dk, dv (and dbias)
of each kernel with a float64 reference computed by CuPy on the GPU for the first batch and two heads. Kernels are
compiled up front in a process pool (CuPy's disk cache). Writes the table to $OUT/mma_f32_bwd.txt when $OUT is set.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

# (name, B, H, N, D, causal, bias): llm.c's tiny shape (the 124 us -> 45 us target), N = 1024 and 4096 at
# D = 64, N = 4096 at D = 128, causal and not; the masks suite's bias with bias_grad (a (1, H, N, N) float32 bias:
# dbias summed over the batch by atomics) at N = 1024 and 4096 (issue 17: 1.5x SDPA EFFICIENT wanted).
CASES = [
    *((f"{tag}{'-causal' if c else ''}", b, h, n, d, c, False)
      for tag, b, h, n, d in (("tiny", 4, 12, 256, 64), ("n1024-d64", 2, 16, 1024, 64), ("n4096-d64", 2, 16, 4096, 64),
                              ("n4096-d128", 2, 16, 4096, 128))
      for c in (False, True)),
    ("bias-grad-n1024", 2, 16, 1024, 64, False, True),
    ("bias-grad-n4096", 2, 16, 4096, 64, False, True),
]  # fmt: skip


def _inputs(b, h, n, d, bias, seed=0):
    import cupy as cp

    rs = cp.random.RandomState(seed)
    q, k, v, do = (rs.standard_normal((b, h, n, d), dtype=cp.float32) for _ in range(4))
    kw = {"bias": rs.standard_normal((1, h, n, n), dtype=cp.float32) * 0.5, "bias_grad": True} if bias else {}
    return q, k, v, do, kw


def _forward(q, k, v, causal, kw):
    import cupyflash

    fkw = {n: x for n, x in kw.items() if n != "bias_grad"}
    return cupyflash.attention_forward(q, k, v, causal, kernel="portable", **fkw)


def _warm(job) -> str:
    """Compile a case's kernels in a worker (B = 1: the same instantiations as the full shape)."""
    name, kernel, config = job
    _, _, h, n, d, causal, bias = next(c for c in CASES if c[0] == name)
    try:
        import cupyflash

        q, k, v, do, kw = _inputs(1, h, n, d, bias)
        if kernel == "forward":
            _forward(q, k, v, causal, kw)
        elif config is None:
            o, lse = _forward(q, k, v, causal, kw)
            cupyflash.attention_backward(do, q, k, v, o, lse, causal, kernel=kernel, **kw)
        else:
            _config_backward(q, k, v, do, causal, config)
        return ""
    except Exception as e:  # reported, the rest goes on
        return f"{name} {kernel} {config}: {type(e).__name__}: {str(e)[:300]}"


def _config_backward(q, k, v, do, causal, config):
    import cupy as cp

    from cupyflash.kernels import mma
    from cupyflash.validation import check_backward

    o, lse = _forward(q, k, v, causal, {})
    p = check_backward(do, q, k, v, o, lse, causal=causal)
    dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
    run = lambda: mma.backward(do, q, k, v, o, lse, dq, dk, dv, p, config=config)  # noqa: E731
    run()
    return run, (dq, dk, dv)


def median_ms(fn, warmup=3, iters=30) -> float:
    from dev_wgmma import median_ms as shared  # the dev scripts' CUDA-event timer (imports CuPy: GPU only)

    return shared(fn, warmup=warmup, iters=iters)


def torch_backward(q, k, v, do, causal, bias):
    """A callable running SDPA EFFICIENT's backward (dq, dk, dv, and dbias of a bias requiring grad), or None."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa
    except Exception:  # noqa: BLE001 - torch is optional here
        return None
    tq, tk, tv, tdo = (torch.as_tensor(x, device="cuda").requires_grad_(x is not do) for x in (q, k, v, do))
    tb = None if bias is None else torch.as_tensor(bias, device="cuda").requires_grad_(True)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        out = sdpa(tq, tk, tv, attn_mask=tb, is_causal=causal)
    inputs = (tq, tk, tv) if tb is None else (tq, tk, tv, tb)
    return lambda: torch.autograd.grad(out, inputs, tdo, retain_graph=True)


def torch_median_ms(fn, warmup=3, iters=30) -> float:
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def reference_grads(q, k, v, do, causal, bias):
    """dq, dk, dv in float64 by CuPy for heads 0, 1 of batch 0 (with a bias: of every batch, and dbias summed)."""
    import cupy as cp

    nb = q.shape[0] if bias is not None else 1
    q, k, v, do = (x[:nb, :2].astype(cp.float64) for x in (q, k, v, do))
    n, d = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    s = q @ k.swapaxes(-1, -2) * scale
    if bias is not None:
        s = s + bias[:, :2].astype(cp.float64)
    if causal:
        s = cp.where(cp.tri(n, dtype=bool), s, -cp.inf)
    p = cp.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    dv = p.swapaxes(-1, -2) @ do
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    return [ds @ k * scale, ds.swapaxes(-1, -2) @ q * scale, dv] + ([ds.sum(0, keepdims=True)] if nb > 1 else [])


def rel(x, r) -> float:
    import cupy as cp

    x = x.astype(cp.float64)
    return float(cp.linalg.norm(x - r) / cp.linalg.norm(r))


def run_case(case, kernels=("mma", "portable", "torch")) -> list[str]:
    import cupy as cp

    import cupyflash

    name, b, h, n, d, causal, bias = case
    q, k, v, do, kw = _inputs(b, h, n, d, bias)
    o, lse = _forward(q, k, v, causal, kw)
    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
    ref = reference_grads(q, k, v, do, causal, kw.get("bias"))
    lines, times = [], {}
    for kernel in kernels:
        if kernel == "torch":
            try:
                call = torch_backward(q, k, v, do, causal, kw.get("bias"))
                if call is None:
                    continue
                ms = torch_median_ms(call, iters=20 if n >= 2048 else 50)
                grads = [cp.asarray(g.detach()) for g in call()]
            except Exception as e:  # noqa: BLE001 - reported, the table goes on
                print(f"{name:20s} torch    FAIL {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
        else:
            call = lambda: cupyflash.attention_backward(do, q, k, v, o, lse, causal, kernel=kernel, **kw)  # noqa: E731
            ms = median_ms(call, iters=20 if n >= 2048 else 50)
            grads = call()
        times[kernel] = ms
        nb = ref[0].shape[0]
        got = [g[:nb, :2] for g in grads[:3]] + [g[:, :2] for g in grads[3:]]
        errs = " ".join(f"{nm} {rel(g, r):.1e}" for nm, g, r in zip(("dq", "dk", "dv", "dbias"), got, ref))
        vs = "" if kernel == "mma" else f"  mma {ms / times['mma']:5.2f}x faster" if "mma" in times else ""
        lines.append(f"{name:20s} {kernel:8s} B={b} H={h} N={n} D={d} {'causal' if causal else 'full  '} "
                     f"{ms * 1e3:9.1f} us {flops / ms / 1e9:7.1f} TFLOP/s   rel err {errs}{vs}")
        print(lines[-1], flush=True)
        del grads, call
        cp.get_default_memory_pool().free_all_blocks()
    return lines


def sweep_configs():
    """Alternative float32 backward tiles (not in the tables) worth timing against them."""
    from cupyflash.plans.mma import BACKWARD_CONFIGS_F32, BackwardConfig

    f = lambda d, br, kw, **x: BackwardConfig(d, br=br, key_warps=kw, elem=4, **x)  # noqa: E731
    alts = {64: [f(64, 64, 4), f(64, 32, 8), f(64, 64, 8, dp_chunks=2)],
            128: [f(128, 16, 8), f(128, 32, 8, dp_chunks=2), f(128, 16, 4), f(128, 32, 4)]}  # fmt: skip
    return {d: [BACKWARD_CONFIGS_F32[d]] + [c for c in cs if c != BACKWARD_CONFIGS_F32[d]] for d, cs in alts.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time other float32 tiles at N = 4096")
    ap.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    args = ap.parse_args()
    cases = [c for c in CASES if args.cases is None or c[0] in args.cases]
    sweep = sweep_configs() if args.sweep else {}

    t0 = time.perf_counter()
    jobs = [(c[0], kern, None) for c in cases for kern in ("mma", "portable")]
    for d, cfgs in sweep.items():
        for causal in (False, True):
            name = f"n4096-d{d}{'-causal' if causal else ''}"
            jobs += [(name, "mma", cfg) for cfg in cfgs]
    with ProcessPoolExecutor(max_workers=min(16, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        for err in pool.map(_warm, jobs):
            if err:
                print("COMPILE/RUN FAIL", err, flush=True)
    print(f"compiled in {time.perf_counter() - t0:.0f} s", flush=True)

    import cupy as cp

    dev = cp.cuda.Device()
    lines = [f"# {cp.cuda.runtime.getDeviceProperties(dev.id)['name'].decode()}, float32 backward (attention_backward "
             f"call), mma (3xTF32) vs portable vs torch SDPA EFFICIENT"]  # fmt: skip
    print(lines[0], flush=True)
    for case in cases:
        lines += run_case(case)
    for d, cfgs in sweep.items():
        for causal in (False, True):
            q, k, v, do, _ = _inputs(2, 16, 4096, d, False)
            flops = 2.5 * 4 * 2 * 16 * 4096 * 4096 * d / (2 if causal else 1)
            for cfg in cfgs:
                run, _ = _config_backward(q, k, v, do, causal, cfg)
                ms = median_ms(run, iters=20)
                lines.append(f"sweep D={d} {'causal' if causal else 'full  '} br={cfg.br} key_warps={cfg.key_warps} "
                             f"dp_chunks={cfg.dp_chunks} smem={cfg.shared_bytes // 1024} KB: {ms * 1e3:8.1f} us "
                             f"{flops / ms / 1e9:6.1f} TFLOP/s")  # fmt: skip
                print(lines[-1], flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mma_f32_bwd.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
