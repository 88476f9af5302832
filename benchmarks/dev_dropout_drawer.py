"""The Hopper backward with dropout, keep bits from the drawer warpgroup (plans.wgmma.DRAWER_HEAD_DIMS) or drawn by
the warpgroups that compute, and the forward, beside the same calls without dropout (issue 16). bf16,
the dropout suite's shapes (B*N = 16k, H*D = 2048), one process, both backward settings alternated over two rounds
(best of each). Also checks that dK and dV come out bitwise equal both ways (the same keep bits; dQ's float atomics
may differ). (s14 also timed a forward drawer with this script; that kernel is not in the tree: NOTES.md.)
GPU machine:
    python benchmarks/dev_dropout_drawer.py [--d 64 128] [--n 2048 8192 16384] > $OUT/dropout_drawer.txt
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev_dropout_ab import DROP, suite_rows  # noqa: E402
from dev_ws_ab import per_call_ms  # noqa: E402


def main() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.plans import wgmma

    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[2048, 8192, 16384])
    a = ap.parse_args()
    heads = frozenset(wgmma.DRAWER_HEAD_DIMS)
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16, ms per call; ratios: no dropout / "
          "dropout (>= 0.8 is the issue's bar for fwd+bwd)", flush=True)

    def use(on: bool) -> None:
        wgmma.DRAWER_HEAD_DIMS = heads if on else frozenset()
        cuda_backend._backward_cache.clear()  # plans are cached per call signature

    for r in suite_rows(a.d, a.n):
        t: dict[bool, float] = {}
        grads = {}
        for rnd in range(2):
            for on in ((True, False) if rnd == 0 else (False, True)):
                use(on)
                args = (r.do, r.q, r.k, r.v, r.o1, r.lse1)
                grads[on] = cf.attention_backward(*args, causal=r.causal, **DROP)
                ms = per_call_ms(lambda: cf.attention_backward(*args, causal=r.causal, **DROP))
                t[on] = min(t.get(on, ms), ms)
        use(True)
        same = all(bool((x == y).all()) for x, y in zip(grads[True][1:3], grads[False][1:3]))
        dq_err = float(cp.abs(grads[True][0].astype(cp.float32) - grads[False][0].astype(cp.float32)).max())
        fwd0, fwd1, bwd0 = r.fwd0, r.fwd1, r.bwd0
        print(f"D={r.d} N={r.n} B={r.b} {'causal' if r.causal else 'full  '}: fwd {fwd0:.3f}/{fwd1:.3f} "
              f"({fwd0 / fwd1:.3f}) | bwd {bwd0:.3f} / drawer {t[True]:.3f} ({bwd0 / t[True]:.3f}) / "
              f"in-warp {t[False]:.3f} ({bwd0 / t[False]:.3f}) | fwd+bwd drawer "
              f"{(fwd0 + bwd0) / (fwd1 + t[True]):.3f} in-warp {(fwd0 + bwd0) / (fwd1 + t[False]):.3f} | "
              f"dK,dV equal {same}, dQ max diff {dq_err:.2e}", flush=True)
        grads = {}


if __name__ == "__main__":
    main()
