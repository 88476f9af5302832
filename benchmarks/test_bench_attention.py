"""The DESIGN.md §5 grid (and the fp32 shapes) as pytest-benchmark cases.

    pytest benchmarks --benchmark-only                       # everything (several minutes)
    pytest benchmarks --benchmark-only -k "N2048 and D128"   # a slice

One test per (shape, pass, implementation), grouped by shape and pass. pytest-benchmark's
own statistics are wall times of a target that synchronises the device after each call
(so they include a few microseconds of launch and sync overhead); the CUDA-event median and
the TFLOP/s it gives are in ``extra_info`` (``median_ms_cuda``, ``tflops``), which is what
``python -m cupyflash.bench`` reports. Inputs are random normal, shared with torch by DLPack,
rotated or L2-flushed between rounds exactly as in the CLI (see ``cupyflash.bench.timing``).
"""
from __future__ import annotations

from typing import Any

import pytest

from cupyflash import bench
from cupyflash.bench import timing

IMPLS = ("cupyflash", "naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
PASSES = ("fwd", "bwd")
SHAPES = bench.grid_shapes() + bench.fp32_shapes()
# Shape outermost, so each shape's inputs are made once and freed before the next.
CASES = [(s, p, impl) for s in SHAPES for p in PASSES for impl in IMPLS]

RUNS, MIN_RUNS, MAX_SECONDS, WARMUP = 30, 5, 1.0, 3


def _case_id(case: tuple[bench.Shape, str, str]) -> str:
    s, p, impl = case
    return f"{s.dtype}-B{s.b}-H{s.h}-N{s.n}-D{s.d}-{'causal' if s.causal else 'full'}-{p}-{impl}"


class _Inputs:
    """The input sets of the shape being benchmarked (one shape alive at a time)."""

    def __init__(self) -> None:
        self.shape: bench.Shape | None = None
        self.sets: list[bench.InputSet] = []
        self.plan = timing.CachePlan(1, 0)
        self.opts = bench.parse_args(["--compare", "none"], has_torch=False)

    def get(self, shape: bench.Shape) -> tuple[list[bench.InputSet], timing.CachePlan]:
        if shape != self.shape:
            import cupy

            self.release()
            self.sets, self.plan = bench.input_sets(shape, self.opts, cupy.random.default_rng(0))
            self.shape = shape
        return self.sets, self.plan

    def release(self) -> None:
        self.sets, self.shape = [], None
        bench.free_device_memory()


@pytest.fixture(scope="module")
def inputs():
    cache = _Inputs()
    yield cache
    cache.release()


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_attention(benchmark: Any, inputs: _Inputs, case: tuple[bench.Shape, str, str]) -> None:
    shape, pass_, impl = case
    if impl.startswith("sdpa") and not bench.torch_importable():
        pytest.skip("torch is not installed")
    sets, plan = inputs.get(shape)
    flops = bench.attention_flops(shape.b, shape.h, shape.n, shape.n, shape.d, shape.causal, pass_)
    benchmark.group = f"{shape.label} {pass_}"
    try:
        prepared = bench.WORKLOADS["softmax"].impl(impl)(shape, pass_, sets, inputs.opts)
    except bench.Unavailable as e:
        pytest.skip(f"{impl}: {e}")
    clock = bench.make_clock(prepared.clock)
    flush = clock.flusher(plan.flush_bytes) if plan.flush_bytes else None
    n_sets = len(sets)
    state = {"round": 0}
    times: list[float] = []

    def setup() -> tuple[tuple[int], dict]:
        i = state["round"] % n_sets  # consecutive rounds never reuse a set
        state["round"] += 1
        if flush is not None:
            flush()
        clock.synchronize()
        return (i,), {}

    def target(i: int) -> None:
        start, end = clock.event(), clock.event()
        clock.record(start)
        prepared.call(i)
        clock.record(end)
        times.append(clock.elapsed_ms(start, end))  # waits for the call: the wall time is honest

    try:
        with prepared.context():
            prepared.call(0)  # compile and warm the allocators outside everything
            clock.synchronize()
            args, _ = setup()
            target(*args)
            rounds = timing.plan_runs(times[-1], runs=RUNS, min_runs=MIN_RUNS, max_seconds=MAX_SECONDS)
            warm = timing.plan_warmup(times[-1], warmup=WARMUP, sets=n_sets, max_seconds=MAX_SECONDS)
            times.clear()
            benchmark.pedantic(target, setup=setup, rounds=rounds, warmup_rounds=warm, iterations=1)
    finally:
        del prepared
        clock.synchronize()
    timed = times[-rounds:]
    median = timing.median_ms(timed)
    benchmark.extra_info.update(
        impl=impl,
        pass_=pass_,
        dtype=shape.dtype,
        b=shape.b,
        h=shape.h,
        n=shape.n,
        d=shape.d,
        causal=shape.causal,
        flops=flops,
        median_ms_cuda=median,
        tflops=timing.tflops(flops, median),
        input_sets=n_sets,
        l2_flushed=flush is not None,
    )
