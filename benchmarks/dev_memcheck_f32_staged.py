"""The float32 mma kernels with mask/bias arrays (staged tiles where they fit, forward and backward) on small odd
shapes, for compute-sanitizer; exits non-zero if a result is non-finite. GPU machine:
    compute-sanitizer --tool memcheck --error-exitcode 3 python benchmarks/dev_memcheck_f32_staged.py
"""
import cupy
import numpy as np

import cupyflash

# (Hq, Hk, Nq, Nk, D, causal): gpu_smoke.py's shapes and one larger
SHAPES = [(2, 1, 17, 33, 40, True), (2, 2, 33, 17, 64, True), (1, 1, 70, 70, 128, False), (2, 1, 70, 100, 128, True),
          (1, 1, 70, 130, 64, False), (2, 2, 150, 230, 64, False)]


def main() -> int:
    rng = np.random.default_rng(0)
    bad = 0
    for hq, hk, nq, nk, d, causal in SHAPES:
        f = lambda s: cupy.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
        q, k, v, do = f((1, hq, nq, d)), f((1, hk, nk, d)), f((1, hk, nk, d)), f((1, hq, nq, d))
        for label, kw in (("mask", dict(mask=cupy.asarray(rng.random((1, hq, nq, nk)) < 0.8))),
                          ("bias", dict(bias=f((1, hq, nq, nk)))),
                          ("head bias", dict(bias=f((hq, 1, nk)))),
                          ("both", dict(mask=cupy.asarray(rng.random((1, 1, 1, nk)) < 0.8), bias=f((hq, nq, nk))))):
            o, lse = cupyflash.attention_forward(q, k, v, causal=causal, kernel="mma", **kw)
            bkw = dict(kw, bias_grad=True) if "bias" in kw else kw
            grads = cupyflash.attention_backward(do, q, k, v, o, lse, causal=causal, kernel="mma", **bkw)
            ok = all(bool(cupy.isfinite(x).all()) for x in (o, *grads))
            bad += not ok
            print(f"mma float32 hq={hq} nq={nq} nk={nk} d={d} causal={causal} {label}: {'ok' if ok else 'NON-FINITE'}")
    return bad


if __name__ == "__main__":
    raise SystemExit(main())
