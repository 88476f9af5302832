// Portable FlashAttention backward (FlashAttention-2 algorithm, SIMT, any NVIDIA GPU).
//
//   portable_bwd_delta : Delta = rowsum(dO * O) and lse2 = lse * log2(e), float32, one warp per row.
//   portable_bwd_kv    : one block per (K_j/V_j tile, kv head, batch); dK_j, dV_j stay in registers
//                        while the block walks the group's query heads and their Q_i tiles.
//                        With a dq_acc buffer it also adds scale * dS K_j into dQ (float32 atomics).
//   portable_bwd_dq    : the alternative to atomics: one block per Q_i tile recomputes S, P, dP,
//                        dS against every K_j/V_j tile and writes dQ_i once.
//   portable_bwd_dq_convert : float32 dQ accumulator to the input dtype (after the atomics).
//
// Recomputation: P = exp2(S * scale * log2e - lse2), dS = P * (dP - Delta), with P forced to 0
// where the mask hides a key or lse = -inf (a row that saw no key), so such rows get zero
// gradients and never NaN.
#include "portable_tile.cuh"

using namespace cupyflash;
using namespace cupyflash::portable;

template <typename T>
__global__ void __launch_bounds__(256)
portable_bwd_delta(const T* __restrict__ o, const T* __restrict__ dout, const float* __restrict__ lse,
                   float* __restrict__ lse2, float* __restrict__ delta,
                   long long sob, long long soh, long long son,
                   long long sdb, long long sdh, long long sdn,
                   long long slb, long long slh, long long sln,
                   int hq, int nq, int d, long long rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int lane = threadIdx.x % 32;
    const long long b = row / ((long long)hq * nq);
    const int h = (int)(row / nq % hq), n = (int)(row % nq);
    const T* orow = o + b * sob + h * soh + n * son;
    const T* drow = dout + b * sdb + h * sdh + n * sdn;
    float acc = 0.f;
    for (int c = lane; c < d; c += 32) acc = fmaf(to_float<T>(orow[c]), to_float<T>(drow[c]), acc);
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    if (lane == 0) {
        delta[row] = acc;
        lse2[row] = lse[b * slb + h * slh + n * sln] * kLog2e;  // -inf stays -inf
    }
}

template <typename T>
__global__ void __launch_bounds__(256)
portable_bwd_dq_convert(const float* __restrict__ dq_acc, T* __restrict__ dq,
                        long long sb, long long sh, long long sn, int hq, int nq, int d, long long total) {
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(idx % d);
        const long long row = idx / d;
        const int n = (int)(row % nq), h = (int)(row / nq % hq);
        const long long b = row / ((long long)nq * hq);
        dq[b * sb + h * sh + n * sn + c] = from_float<T>(dq_acc[idx]);
    }
}

// Which (key, query row) pairs of a tile the mask hides; `masked` is false for interior tiles,
// so they skip the per-element test.
struct MaskInfo {
    bool masked;  // does this tile cross the diagonal or an edge?
    int causal, nk, off;
    __device__ __forceinline__ bool hidden(int key, int qrow) const {
        return masked && (key >= nk || (causal && key > qrow + off));
    }
};

// ------------------------------------------------------------------------------ dK, dV (+ dQ atomics)

