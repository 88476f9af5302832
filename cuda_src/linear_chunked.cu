// Linear attention, chunked: O(N D^2) work, no N x N intermediate (TransNormerLLM / "flash
// linear attention").
//
//   o_i = scale * sum_j W_ij (q_i . k_j) v_j,   W_ij = [j <= p_i] * lambda^(p_i - j),  p_i = i + Nk - Nq
//
// Positions are split into chunks of C = 64. For a query at position p in chunk c:
//   o = scale * [ sum_{j in chunk c, j <= p} lambda^(p-j) (q.k_j) v_j        (intra: a C x C tile)
//               + lambda^(p - cC) q^T S_c ]                                 (inter: a D x D state)
//   S_c = sum_{j < cC} lambda^(cC - j) k_j v_j^T,   S_{c+1} = lambda^C S_c + U_c,
//   U_c = sum_{j in chunk c} lambda^(C - (j - cC)) k_j v_j^T.
// Every power has a non-negative exponent, so nothing overflows for small lambda.
//
// Three launches: linear_chunk_state (every U_c in parallel), linear_state_scan (the prefix
// over chunks, in place, one thread per state element) and linear_chunk_out (intra tile plus
// inter state, every chunk in parallel). The backward reuses all three:
//   dQ = the forward with (Q, K, V) -> (dO, V, K) and S^T;
//   dK, dV use the reverse state R_c = sum_{p >= (c+1)C} lambda^(p - (c+1)C + 1) q_p do_p^T
//   (an exclusive scan from the last chunk) with the anti-causal intra tile ("rev"):
//   dK_c = scale [ (V dO^T o W^T) Q + diag(lambda^(C-1-r)) V R_c^T ],
//   dV_c = scale [ (K Q^T o W^T) dO + diag(lambda^(C-1-r)) K R_c ],
//   summed over the GQA group's query heads inside the block (no atomics).
// Non-causal problems use the same kernels with one total state (o = scale * Q (K^T V)).
//
// All products are 64 x N tiles computed by 256 threads from shared-memory slices of 32 along
// the reduction axis (tile_mma): FFMA for float32 (TC = false), TF32 mma.sync for 16-bit inputs
// (TC = true). Inputs are float, __half or __nv_bfloat16; staging and accumulation are float.
// These passes serve float32 and the FFMA fallback; 16-bit inputs on sm_80+ take the fused walk
// of linear_fused.cu instead. The TC = true tiles remain for linear_masked.cu.
#ifndef CUPYFLASH_LINEAR_CHUNKED_CU
#define CUPYFLASH_LINEAR_CHUNKED_CU
#include "common.cuh"

namespace cupyflash {
namespace linear {

constexpr int kThreads = 256;
constexpr int kTX = 16;      // FFMA tiles: 16 x 16 threads, each 4 rows by groups of 4 columns
constexpr int kRows = 64;    // rows of every tile: the chunk length C, or a block of D
constexpr int kChunk = kRows;
constexpr int kKS = 32;      // reduction slice staged in shared memory per step
constexpr int kPad = 4;      // keeps float4 alignment and moves consecutive rows across banks
constexpr int kLdA = kRows + kPad;

// Accumulator of a 64 x N tile, 16 x (N / 16) floats per thread in one of two layouts.
// FFMA (TC = false, float32): thread (ty, tx) = (tid / 16, tid % 16) owns rows 4ty..4ty+3 and,
// for each group of 4 columns, 64g + 4tx .. +3 (float4 reads of a staged row never conflict).
// Tensor cores (TC = true, 16-bit inputs): the m16n8k8 TF32 accumulator layout; warp w owns rows
// 16 (w % 4) .. +15 and columns (w / 4) N/2 .. +N/2 - 1 as N/16 tiles of 16 x 8, lane (g, t) =
// (lane / 4, lane % 4) holding rows g, g + 8 and columns 2t, 2t + 1 of each.
template <int N, bool TC>
struct Tile {
  static_assert(N % 64 == 0, "tile width must be a multiple of 64");
  static constexpr int TN = N / 16;
  float v[4][TN];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) v[i][j] = 0.f;
  }
  __device__ __forceinline__ static int row(int i, int j) {
    if (TC) {
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      return 16 * (warp % 4) + lane / 4 + 8 * (i / 2);
    }
    return (threadIdx.x / kTX) * 4 + i;
  }
  __device__ __forceinline__ static int col(int i, int j) {
    if (TC) {
      const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
      return (warp / 4) * (N / 2) + 8 * j + 2 * (lane % 4) + (i % 2);
    }
    return (j / 4) * (kTX * 4) + (threadIdx.x % kTX) * 4 + (j % 4);
  }
};

