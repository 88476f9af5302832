"""Development check of the portable kernels on a GPU: accuracy against float64 and fp32 speed.

Calls ``cupyflash.kernels.portable`` directly on 4-D views (no dispatch), so it runs before
the rest of the package is wired. Usage: python benchmarks/dev_portable.py [--quick]
"""
from __future__ import annotations

import math
import sys
import time

import cupy as cp
import numpy as np

from cupyflash import _dtypes
from cupyflash.kernels import portable
from cupyflash.plans import DeviceLimits
from cupyflash.plans import portable as pp
from cupyflash.validation import AttentionProblem

BF16 = _dtypes.BFLOAT16
TOL = {"float32": (1e-5, 1e-4), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2)}


def ref_forward(q, k, v, causal, scale):
    """float64 reference on the GPU (cupy), q (B,Hq,Nq,D), k/v (B,Hk,Nk,D)."""
    q, k, v = (cp.asarray(x, dtype=cp.float64) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = cp.repeat(k, g, axis=1), cp.repeat(v, g, axis=1)
    nq, nk = q.shape[2], k.shape[2]
    s = (q @ k.transpose(0, 1, 3, 2)) * scale
    if causal:
        i = cp.arange(nq)[:, None]
        j = cp.arange(nk)[None, :]
        s = cp.where(j > i + (nk - nq), -cp.inf, s)
    m = s.max(-1, keepdims=True)
    m_safe = cp.where(cp.isfinite(m), m, 0)
    e = cp.exp(s - m_safe)
    l = e.sum(-1, keepdims=True)
    p = cp.where(l > 0, e / cp.where(l > 0, l, 1), 0)
    o = p @ v
    lse = cp.where(l[..., 0] > 0, cp.log(cp.where(l[..., 0] > 0, l[..., 0], 1)) + m_safe[..., 0], -cp.inf)
    return o, lse, p


def ref_backward(do, q, k, v, causal, scale):
    do, q, k, v = (cp.asarray(x, dtype=cp.float64) for x in (do, q, k, v))
    hk = k.shape[1]
    g = q.shape[1] // hk
    o, lse, p = ref_forward(q, k, v, causal, scale)
    kr, vr = cp.repeat(k, g, axis=1), cp.repeat(v, g, axis=1)
    dv = p.transpose(0, 1, 3, 2) @ do
    dp = do @ vr.transpose(0, 1, 3, 2)
    delta = (do * o).sum(-1, keepdims=True)
    ds = p * (dp - delta)
    dq = scale * (ds @ kr)
    dk = scale * (ds.transpose(0, 1, 3, 2) @ q)
    b = q.shape[0]
    dk = dk.reshape(b, hk, g, *dk.shape[2:]).sum(2)
    dv = dv.reshape(b, hk, g, *dv.shape[2:]).sum(2)
    return dq, dk, dv


def rel(x, ref) -> float:
    x = cp.asarray(x, dtype=cp.float64)
    if not bool(cp.isfinite(x).all()):
        return float("inf")
    den = float(cp.linalg.norm(ref))
    return float(cp.linalg.norm(x - ref)) / (den if den > 0 else 1.0)


def problem(q, k, causal, scale=None) -> AttentionProblem:
    b, hq, nq, d = q.shape
    return AttentionProblem((b,), hq, k.shape[1], nq, k.shape[2], d, np.dtype(q.dtype), causal,
                            scale if scale is not None else 1 / math.sqrt(d), "cupy")  # fmt: skip


def nan_like(x, dtype=None):
    return cp.full(x.shape, cp.nan, dtype=dtype or x.dtype)


def run_case(name, dtname, b, hq, hk, nq, nk, d, causal, scale=None, transposed=False, rng=None, logit=1.0):
    dt = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}[dtname]
    if transposed:  # (B, N, H, D) storage seen as (B, H, N, D)
        qh = rng.standard_normal((b, nq, hq, d)) * logit
        kh = rng.standard_normal((b, nk, hk, d))
        vh = rng.standard_normal((b, nk, hk, d))
        q, k, v = (cp.asarray(x.astype(dt)).transpose(0, 2, 1, 3) for x in (qh, kh, vh))
    else:
        q = cp.asarray((rng.standard_normal((b, hq, nq, d)) * logit).astype(dt))
        k = cp.asarray(rng.standard_normal((b, hk, nk, d)).astype(dt))
        v = cp.asarray(rng.standard_normal((b, hk, nk, d)).astype(dt))
    do = cp.asarray(rng.standard_normal((b, hq, nq, d)).astype(dt))
    p = problem(q, k, causal, scale)
    o = nan_like(q)
    lse = cp.full((b, hq, nq), cp.nan, dtype=cp.float32)
    portable.forward(q, k, v, o, lse, p)
    o2 = nan_like(q)
    lse2 = cp.full((b, hq, nq), cp.nan, dtype=cp.float32)
    portable.forward(q, k, v, o2, lse2, p)
    same = all(cp.asnumpy(x).tobytes() == cp.asnumpy(y).tobytes() for x, y in ((o, o2), (lse, lse2)))
    o_ref, lse_ref, _ = ref_forward(q, k, v, causal, p.scale)
    e_o = rel(o, o_ref)
    fin = cp.isfinite(lse_ref)
    lse_ok = bool((cp.isneginf(lse) == ~fin).all())
    e_lse = rel(cp.where(fin, lse, 0), cp.where(fin, lse_ref, 0))
    grads = {}
    for strategy in ("atomic", "separate"):
        dq, dk, dv = nan_like(q), nan_like(k), nan_like(v)
        portable.backward(do, q, k, v, o, lse, dq, dk, dv, p, dq_strategy=strategy)
        grads[strategy] = (dq, dk, dv)
    dq_ref, dk_ref, dv_ref = ref_backward(do, q, k, v, causal, p.scale)
    tol_o, tol_g = TOL[dtname]
    errs = {}
    for strategy, (dq, dk, dv) in grads.items():
        errs[strategy] = (rel(dq, dq_ref), rel(dk, dk_ref), rel(dv, dv_ref))
    ok = e_o < tol_o and e_lse < 1e-5 and lse_ok and same and all(e < tol_g for es in errs.values() for e in es)
    es = " ".join(f"{s}: dq {a:.1e} dk {b_:.1e} dv {c:.1e}" for s, (a, b_, c) in errs.items())
    print(f"{'OK ' if ok else 'BAD'} {name:38s} o {e_o:.1e} lse {e_lse:.1e}{'' if lse_ok else ' (-inf mismatch)'}"
          f"{'' if same else ' NONDETERMINISTIC'} | {es}", flush=True)  # fmt: skip
    return ok


