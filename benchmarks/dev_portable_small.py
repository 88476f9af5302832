"""Portable (fp32) tiles at a tiny shape (issue 12's B=4, H=12, N=256, D=64): GPU time per call of the forward and
backward with each forward / dK-dV tile forced (one process per configuration, so each compiles only its kernels).

    python benchmarks/dev_portable_small.py            # every configuration, a line each
    python benchmarks/dev_portable_small.py one FWD KV [B N]  # FWD = rows,cols,tm[,min_blocks[,kv_bufs]], KV = rows,cols,tm
"""
from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FWD = ["64,64,8,3", "32,64,4,3", "64,64,4,2", "32,32,4,3"]
KV = ["64,64,8", "64,32,8", "32,32,4", "32,64,4"]


def tile(spec: str):
    from cupyflash.plans.portable import Tile

    v = [int(x) for x in spec.split(",")]
    return Tile(v[0], v[1], v[2], min_blocks=v[3] if len(v) > 3 else 1, kv_bufs=v[4] if len(v) > 4 else 1)


def one(fwd: str, kv: str, b: int = 4, n: int = 256) -> None:
    import cupy

    import cupyflash as cf
    from cupyflash.plans import portable

    portable.FORWARD_TILES[64] = (tile(fwd),)
    portable.KV_TILES[64] = (tile(kv),)
    rng = cupy.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((b, 12, n, 64), dtype=cupy.float32) for _ in range(4))
    o, lse = cf.attention_forward(q, k, v, kernel="portable")
    cf.attention_backward(do, q, k, v, o, lse, kernel="portable")
    out = []
    for call in (lambda: cf.attention_forward(q, k, v, kernel="portable"),
                 lambda: cf.attention_backward(do, q, k, v, o, lse, kernel="portable")):
        for _ in range(20):
            call()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(200):
            call()
        end.record()
        end.synchronize()
        out.append(cupy.cuda.get_elapsed_time(start, end) * 1000 / 200)
    print(f"B={b} N={n} fwd tile {fwd:10s} kv tile {kv:8s}: forward {out[0]:6.1f} us, backward {out[1]:6.1f} us a call "
          "(200 back to back, events)", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        one(sys.argv[2], sys.argv[3], *(int(x) for x in sys.argv[4:6]))
    else:
        for f, kv in zip(FWD, KV):
            subprocess.run([sys.executable, __file__, "one", f, kv], check=False)
