"""NVRTC compiles every kernel instantiation for each target architecture with no spills.

Needs no GPU: NVRTC and the CUDA headers come from the pip CUDA packages
(``cupy-cuda13x[ctk]``). The compiles run in a process pool once per session.
"""
from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor

import pytest

try:
    from cupy.cuda import nvrtc

    nvrtc.getVersion()
    NVRTC_REASON = None
except Exception as e:  # pragma: no cover - depends on the machine
    NVRTC_REASON = f"NVRTC unavailable ({type(e).__name__}: {e})"

pytestmark = pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON))

#: Every family must build for these; the tensor-core family also for the consumer parts.
ARCHS = {
    "portable": ("sm_80", "sm_90a"),
    "mma": ("sm_80", "sm_86", "sm_89", "sm_90a"),
    "linear": ("sm_80", "sm_90a"),
    "wgmma": ("sm_90a",),  # Hopper-only instructions
}


def all_jobs() -> list[tuple[str, str, str, str]]:
    from cupyflash.kernels import linear, mma, portable, wgmma

    jobs = []
    for fam in (portable, mma, linear, wgmma):
        name = getattr(fam, "NAME", fam.__name__.rsplit(".", 1)[-1])
        for source, expr in fam.instantiations():
            for arch in ARCHS.get(name, ("sm_80", "sm_90a")):
                jobs.append((name, source, expr, arch))
    return jobs


def _compile(job):
    from cupyflash.kernels.build import CompileError, nvrtc_compile

    _, source, expr, arch = job
    try:
        return nvrtc_compile(source, expr, arch)
    except CompileError as e:
        return str(e)


@pytest.fixture(scope="session")
def compiled() -> dict:
    jobs = all_jobs()
    with ProcessPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(_compile, jobs, chunksize=1))
    return dict(zip(jobs, results))


def test_every_family_has_instantiations():
    names = {job[0] for job in all_jobs()}
    assert {"portable", "mma", "linear", "wgmma"} <= names


@pytest.mark.parametrize("job", all_jobs(), ids=lambda j: f"{j[2]}@{j[3]}")
def test_compiles_without_spills(job, compiled):
    usage = compiled[job]
    assert not isinstance(usage, str), usage
    print(usage.line())
    assert not usage.spills, usage.line()
    assert usage.stack_frame == 0, usage.line()
    assert 0 < usage.registers <= 255, usage.line()
