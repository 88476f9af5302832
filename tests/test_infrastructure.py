"""CPU tests of the shared machinery: layout merging, launch-plan checks, the builder."""
from __future__ import annotations

import numpy as np
import pytest

from cupyflash import _dtypes
from cupyflash._layout import _mergeable
from cupyflash.kernels import build
from cupyflash.plans import A100, H100, LaunchPlan, cdiv


def test_mergeable_batch_dims():
    x = np.empty((3, 4, 5, 6, 8), np.float32)
    assert _mergeable(x.shape[:2], x.strides[:2])
    t = x.transpose(1, 0, 2, 3, 4)  # swapped batch dims: not one stride
    assert not _mergeable(t.shape[:2], t.strides[:2])
    s = x[::2]  # every other outer index: still one stride per dim, but no longer mergeable
    assert not _mergeable(s.shape[:2], s.strides[:2])
    one = x[:, :1]  # size-1 dims never block a merge
    assert _mergeable(one.shape[:2], one.strides[:2])
    bnhd = np.empty((2, 7, 3, 8), np.float32).transpose(0, 2, 1, 3)  # (B, N, H, D) seen as (B, H, N, D)
    assert _mergeable(bnhd.shape[:1], bnhd.strides[:1])


def test_cdiv():
    assert [cdiv(n, 64) for n in (0, 1, 64, 65, 1000)] == [0, 1, 1, 2, 16]


def test_launch_plan_rejects_bad_geometry():
    LaunchPlan("f.cu", "k<1>", (10, 65535, 1), (128, 1, 1), 0)
    with pytest.raises(ValueError, match="grid"):
        LaunchPlan("f.cu", "k<1>", (10, 70000, 1), (128, 1, 1), 0)
    with pytest.raises(ValueError, match="grid"):
        LaunchPlan("f.cu", "k<1>", (0, 1, 1), (128, 1, 1), 0)
    with pytest.raises(ValueError, match="threads"):
        LaunchPlan("f.cu", "k<1>", (1, 1, 1), (1024, 2, 1), 0)


def test_device_limits_constants():
    assert A100.compute_capability == 80 and H100.max_shared_per_block > A100.max_shared_per_block


def test_ctype_for_every_supported_dtype():
    assert set(_dtypes.CTYPE) == set(_dtypes.SUPPORTED)
    assert _dtypes.BFLOAT16 is not None, "bfloat16 needs ml_dtypes"


def test_compile_options_carry_a_source_hash():
    opts = build.compile_options()
    assert "-std=c++17" in opts
    assert any(o.startswith("-DCUPYFLASH_SOURCE_HASH=") for o in opts)
    assert any(o == f"-I{build.source_dir()}" for o in opts)

