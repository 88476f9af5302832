// Tensor-core building blocks for sm_80+ (inline PTX): cp.async, ldmatrix, mma.sync m16n8k16,
// and the shared-memory tile layout that keeps ldmatrix and cp.async free of bank conflicts.
//
// Fragment layouts of mma.m16n8k16 (lane = 4*g + t, g = lane/4 row group, t = lane%4):
//   A (16x16, row-major): a[0] = (row g,   cols 2t..2t+1)   a[1] = (row g+8, cols 2t..2t+1)
//                         a[2] = (row g,   cols 2t+8..+9)   a[3] = (row g+8, cols 2t+8..+9)
//   B (16x8,  col-major): b[0] = (k 2t..2t+1, col g)         b[1] = (k 2t+8..+9, col g)
//   C (16x8, f32):        c[0..1] = (row g, cols 2t..2t+1)  c[2..3] = (row g+8, cols 2t..2t+1)
// Two neighbouring C tiles (cols 0..7 and 8..15) packed to 16 bits are exactly one A fragment,
// which is why P (and dS) never leave registers on the way into the next product.
#pragma once
#include "common.cuh"

namespace cupyflash {
namespace mma {

// NVRTC ships no <cstdint>/<type_traits>: the two things needed from them.
using uint32_t = unsigned int;
using int64_t = long long;
template <typename A, typename B> inline constexpr bool is_same_v = false;
template <typename A> inline constexpr bool is_same_v<A, A> = true;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ------------------------------------------------------------------------------ cp.async

// 16-byte global->shared copy that bypasses L1. src_bytes < 16 zero-fills the tail; 0 reads nothing,
// which is how partial tiles (rows past N, columns past D) become zeros without a branch.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// The same copy for data read once (decode's K/V cache), with an L2 evict-first policy (from l2_evict_first).
// Measured on decode (H100, benchmarks/NOTES.md 2026-11-25): 1-3.8% less GPU time; a 256-byte L2 prefetch hint,
// alone or beside it, changed nothing. tests/test_sass.py checks its uses from the SASS (s26: ptxas once read the
// policy from an odd register, an illegal instruction).
__device__ __forceinline__ unsigned long long l2_evict_first() {
  unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void cp_async_16_once(uint32_t dst, const void* src, int src_bytes,
                                                 unsigned long long policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes), "l"(policy) : "memory");
}
// 4-byte variant (through L1), for per-row statistics that carry no 16-byte alignment.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ------------------------------------------------------------------------------ ldmatrix

// Four 8x8 b16 matrices; lane i gives the address of row i%8 of matrix i/8, and register j of
// every lane receives matrix j in the A/B fragment order above.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
// Transposed: lane (g, t) receives rows 2t, 2t+1 of column g; used where the stored rows are the
// contraction index (V in P V, dO in P^T dO, Q in dS^T Q, K in dS K).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ------------------------------------------------------------------------------ mma

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (is_same_v<T, __half>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(is_same_v<T, __nv_bfloat16>, "mma needs __half or __nv_bfloat16");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// One k16 step of a warp's tile, acc[m][n] += A_m B_n: kM 16-row A fragments already in registers,
// kN 8-column B fragments read here two per ldmatrix.x4 (.trans where B's stored rows are the
// contraction index); b_addr(n2) is the smem address of fragments 2 n2 and 2 n2 + 1.
template <typename T, bool kTransB, int kM, int kN, typename BAddr>
__device__ __forceinline__ void mma_k16(float (&acc)[kM][kN][4], const uint32_t (&a)[kM][4], BAddr b_addr) {
  static_assert(kN % 2 == 0, "B fragments come in pairs");
#pragma unroll
  for (int n2 = 0; n2 < kN / 2; ++n2) {
    uint32_t b[4];
    if constexpr (kTransB) {
      ldmatrix_x4_trans(b, b_addr(n2));
    } else {
      ldmatrix_x4(b, b_addr(n2));
    }
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      mma_16816<T>(acc[m][2 * n2], a[m], b[0], b[1]);
      mma_16816<T>(acc[m][2 * n2 + 1], a[m], b[2], b[3]);
    }
  }
}

// The same for one 16-row strip of A (a 1 x kN tile).
template <typename T, bool kTransB, int kN, typename BAddr>
__device__ __forceinline__ void mma_k16(float (&acc)[kN][4], const uint32_t (&a)[4], BAddr b_addr) {
  mma_k16<T, kTransB>(reinterpret_cast<float(&)[1][kN][4]>(acc), reinterpret_cast<const uint32_t(&)[1][4]>(a), b_addr);
}

// Two floats rounded to T and packed lo | hi << 16 (lo is the lower column of a fragment pair).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
}

