"""The command line: argument parsing into ``Options``, suite expansion, shape filtering and
the ``--list`` plan (pure Python, tested on the CPU; needs no GPU)."""
from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from .shapes import (
    DTYPE_ALIASES,
    Shape,
    attention_flops,
    dropout_shapes,
    flex_shapes,
    fp32_shapes,
    grid_shapes,
    linear_flops,
    linear_quick_shapes,
    linear_shapes,
    long_shapes,
    masks_shapes,
    overhead_shapes,
    quick_shapes,
    variants_shapes,
    varlen_shapes,
)

# ---------------------------------------------------------------------------- arguments

SOFTMAX_SUITES: dict[str, Callable[[], list[Shape]]] = {
    "grid": grid_shapes,
    "fp32": fp32_shapes,
    "long": long_shapes,
    "quick": quick_shapes,
    "overhead": overhead_shapes,  # host time of tiny calls (bench/overhead.py); runs alone
    "variants": variants_shapes,  # window, softcap, ALiBi, sinks against plain and Flex (bench/variants.py); alone
    "dropout": dropout_shapes,  # deterministic backward, dropout vs SDPA FLASH (bench/dropout.py); alone
    "masks": masks_shapes,  # bias (with its gradient) and bool mask vs SDPA EFFICIENT (bench/masks.py); alone
    "varlen": varlen_shapes,  # a packed batch against dense, padding and nested SDPA (bench/varlen.py); alone
    "flex": flex_shapes,  # mask_mod + block_mask vs flex_attention, dense causal; first-call compile (bench/flex.py)
}
ALONE_SUITES = ("overhead", "variants", "dropout", "masks", "varlen", "flex")  # not the TFLOP/s table's rows
#: Suites whose rows time other passes than fwd and bwd (--passes picks among these).
SUITE_PASSES = {"dropout": ("bwd", "fwd+bwd"), "masks": ("fwd", "fwd+bwd"), "flex": ("fwd", "fwd+bwd")}
LINEAR_SUITES: dict[str, Callable[[], list[Shape]]] = {"linear": linear_shapes, "quick": linear_quick_shapes}
SUITE_GROUPS = {"all": ("grid", "fp32", "long")}
DEFAULT_SUITES = {"softmax": ("grid", "fp32"), "linear": ("linear",)}
TORCH_BACKENDS = {  # impl name -> torch.nn.attention.SDPBackend member
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
}
KERNEL_CHOICES = ("auto", "wgmma", "mma", "portable")
LINEAR_COMPARISONS = ("naive-linear", "fla")  # fla: flash-linear-attention's Triton kernels (fla-core)


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
        "--plot out.png`; `python -m cupyflash.bench --suite long`; `python -m cupyflash.bench --mode linear`; "
        "`python -m cupyflash.bench --suite overhead --json overhead.json`; "
        "`python -m cupyflash.bench --suite variants --d 128 --n 16384 --json variants.json`; "
        "`python -m cupyflash.bench --suite dropout --json dropout.json`; "
        "`python -m cupyflash.bench --suite masks --json masks.json`.",
    )
    p.add_argument("--mode", choices=("softmax", "linear"), default="softmax", help="workload family (default softmax)")
    p.add_argument(
        "--suite",
        default=None,
        help="comma list: grid, fp32, long, quick, all (= grid,fp32,long); linear mode: linear, quick. "
        "Default: grid,fp32 (linear mode: linear). overhead (alone): microseconds per call of tiny "
        "forwards, backwards and a linear forward, wall time against GPU time, beside SDPA. variants (alone): "
        "bf16 window/softcap/ALiBi/sinks against our plain call and FlexAttention (--d, --n, --causal, --passes "
        "filter; --compare none leaves Flex out). dropout (alone): bf16 deterministic backward against the default per "
        "family (--passes bwd; --kernels picks families) and dropout 0.1 forward+backward against ours without "
        "dropout and SDPA FLASH (--passes fwd+bwd). masks (alone): bias with its gradient and a bool mask against "
        "SDPA EFFICIENT with the same attn_mask, bf16 and fp32 (--passes fwd,fwd+bwd). varlen (alone): a packed "
        "bf16 causal batch of long-tailed "
        "documents against our dense kernel at the same work, padding to the longest and SDPA on nested tensors "
        "(--d, --passes filter; --compare none leaves SDPA out). flex (alone): mask_mod + block_mask for a document "
        "mask (8 documents in 16k tokens) and prefix-LM against no block mask, dense causal and torch's compiled "
        "flex_attention, bf16 (--passes fwd,fwd+bwd), and a new snippet's first-call time",
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
        help="comma list of naive, torch (all SDPA backends), sdpa-flash, sdpa-cudnn, sdpa-efficient, or none; "
        "linear mode: naive, fla (flash-linear-attention's Triton kernels, package fla-core). "
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
    p.add_argument(
        "--decay",
        action="store_true",
        help="linear mode: per-head decay lambda_h = 1 - 2^(-5 - h) (RetNet's rates) for cupyflash and fla; naive n/a",
    )
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
    decay: bool = False  # linear mode: per-head decay (linear_impls.decay_rates)

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
        elif name == "fla":
            picks = ["fla"]
        else:
            raise ValueError(
                f"unknown comparison {name!r}; use naive, torch, {', '.join(TORCH_BACKENDS)}, fla or none"
            )
        if (mode == "linear") != all(p in LINEAR_COMPARISONS for p in picks):
            raise ValueError(
                "--mode linear compares against naive and fla (SDPA has no linear attention); "
                "fla is a linear-attention library"
            )
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
    for alone in ALONE_SUITES:
        if alone in suites and len(suites) > 1:
            parser.error(f"--suite {alone} runs alone (its rows have their own table)")
    if not has_torch and any(c in TORCH_BACKENDS for c in compare):
        parser.error("--compare torch needs PyTorch, which is not importable here")
    valid_passes = ("fwd", "bwd") if a.mode == "softmax" else ("fwd", "fwd+bwd")
    valid_passes = SUITE_PASSES.get(suites[0], valid_passes) if len(suites) == 1 else valid_passes
    passes = tuple(_csv(a.passes)) if a.passes else valid_passes
    for p_ in passes:
        if p_ not in valid_passes:
            what = f"--suite {suites[0]}" if suites[0] in SUITE_PASSES and len(suites) == 1 else f"--mode {a.mode}"
            parser.error(f"--passes: {p_!r} is not one of {valid_passes} for {what}")
    kernels = tuple(_csv(a.kernels)) if a.kernels else (a.kernel,)
    for k in kernels:
        if k not in KERNEL_CHOICES:
            parser.error(f"--kernels: {k!r} is not one of {KERNEL_CHOICES}")
    if a.decay and a.mode != "linear":
        parser.error("--decay is a linear-attention option (--mode linear)")
    if suites in (("masks",), ("flex",)) and len(kernels) > 1:
        parser.error(f"--suite {suites[0]} compares one kernel choice with torch: use --kernel")
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
        decay=a.decay,
    )


