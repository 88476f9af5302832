"""``python -m cupyflash.bench``: cupyflash against naive CuPy and PyTorch SDPA (DESIGN.md §5).

Per shape and pass, every implementation runs on the same random inputs (shared with torch
by DLPack), timed with CUDA events (``cupyflash._timing``); the table reports TFLOP/s and
the ratio of cupyflash to each comparison. A benchmark family is a ``Workload`` (its shapes,
FLOP count, passes and implementations): ``softmax`` attention is the main one, ``linear``
attention a second one, and another family is one more entry in ``WORKLOADS``.

Everything above the "GPU side" line is pure Python and tested on the CPU
(``tests/test_bench_cli.py``); ``--help`` and ``--list`` need no GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import platform
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Sequence

from . import _timing

# ---------------------------------------------------------------------------- shapes

DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}

# The grid of the FlashAttention papers: a fixed token count and model width.
GRID_TOKENS = 16384  # B * N
GRID_HIDDEN = 2048  # H * D
GRID_NS = (512, 1024, 2048, 4096, 8192, 16384)
GRID_DS = (64, 128)
GRID_DTYPES = ("bfloat16", "float16")

#: Peak memory of forward + backward must stay under this many q-sized tensors (O(N)).
MEMORY_FACTOR = 16


@dataclass(frozen=True)
class Shape:
    """One benchmarked problem: q, k, v are (b, h, n, d) in ``dtype``; Nq == Nk == n."""

    b: int
    h: int
    n: int
    d: int
    causal: bool
    dtype: str
    check_memory: bool = False  # also measure peak memory of forward + backward (long suite)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one (b, h, n, d) tensor."""
        return self.b * self.h * self.n * self.d * self.itemsize

    @property
    def label(self) -> str:
        return f"{self.dtype} B={self.b} H={self.h} N={self.n} D={self.d} {'causal' if self.causal else 'full'}"


def grid_shapes() -> list[Shape]:
    return [
        Shape(GRID_TOKENS // n, GRID_HIDDEN // d, n, d, causal, dtype)
        for dtype in GRID_DTYPES
        for d in GRID_DS
        for causal in (False, True)
        for n in GRID_NS
    ]


def fp32_shapes() -> list[Shape]:
    # Two wide shapes, then the llm.c FP32 attention shapes (GPT-2 124M: 12 heads of 64).
    wide = [Shape(4, 16, 4096, 128, causal, "float32") for causal in (False, True)]
    llmc = [Shape(4, 12, n, 64, True, "float32") for n in (1024, 2048, 4096)]
    return wide + llmc


def long_shapes() -> list[Shape]:
    return [Shape(1, 8, 131072, 128, True, "bfloat16", check_memory=True)]


def quick_shapes() -> list[Shape]:
    return [
        Shape(2, 4, 256, 64, False, "float16"),
        Shape(2, 4, 1000, 128, True, "bfloat16"),
        Shape(1, 2, 777, 64, True, "float32"),
        Shape(4, 8, 1024, 128, False, "bfloat16"),
    ]


def linear_shapes() -> list[Shape]:
    return [Shape(4, 16, 8192, d, True, dt) for dt in GRID_DTYPES for d in GRID_DS] + [
        Shape(1, 16, 32768, 64, True, dt) for dt in GRID_DTYPES
    ]


def linear_quick_shapes() -> list[Shape]:
    return [Shape(2, 4, 1024, 64, True, "bfloat16"), Shape(1, 2, 777, 64, True, "float32")]


# ---------------------------------------------------------------------------- FLOPs


def attention_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool, pass_: str) -> float:
    """Softmax attention FLOPs as in the FlashAttention papers: forward 4*B*H*Nq*Nk*D (two
    matmuls), halved for causal when Nq == Nk; backward 2.5x forward (five matmuls, the
    recomputed S counted as half)."""
    fwd = 4.0 * b * h * nq * nk * d
    if causal:
        if nq == nk:
            fwd /= 2
        else:  # bottom-right aligned mask: row i sees min(nk, max(0, i + nk - nq + 1)) keys
            visible = sum(min(nk, max(0, i + nk - nq + 1)) for i in range(nq))
            fwd *= visible / (nq * nk)
    factor = {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}
    if pass_ not in factor:
        raise ValueError(f"pass must be one of {tuple(factor)}; got {pass_!r}")
    return fwd * factor[pass_]


def linear_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool, pass_: str) -> float:
    """Effective FLOPs of masked-matmul linear attention ``((q k^T) * M) v``: forward as the
    softmax count; backward four matmuls (dA = dO V^T, dQ, dK, dV), i.e. 2x forward."""
    fwd = attention_flops(b, h, nq, nk, d, causal, "fwd")
    factor = {"fwd": 1.0, "bwd": 2.0, "fwd+bwd": 3.0}
    if pass_ not in factor:
        raise ValueError(f"pass must be one of {tuple(factor)}; got {pass_!r}")
    return fwd * factor[pass_]


