"""``--suite overhead``: what a small call costs on the host (issue 12, item 5).

For each tiny shape the wall time of ``CALLS`` back-to-back calls after warm-up, then one device
synchronise, divided by ``CALLS`` (the median of ``REPEATS`` such runs): kernels this small finish before
the next launch is issued, so the figure is the host path (checks, plans, allocation, launch) whenever that
is the longer. Beside it, the GPU time of the same call with the host out of the way: the calls queue
behind a spin kernel and run back to back, timed by CUDA events around the queue (``queued_us``), so the
reader sees whether a row is bound by the host or by the GPU. PyTorch SDPA runs like with like, in the same
process: forward under ``torch.no_grad()``, backward alone (``torch.autograd.grad`` on a graph kept from one
forward); its columns are left out when torch is not importable.

One decode row (issue 15): ``attention_with_kvcache`` for one new query row against a full bf16
cache of 4096 keys (B = 1, 32 query heads over 8 KV heads, D = 128, ``cache_seqlens`` a device
array), beside SDPA on the equivalent dense call (q against the cache, ``enable_gqa``).
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Sequence

from . import timing
from .report import Record
from .shapes import Shape

CALLS = 300
WARMUP = 30
REPEATS = 5


@dataclass(frozen=True)
class Row:
    """One line of the table: a call on one shape."""

    call: str  # "forward", "backward", "linear forward"
    workload: str  # "softmax" or "linear"
    pass_: str  # "fwd" or "bwd"
    shape: Shape

    @property
    def label(self) -> str:
        s = self.shape
        if self.workload == "decode":
            return f"{self.call} {s.dtype} B={s.b} Hq={s.h} Hk={DECODE_HK} Nq=1 cache={s.n} D={s.d}"
        causal = " causal" if s.causal else ""
        return f"{self.call} {s.dtype} B={s.b} H={s.h} N={s.n} D={s.d}{causal}"


#: The decode row: h is the query heads, n the cache's keys (all of them attended), DECODE_HK key/value heads.
DECODE = Shape(1, 32, 4096, 128, False, "bfloat16")
DECODE_HK = 8


def plan_rows(shapes: Sequence[Shape]) -> list[Row]:
    """Forward and backward per shape, the causal linear forward at each bf16 shape, then the decode row."""
    rows = [Row(call, "softmax", p, s) for s in shapes for call, p in (("forward", "fwd"), ("backward", "bwd"))]
    rows += [Row("linear forward", "linear", "fwd", replace(s, causal=True)) for s in shapes if s.dtype == "bfloat16"]
    rows.append(Row("decode", "decode", "fwd", DECODE))
    return rows


def format_plan(rows: Sequence[Row], sdpa: bool) -> str:
    lines = [f"suite overhead: wall time of {CALLS} back-to-back calls after warm-up, one synchronise (median of {REPEATS}), "
             f"/ {CALLS}; GPU time by CUDA events" + ("; SDPA alongside" if sdpa else "")]
    lines += [f"  {r.label}" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- measuring


@dataclass
class Timed:
    """A call with no arguments, the synchronise and clock of the library that launches it, and a
    context held around the measurement (e.g. ``torch.no_grad``)."""

    call: Callable[[], Any]
    sync: Callable[[], None]
    clock: timing.Clock
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext


def wall_us(t: Timed, calls: int = CALLS, warmup: int = WARMUP, repeats: int = REPEATS) -> tuple[float, float]:
    """Microseconds per call of ``calls`` back-to-back calls: (wall time to the closing synchronise, host time
    to the last call's return), each the median of ``repeats`` runs (a single run moves by 30% on the GPU
    machine's host). The host time is what queueing the calls cost: CUDA holds about 1000 launches before the
    host waits, more than ``calls`` of these calls make, so on a GPU-bound row it is the host's own part."""
    walls, hosts = [], []
    with t.context():
        for _ in range(warmup):
            t.call()
        t.sync()
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                t.call()
            queued = time.perf_counter()
            t.sync()
            walls.append((time.perf_counter() - start) / calls * 1e6)
            hosts.append((queued - start) / calls * 1e6)
    return sorted(walls)[len(walls) // 2], sorted(hosts)[len(hosts) // 2]


#: Calls queued behind the spin kernel (CUDA queues ~1000 launches before the host blocks; a backward is 3).
QUEUED_CALLS = 100
_SPIN = r"""
extern "C" __global__ void spin(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}
"""


@functools.lru_cache(maxsize=None)
def _spin_kernel() -> Any:
    import cupy

    return cupy.RawKernel(_SPIN, "spin")


def _spin(ms: float) -> None:
    """Hold the null stream (and so every blocking stream, torch's default included) for ``ms``."""
    import cupy

    _spin_kernel()((1,), (1,), (cupy.uint64(ms * 1e6),), stream=cupy.cuda.Stream.null)


def queued_us(t: Timed, host_us: float, calls: int = QUEUED_CALLS) -> float:
    """GPU microseconds per call with the host out of the way: ``calls`` calls are queued while a spin kernel
    holds the GPU, then run back to back between two events (the gaps between their kernels included). The
    spin lasts twice the host time of the queue (``host_us`` per call, from ``wall_us``); a queue that took
    longer than the spin raises, since the GPU would have waited for the host."""
    spin_ms = 2 * calls * host_us * 1e-3 + 1.0
    with t.context():
        t.call()
        t.sync()
        start, end = t.clock.event(), t.clock.event()
        _spin(spin_ms)
        t0 = time.perf_counter()
        t.clock.record(start)
        for _ in range(calls):
            t.call()
        t.clock.record(end)
        queued_ms = (time.perf_counter() - t0) * 1e3
        ms = t.clock.elapsed_ms(start, end)
    if queued_ms > spin_ms:
        raise RuntimeError(f"queueing {calls} calls took {queued_ms:.1f} ms, longer than the {spin_ms:.1f} ms spin")
    return ms / calls * 1e3


def _cupy_inputs(shape: Shape, seed: int) -> tuple[Any, Any, Any, Any]:
    import cupy

    from .device import cupy_dtype

    rng = cupy.random.default_rng(seed)
    dims = (shape.b, shape.h, shape.n, shape.d)
    return tuple(rng.standard_normal(dims, dtype=cupy.float32).astype(cupy_dtype(shape.dtype)) for _ in range(4))  # type: ignore[return-value]


def _decode_inputs(shape: Shape, seed: int) -> tuple[Any, Any, Any, Any]:
    """q (B, Hq, 1, D), the caches (B, Hk, S, D) and cache_seqlens = S for every row, as a device array."""
    import cupy

    from .device import cupy_dtype

    rng = cupy.random.default_rng(seed)
    dt = cupy_dtype(shape.dtype)
    q = rng.standard_normal((shape.b, shape.h, 1, shape.d), dtype=cupy.float32).astype(dt)
    kc, vc = (rng.standard_normal((shape.b, DECODE_HK, shape.n, shape.d), dtype=cupy.float32).astype(dt)
              for _ in range(2))  # fmt: skip
    return q, kc, vc, cupy.full((shape.b,), shape.n, dtype=cupy.int32)


def ours(row: Row, q: Any, k: Any, v: Any, do: Any) -> Timed:
    """For the decode row k and v are the caches and ``do`` the cache_seqlens array."""
    import cupy

    import cupyflash as cf

    c = row.shape.causal
    if row.workload == "decode":
        call = lambda: cf.attention_with_kvcache(q, k, v, cache_seqlens=do)  # noqa: E731
    elif row.workload == "linear":
        call = lambda: cf.linear_attention_forward(q, k, v, causal=c)  # noqa: E731
    elif row.pass_ == "fwd":
        call = lambda: cf.attention_forward(q, k, v, c)  # noqa: E731
    else:
        o, lse = cf.attention_forward(q, k, v, c)
        call = lambda: cf.attention_backward(do, q, k, v, o, lse, c)  # noqa: E731
    return Timed(call, cupy.cuda.Device().synchronize, timing.CupyClock())


def sdpa(row: Row, q: Any, k: Any, v: Any, do: Any) -> Timed | None:
    """PyTorch SDPA (its own backend choice, as a user calls it); None for linear attention. For the decode row,
    the dense call that reads the same keys: q against the cache, grouped heads (``enable_gqa``)."""
    if row.workload == "linear":
        return None
    import torch
    import torch.nn.functional as F

    from .device import to_torch

    c = row.shape.causal
    if row.workload == "decode":
        tq, tk, tv = (to_torch(x) for x in (q, k, v))
        return Timed(lambda: F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True), torch.cuda.synchronize,
                     timing.TorchClock(), torch.no_grad)  # fmt: skip
    tq, tk, tv, tdo = (to_torch(x) for x in (q, k, v, do))
    if row.pass_ == "fwd":
        return Timed(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=c), torch.cuda.synchronize,
                     timing.TorchClock(), torch.no_grad)  # fmt: skip
    leaves = [x.detach().requires_grad_() for x in (tq, tk, tv)]
    o = F.scaled_dot_product_attention(*leaves, is_causal=c)  # the graph every timed backward reuses
    return Timed(lambda: torch.autograd.grad(o, leaves, tdo, retain_graph=True), torch.cuda.synchronize,
                 timing.TorchClock())  # fmt: skip


