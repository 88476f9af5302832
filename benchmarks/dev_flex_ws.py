"""The lockstep and the warp-specialised wgmma forward on calls whose query tiles meet few key tiles, through the
public API: user snippets (issue 17's --suite flex cases: doc2..doc16, causal documents of random lengths, and
prefix-LM, non-causal with the first N/4 keys seen by all, each with its block mask) and causal sliding windows
(issue 13), bf16, B=1, N=16384, H*D = 2048; dense causal (the default kernel) beside them. GPU ms per call (CUDA
events around 20 back-to-back calls, median of 9 batches), the two kernels alternated twice (best of the two), and
the largest |o_ws - o_lockstep| / lse difference. The lockstep kernel is forced by ws_unsupported, the ws one by
clearing plans.wgmma's few-keys thresholds (lockstep_by_default). GPU machine:
    python benchmarks/dev_flex_ws.py [--cases doc8 prefix-lm window1024 ...] > $OUT/flex_ws.txt
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dev_ws_ab import per_call_ms  # noqa: E402

CASES = ("doc2", "doc4", "doc8", "doc16", "prefix-lm", "window256", "window384", "window512", "window768", "window1024",
         "window4096")


def keywords(case: str, shape, x: dict) -> tuple[bool, dict, float]:
    """(causal, keywords, mean keys a query row visits) of a case."""
    import cupy as cp

    import cupyflash as cf
    from cupyflash.bench import flex as bflex

    if case.startswith("window"):
        left = int(case[6:])
        return True, {"window_size": (left, 0)}, float(left + 1)
    if case.startswith("doc"):  # documents of random lengths, as --suite flex's doc8 (seed 0)
        doc = bflex.doc_ids(shape.n, int(case[3:]))
        kw = bflex._snippet("doc8", {"doc": cp.asarray(doc[None].copy())})
    else:
        kw = bflex._snippet(case, x)
    kw["block_mask"] = cf.create_block_mask(kw["mask_mod"], 1, None, shape.n, shape.n, aux=kw["aux"])
    causal = case != "prefix-lm"
    return causal, kw, float(kw["block_mask"].keys_a_row(causal, None))  # Variant.block_keys


def main() -> None:
    import cupy as cp

    import cupyflash as cf
    from cupyflash import cuda_backend
    from cupyflash.bench import flex as bflex
    from cupyflash.bench.shapes import Shape
    from cupyflash.plans import wgmma

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    a = ap.parse_args()
    original = wgmma.ws_unsupported
    rules = ("WS_MIN_BLOCK_KEYS_D64", "WS_MIN_CAUSAL_ROWS_D64", "WS_MIN_WINDOW_KEYS_D64")
    saved = {n: getattr(wgmma, n) for n in rules if hasattr(wgmma, n)}

    def use(mode: str) -> None:
        if mode == "lockstep":
            wgmma.ws_unsupported = lambda variant: "lockstep (A/B)"
        else:
            wgmma.ws_unsupported = lambda variant: "arrays" if variant.arrays else None
            for n in saved:
                setattr(wgmma, n, 0)  # ws even where lockstep_by_default would not
        cuda_backend._forward_cache.clear()  # plans are cached per call signature

    def restore() -> None:
        wgmma.ws_unsupported = original
        for n, value in saved.items():
            setattr(wgmma, n, value)
        cuda_backend._forward_cache.clear()

    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}; bf16 forward ms per call", flush=True)
    for d in a.d:
        shape = Shape(b=1, h=2048 // d, n=16384, d=d, dtype="bfloat16", causal=True)
        x = bflex.inputs(shape, 0)
        q, k, v = x["q"], x["k"], x["v"]
        flops_causal = 4 * shape.h * shape.n * shape.n * d / 2
        dense = per_call_ms(lambda: cf.attention_forward(q, k, v, True))
        print(f"D={d} dense causal {dense:.3f} ms ({flops_causal / dense / 1e9:.0f} TFLOP/s)", flush=True)
        for case in a.cases:
            causal, kw, span = keywords(case, shape, x)
            t, outs = {"lockstep": [], "ws": []}, {}
            for rnd in range(2):
                for mode in (("lockstep", "ws") if rnd == 0 else ("ws", "lockstep")):
                    use(mode)
                    call = lambda: cf.attention_forward(q, k, v, causal, **kw)  # noqa: E731
                    o, lse = call()
                    outs[mode] = (o.astype(cp.float32), lse)
                    t[mode].append(per_call_ms(call))
            restore()
            auto = per_call_ms(lambda: cf.attention_forward(q, k, v, causal, **kw))
            dl, dw = min(t["lockstep"]), min(t["ws"])
            do = float(cp.abs(outs["ws"][0] - outs["lockstep"][0]).max())
            fin = cp.isfinite(outs["lockstep"][1])
            dlse = float(cp.abs(cp.where(fin, outs["ws"][1] - outs["lockstep"][1], 0)).max())
            same_inf = bool((cp.isfinite(outs["ws"][1]) == fin).all())
            print(f"D={d} {case} (visited keys a row {span:.0f}): lockstep {dl:.3f} ms, ws {dw:.3f} ms, lockstep/ws "
                  f"{dl / dw:.3f}, default {auto:.3f}; x dense causal {dl / dense:.3f} / {dw / dense:.3f}; "
                  f"max|do| {do:.2e} max|dlse| {dlse:.2e} same -inf rows {same_inf}", flush=True)


if __name__ == "__main__":
    main()