def accuracy(quick: bool) -> bool:
    rng = np.random.default_rng(0)
    cases = [
        ("fp32 d64 n128", "float32", 2, 4, 4, 128, 128, 64, False),
        ("fp32 d128 n1000 causal", "float32", 1, 2, 2, 1000, 1000, 128, True),
        ("fp32 d40 odd n17x33", "float32", 2, 3, 3, 17, 33, 40, False),
        ("fp32 d1 n1", "float32", 1, 1, 1, 1, 1, 1, False),
        ("fp32 d256 n77x130 causal", "float32", 1, 2, 1, 77, 130, 256, True),
        ("fp32 d128 gqa 8/2 causal nq>nk", "float32", 2, 8, 2, 200, 150, 128, True),
        ("fp32 d64 causal nq>nk (masked rows)", "float32", 1, 2, 2, 70, 5, 64, True),
        ("fp32 d7 n100 causal", "float32", 1, 2, 2, 100, 100, 7, True),
        ("fp32 d96 mqa 4/1", "float32", 2, 4, 1, 130, 257, 96, False),
        ("fp32 d160 n65", "float32", 1, 2, 2, 65, 65, 160, True),
        ("fp16 d64 n300 causal", "float16", 2, 4, 2, 300, 300, 64, True),
        ("fp16 d40 n1000", "float16", 1, 2, 2, 1000, 1000, 40, False),
        ("fp16 d128 n513", "float16", 1, 2, 2, 513, 513, 128, False),
        ("bf16 d128 n256 causal", "bfloat16", 2, 4, 4, 256, 256, 128, True),
        ("bf16 d256 n100", "bfloat16", 1, 2, 1, 100, 100, 256, False),
        ("bf16 d80 n333 causal", "bfloat16", 1, 4, 2, 333, 333, 80, True),
    ]
    ok = True
    for name, dtn, b, hq, hk, nq, nk, d, causal in cases:
        ok &= run_case(name, dtn, b, hq, hk, nq, nk, d, causal, rng=rng)
    ok &= run_case("fp32 d64 transposed (B,N,H,D)", "float32", 2, 4, 4, 100, 100, 64, True, transposed=True, rng=rng)
    ok &= run_case("fp16 d128 transposed (B,N,H,D)", "float16", 2, 4, 2, 257, 257, 128, False, transposed=True, rng=rng)
    ok &= run_case("fp32 d64 scale=10 large logits", "float32", 1, 2, 2, 200, 200, 64, True, scale=10.0, rng=rng)
    ok &= run_case("fp32 d126 (scalar loads)", "float32", 1, 2, 2, 100, 100, 126, False, rng=rng)
    ok &= run_case("fp16 d36 (scalar loads) causal", "float16", 1, 2, 2, 100, 90, 36, True, rng=rng)
    return ok