def run_overhead(rows: Sequence[Row], use_sdpa: bool, seed: int, env: dict[str, Any],
                 progress: Callable[[str], None]) -> list[Record]:  # fmt: skip
    """One record per (row, implementation): ``median_ms`` is the wall time per call, ``gpu_ms``
    the GPU time of the same call with the host out of the way (``queued_us``)."""
    records: list[Record] = []
    for r in rows:
        q, k, v, do = (_decode_inputs if r.workload == "decode" else _cupy_inputs)(r.shape, seed)
        impls = [("cupyflash-linear" if r.workload == "linear" else "cupyflash", ours)]
        if use_sdpa:
            impls.append(("sdpa", sdpa))
        for name, make in impls:
            s = r.shape
            base = dict(workload=r.workload, b=s.b, h=s.h, n=s.n, d=s.d, causal=s.causal, dtype=s.dtype,
                        pass_=r.pass_, impl=name, kind="overhead", env=env)  # fmt: skip
            try:
                t = make(r, q, k, v, do)
                if t is None:
                    continue
                wall, host = wall_us(t)
                gpu = queued_us(t, host)
            except Exception as e:  # a refusal or an OOM: report it, keep going
                records.append(Record(status="error", note=f"{type(e).__name__}: {e}"[:200], **base))
                progress(f"overhead {r.label} {name}: error {e}")
                continue
            records.append(Record(status="ok", median_ms=wall * 1e-3, gpu_ms=gpu * 1e-3, host_ms=host * 1e-3, runs=CALLS,
                                  note=f"median of {REPEATS}: wall of {CALLS} back-to-back calls / {CALLS}", **base))  # fmt: skip
            progress(f"overhead {r.label} {name}: {wall:.1f} us/call wall, {host:.1f} us host, {gpu:.1f} us GPU")
    return records


