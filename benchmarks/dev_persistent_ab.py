"""The persistent ws forward (plans.wgmma ForwardConfig.persistent) against the one-tile-a-block ws kernel and the
lockstep kernel, in one process: each configuration reached explicitly through the wgmma family's entry point
(no API cache), bf16, H*D = 2048, B*N = 16384 (and N = 4096 with --n 4096). GPU ms per call (dev_ws_ab.per_call_ms:
events around back-to-back calls, median of batches), the three kernels alternated over two rounds (best of the
two); persistent o/lse bit for bit against the ws kernel's. Rows: causal sliding windows of 256 / 1024 / 2048 /
4096 keys (issue 13's rows are window 1024), a symmetric window, and dense causal / full (persistent forced there:
not a default, for the record). ``--two``: at D = 64 also the ws forward with two consumers (Br = 128, the
lockstep kernel's tile) instead of three (Br = 192), one tile a block and persistent. GPU machine:
    python benchmarks/dev_persistent_ab.py [--d 64 128] [--n 16384 4096] [--cases ...] [--two] > $OUT/persistent_ab.txt
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev_ws_ab import per_call_ms  # noqa: E402

CASES = {  # name: (causal, window_size)
    "window256": (True, (256, 0)),
    "window1024": (True, (1024, 0)),
    "window2048": (True, (2048, 0)),
    "window4096": (True, (4096, 0)),
    "window512-512": (False, (512, 512)),
    "causal": (True, None),
    "full": (False, None),
}


def main() -> None:
    import cupy as cp

    from cupyflash.kernels import wgmma
    from cupyflash.plans import wgmma as plans
    from cupyflash.validation import check_attention

    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[16384])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--two", action="store_true", help="D = 64: the ws forward with two consumers too")
    a = ap.parse_args()
    bf16 = cp.dtype("bfloat16")
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16 forward GPU ms per call", flush=True)
    for d in a.d:
        configs = {"lockstep": plans.FORWARD_CONFIGS[d], "ws": plans.WS_FORWARD_CONFIGS[d],
                   "persistent": replace(plans.WS_FORWARD_CONFIGS[d], persistent=True)}  # fmt: skip
        if a.two and d == 64:
            two = replace(plans.WS_FORWARD_CONFIGS[d], warpgroups=2)
            configs.update({"ws2": two, "persistent2": replace(two, persistent=True)})
        for n in a.n:
            b, h = max(1, 16384 // n), 2048 // d
            rng = cp.random.default_rng(0)
            q, k, v = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(bf16) for _ in range(3))
            o = cp.empty_like(q)
            lse = cp.empty((b, h, n), cp.float32)
            for case in a.cases:
                causal, window = CASES[case]
                p = check_attention(q, k, v, causal=causal, window_size=window)
                t, outs = {m: [] for m in configs}, {}
                for rnd in range(2):
                    for mode in (list(configs) if rnd == 0 else list(configs)[::-1]):
                        call = lambda: wgmma.forward(q, k, v, o, lse, p, config=configs[mode])  # noqa: E731
                        o.fill(float("nan"))
                        call()
                        outs[mode] = (o.get().tobytes(), lse.get().tobytes())
                        t[mode].append(per_call_ms(call))
                best = {m: min(x) for m, x in t.items()}
                same = outs["persistent"] == outs["ws"]
                default = plans.plan_forward(b, h, n, d, "__nv_bfloat16", plans.DeviceLimits.current(),
                                             variant=p.variant).config  # fmt: skip
                kind = ("lockstep" if not default.ws else "few-tiles (persistent2)" if default == plans.WS_FEW_TILES_D64
                        else "persistent" if default.persistent else "ws")  # fmt: skip
                more = "".join(f", {m} {best[m]:.3f} ({best['ws'] / best[m]:.3f}x ws)"
                               for m in configs if m.endswith("2"))  # fmt: skip
                print(f"D={d} N={n} B={b} {case:13s} lockstep {best['lockstep']:.3f} ms, ws {best['ws']:.3f}, "
                      f"persistent {best['persistent']:.3f}; persistent vs ws {best['ws'] / best['persistent']:.3f}x, "
                      f"vs lockstep {best['lockstep'] / best['persistent']:.3f}x; bitwise = ws: {same}; "
                      f"default: {kind}{more}", flush=True)


if __name__ == "__main__":
    main()
