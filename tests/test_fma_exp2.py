"""exp2_fma (cuda_src/fma_exp2.cuh): the FMA-pipe 2^x that the softcapped strips use for part of their
exponentials. The CPU tests evaluate the header's arithmetic step by step in NumPy float32 (its constants read from
the header itself) over a dense sweep; the GPU test runs the device function and compares it with that emulation
and with exp2."""
from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import HAS_GPU, requires_gpu

from cupyflash.kernels.build import compile_options, read_source

#: The header's bound (its comment): max relative error of the degree-3 polynomial on [-1/2, 1/2] in float32.
MAX_REL = 1.02e-4


def header_constants() -> dict[str, np.float32]:
    text = read_source("fma_exp2.cuh")
    found = dict(re.findall(r"\b(kExp2C[123]|kRoundMagic) = ([0-9a-fx.p+-]+)f", text))
    assert set(found) == {"kExp2C1", "kExp2C2", "kExp2C3", "kRoundMagic"}, found
    return {k: np.float32(float.fromhex(v) if "x" in v else float(v)) for k, v in found.items()}


def fma32(a, b, c):
    """fmaf in float32: a * b is exact in float64 (24 + 24 bits), so only the float64 sum's rounding and the final
    one differ from a single rounding, which can move a result by 1 ulp in rare ties."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def exp2_fma_numpy(x: np.ndarray) -> np.ndarray:
    """The header's arithmetic in float32, step by step."""
    c = header_constants()
    x = np.fmax(np.asarray(x, np.float32), np.float32(-127.0))  # fmaxf (np.fmax): NaN gives -127
    j = (x + c["kRoundMagic"]).astype(np.float32)
    f = (x - (j - c["kRoundMagic"]).astype(np.float32)).astype(np.float32)
    one = np.ones_like(f)
    p = fma32(fma32(fma32(np.full_like(f, c["kExp2C3"]), f, np.full_like(f, c["kExp2C2"])), f,
                    np.full_like(f, c["kExp2C1"])), f, one)  # fmt: skip
    bits = p.view(np.int32).astype(np.int64) + (j.view(np.int32).astype(np.int64) << 23)
    return (bits & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def sweep() -> np.ndarray:
    """Dense over the exponents a softmax makes (x <= 0), plus the edges."""
    dense = np.linspace(-130.0, 0.0, 2_000_001, dtype=np.float64).astype(np.float32)
    fine = np.linspace(-2.0, 0.0, 1_000_001, dtype=np.float64).astype(np.float32)
    halves = np.arange(-127.0, 0.5, 0.5, dtype=np.float32)  # round-half cases of the magic add
    near = np.concatenate([np.nextafter(halves, np.float32(-np.inf)), np.nextafter(halves, np.float32(np.inf))])
    edges = np.array([0.0, -0.0, -1e-30, 1e-7, 0.49, 3.0, 100.0, -126.0, -126.5, -127.0, -200.0, -3e38],
                     dtype=np.float32)  # fmt: skip
    return np.concatenate([dense, fine, halves, near, edges])


def test_relative_error_over_the_normal_range():
    x = sweep()
    x = x[(x >= -126.0) & (x <= 100.0)]  # results normal floats
    got = exp2_fma_numpy(x).astype(np.float64)
    ref = np.exp2(x.astype(np.float64))
    rel = np.abs(got / ref - 1.0)
    assert rel.max() <= MAX_REL, f"max relative error {rel.max():.3g} at x = {x[np.argmax(rel)]}"
    assert rel.max() >= 0.9e-4  # the sweep reaches the polynomial's extremes (not a vacuous check)


def test_exact_points_and_masked_scores():
    got = exp2_fma_numpy(np.array([0.0, -0.0, -1.0, -10.0, -126.0], np.float32))
    np.testing.assert_array_equal(got, np.array([1.0, 1.0, 0.5, 2.0**-10, 2.0**-126], np.float32))
    # masked scores (-inf), anything at or below -127 and NaN: exactly +0 (P V and the row sum add nothing)
    low = np.array([-np.inf, -3e38, -1000.0, -127.5, -127.0, np.nan], np.float32)
    out = exp2_fma_numpy(low)
    assert np.all(out.view(np.uint32) == 0), out


def test_monotone_and_bounded_below_normal_range():
    # between -127 and -126 the result is a denormal (no flush): non-negative, below 2^-126, never garbage
    x = np.linspace(-127.0, -126.0, 100_001, dtype=np.float64).astype(np.float32)
    out = exp2_fma_numpy(x).astype(np.float64)
    assert np.all(out >= 0.0) and np.all(out <= 2.0**-126 * (1 + MAX_REL))
    # monotone over the whole sweep (to within the polynomial's error at the n boundaries)
    y = np.sort(sweep()[sweep() <= 0.0])
    v = exp2_fma_numpy(y).astype(np.float64)
    assert np.all(np.diff(v) >= -2 * MAX_REL * v[1:])


# ----------------------------------------------------------------------------------------------------- the GPU

_KERNEL = r"""
#include "fma_exp2.cuh"
extern "C" __global__ void exp2_fma_kernel(const float* x, float* y, float* y_mufu, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    y[i] = cupyflash::exp2_fma(x[i]);
    float e;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x[i]));
    y_mufu[i] = e;
  }
}
"""


@requires_gpu
@pytest.mark.gpu
def test_device_function_matches_emulation_and_exp2():
    import cupy

    x = sweep()
    x = np.concatenate([x, np.array([-np.inf, np.nan], np.float32)])
    xd = cupy.asarray(x)
    y = cupy.full(x.shape, np.nan, np.float32)  # poisoned
    y_mufu = cupy.full(x.shape, np.nan, np.float32)
    mod = cupy.RawModule(code=_KERNEL, options=compile_options())
    kern = mod.get_function("exp2_fma_kernel")
    n = x.size
    kern(((n + 255) // 256,), (256,), (xd, y, y_mufu, np.int32(n)))
    got, mufu = y.get(), y_mufu.get()
    emu = exp2_fma_numpy(x)
    # the emulation's float64 fma may differ from the device's fused one by an ulp in rare ties
    ulps = np.abs(got.view(np.int32).astype(np.int64) - emu.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1, f"device differs from the emulation by {ulps.max()} ulp at x = {x[np.argmax(ulps)]}"
    normal = (x >= -126.0) & (x <= 0.0)
    rel = np.abs(got[normal].astype(np.float64) / mufu[normal].astype(np.float64) - 1.0)
    assert rel.max() <= MAX_REL + 2.0**-21  # ex2.approx is itself ~2^-22 relative
    assert np.all(got[x <= -127.0].view(np.uint32) == 0) and got[-1] == 0.0 and got[-2] == 0.0
