// Shared by every kernel family: element types, conversions, constants.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace cupyflash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// log2 on the MUFU path (~2^-22 relative).
__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Inputs are float, __half or __nv_bfloat16; all arithmetic is float.
template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// The block's barrier; with kThreads > 0, named barrier 1 of the first kThreads threads instead: a kernel whose
// helper warpgroup (the wgmma backward's keep-bit drawer) takes no part in its loop's barriers.
template <int kThreads = 0>
__device__ __forceinline__ void sync_block() {
  if constexpr (kThreads == 0) {
    __syncthreads();
  } else {
    static_assert(kThreads % 32 == 0, "whole warps");
    asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory");
  }
}

}  // namespace cupyflash
