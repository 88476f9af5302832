"""GPU timing with CUDA events, shared by ``python -m cupyflash.bench`` and ``benchmarks/``.

Every measurement follows DESIGN.md §5: events around each call on the stream the work runs
on, warm-up first (so NVRTC compilation and allocator growth stay out), the median of many
runs, and inputs that are not sitting in L2 when a call starts: either several input sets
used in turn, or, when one set is so small that rotating would need too many copies, a
scratch buffer twice the size of L2 rewritten before each call (outside the timed region).

The planning helpers are pure functions so the CPU tests cover them; the clocks import CuPy
or torch only when built.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

#: L2 size assumed when the device cannot be asked (H100/H200 have 50-60 MB).
DEFAULT_L2_BYTES = 60 * 1024 * 1024


# ---------------------------------------------------------------------------- pure planning


@dataclass(frozen=True)
class CachePlan:
    """How a measurement keeps inputs out of L2: ``sets`` input sets used in turn, and a
    scratch buffer of ``flush_bytes`` rewritten before each call (0: no flush)."""

    sets: int
    flush_bytes: int


def plan_cache_defeat(set_bytes: int, l2_bytes: int, max_sets: int = 8) -> CachePlan:
    """Rotate inputs while ``max_sets`` copies are enough to push one set out of L2 between
    its uses (the other sets together touch at least 2x L2); flush otherwise.

    ``set_bytes`` counts what one call reads and writes; a set of at least 2x L2 evicts itself.
    """
    if set_bytes <= 0 or l2_bytes <= 0:
        raise ValueError(f"set_bytes and l2_bytes must be positive; got {set_bytes}, {l2_bytes}")
    if set_bytes >= 2 * l2_bytes:
        return CachePlan(sets=1, flush_bytes=0)
    sets = 1 + math.ceil(2 * l2_bytes / set_bytes)
    if sets <= max_sets:
        return CachePlan(sets=sets, flush_bytes=0)
    return CachePlan(sets=1, flush_bytes=2 * l2_bytes)


def plan_runs(estimate_ms: float, *, runs: int, min_runs: int, max_seconds: float) -> int:
    """How many timed calls fit in ``max_seconds`` given one call's estimated time, clamped
    to ``[min_runs, runs]`` (slow shapes take fewer runs; fast ones take ``runs``)."""
    if runs < 1 or min_runs < 1:
        raise ValueError(f"runs and min_runs must be >= 1; got {runs}, {min_runs}")
    min_runs = min(min_runs, runs)
    if estimate_ms <= 0 or not math.isfinite(estimate_ms):
        return runs
    fit = int(max_seconds * 1000.0 / estimate_ms)
    return max(min_runs, min(runs, fit))


def plan_warmup(estimate_ms: float, *, warmup: int, sets: int, max_seconds: float) -> int:
    """Warm-up calls after the first (compiling) one: ``warmup`` but no more than a fifth of
    the time budget, and never fewer than needed to touch every input set once."""
    if estimate_ms > 0 and math.isfinite(estimate_ms):
        warmup = min(warmup, max(1, int(0.2 * max_seconds * 1000.0 / estimate_ms)))
    return max(warmup, sets)


def median_ms(times_ms: Sequence[float]) -> float:
    if not times_ms:
        raise ValueError("no timings to take the median of")
    return float(statistics.median(times_ms))


def tflops(flops: float, ms: float) -> float:
    """TFLOP/s of ``flops`` done in ``ms`` milliseconds."""
    if ms <= 0:
        raise ValueError(f"time must be positive; got {ms} ms")
    return flops / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------- clocks


class Clock(Protocol):
    """CUDA events on the stream one library launches on."""

    def event(self) -> Any: ...

    def record(self, event: Any) -> None: ...

    def elapsed_ms(self, start: Any, end: Any) -> float: ...

    def synchronize(self) -> None: ...

    def flusher(self, nbytes: int) -> Callable[[], None]: ...


class CupyClock:
    """Events on CuPy's current stream (where cupyflash launches)."""

    def __init__(self) -> None:
        import cupy

        self._cupy = cupy

    def event(self) -> Any:
        return self._cupy.cuda.Event()

    def record(self, event: Any) -> None:
        event.record()  # current stream

    def elapsed_ms(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(self._cupy.cuda.get_elapsed_time(start, end))

    def synchronize(self) -> None:
        self._cupy.cuda.Device().synchronize()

    def flusher(self, nbytes: int) -> Callable[[], None]:
        buf = self._cupy.empty(nbytes, dtype=self._cupy.uint8)
        state = [0]

        def flush() -> None:
            state[0] = (state[0] + 1) & 0xFF
            buf.fill(state[0])

        return flush


class TorchClock:
    """Events on torch's current stream (where SDPA launches)."""

    def __init__(self) -> None:
        import torch

        self._torch = torch

    def event(self) -> Any:
        return self._torch.cuda.Event(enable_timing=True)

    def record(self, event: Any) -> None:
        event.record()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        end.synchronize()
        return float(start.elapsed_time(end))

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()

    def flusher(self, nbytes: int) -> Callable[[], None]:
        buf = self._torch.empty(nbytes, dtype=self._torch.uint8, device="cuda")
        state = [0]

        def flush() -> None:
            state[0] = (state[0] + 1) & 0xFF
            buf.fill_(state[0])

        return flush


def device_l2_bytes() -> int:
    """L2 size of CuPy's current device (DEFAULT_L2_BYTES if it cannot be read)."""
    import cupy

    try:
        n = int(cupy.cuda.Device().attributes["L2CacheSize"])
    except Exception:
        return DEFAULT_L2_BYTES
    return n if n > 0 else DEFAULT_L2_BYTES


# ---------------------------------------------------------------------------- measuring


@dataclass(frozen=True)
class Timing:
    times_ms: tuple[float, ...]
    warmup: int
    sets: int
    flushed: bool

    @property
    def median_ms(self) -> float:
        return median_ms(self.times_ms)

    @property
    def runs(self) -> int:
        return len(self.times_ms)


def _time_one(clock: Clock, call: Callable[[int], Any], i: int, flush: Callable[[], None] | None) -> float:
    start, end = clock.event(), clock.event()
    if flush is not None:
        flush()
    clock.record(start)
    call(i)
    clock.record(end)
    return clock.elapsed_ms(start, end)


def measure(
    call: Callable[[int], Any],
    clock: Clock,
    *,
    plan: CachePlan = CachePlan(1, 0),
    warmup: int = 3,
    runs: int = 30,
    min_runs: int = 5,
    max_seconds: float = 1.0,
) -> Timing:
    """Median-ready CUDA-event times of ``call(i)``, i cycling over ``plan.sets`` input sets.

    The first call compiles and grows allocator pools; one more call gives an estimate that
    sizes the warm-up and the number of timed runs. Timed calls are issued back to back with
    a pair of events each, and read after the last one.
    """
    flush = clock.flusher(plan.flush_bytes) if plan.flush_bytes else None
    sets = max(1, plan.sets)
    clock.synchronize()
    call(0)
    clock.synchronize()
    estimate = _time_one(clock, call, 1 % sets, flush)
    n_warm = plan_warmup(estimate, warmup=max(0, warmup - 2), sets=sets, max_seconds=max_seconds)
    for w in range(n_warm):
        call(w % sets)
    n_runs = plan_runs(estimate, runs=runs, min_runs=min_runs, max_seconds=max_seconds)
    pairs = [(clock.event(), clock.event()) for _ in range(n_runs)]
    for r, (start, end) in enumerate(pairs):
        if flush is not None:
            flush()
        clock.record(start)
        call((n_warm + r) % sets)  # continues the cycle: no set runs twice in a row
        clock.record(end)
    clock.synchronize()
    times = tuple(clock.elapsed_ms(s, e) for s, e in pairs)
    return Timing(times_ms=times, warmup=n_warm + 2, sets=sets, flushed=flush is not None)
