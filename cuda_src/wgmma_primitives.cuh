// Hopper (sm_90a) warpgroup MMA building blocks: shared-memory matrix descriptors, wgmma.mma_async
// with both operands in shared memory (SS) or A in registers (RS), and the fences around them.
//
// Operand tiles use the 128-byte swizzle that TileLayout<64> already writes (mma_primitives.cuh):
// a tile of R rows x 64 elements (16-bit), row r at 128 r bytes, 16-byte chunk c at (c ^ r % 8). A head
// dim of 128 is two such tiles one after the other. With the tile 1024-byte aligned this is the
// canonical 128B-swizzle layout of the PTX ISA ("Shared Memory Matrix Layout"):
//   K-major (Q as A and K as B of Q K^T): 8-row groups 1024 bytes apart (SBO); a k16 step is the
//     start address moved by 32 bytes inside the 128-byte row.
//   MN-major (V as B of P V, .trans): K (keys) runs down the rows, 8-row groups 1024 bytes apart (SBO);
//     the next 64 columns of N are the next tile, LBO bytes on.
// Register fragments of m64nNk16 are those of mma.sync m16n8k16 per warp (warp w of the warpgroup owns
// rows 16w..16w+15): accumulator d[j] is the C tile of columns 8j..8j+7, and an A fragment is two C
// tiles packed to 16 bits, so P goes from S into P V without leaving registers.
#pragma once
#include "mma_primitives.cuh"

namespace cupyflash {
namespace wgmma {

using mma::uint32_t;
using uint64_t = unsigned long long;

// Descriptor of a 128B-swizzled tile at shared address addr (lbo: bytes to the next 64 MN columns;
// ignored for K-major operands).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo = 16) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (1ull << 62);
}

// Orders this thread's register writes (accumulators, A fragments) before the next wgmma.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Wait until at most N committed wgmma groups of this warpgroup are in flight.
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes (cp.async, st.shared) made visible to the async proxy that wgmma reads through;
// each writing thread runs it before the barrier that publishes the tile.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving reads or writes of wgmma operands (accumulators, register A
// fragments) across a wait(), and from reusing A's registers while a product may still read them.
template <int NT>
__device__ __forceinline__ void fence_operands(float (&d)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
  }
}

template <int NK>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[NK][4]) {
#pragma unroll
  for (int j = 0; j < NK; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[j][e])::"memory");
  }
}

// d (+)= A B for one k16 step, m64 x N, A and B from descriptors; accumulate = 0 overwrites d.
// kTransA/kTransB = 0: the operand is K-major (K contiguous: Q and K of Q K^T); 1: MN-major (K runs
// down the rows: V of P V; dS^T and K of the backward's dQ = dS K).
template <typename T, int N>
struct Wgmma;  // the instantiations, spelled out below: inline PTX needs every accumulator register named

template <typename T, int N, int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void mma_ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {
  Wgmma<T, N>::template ss<kTransA, kTransB>(d, a, b, accumulate);
}
// d += A B for one k16 step: A (this thread's m16n8k16-style fragment) in registers, B MN-major (.trans).
template <typename T, int N>
__device__ __forceinline__ void mma_rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b) {
  Wgmma<T, N>::rs(d, a, b);
}

#define CUPYFLASH_ACC4(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define CUPYFLASH_ACC_N64                                                                                    \
  CUPYFLASH_ACC4(0), CUPYFLASH_ACC4(1), CUPYFLASH_ACC4(2), CUPYFLASH_ACC4(3), CUPYFLASH_ACC4(4),             \
      CUPYFLASH_ACC4(5), CUPYFLASH_ACC4(6), CUPYFLASH_ACC4(7)
#define CUPYFLASH_ACC_N128                                                                                   \
  CUPYFLASH_ACC_N64, CUPYFLASH_ACC4(8), CUPYFLASH_ACC4(9), CUPYFLASH_ACC4(10), CUPYFLASH_ACC4(11),           \
      CUPYFLASH_ACC4(12), CUPYFLASH_ACC4(13), CUPYFLASH_ACC4(14), CUPYFLASH_ACC4(15)
#define CUPYFLASH_REGS_N64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define CUPYFLASH_REGS_N128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

// Wgmma<CT, N> for PTX type TYPE. The operands after the N/2 accumulator registers are numbered from
// X = N/2: SS takes a, b, accumulate, transA, transB as %X..%X+4; RS takes a0..a3, b, 1 as %X..%X+5.
#define CUPYFLASH_WGMMA(CT, TYPE, N, REGS, ACC, X0, X1, X2, X3, X4, X5)                                         \
  template <>                                                                                                   \
  struct Wgmma<CT, N> {                                                                                         \
    template <int kTransA, int kTransB>                                                                         \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t a, uint64_t b, int accumulate) {   \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" X2 ", 0;\n"                                              \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS ", %" X0 ", %" X1    \
                   ", p, 1, 1, %" X3 ", %" X4 ";\n}\n"                                                           \
                   : ACC                                                                                        \
                   : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));                              \
    }                                                                                                           \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t b) {       \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" X5 ", 0;\n"                                              \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " " REGS ", {%" X0 ", %" X1   \
                   ", %" X2 ", %" X3 "}, %" X4 ", p, 1, 1, 1;\n}\n"                                               \
                   : ACC                                                                                        \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                               \
    }                                                                                                           \
  };

CUPYFLASH_WGMMA(__half, "f16", 64, CUPYFLASH_REGS_N64, CUPYFLASH_ACC_N64, "32", "33", "34", "35", "36", "37")
CUPYFLASH_WGMMA(__nv_bfloat16, "bf16", 64, CUPYFLASH_REGS_N64, CUPYFLASH_ACC_N64, "32", "33", "34", "35", "36", "37")
CUPYFLASH_WGMMA(__half, "f16", 128, CUPYFLASH_REGS_N128, CUPYFLASH_ACC_N128, "64", "65", "66", "67", "68", "69")
CUPYFLASH_WGMMA(__nv_bfloat16, "bf16", 128, CUPYFLASH_REGS_N128, CUPYFLASH_ACC_N128, "64", "65", "66", "67", "68", "69")

#undef CUPYFLASH_WGMMA
#undef CUPYFLASH_REGS_N128
#undef CUPYFLASH_REGS_N64
#undef CUPYFLASH_ACC_N128
#undef CUPYFLASH_ACC_N64
#undef CUPYFLASH_ACC4

}  // namespace wgmma
}  // namespace cupyflash
