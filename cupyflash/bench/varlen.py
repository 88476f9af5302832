"""``--suite varlen``: a packed batch of documents against our dense kernel and against padding (issue 14,
"Speed").

Per shape (bf16, causal, 16384 tokens, H*D = 2048, D = 64 and 128) one long-tailed pack of documents
(``LENGTHS``: many of 64-512 tokens, a few of 2k-8k, none a multiple of a tile), forward and backward:

- ``packed``: ``attention_varlen_forward/backward`` on the pack (one launch per pass);
- ``dense same work``: our dense causal call on one sequence of N tokens with as many visible
  (query, key) pairs as the pack (N = sqrt(2 * pairs)): what the pack's work costs without packing;
- ``padded``: every document padded to the longest and one dense causal call (B = documents);
- ``sdpa-nested``: PyTorch's SDPA on jagged nested tensors (FLASH backend), where torch accepts them.

TFLOP/s count only real work, the causal pairs of each document (the same count for every row), so
"vs dense" (packed TFLOP/s over dense-same-work TFLOP/s) is the issue's >= 0.9x, and "padded / packed" and
"sdpa / packed" are times (> 1: packed is faster; the issue asks >= 3x and >= 1.0x).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from . import timing
from .report import Record
from .shapes import Shape
from .variants import RUNS, median_ms

#: The pack: three long documents among short ones, 16384 tokens in all, interleaved as a loader would.
LENGTHS = (509, 8191, 447, 383, 2047, 321, 257, 190, 3073, 129, 64, 515, 258)
IMPLS = ("packed", "dense same work", "padded", "sdpa-nested")


def causal_pairs(lengths: Sequence[int]) -> int:
    """Visible (query, key) pairs of causal attention on each document: n (n + 1) / 2 each."""
    return sum(n * (n + 1) // 2 for n in lengths)


def dense_length(lengths: Sequence[int]) -> int:
    """The one-sequence causal N with (about) the pack's pairs."""
    return round(math.sqrt(2 * causal_pairs(lengths)))


@dataclass(frozen=True)
class Row:
    shape: Shape  # b = 1, n = the pack's total tokens
    pass_: str

    @property
    def label(self) -> str:
        s = self.shape
        return f"varlen {s.dtype} H={s.h} D={s.d} tokens={sum(LENGTHS)} docs={len(LENGTHS)}"

    @property
    def flops(self) -> float:
        """Real work only: 4 * H * D per visible pair forward, 2.5x that backward (as attention_flops)."""
        fwd = 4.0 * self.shape.h * self.shape.d * causal_pairs(LENGTHS)
        return fwd * (2.5 if self.pass_ == "bwd" else 1.0)


def plan_rows(shapes: Sequence[Shape], passes: Sequence[str]) -> list[Row]:
    return [Row(s, p) for s in shapes for p in passes]


def format_plan(rows: Sequence[Row], torch: bool) -> str:
    lines = [f"suite varlen: CUDA events, median of <= {RUNS} runs after warm-up; TFLOP/s of real work (causal "
             f"pairs per document); lengths {list(LENGTHS)}" + ("; SDPA on nested tensors alongside" if torch else "")]
    lines += [f"  {r.label} {r.pass_}: {r.flops / 1e9:.1f} GFLOP" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the calls


def _inputs(shape: Shape, seed: int) -> dict[str, Any]:
    import cupy

    from .device import cupy_dtype

    rng = cupy.random.default_rng(seed)
    dt = cupy_dtype(shape.dtype)
    total = sum(LENGTHS)
    x = {n: rng.standard_normal((total, shape.h, shape.d), dtype=cupy.float32).astype(dt)
         for n in ("q", "k", "v", "do")}  # fmt: skip
    x["cu"] = cupy.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32))
    return x


def _packed(pass_: str, x: dict[str, Any]) -> Callable[[], Any]:
    import cupyflash as cf

    q, k, v, do, cu, m = x["q"], x["k"], x["v"], x["do"], x["cu"], max(LENGTHS)
    if pass_ == "fwd":
        return lambda: cf.attention_varlen_forward(q, k, v, cu, cu, m, m, True)
    o, lse = cf.attention_varlen_forward(q, k, v, cu, cu, m, m, True)
    return lambda: cf.attention_varlen_backward(do, q, k, v, o, lse, cu, cu, m, m, True)


def _dense(pass_: str, shape: Shape, b: int, n: int, seed: int) -> Callable[[], Any]:
    import cupy

    import cupyflash as cf

    from .device import cupy_dtype

    rng = cupy.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((b, shape.h, n, shape.d), dtype=cupy.float32).astype(cupy_dtype(shape.dtype))
                   for _ in range(4))  # fmt: skip
    if pass_ == "fwd":
        return lambda: cf.attention_forward(q, k, v, True)
    o, lse = cf.attention_forward(q, k, v, True)
    return lambda: cf.attention_backward(do, q, k, v, o, lse, True)


