// Shared device helpers of the portable (SIMT, any-GPU) FlashAttention kernels.
//
// Tiles live in shared memory as float, row-major, with a row stride of width + 4 floats:
// the +4 keeps every row 16-byte aligned for float4 reads, and puts 8 consecutive rows on
// 8 distinct 4-bank groups, so the float4 reads of a quarter-warp that walk down a column
// of rows (the "B" operand of S = Q K^T) never conflict.
//
// Threads form row groups of LANES consecutive lanes. In a product with rows x columns the
// thread (group g, lane) owns rows g*TM .. g*TM+TM-1 and
//   - for S-like products (columns are keys or queries): columns lane + t*LANES, t < TN;
//   - for O-like products (columns are the head dim): DT = DP/LANES columns laid out as
//     chunks of VEC contiguous floats, chunk c at c*LANES*VEC + lane*VEC, so a group's reads
//     of one B row are contiguous float4 (or float2) loads.
// Every shared-memory value read is reused TM or TN (resp. DT) times from registers.
//
// Kernels take one `const __grid_constant__ AttentionParams p` and a variant Policy (attention_policy.cuh):
// its mask decides which tiles are visited and which elements are hidden, its score rule maps q . k to
// the score (softcap, ALiBi); attention sinks come from p.
#pragma once
#include "attention_policy.cuh"
#include "common.cuh"
#include "mma_primitives.cuh"  // cp.async

namespace cupyflash {
namespace portable {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int vec_of(int dt) { return dt % 4 == 0 ? 4 : (dt % 2 == 0 ? 2 : 1); }
__host__ __device__ constexpr int min_c(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int max_c(int a, int b) { return a > b ? a : b; }

// Shared-memory row stride for a tile `width` floats wide.
__host__ __device__ constexpr int ld_of(int width) { return width + 4; }

// Column of micro-tile element c of a lane in an O-like product.
template <int VEC, int LANES>
__device__ __forceinline__ int col_of(int c, int lane) {
    return (c / VEC) * LANES * VEC + lane * VEC + c % VEC;
}

// N consecutive shared floats into registers, with the widest aligned loads.
template <int N>
__device__ __forceinline__ void lds(float (&dst)[N], const float* src) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int j = 0; j < N; j += 4) {
            const float4 v = *reinterpret_cast<const float4*>(src + j);
            dst[j] = v.x; dst[j + 1] = v.y; dst[j + 2] = v.z; dst[j + 3] = v.w;
        }
    } else if constexpr (N % 2 == 0) {
#pragma unroll
        for (int j = 0; j < N; j += 2) {
            const float2 v = *reinterpret_cast<const float2*>(src + j);
            dst[j] = v.x; dst[j + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) dst[j] = src[j];
    }
}

// ------------------------------------------------------------------ global <-> shared

// 16 bytes of T (4 floats or 8 halves) to floats.
template <typename T> __device__ __forceinline__ void unpack16(const uint4& u, float* f);
template <> __device__ __forceinline__ void unpack16<float>(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
}
template <> __device__ __forceinline__ void unpack16<__half>(const uint4& u, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 v = __half22float2(h[j]);
        f[2 * j] = v.x; f[2 * j + 1] = v.y;
    }
}
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4& u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 v = __bfloat1622float2(h[j]);
        f[2 * j] = v.x; f[2 * j + 1] = v.y;
    }
}

// The 16-byte path of a ROWS x DP tile copy: fetch into registers, then commit to shared
// memory (split so a kernel may issue the loads early). Rows >= nrows and columns >= d become zeros.
template <typename T, int ROWS, int DP, int THREADS>
struct TileFetch {
    static constexpr int E = 16 / sizeof(T);  // elements per 16-byte vector
    static constexpr int VPR = DP / E;        // vectors per row
    static constexpr int TOTAL = ROWS * VPR;
    static constexpr int ITERS = cdiv(TOTAL, THREADS);
    uint4 raw[ITERS];

