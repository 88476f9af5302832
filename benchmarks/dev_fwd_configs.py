"""Forward tile configurations on calls whose query tiles meet few key tiles (issue 17's doc8, issue 13's windows),
through the public API with plans.wgmma.forward_config forced: the lockstep kernel at one warpgroup (Br = 64, three
blocks an SM) against the defaults, bf16, B=1, N=16384, H*D = 2048. GPU ms per call (dev_ws_ab.per_call_ms), two
rounds in alternating order (best), o against the first configuration's. GPU machine:
    python benchmarks/dev_fwd_configs.py [--cases doc8 window1024] [--d 64 128] > $OUT/fwd_configs.txt
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev_flex_ws import keywords  # noqa: E402
from dev_ws_ab import per_call_ms  # noqa: E402


def configs(d: int) -> dict:
    from cupyflash.plans.wgmma import FORWARD_CONFIGS, WS_FORWARD_CONFIGS, ForwardConfig

    out = {"lockstep": FORWARD_CONFIGS[d], "ws": WS_FORWARD_CONFIGS[d]}
    if d == 64:
        out["1wg-bc64-s4-3blk"] = ForwardConfig(64, bc=64, warpgroups=1, stages=4, min_blocks=3)
        out["1wg-bc128-s3-2blk"] = ForwardConfig(64, bc=128, warpgroups=1, stages=3, min_blocks=2)
        out["2wg-bc128-s3-1blk"] = ForwardConfig(64, bc=128, warpgroups=2, stages=3, min_blocks=1)
    else:
        out["1wg-bc64-s3-2blk"] = ForwardConfig(128, bc=64, warpgroups=1, stages=3, min_blocks=2)  # 228 KB: two fit
        out["2wg-bc64-s3-1blk"] = ForwardConfig(128, bc=64, warpgroups=2, stages=3, min_blocks=1)
        out["ws-bc64-s4"] = ForwardConfig(128, bc=64, warpgroups=2, stages=4, ws=True)
    return out


def main() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.bench import flex as bflex
    from cupyflash.bench.shapes import Shape
    from cupyflash.plans import wgmma

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["doc8", "window1024"])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    a = ap.parse_args()
    original = wgmma.forward_config
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16 forward ms per call", flush=True)
    for d in a.d:
        shape = Shape(b=1, h=2048 // d, n=16384, d=d, dtype="bfloat16", causal=True)
        x = bflex.inputs(shape, 0)
        q, k, v = x["q"], x["k"], x["v"]
        cfgs = configs(d)
        for case in a.cases:
            causal, kw, span = keywords(case, shape, x)
            t, ref = {n: [] for n in cfgs}, None
            for rnd in range(2):
                for name in (list(cfgs) if rnd == 0 else list(cfgs)[::-1]):
                    wgmma.forward_config = lambda *_a, _c=cfgs[name], **_k: _c
                    cuda_backend._forward_cache.clear()
                    call = lambda: cf.attention_forward(q, k, v, causal, **kw)  # noqa: E731
                    try:
                        o, _ = call()
                    except Exception as e:  # noqa: BLE001 (a config that does not build: say so, go on)
                        print(f"D={d} {case} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        t[name].append(float("nan"))
                        continue
                    o = o.astype(cp.float32)
                    ref = o if ref is None else ref
                    err = float(cp.abs(o - ref).max())
                    t[name].append(per_call_ms(call))
                    if rnd == 1:
                        print(f"D={d} {case} (keys a row {span:.0f}) {name}: {min(t[name]):.3f} ms "
                              f"(rounds {' / '.join(f'{v:.3f}' for v in t[name])}) max|do| {err:.1e}", flush=True)
            wgmma.forward_config = original
            cuda_backend._forward_cache.clear()


if __name__ == "__main__":
    main()