// lambda^e from lg = log2(lambda); e == 0 is exactly 1 even when lambda underflowed to 0 in float.
__device__ __forceinline__ float decay_pow(float lg, int e) { return e == 0 ? 1.f : exp2f(lg * float(e)); }

__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

// d = a b + d for one 16 x 8 x 8 TF32 tile (sm_80+), float accumulators.
__device__ __forceinline__ void mma_tf32(float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1,
                                         unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// acc += At^T B over one slice: At is [kKS][kLdA] (reduction index major), B is [kKS][N + kPad].
template <int N, bool TC>
__device__ __forceinline__ void tile_mma(Tile<N, TC>& acc, const float* __restrict__ At,
                                         const float* __restrict__ B) {
  constexpr int TN = Tile<N, TC>::TN;
  if constexpr (TC) {
    // 16-bit inputs are exact in TF32; products of float intermediates (P, the states) are
    // rounded to TF32 (2^-11 relative), well inside the 16-bit output tolerance.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    const float* a = At + 16 * (warp % 4) + g;
    const float* b = B + (warp / 4) * (N / 2) + g;
#pragma unroll 2
    for (int k0 = 0; k0 < kKS; k0 += 8) {
      const unsigned a0 = to_tf32(a[(k0 + t) * kLdA]), a1 = to_tf32(a[(k0 + t) * kLdA + 8]);
      const unsigned a2 = to_tf32(a[(k0 + t + 4) * kLdA]), a3 = to_tf32(a[(k0 + t + 4) * kLdA + 8]);
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        const unsigned b0 = to_tf32(b[(k0 + t) * (N + kPad) + 8 * j]);
        const unsigned b1 = to_tf32(b[(k0 + t + 4) * (N + kPad) + 8 * j]);
        mma_tf32(acc.v[0][j], acc.v[1][j], acc.v[2][j], acc.v[3][j], a0, a1, a2, a3, b0, b1);
      }
    }
  } else {
    const int ty = threadIdx.x / kTX, tx = threadIdx.x % kTX;
#pragma unroll 2
    for (int k = 0; k < kKS; ++k) {
      const float4 a4 = *reinterpret_cast<const float4*>(At + k * kLdA + ty * 4);
      const float a[4] = {a4.x, a4.y, a4.z, a4.w};
      float b[TN];
#pragma unroll
      for (int g = 0; g < TN / 4; ++g) {
        const float4 b4 = *reinterpret_cast<const float4*>(B + k * (N + kPad) + g * (kTX * 4) + tx * 4);
        b[4 * g + 0] = b4.x;
        b[4 * g + 1] = b4.y;
        b[4 * g + 2] = b4.z;
        b[4 * g + 3] = b4.w;
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) acc.v[i][j] = fmaf(a[i], b[j], acc.v[i][j]);
    }
  }
}

// Stage an R x CC window of a row-major matrix (row stride ld, unit column stride) as float:
// dst[r][c] (or dst[c][r] with TRANS) = rscale[r] * src[row0 + r][col0 + c], zero outside
// rows [0, nrows) and columns [0, ncols) so partial chunks and padded head dims add nothing.
template <typename T, int R, int CC, bool TRANS>
__device__ __forceinline__ void stage(float* __restrict__ dst, int ldd, const T* __restrict__ src, long long ld,
                                      int row0, int nrows, int col0, int ncols, const float* rscale) {
  static_assert((R * CC) % kThreads == 0, "stage covers the window in whole passes");
#pragma unroll 4
  for (int it = 0; it < R * CC / kThreads; ++it) {
    const int e = it * kThreads + threadIdx.x;
    const int r = e / CC, c = e % CC;
    const int gr = row0 + r, gc = col0 + c;
    float x = 0.f;
    if (gr >= 0 && gr < nrows && gc < ncols) x = to_float<T>(src[(long long)gr * ld + gc]);
    if (rscale != nullptr) x *= rscale[r];
    if (TRANS)
      dst[c * ldd + r] = x;
    else
      dst[r * ldd + c] = x;
  }
}

