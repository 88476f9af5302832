"""The built wheel ships the CUDA sources, and the installed package finds them."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_source_dir_holds_every_kernel_source():
    from cupyflash.kernels.build import source_dir

    names = {p.name for p in source_dir().iterdir()}
    assert {"common.cuh", "portable_forward.cu", "portable_backward.cu", "mma_forward.cu"} <= names


@pytest.mark.skipif(not (ROOT / "setup.cfg").exists(), reason="not a source checkout")
def test_wheel_contains_cuda_src(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    # Build from a clean copy: an in-tree build/ folder could leak stale files into the wheel.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns("build", "*.egg-info", ".git", ".snap", "__pycache__"))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = tmp_path.glob("cupyflash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    srcs = {p.name for p in (ROOT / "cuda_src").iterdir() if p.suffix in (".cu", ".cuh")}
    assert srcs, "no CUDA sources in the checkout"
    for s in srcs:
        assert f"cupyflash/cuda_src/{s}" in names, f"{s} missing from the wheel"
    assert "cupyflash/kernels/build.py" in names
