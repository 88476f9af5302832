// Portable FlashAttention forward (FlashAttention-2 algorithm, SIMT, any NVIDIA GPU).
//
// One block per (Q_i tile, query head, batch). Q_i stays in shared memory; the block walks
// the K_j / V_j tiles, keeping the running row max m (log2 units), the running sum l and
// the unnormalised O_i in registers; O_i and lse are written once at the end.
//
// Template parameters: element type T, padded head dim DP (a multiple of 32), query rows BR
// and key columns BC per tile, TM query rows per thread, LANES threads per row group
// (see portable_tile.cuh for who owns what), and MIN_BLOCKS: blocks per SM that the register
// allocation must allow (ptxas otherwise trades occupancy away, or spills a few bytes to reach
// a register target of its own). Threads = BR / TM * LANES.
//
// Measured on an H200 (fp32, D=128): prefetching K_j+1 / V_j into registers during the
// products was slower (29 vs 34 TFLOP/s; the extra registers cost a block per SM), so the
// loads go straight to shared memory and other resident blocks hide their latency.
#include "portable_tile.cuh"

using namespace cupyflash;
using namespace cupyflash::portable;

template <typename T, int DP, int BR, int BC, int TM, int LANES, int MIN_BLOCKS>
__global__ void __launch_bounds__(BR / TM * LANES, MIN_BLOCKS)
portable_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
             float* __restrict__ lse,
             long long sqb, long long sqh, long long sqn,
             long long skb, long long skh, long long skn,
             long long svb, long long svh, long long svn,
             long long sob, long long soh, long long son,
             long long slb, long long slh, long long sln,
             int nq, int nk, int d, int group, int causal, float scale_log2, int vec) {
    constexpr int THREADS = BR / TM * LANES;
    constexpr int TN = BC / LANES;  // S columns per thread
    constexpr int DT = DP / LANES;  // O columns per thread
    constexpr int VEC = vec_of(DT);
    constexpr int LDD = ld_of(DP);  // Q_i, K_j, V_j rows
    constexpr int LDP = ld_of(BC);  // P rows
    static_assert(BR % TM == 0 && BC % LANES == 0 && DP % LANES == 0 && BC % 4 == 0, "tile shape");
    static_assert(THREADS % 32 == 0 && LANES <= 32, "row groups must tile whole warps");

    // K_j and V_j share one buffer: S is finished before V_j is needed, and the smaller
    // footprint keeps two or more blocks per SM (the SIMT pipes need the warps).
    extern __shared__ float4 smem_f4[];
    float* Qs = reinterpret_cast<float*>(smem_f4);
    float* KVs = Qs + BR * LDD;
    float* Ps = KVs + BC * LDD;

    const int lane = threadIdx.x % LANES, g = threadIdx.x / LANES;
    const int r0 = blockIdx.x * BR, h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const bool v16 = vec != 0;
    const int off = nk - nq;  // causal: row r sees keys <= r + off (bottom-right aligned)

    const T* kb = k + b * skb + hk * skh;
    const T* vb = v + b * svb + hk * svh;
    load_tile<T, BR, DP, THREADS>(Qs, q + b * sqb + h * sqh + r0 * sqn, sqn, nq - r0, d, v16);

    float acc[TM][DT];
    zero(acc);
    float m[TM], l[TM];  // m: row max of scaled scores in log2 units; l: this thread's part of the row sum
#pragma unroll
    for (int i = 0; i < TM; ++i) { m[i] = neg_inf(); l[i] = 0.f; }

    // Tiles entirely above the diagonal are never visited.
    const int kv_end = causal ? min(nk, min(r0 + BR, nq) + off) : nk;
    const int n_tiles = kv_end > 0 ? cdiv(kv_end, BC) : 0;

#pragma unroll 1
    for (int j = 0; j < n_tiles; ++j) {
        const int c0 = j * BC;
        __syncthreads();  // previous P V done with KVs and Ps
        load_tile<T, BC, DP, THREADS>(KVs, kb + c0 * skn, skn, nk - c0, d, v16);
        __syncthreads();

        float s[TM][TN];
        zero(s);
        mma_abT<TM, TN, DP, LDD, LDD, LANES>(s, Qs + g * TM * LDD, KVs + lane * LDD);

        // Only the tile holding the end of the keys or crossing the diagonal needs a mask.
        const bool masked = c0 + BC > nk || (causal && c0 + BC - 1 > r0 + off);
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int row = r0 + g * TM + i;
            float mx = neg_inf();
#pragma unroll
            for (int t = 0; t < TN; ++t) {
                const int key = c0 + lane + t * LANES;
                float x = s[i][t] * scale_log2;
                if (masked && (key >= nk || (causal && key > row + off))) x = neg_inf();
                s[i][t] = x;
                mx = fmaxf(mx, x);
            }
            const float m_new = fmaxf(m[i], group_max<LANES>(mx));
            // A row that has seen no key yet keeps m = -inf; subtracting 0 then gives p = 0, not NaN.
            const float m_use = m_new == neg_inf() ? 0.f : m_new;
            const float alpha = exp2f(m[i] - m_use);
            float sum = 0.f;
#pragma unroll
            for (int t = 0; t < TN; ++t) {
                const float p = exp2f(s[i][t] - m_use);
                sum += p;
                Ps[(g * TM + i) * LDP + lane + t * LANES] = p;
            }
            l[i] = l[i] * alpha + sum;
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < DT; ++c) acc[i][c] *= alpha;
        }
        __syncthreads();  // all of S done with K_j; P complete
        load_tile<T, BC, DP, THREADS>(KVs, vb + c0 * svn, svn, nk - c0, d, v16);
        __syncthreads();
        mma_ab<TM, DT, LANES, BC, LDP, LDD>(acc, Ps + g * TM * LDP, KVs + lane * VEC);
    }

    // Epilogue: O_i = acc / l, lse = ln(2^m * l). A row with no visible key gets 0 and -inf.
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = r0 + g * TM + i;
        const float lt = group_sum<LANES>(l[i]);
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        if (row < nq) {
            store_row<T, DT, VEC, LANES>(o + b * sob + h * soh + row * son, acc[i], inv, lane, d, v16);
            if (lane == 0)
                lse[b * slb + h * slh + row * sln] = lt > 0.f ? m[i] * 0.6931471805599453f + logf(lt) : neg_inf();
        }
    }
}