// Shared staging buffers of every linear kernel (static: 43 KB at DV = 128).
template <int DV>
struct Smem {
  float At[kKS * kLdA];          // A operand slice, reduction index major
  float B[kKS * (DV + kPad)];    // B operand slice
  float Pt[kChunk * kLdA];       // the weighted C x C score tile, transposed (key major)
  float w[kChunk];               // per-row factors
};

// acc = X[xrow0 .. +64) Y[yrow0 .. +64)^T: the C x C score tile, reduced over D in slices.
template <typename T, int DV, bool TC>
__device__ __forceinline__ void tile_scores(Tile<64, TC>& acc, Smem<DV>& sm, const T* X, long long xld, int xrow0,
                                            int nx, const T* Y, long long yld, int yrow0, int ny, int D) {
  acc.zero();
  for (int d0 = 0; d0 < D; d0 += kKS) {
    stage<T, kChunk, kKS, true>(sm.At, kLdA, X, xld, xrow0, nx, d0, D, nullptr);
    stage<T, kChunk, kKS, true>(sm.B, 64 + kPad, Y, yld, yrow0, ny, d0, D, nullptr);
    __syncthreads();
    tile_mma<64, TC>(acc, sm.At, sm.B);
    __syncthreads();
  }
}

// Write the weighted tile P[r][s] = acc[r][s] * weight(r, s) transposed into sm.Pt.
template <int DV, bool TC, typename Weight>
__device__ __forceinline__ void put_p(Smem<DV>& sm, const Tile<64, TC>& acc, Weight weight) {
  using Tl = Tile<64, TC>;
  if constexpr (TC) {
    // lanes of a warp hit 32 distinct banks: column 2t + (i % 2), row g (+ 8)
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < Tl::TN; ++j) {
        const int r = Tl::row(i, j), c = Tl::col(i, j);
        sm.Pt[c * kLdA + r] = acc.v[i][j] * weight(r, c);
      }
  } else {
    // four consecutive rows of one column: one float4 store
#pragma unroll
    for (int j = 0; j < Tl::TN; ++j) {
      const int c = Tl::col(0, j), r = Tl::row(0, j);
      float4 p;
      p.x = acc.v[0][j] * weight(r + 0, c);
      p.y = acc.v[1][j] * weight(r + 1, c);
      p.z = acc.v[2][j] * weight(r + 2, c);
      p.w = acc.v[3][j] * weight(r + 3, c);
      *reinterpret_cast<float4*>(sm.Pt + c * kLdA + r) = p;
    }
  }
}

// acc += P Z[zrow0 .. +64)[:, col0 .. +DV): P staged in sm.Pt by put_p (caller syncs after put_p).
template <typename T, int DV, bool TC>
__device__ __forceinline__ void tile_pv(Tile<DV, TC>& acc, Smem<DV>& sm, const T* Z, long long zld, int zrow0,
                                        int nz, int col0, int D) {
  for (int s0 = 0; s0 < kChunk; s0 += kKS) {
    stage<T, kKS, DV, false>(sm.B, DV + kPad, Z, zld, zrow0 + s0, nz, col0, D, nullptr);
    __syncthreads();
    tile_mma<DV, TC>(acc, sm.Pt + s0 * kLdA, sm.B);
    __syncthreads();
  }
}

template <typename T, int N, bool TC>
__device__ __forceinline__ void store_tile(T* O, long long ld, int row0, int nrows, int col0, int ncols,
                                           const Tile<N, TC>& acc) {
  using Tl = Tile<N, TC>;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < Tl::TN; ++j) {
      const int r = row0 + Tl::row(i, j), c = col0 + Tl::col(i, j);
      if (r >= 0 && r < nrows && c < ncols) O[(long long)r * ld + c] = from_float<T>(acc.v[i][j]);
    }
}

}  // namespace linear
}  // namespace cupyflash

using namespace cupyflash::linear;