    __device__ __forceinline__ void fetch(const T* __restrict__ g, long long sn, int nrows, int d) {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const int idx = it * THREADS + threadIdx.x;
            const int r = idx / VPR, c = (idx % VPR) * E;
            raw[it] = make_uint4(0, 0, 0, 0);
            if ((TOTAL % THREADS == 0 || idx < TOTAL) && r < nrows && c < d)
                raw[it] = __ldg(reinterpret_cast<const uint4*>(g + r * sn + c));
        }
    }

    __device__ __forceinline__ void commit(float* __restrict__ s) const {
        constexpr int LD = ld_of(DP);
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const int idx = it * THREADS + threadIdx.x;
            if (TOTAL % THREADS == 0 || idx < TOTAL) {
                const int r = idx / VPR, c = (idx % VPR) * E;
                float f[E];
                unpack16<T>(raw[it], f);
#pragma unroll
                for (int j = 0; j < E; j += 4)
                    *reinterpret_cast<float4*>(s + r * LD + c + j) = make_float4(f[j], f[j + 1], f[j + 2], f[j + 3]);
            }
        }
    }
};

// The scalar path: consecutive threads read consecutive elements (coalesced for any D,
// alignment or stride).
template <typename T, int ROWS, int DP, int THREADS>
__device__ __forceinline__ void load_tile_scalar(float* __restrict__ s, const T* __restrict__ g, long long sn,
                                                 int nrows, int d) {
    constexpr int LD = ld_of(DP);
    constexpr int TOTAL = ROWS * DP;
#pragma unroll 4
    for (int it = 0; it < cdiv(TOTAL, THREADS); ++it) {
        const int idx = it * THREADS + threadIdx.x;
        if (TOTAL % THREADS == 0 || idx < TOTAL) {
            const int r = idx / DP, c = idx % DP;
            s[r * LD + c] = (r < nrows && c < d) ? to_float<T>(g[r * sn + c]) : 0.f;
        }
    }
}

// Copy a ROWS x DP tile (rows of global stride sn, valid rows `nrows`, valid columns `d`) to
// shared memory as float, zero-filling the rest so padded rows/columns add nothing to dot
// products. `vec` (decided on the host from alignment and strides) selects 16-byte loads.
template <typename T, int ROWS, int DP, int THREADS>
__device__ __forceinline__ void load_tile(float* __restrict__ s, const T* __restrict__ g, long long sn,
                                          int nrows, int d, bool vec) {
    if (vec) {
        TileFetch<T, ROWS, DP, THREADS> f;
        f.fetch(g, sn, nrows, d);
        f.commit(s);
    } else {
        load_tile_scalar<T, ROWS, DP, THREADS>(s, g, sn, nrows, d);
    }
}