def memcheck() -> bool:
    rng = np.random.default_rng(2)
    ok = run_case("memcheck fp32 d40 n17x33 causal", "float32", 1, 2, 1, 17, 33, 40, True, rng=rng)
    ok &= run_case("memcheck bf16 d128 n70x65", "bfloat16", 1, 2, 2, 70, 65, 128, False, rng=rng)
    ok &= run_case("memcheck fp16 d256 n33 scalar", "float16", 1, 1, 1, 33, 33, 250, True, rng=rng)
    ok &= run_case("memcheck fp32 d64 transposed", "float32", 2, 2, 2, 65, 65, 64, True, transposed=True, rng=rng)
    return ok


def bench(fn, reps=10) -> float:
    fn()
    cp.cuda.Device().synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(ts)) * 1e-3


def speed() -> None:
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        import torch.nn.functional as F
    except Exception as e:  # pragma: no cover
        torch = None
        print("torch unavailable:", e)
    limits = DeviceLimits.current()
    print("device", cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), limits)
    shapes = [(4, 16, 4096, 128, False), (4, 12, 1024, 64, True), (4, 12, 2048, 64, True), (4, 12, 4096, 64, True)]
    for b, h, n, d, causal in shapes:
        rng = np.random.default_rng(1)
        q, k, v, do = (cp.asarray(rng.standard_normal((b, h, n, d), dtype=np.float32)) for _ in range(4))
        p = problem(q, k, causal)
        o = cp.empty_like(q)
        lse = cp.empty((b, h, n), dtype=cp.float32)
        dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        t_f = bench(lambda: portable.forward(q, k, v, o, lse, p))
        t_a = bench(lambda: portable.backward(do, q, k, v, o, lse, dq, dk, dv, p, dq_strategy="atomic"))
        t_s = bench(lambda: portable.backward(do, q, k, v, o, lse, dq, dk, dv, p, dq_strategy="separate"))
        plan_f = pp.forward_plan(pp.Shape(b, h, h, n, n, d, np.dtype(np.float32)), limits)
        line = (f"B={b} H={h} N={n} D={d} causal={causal}: fwd {flops / t_f / 1e12:.1f} TF/s ({t_f * 1e3:.2f} ms) "
                f"bwd atomic {2.5 * flops / t_a / 1e12:.1f} ({t_a * 1e3:.2f} ms) "
                f"separate {2.5 * flops / t_s / 1e12:.1f} ({t_s * 1e3:.2f} ms) [{plan_f.launch.name}]")  # fmt: skip
        if torch is not None:
            tq, tk, tv, tdo = (torch.as_tensor(x, device="cuda") for x in (q, k, v, do))
            tq.requires_grad_(True)
            tk.requires_grad_(True)
            tv.requires_grad_(True)
            torch.backends.cuda.matmul.allow_tf32 = False
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

            def ttime(fn, reps=10):
                fn()
                torch.cuda.synchronize()
                ts = []
                for _ in range(reps):
                    ev0.record()
                    fn()
                    ev1.record()
                    ev1.synchronize()
                    ts.append(ev0.elapsed_time(ev1))
                return float(np.median(ts)) * 1e-3

            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                tf = ttime(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal))
                out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                tb = ttime(lambda: torch.autograd.grad(out, (tq, tk, tv), tdo, retain_graph=True))
            line += f" | SDPA eff fwd {flops / tf / 1e12:.1f} bwd {2.5 * flops / tb / 1e12:.1f}"
            line += f" | ratio fwd {tf / t_f:.2f} bwd {tb / min(t_a, t_s):.2f}"
        print(line, flush=True)