# ---------------------------------------------------------------------------- memory arithmetic


def naive_scores_bytes(shape: Shape) -> int:
    """Bytes of the full (B, H, N, N) score matrix in the input dtype."""
    return shape.b * shape.h * shape.n * shape.n * shape.itemsize


def naive_softmax_head_bytes(n: int, itemsize: int) -> int:
    """Peak bytes of naive softmax attention for one head: S in the input dtype, S in
    float32 (softmax works in place on it), P in the input dtype, plus a float32 temporary."""
    return n * n * (2 * itemsize + 8)


def naive_linear_head_bytes(n: int, itemsize: int, backward: bool) -> int:
    """Peak bytes of naive linear attention per head: A and its masked copy; dA too with backward."""
    return n * n * itemsize * (4 if backward else 2)


def heads_per_chunk(head_bytes: int, shared_bytes: int, budget_bytes: int) -> int:
    """How many heads the naive implementation processes at once within ``budget_bytes``
    (``shared_bytes``: the N x N mask, allocated once); 0 when a single head does not fit."""
    room = budget_bytes - shared_bytes
    return max(0, room // head_bytes) if room > 0 else 0


def linear_memory_bound(shape: Shape) -> int:
    """What O(N) memory means here: MEMORY_FACTOR tensors the size of q."""
    return MEMORY_FACTOR * shape.tensor_bytes


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# ---------------------------------------------------------------------------- records


@dataclass
class Record:
    """One measurement (kind "timing") or one memory check (kind "memory")."""

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
    "median_ms", "tflops", "flops", "runs", "sets", "flushed", "note", "peak_bytes",
    *ENV_KEYS,
)  # fmt: skip


def records_to_json(records: Sequence[Record]) -> str:
    return json.dumps([r.to_json() for r in records], indent=1, sort_keys=True)


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
    panels = sorted(series.items(), key=lambda kv: (*kv[0][:4], order.get(kv[0][4], 9)))
    for ax, (key, by_impl) in zip(axes.flat, panels):
        workload, dtype, d, causal, pass_ = key
        for impl, pts in by_impl.items():
            ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", label=impl)
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


# ---------------------------------------------------------------------------- arguments

