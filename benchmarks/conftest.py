"""pytest-benchmark suites need a CUDA device and pytest-benchmark; without either, every
benchmark is skipped with the reason (never an error)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cupyflash.bench import gpu_unavailable_reason


def _skip_reason() -> str | None:
    if importlib.util.find_spec("pytest_benchmark") is None:
        return "pytest-benchmark is not installed (pip install pytest-benchmark)"
    reason = gpu_unavailable_reason()
    return None if reason is None else f"GPU benchmark: {reason}"


SKIP_REASON = _skip_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SKIP_REASON is None:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    here = Path(__file__).parent
    for item in items:  # the hook sees every collected item: mark only ours
        if here in Path(str(item.path)).parents:
            item.add_marker(skip)


if SKIP_REASON is not None and importlib.util.find_spec("pytest_benchmark") is None:

    @pytest.fixture
    def benchmark() -> None:  # stands in so collection works; every test is skipped anyway
        return None
