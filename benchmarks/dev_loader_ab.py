"""The wgmma backward with its loader warpgroup (kLoader, plans.wgmma.LOADER) against the lockstep kernel, through
the public API in one process: first agreement on odd shapes (dk and dv bitwise: the same arithmetic in the same
order; dq within its adds' reordering), then GPU ms per call (dev_ws_ab.per_call_ms), two rounds alternated, bf16,
B*N = 16k, N = 8k, H*D = 2048; dense full / causal and --suite flex's doc8 / prefix-LM by default, or dev_bwd_ab's
rows (``--rows window-c softcap alibi-c determ``; a row where plans.wgmma.uses_loader gives no loader times the
lockstep kernel twice). GPU machine:
    python benchmarks/dev_loader_ab.py > $OUT/loader_ab.txt
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dev_bwd_ab import row_keywords  # noqa: E402
from dev_ws_ab import per_call_ms  # noqa: E402


def grads(loader: bool, call):
    import cupy as cp

    from cupyflash import cuda_backend
    from cupyflash.plans import wgmma

    wgmma.LOADER = loader
    cuda_backend._backward_cache.clear()
    return [g.astype(cp.float32) for g in call()[:3]]


def main() -> None:
    import argparse

    import cupy as cp

    import cupyflash as cf

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two agreement shapes and the dense causal rows only")
    ap.add_argument("--rows", nargs="+", default=None, help="dev_bwd_ab.py's rows instead of the default four")
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--no-agree", action="store_true", help="timings only")
    ap.add_argument("--any-score", action="store_true",
                    help="the loader at D = 64 with every score too (uses_loader keeps it to plain scores there)")
    a = ap.parse_args()
    if a.any_score:
        from cupyflash.plans import wgmma

        rule = wgmma.uses_loader
        wgmma.uses_loader = lambda d, variant, own: rule(128, variant, own)  # D = 128's rule at every head dim
    bf16 = cp.dtype("bfloat16")
    rng = cp.random.default_rng(1)
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}", flush=True)
    bad = 0
    shapes = ((64, 2, 4, 2, 300, 333, True), (128, 2, 8, 2, 1000, 700, True), (128, 1, 4, 4, 517, 517, False),
              (64, 1, 2, 1, 64, 64, False), (96, 1, 2, 2, 260, 260, True))
    for d, b, hq, hk, nq, nk, causal in shapes[: 0 if a.no_agree else 2 if a.quick else None]:
        q, do = (rng.standard_normal((b, hq, nq, d), dtype=cp.float32).astype(bf16) for _ in range(2))
        k, v = (rng.standard_normal((b, hk, nk, d), dtype=cp.float32).astype(bf16) for _ in range(2))
        o, lse = cf.attention_forward(q, k, v, causal, kernel="wgmma")
        call = lambda: cf.attention_backward(do, q, k, v, o, lse, causal, kernel="wgmma")  # noqa: E731
        (dq0, dk0, dv0), (dq1, dk1, dv1) = grads(False, call), grads(True, call)
        same = bool((dk0 == dk1).all() and (dv0 == dv1).all())
        rel = float(cp.abs(dq1 - dq0).max() / cp.abs(dq0).max())
        ok = same and rel < 2e-2 and all(bool(cp.isfinite(x).all()) for x in (dq1, dk1, dv1))
        bad += not ok
        print(f"agree D={d} B={b} Hq={hq} Hk={hk} Nq={nq} Nk={nk} causal={causal}: dk dv bitwise {same}, dq max rel "
              f"diff {rel:.1e} {'ok' if ok else 'BAD'}", flush=True)
    n = 8192
    for d in a.d:
        b, h = 16384 // n, 2048 // d
        q, k, v, do = (rng.standard_normal((b, h, n, d), dtype=cp.float32).astype(bf16) for _ in range(4))
        names = a.rows or (["causal"] if a.quick else ["full", "causal", "doc8", "prefix"])
        for name in names:
            causal, kw = row_keywords(name, b, h, n)
            det = kw.pop("deterministic", False)
            o, lse = cf.attention_forward(q, k, v, causal=causal, **kw)
            call = lambda: cf.attention_backward(do, q, k, v, o, lse, causal=causal, deterministic=det,  # noqa: E731
                                                 **kw)
            t = {False: [], True: []}
            for rnd in range(2):
                for loader in ((False, True) if rnd == 0 else (True, False)):
                    g = grads(loader, call)
                    t[loader].append(per_call_ms(call))
            same = bool((g[1] == grads(not loader, call)[1]).all())
            print(f"D={d} {name:7s} lockstep {min(t[False]):.3f} ms, loader {min(t[True]):.3f} ms, lockstep/loader "
                  f"{min(t[False]) / min(t[True]):.3f}; dk bitwise {same}", flush=True)
            cp.get_default_memory_pool().free_all_blocks()
    print(f"{bad} disagreeing shapes", flush=True)


if __name__ == "__main__":
    main()
