"""GPU: the portable forward with its K/V tile loads pipelined (two cp.async buffers, ``Tile.kv_bufs = 2``) against
the one-buffer kernel it replaces, in one process, float32: issue 12's tiny shape (B=4, H=12, N=256, D=64), the
same at B=1, and B=4, H=16, N=2048 at D=64 and 128 (nothing may get slower). Also the backward's time as planned.

    python benchmarks/dev_portable_prefetch.py   # about a minute on an H100; also to $OUT/portable_prefetch.txt

Each forward variant is forced through ``plans.portable.FORWARD_TILES`` (the public API's plan cache is cleared in
between) and checked first against the float64 reference (``cupyflash.reference``) with NaN-poisoned outputs:
o within 1e-5 and lse within 1e-5 (relative), gradients within 1e-4; large shapes on a slice of (batch, head) pairs
(b in {0, 3}, h in {0, 15}). Times: CUDA events around batches of back-to-back public-API calls, median of the
batches, after warm-up (GPU time per call; the host time per call is printed beside it: if it is the larger, the
events measured the host). A few odd shapes (D = 62: the 4-byte cp.async path; N = 17; causal; GQA) are checked
for accuracy only.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import cupyflash as cf  # noqa: E402
from cupyflash import cuda_backend, reference  # noqa: E402
from cupyflash.kernels import portable  # noqa: E402
from cupyflash.plans import DeviceLimits  # noqa: E402
from cupyflash.plans import portable as pp  # noqa: E402
from cupyflash.validation import check_attention  # noqa: E402

TOL_O, TOL_GRAD = 1e-5, 1e-4
# (label, B, H, N, D): timed, forward and backward
SHAPES = [("tiny", 4, 12, 256, 64), ("tiny B=1", 1, 12, 256, 64), ("large", 4, 16, 2048, 64),
          ("large", 4, 16, 2048, 128)]  # fmt: skip
# Forward tiles per D_pad: (label, tiles); the first is the plan's.
FWD_VARIANTS = {
    64: [("2 bufs (plan)", None), ("1 buf (before)", (pp.Tile(64, 64, 8, min_blocks=3),))],
    128: [("64x32, 2 bufs (plan)", None), ("64x64, 1 buf (before)", (pp.Tile(64, 64, 8),)),
          ("64x64, 2 bufs, 1 block/SM", (pp.Tile(64, 64, 8, kv_bufs=2),))],
}
# Accuracy only: (B, Hq, Hk, Nq, Nk, D, causal)
ODD = [(2, 3, 3, 1000, 777, 62, True), (1, 4, 2, 17, 17, 64, True), (2, 2, 1, 300, 520, 64, False),
       (1, 2, 2, 129, 200, 32, True), (4, 12, 12, 256, 256, 64, True)]  # fmt: skip
DEFAULT_TILES = {dp: pp.FORWARD_TILES[dp] for dp in pp.D_PADS}

lines: list[str] = []


def say(s: str) -> None:
    print(s, flush=True)
    lines.append(s)


def rel(x, ref) -> float:
    x = np.asarray(cupy.asnumpy(x) if isinstance(x, cupy.ndarray) else x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def use_tiles(dp: int, tiles) -> None:
    pp.FORWARD_TILES[dp] = tiles if tiles is not None else DEFAULT_TILES[dp]
    cuda_backend._forward_cache.clear()


def gpu_us(call, target_us: float = 20000.0) -> tuple[float, float]:
    """(GPU us per call, host us per call): medians over batches of back-to-back calls, after warm-up."""
    for _ in range(5):
        call()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(3):
        call()
    cupy.cuda.Device().synchronize()
    est = (time.perf_counter() - t) / 3 * 1e6
    batch = int(min(100, max(3, target_us / max(est, 1.0))))
    reps = 25 if est < 1000 else 11
    for _ in range(min(20, batch)):
        call()
    gpu, host = [], []
    for _ in range(reps):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        t = time.perf_counter()
        for _ in range(batch):
            call()
        host.append((time.perf_counter() - t) / batch * 1e6)
        e1.record()
        e1.synchronize()
        gpu.append(cupy.cuda.get_elapsed_time(e0, e1) * 1000 / batch)
    return statistics.median(gpu), statistics.median(host)


def inputs(b, hq, hk, nq, nk, d, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, nq, d)).astype(np.float32)
    k = rng.standard_normal((b, hk, nk, d)).astype(np.float32)
    v = rng.standard_normal((b, hk, nk, d)).astype(np.float32)
    do = rng.standard_normal((b, hq, nq, d)).astype(np.float32)
    return q, k, v, do


def check(q, k, v, do, causal: bool, sl=(slice(None), slice(None)), backward: bool = True) -> str:
    """Forward (and backward) through the family's entry points into NaN-poisoned outputs, against float64."""
    qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
    p = check_attention(qd, kd, vd, causal=causal)
    o = cupy.full(q.shape, cupy.nan, dtype=cupy.float32)
    lse = cupy.full(q.shape[:-1], cupy.nan, dtype=cupy.float32)
    portable.forward(qd, kd, vd, o, lse, p)
    f64 = [x[sl].astype(np.float64) for x in (q, k, v, do)]
    o_ref, lse_ref = reference.attention_forward(*f64[:3], causal=causal)
    e_o = rel(o[sl], o_ref)
    lse_h = cupy.asnumpy(lse[sl]).astype(np.float64)
    fin = np.isfinite(lse_ref)
    ok = e_o <= TOL_O and np.array_equal(np.isfinite(lse_h), fin)
    ok = ok and np.allclose(lse_h[fin], lse_ref[fin], rtol=1e-5, atol=1e-5)
    out = f"o {e_o:.1e}"
    if backward:
        dq, dk, dv = (cupy.full(x.shape, cupy.nan, dtype=cupy.float32) for x in (q, k, v))
        portable.backward(dod, qd, kd, vd, o, lse, dq, dk, dv, p)
        refs = reference.attention_backward(f64[3], *f64[:3], o_ref, lse_ref, causal=causal)
        errs = [rel(g[sl], r) for g, r in zip((dq, dk, dv), refs)]
        ok = ok and max(errs) <= TOL_GRAD
        out += " dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs)
    return ("ok   " if ok else "FAIL ") + out