# ---------------------------------------------------------------------------- table


def format_overhead_table(records: Sequence[Record], rows: Sequence[Row]) -> str:
    """Rows: calls; columns: ours and SDPA wall microseconds per call, their host parts (queueing the calls),
    and their GPU times with the host out of the way."""
    by: dict[tuple, dict[str, Record]] = {}
    for rec in records:
        if rec.kind == "overhead":
            key = (rec.workload, rec.pass_, rec.dtype, rec.b, rec.h, rec.n, rec.d, rec.causal)
            by.setdefault(key, {})[rec.impl] = rec

    def cell(rec: Record | None, ms: float | None) -> str:
        if rec is None:
            return "-"
        if rec.status != "ok":
            return rec.status
        return "-" if ms is None else f"{ms * 1e3:.1f}"

    header = ["call", "ours us/call", "SDPA us/call", "ours host us", "SDPA host us", "ours GPU us (queued)",
              "SDPA GPU us (queued)"]  # fmt: skip
    body = []
    for r in rows:
        s = r.shape
        got = by.get((r.workload, r.pass_, s.dtype, s.b, s.h, s.n, s.d, s.causal), {})
        mine = got.get("cupyflash") or got.get("cupyflash-linear")
        theirs = got.get("sdpa")
        body.append([r.label, *(cell(x, x and getattr(x, f)) for f in ("median_ms", "host_ms", "gpu_ms")
                                for x in (mine, theirs))])  # fmt: skip
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt(header), rule, *(fmt(b) for b in body)])
