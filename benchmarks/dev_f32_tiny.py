"""Issue 12's float32 backward row (B=4 H=12 N=256 D=64) taken apart: the call's queued GPU time as shipped and
with the main kernel's query tiles split over more blocks (``plans.mma.query_parts`` forced: grid z = parts, each
part's dK/dV partials summed by the combine launch), so that the main kernel's time per block-step and per block can
be read off. ``--once`` runs one call of each (for ncu's per-kernel times). GPU machine:
    python benchmarks/dev_f32_tiny.py > $OUT/f32_tiny.txt
    ncu --clock-control none -k regex:mma_ python benchmarks/dev_f32_tiny.py --once > $OUT/ncu_f32_tiny.txt
    python benchmarks/dev_f32_tiny.py --launches > $OUT/f32_tiny_launches.txt  # each launch's share of the queue
``--configs``: other tables forced (two blocks an SM at <= 128 registers: a d split, or Br = 16 with query parts).
``--launches``: the shipped plan's queue with only some of its launches (the results are garbage; the time is each
launch's share of the call, gaps included).
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [(4, 12, 256, 64, False), (4, 12, 256, 64, True)]
PARTS = [None, 2, 3, 4]


def launches() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash.bench import overhead, timing
    from cupyflash.kernels import build

    fire = build.Launch.fire
    keep: tuple[str, ...] = ()

    def only(self, stream):
        if any(k in self.plan.name for k in keep):
            fire(self, stream)

    rng = cp.random.default_rng(0)
    for b, h, n, d, causal in SHAPES:
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32) for _ in range(4))
        o, lse = cf.attention_forward(q, k, v, causal)
        call = lambda: cf.attention_backward(do, q, k, v, o, lse, causal)  # noqa: E731
        for rnd in range(2):
            for sel in (("delta", "flash_bwd", "convert"), ("flash_bwd",), ("delta", "convert"), ("delta",),
                        ("convert",), ("delta", "flash_bwd")):
                keep = sel
                build.Launch.fire = only
                t = overhead.Timed(call, cp.cuda.Device().synchronize, timing.CupyClock())
                _, host = overhead.wall_us(t, calls=100, warmup=5, repeats=3)
                us = statistics.median(overhead.queued_us(t, host) for _ in range(7))
                build.Launch.fire = fire
                print(f"B={b} H={h} N={n} D={d} {'causal' if causal else 'full  '} round {rnd}: {'+'.join(sel):24s} "
                      f"{us:7.1f} us", flush=True)


def configs() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.bench import overhead, timing
    from cupyflash.plans import mma
    from cupyflash.plans.mma import BackwardConfig as C

    shipped, table, small = mma.query_parts, dict(mma.BACKWARD_CONFIGS_F32), dict(mma.SMALL_GRID_BACKWARD_F32)
    alts = [None, (C(64, br=32, key_warps=4, d_split=2, min_blocks=2, elem=4), 1),
            (C(64, br=16, key_warps=8, min_blocks=2, elem=4), 1), (C(64, br=16, key_warps=8, min_blocks=2, elem=4), 2),
            (C(64, br=32, key_warps=4, d_split=2, min_blocks=2, elem=4), 2), (C(64, br=32, key_warps=8, elem=4), 2)]

    def force(alt):
        mma.BACKWARD_CONFIGS_F32.update(table)
        mma.SMALL_GRID_BACKWARD_F32.clear()
        mma.query_parts = shipped
        if alt is None:
            mma.SMALL_GRID_BACKWARD_F32.update(small)
        else:
            mma.BACKWARD_CONFIGS_F32[64] = alt[0]
            mma.query_parts = lambda *a, **k: alt[1]
        cuda_backend._backward_cache.clear()

    rng = cp.random.default_rng(0)
    for b, h, n, d, causal in SHAPES:
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32) for _ in range(4))
        o, lse = cf.attention_forward(q, k, v, causal)
        call = lambda: cf.attention_backward(do, q, k, v, o, lse, causal)  # noqa: E731
        force(None)
        ref = [g.copy() for g in call()]
        best: dict = {}
        for rnd in range(2):
            for i in (range(len(alts)) if rnd == 0 else reversed(range(len(alts)))):
                force(alts[i])
                grads = call()
                err = max(float(cp.abs(g - r).max() / cp.abs(r).max()) for g, r in zip(grads, ref))
                t = overhead.Timed(call, cp.cuda.Device().synchronize, timing.CupyClock())
                _, host = overhead.wall_us(t, calls=100, warmup=5, repeats=3)
                us = statistics.median(overhead.queued_us(t, host) for _ in range(7))
                best[i] = (min(best.get(i, (us,))[0], us), err)
        force(None)
        for i, (us, err) in sorted(best.items()):
            print(f"B={b} H={h} N={n} D={d} {'causal' if causal else 'full  '} {alts[i]}: {us:7.1f} us "
                  f"(max rel. diff to shipped {err:.1e})", flush=True)


def main() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.bench import overhead, timing
    from cupyflash.plans import mma

    shipped = mma.query_parts
    once = "--once" in sys.argv

    def force(parts):
        mma.query_parts = shipped if parts is None else (lambda *a, **k: parts)
        cuda_backend._forward_cache.clear()
        cuda_backend._backward_cache.clear()

    rng = cp.random.default_rng(0)
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; float32 backward, GPU us per call (queued, "
          "median of 7, best of 2 rounds)", flush=True)
    for b, h, n, d, causal in SHAPES:
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32) for _ in range(4))
        o, lse = cf.attention_forward(q, k, v, causal)
        call = lambda: cf.attention_backward(do, q, k, v, o, lse, causal)  # noqa: E731
        ref = None
        best: dict = {}
        for rnd in range(1 if once else 2):
            for parts in (PARTS if rnd == 0 else PARTS[::-1]):
                force(parts)
                grads = call()
                cp.cuda.Device().synchronize()
                if parts is None:
                    ref = [g.copy() for g in grads]
                err = max(float(cp.abs(g - r).max() / cp.abs(r).max()) for g, r in zip(grads, ref)) if ref else 0.0
                if once:
                    print(f"B={b} H={h} N={n} D={d} causal={causal} parts={parts}: ran once (err vs shipped {err:.1e})",
                          flush=True)
                    continue
                t = overhead.Timed(call, cp.cuda.Device().synchronize, timing.CupyClock())
                _, host = overhead.wall_us(t, calls=100, warmup=5, repeats=3)
                us = statistics.median(overhead.queued_us(t, host) for _ in range(7))
                best[parts] = (min(best.get(parts, (us,))[0], us), err)
        force(None)
        for parts, (us, err) in best.items():
            print(f"B={b} H={h} N={n} D={d} {'causal' if causal else 'full  '} parts={parts}: {us:7.1f} us "
                  f"(max rel. diff to shipped {err:.1e})", flush=True)


if __name__ == "__main__":
    launches() if "--launches" in sys.argv else configs() if "--configs" in sys.argv else main()