// U[bh, c] = sum_{r < C} a_r X_r (x) Y_r over chunk c, a 64-row block of D by a DV-column block.
// Forward (rev = 0): X = K, Y = V of kv head h / group, rows = key positions, a_r = lambda^(C - r).
// Reverse (rev = 1): X = Q, Y = dO of query head h, rows = query rows at positions cC + r
// (row = position - row_off), a_r = lambda^(r + 1). Non-causal: has_decay = 0, so a_r = 1.
// Grid: x = (b * Hq + h) * nchunks + c, y = column block * ceil(D / 64) + row block.
template <typename T, int DV, bool TC>
__global__ void __launch_bounds__(kThreads, 3) linear_chunk_state(
    const T* __restrict__ X, long long xsb, long long xsh, long long xsn, const T* __restrict__ Y, long long ysb,
    long long ysh, long long ysn, float* __restrict__ U, const float* __restrict__ decay, int has_decay, int Hq,
    int group, int nrows, int row_off, int nchunks, int D, int rev) {
  __shared__ __align__(16) Smem<DV> sm;
  const int bh = blockIdx.x / nchunks, c = blockIdx.x % nchunks;
  const int b = bh / Hq, h = bh % Hq;
  const int nmb = (D + kRows - 1) / kRows;
  const int mb = blockIdx.y % nmb, nb = blockIdx.y / nmb;
  const int th = rev ? h : h / group;
  const T* Xb = X + b * xsb + th * xsh;
  const T* Yb = Y + b * ysb + th * ysh;
  if (threadIdx.x < kChunk) {
    const float lg = has_decay ? log2f(decay[h]) : 0.f;
    const int r = threadIdx.x;
    sm.w[r] = has_decay ? decay_pow(lg, rev ? r + 1 : kChunk - r) : 1.f;
  }
  __syncthreads();
  Tile<DV, TC> acc;
  acc.zero();
  const int row0 = c * kChunk - row_off;
  for (int s0 = 0; s0 < kChunk; s0 += kKS) {
    // At[r][m] = a_r X[r][m]: the chunk rows are the reduction axis here.
    stage<T, kKS, kRows, false>(sm.At, kLdA, Xb, xsn, row0 + s0, nrows, mb * kRows, D, sm.w + s0);
    stage<T, kKS, DV, false>(sm.B, DV + kPad, Yb, ysn, row0 + s0, nrows, nb * DV, D, nullptr);
    __syncthreads();
    tile_mma<DV, TC>(acc, sm.At, sm.B);
    __syncthreads();
  }
  float* Ub = U + ((long long)bh * nchunks + c) * D * D;
  store_tile<float, DV, TC>(Ub, D, mb * kRows, D, nb * DV, D, acc);
}

// In-place scan over chunks, one thread per state element of one head.
// mode 0: S_0 = 0, S_{c+1} = lambda^C S_c + U_c (forward, exclusive);
// mode 1: R_{n-1} = 0, R_{c-1} = lambda^C R_c + U_c (reverse, exclusive);
// mode 2: slot 0 = sum of all U_c (non-causal total).
// Grid: x = bh * nblocks + element block.
extern "C" __global__ void __launch_bounds__(kThreads) linear_state_scan(float* __restrict__ U, int nchunks,
                                                                         int DD, int nblocks,
                                                                         const float* __restrict__ decay,
                                                                         int has_decay, int Hq, int mode) {
  const int bh = blockIdx.x / nblocks;
  const int e = (blockIdx.x % nblocks) * kThreads + threadIdx.x;
  if (e >= DD) return;
  const float f = has_decay ? decay_pow(log2f(decay[bh % Hq]), kChunk) : 1.f;
  float* u = U + (long long)bh * nchunks * DD + e;
  // Loads do not depend on the running state: fetch kBatch chunks at a time so their latencies
  // overlap (the compiler cannot hoist them above the stores itself: DD may alias).
  constexpr int kBatch = 8;
  float run = 0.f;
  for (int c0 = 0; c0 < nchunks; c0 += kBatch) {
    float x[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = mode == 1 ? nchunks - 1 - (c0 + i) : c0 + i;
      x[i] = (c0 + i < nchunks) ? u[(long long)c * DD] : 0.f;
    }
    if (mode == 2) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) run += x[i];
      continue;
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int c = mode == 1 ? nchunks - 1 - (c0 + i) : c0 + i;
      if (c0 + i < nchunks) {
        u[(long long)c * DD] = run;
        run = fmaf(f, run, x[i]);
      }
    }
  }
  if (mode == 2) u[0] = run;
}

