"""Running a benchmark: input sets per shape, one measurement per (shape, pass, implementation),
progress on stderr, and ``main`` (the ``python -m cupyflash.bench`` entry point)."""
from __future__ import annotations

import importlib.util
import sys
from typing import Any, Sequence

from . import timing
from .cli import (
    TORCH_BACKENDS,
    Options,
    format_plan,
    is_dropout,
    is_flex,
    is_masks,
    is_overhead,
    is_variants,
    is_varlen,
    overhead_uses_sdpa,
    paired_rows,
    parse_args,
)
from .device import environment, free_device_memory, require_gpu
from .impls import Impl, InputSet, Unavailable, first_line, random_inputs
from .memory import memory_record
from .report import Record, format_notes, format_table, plot, write_json
from .shapes import Shape
from .workloads import WORKLOADS


# ---------------------------------------------------------------------------- running


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_clock(kind: str) -> timing.Clock:
    return timing.CupyClock() if kind == "cupy" else timing.TorchClock()


def input_sets(shape: Shape, opts: Options, rng: Any) -> tuple[list[InputSet], timing.CachePlan]:
    """The input sets of one shape, enough of them to keep L2 from flattering (see timing)."""
    import cupy

    touched = 4 * shape.tensor_bytes  # the least a call touches: q, k, v and o
    plan = timing.plan_cache_defeat(touched, timing.device_l2_bytes())
    free, _ = cupy.cuda.runtime.memGetInfo()
    # Rotation must leave room for the largest implementation's workspace.
    room = max(1, int(0.25 * free) // max(1, 4 * shape.tensor_bytes))
    if plan.sets > room:
        plan = timing.CachePlan(1, 2 * timing.device_l2_bytes())
    return [random_inputs(shape, rng) for _ in range(plan.sets)], plan

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
    if opts.decay:  # recorded with every measurement: the same shapes run with and without it
        env["linear_decay"] = "lambda_h = 1 - 2**(-5 - h)"
    progress(f"device: {env['device']} (sm_{env['compute_capability']}), versions {env['versions']}"
             + (f", decay {env['linear_decay']}" if opts.decay else ""))
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


def run_one(
    shape: Shape,
    pass_: str,
    name: str,
    prepare: Impl,
    sets: Sequence[InputSet],
    plan: timing.CachePlan,
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
            t = timing.measure(
                prepared.call,
                make_clock(prepared.clock),
                plan=timing.CachePlan(len(sets), plan.flush_bytes),
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
    return Record(status="ok", median_ms=ms, tflops=timing.tflops(flops, ms), runs=t.runs, sets=t.sets,
                  flushed=t.flushed, **base)  # type: ignore[arg-type]


def _decode_args(argv: Sequence[str]) -> list[str] | None:
    """``--suite decode`` runs the decode benchmark (bench/decode.py) with the remaining arguments, else None."""
    args = list(argv)
    for i, a in enumerate(args):
        if a == "--suite" and i + 1 < len(args) and args[i + 1] == "decode":
            return args[:i] + args[i + 2 :]
        if a == "--suite=decode":
            return args[:i] + args[i + 1 :]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    decode_args = _decode_args(sys.argv[1:] if argv is None else argv)
    if decode_args is not None:
        from .decode import main as decode_main

        return decode_main(decode_args)
    opts = parse_args(argv)
    if opts.list:
        print(format_plan(opts))
        return 0
    if opts.plot:
        if importlib.util.find_spec("matplotlib") is None:  # fail before the runs, not after
            raise SystemExit("--plot needs matplotlib; install it with `pip install matplotlib`")
    require_gpu()
    if is_overhead(opts):
        return overhead_main(opts)
    if is_variants(opts):
        return variants_main(opts)
    if is_dropout(opts) or is_masks(opts) or is_flex(opts):
        return paired_main(opts)
    if is_varlen(opts):
        return varlen_main(opts)
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


def overhead_main(opts: Options) -> int:
    """``--suite overhead``: the host-overhead table (and JSON records of kind "overhead")."""
    from .overhead import format_overhead_table, plan_rows, run_overhead

    use_sdpa = overhead_uses_sdpa(opts)
    if use_sdpa:
        import torch  # noqa: F401  (imported before environment() so its version is recorded)
    env = _environment()
    rows = plan_rows(opts.shapes)
    records = run_overhead(rows, use_sdpa, opts.seed, env, progress)
    return _finish(opts, records, format_overhead_table(records, rows))


def variants_main(opts: Options) -> int:
    """``--suite variants``: the variants table (and JSON records of kind "variants")."""
    from .variants import format_variants_table, plan_rows, run_variants

    use_flex = overhead_uses_sdpa(opts)  # a torch comparison asked for (the default with torch)
    missing = None
    if use_flex:
        try:
            import torch.nn.attention.flex_attention  # noqa: F401  (before environment(): torch's version)
        except Exception as e:
            missing = f"FlexAttention is not importable ({type(e).__name__}: {e})"
    env = _environment()
    rows = plan_rows(opts.shapes, opts.passes)

    save = _saver(opts)

    records = run_variants(rows, use_flex, missing, opts.seed, env, progress, save)
    return _finish(opts, records, format_variants_table(records, rows))


def paired_main(opts: Options) -> int:
    """``--suite dropout`` / ``--suite masks``: each row's implementations against its first (bench/paired.py),
    JSON records of kind "dropout" / "masks"."""
    from . import dropout, flex, masks
    from .paired import format_table, run_rows

    suite = dropout if is_dropout(opts) else flex if is_flex(opts) else masks
    if overhead_uses_sdpa(opts):
        import torch  # noqa: F401  (imported before environment() so its version is recorded)
    env = _environment()
    rows = paired_rows(opts)

    save = _saver(opts)

    records = run_rows(rows, suite.inputs, suite.make, opts.seed, env, progress, save)
    return _finish(opts, records, format_table(records, rows, suite.NAMES))


def varlen_main(opts: Options) -> int:
    """``--suite varlen``: the packed-batch table (and JSON records of kind "varlen")."""
    from .varlen import format_varlen_table, plan_rows, run_varlen

    use_torch = overhead_uses_sdpa(opts)  # a torch comparison asked for (the default with torch)
    missing = None
    if use_torch:
        try:
            import torch  # noqa: F401  (before environment(): torch's version)

            torch.nested.nested_tensor_from_jagged  # noqa: B018  (jagged nested tensors: torch >= 2.3)
        except Exception as e:
            missing = f"torch jagged nested tensors are not available ({type(e).__name__}: {e})"
    env = _environment()
    rows = plan_rows(opts.shapes, opts.passes)

    save = _saver(opts)

    records = run_varlen(rows, use_torch, missing, opts.seed, env, progress, save)
    return _finish(opts, records, format_varlen_table(records), ours=lambda impl: impl == "packed")


# ---------------------------------------------------------------------------- what the suites share


def _environment() -> dict[str, Any]:
    """The device and versions, announced on stderr (torch, when compared, is imported before this)."""
    env = environment()
    progress(f"device: {env['device']} (sm_{env['compute_capability']}), versions {env['versions']}")
    return env


def _saver(opts: Options):
    """Writes the records so far after every shape, so a run cut short keeps what it measured."""

    def save(records: list[Record]) -> None:
        if opts.json:
            write_json(records, opts.json)

    return save


def _finish(opts: Options, records: list[Record], table: str, ours=lambda impl: impl.startswith("cupyflash")) -> int:
    """Print the suite's table, write its JSON, and exit 1 if one of our own calls failed."""
    print(table)
    if opts.json:
        write_json(records, opts.json)
        progress(f"wrote {len(records)} records to {opts.json}")
    return 1 if any(r.status == "error" and ours(r.impl) for r in records) else 0