SOFTMAX_SUITES: dict[str, Callable[[], list[Shape]]] = {
    "grid": grid_shapes,
    "fp32": fp32_shapes,
    "long": long_shapes,
    "quick": quick_shapes,
}
LINEAR_SUITES: dict[str, Callable[[], list[Shape]]] = {"linear": linear_shapes, "quick": linear_quick_shapes}
SUITE_GROUPS = {"all": ("grid", "fp32", "long")}
DEFAULT_SUITES = {"softmax": ("grid", "fp32"), "linear": ("linear",)}
TORCH_BACKENDS = {  # impl name -> torch.nn.attention.SDPBackend member
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
}
KERNEL_CHOICES = ("auto", "mma", "portable")


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in _csv(text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


def _dtypes(text: str) -> list[str]:
    out = []
    for t in _csv(text):
        if t.lower() not in DTYPE_ALIASES:
            raise argparse.ArgumentTypeError(f"unknown dtype {t!r}; use bf16, fp16 or fp32")
        out.append(DTYPE_ALIASES[t.lower()])
    return out


def torch_importable() -> bool:
    return importlib.util.find_spec("torch") is not None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cupyflash.bench",
        description="Benchmark cupyflash attention (TFLOP/s, CUDA events, median of runs) against "
        "naive CuPy attention and PyTorch SDPA backends on the same inputs.",
        epilog="Examples: `python -m cupyflash.bench` (grid + fp32); "
        "`python -m cupyflash.bench --suite quick --compare none`; "
        "`python -m cupyflash.bench --suite grid --dtype bf16 --d 128 --kernels mma,portable --json out.json "
        "--plot out.png`; `python -m cupyflash.bench --suite long`; `python -m cupyflash.bench --mode linear`.",
    )
    p.add_argument("--mode", choices=("softmax", "linear"), default="softmax", help="workload family (default softmax)")
    p.add_argument(
        "--suite",
        default=None,
        help="comma list: grid, fp32, long, quick, all (= grid,fp32,long); linear mode: linear, quick. "
        "Default: grid,fp32 (linear mode: linear)",
    )
    p.add_argument("--dtype", type=_dtypes, default=None, help="keep only these dtypes (bf16,fp16,fp32)")
    p.add_argument("--d", type=_ints, default=None, help="keep only these head dims, e.g. 64,128")
    p.add_argument("--n", type=_ints, default=None, help="keep only these sequence lengths")
    p.add_argument("--causal", choices=("0", "1", "both"), default="both", help="masking (default both)")
    p.add_argument("--passes", default=None, help="comma list of fwd,bwd (linear: fwd,fwd+bwd); default all")
    p.add_argument("--kernel", choices=KERNEL_CHOICES, default="auto", help="cupyflash kernel= option")
    p.add_argument("--kernels", default=None, help="several kernel families side by side, e.g. mma,portable")
    p.add_argument(
        "--compare",
        default=None,
        help="comma list of naive, torch (all SDPA backends), sdpa-flash, sdpa-cudnn, sdpa-efficient, or none. "
        "Default: naive,torch when torch is importable, else naive",
    )
    p.add_argument("--naive-budget-gb", type=float, default=8.0, help="memory for naive N x N scores (default 8)")
    p.add_argument("--runs", type=int, default=30, help="timed runs per measurement at most (default 30)")
    p.add_argument("--min-runs", type=int, default=5, help="timed runs at least (default 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--max-seconds", type=float, default=0.5, help="time cap per measurement (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", metavar="FILE", default=None, help="write every record as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None, help="plot TFLOP/s against N (needs matplotlib)")
    p.add_argument("--list", action="store_true", help="print the shapes that would run and exit (no GPU needed)")
    return p


@dataclass(frozen=True)
class Options:
    mode: str
    suites: tuple[str, ...]
    shapes: tuple[Shape, ...]
    passes: tuple[str, ...]
    kernels: tuple[str, ...]
    compare: tuple[str, ...]  # impl names of the comparisons
    naive_budget_bytes: int
    runs: int
    min_runs: int
    warmup: int
    max_seconds: float
    seed: int
    json: str | None
    plot: str | None
    list: bool

    @property
    def impls(self) -> tuple[str, ...]:
        return tuple(cupyflash_impl_name(k, self.kernels, self.mode) for k in self.kernels) + self.compare

    @property
    def primary(self) -> str:
        return self.impls[0]


def cupyflash_impl_name(kernel: str, kernels: Sequence[str], mode: str = "softmax") -> str:
    base = "cupyflash" if mode == "softmax" else "cupyflash-linear"
    return base if list(kernels) == ["auto"] else f"{base}[{kernel}]"


def expand_suites(text: str | None, mode: str) -> tuple[str, ...]:
    table = SOFTMAX_SUITES if mode == "softmax" else LINEAR_SUITES
    names = _csv(text) if text else list(DEFAULT_SUITES[mode])
    out: list[str] = []
    for name in names:
        for s in SUITE_GROUPS.get(name, (name,)) if mode == "softmax" else (name,):
            if s not in table:
                raise ValueError(f"unknown suite {s!r} for --mode {mode}; choose from {sorted(table)}"
                                 + (" or all" if mode == "softmax" else ""))
            if s not in out:
                out.append(s)
    return tuple(out)


def suite_shapes(suites: Iterable[str], mode: str = "softmax") -> list[Shape]:
    table = SOFTMAX_SUITES if mode == "softmax" else LINEAR_SUITES
    shapes: list[Shape] = []
    for s in suites:
        for shape in table[s]():
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def filter_shapes(
    shapes: Iterable[Shape],
    dtypes: Sequence[str] | None = None,
    ds: Sequence[int] | None = None,
    ns: Sequence[int] | None = None,
    causal: str = "both",
) -> list[Shape]:
    want_causal = {"0": (False,), "1": (True,), "both": (False, True)}[causal]
    return [
        s
        for s in shapes
        if (dtypes is None or s.dtype in dtypes)
        and (ds is None or s.d in ds)
        and (ns is None or s.n in ns)
        and s.causal in want_causal
    ]


def expand_compare(text: str | None, mode: str, has_torch: bool) -> tuple[str, ...]:
    names = _csv(text) if text else (["naive", "torch"] if has_torch and mode == "softmax" else ["naive"])
    out: list[str] = []
    for name in names:
        if name == "none":
            continue
        if name == "naive":
            picks = ["naive" if mode == "softmax" else "naive-linear"]
        elif name == "torch":
            picks = list(TORCH_BACKENDS)
        elif name in TORCH_BACKENDS:
            picks = [name]
        else:
            raise ValueError(f"unknown comparison {name!r}; use naive, torch, {', '.join(TORCH_BACKENDS)} or none")
        if mode == "linear" and picks != ["naive-linear"]:
            raise ValueError("--mode linear compares against naive only (SDPA has no linear attention)")
        out += [p for p in picks if p not in out]
    return tuple(out)


def parse_args(argv: Sequence[str] | None = None, *, has_torch: bool | None = None) -> Options:
    parser = build_parser()
    a = parser.parse_args(argv)
    has_torch = torch_importable() if has_torch is None else has_torch
    try:
        suites = expand_suites(a.suite, a.mode)
        compare = expand_compare(a.compare, a.mode, has_torch)
    except ValueError as e:
        parser.error(str(e))
    if not has_torch and any(c in TORCH_BACKENDS for c in compare):
        parser.error("--compare torch needs PyTorch, which is not importable here")
    valid_passes = ("fwd", "bwd") if a.mode == "softmax" else ("fwd", "fwd+bwd")
    passes = tuple(_csv(a.passes)) if a.passes else valid_passes
    for p_ in passes:
        if p_ not in valid_passes:
            parser.error(f"--passes: {p_!r} is not one of {valid_passes} for --mode {a.mode}")
    kernels = tuple(_csv(a.kernels)) if a.kernels else (a.kernel,)
    for k in kernels:
        if k not in KERNEL_CHOICES:
            parser.error(f"--kernels: {k!r} is not one of {KERNEL_CHOICES}")
    if a.mode == "linear" and kernels != ("auto",):
        parser.error("--kernel/--kernels choose softmax kernel families; linear attention has its own")
    if a.runs < 1 or a.min_runs < 1 or a.warmup < 0 or a.max_seconds <= 0 or a.naive_budget_gb < 0:
        parser.error("--runs/--min-runs must be >= 1, --warmup >= 0, --max-seconds > 0, --naive-budget-gb >= 0")
    shapes = filter_shapes(suite_shapes(suites, a.mode), a.dtype, a.d, a.n, a.causal)
    if not shapes:
        parser.error("the filters leave no shape to run (see --list without filters)")
    return Options(
        mode=a.mode,
        suites=suites,
        shapes=tuple(shapes),
        passes=passes,
        kernels=kernels,
        compare=compare,
        naive_budget_bytes=int(a.naive_budget_gb * 2**30),
        runs=a.runs,
        min_runs=a.min_runs,
        warmup=a.warmup,
        max_seconds=a.max_seconds,
        seed=a.seed,
        json=a.json,
        plot=a.plot,
        list=a.list,
    )


def format_plan(opts: Options) -> str:
    flops = WORKLOAD_FLOPS[opts.mode]
    lines = [f"mode {opts.mode}, suites {','.join(opts.suites)}, passes {','.join(opts.passes)}, "
             f"implementations {', '.join(opts.impls)}"]
    for s in opts.shapes:
        gf = ", ".join(f"{p} {flops(s.b, s.h, s.n, s.n, s.d, s.causal, p) / 1e9:.1f} GFLOP" for p in opts.passes)
        lines.append(f"  {s.label}: {gf}" + ("  [+ memory check]" if s.check_memory else ""))
    return "\n".join(lines)


WORKLOAD_FLOPS: dict[str, Callable[..., float]] = {"softmax": attention_flops, "linear": linear_flops}


# ============================================================================ GPU side


class Unavailable(Exception):
    """An implementation does not run this case (shown as n/a, with the reason)."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message, for a table note."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:limit] if lines else ""


def gpu_unavailable_reason() -> str | None:
    try:
        import cupy
    except Exception as e:
        return f"CuPy is not importable ({type(e).__name__}: {e})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:
        return f"no usable CUDA device ({type(e).__name__}: {e})"
    return None


def require_gpu() -> None:
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"python -m cupyflash.bench needs a CUDA GPU: {reason}. (--help and --list work without one.)")


def environment() -> dict[str, Any]:
    import cupy
    import numpy

    import cupyflash

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    versions = {
        "cupyflash": cupyflash.__version__,
        "cupy": cupy.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
    }
    if "torch" in sys.modules:
        versions["torch"] = sys.modules["torch"].__version__
    return {
        "device": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": dev.compute_capability,
        "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def cupy_dtype(name: str) -> Any:
    import numpy as np

    from . import _dtypes

    return {"float32": _dtypes.FLOAT32, "float16": _dtypes.FLOAT16, "bfloat16": _dtypes.BFLOAT16}[name]


@dataclass
class InputSet:
    """Random normal q, k, v, dO of one shape (CuPy), plus what implementations derive from
    them outside the timed region (cupyflash's o and lse, keyed by kernel)."""

    q: Any
    k: Any
    v: Any
    do: Any
    derived: dict[str, Any] = field(default_factory=dict)


def random_inputs(shape: Shape, rng: Any) -> InputSet:
    import cupy

    dt = cupy_dtype(shape.dtype)
    dims = (shape.b, shape.h, shape.n, shape.d)

    def normal() -> Any:
        return rng.standard_normal(dims, dtype=cupy.float32).astype(dt)

    return InputSet(normal(), normal(), normal(), normal())


def free_device_memory() -> None:
    import cupy

    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def to_torch(x: Any) -> Any:
    """A torch tensor on the same memory as CuPy array ``x`` (DLPack, no copy)."""
    import torch

    try:
        return torch.from_dlpack(x)
    except Exception:
        import cupy

        if str(x.dtype) != "bfloat16":
            raise
        return torch.from_dlpack(x.view(cupy.uint16)).view(torch.bfloat16)


@dataclass
class Prepared:
    """A timed call ``call(i)`` on input set i, the clock of the library that launches it,
    and a context held around the whole measurement (e.g. the SDPA backend choice)."""

    call: Callable[[int], Any]
    clock: str  # "cupy" or "torch"
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext


Impl = Callable[[Shape, str, Sequence[InputSet], Options], Prepared]


# ---------------------------------------------------------------------------- softmax impls


def cupyflash_impl(kernel: str) -> Impl:
    def prepare(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
        import cupyflash as cf

        c = shape.causal
        try:
            o0, lse0 = cf.attention_forward(sets[0].q, sets[0].k, sets[0].v, c, kernel=kernel)
        except TypeError as e:  # dispatch refuses the dtype/head dim/arch for this family
            raise Unavailable(str(e)) from e
        if pass_ == "fwd":
            del o0, lse0
            return Prepared(lambda i: cf.attention_forward(sets[i].q, sets[i].k, sets[i].v, c, kernel=kernel), "cupy")
        key = f"cupyflash[{kernel}]"
        for j, s in enumerate(sets):  # backward alone: o and lse come from outside the timed region
            if key not in s.derived:
                s.derived[key] = (o0, lse0) if j == 0 else cf.attention_forward(s.q, s.k, s.v, c, kernel=kernel)

        def bwd(i: int) -> Any:
            s = sets[i]
            o, lse = s.derived[key]
            return cf.attention_backward(s.do, s.q, s.k, s.v, o, lse, c, kernel=kernel)

        return Prepared(bwd, "cupy")

    return prepare


def naive_attention_forward(q: Any, k: Any, v: Any, causal: bool, scale: float, chunk: int) -> Any:
    """softmax(scale q k^T) v with the scores in the input dtype and the softmax in float32,
    ``chunk`` heads at a time so the N x N matrices fit the memory budget."""
    import cupy

    b, h, n, d = q.shape
    q3, k3, v3 = (x.reshape(b * h, n, d) for x in (q, k, v))
    out = cupy.empty_like(q3)
    bias = None
    if causal:  # bottom-right aligned, Nq == Nk here
        bias = cupy.triu(cupy.full((n, n), -cupy.inf, dtype=cupy.float32), k=1)  # -inf where j > i
    for s in range(0, b * h, chunk):
        e = min(b * h, s + chunk)
        S = cupy.matmul(q3[s:e], k3[s:e].transpose(0, 2, 1)).astype(cupy.float32, copy=False)
        S *= cupy.float32(scale)
        if bias is not None:
            S += bias
        S -= S.max(axis=-1, keepdims=True)
        cupy.exp(S, out=S)
        S /= S.sum(axis=-1, keepdims=True)
        out[s:e] = cupy.matmul(S.astype(q.dtype), v3[s:e])
        del S
    return out.reshape(b, h, n, d)


def naive_impl(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
    if pass_ != "fwd":
        raise Unavailable("naive is benchmarked forward only")
    mask = shape.n * shape.n * 4 if shape.causal else 0
    chunk = heads_per_chunk(naive_softmax_head_bytes(shape.n, shape.itemsize), mask, opts.naive_budget_bytes)
    if chunk == 0:
        need = naive_softmax_head_bytes(shape.n, shape.itemsize) + mask
        raise Unavailable(
            f"one head's N x N scores need {fmt_bytes(need)} > budget {fmt_bytes(opts.naive_budget_bytes)} "
            f"(all heads: {fmt_bytes(naive_scores_bytes(shape))} in {shape.dtype}); raise --naive-budget-gb"
        )
    scale = 1.0 / math.sqrt(shape.d)
    return Prepared(
        lambda i: naive_attention_forward(sets[i].q, sets[i].k, sets[i].v, shape.causal, scale, chunk), "cupy"
    )


def sdpa_impl(backend: str) -> Impl:
    def prepare(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
        import warnings

        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        be = getattr(SDPBackend, backend)

        @contextlib.contextmanager
        def context() -> Any:
            with warnings.catch_warnings(), sdpa_kernel([be]):
                warnings.simplefilter("ignore")  # refusals also warn; the reason comes from the exception
                yield

        c = shape.causal
        # Leaves that require grad, as in training: the forward then also keeps what its
        # backward needs (as cupyflash's forward always returns lse), and the backward can run.
        leaves = [[to_torch(x).detach().requires_grad_() for x in (s.q, s.k, s.v)] for s in sets]
        grads_out = [to_torch(s.do) for s in sets]
        with context():
            try:
                F.scaled_dot_product_attention(*leaves[0], is_causal=c)
            except (RuntimeError, NotImplementedError, ValueError) as e:
                raise Unavailable(f"{backend} refuses this case: {first_line(e)}") from e
            if pass_ == "fwd":

                def fwd(i: int) -> Any:
                    return F.scaled_dot_product_attention(*leaves[i], is_causal=c)

                return Prepared(fwd, "torch", context)
            # Backward alone: each set's forward runs once here, outside the timed region.
            outs = [F.scaled_dot_product_attention(*qkv, is_causal=c) for qkv in leaves]

        def bwd(i: int) -> None:
            for x in leaves[i]:
                x.grad = None  # a fresh gradient each call, no accumulation kernel
            outs[i].backward(grads_out[i], retain_graph=True)

        torch.cuda.synchronize()
        return Prepared(bwd, "torch", context)

    return prepare


# ---------------------------------------------------------------------------- linear impls


def find_linear() -> tuple[Callable | None, Callable | None]:
    """cupyflash's linear attention forward and backward, if this build has them (exported
    at the top level, or in ``cupyflash.linear_api``)."""
    import cupyflash

    mod: Any = cupyflash
    if getattr(mod, "linear_attention_forward", None) is None:
        try:
            mod = importlib.import_module("cupyflash.linear_api")
        except ImportError:
            return None, None
    fwd = getattr(mod, "linear_attention_forward", None) or getattr(mod, "linear_attention", None)
    return fwd, getattr(mod, "linear_attention_backward", None)


def cupyflash_linear_impl(kernel: str) -> Impl:
    def prepare(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
        fwd, bwd = find_linear()
        if fwd is None:
            raise Unavailable("cupyflash has no linear_attention in this build")
        if pass_ == "fwd":
            return Prepared(lambda i: fwd(sets[i].q, sets[i].k, sets[i].v, causal=True), "cupy")
        if bwd is None:
            raise Unavailable("cupyflash has no linear_attention_backward in this build")

        def fwd_bwd(i: int) -> Any:
            s = sets[i]
            fwd(s.q, s.k, s.v, causal=True)
            return bwd(s.do, s.q, s.k, s.v, causal=True)

        return Prepared(fwd_bwd, "cupy")

    return prepare


def naive_linear(q: Any, k: Any, v: Any, do: Any | None, chunk: int) -> Any:
    """o = ((q k^T) * M) v with M the causal 0/1 mask, and with ``do`` its gradients
    (dA = (dO v^T) * M, dq = dA k, dk = dA^T q, dv = A^T dO), ``chunk`` heads at a time."""
    import cupy

    b, h, n, d = q.shape
    q3, k3, v3 = (x.reshape(b * h, n, d) for x in (q, k, v))
    do3 = None if do is None else do.reshape(b * h, n, d)
    mask = cupy.tri(n, n, 0, dtype=cupy.float32).astype(q.dtype)  # 1 where j <= i
    out = cupy.empty_like(q3)
    grads = None if do is None else tuple(cupy.empty_like(x) for x in (q3, k3, v3))
    for s in range(0, b * h, chunk):
        e = min(b * h, s + chunk)
        A = cupy.matmul(q3[s:e], k3[s:e].transpose(0, 2, 1))
        A *= mask
        out[s:e] = cupy.matmul(A, v3[s:e])
        if do3 is not None and grads is not None:
            dA = cupy.matmul(do3[s:e], v3[s:e].transpose(0, 2, 1))
            dA *= mask
            grads[0][s:e] = cupy.matmul(dA, k3[s:e])
            grads[1][s:e] = cupy.matmul(dA.transpose(0, 2, 1), q3[s:e])
            grads[2][s:e] = cupy.matmul(A.transpose(0, 2, 1), do3[s:e])
            del dA
        del A
    return out if grads is None else (out, grads)


def naive_linear_impl(shape: Shape, pass_: str, sets: Sequence[InputSet], opts: Options) -> Prepared:
    backward = pass_ != "fwd"
    head = naive_linear_head_bytes(shape.n, shape.itemsize, backward)
    mask = shape.n * shape.n * shape.itemsize
    chunk = heads_per_chunk(head, mask, opts.naive_budget_bytes)
    if chunk == 0:
        raise Unavailable(f"one head's N x N matrices need {fmt_bytes(head + mask)} > budget "
                          f"{fmt_bytes(opts.naive_budget_bytes)}; raise --naive-budget-gb")
    return Prepared(
        lambda i: naive_linear(sets[i].q, sets[i].k, sets[i].v, sets[i].do if backward else None, chunk), "cupy"
    )


# ---------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """A benchmark family: its FLOP count and how to build each named implementation."""

    name: str
    flops: Callable[..., float]
    impl: Callable[[str], Impl]  # impl name -> prepare function

    def available(self) -> str | None:
        """None, or why this family cannot run in this build."""
        return None


def _softmax_impl(name: str) -> Impl:
    if name == "naive":
        return naive_impl
    if name in TORCH_BACKENDS:
        return sdpa_impl(TORCH_BACKENDS[name])
    if name.startswith("cupyflash"):
        return cupyflash_impl(name[len("cupyflash["):-1] if "[" in name else "auto")
    raise KeyError(name)


def _linear_impl(name: str) -> Impl:
    if name == "naive-linear":
        return naive_linear_impl
    if name.startswith("cupyflash-linear"):
        return cupyflash_linear_impl(name[len("cupyflash-linear["):-1] if "[" in name else "auto")
    raise KeyError(name)


class LinearWorkload(Workload):
    def available(self) -> str | None:
        fwd, _ = find_linear()
        return None if fwd is not None else "cupyflash.linear_attention is not in this build yet"


WORKLOADS: dict[str, Workload] = {
    "softmax": Workload("softmax", attention_flops, _softmax_impl),
    "linear": LinearWorkload("linear", linear_flops, _linear_impl),
}


# ---------------------------------------------------------------------------- running


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_clock(kind: str) -> _timing.Clock:
    return _timing.CupyClock() if kind == "cupy" else _timing.TorchClock()


def input_sets(shape: Shape, opts: Options, rng: Any) -> tuple[list[InputSet], _timing.CachePlan]:
    """The input sets of one shape, enough of them to keep L2 from flattering (see _timing)."""
    import cupy

    touched = 4 * shape.tensor_bytes  # the least a call touches: q, k, v and o
    plan = _timing.plan_cache_defeat(touched, _timing.device_l2_bytes())
    free, _ = cupy.cuda.runtime.memGetInfo()
    # Rotation must leave room for the largest implementation's workspace.
    room = max(1, int(0.25 * free) // max(1, 4 * shape.tensor_bytes))
    if plan.sets > room:
        plan = _timing.CachePlan(1, 2 * _timing.device_l2_bytes())
    return [random_inputs(shape, rng) for _ in range(plan.sets)], plan


def measure_memory(shape: Shape, kernel: str, rng: Any) -> tuple[int, int]:
    """Bytes cupyflash holds across one forward + backward at ``shape``, inputs included:
    CuPy's pool after the calls (its high-water mark, since freed blocks stay pooled) and the
    drop in the driver's free memory."""
    import cupy

    import cupyflash as cf

    free_device_memory()
    pool = cupy.get_default_memory_pool()
    free0, _ = cupy.cuda.runtime.memGetInfo()
    s = random_inputs(shape, rng)
    o, lse = cf.attention_forward(s.q, s.k, s.v, shape.causal, kernel=kernel)
    grads = cf.attention_backward(s.do, s.q, s.k, s.v, o, lse, shape.causal, kernel=kernel)
    cupy.cuda.Device().synchronize()
    held = int(pool.total_bytes())
    free1, _ = cupy.cuda.runtime.memGetInfo()
    del s, o, lse, grads
    free_device_memory()
    return held, int(free0 - free1)


def memory_record(shape: Shape, impl: str, kernel: str, rng: Any, env: dict[str, Any]) -> Record:
    base = dict(workload="softmax", b=shape.b, h=shape.h, n=shape.n, d=shape.d, causal=shape.causal,
                dtype=shape.dtype, pass_="fwd+bwd", impl=impl, kind="memory", env=env)
    try:
        held, driver = measure_memory(shape, kernel, rng)
    except Exception as e:
        return Record(status="error", note=f"{type(e).__name__}: {e}", **base)  # type: ignore[arg-type]
    bound = linear_memory_bound(shape)
    ok = held <= bound
    note = (
        f"peak {fmt_bytes(held)} (CuPy pool; driver sees {fmt_bytes(driver)}), "
        f"{held / shape.tensor_bytes:.1f}x the size of q; O(N) bound {MEMORY_FACTOR}x = {fmt_bytes(bound)}: "
        f"{'ok' if ok else 'EXCEEDED'}; naive N x N scores would need {fmt_bytes(naive_scores_bytes(shape))}"
    )
    return Record(status="ok" if ok else "error", peak_bytes=held, note=note, **base)  # type: ignore[arg-type]


def run(opts: Options) -> list[Record]:
    import cupy

    workload = WORKLOADS[opts.mode]
    why = workload.available()
    if why is not None:
        progress(f"skipping --mode {opts.mode}: {why}")
        return []
    if any(i in TORCH_BACKENDS for i in opts.compare):
        import torch  # noqa: F401  (imported before environment() so its version is recorded)
    env = environment()
    progress(f"device: {env['device']} (sm_{env['compute_capability']}), versions {env['versions']}")
    rng = cupy.random.default_rng(opts.seed)
    impls = {name: workload.impl(name) for name in opts.impls}
    records: list[Record] = []
    total = len(opts.shapes) * len(opts.passes) * len(impls)
    step = 0
    for shape in opts.shapes:
        if shape.check_memory and opts.mode == "softmax":
            rec = memory_record(shape, opts.primary, opts.kernels[0], rng, env)
            progress(f"memory {shape.label}: {rec.note}")
            records.append(rec)
        sets, plan = input_sets(shape, opts, rng)
        for pass_ in opts.passes:
            flops = workload.flops(shape.b, shape.h, shape.n, shape.n, shape.d, shape.causal, pass_)
            for name, prepare in impls.items():
                step += 1
                rec = run_one(shape, pass_, name, prepare, sets, plan, flops, opts, env)
                records.append(rec)
                if rec.status == "ok":
                    what = (f"{rec.median_ms:.3f} ms {rec.tflops:.1f} TFLOP/s ({rec.runs} runs, {rec.sets} sets"
                            f"{', L2 flushed' if rec.flushed else ''})")
                else:
                    what = f"{rec.status}: {rec.note}"
                progress(f"[{step}/{total}] {shape.label} {pass_} {name}: {what}")
        del sets
        free_device_memory()
        if opts.json:  # after every shape, so a run cut short still leaves its results
            write_json(records, opts.json)
    return records


def write_json(records: Sequence[Record], path: str) -> None:
    with open(path, "w") as f:
        f.write(records_to_json(records) + "\n")


def run_one(
    shape: Shape,
    pass_: str,
    name: str,
    prepare: Impl,
    sets: Sequence[InputSet],
    plan: _timing.CachePlan,
    flops: float,
    opts: Options,
    env: dict[str, Any],
) -> Record:
    base = dict(workload=opts.mode, b=shape.b, h=shape.h, n=shape.n, d=shape.d, causal=shape.causal,
                dtype=shape.dtype, pass_=pass_, impl=name, flops=flops, env=env)
    import cupy

    prepared = None
    try:
        cupy.cuda.Device().synchronize()
        prepared = prepare(shape, pass_, sets, opts)
        with prepared.context():
            t = _timing.measure(
                prepared.call,
                make_clock(prepared.clock),
                plan=_timing.CachePlan(len(sets), plan.flush_bytes),
                warmup=opts.warmup,
                runs=opts.runs,
                min_runs=opts.min_runs,
                max_seconds=opts.max_seconds,
            )
    except Unavailable as e:
        return Record(status="n/a", note=str(e), **base)  # type: ignore[arg-type]
    except Exception as e:  # an OOM or a refusal we did not foresee: report it, keep going
        return Record(status="error", note=f"{type(e).__name__}: {first_line(e)}", **base)  # type: ignore[arg-type]
    finally:
        del prepared
        cupy.cuda.Device().synchronize()
    ms = t.median_ms
    return Record(status="ok", median_ms=ms, tflops=_timing.tflops(flops, ms), runs=t.runs, sets=t.sets,
                  flushed=t.flushed, **base)  # type: ignore[arg-type]


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.list:
        print(format_plan(opts))
        return 0
    if opts.plot:
        if importlib.util.find_spec("matplotlib") is None:  # fail before the runs, not after
            raise SystemExit("--plot needs matplotlib; install it with `pip install matplotlib`")
    require_gpu()
    records = run(opts)
    if not records:
        return 0
    print(format_table(records, opts.impls, opts.primary))
    notes = format_notes(records)
    if notes:
        print("\n" + notes)
    if opts.json:
        write_json(records, opts.json)
        progress(f"wrote {len(records)} records to {opts.json}")
    if opts.plot:
        plot(records, opts.plot)
        progress(f"wrote {opts.plot}")
    failed = [r for r in records if r.status == "error" and r.impl.startswith("cupyflash")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