// Threads = BC / TM * LANES. Rows of the S-like tiles are keys (TM per thread), columns are
// queries (TN = BR / LANES per thread). The optional dQ partial product regroups the same
// threads over the BR query rows (TMQ rows per thread, LANESQ lanes per row).
template <typename T, int DP, int BC, int BR, int TM, int LANES>
__global__ void __launch_bounds__(BC / TM * LANES, 1)
portable_bwd_kv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ delta,
                T* __restrict__ dk, T* __restrict__ dv, float* __restrict__ dq_acc,
                long long sqb, long long sqh, long long sqn,
                long long skb, long long skh, long long skn,
                long long svb, long long svh, long long svn,
                long long sdb, long long sdh, long long sdn,
                long long sdkb, long long sdkh, long long sdkn,
                long long sdvb, long long sdvh, long long sdvn,
                int nq, int nk, int d, int group, int causal, float scale_log2, float scale, int vec) {
    constexpr int THREADS = BC / TM * LANES;
    constexpr int TN = BR / LANES;
    constexpr int DT = DP / LANES;
    constexpr int VEC = vec_of(DT);
    constexpr int TMQ = max_c(1, BR * 16 / THREADS);
    constexpr int GQ = BR / TMQ;
    constexpr int LANESQ = THREADS / GQ;
    constexpr int DTQ = DP / LANESQ;
    constexpr int VECQ = vec_of(DTQ);
    constexpr int LDD = ld_of(DP);
    constexpr int LDS = ld_of(BR);
    static_assert(BC % TM == 0 && BR % LANES == 0 && DP % LANES == 0 && BR % 4 == 0, "tile shape");
    static_assert(THREADS % 32 == 0 && LANES <= 32, "row groups must tile whole warps");
    static_assert(GQ * LANESQ == THREADS && DP % LANESQ == 0, "dQ regrouping");
    static_assert(THREADS >= BR, "one thread per query row loads lse2 and Delta");

    extern __shared__ float4 smem_f4[];
    float* Ks = reinterpret_cast<float*>(smem_f4);
    float* Vs = Ks + BC * LDD;
    float* Qs = Vs + BC * LDD;
    float* dOs = Qs + BR * LDD;
    float* Pts = dOs + BR * LDD;   // P^T  [key][query]
    float* dSts = Pts + BC * LDS;  // dS^T [key][query]
    float* lse2s = dSts + BC * LDS;
    float* deltas = lse2s + BR;

    const int tid = threadIdx.x, lane = tid % LANES, g = tid / LANES;
    const int c0 = blockIdx.x * BC, hk = blockIdx.y, b = blockIdx.z;
    const int hq = gridDim.y * group;
    const bool v16 = vec != 0;
    const int off = nk - nq;

    load_tile<T, BC, DP, THREADS>(Ks, k + b * skb + hk * skh + c0 * skn, skn, nk - c0, d, v16);
    load_tile<T, BC, DP, THREADS>(Vs, v + b * svb + hk * svh + c0 * svn, svn, nk - c0, d, v16);

    float dk_acc[TM][DT], dv_acc[TM][DT];
    zero(dk_acc);
    zero(dv_acc);

    // Causal: query rows below c0 - off see none of these keys; their tiles are skipped.
    const int i_begin = causal ? max(0, c0 - off) / BR : 0;
    const int n_qtiles = cdiv(nq, BR);

#pragma unroll 1
    for (int hh = 0; hh < group; ++hh) {
        const int h = hk * group + hh;
        const T* qh = q + b * sqb + h * sqh;
        const T* dh = dout + b * sdb + h * sdh;
        const long long rowbase = ((long long)b * hq + h) * nq;
#pragma unroll 1
        for (int it = i_begin; it < n_qtiles; ++it) {
            const int r0 = it * BR;
            __syncthreads();  // previous tile's products are done with Qs, dOs, Pts, dSts
            load_tile<T, BR, DP, THREADS>(Qs, qh + r0 * sqn, sqn, nq - r0, d, v16);
            load_tile<T, BR, DP, THREADS>(dOs, dh + r0 * sdn, sdn, nq - r0, d, v16);
            if (tid < BR) {
                const bool in = r0 + tid < nq;
                lse2s[tid] = in ? lse2[rowbase + r0 + tid] : neg_inf();
                deltas[tid] = in ? delta[rowbase + r0 + tid] : 0.f;
            }
            __syncthreads();

            float s[TM][TN], dp[TM][TN];
            zero(s);
            zero(dp);
            mma_abT<TM, TN, DP, LDD, LDD, LANES>(s, Ks + g * TM * LDD, Qs + lane * LDD);    // S^T = K Q^T
            mma_abT<TM, TN, DP, LDD, LDD, LANES>(dp, Vs + g * TM * LDD, dOs + lane * LDD);  // dP^T = V dO^T

            const MaskInfo mi{c0 + BC > nk || (causal && c0 + BC - 1 > r0 + off), causal, nk, off};
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                const int key = c0 + g * TM + i;
#pragma unroll
                for (int t = 0; t < TN; ++t) {
                    const int qc = lane + t * LANES;
                    const float L = lse2s[qc];
                    const bool zero_p = L == neg_inf() || mi.hidden(key, r0 + qc);
                    const float p = zero_p ? 0.f : exp2f(s[i][t] * scale_log2 - L);
                    Pts[(g * TM + i) * LDS + qc] = p;
                    dSts[(g * TM + i) * LDS + qc] = p * (dp[i][t] - deltas[qc]);
                }
            }
            __syncthreads();
            mma_ab<TM, DT, LANES, BR, LDS, LDD>(dv_acc, Pts + g * TM * LDS, dOs + lane * VEC);   // dV += P^T dO
            mma_ab<TM, DT, LANES, BR, LDS, LDD>(dk_acc, dSts + g * TM * LDS, Qs + lane * VEC);  // dK += dS^T Q

            if (dq_acc != nullptr) {  // dQ_i += scale * dS K_j, added to the float32 buffer
                const int laneq = tid % LANESQ, gq = tid / LANESQ;
                float dq[TMQ][DTQ];
                zero(dq);
                mma_atb<TMQ, DTQ, LANESQ, BC, LDS, LDD>(dq, dSts + gq * TMQ, Ks + laneq * VECQ);
#pragma unroll
                for (int i = 0; i < TMQ; ++i) {
                    const int row = r0 + gq * TMQ + i;
                    if (row < nq) {
                        float* dst = dq_acc + (rowbase + row) * d;
#pragma unroll
                        for (int c = 0; c < DTQ; ++c) {
                            const int col = col_of<VECQ, LANESQ>(c, laneq);
                            if (col < d) atomicAdd(dst + col, dq[i][c] * scale);
                        }
                    }
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int key = c0 + g * TM + i;
        if (key < nk) {
            store_row<T, DT, VEC, LANES>(dk + b * sdkb + hk * sdkh + key * sdkn, dk_acc[i], scale, lane, d, v16);
            store_row<T, DT, VEC, LANES>(dv + b * sdvb + hk * sdvh + key * sdvn, dv_acc[i], 1.f, lane, d, v16);
        }
    }
}

// ------------------------------------------------------------------------------ dQ, separate pass

// Threads = BR / TM * LANES; rows are queries, columns keys (TN = BC / LANES per thread).
template <typename T, int DP, int BR, int BC, int TM, int LANES>
__global__ void __launch_bounds__(BR / TM * LANES, 1)
portable_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                const T* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ delta,
                T* __restrict__ dq,
                long long sqb, long long sqh, long long sqn,
                long long skb, long long skh, long long skn,
                long long svb, long long svh, long long svn,
                long long sdb, long long sdh, long long sdn,
                long long sdqb, long long sdqh, long long sdqn,
                int nq, int nk, int d, int group, int causal, float scale_log2, float scale, int vec) {
    constexpr int THREADS = BR / TM * LANES;
    constexpr int TN = BC / LANES;
    constexpr int DT = DP / LANES;
    constexpr int VEC = vec_of(DT);
    constexpr int LDD = ld_of(DP);
    constexpr int LDS = ld_of(BC);
    static_assert(BR % TM == 0 && BC % LANES == 0 && DP % LANES == 0 && BC % 4 == 0, "tile shape");
    static_assert(THREADS % 32 == 0 && LANES <= 32, "row groups must tile whole warps");
    static_assert(THREADS >= BR, "one thread per query row loads lse2 and Delta");

    extern __shared__ float4 smem_f4[];
    float* Qs = reinterpret_cast<float*>(smem_f4);
    float* dOs = Qs + BR * LDD;
    float* Ks = dOs + BR * LDD;
    float* Vs = Ks + BC * LDD;
    float* dSs = Vs + BC * LDD;  // dS [query][key]
    float* lse2s = dSs + BR * LDS;
    float* deltas = lse2s + BR;

    const int tid = threadIdx.x, lane = tid % LANES, g = tid / LANES;
    const int r0 = blockIdx.x * BR, h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const bool v16 = vec != 0;
    const int off = nk - nq;
    const long long rowbase = ((long long)b * gridDim.y + h) * nq;

    load_tile<T, BR, DP, THREADS>(Qs, q + b * sqb + h * sqh + r0 * sqn, sqn, nq - r0, d, v16);
    load_tile<T, BR, DP, THREADS>(dOs, dout + b * sdb + h * sdh + r0 * sdn, sdn, nq - r0, d, v16);
    if (tid < BR) {
        const bool in = r0 + tid < nq;
        lse2s[tid] = in ? lse2[rowbase + r0 + tid] : neg_inf();
        deltas[tid] = in ? delta[rowbase + r0 + tid] : 0.f;
    }
    const T* kb = k + b * skb + hk * skh;
    const T* vb = v + b * svb + hk * svh;

    float acc[TM][DT];
    zero(acc);
    const int kv_end = causal ? min(nk, min(r0 + BR, nq) + off) : nk;
    const int n_tiles = kv_end > 0 ? cdiv(kv_end, BC) : 0;

#pragma unroll 1
    for (int j = 0; j < n_tiles; ++j) {
        const int c0 = j * BC;
        __syncthreads();
        load_tile<T, BC, DP, THREADS>(Ks, kb + c0 * skn, skn, nk - c0, d, v16);
        load_tile<T, BC, DP, THREADS>(Vs, vb + c0 * svn, svn, nk - c0, d, v16);
        __syncthreads();

        float s[TM][TN], dp[TM][TN];
        zero(s);
        zero(dp);
        mma_abT<TM, TN, DP, LDD, LDD, LANES>(s, Qs + g * TM * LDD, Ks + lane * LDD);    // S = Q K^T
        mma_abT<TM, TN, DP, LDD, LDD, LANES>(dp, dOs + g * TM * LDD, Vs + lane * LDD);  // dP = dO V^T

        const MaskInfo mi{c0 + BC > nk || (causal && c0 + BC - 1 > r0 + off), causal, nk, off};
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int rl = g * TM + i;
            const float L = lse2s[rl], dl = deltas[rl];
#pragma unroll
            for (int t = 0; t < TN; ++t) {
                const int kc = lane + t * LANES;
                const bool zero_p = L == neg_inf() || mi.hidden(c0 + kc, r0 + rl);
                const float p = zero_p ? 0.f : exp2f(s[i][t] * scale_log2 - L);
                dSs[rl * LDS + kc] = p * (dp[i][t] - dl);
            }
        }
        __syncthreads();
        mma_ab<TM, DT, LANES, BC, LDS, LDD>(acc, dSs + g * TM * LDS, Ks + lane * VEC);  // dQ += dS K
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = r0 + g * TM + i;
        if (row < nq) store_row<T, DT, VEC, LANES>(dq + b * sdqb + h * sdqh + row * sdqn, acc[i], scale, lane, d, v16);
    }
}