// ------------------------------------------------------------------ pipelined tile copies
//
// load_tile's copy without the wait, so a kernel can keep a tile's loads in flight while it computes on
// another buffer: float32 tiles by cp.async (sm_80+; 16 bytes where `vec`, else 4 bytes an element, which
// needs only float's own alignment), zero-filled past nrows and d by a source size of 0. Other element types
// (16-bit rows may be 2-byte aligned; the conversion needs registers) and older GPUs copy synchronously
// here, which stays correct. A tile is usable after async_wait<N>() and a barrier.
template <typename T, int ROWS, int DP, int THREADS>
__device__ __forceinline__ void load_tile_async(float* __restrict__ s, const T* __restrict__ g, long long sn,
                                                int nrows, int d, bool vec) {
#if __CUDA_ARCH__ >= 800
    if constexpr (mma::is_same_v<T, float>) {
        constexpr int LD = ld_of(DP);
        // Opaque: the per-thread offsets are recomputed per call, not hoisted out of the caller's loop and held
        // live through its products (the D=64 tile sits at its 168-register cap).
        const int tid = mma::opaque(threadIdx.x);
        if (vec) {
            constexpr int VPR = DP / 4, TOTAL = ROWS * VPR;
            static_assert(THREADS % VPR == 0, "a thread keeps its column: one address, stepped by rows");
            constexpr int RSTEP = THREADS / VPR;
            const int r = tid / VPR, c = tid % VPR * 4;
            const T* src = g + r * sn + c;
            const unsigned dst = mma::smem_u32(s + r * LD + c);
            const bool cin = c < d;  // vec: d % 4 == 0, a chunk is all in or all out
#pragma unroll
            for (int it = 0; it < cdiv(TOTAL, THREADS); ++it) {
                if (TOTAL % THREADS == 0 || it * THREADS + tid < TOTAL) {
                    const bool in = cin && r + it * RSTEP < nrows;
                    mma::cp_async_16(dst + it * RSTEP * LD * 4, in ? src + it * RSTEP * sn : g, in ? 16 : 0);
                }
            }
        } else {
            constexpr int TOTAL = ROWS * DP;
#pragma unroll 4
            for (int it = 0; it < cdiv(TOTAL, THREADS); ++it) {
                const int idx = it * THREADS + tid;
                if (TOTAL % THREADS == 0 || idx < TOTAL) {
                    const int r = idx / DP, c = idx % DP;
                    const bool in = r < nrows && c < d;
                    mma::cp_async_4(mma::smem_u32(s + r * LD + c), in ? g + r * sn + c : g, in ? 4 : 0);
                }
            }
        }
        return;
    }
#endif
    load_tile<T, ROWS, DP, THREADS>(s, g, sn, nrows, d, vec);
}

// cp.async group bookkeeping for load_tile_async (no-ops where it copies synchronously).
__device__ __forceinline__ void async_commit() {
#if __CUDA_ARCH__ >= 800
    mma::cp_async_commit();
#endif
}
template <int N>
__device__ __forceinline__ void async_wait() {
#if __CUDA_ARCH__ >= 800
    mma::cp_async_wait<N>();
#endif
}

// Store N floats (times `mul`) as T at g; N-element vector store when `vec`.
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* g, const float* v, float mul) {
    if constexpr (sizeof(T) == 4 && N == 4) {
        *reinterpret_cast<float4*>(g) = make_float4(v[0] * mul, v[1] * mul, v[2] * mul, v[3] * mul);
    } else if constexpr (sizeof(T) == 4 && N == 2) {
        *reinterpret_cast<float2*>(g) = make_float2(v[0] * mul, v[1] * mul);
    } else if constexpr (sizeof(T) == 2 && N % 2 == 0) {
        // Pack pairs into 32-bit words, written as one 4- or 8-byte store.
        unsigned w[N / 2];
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {
            const T lo = from_float<T>(v[2 * j] * mul), hi = from_float<T>(v[2 * j + 1] * mul);
            w[j] = (unsigned)*reinterpret_cast<const unsigned short*>(&lo) |
                   ((unsigned)*reinterpret_cast<const unsigned short*>(&hi) << 16);
        }
        if constexpr (N == 4) *reinterpret_cast<uint2*>(g) = make_uint2(w[0], w[1]);
        else *reinterpret_cast<unsigned*>(g) = w[0];
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j) g[j] = from_float<T>(v[j] * mul);
    }
}

// One thread's DT columns of an O-like row (see col_of) to global row g, times `mul`.
template <typename T, int DT, int VEC, int LANES>
__device__ __forceinline__ void store_row(T* g, const float (&v)[DT], float mul, int lane, int d, bool vec) {
#pragma unroll
    for (int c = 0; c < DT; c += VEC) {
        const int col = col_of<VEC, LANES>(c, lane);
        if (vec) {
            // vec implies d % 4 == 0 (fp32) or d % 8 == 0 (16-bit), so a chunk is all in or all out.
            if (col < d) store_vec<T, VEC>(g + col, v + c, mul);
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e)
                if (col + e < d) g[col + e] = from_float<T>(v[c + e] * mul);
        }
    }
}

// ------------------------------------------------------------------ register-tiled products