def _sdpa_nested(pass_: str, x: dict[str, Any]) -> tuple[Callable[[], Any], Any]:
    """SDPA on jagged nested tensors (B, j, H, D) -> (B, H, j, D), FLASH backend only."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .device import to_torch

    offsets = to_torch(x["cu"]).to(torch.int64)
    nested = [torch.nested.nested_tensor_from_jagged(to_torch(x[n]), offsets).transpose(1, 2) for n in "qkv"]
    do = torch.nested.nested_tensor_from_jagged(to_torch(x["do"]), offsets).transpose(1, 2)
    attend = torch.nn.functional.scaled_dot_product_attention

    @contextlib.contextmanager
    def flash_only(grad: bool = True) -> Any:
        with torch.set_grad_enabled(grad), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            yield

    if pass_ == "fwd":
        return (lambda: attend(*nested, is_causal=True)), (lambda: flash_only(False))
    leaves = [t.detach().requires_grad_() for t in nested]
    with flash_only():
        o = attend(*leaves, is_causal=True)  # the graph every timed backward reuses
    return (lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)), flash_only


# ---------------------------------------------------------------------------- measuring


def run_varlen(rows: Sequence[Row], use_torch: bool, torch_missing: str | None, seed: int, env: dict[str, Any],
               progress: Callable[[str], None],
               done: Callable[[list[Record]], None] = lambda r: None) -> list[Record]:  # fmt: skip
    """Records of kind "varlen", one per (row, implementation)."""
    from .device import free_device_memory

    records: list[Record] = []
    pad_b, pad_n, same_n = len(LENGTHS), max(LENGTHS), dense_length(LENGTHS)
    for r in rows:
        x = _inputs(r.shape, seed)
        makers: dict[str, Callable[[], tuple[Callable[[], Any], Any]]] = {
            "packed": lambda: (_packed(r.pass_, x), contextlib.nullcontext),
            "dense same work": lambda: (_dense(r.pass_, r.shape, 1, same_n, seed), contextlib.nullcontext),
            "padded": lambda: (_dense(r.pass_, r.shape, pad_b, pad_n, seed), contextlib.nullcontext),
        }
        for impl, make in makers.items():
            records.append(_measure(r, impl, make, timing.CupyClock, env, progress))
            free_device_memory()
        if not use_torch or torch_missing is not None:
            why = torch_missing or "no torch comparison asked for (--compare none)"
            records.append(_record(r, "sdpa-nested", env, status="n/a", note=why))
        else:
            records.append(_measure(r, "sdpa-nested", lambda: _sdpa_nested(r.pass_, x), timing.TorchClock, env,
                                    progress))  # fmt: skip
        del x
        free_device_memory()
        done(records)
    return records


def _record(row: Row, impl: str, env: dict[str, Any], **fields: Any) -> Record:
    s = row.shape
    return Record(workload="softmax+varlen", b=len(LENGTHS), h=s.h, n=s.n, d=s.d, causal=True, dtype=s.dtype,
                  pass_=row.pass_, impl=impl, flops=row.flops, kind="varlen", env=env, **fields)  # fmt: skip


def _measure(row: Row, impl: str, make: Callable[[], tuple[Callable[[], Any], Any]],
             clock: Callable[[], timing.Clock], env: dict[str, Any], progress: Callable[[str], None]) -> Record:
    try:
        call, context = make()
        ms, runs = median_ms(call, clock(), context)
    except Exception as e:  # a refusal or an OOM: report it, keep going
        note = f"{type(e).__name__}: {e}"[:200]
        progress(f"{row.label} {row.pass_} {impl}: error {note}")
        return _record(row, impl, env, status="error", note=note)
    tf = timing.tflops(row.flops, ms)
    progress(f"{row.label} {row.pass_} {impl}: {ms:.3f} ms, {tf:.1f} TFLOP/s of real work ({runs} runs)")
    return _record(row, impl, env, status="ok", median_ms=ms, tflops=tf, runs=runs)


# ---------------------------------------------------------------------------- table


def format_varlen_table(records: Sequence[Record]) -> str:
    """Per (D, pass): each implementation's ms and TFLOP/s of real work, packed over dense-same-work in
    TFLOP/s, and padded's and SDPA's time over packed's."""
    by: dict[tuple, dict[str, Record]] = {}
    for rec in records:
        if rec.kind == "varlen":
            by.setdefault((rec.dtype, rec.h, rec.d, rec.pass_), {})[rec.impl] = rec

    def ok(cell: dict[str, Record], impl: str) -> Record | None:
        rec = cell.get(impl)
        return rec if rec is not None and rec.status == "ok" else None

    header = ["row", "pass", *(f"{i} ms" for i in IMPLS), "packed TFLOP/s", "vs dense", "padded/packed",
              "sdpa/packed"]  # fmt: skip
    body = []
    for (dtype, h, d, pass_), cell in by.items():
        mine = ok(cell, "packed")
        dense, pad, sdpa = ok(cell, "dense same work"), ok(cell, "padded"), ok(cell, "sdpa-nested")
        times = [("-" if i not in cell else cell[i].status if cell[i].status != "ok" else f"{cell[i].median_ms:.3f}")
                 for i in IMPLS]  # fmt: skip
        body.append([f"{dtype} H={h} D={d}", pass_, *times, f"{mine.tflops:.1f}" if mine else "-",
                     f"{mine.tflops / dense.tflops:.2f}x" if mine and dense else "-",
                     f"{pad.median_ms / mine.median_ms:.2f}x" if mine and pad else "-",
                     f"{sdpa.median_ms / mine.median_ms:.2f}x" if mine and sdpa else "-"])  # fmt: skip
    notes = [f"- dense same work: one causal sequence of N = {dense_length(LENGTHS)} (the pack's "
             f"{causal_pairs(LENGTHS)} pairs per head); padded: B = {len(LENGTHS)} x N = {max(LENGTHS)}"]
    seen = {(rec.impl, rec.status, rec.note) for rec in records if rec.kind == "varlen" and rec.status != "ok"}
    notes += [f"- {impl} {status}: {note}" for impl, status, note in sorted(seen)]
    widths = [max(len(hd), *(len(b[i]) for b in body)) if body else len(hd) for i, hd in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) if i < 2 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"  # fmt: skip

    rule = "|" + "|".join("-" * (w + 2) if i < 2 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt(header), rule, *(fmt(b) for b in body), "", *notes])