// The A fragment of k16 step kk of a product whose A operand is a C strip held in registers (P, P^T,
// dS^T): C tiles 2kk and 2kk+1, rounded to T. A C strip of 2K n8 tiles is the A operand of K steps.
template <typename T, int NT>
__device__ __forceinline__ void pack_a_step(uint32_t (&a)[4], const float (&c)[NT][4], int kk) {
  a[0] = pack2<T>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<T>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<T>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<T>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}
template <typename T, int K>
__device__ __forceinline__ void pack_a(uint32_t (&a)[K][4], const float (&c)[2 * K][4]) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk) pack_a_step<T>(a[kk], c, kk);
}

// The inverse of pack2: two T packed lo | hi << 16, as floats.
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t x) {
  if constexpr (is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<__half2*>(&x));
  } else {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
  }
}

// ------------------------------------------------------------------------------ smem tiles

// A tile of rows x D elements (16-bit) in shared memory, addressed by (row, 16-byte chunk).
// When a row spans a multiple of 8 chunks (128 bytes), chunk c of row r lives at c ^ (r % 8): the 8
// rows one ldmatrix reads then hit 8 different bank groups. Other widths get one spare chunk per
// row instead (row pitch = odd multiple of 16 bytes), which spreads 8 rows over 8 bank groups too.
template <int D>
struct TileLayout {
  static_assert(D % 8 == 0, "tile width must be a whole number of 16-byte chunks");
  static constexpr bool kSwizzle = D % 64 == 0;
  static constexpr int kPitch = kSwizzle ? D : D + 8;  // elements per row in smem

  __device__ static __forceinline__ int offset(int row, int chunk) {
    if constexpr (kSwizzle) {
      return row * kPitch + ((chunk ^ (row & 7)) << 3);
    } else {
      return row * kPitch + (chunk << 3);
    }
  }
};

// Per-lane ldmatrix row addresses for chunk pairs (2*ks + cb), ks = 0, 1, ...
// With the swizzle, chunk c of row r sits at byte 16 * ((c % 8) ^ (r % 8)) of 128-byte group c / 8.
// By default the four possible patterns (ks % 4) live in four registers. kXor: when cb % 8 is 0 or 1,
// (2*ks + cb) % 8 = (2*ks % 8) ^ (cb % 8), so the lane's part stays pre-XORed in one register and the
// ks part is a compile-time XOR of bits 4..6 plus an immediate (3 registers fewer, one LOP3 per
// ldmatrix); this needs the tile base 128-byte aligned (every tile is: the dynamic smem base is, and
// swizzled rows are 128-byte multiples). Which form leaves ptxas more room differs per kernel.
template <int D, bool kXor = false>
struct LdmRows {
  using L = TileLayout<D>;
  static constexpr bool kFast = L::kSwizzle && kXor;
  static constexpr int kRegs = L::kSwizzle && !kXor ? 4 : 1;
  uint32_t off[kRegs];
  __device__ __forceinline__ LdmRows(int row, int cb) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) off[i] = static_cast<uint32_t>(L::offset(row, 2 * i + cb)) * 2u;
  }
  // Shared address of chunk 2*ks + cb of (row + row_shift) in the tile at base; row_shift a multiple of 8.
  __device__ __forceinline__ uint32_t at(uint32_t base, int ks, int row_shift = 0) const {
    const uint32_t shift = static_cast<uint32_t>(row_shift * L::kPitch * 2);
    if constexpr (kFast) {
      return ((base + off[0]) ^ static_cast<uint32_t>((2 * ks & 7) << 4)) + static_cast<uint32_t>((ks >> 2) * 128) +
             shift;
    } else if constexpr (L::kSwizzle) {
      return base + off[ks & 3] + static_cast<uint32_t>((ks >> 2) * 128) + shift;
    } else {
      return base + off[0] + static_cast<uint32_t>(ks * 32) + shift;
    }
  }
};

