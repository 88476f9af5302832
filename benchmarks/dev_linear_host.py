"""The linear forward's host path (issue 12) with build.launch_plan as it is against its previous form (argument
kinds read per call), alternated in one process: per-call wall time of back-to-back calls after warm-up
(bf16 B=1 H=8 N=128 D=64, causal): the median over 40 alternated rounds of 500 calls (the host is noisy). GPU
machine:
    python benchmarks/dev_linear_host.py
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def per_call_us(f, n: int = 3000) -> float:
    import cupy

    for _ in range(50):
        f()
    cupy.cuda.Device().synchronize()
    t = time.perf_counter()
    for _ in range(n):
        f()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - t) / n * 1e6


def per_call_kinds(plan, args: tuple) -> None:
    """launch_plan before 2026-11-25: the argument codes built and looked up on every call."""
    import cupy

    from cupyflash.kernels import build

    codes = "".join([build._ARG_CODES.get(type(a), "P") for a in args])
    key = (id(plan), codes)
    with build._packing:
        fast = _old.get(key)
        if fast is None or fast.plan is not plan:
            fast = _old[key] = build.ArgsLaunch(plan, codes)
        fast.fire(cupy.cuda.get_current_stream().ptr, args)


_old: dict = {}


def main() -> None:
    import cupy

    from cupyflash import linear_attention_forward
    from cupyflash.kernels import build, linear

    rng = cupy.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 128, 64), dtype=cupy.float32).astype("bfloat16") for _ in range(3))
    from cupyflash.linear_validation import check_linear

    p = check_linear(q, k, v, causal=True)
    linear_attention_forward(q, k, v, causal=True)
    # The full path (the API's plain calls repeat their recorded launches and no longer go through _launch).
    call = lambda: linear.forward(q, k, v, None, None, p)  # noqa: E731
    new = build.launch_plan
    times: dict[str, list[float]] = {"first-launch kinds (now)": [], "kinds per call (before)": []}
    for _ in range(40):
        for label, fn in zip(times, (new, per_call_kinds)):
            linear._launch = fn
            times[label].append(per_call_us(call, 500))
    linear._launch = new
    for label, ts in times.items():
        ts.sort()
        print(f"{label:26s} median {ts[len(ts) // 2]:6.2f} us/call (quartiles {ts[len(ts) // 4]:.2f}, "
              f"{ts[3 * len(ts) // 4]:.2f})", flush=True)


if __name__ == "__main__":
    main()