SWEEP = {
    # (table, D_pad, candidate tiles (first = current default), shape (b, h, n, d, causal))
    "fwd128": (pp.FORWARD_TILES, 128,
               [pp.Tile(64, 64, 8), pp.Tile(64, 64, 4, min_blocks=2), pp.Tile(128, 64, 8)],
               (4, 16, 4096, 128, False)),
    "fwd64": (pp.FORWARD_TILES, 64,
              [pp.Tile(64, 64, 8, min_blocks=3, kv_bufs=2), pp.Tile(64, 64, 8, min_blocks=3), pp.Tile(64, 64, 8),
               pp.Tile(64, 64, 4, min_blocks=2)],
              (4, 12, 4096, 64, True)),
    "kv128": (pp.KV_TILES, 128, [pp.Tile(64, 64, 4), pp.Tile(64, 32, 4)], (4, 16, 4096, 128, False)),
    "kv64": (pp.KV_TILES, 64, [pp.Tile(64, 64, 8), pp.Tile(64, 32, 8)], (4, 12, 4096, 64, True)),
}


def small_forward_errors(d: int) -> str:
    """Forward rel. error vs float64 on a small odd causal GQA shape, for each dtype."""
    rng = np.random.default_rng(5)
    out = []
    for dtn, dt in (("f32", np.float32), ("f16", np.float16), ("bf16", BF16)):
        q = cp.asarray(rng.standard_normal((2, 4, 150, d)).astype(dt))
        k = cp.asarray(rng.standard_normal((2, 2, 170, d)).astype(dt))
        v = cp.asarray(rng.standard_normal((2, 2, 170, d)).astype(dt))
        p = problem(q, k, True)
        o, lse = nan_like(q), cp.full((2, 4, 150), cp.nan, dtype=cp.float32)
        portable.forward(q, k, v, o, lse, p)
        o_ref, _, _ = ref_forward(q, k, v, True, p.scale)
        out.append(f"{dtn} {rel(o, o_ref):.1e}")
    return ",".join(out)


def sweep() -> None:
    """fp32 TFLOP/s of alternative tiles, each also checked against the default's results."""
    for key, (table, dp, tiles, (b, h, n, d, causal)) in SWEEP.items():
        rng = np.random.default_rng(3)
        q, k, v, do = (cp.asarray(rng.standard_normal((b, h, n, d), dtype=np.float32)) for _ in range(4))
        p = problem(q, k, causal)
        o, lse = cp.empty_like(q), cp.empty((b, h, n), dtype=cp.float32)
        dq, dk, dv = cp.empty_like(q), cp.empty_like(k), cp.empty_like(v)
        portable.forward(q, k, v, o, lse, p)
        o_base = o.copy()
        portable.backward(do, q, k, v, o, lse, dq, dk, dv, p)
        g_base = (dq.copy(), dk.copy(), dv.copy())
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        saved = table[dp]
        res = []
        for t in tiles:
            table[dp] = (t,)
            try:
                if key.startswith("fwd"):
                    o.fill(cp.nan)
                    tt = bench(lambda: portable.forward(q, k, v, o, lse, p))
                    tf = flops / tt / 1e12
                    chk = f"vs default {rel(o, o_base.astype(cp.float64)):.1e}; small {small_forward_errors(d)}"
                else:
                    portable.forward(q, k, v, o, lse, p)
                    dq.fill(cp.nan)
                    tt = bench(lambda: portable.backward(do, q, k, v, o, lse, dq, dk, dv, p, dq_strategy="atomic"))
                    tf = 2.5 * flops / tt / 1e12
                    errs = [rel(x, y.astype(cp.float64)) for x, y in zip((dq, dk, dv), g_base)]
                    chk = "vs default " + ",".join(f"{e:.1e}" for e in errs)
                res.append(f"{t.targs()},{t.min_blocks}: {tf:.1f} ({chk})")
            except Exception as e:  # a candidate too big for this device
                res.append(f"{t.targs()}: {type(e).__name__} {str(e)[:80]}")
            finally:
                table[dp] = saved
        print(f"sweep {key} B={b} H={h} N={n} D={d} causal={causal}:\n   " + "\n   ".join(res), flush=True)


if __name__ == "__main__":
    t0 = time.time()
    if "--memcheck" in sys.argv:
        sys.exit(0 if memcheck() else 1)
    good = accuracy("--quick" in sys.argv)
    print(f"accuracy {'PASS' if good else 'FAIL'} ({time.time() - t0:.0f} s)", flush=True)
    if "--no-speed" not in sys.argv:
        speed()
    if "--sweep" in sys.argv:
        sweep()