// acc[i][t] += sum_k A[i][k] * B[t*LANES][k]: A points at the thread's first row, B at the
// row of its lane; both row-major with K (a multiple of 4) along the row. Per 4 values of k,
// TM + TN float4 loads feed 4*TM*TN FMAs.
template <int TM, int TN, int K, int LDA, int LDB, int LANES>
__device__ __forceinline__ void mma_abT(float (&acc)[TM][TN], const float* __restrict__ A,
                                        const float* __restrict__ B) {
#pragma unroll 2
    for (int k = 0; k < K; k += 4) {
        float4 b[TN];
#pragma unroll
        for (int t = 0; t < TN; ++t) b[t] = *reinterpret_cast<const float4*>(B + t * LANES * LDB + k);
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const float4 a = *reinterpret_cast<const float4*>(A + i * LDA + k);
#pragma unroll
            for (int t = 0; t < TN; ++t) {
                acc[i][t] = fmaf(a.x, b[t].x, acc[i][t]);
                acc[i][t] = fmaf(a.y, b[t].y, acc[i][t]);
                acc[i][t] = fmaf(a.z, b[t].z, acc[i][t]);
                acc[i][t] = fmaf(a.w, b[t].w, acc[i][t]);
            }
        }
    }
}

// acc[i][c] += sum_k A[i][k] * B[k][col(c)]: A (row-major, the thread's first row; K a
// multiple of 4 along the row) like P in P V; B points at row 0 plus lane*VEC.
template <int TM, int DT, int LANES, int K, int LDA, int LDB>
__device__ __forceinline__ void mma_ab(float (&acc)[TM][DT], const float* __restrict__ A,
                                       const float* __restrict__ B) {
    constexpr int VEC = vec_of(DT);
#pragma unroll 1
    for (int k = 0; k < K; k += 4) {
        float4 a[TM];
#pragma unroll
        for (int i = 0; i < TM; ++i) a[i] = *reinterpret_cast<const float4*>(A + i * LDA + k);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            float bv[DT];
#pragma unroll
            for (int c = 0; c < DT; c += VEC) {
                float tmp[VEC];
                lds<VEC>(tmp, B + (k + kk) * LDB + (c / VEC) * LANES * VEC);
#pragma unroll
                for (int e = 0; e < VEC; ++e) bv[c + e] = tmp[e];
            }
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                const float av = kk == 0 ? a[i].x : kk == 1 ? a[i].y : kk == 2 ? a[i].z : a[i].w;
#pragma unroll
                for (int c = 0; c < DT; ++c) acc[i][c] = fmaf(av, bv[c], acc[i][c]);
            }
        }
    }
}

// acc[i][c] += sum_k A[k][i] * B[k][col(c)]: A stored k-major (A points at column of the
// thread's first row), as dS^T when dQ = dS K is built from the key-major dS^T tile.
template <int TM, int DT, int LANES, int K, int LDA, int LDB>
__device__ __forceinline__ void mma_atb(float (&acc)[TM][DT], const float* __restrict__ A,
                                        const float* __restrict__ B) {
    constexpr int VEC = vec_of(DT);
#pragma unroll 2
    for (int k = 0; k < K; ++k) {
        float a[TM];
        lds<TM>(a, A + k * LDA);
        float bv[DT];
#pragma unroll
        for (int c = 0; c < DT; c += VEC) {
            float tmp[VEC];
            lds<VEC>(tmp, B + k * LDB + (c / VEC) * LANES * VEC);
#pragma unroll
            for (int e = 0; e < VEC; ++e) bv[c + e] = tmp[e];
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int c = 0; c < DT; ++c) acc[i][c] = fmaf(a[i], bv[c], acc[i][c]);
    }
}

// ------------------------------------------------------------------ row-group reductions

// Lanes of a row group are LANES consecutive lanes of one warp: xor shuffles stay inside it.
template <int LANES>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
template <int LANES>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

template <int TM, int TN>
__device__ __forceinline__ void zero(float (&a)[TM][TN]) {
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int t = 0; t < TN; ++t) a[i][t] = 0.f;
}

}  // namespace portable
}  // namespace cupyflash