def main() -> int:
    dev = cupy.cuda.Device()
    name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    limits = DeviceLimits.current()
    say(f"# portable K/V prefetch, float32, {name} (sm_{limits.compute_capability}, {limits.sm_count} SMs, "
        f"{limits.max_shared_per_block} B shared a block)")
    failed = 0
    for b, hq, hk, nq, nk, d, causal in ODD:
        q, k, v, do = inputs(b, hq, hk, nq, nk, d, seed=1)
        res = check(q, k, v, do, causal)
        failed += res.startswith("FAIL")
        plan = pp.forward_plan(pp.Shape(b, hq, hk, nq, nk, d, np.dtype(np.float32)), limits)
        say(f"check B={b} Hq={hq} Hk={hk} Nq={nq} Nk={nk} D={d}{' causal' if causal else ''} "
            f"(kv_bufs {plan.tile.kv_bufs}): {res}")
    say("")
    say("| shape | forward tile | fwd GPU us | fwd host us | fwd TFLOP/s | accuracy |")
    say("|---|---|---:|---:|---:|---|")
    bwd_rows = []
    for label, b, h, n, d in SHAPES:
        q, k, v, do = inputs(b, h, h, n, n, d)
        sl = (slice(None), slice(None)) if n <= 256 else (slice(None, None, 3), slice(None, None, 15))
        dp = pp.padded_d(d)
        qd, kd, vd, dod = (cupy.asarray(x) for x in (q, k, v, do))
        flops = 4.0 * b * h * n * n * d
        for vlabel, tiles in FWD_VARIANTS[dp]:
            use_tiles(dp, tiles)
            res = check(q, k, v, do, False, sl, backward=False)
            failed += res.startswith("FAIL")
            t, host = gpu_us(lambda: cf.attention_forward(qd, kd, vd, kernel="portable"))
            say(f"| {label} B={b} H={h} N={n} D={d} | {vlabel} | {t:.1f} | {host:.1f} | {flops / t / 1e6:.1f} | "
                f"{res} |")
        use_tiles(dp, None)
        res = check(q, k, v, do, False, sl)
        failed += res.startswith("FAIL")
        o, lse = cf.attention_forward(qd, kd, vd, kernel="portable")
        t, host = gpu_us(lambda: cf.attention_backward(dod, qd, kd, vd, o, lse, kernel="portable"))
        kt = pp.backward_plan(pp.Shape(b, h, h, n, n, d, np.dtype(np.float32)), limits).kv_tile
        bwd_rows.append(f"| {label} B={b} H={h} N={n} D={d} | {kt.targs()} | {t:.1f} | {host:.1f} | "
                        f"{2.5 * flops / t / 1e6:.1f} | {res} |")
    say("")
    say("| shape (backward as planned: Delta, dK/dV + dQ atomics, dQ conversion) | dK/dV tile | bwd GPU us | "
        "bwd host us | bwd TFLOP/s | accuracy (fwd + bwd) |")
    say("|---|---|---:|---:|---:|---|")
    for row in bwd_rows:
        say(row)
    say("")
    say(f"{'FAILED: ' + str(failed) if failed else 'all checks passed'}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "portable_prefetch.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
