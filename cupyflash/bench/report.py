"""What a run reports: ``Record`` (one measurement or memory check), the JSON records, the
Markdown table, the notes under it, and the TFLOP/s plot (pure Python, tested on the CPU)."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from .shapes import Shape

# ---------------------------------------------------------------------------- records


@dataclass
class Record:
    """One measurement (kind "timing"), one memory check (kind "memory") or one host-overhead
    measurement (kind "overhead": ``median_ms`` wall time per call, ``host_ms`` the host's part, ``gpu_ms``
    the GPU's)."""

    workload: str
    b: int
    h: int
    n: int
    d: int
    causal: bool
    dtype: str
    pass_: str
    impl: str
    status: str  # "ok", "n/a" (refused or skipped, see note) or "error"
    median_ms: float | None = None
    tflops: float | None = None
    flops: float | None = None
    runs: int = 0
    sets: int = 0
    flushed: bool = False
    note: str = ""
    kind: str = "timing"
    peak_bytes: int | None = None  # memory records
    gpu_ms: float | None = None  # overhead records: GPU time of the call, queued behind a spin (median_ms is wall)
    host_ms: float | None = None  # overhead records: host time of the call (queueing it, no waiting on the GPU)
    env: dict[str, Any] = field(default_factory=dict)  # device, versions, date

    @property
    def shape(self) -> Shape:
        return Shape(self.b, self.h, self.n, self.d, self.causal, self.dtype)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["pass"] = out.pop("pass_")
        env = out.pop("env")
        for key in ENV_KEYS:  # flat records: device, versions and date on every line
            out[key] = env.get(key)
        return out


#: What ``environment()`` says about the run, copied into every record.
ENV_KEYS = ("device", "compute_capability", "versions", "date")

#: Keys every JSON record has (tests check the schema against this).
JSON_KEYS = (
    "kind", "workload", "b", "h", "n", "d", "causal", "dtype", "pass", "impl", "status",
    "median_ms", "tflops", "flops", "runs", "sets", "flushed", "note", "peak_bytes", "gpu_ms", "host_ms",
    *ENV_KEYS,
)  # fmt: skip


def records_to_json(records: Sequence[Record]) -> str:
    return json.dumps([r.to_json() for r in records], indent=1, sort_keys=True)


def write_json(records: Sequence[Record], path: str) -> None:
    with open(path, "w") as f:
        f.write(records_to_json(records) + "\n")


# ---------------------------------------------------------------------------- table


def _fmt_ratio(primary: float | None, other: float | None) -> str:
    if not primary or not other:
        return "-"
    return f"{primary / other:.2f}x"


def format_table(records: Sequence[Record], impls: Sequence[str], primary: str) -> str:
    """A Markdown table: one row per (workload, shape, pass); ``primary`` gives ms and
    TFLOP/s, every other implementation its TFLOP/s and the ratio primary/it."""
    timing = [r for r in records if r.kind == "timing"]
    rows: dict[tuple, dict[str, Record]] = {}
    for r in timing:
        rows.setdefault((r.workload, r.dtype, r.b, r.h, r.n, r.d, r.causal, r.pass_), {})[r.impl] = r
    others = [i for i in impls if i != primary]
    header = ["B", "H", "N", "D", "causal", "dtype", "pass", f"{primary} ms", f"{primary} TFLOP/s"]
    for o in others:
        header += [f"{o} TFLOP/s", f"vs {o}"]
    body = []
    for (_, dtype, b, h, n, d, causal, pass_), by_impl in rows.items():
        p = by_impl.get(primary)
        ok_p = p is not None and p.status == "ok"
        line = [str(b), str(h), str(n), str(d), "yes" if causal else "no", dtype, pass_]
        line += [f"{p.median_ms:.3f}", f"{p.tflops:.1f}"] if ok_p else [_status(p), _status(p)]
        for o in others:
            r = by_impl.get(o)
            if r is not None and r.status == "ok":
                line += [f"{r.tflops:.1f}", _fmt_ratio(p.tflops if ok_p else None, r.tflops)]
            else:
                line += [_status(r), "-"]
        body.append(line)
    widths = [max(len(h_), *(len(row[i]) for row in body)) if body else len(h_) for i, h_ in enumerate(header)]

    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"

    lines = [fmt(header), "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += [fmt(row) for row in body]
    return "\n".join(lines)


def _status(r: Record | None) -> str:
    if r is None:
        return "-"
    return "error" if r.status == "error" else "n/a"


def format_notes(records: Sequence[Record]) -> str:
    """Why cells are n/a or errors (one line per distinct reason) and the memory checks."""
    lines: list[str] = []
    seen: set[tuple[str, str]] = set()
    for r in records:
        if r.kind == "timing" and r.status != "ok" and (r.impl, r.note) not in seen:
            seen.add((r.impl, r.note))
            lines.append(f"- {r.impl} {r.status} ({r.shape.label}, {r.pass_}): {r.note}")
    for r in records:
        if r.kind == "memory":
            lines.append(f"- memory {r.shape.label}, {r.impl} forward + backward: {r.note}")
    return "\n".join(lines)


def plot_series(records: Sequence[Record]) -> dict[tuple, dict[str, list[tuple[int, float]]]]:
    """TFLOP/s against N, per (workload, dtype, D, causal, pass) and implementation."""
    out: dict[tuple, dict[str, list[tuple[int, float]]]] = {}
    for r in records:
        if r.kind != "timing" or r.status != "ok" or r.tflops is None:
            continue
        key = (r.workload, r.dtype, r.d, r.causal, r.pass_)
        out.setdefault(key, {}).setdefault(r.impl, []).append((r.n, r.tflops))
    for series in out.values():
        for pts in series.values():
            pts.sort()
    return out


def plot(records: Sequence[Record], path: str) -> None:
    """One panel per (workload, dtype, D, causal, pass), one line per implementation."""
    plt = _pyplot()
    series = plot_series(records)
    if not series:
        raise RuntimeError("nothing to plot: no successful timings")
    ncols = min(4, len(series))
    nrows = math.ceil(len(series) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    order = {"fwd": 0, "bwd": 1, "fwd+bwd": 2}
    # One colour per implementation across every panel, so lines read the same everywhere.
    impls = sorted({impl for by_impl in series.values() for impl in by_impl})
    colour = {impl: f"C{i % 10}" for i, impl in enumerate(impls)}
    panels = sorted(series.items(), key=lambda kv: (*kv[0][:4], order.get(kv[0][4], 9)))
    for ax, (key, by_impl) in zip(axes.flat, panels):
        workload, dtype, d, causal, pass_ = key
        for impl, pts in by_impl.items():
            ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", label=impl, color=colour[impl])
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_title(f"{workload} {dtype} D={d} {'causal' if causal else 'full'} {pass_}", fontsize=9)
        ax.set_xlabel("N")
        ax.set_ylabel("TFLOP/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--plot needs matplotlib ({e}); install it with `pip install matplotlib`") from e
    return plt
