// 2^x on the FMA pipe, for kernels whose special-function unit (MUFU: ex2, tanh, lg2; 16 results per clock and
// SM on sm_80/sm_90 against 128 FMAs) is their bottleneck: the softcapped strips, which pay a MUFU tanh per score
// on top of the exponential (mma_softmax.cuh moves part of their exponentials here, FlashAttention-4's remedy).
#pragma once

namespace cupyflash {

// Cody-Waite: x = n + f with n = round(x) and f in [-1/2, 1/2]; 2^f by a polynomial, 2^n by adding n to the
// exponent field. Adding 1.5 * 2^23 rounds x to an integer held in the low mantissa bits (no float-to-int
// conversion, which is itself a quarter-rate instruction); shifted left by 23 those bits are n << 23 (the
// constant's own bits vanish: its low 9 bits are 0). The polynomial is the relative minimax of degree 3 with
// constant term 1 (max relative error 1.01e-4, below half an ulp of the fp16/bf16 P that P V multiplies; exactly 1
// at x = 0, the row maximum). x is clamped to -127, where n = -127, f = 0, p = 1 and the bits cancel: masked
// scores (-inf) give exactly 0. For x <= 127 (a softmax's exponents are <= 0); NaN gives 0. The arithmetic is
// mirrored in NumPy by tests/test_fma_exp2.py: keep the two in step.
constexpr float kExp2C1 = 0x1.62f5fcp-1f, kExp2C2 = 0x1.f00c52p-3f, kExp2C3 = 0x1.c2a20ep-5f;
constexpr float kRoundMagic = 12582912.f;  // 1.5 * 2^23

__device__ __forceinline__ float exp2_fma(float x) {
  x = fmaxf(x, -127.f);
  const float j = x + kRoundMagic;        // round(x) in the low mantissa bits
  const float f = x - (j - kRoundMagic);  // exact
  const float p = fmaf(fmaf(fmaf(kExp2C3, f, kExp2C2), f, kExp2C1), f, 1.f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(j) << 23));
}

}  // namespace cupyflash
