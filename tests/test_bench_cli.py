"""The benchmark CLI's pure pieces (arguments, shapes, FLOPs, timing plans, table, JSON) on the
CPU; the GPU runs of ``python -m cupyflash.bench`` skip without a device."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from conftest import HAS_GPU, requires_gpu

from cupyflash import bench
from cupyflash.bench import Record, Shape, timing

# ---------------------------------------------------------------------------- arguments


def test_help_runs_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "cupyflash.bench", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for flag in ("--suite", "--dtype", "--causal", "--kernel", "--kernels", "--compare", "--json", "--plot", "--mode"):
        assert flag in out.stdout


def test_defaults_are_grid_and_fp32():
    o = bench.parse_args([], has_torch=False)
    assert o.suites == ("grid", "fp32")
    assert len(o.shapes) == 48 + 5
    assert o.passes == ("fwd", "bwd")
    assert o.kernels == ("auto",)
    assert o.compare == ("naive",)
    assert o.impls == ("cupyflash", "naive") and o.primary == "cupyflash"


def test_default_compare_adds_every_sdpa_backend_when_torch_is_there():
    o = bench.parse_args([], has_torch=True)
    assert o.compare == ("naive", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
    o = bench.parse_args(["--compare", "sdpa-cudnn"], has_torch=True)
    assert o.compare == ("sdpa-cudnn",)
    assert bench.parse_args(["--compare", "none"], has_torch=True).compare == ()


def test_all_is_grid_fp32_long():
    o = bench.parse_args(["--suite", "all"], has_torch=False)
    assert o.suites == ("grid", "fp32", "long")
    assert o.shapes[-1] == Shape(1, 8, 131072, 128, True, "bfloat16", check_memory=True)


def test_filters_pick_one_grid_shape():
    argv = ["--suite", "grid", "--dtype", "bf16", "--d", "128", "--n", "2048", "--causal", "1"]
    o = bench.parse_args(argv, has_torch=False)
    assert o.shapes == (Shape(8, 16, 2048, 128, True, "bfloat16"),)


def test_several_kernel_families_side_by_side():
    o = bench.parse_args(["--kernels", "mma,portable", "--compare", "none"], has_torch=False)
    assert o.impls == ("cupyflash[mma]", "cupyflash[portable]")
    assert o.primary == "cupyflash[mma]"
    assert bench.parse_args(["--kernel", "portable"], has_torch=False).impls[0] == "cupyflash[portable]"


@pytest.mark.parametrize(
    "argv",
    [
        ["--suite", "nope"],
        ["--mode", "linear", "--suite", "grid"],
        ["--compare", "torch"],  # torch absent
        ["--compare", "tensorflow"],
        ["--dtype", "fp64"],
        ["--d", "64,x"],
        ["--kernels", "mma,tpu"],
        ["--passes", "fwd+bwd"],
        ["--n", "3"],  # filters leave nothing
        ["--runs", "0"],
    ],
)
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv, has_torch=False)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_linear_mode_shapes_and_passes():
    o = bench.parse_args(["--mode", "linear"], has_torch=True)
    assert o.passes == ("fwd", "fwd+bwd")
    assert o.compare == ("naive-linear",)
    assert o.impls[0] == "cupyflash-linear"
    assert {(s.b, s.h, s.n, s.d) for s in o.shapes} == {(4, 16, 8192, 64), (4, 16, 8192, 128), (1, 16, 32768, 64)}
    assert all(s.causal for s in o.shapes)
    with pytest.raises(SystemExit):
        bench.parse_args(["--mode", "linear", "--compare", "torch"], has_torch=True)
    o = bench.parse_args(["--mode", "linear", "--compare", "naive,fla"], has_torch=True)
    assert o.compare == ("naive-linear", "fla")
    with pytest.raises(SystemExit):  # fla is linear attention, not a softmax comparison
        bench.parse_args(["--compare", "fla"], has_torch=True)


def test_linear_decay_option(capsys):
    from cupyflash.bench.linear_impls import decay_rates

    assert not bench.parse_args(["--mode", "linear"], has_torch=True).decay
    o = bench.parse_args(["--mode", "linear", "--decay", "--compare", "naive,fla"], has_torch=True)
    assert o.decay
    with pytest.raises(SystemExit):  # softmax attention has no decay
        bench.parse_args(["--decay"], has_torch=True)
    lam = decay_rates(16)
    assert lam.dtype == np.float32 and lam.shape == (16,)
    assert abs(lam[0] - (1 - 2.0**-5)) < 1e-7 and np.all(np.diff(lam) > 0) and np.all((0 < lam) & (lam < 1))
    assert bench.main(["--mode", "linear", "--decay", "--list", "--compare", "none"]) == 0
    assert "mode linear with decay" in capsys.readouterr().out


def test_list_prints_the_plan_without_a_gpu(capsys):
    assert bench.main(["--list", "--suite", "quick", "--compare", "none"]) == 0
    out = capsys.readouterr().out
    assert out.count("fwd ") == out.count("bwd ") == len(bench.quick_shapes())
    assert "float16 B=2 H=4 N=256 D=64 full" in out


@pytest.mark.skipif(HAS_GPU, reason="checks the message a CPU-only machine gets")
def test_a_run_without_gpu_says_so():
    with pytest.raises(SystemExit) as e:
        bench.main(["--suite", "quick", "--compare", "none"])
    assert "needs a CUDA GPU" in str(e.value)


# ---------------------------------------------------------------------------- shapes


def test_grid_matches_design():
    shapes = bench.grid_shapes()
    assert len(shapes) == 6 * 2 * 2 * 2
    assert all(s.b * s.n == 16384 and s.h * s.d == 2048 for s in shapes)
    assert sorted({s.n for s in shapes}) == [512, 1024, 2048, 4096, 8192, 16384]
    assert {s.dtype for s in shapes} == {"bfloat16", "float16"}
    assert {(s.d, s.causal) for s in shapes} == {(64, False), (64, True), (128, False), (128, True)}
    assert len(set(shapes)) == len(shapes)


def test_fp32_suite_has_the_llmc_shapes():
    shapes = bench.fp32_shapes()
    assert all(s.dtype == "float32" for s in shapes)
    assert [(s.b, s.h, s.n, s.d, s.causal) for s in shapes if s.d == 64] == [
        (4, 12, 1024, 64, True), (4, 12, 2048, 64, True), (4, 12, 4096, 64, True)
    ]  # fmt: skip
    assert {s.causal for s in shapes if s.d == 128 and s.n == 4096 and s.h == 16} == {False, True}


# ---------------------------------------------------------------------------- FLOPs


def _visible_pairs(nq: int, nk: int) -> int:
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    return int((j <= i + (nk - nq)).sum())


def test_forward_flops_formula():
    # B=8, H=16, N=2048, D=128: 4 * 8 * 16 * 2048^2 * 128 = 274.9 GFLOP
    assert bench.attention_flops(8, 16, 2048, 2048, 128, False, "fwd") == 4 * 8 * 16 * 2048 * 2048 * 128
    assert bench.attention_flops(8, 16, 2048, 2048, 128, True, "fwd") == 2 * 8 * 16 * 2048 * 2048 * 128
    assert bench.attention_flops(1, 1, 3, 5, 7, False, "bwd") == 2.5 * 4 * 3 * 5 * 7
    assert bench.attention_flops(1, 1, 3, 5, 7, False, "fwd+bwd") == 3.5 * 4 * 3 * 5 * 7


@pytest.mark.parametrize("nq,nk", [(2, 4), (5, 3), (1, 9), (7, 7)])
def test_causal_flops_count_visible_pairs_when_lengths_differ(nq, nk):
    flops = bench.attention_flops(2, 3, nq, nk, 8, True, "fwd")
    if nq == nk:
        assert flops == 4 * 2 * 3 * nq * nk * 8 / 2  # the papers' convention, not N(N+1)/2
    else:
        assert math.isclose(flops, 4 * 2 * 3 * 8 * _visible_pairs(nq, nk))


def test_linear_flops_and_bad_pass():
    fwd = bench.linear_flops(4, 16, 8192, 8192, 64, True, "fwd")
    assert fwd == bench.attention_flops(4, 16, 8192, 8192, 64, True, "fwd")
    assert bench.linear_flops(4, 16, 8192, 8192, 64, True, "fwd+bwd") == 3 * fwd
    with pytest.raises(ValueError):
        bench.attention_flops(1, 1, 1, 1, 1, False, "backward")


# ---------------------------------------------------------------------------- memory arithmetic


def test_long_context_naive_scores_are_256_gib():
    (long,) = bench.long_shapes()
    assert bench.naive_scores_bytes(long) == 8 * 131072**2 * 2 == 256 * 2**30
    assert bench.linear_memory_bound(long) == 16 * 131072 * 8 * 128 * 2  # 4 GiB
    assert bench.fmt_bytes(256 * 2**30) == "256.0 GiB"


def test_naive_heads_per_chunk():
    head = bench.naive_softmax_head_bytes(16384, 2)  # 3 GiB per head
    assert head == 16384**2 * 12
    assert bench.heads_per_chunk(head, 0, 8 * 2**30) == 2
    assert bench.heads_per_chunk(head, 16384**2 * 4, 4 * 2**30) == 1  # mask + one head: exactly 4 GiB
    assert bench.heads_per_chunk(head, 16384**2 * 4, 4 * 2**30 - 1) == 0
    assert bench.heads_per_chunk(10, 0, 95) == 9
    assert bench.heads_per_chunk(10, 100, 50) == 0
    assert bench.naive_linear_head_bytes(8, 2, True) == 2 * bench.naive_linear_head_bytes(8, 2, False)


# ---------------------------------------------------------------------------- timing plans

L2 = 50 * 2**20


def test_cache_plan_rotates_small_sets_and_flushes_tiny_ones():
    assert timing.plan_cache_defeat(256 * 2**20, L2) == timing.CachePlan(1, 0)  # evicts itself
    assert timing.plan_cache_defeat(2 * L2, L2) == timing.CachePlan(1, 0)
    p = timing.plan_cache_defeat(50 * 2**20, L2)  # the llm.c N=1024 fp32 case
    assert p == timing.CachePlan(3, 0)
    assert (p.sets - 1) * 50 * 2**20 >= 2 * L2  # the others push a set out between its uses
    assert timing.plan_cache_defeat(2**20, L2) == timing.CachePlan(1, 2 * L2)
    assert timing.plan_cache_defeat(30 * 2**20, L2, max_sets=4) == timing.CachePlan(1, 2 * L2)
    with pytest.raises(ValueError):
        timing.plan_cache_defeat(0, L2)


def test_run_and_warmup_counts():
    assert timing.plan_runs(0.1, runs=30, min_runs=5, max_seconds=1.0) == 30
    assert timing.plan_runs(100.0, runs=30, min_runs=5, max_seconds=1.0) == 10
    assert timing.plan_runs(5000.0, runs=30, min_runs=5, max_seconds=1.0) == 5
    assert timing.plan_runs(5000.0, runs=3, min_runs=5, max_seconds=1.0) == 3
    assert timing.plan_warmup(0.1, warmup=3, sets=1, max_seconds=1.0) == 3
    assert timing.plan_warmup(2000.0, warmup=3, sets=1, max_seconds=1.0) == 1
    assert timing.plan_warmup(2000.0, warmup=3, sets=4, max_seconds=1.0) == 4  # touch every set
    assert timing.median_ms([3.0, 1.0, 2.0, 100.0]) == 2.5
    assert math.isclose(timing.tflops(1e12, 1000.0), 1.0)


class FakeClock:
    """Events that read a fake time advanced by the calls; records what happened in order."""

    def __init__(self, ms_per_call: float):
        self.now = 0.0
        self.ms_per_call = ms_per_call
        self.log: list[str] = []

    def event(self):
        return {"t": None}

    def record(self, ev):
        ev["t"] = self.now
        self.log.append("rec")

    def elapsed_ms(self, a, b):
        return b["t"] - a["t"]

    def synchronize(self):
        self.log.append("sync")

    def flusher(self, nbytes):
        def flush():
            self.log.append("flush")

        return flush

    def call(self, i):
        self.now += self.ms_per_call * (1 + i)  # set i takes (1 + i) units: the median shows mixing
        self.log.append(f"call{i}")


def test_measure_rotates_sets_and_never_repeats_one_back_to_back():
    clock = FakeClock(ms_per_call=1.0)
    t = timing.measure(clock.call, clock, plan=timing.CachePlan(3, 0), warmup=3, runs=9, min_runs=2)
    calls = [int(x[4:]) for x in clock.log if x.startswith("call")]
    assert all(a != b for a, b in zip(calls, calls[1:]))
    assert t.runs == 9 and t.sets == 3 and not t.flushed
    assert sorted(t.times_ms) == [1.0] * 3 + [2.0] * 3 + [3.0] * 3
    assert t.median_ms == 2.0
    assert "flush" not in clock.log


def test_measure_flushes_before_each_timed_call_and_caps_runs_by_time():
    clock = FakeClock(ms_per_call=400.0)
    t = timing.measure(clock.call, clock, plan=timing.CachePlan(1, 1234), runs=30, min_runs=2, max_seconds=1.0)
    assert t.runs == 2 and t.flushed  # 400 ms per call: 2 fit the 1 s cap (min_runs 2)
    log = clock.log
    # Every timed call (the estimate and the runs) is flush, start event, call, end event:
    # the flush stays outside the events.
    flushes = [i for i, x in enumerate(log) if x == "flush"]
    assert len(flushes) == 1 + t.runs
    assert all(log[i + 1] == "rec" and log[i + 2].startswith("call") and log[i + 3] == "rec" for i in flushes)
    assert all(x == 400.0 for x in t.times_ms)


# ---------------------------------------------------------------------------- table and JSON

ENV = {"device": "NVIDIA H100 80GB HBM3", "versions": {"cupy": "14.2.0"}, "date": "2026-11-22T00:00:00+00:00"}


def _rec(impl, tflops, pass_="fwd", n=2048, status="ok", note="", dtype="bfloat16"):
    flops = bench.attention_flops(8, 16, n, n, 128, False, pass_)
    ms = flops / (tflops * 1e12) * 1e3 if status == "ok" else None
    return Record("softmax", 16384 // n, 16, n, 128, False, dtype, pass_, impl, status, median_ms=ms,
                  tflops=tflops if status == "ok" else None, flops=flops, runs=30, sets=1, note=note, env=ENV)


def _records():
    return [
        _rec("cupyflash", 300.0),
        _rec("naive", 10.0),
        _rec("sdpa-flash", 150.0),
        _rec("sdpa-cudnn", 0, status="n/a", note="refuses"),
        _rec("cupyflash", 200.0, pass_="bwd"),
        _rec("naive", 0, pass_="bwd", status="n/a", note="naive is benchmarked forward only"),
        _rec("sdpa-flash", 250.0, pass_="bwd"),
        _rec("sdpa-cudnn", 400.0, pass_="bwd"),
        _rec("cupyflash", 310.0, n=4096),
        _rec("sdpa-flash", 0, n=4096, status="error", note="OutOfMemoryError"),
    ]


def test_table_has_ratios_and_na_cells():
    impls = ("cupyflash", "naive", "sdpa-flash", "sdpa-cudnn")
    table = bench.format_table(_records(), impls, "cupyflash")
    lines = table.splitlines()
    assert len(lines) == 2 + 3  # header, alignment row, three (shape, pass) rows
    assert "cupyflash TFLOP/s" in lines[0] and "vs sdpa-cudnn" in lines[0]
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:7] == ["8", "16", "2048", "128", "no", "bfloat16", "fwd"]
    assert cells[8:] == ["300.0", "10.0", "30.00x", "150.0", "2.00x", "n/a", "-"]
    bwd = [c.strip() for c in lines[3].strip("|").split("|")]
    assert bwd[8:] == ["200.0", "n/a", "-", "250.0", "0.80x", "400.0", "0.50x"]
    n4096 = [c.strip() for c in lines[4].strip("|").split("|")]
    assert n4096[-4:] == ["error", "-", "-", "-"]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    notes = bench.format_notes(_records())
    assert "naive is benchmarked forward only" in notes and "OutOfMemoryError" in notes


def test_json_records_carry_shape_timing_device_versions_and_date(tmp_path):
    data = json.loads(bench.records_to_json(_records()))
    assert isinstance(data, list) and len(data) == len(_records())
    for r in data:
        assert set(r) == set(bench.JSON_KEYS)
    first = data[0]
    assert first["pass"] == "fwd" and first["impl"] == "cupyflash" and first["kind"] == "timing"
    assert first["device"] == ENV["device"] and first["versions"]["cupy"] == "14.2.0" and first["date"]
    assert math.isclose(first["flops"] / (first["median_ms"] * 1e-3) / 1e12, first["tflops"])


def test_plot_series_groups_by_config_and_sorts_by_n():
    recs = [_rec("cupyflash", 310.0, n=4096), _rec("cupyflash", 300.0, n=2048), _rec("naive", 10.0)]
    recs.append(_rec("cupyflash", 0, n=8192, status="n/a"))
    series = bench.plot_series(recs)
    assert list(series) == [("softmax", "bfloat16", 128, False, "fwd")]
    assert series[("softmax", "bfloat16", 128, False, "fwd")]["cupyflash"] == [(2048, 300.0), (4096, 310.0)]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    bench.plot(_records(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------- GPU


@requires_gpu
def test_naive_attention_matches_the_reference(rng):
    import cupy

    from cupyflash import reference

    for causal in (False, True):
        q, k, v = (rng.standard_normal((2, 3, 67, 32)).astype(np.float32) for _ in range(3))
        want, _ = reference.attention_forward(q, k, v, causal=causal)
        got = bench.naive_attention_forward(*(cupy.asarray(x) for x in (q, k, v)), causal, 32**-0.5, chunk=4)
        assert np.linalg.norm(cupy.asnumpy(got) - want) / np.linalg.norm(want) < 1e-5


@requires_gpu
def test_naive_linear_gradients_match_finite_masked_products(rng):
    import cupy

    q, k, v, do = (rng.standard_normal((1, 2, 33, 16)) for _ in range(4))
    m = np.tril(np.ones((33, 33)))
    a = (q @ k.swapaxes(-1, -2)) * m
    da = (do @ v.swapaxes(-1, -2)) * m
    want = (a @ v, da @ k, da.swapaxes(-1, -2) @ q, a.swapaxes(-1, -2) @ do)
    o, (dq, dk, dv) = bench.naive_linear(*(cupy.asarray(x.astype(np.float32)) for x in (q, k, v, do)), chunk=1)
    for got, ref in zip((o, dq, dk, dv), want):
        got = cupy.asnumpy(got).reshape(ref.shape)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5


@requires_gpu
def test_quick_suite_runs_end_to_end(tmp_path, capsys):
    out = tmp_path / "quick.json"
    code = bench.main(["--suite", "quick", "--compare", "naive", "--runs", "3", "--min-runs", "2",
                       "--max-seconds", "0.2", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "cupyflash TFLOP/s" in table
    data = json.loads(out.read_text())
    ok = [r for r in data if r["impl"] == "cupyflash" and r["status"] == "ok"]
    assert len(ok) == 2 * len(bench.quick_shapes())
    assert all(r["tflops"] > 0 and r["median_ms"] > 0 for r in ok)


def test_naive_is_unavailable_for_bfloat16_only():
    from cupyflash.bench.impls import Unavailable, require_cupy_matmul

    require_cupy_matmul("float16")
    require_cupy_matmul("float32")
    with pytest.raises(Unavailable, match="bfloat16"):
        require_cupy_matmul("bfloat16")


# ---------------------------------------------------------------------------- overhead suite


def test_overhead_suite_lists_its_calls_without_a_gpu(capsys):
    o = bench.parse_args(["--suite", "overhead"], has_torch=False)
    assert o.shapes == (Shape(1, 8, 128, 64, False, "bfloat16"), Shape(4, 12, 256, 64, False, "float32"))
    assert bench.main(["--suite", "overhead", "--list", "--compare", "none"]) == 0
    out = capsys.readouterr().out
    assert "300 back-to-back calls" in out
    for row in ("forward bfloat16 B=1 H=8 N=128 D=64", "backward bfloat16 B=1 H=8 N=128 D=64",
                "forward float32 B=4 H=12 N=256 D=64", "backward float32 B=4 H=12 N=256 D=64",
                "linear forward bfloat16 B=1 H=8 N=128 D=64 causal",
                "decode bfloat16 B=1 Hq=32 Hk=8 Nq=1 cache=4096 D=128"):  # fmt: skip
        assert f"  {row}\n" in out + "\n"
    with pytest.raises(SystemExit):  # its rows are calls, not TFLOP/s: it runs alone
        bench.parse_args(["--suite", "overhead,grid"], has_torch=False)


def test_overhead_table_and_json(tmp_path):
    from cupyflash.bench.overhead import format_overhead_table, plan_rows

    rows = plan_rows(bench.parse_args(["--suite", "overhead"], has_torch=False).shapes)
    assert [(r.call, r.shape.dtype) for r in rows][-2:] == [("linear forward", "bfloat16"), ("decode", "bfloat16")]
    s = rows[0].shape
    base = dict(workload="softmax", b=s.b, h=s.h, n=s.n, d=s.d, causal=s.causal, dtype=s.dtype, pass_="fwd",
                kind="overhead", status="ok", runs=300)  # fmt: skip
    recs = [Record(impl="cupyflash", median_ms=0.0215, gpu_ms=0.0071, host_ms=0.0211, **base),
            Record(impl="sdpa", median_ms=0.0202, gpu_ms=0.0093, host_ms=0.0198, **base)]  # fmt: skip
    table = format_overhead_table(recs, rows).splitlines()
    assert "ours us/call" in table[0] and "SDPA us/call" in table[0] and "GPU us (queued)" in table[0]
    assert len(table) == 2 + len(rows)
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:4]]
    assert cells[0] == ["forward bfloat16 B=1 H=8 N=128 D=64", "21.5", "20.2", "21.1", "19.8", "7.1", "9.3"]
    assert cells[1][1:] == ["-"] * 6  # the backward row has no record
    path = tmp_path / "o.json"
    bench.report.write_json(recs, str(path))
    got = json.loads(path.read_text())
    assert set(got[0]) == set(bench.JSON_KEYS) and got[0]["kind"] == "overhead" and got[0]["gpu_ms"] == 0.0071
    # The decode row: its own workload, found by the table under its label.
    dec = Record(impl="cupyflash", median_ms=0.012, gpu_ms=0.02, host_ms=0.011,
                 **dict(base, workload="decode", b=1, h=32, n=4096, d=128, dtype="bfloat16"))  # fmt: skip
    last = format_overhead_table([dec], rows).splitlines()[-1]
    assert [c.strip() for c in last.strip("|").split("|")] == [
        "decode bfloat16 B=1 Hq=32 Hk=8 Nq=1 cache=4096 D=128", "12.0", "-", "11.0", "-", "20.0", "-"]


# ---------------------------------------------------------------------------- variants suite


def test_variants_suite_lists_its_rows_without_a_gpu(capsys):
    o = bench.parse_args(["--suite", "variants"], has_torch=False)
    assert len(o.shapes) == 8 and {s.dtype for s in o.shapes} == {"bfloat16"}
    assert all(s.b * s.n == 16384 and s.h * s.d == 2048 for s in o.shapes)
    assert {(s.n, s.d) for s in o.shapes} == {(4096, 64), (4096, 128), (16384, 64), (16384, 128)}
    assert bench.main(["--suite", "variants", "--list", "--compare", "none", "--d", "128", "--n", "16384"]) == 0
    out = capsys.readouterr().out
    assert "visible pairs" in out and "Flex" not in out
    shape = "bfloat16 B=1 H=16 N=16384 D=128"
    for case in ("plain", "plain causal", "window 1024 causal", "softcap 50", "alibi causal", "sinks causal"):
        for p in ("fwd", "bwd"):
            assert f"  {case} {shape} {p}: " in out
    assert len(out.strip().splitlines()) == 1 + 6 * 2
    assert f"  plain {shape} fwd: 2199.0 GFLOP" in out  # 4 * 16 * 128 * 16384^2
    with pytest.raises(SystemExit):  # its rows have their own table: it runs alone
        bench.parse_args(["--suite", "variants,grid"], has_torch=False)


def test_variants_filters_pick_cases_by_causality_and_pass():
    from cupyflash.bench.variants import plan_rows

    o = bench.parse_args(["--suite", "variants", "--causal", "0", "--passes", "bwd", "--n", "4096"], has_torch=True)
    rows = plan_rows(o.shapes, o.passes)
    assert [(r.case.name, r.shape.d, r.pass_) for r in rows] == [
        ("plain", 64, "bwd"), ("softcap 50", 64, "bwd"), ("plain", 128, "bwd"), ("softcap 50", 128, "bwd")]
    assert "FlexAttention alongside" in bench.cli.format_plan(o)


@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 9), (9, 5), (64, 64)])
def test_visible_pairs_match_the_dense_rule_and_keys_of(nq, nk):
    from cupyflash.bench.variants import CASES, visible_pairs
    from cupyflash.variants import Variant

    variants = [c.variant for c in CASES] + [Variant.of(False, (3, 2), 0.0, False, False),
                                             Variant.of(False, (-1, 0), 0.0, False, False),
                                             Variant.of(True, (0, 0), 0.0, False, False)]  # fmt: skip
    for v in variants:
        dense = int(v.visible(np, np.arange(nq), np.arange(nk), nq, nk).sum())
        rows = sum(max(0, e - b) for b, e in (v.keys_of(i, i + 1, nq, nk) for i in range(nq)))
        assert visible_pairs(v, nq, nk) == dense == rows, v
    window = CASES[2].variant  # (1024, 0) at 16k: each row sees min(i + 1, 1025) keys
    assert visible_pairs(window, 16384, 16384) == 1025 * 16384 - 1024 * 1025 // 2
    assert visible_pairs(CASES[1].variant, 16384, 16384) == 16384 * 16385 // 2


def _variants_records(rows):
    """Fake timings: ours takes as long as its visible area at 400 TFLOP/s fwd, Flex twice as long."""
    from cupyflash.bench.variants import _record

    out = []
    for r in rows:
        ms = r.flops / 400e12 * 1e3 * (1.25 if r.case.key == "alibi" else 1.0)
        out.append(_record(r, "cupyflash", ENV, status="ok", median_ms=ms, tflops=timing.tflops(r.flops, ms), runs=50))
        if r.case.flex:
            out.append(_record(r, "flex", ENV, status="ok", median_ms=2 * ms, tflops=timing.tflops(r.flops, 2 * ms)))
        else:
            out.append(_record(r, "flex", ENV, status="n/a", note="Flex cannot add a sink logit"))
    return out


def test_variants_table_ratios_notes_and_json(tmp_path):
    from cupyflash.bench.variants import format_variants_table, plan_rows

    rows = plan_rows(bench.parse_args(["--suite", "variants", "--d", "128", "--n", "16384"], has_torch=False).shapes,
                     ("fwd", "bwd"))  # fmt: skip
    recs = _variants_records(rows)
    lines = format_variants_table(recs, rows).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "row", "pass", "ours ms", "ours TFLOP/s", "vs plain", "Flex ms", "Flex/ours time"]
    cells = {tuple(c.strip() for c in line.strip("|").split("|"))[:2]: [c.strip() for c in line.strip("|").split("|")]
             for line in lines[2:2 + len(rows)]}  # fmt: skip
    shape = "bfloat16 B=1 H=16 N=16384 D=128"
    assert cells[(f"plain {shape}", "fwd")][3:] == ["400.0", "1.00x", f"{2 * 2199.0 / 400:.3f}", "2.00x"]
    assert cells[(f"alibi causal {shape}", "bwd")][3:5] == ["320.0", "0.80x"]
    assert cells[(f"sinks causal {shape}", "fwd")][5:] == ["n/a", "-"]
    assert len({len(line) for line in lines[:2 + len(rows)]}) == 1  # aligned
    notes = [line for line in lines if line.startswith("- window 1024")]
    assert "- flex n/a: Flex cannot add a sink logit" in lines
    assert len(notes) == 2 and "8.3x faster than plain causal (visible-area ratio 8.3x)" in notes[0]
    assert "16.5x faster than plain full (visible-area ratio 16.5x)" in notes[0]
    path = tmp_path / "v.json"
    bench.report.write_json(recs, str(path))
    got = json.loads(path.read_text())
    assert all(set(r) == set(bench.JSON_KEYS) and r["kind"] == "variants" for r in got)
    assert {r["workload"] for r in got} == {"softmax+plain", "softmax+causal", "softmax+window1024",
                                            "softmax+softcap50", "softmax+alibi", "softmax+sinks"}  # fmt: skip


def test_run_variants_records_without_a_gpu(monkeypatch):
    """The record flow of run_variants, with the GPU parts replaced: every (row, impl) gets one record,
    Flex's say n/a with the reason when it is missing."""
    from cupyflash.bench import device, variants

    calls = []
    monkeypatch.setattr(variants, "inputs", lambda shape, seed: {})
    monkeypatch.setattr(variants, "ours", lambda case, p, x: calls.append((case.key, p)) or (lambda: None))
    monkeypatch.setattr(variants, "median_ms", lambda call, clock, context: (2.0, 50))
    monkeypatch.setattr(variants.timing, "CupyClock", lambda: None)
    monkeypatch.setattr(device, "free_device_memory", lambda: None)
    rows = variants.plan_rows(bench.parse_args(["--suite", "variants", "--n", "4096"], has_torch=True).shapes,
                              ("fwd", "bwd"))  # fmt: skip
    saved = []
    recs = variants.run_variants(rows, True, "no torch here", 0, ENV, lambda m: None,
                                 lambda r: saved.append(len(r)))
    assert len(recs) == 2 * len(rows) == 2 * 2 * 6 * 2
    assert saved == [8, 24, 32, 48]  # per (n, d) shape: 2 full cases, then 4 causal ones
    ours = [r for r in recs if r.impl == "cupyflash"]
    assert all(r.status == "ok" and r.median_ms == 2.0 and r.runs == 50 for r in ours)
    assert all(r.status == "n/a" and r.note == "no torch here" for r in recs if r.impl == "flex")
    assert len(calls) == len(rows)
    recs = variants.run_variants(rows, False, None, 0, ENV, lambda m: None)
    assert {r.impl for r in recs} == {"cupyflash"}


