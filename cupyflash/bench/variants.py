"""``--suite variants``: window, softcap, ALiBi and sinks against our plain call and FlexAttention
(issue 13, "Speed").

Per grid shape (bf16, B*N = 16384, H*D = 2048) the cases below, forward and backward, timed by CUDA
events (median of many after warm-up). TFLOP/s count only the (query, key) pairs a case can see
(``visible_pairs``), so "vs plain" (ours over our plain call of the same causality) tells whether a
variant keeps its speed per unit of work (the issue asks >= 0.9x), and the notes under the table give
how much faster the window is in time than full attention (the issue: about 16x at N = 16k). Flex runs
in the same process on the same memory (DLPack), compiled afresh per case; sinks are "n/a" there
(a sink logit in the denominator needs extra tensors Flex does not take).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Callable, ContextManager, Sequence

import numpy as np

from ..variants import Variant
from . import timing
from .report import Record
from .shapes import Shape

WINDOW = 1024
SOFTCAP = 50.0
# Calls take 0.2-20 ms; 50 timed runs (at least 10) within ~1 s keep the median steady.
WARMUP, RUNS, MIN_RUNS, MAX_SECONDS = 5, 50, 10, 1.0


@dataclass(frozen=True)
class Case:
    """One variant call: FlashAttention's keywords, and whether Flex can express it."""

    key: str  # short name used in JSON records (workload "softmax+<key>")
    name: str
    causal: bool
    window_size: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    flex: bool = True

    @property
    def variant(self) -> Variant:
        return Variant.of(self.causal, self.window_size, self.softcap, self.alibi, self.sinks)


CASES = (
    Case("plain", "plain", False),
    Case("causal", "plain causal", True),
    Case(f"window{WINDOW}", f"window {WINDOW} causal", True, window_size=(WINDOW, 0)),
    Case(f"softcap{SOFTCAP:g}", f"softcap {SOFTCAP:g}", False, softcap=SOFTCAP),
    Case("alibi", "alibi causal", True, alibi=True),
    Case("sinks", "sinks causal", True, sinks=True, flex=False),
)
PLAIN = {False: CASES[0], True: CASES[1]}  # the call each case is compared with


def visible_pairs(variant: Variant, nq: int, nk: int) -> int:
    """Exactly how many (query, key) pairs ``variant`` scores: the sum over query rows i of the
    length of ``variant.keys_of(i, i + 1, nq, nk)``, all rows at once."""
    left, right = variant._bounds(nq, nk)  # the clamped bounds keys_of uses
    i = np.arange(nq, dtype=np.int64)
    begin = np.maximum(0, i + (nk - nq) - left)
    end = np.maximum(0, np.minimum(nk, i + (nk - nq) + right + 1))
    return int(np.maximum(0, end - begin).sum())


@dataclass(frozen=True)
class Row:
    case: Case
    shape: Shape
    pass_: str  # "fwd" or "bwd"

    @property
    def label(self) -> str:
        s = self.shape
        return f"{self.case.name} {s.dtype} B={s.b} H={s.h} N={s.n} D={s.d}"

    @property
    def flops(self) -> float:
        """Forward 4*B*H*D per visible pair (two matmuls); backward 2.5x (as attention_flops)."""
        s = self.shape
        fwd = 4.0 * s.b * s.h * s.d * visible_pairs(self.case.variant, s.n, s.n)
        return fwd * (2.5 if self.pass_ == "bwd" else 1.0)

    def key(self) -> tuple:
        s = self.shape
        return (self.case.key, self.pass_, s.dtype, s.b, s.h, s.n, s.d)


def plan_rows(shapes: Sequence[Shape], passes: Sequence[str]) -> list[Row]:
    """Per shape, the cases of its causality (so --causal filters cases), each pass."""
    return [Row(c, s, p) for s in shapes for c in CASES if c.causal == s.causal for p in passes]


