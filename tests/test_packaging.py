"""The built wheel ships the CUDA sources, and the installed package finds them."""
from __future__ import annotations

import os
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


# ---------------------------------------------------------------------------- metadata and extras


def _setup_cfg():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


@pytest.mark.skipif(not (ROOT / "setup.cfg").exists(), reason="not a source checkout")
def test_small_cuda_extras_and_full_ones():
    extras = {k: v.split() for k, v in _setup_cfg()["options.extras_require"].items()}
    for major in ("12", "13"):
        small = " ".join(extras[f"cuda{major}"])
        # What the kernels need (NVRTC, the cudart headers) and cupy.random (cuRAND), and no more.
        assert f"cupy-cuda{major}x" in small and "[ctk]" not in small
        assert f"cuda-toolkit[cudart,nvrtc,curand]=={major}.*" in small
        assert "[ctk]" in " ".join(extras[f"cuda{major}-full"])


@pytest.mark.skipif(not (ROOT / "setup.cfg").exists(), reason="not a source checkout")
def test_license_and_metadata():
    meta = _setup_cfg()["metadata"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert meta["license"] == "MIT" and "LICENSE" in meta["license_files"]
    assert "License :: OSI Approved :: MIT License" in meta["classifiers"]
    assert "Homepage" in meta["project_urls"] and meta["keywords"]


@pytest.mark.skipif(not (ROOT / ".ci" / "run").exists(), reason="not a source checkout")
def test_ci_runs_exactly_the_readme_test_command_and_cleans_up():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    (test_cmd,) = [ln for ln in readme.splitlines() if ln.startswith("python3 -m pip install") and "pytest" in ln]
    assert test_cmd in ci.splitlines()
    assert "set -euo pipefail" in ci and "trap 'rm -rf" in ci and "--no-cache-dir" not in ci


def _link_site_packages(names: list[str], into: Path) -> None:
    """Symlink everything in the site folders that hold ``names`` into ``into``, except
    cupyflash itself (an install of it, or its editable hooks): the throwaway venv gets what
    building and importing need, with their dependencies, and no cupyflash to hide ours."""
    import importlib.util

    sites = set()
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            pytest.skip(f"{name} is not installed here")
        sites.add(Path(spec.origin).parent.parent)
    for site in sites:
        for p in site.iterdir():
            skip = p.name.startswith(("cupyflash", "__editable__")) or p.suffix == ".pth"
            if not skip and not (into / p.name).exists():
                (into / p.name).symlink_to(p)


@pytest.mark.skipif(not (ROOT / "setup.cfg").exists(), reason="not a source checkout")
def test_editable_install_imports_from_another_directory(tmp_path):
    """README "Development": ``python3 -m pip install --no-deps --no-build-isolation -e .`` gives
    an install that imports from anywhere and finds the CUDA sources (cuda_src is mapped to the
    package cupyflash.cuda_src, which an editable install must keep)."""
    pytest.importorskip("setuptools")
    pytest.importorskip("pip")
    import venv

    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env)
    py = env / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    deps = tmp_path / "deps"
    deps.mkdir()
    _link_site_packages(["pip", "setuptools", "numpy", "ml_dtypes"], deps)
    Path(purelib, "deps.pth").write_text(f"{deps}\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_REQUIRE_VIRTUALENV")}
    r = subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "-e", str(ROOT)],
                       capture_output=True, text=True, env=clean, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    # cupyflash.cuda_src itself, not build.source_dir(), which falls back to the checkout.
    check = "import cupyflash, cupyflash.cuda_src as s; print(cupyflash.__file__); print(list(s.__path__)[0])"
    r = subprocess.run([str(py), "-c", check], capture_output=True, text=True, env=clean, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    init, src = r.stdout.split()
    assert Path(init) == ROOT / "cupyflash" / "__init__.py"
    assert Path(src).resolve() == (ROOT / "cuda_src").resolve()

