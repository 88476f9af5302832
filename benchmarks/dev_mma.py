"""Development check of the tensor-core ("mma") family on a GPU: accuracy, then speed vs SDPA FLASH.

Accuracy: every case runs the family directly on NaN-poisoned outputs and compares o, lse, dq,
dk, dv with a float64 reference computed by torch on the GPU; torch SDPA on the same inputs
gives the error bound (ours <= 2x SDPA's). Speed: CUDA events, median after warm-up, TFLOP/s
(forward 4*B*H*N*N*D, halved for causal; backward 2.5x) and the ratio to SDPA FLASH.

Usage: python benchmarks/dev_mma.py [--skip-accuracy] [--skip-bench] [--variants]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import cupy as cp
import numpy as np

from cupyflash import _dtypes
from cupyflash.kernels import build
from cupyflash.kernels import mma
from cupyflash.plans import mma as plans
from cupyflash.validation import check_attention

try:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover
    torch = None

DT = {"float16": _dtypes.FLOAT16, "bfloat16": _dtypes.BFLOAT16}
TORCH_DT = {"float16": "float16", "bfloat16": "bfloat16"}


# ----------------------------------------------------------------------------- compile up front


def _compile_one(job: tuple[str, str]) -> str | None:
    try:
        build.get_function(*job)
        return None
    except Exception as e:
        return f"COMPILE FAIL {job[1]}: {str(e)[:400]}"


def precompile(jobs: list[tuple[str, str]]) -> set[str]:
    """Fill CuPy's disk cache from a process pool so the measurements never see NVRTC.
    Returns the names that failed to build."""
    import multiprocessing as mp

    t = time.perf_counter()
    failed = set()
    with ProcessPoolExecutor(max_workers=min(16, len(jobs)), mp_context=mp.get_context("spawn")) as pool:
        for job, err in zip(jobs, pool.map(_compile_one, jobs)):
            if err:
                print(err, flush=True)
                failed.add(job[1])
    print(f"precompile: {len(jobs)} instantiations in {time.perf_counter() - t:.1f}s, {len(failed)} failed", flush=True)
    return failed


# ----------------------------------------------------------------------------- reference


def t64(x: cp.ndarray) -> "torch.Tensor":
    return torch.from_dlpack(cp.ascontiguousarray(x.astype(np.float32))).double()


def reference(q, k, v, do, causal: bool, scale: float):
    """float64 o, lse, dq, dk, dv (torch tensors); rows with no key: o = 0, lse = -inf, zero grads."""
    q, k, v, do = (t64(x) for x in (q, k, v, do))
    group = q.shape[-3] // k.shape[-3]
    kk = k.repeat_interleave(group, dim=-3)
    vv = v.repeat_interleave(group, dim=-3)
    nq, nk = q.shape[-2], k.shape[-2]
    s = (q @ kk.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(nq, device=s.device)[:, None]
        j = torch.arange(nk, device=s.device)[None, :]
        s = s.masked_fill(j > i + (nk - nq), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = p @ vv
    dv = p.transpose(-1, -2) @ do
    dp = do @ vv.transpose(-1, -2)
    delta = (do * o).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = scale * ds @ kk
    dk = scale * ds.transpose(-1, -2) @ q

    def fold(x):  # sum the group's query heads back onto their kv head
        sh = x.shape
        return x.reshape(*sh[:-3], sh[-3] // group, group, *sh[-2:]).sum(-3)

    return o, lse, dq, fold(dk), fold(dv)


def to_torch(x: cp.ndarray) -> "torch.Tensor":
    """A torch copy in the same 16-bit dtype (through float32, exact, so DLPack never sees bfloat16)."""
    dt = torch.float16 if x.dtype == _dtypes.FLOAT16 else torch.bfloat16
    return torch.from_dlpack(cp.ascontiguousarray(x.astype(np.float32))).to(dt)


def sdpa_errors(q, k, v, do, causal, scale, ref):
    """SDPA (default backend choice) forward/backward rel. errors on the same inputs."""
    tq, tk, tv, tdo = (to_torch(x) for x in (q, k, v, do))
    tq.requires_grad_(True)
    tk.requires_grad_(True)
    tv.requires_grad_(True)
    nq, nk = q.shape[-2], k.shape[-2]
    kw = dict(scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])
    if causal and nq != nk:
        i = torch.arange(nq, device=tq.device)[:, None]
        j = torch.arange(nk, device=tq.device)[None, :]
        o = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=(j <= i + (nk - nq)), **kw)
    else:
        o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, **kw)
    o.backward(tdo)
    outs = [o.detach().nan_to_num(0.0), tq.grad.nan_to_num(0.0), tk.grad.nan_to_num(0.0), tv.grad.nan_to_num(0.0)]
    refs = [ref[0], ref[2], ref[3], ref[4]]
    return [rel(x.double(), r) for x, r in zip(outs, refs)]


def rel(x: "torch.Tensor", ref: "torch.Tensor") -> float:
    if not torch.isfinite(x).all():
        return float("inf")
    den = torch.linalg.vector_norm(ref).item()
    num = torch.linalg.vector_norm(x - ref).item()
    return num / den if den > 0 else num


# ----------------------------------------------------------------------------- accuracy


def run_case(dtype: str, b, hq, hk, nq, nk, d, causal, scale=None, transposed=False, seed=0, fcfg=None, bcfg=None,
             label="") -> bool:
    rng = np.random.default_rng(seed)
    dt = DT[dtype]

    def make(h, n):
        if transposed:  # (B, N, H, D) memory seen as (B, H, N, D)
            return cp.asarray(rng.standard_normal((b, n, h, d)).astype(dt)).transpose(0, 2, 1, 3)
        return cp.asarray(rng.standard_normal((b, h, n, d)).astype(dt))

    q, k, v, do = make(hq, nq), make(hk, nk), make(hk, nk), make(hq, nq)
    p = check_attention(q, k, v, causal=causal, scale=scale)
    o = cp.full(q.shape, np.nan, dtype=dt)
    lse = cp.full(q.shape[:-1], np.nan, dtype=np.float32)
    mma.forward(q, k, v, o, lse, p, fcfg)
    o2 = cp.full(q.shape, np.nan, dtype=dt)
    lse2 = cp.full(q.shape[:-1], np.nan, dtype=np.float32)
    mma.forward(q, k, v, o2, lse2, p, fcfg)
    same = bool(cp.all(o.view(np.uint16) == o2.view(np.uint16))) and bool(
        cp.all((lse == lse2) | (cp.isinf(lse) & cp.isinf(lse2)))
    )
    dq, dk, dv = (cp.full(x.shape, np.nan, dtype=dt) for x in (q, k, k))
    mma.backward(do, q, k, v, o, lse, dq, dk, dv, p, bcfg)
    cp.cuda.Device().synchronize()

    ref = reference(q, k, v, do, causal, p.scale)
    ours = [t64(o), None, t64(dq), t64(dk), t64(dv)]
    errs = [rel(ours[0], ref[0]), 0.0, rel(ours[2], ref[2]), rel(ours[3], ref[3]), rel(ours[4], ref[4])]
    # lse: -inf exactly where the reference has it, small absolute error elsewhere.
    tl = torch.from_dlpack(lse).double()
    fin = torch.isfinite(ref[1])
    lse_ok = bool((torch.isinf(tl) == ~fin).all()) and bool(torch.isfinite(tl[fin]).all())
    lse_err = (tl[fin] - ref[1][fin]).abs().max().item() if fin.any() else 0.0
    errs[1] = lse_err
    terr = sdpa_errors(q, k, v, do, causal, p.scale, ref)
    names = ["o", "dq", "dk", "dv"]
    ours4 = [errs[0], errs[2], errs[3], errs[4]]
    ok = same and lse_ok and lse_err < 2e-3
    parts = []
    for nm, e, te in zip(names, ours4, terr):
        good = e <= 2 * te + 1e-6
        ok &= good
        parts.append(f"{nm} {e:.2e}/{te:.2e}{'' if good else '!'}")
    tag = "ok  " if ok else "FAIL"
    print(
        f"{tag} {label}{dtype:8s} b={b} hq={hq} hk={hk} nq={nq} nk={nk} d={d} causal={int(causal)} scale={p.scale:.3g}"
        f"{' T' if transposed else ''} | ours/sdpa: {' '.join(parts)} | lse {lse_err:.1e} det={int(same)}",
        flush=True,
    )
    return ok


CASES = [
    # (b, hq, hk, nq, nk, d, causal, scale, transposed)
    (2, 4, 4, 1000, 1000, 64, False, None, False),
    (2, 4, 4, 1000, 1000, 64, True, None, False),
    (1, 8, 2, 17, 1000, 128, True, None, False),
    (1, 8, 2, 1000, 17, 96, True, None, False),
    (2, 4, 4, 1, 1, 40, False, None, False),
    (1, 4, 4, 1, 300, 40, True, None, False),
    (1, 4, 1, 300, 333, 256, True, None, False),
    (1, 4, 2, 257, 255, 256, False, None, False),
    (2, 8, 8, 1024, 1024, 128, False, None, False),
    (2, 8, 8, 1024, 1024, 128, True, None, True),
    (1, 6, 3, 517, 517, 96, False, None, True),
    (1, 4, 4, 256, 256, 64, False, 10.0, False),
    (1, 4, 4, 333, 200, 32, True, None, False),
    (1, 4, 2, 200, 333, 192, True, None, False),
    (1, 2, 2, 300, 300, 160, False, None, False),
]


def variant_accuracy(failed: set[str]) -> set[str]:
    """Names of variants that gave a wrong answer (or did not build)."""
    bad = set(failed)
    for cfg in VARIANTS_FWD + VARIANTS_BWD:
        fw = isinstance(cfg, plans.ForwardConfig)
        name = cfg.name("__nv_bfloat16")
        if name in bad:
            continue
        for dtype in ("float16", "bfloat16"):
            for i, (b, hq, hk, nq, nk, causal) in enumerate(VARIANT_CASES):
                try:
                    ok = run_case(dtype, b, hq, hk, nq, nk, cfg.d, causal, seed=100 + i, fcfg=cfg if fw else None,
                                  bcfg=None if fw else cfg, label=f"[{name}] ")  # fmt: skip
                except Exception as e:
                    print(f"FAIL [{name}] {type(e).__name__}: {e}", flush=True)
                    ok = False
                if not ok:
                    bad.add(name)
    print("VARIANTS BAD:", sorted(bad), flush=True)
    return bad


def accuracy() -> bool:
    ok = True
    for dtype in ("float16", "bfloat16"):
        for i, (b, hq, hk, nq, nk, d, causal, scale, tr) in enumerate(CASES):
            try:
                ok &= run_case(dtype, b, hq, hk, nq, nk, d, causal, scale, tr, seed=i)
            except Exception as e:  # keep going: one report for everything
                ok = False
                print(f"FAIL {dtype} case {i}: {type(e).__name__}: {e}", flush=True)
    print("ACCURACY", "PASS" if ok else "FAIL", flush=True)
    return ok


# ----------------------------------------------------------------------------- speed


def median_ms(fn, warmup=3, iters=15) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, z = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        z.record()
        z.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, z))
    return statistics.median(times)


def torch_median_ms(fn, warmup=3, iters=15) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z))
    return statistics.median(times)


# The goal grid (B*N = 16384, H*D = 2048), N >= 1024.
SHAPES = [(16, 16, 1024, 128), (4, 16, 4096, 128), (2, 16, 8192, 128), (1, 16, 16384, 128), (16, 32, 1024, 64),
          (4, 32, 4096, 64), (1, 32, 16384, 64)]


def bench(dtype: str, fwd_cfg=None, bwd_cfg=None, shapes=SHAPES, label="") -> None:
    dt = DT[dtype]
    for b, h, n, d in shapes:
        q, k, v, do = (cp.random.standard_normal((b, h, n, d), dtype=np.float32).astype(dt) for _ in range(4))
        for causal in (False, True):
            if fwd_cfg is not None and fwd_cfg.d != plans.padded_head_dim(d):
                continue
            if bwd_cfg is not None and bwd_cfg.d != plans.padded_head_dim(d):
                continue
            p = check_attention(q, k, v, causal=causal)
            o = cp.empty_like(q)
            lse = cp.empty((b, h, n), dtype=np.float32)
            dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
            f = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
            mma.forward(q, k, v, o, lse, p)
            t_f = math.nan if bwd_cfg else median_ms(lambda: mma.forward(q, k, v, o, lse, p, fwd_cfg))
            t_b = math.nan if fwd_cfg else median_ms(lambda: mma.backward(do, q, k, v, o, lse, dq, dk, dv, p, bwd_cfg))
            line = (f"{label}{dtype:8s} B={b:2d} H={h} N={n:5d} D={d} causal={int(causal)} | ours fwd "
                    f"{f / t_f / 1e9:6.1f} bwd {2.5 * f / t_b / 1e9:6.1f} TFLOP/s")  # fmt: skip
            if torch is not None and not (fwd_cfg or bwd_cfg):
                tq, tk, tv, tdo = (to_torch(x) for x in (q, k, v, do))
                tq, tk, tv = (x.detach().requires_grad_(True) for x in (tq, tk, tv))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    tf = torch_median_ms(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
                    out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                    tb = torch_median_ms(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True))
                line += (f" | sdpa fwd {f / tf / 1e9:6.1f} bwd {2.5 * f / tb / 1e9:6.1f} | ratio fwd {tf / t_f:4.2f}"
                         f" bwd {tb / t_b:4.2f}")  # fmt: skip
                del out
            print(line, flush=True)
        del q, k, v, do


FC, BC, B2 = plans.ForwardConfig, plans.BackwardConfig, plans.Backward2DConfig
# D = 64 forward at 16 rows per warp: 3 blocks of 4 warps per SM (142 registers), or 2 blocks of 8 (128).
VARIANTS_FWD: list = [FC(64, br=64, bc=64, warps=4, min_blocks=3), FC(64, br=128, bc=64, warps=8, min_blocks=2)]
VARIANTS_BWD = [
    BC(128, br=32, key_warps=8),  # the key-major 1-D layout, default before the 2-D one
    # D = 64 in the 2-D layout with Br = 128: bf16 spills 20 B on sm_90a, fp16 does not (timed in both).
    B2(64, br=128, bc=128, q_row_warps=4, packed_p=True),
]
#: Variants also timed in fp16 (to separate the cost of a bf16-only spill from the layout's).
VARIANTS_FP16 = [B2(64, br=128, bc=128, q_row_warps=4, packed_p=True)]
# Accuracy of each variant: tails, causal diagonals, GQA with Nq != Nk.
VARIANT_CASES = [(2, 4, 4, 1000, 1000, False), (2, 4, 4, 1000, 1000, True), (1, 8, 2, 300, 517, True)]
VARIANT_SHAPES = [(16, 16, 1024, 128), (2, 16, 8192, 128), (16, 32, 1024, 64), (4, 32, 4096, 64)]


def bwd_label(c) -> str:
    if isinstance(c, plans.Backward2DConfig):
        return (f"bwd2d br{c.br}bc{c.bc}w{c.warps}s{c.s_key_warps}v{c.v_key_warps}q{c.q_row_warps}m{c.min_blocks}"
                f"p{int(c.packed_p)}st{c.stages}")
    return f"bwd br{c.br}kw{c.key_warps}s{c.stages}m{c.min_blocks}c{c.dp_chunks}"


def ncu_target(d: int = 128) -> int:
    """One forward and one backward launch for ncu (B=2, N=4096, H*D = 2048, bf16, non-causal)."""
    rng = np.random.default_rng(0)
    h = 2048 // d
    q, k, v, do = (cp.asarray(rng.standard_normal((2, h, 4096, d)).astype(DT["bfloat16"])) for _ in range(4))
    p = check_attention(q, k, v)
    o, lse = cp.empty_like(q), cp.empty((2, h, 4096), dtype=np.float32)
    mma.forward(q, k, v, o, lse, p)
    dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
    mma.backward(do, q, k, v, o, lse, dq, dk, dv, p)
    cp.cuda.Device().synchronize()
    return 0


def smoke() -> int:
    rng = np.random.default_rng(1)
    for dtype in ("float16", "bfloat16"):
        for d in (64, 128):
            q = cp.asarray(rng.standard_normal((1, 4, 77, d)).astype(DT[dtype]))
            k, v = (cp.asarray(rng.standard_normal((1, 2, 93, d)).astype(DT[dtype])) for _ in range(2))
            p = check_attention(q, k, v, causal=True)
            o, lse = cp.empty_like(q), cp.empty((1, 4, 77), dtype=np.float32)
            mma.forward(q, k, v, o, lse, p)
            dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
            mma.backward(q, q, k, v, o, lse, dq, dk, dv, p)
            cp.cuda.Device().synchronize()
            print("smoke", dtype, d, bool(cp.isfinite(o).all()), bool(cp.isfinite(dq).all()), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="one small fwd+bwd per head dim, no torch (for compute-sanitizer)")
    ap.add_argument("--ncu", type=int, nargs="?", const=128, default=None, metavar="D",
                    help="one fwd + one bwd launch at head dim D (default 128), for ncu")
    args = ap.parse_args()
    if args.smoke:
        return smoke()
    if args.ncu is not None:
        return ncu_target(args.ncu)
    dev = cp.cuda.Device()
    print("device:", cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode(), "torch", torch and torch.__version__)
    jobs = plans.instantiations()
    if args.variants:
        for c in VARIANTS_FWD:
            for ct in ("__half", "__nv_bfloat16"):
                jobs.append((plans.FORWARD_SOURCE, c.name(ct)))
        for c in VARIANTS_BWD:
            for ct in ("__half", "__nv_bfloat16"):
                jobs.append((plans.BACKWARD_SOURCE, c.name(ct)))
    failed = precompile(jobs)
    ok = not any(n in failed for _, n in plans.instantiations())
    if not args.skip_accuracy:
        ok &= accuracy()
    bad = variant_accuracy(failed) if args.variants else set()
    if not args.skip_bench:
        bench("bfloat16")
        if args.variants:
            for c in VARIANTS_FWD:
                if c.name("__nv_bfloat16") not in bad:
                    bench("bfloat16", fwd_cfg=c, shapes=VARIANT_SHAPES,
                          label=f"[fwd {c.br}x{c.bc}w{c.warps}s{c.stages}m{c.min_blocks}] ")  # fmt: skip
            for c in VARIANTS_BWD:
                if c.name("__nv_bfloat16") not in bad:
                    bench("bfloat16", bwd_cfg=c, shapes=VARIANT_SHAPES, label=f"[{bwd_label(c)}] ")
        bench("float16", shapes=[SHAPES[0], SHAPES[2], SHAPES[4], SHAPES[5]])
        if args.variants:
            for c in VARIANTS_FP16:
                if c.name("__nv_bfloat16") not in bad:
                    bench("float16", bwd_cfg=c, shapes=VARIANT_SHAPES, label=f"[{bwd_label(c)}] ")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