def is_overhead(opts: Options) -> bool:
    return opts.suites == ("overhead",)


def overhead_uses_sdpa(opts: Options) -> bool:
    """SDPA's columns (Flex's in the variants suite): whenever the comparisons name a torch backend (the
    default with torch)."""
    return any(c in TORCH_BACKENDS for c in opts.compare)


def is_variants(opts: Options) -> bool:
    return opts.suites == ("variants",)


def is_varlen(opts: Options) -> bool:
    return opts.suites == ("varlen",)


def is_dropout(opts: Options) -> bool:
    return opts.suites == ("dropout",)


def is_masks(opts: Options) -> bool:
    return opts.suites == ("masks",)


def is_flex(opts: Options) -> bool:
    return opts.suites == ("flex",)


def paired_rows(opts: Options) -> list:
    """The rows of the dropout or masks suite (bench/paired.py's ``Row``), SDPA's columns when a torch
    comparison is on."""
    sdpa = overhead_uses_sdpa(opts)
    if is_dropout(opts):
        from .dropout import plan_rows as dropout_rows

        return dropout_rows(opts.shapes, opts.passes, opts.kernels, sdpa)
    if is_flex(opts):
        from .flex import plan_rows as flex_rows

        return flex_rows(opts.shapes, opts.passes, opts.kernels[0], sdpa)
    from .masks import plan_rows as masks_rows

    return masks_rows(opts.shapes, opts.passes, opts.kernels[0], sdpa)


def format_plan(opts: Options) -> str:
    if is_varlen(opts):
        from .varlen import format_plan as varlen_plan
        from .varlen import plan_rows as varlen_rows

        return varlen_plan(varlen_rows(opts.shapes, opts.passes), overhead_uses_sdpa(opts))
    if is_dropout(opts) or is_masks(opts) or is_flex(opts):
        from .paired import format_plan as paired_plan

        return paired_plan(f"suite {opts.suites[0]}", paired_rows(opts))
    if is_variants(opts):
        from .variants import format_plan as variants_plan
        from .variants import plan_rows as variants_rows

        return variants_plan(variants_rows(opts.shapes, opts.passes), overhead_uses_sdpa(opts))
    if is_overhead(opts):
        from .overhead import format_plan as overhead_plan
        from .overhead import plan_rows

        return overhead_plan(plan_rows(opts.shapes), overhead_uses_sdpa(opts))
    flops = WORKLOAD_FLOPS[opts.mode]
    lines = [f"mode {opts.mode}{' with decay' if opts.decay else ''}, suites {','.join(opts.suites)}, "
             f"passes {','.join(opts.passes)}, implementations {', '.join(opts.impls)}"]
    for s in opts.shapes:
        gf = ", ".join(f"{p} {flops(s.b, s.h, s.n, s.n, s.d, s.causal, p) / 1e9:.1f} GFLOP" for p in opts.passes)
        lines.append(f"  {s.label}: {gf}" + ("  [+ memory check]" if s.check_memory else ""))
    return "\n".join(lines)


WORKLOAD_FLOPS: dict[str, Callable[..., float]] = {"softmax": attention_flops, "linear": linear_flops}