# ---------------------------------------------------------------------------- dropout and masks suites


def test_dropout_suite_lists_its_rows_without_a_gpu(capsys):
    from cupyflash.bench.dropout import plan_rows

    o = bench.parse_args(["--suite", "dropout"], has_torch=False)
    assert {s.dtype for s in o.shapes} == {"bfloat16"} and o.passes == ("bwd", "fwd+bwd")
    assert all(s.b * s.n == 16384 and s.h * s.d == 2048 for s in o.shapes)
    assert {(s.n, s.d, s.causal) for s in o.shapes} == {
        (n, d, c) for n in (1024, 2048, 4096, 8192, 16384) for d in (64, 128) for c in (False, True)}
    rows = plan_rows(o.shapes, o.passes, o.kernels, sdpa=False)
    det = [r for r in rows if r.pass_ == "bwd"]
    drop = [r for r in rows if r.pass_ == "fwd+bwd"]
    assert len(det) == 20 * 2 + 12  # wgmma and mma everywhere, portable to N = 4k
    assert {r.shape.n for r in det if r.kernel == "portable"} == {1024, 2048, 4096}
    assert all(r.impls[:2] == ("cupyflash+deterministic", "cupyflash") for r in det)
    assert all(r.impls[2:] == (("cupyflash+separate-dq",) if r.kernel == "portable" else ()) for r in det)
    assert len(drop) == 16 and min(r.shape.n for r in drop) == 2048
    assert all(r.impls == ("cupyflash+dropout", "cupyflash") and r.kernel == "auto" for r in drop)
    assert rows[0].flops == bench.attention_flops(16, 32, 1024, 1024, 64, False, "bwd")
    assert drop[0].flops == bench.attention_flops(8, 32, 2048, 2048, 64, False, "fwd+bwd")
    assert bench.main(["--suite", "dropout", "--list", "--compare", "none"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("suite dropout") and len(out) == 1 + len(rows)
    assert ("  deterministic[portable] bfloat16 B=16 H=32 N=1024 D=64 full bwd: 343.6 GFLOP; "
            "cupyflash+deterministic, cupyflash, cupyflash+separate-dq") in out
    assert ("  dropout0.1 bfloat16 B=1 H=16 N=16384 D=128 causal fwd+bwd: 3848.3 GFLOP; "
            "cupyflash+dropout, cupyflash") in out
    with pytest.raises(SystemExit):  # its rows have their own table: it runs alone
        bench.parse_args(["--suite", "dropout,grid"], has_torch=False)


def test_dropout_filters_families_passes_and_sdpa():
    from cupyflash.bench.dropout import plan_rows

    o = bench.parse_args(["--suite", "dropout", "--kernels", "mma,portable", "--passes", "bwd", "--n", "4096",
                          "--d", "128", "--causal", "1"], has_torch=True)  # fmt: skip
    rows = plan_rows(o.shapes, o.passes, o.kernels, sdpa=bench.cli.overhead_uses_sdpa(o))
    assert [(r.case, r.pass_) for r in rows] == [("deterministic[mma]", "bwd"), ("deterministic[portable]", "bwd")]
    o = bench.parse_args(["--suite", "dropout", "--kernel", "mma", "--passes", "fwd+bwd", "--n", "2048", "--d", "64",
                          "--causal", "0"], has_torch=True)  # fmt: skip
    (row,) = bench.cli.paired_rows(o)
    assert row.case == "dropout0.1" and row.kernel == "mma" and row.impls[-1] == "sdpa-flash"
    assert bench.cli.paired_rows(bench.parse_args(["--suite", "dropout", "--compare", "none", "--passes", "fwd+bwd",
                                                   "--n", "2048", "--d", "64", "--causal", "0"],
                                                  has_torch=True))[0].impls[-1] == "cupyflash"  # fmt: skip


@pytest.mark.parametrize("argv", [
    ["--suite", "dropout", "--passes", "fwd"],
    ["--suite", "dropout", "--dtype", "fp32"],  # bf16 only: no shape left
    ["--suite", "dropout", "--n", "512"],
    ["--suite", "masks", "--passes", "bwd"],
    ["--suite", "masks", "--kernels", "mma,portable"],
    ["--suite", "masks", "--causal", "1"],  # not causal: no shape left
    ["--suite", "masks,dropout"],
])  # fmt: skip
def test_dropout_and_masks_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv, has_torch=False)
    assert e.value.code == 2 and "usage:" in capsys.readouterr().err


def test_masks_suite_lists_its_rows_without_a_gpu(capsys):
    o = bench.parse_args(["--suite", "masks"], has_torch=True)
    assert {s.dtype for s in o.shapes} == {"bfloat16", "float32"} and o.passes == ("fwd", "fwd+bwd")
    assert all(s.b * s.n == 16384 and s.h * s.d == 2048 and not s.causal for s in o.shapes)
    assert len(o.shapes) == 2 * 2 * 4
    rows = bench.cli.paired_rows(o)
    assert len(rows) == 4 * len(o.shapes)
    assert [(r.case, r.pass_) for r in rows[:4]] == [
        ("bias", "fwd"), ("bias_grad", "fwd+bwd"), ("mask", "fwd"), ("mask", "fwd+bwd")]
    assert all(r.impls == ("cupyflash", "sdpa-efficient") and r.kernel == "auto" for r in rows)
    rows = bench.cli.paired_rows(bench.parse_args(["--suite", "masks", "--compare", "none", "--kernel", "portable",
                                                   "--passes", "fwd+bwd"], has_torch=True))  # fmt: skip
    assert all(r.impls == ("cupyflash",) and r.kernel == "portable" and r.pass_ == "fwd+bwd" for r in rows)
    assert bench.main(["--suite", "masks", "--list", "--compare", "none", "--dtype", "fp32", "--d", "128",
                       "--n", "8192"]) == 0  # fmt: skip
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("suite masks") and len(out) == 1 + 4
    assert "  bias_grad float32 B=2 H=16 N=8192 D=128 full fwd+bwd: 3848.3 GFLOP; cupyflash" in out


def test_flex_suite_lists_its_rows_without_a_gpu(capsys):
    o = bench.parse_args(["--suite", "flex"], has_torch=True)
    assert all(s.b == 1 and s.n == 16384 and s.h * s.d == 2048 and s.causal and s.dtype == "bfloat16"
               for s in o.shapes) and len(o.shapes) == 2  # fmt: skip
    rows = bench.cli.paired_rows(o)
    assert [(r.case, r.pass_) for r in rows[:5]] == [("doc8", "fwd"), ("doc8", "fwd+bwd"), ("prefix-lm", "fwd"),
                                                     ("prefix-lm", "fwd+bwd"), ("first-call", "fwd")]  # fmt: skip
    assert rows[0].impls == ("cupyflash", "cupyflash-no-block-mask", "cupyflash-dense-causal", "flex-attention")
    assert rows[4].impls == ("cupyflash",)
    o = bench.parse_args(["--suite", "flex", "--compare", "none", "--passes", "fwd+bwd"], has_torch=True)
    assert all("flex-attention" not in r.impls and r.case != "first-call" for r in bench.cli.paired_rows(o))
    with pytest.raises(SystemExit):
        bench.parse_args(["--suite", "flex", "--kernels", "mma,portable"], has_torch=False)
    assert bench.main(["--suite", "flex", "--list", "--compare", "none", "--d", "128"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("suite flex") and len(out) == 1 + 5


@pytest.mark.skipif(HAS_GPU, reason="checks the message a CPU-only machine gets")
@pytest.mark.parametrize("suite", ["dropout", "masks", "flex"])
def test_dropout_and_masks_without_gpu_say_so(suite):
    with pytest.raises(SystemExit) as e:
        bench.main(["--suite", suite, "--compare", "none"])
    assert "needs a CUDA GPU" in str(e.value)


def test_paired_table_ratios_and_notes(tmp_path):
    from cupyflash.bench import dropout
    from cupyflash.bench.paired import format_table, record

    o = bench.parse_args(["--suite", "dropout", "--n", "2048", "--d", "64", "--causal", "0"], has_torch=True)
    rows = bench.cli.paired_rows(o)
    assert [r.case for r in rows] == ["deterministic[wgmma]", "deterministic[mma]", "deterministic[portable]",
                                      "dropout0.1"]  # fmt: skip
    recs = []
    for r in rows:
        for i, impl in enumerate(r.impls):
            if impl == "sdpa-flash":
                recs.append(record(r, impl, ENV, status="error", note="RuntimeError: no kernel"))
            elif r.kernel == "wgmma":
                recs.append(record(r, impl, ENV, status="n/a", note="TypeError: wgmma needs sm_90"))
            else:
                ms = 2.0 * (1 + i * 0.25)  # the base 2 ms, the next 2.5 ms, then 3 ms
                recs.append(record(r, impl, ENV, status="ok", median_ms=ms, tflops=timing.tflops(r.flops, ms), runs=9))
    lines = format_table(recs, rows, dropout.NAMES).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == ["row", "pass", "ms", "TFLOP/s", "default ms", "default/base", "separate dQ ms",
                      "separate dQ/base", "SDPA FLASH ms", "SDPA FLASH/base"]  # fmt: skip
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:2 + len(rows)]]
    assert cells[0][2:] == ["n/a", "-", "n/a", "-", "-", "-", "-", "-"]
    flops = rows[1].flops
    assert cells[1][0] == "deterministic[mma] bfloat16 B=8 H=32 N=2048 D=64 full [deterministic]"
    assert cells[1][2:] == ["2.000", f"{flops / 2e-3 / 1e12:.1f}", "2.500", "1.25x", "-", "-", "-", "-"]
    assert cells[2][4:8] == ["2.500", "1.25x", "3.000", "1.50x"]
    assert cells[3][2:] == ["2.000", f"{rows[3].flops / 2e-3 / 1e12:.1f}", "2.500", "1.25x", "-", "-", "error", "-"]
    assert len({len(line) for line in lines[:2 + len(rows)]}) == 1  # aligned
    assert "- sdpa-flash error: RuntimeError: no kernel" in lines
    assert "- cupyflash n/a: TypeError: wgmma needs sm_90" in lines
    path = tmp_path / "d.json"
    bench.report.write_json(recs, str(path))
    got = json.loads(path.read_text())
    assert all(set(r) == set(bench.JSON_KEYS) and r["kind"] == "dropout" for r in got)
    assert {r["workload"] for r in got} == {"softmax+deterministic[wgmma]", "softmax+deterministic[mma]",
                                            "softmax+deterministic[portable]", "softmax+dropout0.1"}  # fmt: skip


def test_run_rows_records_without_a_gpu(monkeypatch):
    """run_rows with the GPU parts replaced: one record per (row, impl), inputs once per shape, a family's
    refusal (a TypeError inside ``refused``) is n/a, any other exception an error, and the run goes on."""
    from cupyflash.bench import device, masks, paired

    made, shapes = [], []

    def make(row, impl, x):
        made.append((row.case, row.pass_, impl))
        if impl == "sdpa-efficient" and row.case == "mask":
            raise RuntimeError("out of memory")
        if row.shape.dtype == "float32" and impl == "cupyflash":
            with paired.refused():
                raise TypeError("the mma family needs fp16/bf16")
        return (lambda: None), paired.no_context, (lambda: None)

    monkeypatch.setattr(paired, "median_ms", lambda ready: (4.0, 12))
    monkeypatch.setattr(device, "free_device_memory", lambda: None)
    rows = masks.plan_rows(bench.parse_args(["--suite", "masks", "--d", "64", "--n", "1024"], has_torch=True).shapes,
                           ("fwd", "fwd+bwd"), "mma", sdpa=True)  # fmt: skip
    saved = []
    recs = paired.run_rows(rows, lambda s, seed: shapes.append(s) or {}, make, 0, ENV, lambda m: None,
                           lambda r: saved.append(len(r)))  # fmt: skip
    assert len(recs) == len(made) == 2 * len(rows) == 16 and saved == [8, 16] and len(shapes) == 2
    status = {(r.dtype, r.workload, r.pass_, r.impl): (r.status, r.note) for r in recs}
    assert status[("bfloat16", "softmax+bias_grad", "fwd+bwd", "cupyflash")][0] == "ok"
    assert status[("bfloat16", "softmax+mask", "fwd", "sdpa-efficient")] == ("error", "RuntimeError: out of memory")
    refusal = ("n/a", "Unavailable: the mma family needs fp16/bf16")
    assert status[("float32", "softmax+bias", "fwd", "cupyflash")] == refusal
    assert all(r.median_ms == 4.0 and r.runs == 12 and r.kind == "masks" for r in recs if r.status == "ok")


def test_dropout_and_masks_calls_run_on_the_numpy_backend(rng):
    """The timed calls' keywords (deterministic, dropout_p/seed, bias, bias_grad, mask) reach the API: run once
    on NumPy arrays (the NumPy backend, kernel "auto"); a named family there is the API's TypeError, which
    ``refused`` turns into an n/a cell."""
    from cupyflash.bench import dropout, masks
    from cupyflash.bench.impls import Unavailable
    from cupyflash.bench.paired import Row

    shape = Shape(2, 2, 48, 16, True, "float32")
    x = {n: rng.standard_normal((2, 2, 48, 16)).astype(np.float32) for n in ("q", "k", "v", "do")}
    x["bias"] = rng.standard_normal((1, 2, 48, 48)).astype(np.float32)
    x["mask"] = rng.random((1, 2, 48, 48)) < masks.KEEP
    rows = dropout.plan_rows([shape], ("bwd",), ("auto",), sdpa=False)
    assert [r.kernel for r in rows] == ["wgmma", "mma", "portable"]
    for r in rows:  # the rows name a family: refused on NumPy arrays
        for impl in r.impls:
            with pytest.raises(Unavailable, match="CUDA kernel family"):
                dropout.make(r, impl, x)
    rows = [Row("dropout", "deterministic", shape, "bwd", ("cupyflash+deterministic", "cupyflash")),
            Row("dropout", "dropout0.1", shape, "fwd+bwd", ("cupyflash+dropout", "cupyflash"))]
    rows += masks.plan_rows([Shape(2, 2, 48, 16, False, "float32")], ("fwd", "fwd+bwd"), "auto", sdpa=False)
    assert len(rows) == 2 + 4
    for r in rows:
        for impl in r.impls:
            call, context, _ = (dropout if r.kind == "dropout" else masks).make(r, impl, x)
            with context():
                call()
# ---------------------------------------------------------------------------- varlen suite


def test_varlen_suite_lists_its_rows_without_a_gpu(capsys):
    from cupyflash.bench.varlen import LENGTHS, causal_pairs, dense_length

    o = bench.parse_args(["--suite", "varlen"], has_torch=False)
    assert [(s.b, s.h, s.n, s.d, s.causal, s.dtype) for s in o.shapes] == [
        (1, 32, 16384, 64, True, "bfloat16"), (1, 16, 16384, 128, True, "bfloat16")]
    assert sum(LENGTHS) == 16384 and max(LENGTHS) >= 8000 and sum(n <= 512 for n in LENGTHS) >= 8
    assert all(n % 16 for n in LENGTHS if n != 64)  # multiples of no tile (but one)
    assert abs(dense_length(LENGTHS) ** 2 / 2 - causal_pairs(LENGTHS)) < dense_length(LENGTHS)
    assert bench.main(["--suite", "varlen", "--list", "--compare", "none", "--d", "128"]) == 0
    out = capsys.readouterr().out
    assert "real work" in out and "SDPA" not in out and len(out.strip().splitlines()) == 3
    gflop = 4 * 16 * 128 * causal_pairs(LENGTHS) / 1e9
    assert f"D=128 tokens=16384 docs={len(LENGTHS)} fwd: {gflop:.1f} GFLOP" in out
    with pytest.raises(SystemExit):  # its rows have their own table: it runs alone
        bench.parse_args(["--suite", "varlen,grid"], has_torch=False)


def test_run_varlen_records_and_table_without_a_gpu(monkeypatch):
    """run_varlen's record flow with the GPU parts replaced, then the table's ratios: packed at 300 TFLOP/s of
    real work, dense same work at 320, padded 4x packed's time, SDPA missing."""
    from cupyflash.bench import device, varlen

    times = {"packed": 1.0, "dense same work": 300 / 320, "padded": 4.0}
    monkeypatch.setattr(varlen, "_inputs", lambda shape, seed: {})
    monkeypatch.setattr(varlen, "_packed", lambda p, x: "packed")
    monkeypatch.setattr(varlen, "_dense", lambda p, shape, b, n, seed: "padded" if b > 1 else "dense same work")
    monkeypatch.setattr(varlen.timing, "CupyClock", lambda: None)
    monkeypatch.setattr(device, "free_device_memory", lambda: None)
    rows = varlen.plan_rows(bench.parse_args(["--suite", "varlen", "--d", "64"], has_torch=False).shapes,
                            ("fwd", "bwd"))  # fmt: skip
    unit = {r.pass_: r.flops / 300e12 * 1e3 for r in rows}  # packed's ms at 300 TFLOP/s
    state = {}

    def fake_median(call, clock, context):
        return times[call] * unit[state["pass"]], 50

    monkeypatch.setattr(varlen, "median_ms", fake_median)
    recs = []
    for r in rows:
        state["pass"] = r.pass_
        recs += varlen.run_varlen([r], False, None, 0, ENV, lambda m: None)
    assert [(r.pass_, r.impl, r.status) for r in recs] == [
        (p, i, "n/a" if i == "sdpa-nested" else "ok") for p in ("fwd", "bwd") for i in varlen.IMPLS]
    lines = varlen.format_varlen_table(recs).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:4]]
    assert cells[0][:2] == ["bfloat16 H=32 D=64", "fwd"] and cells[1][1] == "bwd"
    for c in cells:
        assert c[6:] == ["300.0", "0.94x", "4.00x", "-"]
        assert c[5] == "n/a"
    assert any(line.startswith("- sdpa-nested n/a: no torch comparison") for line in lines)


def test_decode_line_gives_both_times_and_both_ratios():
    from cupyflash.bench import decode

    row = {"nq": 1, "b": 8, "nk": 32768, "copy_TBps": 2.9, "floor_ms": 0.36, "ours_ms": 0.40, "ours_gpu_ms": 0.37,
           "graph_ms": 0.368, "paged16_ms": 0.41, "paged16_gpu_ms": 0.372, "sdpa_cudnn_ms": 0.38,
           "sdpa_cudnn_gpu_ms": 0.37 * 1.05, "of_copy_bw": 0.9, "gpu_of_copy_bw": 0.973}
    line = decode._line(row)
    assert "ours 0.400/0.370 ms" in line and "paged16 0.410/0.372" in line
    assert "0.95x per call, 1.05x GPU" in line and "90%/97%" in line
    del row["sdpa_cudnn_ms"], row["sdpa_cudnn_gpu_ms"]
    assert "cuDNN" not in decode._line(row)
