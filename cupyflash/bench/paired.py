"""What the dropout and masks suites share: a ``Row`` (one call shape and pass) measured by several
implementations, the first of which (the "base") the others are compared with in time; the measuring loop
(CUDA events, median, same process, one input set per shape as in bench/variants.py); and the table.

Every comparison column is ``time of X / time of the base``: above 1 the base is faster. With equal FLOP
counts this is also the base's TFLOP/s over X's (the ratio the issues' speed targets are stated in).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Callable, ContextManager, Iterator, Sequence

from . import timing
from .impls import Unavailable
from .report import Record
from .shapes import Shape, attention_flops

# Calls take 0.3-60 ms; 50 timed runs (at least 10) within ~1 s keep the median steady (as bench/variants.py).
WARMUP, RUNS, MIN_RUNS, MAX_SECONDS = 5, 50, 10, 1.0

#: An implementation's call, made ready: the timed call, the context it runs in, the clock that times it.
Ready = tuple[Callable[[], Any], Callable[[], ContextManager[Any]], Callable[[], timing.Clock]]


@dataclass(frozen=True)
class Row:
    kind: str  # the suite: record kind "dropout" or "masks"
    case: str  # what is measured, e.g. "deterministic[mma]", "dropout0.1", "bias_grad"; workload "softmax+<case>"
    shape: Shape
    pass_: str  # "bwd", "fwd" or "fwd+bwd"
    impls: tuple[str, ...]  # the base first
    kernel: str = "auto"  # our kernel= option

    @property
    def label(self) -> str:
        s = self.shape
        return f"{self.case} {s.dtype} B={s.b} H={s.h} N={s.n} D={s.d} {'causal' if s.causal else 'full'}"

    @property
    def flops(self) -> float:
        s = self.shape
        return attention_flops(s.b, s.h, s.n, s.n, s.d, s.causal, self.pass_)

    def key(self) -> tuple:
        s = self.shape
        return (f"softmax+{self.case}", self.pass_, s.dtype, s.b, s.h, s.n, s.d, s.causal)


def format_plan(title: str, rows: Sequence[Row]) -> str:
    lines = [f"{title}: CUDA events, median of <= {RUNS} runs after warm-up; columns: time of each / the first"]
    lines += [f"  {r.label} {r.pass_}: {r.flops / 1e9:.1f} GFLOP; {', '.join(r.impls)}" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- measuring


def record(row: Row, impl: str, env: dict[str, Any], **fields: Any) -> Record:
    s = row.shape
    return Record(workload=f"softmax+{row.case}", b=s.b, h=s.h, n=s.n, d=s.d, causal=s.causal, dtype=s.dtype,
                  pass_=row.pass_, impl=impl, flops=row.flops, kind=row.kind, env=env, **fields)  # fmt: skip


def median_ms(ready: Ready) -> tuple[float, int]:
    call, context, clock = ready
    with context():
        t = timing.measure(lambda i: call(), clock(), warmup=WARMUP, runs=RUNS, min_runs=MIN_RUNS,
                           max_seconds=MAX_SECONDS)  # fmt: skip
    return t.median_ms, t.runs


def measure(row: Row, impl: str, make: Callable[[], Ready], env: dict[str, Any],
            progress: Callable[[str], None]) -> Record:  # fmt: skip
    """One record: "ok" with the median, "n/a" where the implementation refuses the call (``Unavailable``, see
    ``refused``), "error" for anything else (an OOM): the run goes on."""
    try:
        ms, runs = median_ms(make())
    except Unavailable as e:
        note = f"{type(e).__name__}: {e}"[:200]
        progress(f"{row.kind} {row.label} {row.pass_} {impl}: n/a {note}")
        return record(row, impl, env, status="n/a", note=note)
    except Exception as e:
        note = f"{type(e).__name__}: {e}"[:200]
        progress(f"{row.kind} {row.label} {row.pass_} {impl}: error {note}")
        return record(row, impl, env, status="error", note=note)
    tf = timing.tflops(row.flops, ms)
    progress(f"{row.kind} {row.label} {row.pass_} {impl}: {ms:.3f} ms, {tf:.1f} TFLOP/s ({runs} runs)")
    return record(row, impl, env, status="ok", median_ms=ms, tflops=tf, runs=runs)


@contextlib.contextmanager
def refused() -> Iterator[None]:
    """Around a first call with ``kernel=``: the family's refusal (the API's ``TypeError`` naming why it cannot
    run the call, e.g. wgmma off Hopper) becomes ``Unavailable``, an "n/a" cell. Only there: a TypeError
    anywhere else is a bug and reads "error"."""
    try:
        yield
    except TypeError as e:
        raise Unavailable(str(e)) from e


def run_rows(rows: Sequence[Row], inputs: Callable[[Shape, int], dict[str, Any]],
             make: Callable[[Row, str, dict[str, Any]], Ready], seed: int, env: dict[str, Any],
             progress: Callable[[str], None],
             done: Callable[[list[Record]], None] = lambda r: None) -> list[Record]:  # fmt: skip
    """One record per (row, implementation); inputs made once per shape (rows of a shape are adjacent in the
    plans); ``done`` sees the records after every shape, so a run cut short still leaves its JSON."""
    from .device import free_device_memory

    records: list[Record] = []
    for shape, by_shape in groupby(rows, key=lambda r: r.shape):
        x = inputs(shape, seed)
        for r in by_shape:
            for impl in r.impls:
                records.append(measure(r, impl, lambda r=r, impl=impl, x=x: make(r, impl, x), env, progress))
        del x
        free_device_memory()
        done(records)
    return records


def no_context() -> ContextManager[Any]:
    return contextlib.nullcontext()


def cupy_clock() -> timing.Clock:
    return timing.CupyClock()


def torch_clock() -> timing.Clock:
    return timing.TorchClock()


# ---------------------------------------------------------------------------- table


def format_table(records: Sequence[Record], rows: Sequence[Row], names: dict[str, str] | None = None) -> str:
    """Per row: the base's ms and TFLOP/s, then per other implementation its ms and its time over the base's
    ("-" where a row does not have it). ``names`` shortens implementation names in the header. Under the
    table, why cells are n/a or errors."""
    names = names or {}
    by: dict[tuple, Record] = {(*(r.workload, r.pass_, r.dtype, r.b, r.h, r.n, r.d, r.causal), r.impl): r
                               for r in records}  # fmt: skip
    others: list[str] = []
    for r in rows:
        others += [i for i in r.impls[1:] if i not in others]

    def ok(key: tuple, impl: str) -> Record | None:
        rec = by.get((*key, impl))
        return rec if rec is not None and rec.status == "ok" else None

    def ms(key: tuple, impl: str) -> str:
        rec = by.get((*key, impl))
        return "-" if rec is None else rec.status if rec.status != "ok" else f"{rec.median_ms:.3f}"

    header = ["row", "pass", "ms", "TFLOP/s"]
    for i in others:
        header += [f"{names.get(i, i)} ms", f"{names.get(i, i)}/base"]
    body = []
    for r in rows:
        key, base_name = r.key(), r.impls[0]
        base = ok(key, base_name)
        cells = [f"{r.label} [{names.get(base_name, base_name)}]", r.pass_, ms(key, base_name),
                 f"{base.tflops:.1f}" if base else "-"]  # fmt: skip
        for i in others:
            other = ok(key, i) if i in r.impls else None
            cells += [ms(key, i) if i in r.impls else "-",
                      f"{other.median_ms / base.median_ms:.2f}x" if base and other else "-"]  # fmt: skip
        body.append(cells)
    seen = {(rec.impl, rec.status, rec.note) for rec in records if rec.status != "ok"}
    notes = [f"- {impl} {status}: {note}" for impl, status, note in sorted(seen)]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"  # fmt: skip

    rule = "|" + "|".join("-" * (w + 2) if i < 2 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt(header), rule, *(fmt(b) for b in body)] + ([""] + notes if notes else []))


def attention_inputs(shape: Shape, seed: int) -> tuple[Any, dict[str, Any]]:
    """Fresh random q, k, v and do of (B, H, N, D) in the shape's dtype, and the CuPy generator that made
    them (for a suite's own extra inputs)."""
    import cupy

    from .device import cupy_dtype

    rng = cupy.random.default_rng(seed)
    dims, dt = (shape.b, shape.h, shape.n, shape.d), cupy_dtype(shape.dtype)
    return rng, {n: rng.standard_normal(dims, dtype=cupy.float32).astype(dt) for n in ("q", "k", "v", "do")}