// One chunk of output rows, one DV-column block: O_c = scale [ (X Y^T o W) Z + diag(b) X S_c ].
// rev = 0 (o, dq): X rows are query rows (position - off when causal), Y, Z key rows, W causal.
// rev = 1 (dk, dv): X rows are key rows, Y, Z query rows, W anti-causal, and the block sums the
// contributions of the group's query heads. Non-causal: no intra tile, b = 1, S read from slot 0
// (s_chunk = 0) and chunks run over X's own rows.
// S_c is read as S[d][n] (s_trans = 0) or S[n][d] (s_trans = 1).
// Grid: x = (b * Hout + ho) * nchunks + c, y = column block.
template <typename T, int DV, bool TC>
__global__ void __launch_bounds__(kThreads, (DV == 64 && TC) ? 3 : 2) linear_chunk_out(
    const T* __restrict__ X, long long xsb, long long xsh, long long xsn, const T* __restrict__ Y, long long ysb,
    long long ysh, long long ysn, const T* __restrict__ Z, long long zsb, long long zsh, long long zsn,
    T* __restrict__ O, long long osb, long long osh, long long osn, const float* __restrict__ S, long long s_bh,
    long long s_chunk, int s_trans, const float* __restrict__ decay, int has_decay, int Hout, int Hq, int group,
    int nx, int nyz, int nchunks, int D, int off, int causal, int rev, float scale) {
  __shared__ __align__(16) Smem<DV> sm;
  const int bo = blockIdx.x / nchunks, c = blockIdx.x % nchunks;
  const int b = bo / Hout, ho = bo % Hout;
  const int col0 = blockIdx.y * DV;
  const int xrow0 = c * kChunk - ((causal && !rev) ? off : 0);
  const int yrow0 = c * kChunk - ((causal && rev) ? off : 0);
  const T* Xb = X + b * xsb + ho * xsh;
  Tile<DV, TC> acc;
  acc.zero();
  const int G = rev ? group : 1;
  for (int g = 0; g < G; ++g) {
    const int hq = rev ? ho * group + g : ho;
    const int hyz = rev ? hq : ho / group;
    const float lg = has_decay ? log2f(decay[hq]) : 0.f;
    if (causal) {
      Tile<64, TC> s;
      tile_scores<T, DV, TC>(s, sm, Xb, xsn, xrow0, nx, Y + b * ysb + hyz * ysh, ysn, yrow0, nyz, D);
      put_p<DV, TC>(
          sm, s,
          [&](int r, int sc) {
            const int dist = rev ? sc - r : r - sc;
            return dist < 0 ? 0.f : scale * decay_pow(lg, dist);
          });
      __syncthreads();
      tile_pv<T, DV, TC>(acc, sm, Z + b * zsb + hyz * zsh, zsn, yrow0, nyz, col0, D);
    }
    if (threadIdx.x < kChunk) {
      const int r = threadIdx.x;
      sm.w[r] = causal ? scale * decay_pow(lg, rev ? kChunk - 1 - r : r) : scale;
    }
    __syncthreads();
    const float* Sc = S + (long long)(b * Hq + hq) * s_bh + (long long)c * s_chunk;
    for (int d0 = 0; d0 < D; d0 += kKS) {
      stage<T, kChunk, kKS, true>(sm.At, kLdA, Xb, xsn, xrow0, nx, d0, D, sm.w);
      if (s_trans)
        stage<float, DV, kKS, true>(sm.B, DV + kPad, Sc, D, col0, D, d0, D, nullptr);
      else
        stage<float, kKS, DV, false>(sm.B, DV + kPad, Sc, D, d0, D, col0, D, nullptr);
      __syncthreads();
      tile_mma<DV, TC>(acc, sm.At, sm.B);
      __syncthreads();
    }
  }
  store_tile<T, DV, TC>(O + b * osb + ho * osh, osn, xrow0, nx, col0, D, acc);
}

#endif  // CUPYFLASH_LINEAR_CHUNKED_CU