// x, in a value the compiler cannot see through: what is computed from it inside a loop stays there
// instead of being hoisted into registers that stay live through the loop (at 255 registers,
// recomputing a few 64-bit addresses per step is cheaper than spilling them).
__device__ __forceinline__ int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// load_tile_async (below) of a 16-bit tile.
template <typename T, int D, int ROWS, int NTHREADS>
__device__ __forceinline__ void load_tile_16(T* smem, const T* g, int64_t row_stride, int rows_valid, int d_valid,
                                             int tid) {
  using L = TileLayout<D>;
  constexpr int kChunks = D / 8;
  constexpr int kTotal = ROWS * kChunks;
  constexpr int kIters = (kTotal + NTHREADS - 1) / NTHREADS;
  if constexpr (NTHREADS % kChunks == 0 && kTotal % NTHREADS == 0 &&
                (!L::kSwizzle || (NTHREADS / kChunks) % 8 == 0)) {
    // Each thread keeps one column chunk and walks down the rows: one pointer, one stride, and the
    // smem rows move by a multiple of 8 (the swizzle pattern does not change).
    constexpr int kRowStep = NTHREADS / kChunks;
    const int r0 = tid / kChunks;
    const int c = tid % kChunks;
    const int left = d_valid - c * 8;
    const int col_bytes = left >= 8 ? 16 : (left > 0 ? left * 2 : 0);
    const T* src = g + static_cast<int64_t>(r0) * row_stride + (col_bytes ? c * 8 : 0);
    const int64_t step = static_cast<int64_t>(kRowStep) * row_stride;
    const uint32_t dst = smem_u32(smem + L::offset(r0, c));
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const bool row_ok = r0 + it * kRowStep < rows_valid;
      cp_async_16(dst + it * kRowStep * L::kPitch * 2, row_ok ? src + it * step : g, row_ok ? col_bytes : 0);
    }
  } else {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int idx = it * NTHREADS + tid;
      if (kTotal % NTHREADS == 0 || idx < kTotal) {
        const int r = idx / kChunks;
        const int c = idx % kChunks;
        const int left = d_valid - c * 8;
        const bool row_ok = r < rows_valid;
        const int nbytes = row_ok ? (left >= 8 ? 16 : (left > 0 ? left * 2 : 0)) : 0;
        const T* src = g + (nbytes ? static_cast<int64_t>(r) * row_stride + c * 8 : 0);
        cp_async_16(smem_u32(smem + L::offset(r, c)), src, nbytes);
      }
    }
  }
}

// Cooperative async load of a ROWS x D tile (D a padded head dim) from a row-strided global array.
// Rows at or past rows_valid and columns at or past d_valid are zero-filled. The source pointer
// stays inside the array even for zero-fill copies (rows_valid >= 1 is required). tid: threadIdx.x.
// A float tile is the 16-bit tile of 2 D columns over the same bytes (mma_tf32.cuh's FloatTile): its rows, strides
// and valid columns are counted in 16-bit units, and each 16-byte chunk (4 floats) is copied as it is.
template <typename T, int D, int ROWS, int NTHREADS>
__device__ __forceinline__ void load_tile_async(T* smem, const T* g, int64_t row_stride, int rows_valid,
                                                int d_valid, int tid) {
  if constexpr (is_same_v<T, float>) {
    load_tile_16<__half, 2 * D, ROWS, NTHREADS>(reinterpret_cast<__half*>(smem), reinterpret_cast<const __half*>(g),
                                               2 * row_stride, rows_valid, 2 * d_valid, tid);
  } else {
    load_tile_16<T, D, ROWS, NTHREADS>(smem, g, row_stride, rows_valid, d_valid, tid);
  }
}

// Reductions over the 4 lanes (t = 0..3) that share a fragment row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// dst[0] += x, dst[1] += y in global memory, without a return value (dst 8-byte aligned). sm_90
// has a vector form, one instruction and one L2 transaction for the pair.
__device__ __forceinline__ void red_add2(float* dst, float x, float y) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(x), "f"(y) : "memory");
#else
  atomicAdd(dst, x);
  atomicAdd(dst + 1, y);
#endif
}

// Store two adjacent output elements of type T (4 bytes, float: 8) from floats.
template <typename T>
__device__ __forceinline__ void store2(T* dst, float lo, float hi) {
  if constexpr (is_same_v<T, float>) {
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);  // 8 bytes: dst's column is even
  } else {
    *reinterpret_cast<uint32_t*>(dst) = pack2<T>(lo, hi);
  }
}

}  // namespace mma
}  // namespace cupyflash
