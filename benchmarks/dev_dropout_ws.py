"""The forward with dropout 0.1 on the warp-specialised wgmma kernel and on the lockstep one (plans.wgmma.WS_DEFAULT
flipped), beside the same calls without dropout, through the public API: bf16, the dropout suite's shapes (B*N = 16k,
H = 32 at D = 64, 16 at D = 128). Each cell: GPU ms per call from CUDA events around 20 back-to-back calls, median of
9 batches, both settings alternated twice (best of the two rounds). GPU machine:
    python benchmarks/dev_dropout_ws.py > $OUT/dropout_ws.txt
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev_ws_ab import per_call_ms  # noqa: E402


def main() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.plans import wgmma

    bf16 = cp.dtype("bfloat16")
    rng = cp.random.default_rng(0)
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16 forward, ms per call; "
          "drop = dropout 0.1; ratios: dropout / no dropout (<1: dropout slower)", flush=True)
    for d, h in ((64, 32), (128, 16)):
        for n in (2048, 8192, 16384):
            b = 16384 // n
            q, k, v = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(bf16) for _ in range(3))
            for causal in (False, True):
                t: dict[tuple[bool, bool], float] = {}
                for rnd in range(2):
                    for on in ((False, True) if rnd == 0 else (True, False)):
                        wgmma.WS_DEFAULT.update({64: on, 128: on})
                        cuda_backend._forward_cache.clear()  # plans are cached per call signature
                        for drop in (False, True):
                            kw = {"dropout_p": 0.1, "dropout_seed": 7} if drop else {}
                            ms = per_call_ms(lambda: cf.attention_forward(q, k, v, causal=causal, **kw))
                            t[on, drop] = min(t.get((on, drop), ms), ms)
                wgmma.WS_DEFAULT.update({64: True, 128: True})
                cuda_backend._forward_cache.clear()
                print(f"D={d} N={n} B={b} {'causal' if causal else 'full  '}: ws on {t[True, False]:.3f} / drop "
                      f"{t[True, True]:.3f} ({t[True, False] / t[True, True]:.3f}) | ws off {t[False, False]:.3f} / "
                      f"drop {t[False, True]:.3f} ({t[False, False] / t[False, True]:.3f}) | drop: off/on "
                      f"{t[False, True] / t[True, True]:.3f}", flush=True)
            q = k = v = None  # noqa: F841 - free before the next shape
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
