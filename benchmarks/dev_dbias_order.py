"""Development A/B of the backward's grid order when dbias sums over the batch (params.batch_inner).

For the masks suite's bias shapes (bf16, B*N = 16k, H*D = 2048, a (1, H, N, N) bias broadcast over the batch,
not causal): the backward with ``bias_grad=True`` with the batches of one kv head side by side in the grid
(``kernels.family.batch_inner``, the plan's choice) and with the old order (batch slowest), alternated in one
process; CUDA events, median. Also checks that both orders give the same gradients (dk, dv bit for bit; dq and
dbias, float sums in another order, within rounding).

Usage: python benchmarks/dev_dbias_order.py [--kernel wgmma|mma|portable]
"""
from __future__ import annotations

import argparse
import os
import statistics

import cupy as cp
import numpy as np

import cupyflash as cf
from cupyflash import _dtypes, cuda_backend
from cupyflash.kernels import family

from dev_wgmma import median_ms


def order(on: bool) -> None:
    """Pick the grid order for the plans made from here on (the plan cache is cleared)."""
    family.batch_inner = BATCH_INNER if on else (lambda p, g: False)
    cuda_backend._backward_cache.clear()


BATCH_INNER = family.batch_inner


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="auto")
    args = ap.parse_args()
    print(cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "kernel", args.kernel)
    lines = []
    for d, n in ((64, 1024), (64, 2048), (64, 8192), (128, 1024), (128, 2048)):
        b, h = 16384 // n, 2048 // d
        rng = cp.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(_dtypes.BFLOAT16) for _ in range(4))
        bias = rng.standard_normal((1, h, n, n), dtype=cp.float32).astype(_dtypes.BFLOAT16)
        o, lse = cf.attention_forward(q, k, v, False, bias=bias, kernel=args.kernel)

        def bwd():
            return cf.attention_backward(do, q, k, v, o, lse, False, bias=bias, bias_grad=True, kernel=args.kernel)

        grads = {}
        for on in (False, True):
            order(on)
            grads[on] = [g.copy() for g in bwd()]
        same = all(bool((x == y).all()) for x, y in zip(grads[False][1:3], grads[True][1:3]))  # dk, dv: owned

        def rel(i):  # dq and dbias are float sums whose order the grid changes
            x, y = (g[i].astype(cp.float32) for g in (grads[False], grads[True]))
            return float(cp.abs(x - y).max()) / float(cp.abs(x).max())

        ddq, ddb = rel(0), rel(3)
        times = {False: [], True: []}
        for _ in range(3):  # alternated rounds against drift
            for on in (False, True):
                order(on)
                times[on].append(median_ms(bwd, iters=15))
        old, new = (statistics.median(times[on]) for on in (False, True))
        line = (f"D={d:3d} N={n:5d} B={b:2d} H={h:2d}  bwd old {old:7.3f} ms  batch-inner {new:7.3f} ms  "
                f"{old / new:5.2f}x  dk/dv same: {same}  dq, dbias rel diff {ddq:.1e}, {ddb:.1e}")
        print(line, flush=True)
        lines.append(line)
        del q, k, v, do, bias, o, lse, grads
        cp.get_default_memory_pool().free_all_blocks()
    order(True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"dbias_order_{args.kernel}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