def format_plan(rows: Sequence[Row], flex: bool) -> str:
    lines = [f"suite variants: CUDA events, median of <= {RUNS} runs after warm-up; TFLOP/s of visible pairs"
             + ("; FlexAttention alongside" if flex else "")]  # fmt: skip
    lines += [f"  {r.label} {r.pass_}: {r.flops / 1e9:.1f} GFLOP" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- measuring


def median_ms(call: Callable[[], Any], clock: timing.Clock,
              context: Callable[[], ContextManager[Any]]) -> tuple[float, int]:  # fmt: skip
    """Median CUDA-event time of ``call`` and the number of timed runs. One set of inputs is enough:
    q, k, v, o of these shapes are 64 MiB each, past L2 together."""
    with context():
        t = timing.measure(lambda i: call(), clock, warmup=WARMUP, runs=RUNS, min_runs=MIN_RUNS,
                           max_seconds=MAX_SECONDS)  # fmt: skip
    return t.median_ms, t.runs


def inputs(shape: Shape, seed: int) -> dict[str, Any]:
    import cupy

    from .paired import attention_inputs

    rng, x = attention_inputs(shape, seed)
    h = np.arange(1, shape.h + 1)
    x["slopes"] = cupy.asarray(2.0 ** (-8.0 * h / shape.h), dtype=cupy.float32)  # ALiBi's geometric slopes
    x["sinks"] = rng.standard_normal(shape.h, dtype=cupy.float32)
    return x


def ours(case: Case, pass_: str, x: dict[str, Any]) -> Callable[[], Any]:
    import cupyflash as cf

    q, k, v, do, c = x["q"], x["k"], x["v"], x["do"], case.causal
    kw = dict(window_size=case.window_size, softcap=case.softcap, kernel="auto",
              alibi_slopes=x["slopes"] if case.alibi else None, sinks=x["sinks"] if case.sinks else None)  # fmt: skip
    if pass_ == "fwd":
        return lambda: cf.attention_forward(q, k, v, c, **kw)
    o, lse = cf.attention_forward(q, k, v, c, **kw)
    return lambda: cf.attention_backward(do, q, k, v, o, lse, c, **kw)  # 4 arrays with sinks


def flex(case: Case, shape: Shape, x: dict[str, Any], passes: set[str]) -> dict[str, tuple[Callable[[], Any], Any]]:
    """Flex's forward (under no_grad) and backward (autograd.grad on one kept graph) of ``case``."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from .device import to_torch

    # A fresh Dynamo per case: every case's closures recompile flex, and past Dynamo's recompile
    # limit it would silently fall back to eager (materialised scores) for the later rows.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention)
    tq, tk, tv, tdo, slopes = (to_torch(x[n]) for n in ("q", "k", "v", "do", "slopes"))
    cap, left = case.softcap, (case.window_size or (0, 0))[0]
    score_mod = None
    if cap > 0:
        score_mod = lambda s, b, h, qi, ki: cap * torch.tanh(s / cap)  # noqa: E731  (s is already scaled)
    elif case.alibi:
        score_mod = lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).abs()  # noqa: E731
    mask_mod = None  # bottom-right aligned with Nq = Nk: the diagonal is qi == ki
    if case.window_size is not None:
        mask_mod = lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= left)  # noqa: E731
    elif case.causal:
        mask_mod = lambda b, h, qi, ki: ki <= qi  # noqa: E731
    # B = H = None: the mask is the same for every batch and head, and create_block_mask materialises a
    # dense (B, H, N, N) mask first (8 GiB at N = 16k with H = 32 otherwise).
    n = shape.n
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, None, n, n, device="cuda")

    def call(*qkv: Any) -> Any:
        return compiled(*qkv, score_mod=score_mod, block_mask=block_mask)

    calls: dict[str, tuple[Callable[[], Any], Any]] = {"fwd": (lambda: call(tq, tk, tv), torch.no_grad)}
    if "bwd" in passes:
        leaves = [t.detach().requires_grad_() for t in (tq, tk, tv)]
        o = call(*leaves)  # the graph every timed backward reuses
        calls["bwd"] = (lambda: torch.autograd.grad(o, leaves, tdo, retain_graph=True), contextlib.nullcontext)
    return calls


def run_variants(rows: Sequence[Row], use_flex: bool, flex_missing: str | None, seed: int, env: dict[str, Any],
                 progress: Callable[[str], None],
                 done: Callable[[list[Record]], None] = lambda r: None) -> list[Record]:  # fmt: skip
    """Records of kind "variants", one per (row, implementation). With ``use_flex``, Flex runs beside
    ours, or its cells say n/a with ``flex_missing`` as the reason. ``done`` sees the records after
    every shape (so a run cut short still leaves its JSON)."""
    from .device import free_device_memory

    records: list[Record] = []
    for shape, by_shape in groupby(rows, key=lambda r: r.shape):
        x = inputs(shape, seed)
        for case, by_case in groupby(by_shape, key=lambda r: r.case):
            todo = list(by_case)
            for r in todo:
                make = lambda p=r.pass_, c=case: (ours(c, p, x), contextlib.nullcontext)  # noqa: E731
                records.append(_measure(r, "cupyflash", make, timing.CupyClock, env, progress))
            if use_flex:
                records += _flex_records(todo, x, flex_missing, env, progress)
        del x
        free_device_memory()
        done(records)
    return records


def _flex_records(todo: Sequence[Row], x: dict[str, Any], missing: str | None, env: dict[str, Any],
                  progress: Callable[[str], None]) -> list[Record]:  # fmt: skip
    """Flex for every pass of one case: compiled once, n/a where it cannot run the case."""
    case, shape = todo[0].case, todo[0].shape
    why = missing or (None if case.flex else "Flex cannot add a sink logit to the softmax denominator")
    if why is not None:
        return [_record(r, "flex", env, status="n/a", note=why) for r in todo]
    try:
        calls = flex(case, shape, x, {r.pass_ for r in todo})
    except Exception as e:  # a compile failure: every pass of this case reports it
        note = f"{type(e).__name__}: {e}"[:200]
        progress(f"variants {case.name} {shape.label} flex: error {note}")
        return [_record(r, "flex", env, status="error", note=note) for r in todo]
    return [_measure(r, "flex", lambda p=r.pass_: calls[p], _torch_clock, env, progress) for r in todo]


def _torch_clock() -> timing.Clock:
    return timing.TorchClock()


def _record(row: Row, impl: str, env: dict[str, Any], **fields: Any) -> Record:
    s, c = row.shape, row.case
    return Record(workload=f"softmax+{c.key}", b=s.b, h=s.h, n=s.n, d=s.d, causal=c.causal, dtype=s.dtype,
                  pass_=row.pass_, impl=impl, flops=row.flops, kind="variants", env=env, **fields)  # fmt: skip


def _measure(row: Row, impl: str, make: Callable[[], tuple[Callable[[], Any], Any]], clock: Callable[[], timing.Clock],
             env: dict[str, Any], progress: Callable[[str], None]) -> Record:  # fmt: skip
    try:
        call, context = make()
        ms, runs = median_ms(call, clock(), context)
    except Exception as e:  # a refusal or an OOM: report it, keep going
        note = f"{type(e).__name__}: {e}"[:200]
        progress(f"variants {row.label} {row.pass_} {impl}: error {note}")
        return _record(row, impl, env, status="error", note=note)
    tf = timing.tflops(row.flops, ms)
    progress(f"variants {row.label} {row.pass_} {impl}: {ms:.3f} ms, {tf:.1f} TFLOP/s ({runs} runs)")
    return _record(row, impl, env, status="ok", median_ms=ms, tflops=tf, runs=runs)


# ---------------------------------------------------------------------------- table


def format_variants_table(records: Sequence[Record], rows: Sequence[Row]) -> str:
    """Rows: (case, shape, pass); ours ms and TFLOP/s, ours over our plain call in TFLOP/s, Flex ms and
    Flex time over ours (> 1: we are faster). Notes under it: the window's speedup in time."""
    by: dict[tuple, dict[str, Record]] = {}
    for rec in records:
        if rec.kind == "variants":
            by.setdefault((rec.workload.split("+", 1)[-1], rec.pass_, rec.dtype, rec.b, rec.h, rec.n, rec.d),
                          {})[rec.impl] = rec  # fmt: skip

    def ok(key: tuple, impl: str) -> Record | None:
        rec = by.get(key, {}).get(impl)
        return rec if rec is not None and rec.status == "ok" else None

    def cell(key: tuple, impl: str) -> str:
        rec = by.get(key, {}).get(impl)
        return "-" if rec is None else rec.status if rec.status != "ok" else f"{rec.median_ms:.3f}"

    header = ["row", "pass", "ours ms", "ours TFLOP/s", "vs plain", "Flex ms", "Flex/ours time"]
    body, notes = [], []
    for r in rows:
        key = r.key()
        plain_key = (PLAIN[r.case.causal].key, *key[1:])
        mine, plain, theirs = ok(key, "cupyflash"), ok(plain_key, "cupyflash"), ok(key, "flex")
        body.append([r.label, r.pass_, cell(key, "cupyflash"), f"{mine.tflops:.1f}" if mine else "-",
                     f"{mine.tflops / plain.tflops:.2f}x" if mine and plain else "-", cell(key, "flex"),
                     f"{theirs.median_ms / mine.median_ms:.2f}x" if mine and theirs else "-"])  # fmt: skip
        if r.case.window_size is not None and mine:
            plains = {c: ok((PLAIN[c].key, *key[1:]), "cupyflash") for c in (True, False)}
            notes.append(_window_note(r, mine, plains))
    seen = {(rec.impl, rec.status, rec.note) for rec in records if rec.kind == "variants" and rec.status != "ok"}
    notes += [f"- {impl} {status}: {note}" for impl, status, note in sorted(seen)]  # why cells are n/a or errors
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"  # fmt: skip

    rule = "|" + "|".join("-" * (w + 2) if i < 2 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt(header), rule, *(fmt(b) for b in body)] + ([""] + notes if notes else []))


def _window_note(row: Row, mine: Record, plain: dict[bool, Record | None]) -> str:
    """Time of plain causal and plain full over the window's, beside the ratio of visible areas (what a
    kernel that skips every invisible tile approaches)."""
    n, area = row.shape.n, visible_pairs(row.case.variant, row.shape.n, row.shape.n)
    parts = []
    for causal, what in ((True, "plain causal"), (False, "plain full")):
        p = plain[causal]
        ideal = visible_pairs(PLAIN[causal].variant, n, n) / area
        got = f"{p.median_ms / mine.median_ms:.1f}x" if p else "-"
        parts.append(f"{got} faster than {what} (visible-area ratio {ideal:.1f}x)")
    return f"- {row.label} {row.pass_}: " + ", ".join(parts)
