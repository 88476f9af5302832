"""User snippets (issue 17's --suite flex cases) on the lockstep and the warp-specialised wgmma forward, through the
public API: doc2..doc16 (causal, documents of random lengths) and prefix-LM (non-causal, the first N/4 keys seen by all),
each with its block mask, bf16, B=1, N=16384, H*D = 2048; dense causal (ws) beside them. GPU ms per call (CUDA events
around 20 back-to-back calls, median of 9 batches), lockstep and ws alternated twice (best of the two), and the
largest |o_ws - o_lockstep| / lse difference. GPU machine:
    python benchmarks/dev_flex_ws.py > $OUT/flex_ws.txt
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev_ws_ab import per_call_ms  # noqa: E402


def main() -> None:
    import cupy as cp
    import numpy as np

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.bench import flex as bflex
    from cupyflash.bench.shapes import Shape
    from cupyflash.plans import wgmma

    original = wgmma.ws_unsupported
    threshold = getattr(wgmma, "WS_MIN_BLOCK_KEYS_D64", 0)

    def lockstep_for_flex(variant):
        if variant.flex is not None or variant.block_mask:
            return "lockstep (A/B)"
        return original(variant)

    def ws_for_flex(variant):
        return "arrays" if variant.arrays else None

    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16 forward ms per call", flush=True)
    for d in (64, 128):
        shape = Shape(b=1, h=2048 // d, n=16384, d=d, dtype="bfloat16", causal=True)
        x = bflex.inputs(shape, 0)
        q, k, v = x["q"], x["k"], x["v"]
        flops_causal = 4 * shape.h * shape.n * shape.n * d / 2
        dense = per_call_ms(lambda: cf.attention_forward(q, k, v, True))
        print(f"D={d} dense causal {dense:.3f} ms ({flops_causal / dense / 1e9:.0f} TFLOP/s)", flush=True)
        for case in ("doc2", "doc4", "doc8", "doc16", "prefix-lm"):
            if case.startswith("doc"):  # documents of random lengths, as --suite flex's doc8 (seed 0)
                docs = int(case[3:])
                cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, shape.n), docs - 1, replace=False))
                doc = np.searchsorted(cuts, np.arange(shape.n), side="right").astype(np.int32)
                kw = bflex._snippet("doc8", {"doc": cp.asarray(doc[None].copy())})
            else:
                kw = bflex._snippet(case, x)
            kw["block_mask"] = cf.create_block_mask(kw["mask_mod"], 1, None, shape.n, shape.n, aux=kw["aux"])
            causal = case != "prefix-lm"
            span = kw["block_mask"].visited() * shape.n
            t, outs = {"lockstep": [], "ws": []}, {}
            for rnd in range(2):
                for mode in (("lockstep", "ws") if rnd == 0 else ("ws", "lockstep")):
                    wgmma.ws_unsupported = ws_for_flex if mode == "ws" else lockstep_for_flex
                    wgmma.WS_MIN_BLOCK_KEYS_D64 = 0 if mode == "ws" else threshold  # ws even where auto would not
                    cuda_backend._forward_cache.clear()
                    call = lambda: cf.attention_forward(q, k, v, causal, **kw)  # noqa: E731
                    o, lse = call()
                    outs[mode] = (o.astype(cp.float32), lse)
                    t[mode].append(per_call_ms(call))
            wgmma.ws_unsupported = original
            wgmma.WS_MIN_BLOCK_KEYS_D64 = threshold
            cuda_backend._forward_cache.clear()
            dl, dw = min(t["lockstep"]), min(t["ws"])
            do = float(cp.abs(outs["ws"][0] - outs["lockstep"][0]).max())
            fin = cp.isfinite(outs["lockstep"][1])
            dlse = float(cp.abs(cp.where(fin, outs["ws"][1] - outs["lockstep"][1], 0)).max())
            same_inf = bool((cp.isfinite(outs["ws"][1]) == fin).all())
            print(f"D={d} {case} (visited keys a row {span:.0f}): lockstep {dl:.3f} ms, ws {dw:.3f} ms, lockstep/ws {dl / dw:.3f}; "
                  f"x dense causal {dl / dense:.3f} / {dw / dense:.3f}; max|do| {do:.2e} max|dlse| {dlse:.2e} "
                  f"same -inf rows {same_inf}", flush=True)


if __name__ == "__main__":
    main()
