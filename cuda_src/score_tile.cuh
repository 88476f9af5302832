// Mask and bias tiles staged in shared memory (issue 17, speed): the Hopper kernels copy a step's rows of the
// score arrays with cp.async in the same group as the K/V (forward) or Q/dO (backward) tiles they are scored
// with, and ArrayScore (attention_policy.cuh) reads them from shared memory. Without staging each score waited
// on its own global load (one at a time: a register each would spill), which held a bias forward to ~90 of the
// plain kernel's ~450 TFLOP/s (benchmarks/NOTES.md).
#pragma once
#include "attention_params.cuh"
#include "common.cuh"
#include "mma_primitives.cuh"  // cp_async_16

namespace cupyflash {

// The layout of one staged tile: kRows x kCols of the bias (BiasT, when kBias), then of the mask (bytes, when
// kMask). Rows are padded by 16 bytes, which keeps both fragment layouts' reads free of bank conflicts for 1-
// and 2-byte elements (query-major: 8 rows x 4 lanes of a row; key-major: 4 rows, 2 apart, x 8 lanes).
template <class BiasT, bool kMask, bool kBias, int kRows, int kCols>
struct ScoreTile {
  static constexpr int kTileRows = kRows, kTileCols = kCols;
  static constexpr int kBiasPitch = kCols * static_cast<int>(sizeof(BiasT)) + 16;
  static constexpr int kMaskPitch = kCols + 16;
  static constexpr int kBiasBytes = kBias ? kRows * kBiasPitch : 0;
  static constexpr int kBytes = kBiasBytes + (kMask ? kRows * kMaskPitch : 0);
};

namespace staging {

// The element types by size (the copy moves bits: a bf16 bias and a bool mask alike).
template <int kSize> struct Bits;
template <> struct Bits<1> { using type = unsigned char; };
template <> struct Bits<2> { using type = unsigned short; };
template <> struct Bits<4> { using type = unsigned; };

template <int kSize>
__device__ __forceinline__ void store(unsigned dst, unsigned x) {
  if constexpr (kSize == 1) asm volatile("st.shared.u8 [%0], %1;\n" ::"r"(dst), "r"(x) : "memory");
  else if constexpr (kSize == 2) asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(dst), "r"(x) : "memory");
  else asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(dst), "r"(x) : "memory");
}

}  // namespace staging

// One array's kRows x kCols tile at (q0, k0) of its (b, h) slice (kSize-byte elements, element strides sq, sk;
// 32-bit inside a slice) into shared memory at dst, kPitch bytes a row, by kThreads threads (thread tid). A 16-byte
// chunk of a row is one cp.async when the row is contiguous (sk = 1) and the chunk 16-byte aligned, zero-filled
// past nq x nk (those scores are masked by the kernels' built-in mask, or belong to padding rows); otherwise
// (strided or misaligned rows, a key axis that broadcasts) it is read element by element, synchronously.
template <int kSize, int kRows, int kCols, int kPitch, int kThreads>
__device__ __forceinline__ void stage_array_tile(unsigned dst, const void* slice, int sq, int sk, int nq, int nk,
                                                 int q0, int k0, int tid) {
  using E = typename staging::Bits<kSize>::type;
  constexpr int kPer = 16 / kSize;  // elements per chunk
  constexpr int kChunks = kCols / kPer;
  constexpr int kTotal = kRows * kChunks;
  static_assert(kCols % kPer == 0 && kPitch % 16 == 0, "whole 16-byte chunks, 16-byte aligned rows");
#pragma unroll
  for (int it = 0; it < (kTotal + kThreads - 1) / kThreads; ++it) {
    const int idx = it * kThreads + tid;
    if (kTotal % kThreads != 0 && idx >= kTotal) break;
    const int r = idx / kChunks;
    const int c = idx % kChunks;
    const int q = q0 + r, k = k0 + c * kPer;
    const int n = q < nq ? min(max(nk - k, 0), kPer) : 0;  // elements of this chunk inside the problem
    const unsigned d = dst + r * kPitch + c * 16;
    const E* src = static_cast<const E*>(slice) + (n > 0 ? q * sq + k * sk : 0);
    if (n == 0 || (sk == 1 && (reinterpret_cast<unsigned long long>(src) & 15) == 0)) {
      mma::cp_async_16(d, src, n * kSize);
    } else {
#pragma unroll
      for (int e = 0; e < kPer; ++e) staging::store<kSize>(d + e * kSize, e < n ? src[e * sk] : 0u);
    }
  }
}

}  // namespace cupyflash
