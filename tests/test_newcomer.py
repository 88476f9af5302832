"""A newcomer's first commands on a CPU-only machine: they explain the missing GPU in one line,
run the NumPy quickstart, describe the installation and never end in a traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupyflash import _cuda_env

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = _cuda_env.gpu_status()
needs_no_gpu = pytest.mark.skipif(NO_GPU is None, reason="a GPU is here: these check the CPU-only path")


def run_module(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` with this checkout importable, from another directory, as a user would."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


# ---------------------------------------------------------------------------- _cuda_env


@needs_no_gpu
def test_gpu_status_gives_a_one_line_reason_here():
    assert isinstance(NO_GPU, str) and NO_GPU and "\n" not in NO_GPU


@needs_no_gpu
def test_missing_driver_is_named_as_such():
    cupy = pytest.importorskip("cupy")
    if cupy.cuda.runtime.driverGetVersion() != 0:
        pytest.skip("an NVIDIA driver is installed here")
    assert NO_GPU.startswith("no NVIDIA driver found (CuPy could not initialise CUDA): ")
    assert "insufficient" in NO_GPU  # CuPy's own words stay, after ours


class FakeCudaError(RuntimeError):
    pass


def test_explain_no_driver(monkeypatch):
    monkeypatch.setattr(_cuda_env, "_driver_version", lambda: 0)
    e = FakeCudaError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")
    msg = _cuda_env.explain(e)
    assert msg.startswith("no NVIDIA driver found (CuPy could not initialise CUDA): FakeCudaError: cudaErrorInsuff")


def test_explain_old_driver(monkeypatch):
    monkeypatch.setattr(_cuda_env, "_driver_version", lambda: 12080)
    monkeypatch.setattr(_cuda_env, "_runtime_version", lambda: 13000)
    msg = _cuda_env.explain(FakeCudaError("cudaErrorInsufficientDriver: CUDA driver version is insufficient"))
    assert "driver supports only CUDA 12.8" in msg and "CUDA 13.0" in msg and ".[cuda12]" in msg


def test_explain_no_device(monkeypatch):
    monkeypatch.setattr(_cuda_env, "_driver_version", lambda: 13000)
    msg = _cuda_env.explain(FakeCudaError("cudaErrorNoDevice: no CUDA-capable device is detected"))
    assert msg.startswith("no NVIDIA GPU found")


def test_explain_cupy_missing():
    msg = _cuda_env.explain(ModuleNotFoundError("No module named 'cupy'", name="cupy"))
    assert msg.startswith("CuPy is not installed") and 'pip install ".[cuda13]"' in msg


def test_explain_missing_libraries():
    cublas = _cuda_env.explain(ImportError("libcublas.so.13: cannot open shared object file"))
    assert "cuBLAS" in cublas and ".[cuda13-full]" in cublas
    nvrtc = _cuda_env.explain(RuntimeError("CuPy failed to load libnvrtc.so.13"))
    assert "NVRTC" in nvrtc and ".[cuda13]" in nvrtc


def test_cuda_include_dir_holds_the_half_headers():
    pytest.importorskip("cupy")
    d = _cuda_env.cuda_include_dir()
    if d is None:
        pytest.skip("no CUDA headers installed (cupyflash[cuda13] brings them)")
    assert (Path(d) / "cuda_fp16.h").exists() and (Path(d) / "cuda_bf16.h").exists()


# ---------------------------------------------------------------------------- commands


def test_quickstart_runs_and_passes(capsys):
    from cupyflash import quickstart

    assert quickstart.main() == 0
    out = capsys.readouterr().out
    assert "NumPy backend" in out and out.rstrip().splitlines()[-1].startswith("ok")


@needs_no_gpu
def test_bench_without_gpu_says_why_and_runs_the_quickstart(tmp_path):
    r = run_module("-m", "cupyflash.bench", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"no GPU: {NO_GPU}"
    assert "NumPy quickstart" in lines[1] and lines[-1].startswith("ok")
    assert "Traceback" not in r.stderr


def test_info_runs(tmp_path):
    r = run_module("-m", "cupyflash.info", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    for label in ("cupyflash", "numpy", "cupy", "device", "nvrtc", "kernel cache"):
        assert any(line.startswith(label) for line in r.stdout.splitlines()), (label, r.stdout)


def test_info_kernel_table_for_a_named_gpu():
    from cupyflash import _dtypes, info, plans

    lines = info.kernel_table(plans.H100)
    assert len(lines) == 1 + len(_dtypes.SUPPORTED)
    assert all(len(line.split()) == 1 + len(info.HEAD_DIMS) for line in lines)
    assert "portable" in lines[1]  # float32 runs the portable family everywhere


# ---------------------------------------------------------------------------- examples

CPU_EXAMPLES = ["numpy_quickstart.py"]
GPU_EXAMPLES = ["quickstart.py", "long_context.py", "interop.py", "linear_attention.py", "flex_masks.py"]


@pytest.mark.parametrize("script", CPU_EXAMPLES + GPU_EXAMPLES)
def test_example_exits_0_on_this_machine_without_a_traceback(script, tmp_path):
    if script in GPU_EXAMPLES and NO_GPU is None:
        pytest.skip("a GPU is here: the GPU suite runs this example for real")
    r = run_module(str(ROOT / "examples" / script), cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    if script in GPU_EXAMPLES and "quickstart" not in script:
        assert r.stdout.strip() == f"skipped: {script} needs an NVIDIA GPU (no GPU: {NO_GPU})"


@needs_no_gpu
def test_train_gpt_says_it_falls_back_to_the_cpu(tmp_path):
    r = run_module(str(ROOT / "examples" / "train_gpt.py"), "--n-layer", "1", "--n-head", "2", "--d-model", "32",
                   "--seq-len", "16", "--batch", "2", "--steps", "2", "--sample-chars", "0", cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[0].startswith(f"no GPU: {NO_GPU}; training on the CPU")
