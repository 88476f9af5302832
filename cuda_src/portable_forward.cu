// Portable FlashAttention forward (FlashAttention-2 algorithm, SIMT, any NVIDIA GPU).
//
// One block per (Q_i tile, batch * query head): a 2-D grid decoded by tile_coord(p), in either order
// (p.heads_fastest). Q_i stays in shared memory; the block walks, in increasing order, the K_j / V_j
// tiles that the mask policy's keys_of(Q_i rows) covers, keeping the running row max m (log2 units),
// the running sum l and the unnormalised O_i in registers; O_i and lse are written once at the end.
//
// Template parameters: element type T, padded head dim DP (a multiple of 32), query rows BR
// and key columns BC per tile, TM query rows per thread, LANES threads per row group
// (see portable_tile.cuh for who owns what), MIN_BLOCKS: blocks per SM that the register
// allocation must allow (ptxas otherwise trades occupancy away, or spills a few bytes to reach
// a register target of its own), KV_BUFS (1 or 2, below), then the variant Policy (mask and score).
// Threads = BR / TM * LANES.
//
// Variants: a non-identity score policy maps each raw q . k to its final log2-unit score (softcap,
// ALiBi) with the accurate tanhf/log2f, since float32 results are held to 1e-5 of a float64 reference;
// an attention sink starts each row's softmax at the sink's logit with sum 1.
//
// Measured on an H200 (fp32, D=128): prefetching K_j+1 / V_j into registers during the
// products was slower (29 vs 34 TFLOP/s; the extra registers cost a block per SM). So with
// KV_BUFS = 1 the loads go straight to shared memory and other resident blocks hide their
// latency; that leaves a block alone on its SM (small grids, issue 12) waiting two global round
// trips a tile. KV_BUFS = 2 gives K_j and V_j a buffer each and copies with cp.async, which holds
// no registers: V_j flies during S = Q K_j^T and the softmax, K_j+1 during O += P V_j (the
// plan picks it for float32 on sm_80+ where the extra buffer keeps min_blocks per SM).
#include "portable_tile.cuh"

using namespace cupyflash;
using namespace cupyflash::portable;

template <typename T, int DP, int BR, int BC, int TM, int LANES, int MIN_BLOCKS, int KV_BUFS, class Policy>
__global__ void __launch_bounds__(BR / TM * LANES, MIN_BLOCKS)
portable_fwd(const __grid_constant__ AttentionParams p) {
    constexpr int THREADS = BR / TM * LANES;
    constexpr int TN = BC / LANES;  // S columns per thread
    constexpr int DT = DP / LANES;  // O columns per thread
    constexpr int VEC = vec_of(DT);
    constexpr int LDD = ld_of(DP);  // Q_i, K_j, V_j rows
    constexpr int LDP = ld_of(BC);  // P rows
    static_assert(BR % TM == 0 && BC % LANES == 0 && DP % LANES == 0 && BC % 4 == 0, "tile shape");
    static_assert(THREADS % 32 == 0 && LANES <= 32, "row groups must tile whole warps");
    static_assert(KV_BUFS == 1 || KV_BUFS == 2, "K_j and V_j share a buffer or have one each");
    constexpr bool kPipe = KV_BUFS == 2;

    // KV_BUFS = 1: K_j and V_j share one buffer (S is finished before V_j is needed), and the
    // smaller footprint keeps two or more blocks per SM (the SIMT pipes need the warps).
    extern __shared__ float4 smem_f4[];
    float* Qs = reinterpret_cast<float*>(smem_f4);
    float* Ks = Qs + BR * LDD;
    float* Vs = Ks + (KV_BUFS - 1) * BC * LDD;
    float* Ps = Vs + BC * LDD;

    const TileCoord tc = query_tile_coord(p, BR);  // (batch * query heads, query tile)
    const int lane = threadIdx.x % LANES, g = threadIdx.x / LANES;
    const int r0 = tc.tile * BR, b = tc.bh / p.hq, h = tc.bh % p.hq, hk = h / p.group;
    const SeqGeometry seq = seq_geometry(p, b);  // varlen: sequence b's rows and lengths
    if (r0 >= seq.nq) return;                     // past this sequence's queries (never when dense)
    const int nq = seq.nq, d = p.d;
    const float scale_log2 = p.scale_log2;
    const bool v16 = p.vec != 0;

    const T* kb = static_cast<const T*>(p.k) + b * p.k_s.b + hk * p.k_s.h + seq.k_row0 * p.k_s.n;
    const T* vb = static_cast<const T*>(p.v) + b * p.v_s.b + hk * p.v_s.h + seq.k_row0 * p.v_s.n;
    const long long qrow = (long long)seq.q_row0 + r0;
    const T* qb = static_cast<const T*>(p.q) + b * p.q_s.b + h * p.q_s.h + qrow * p.q_s.n;
    if constexpr (!kPipe) load_tile<T, BR, DP, THREADS>(Qs, qb, p.q_s.n, nq - r0, d, v16);

    float acc[TM][DT];
    zero(acc);
    float m[TM], l[TM];  // m: row max of scaled scores in log2 units; l: this thread's part of the row sum
    // A sink is one more logit in every row: m starts at it and l at its exp2(0) = 1, held by lane 0
    // only since l is a partial sum over the row group (group_sum at the end).
    const float sink = sink_log2(p, h);
    const float l0 = (lane == 0 && sink != neg_inf()) ? 1.f : 0.f;
#pragma unroll
    for (int i = 0; i < TM; ++i) { m[i] = sink; l[i] = l0; }

    // Only the key tiles that some row of Q_i may see (under causal, none wholly above the diagonal).
    const Range kt = tiles_covering(Policy(p, seq).mask.keys_of(r0, r0 + BR), BC);
    if constexpr (kPipe) {  // Q_i and the first K_j in flight together: the first cp.async group
        load_tile_async<T, BR, DP, THREADS>(Qs, qb, p.q_s.n, nq - r0, d, v16);
        if (kt.begin < kt.end)
            load_tile_async<T, BC, DP, THREADS>(Ks, kb + kt.begin * BC * p.k_s.n, p.k_s.n, seq.nk - kt.begin * BC, d,
                                                v16);
        async_commit();
    }

    prefetch_score_arrays<true, typename Policy::Score, BR, BC, THREADS>(p, b, h, r0, kt.begin * BC);
#pragma unroll 1
    for (int j = kt.begin; j < kt.end; ++j) {
        const int c0 = j * BC;
        __syncthreads();  // previous P V done with Vs (and Ks, when they share) and Ps
        {  // Mask/bias arrays: the block's rows of the next key tile into L1, a whole step ahead (this tile's
           // came with the previous step, the first before the loop).
            using S = typename Policy::Score;
            if (j + 1 < kt.end) prefetch_score_arrays<true, S, BR, BC, THREADS>(p, b, h, r0, c0 + BC);
        }
        if constexpr (Policy::Dropout::kOn) {
            // Z_ij into this thread's own Ps slots before S is live: Philox's dozen registers inside the
            // softmax loop spilled the larger tiles.
            Policy dpol(p, seq_geometry(p, b));
            dpol.dropout.at_head(p, b, h);
#pragma unroll 1
            for (int i = 0; i < TM; ++i)
#pragma unroll 1
                for (int t = 0; t < TN; ++t)
                    Ps[(g * TM + i) * LDP + lane + t * LANES] =
                        dpol.dropout.factor(r0 + g * TM + i, c0 + lane + t * LANES);
        }
        if constexpr (kPipe) {
            // V_j into its own buffer (free since the barrier above), landing while S and the softmax run;
            // then wait for K_j (the group before: with Q_i for the first tile, else issued before P V_j-1).
            load_tile_async<T, BC, DP, THREADS>(Vs, vb + c0 * p.v_s.n, p.v_s.n, seq_geometry(p, b).nk - c0, d, v16);
            async_commit();
            async_wait<1>();
        } else {
            load_tile<T, BC, DP, THREADS>(Ks, kb + c0 * p.k_s.n, p.k_s.n, seq_geometry(p, b).nk - c0, d, v16);
        }
        __syncthreads();

        float s[TM][TN];
        zero(s);
        mma_abT<TM, TN, DP, LDD, LDD, LANES>(s, Qs + g * TM * LDD, Ks + lane * LDD);

        // The policy is built here, per tile, from the sequence's lengths re-read (varlen; dense: from the
        // constant bank as before), so that they are not held in registers through the products (the D=64
        // float tile sits at its 168-register cap).
        Policy pol(p, seq_geometry(p, b));
        pol.score.at_head(p, b, h);
        mask_at_head(pol.mask, p, b, h);

        // Score variants (softcap, ALiBi) in place, in their own pass: fused into the masking loop below,
        // the D=64 Window tile spilled on sm_90a at its 168-register cap.
        if constexpr (!Policy::Score::kIdentity) {
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int t = 0; t < TN; ++t)
                    s[i][t] = pol.score.template log2_score<false>(s[i][t], r0 + g * TM + i, c0 + lane + t * LANES);
        }
        // Only partial tiles (the end of the keys, the diagonal) test elements.
        const bool masked = pol.mask.partial(r0, r0 + BR, c0, c0 + BC);
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int row = r0 + g * TM + i;
            float mx = neg_inf();
#pragma unroll
            for (int t = 0; t < TN; ++t) {
                const int key = c0 + lane + t * LANES;
                float x = s[i][t];
                if constexpr (Policy::Score::kIdentity) x *= scale_log2;
                if (masked && !pol.mask.visible(row, key)) x = neg_inf();
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
                const float pij = exp2f(s[i][t] - m_use);
                sum += pij;  // the row sum (and lse) are the undropped softmax's
                if constexpr (Policy::Dropout::kOn)
                    Ps[(g * TM + i) * LDP + lane + t * LANES] *= pij;  // Z_ij is there already
                else
                    Ps[(g * TM + i) * LDP + lane + t * LANES] = pij;
            }
            l[i] = l[i] * alpha + sum;
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < DT; ++c) acc[i][c] *= alpha;
        }
        __syncthreads();  // all of S done with K_j; P complete
        if constexpr (kPipe) {
            // K_j+1 into K_j's buffer, landing while P V_j runs; an empty group after the last tile keeps the
            // count of groups in flight the same every step. Then wait for V_j.
            if (j + 1 < kt.end)
                load_tile_async<T, BC, DP, THREADS>(Ks, kb + (c0 + BC) * p.k_s.n, p.k_s.n,
                                                    seq_geometry(p, b).nk - c0 - BC, d, v16);
            async_commit();
            async_wait<1>();
        } else {
            load_tile<T, BC, DP, THREADS>(Vs, vb + c0 * p.v_s.n, p.v_s.n, seq_geometry(p, b).nk - c0, d, v16);
        }
        __syncthreads();
        mma_ab<TM, DT, LANES, BC, LDP, LDD>(acc, Ps + g * TM * LDP, Vs + lane * VEC);
    }
    if constexpr (kPipe) async_wait<0>();  // no copy outlives the block (Q_i's, when no key tile was visited)

    // Epilogue: O_i = acc / l, lse = ln(2^m * l). A row with no visible key and no sink gets 0 and -inf.
    const SeqGeometry rows = seq_geometry(p, b);  // re-read, as in the loop
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = r0 + g * TM + i;
        const float lt = group_sum<LANES>(l[i]);
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        if (row < rows.nq) {
            const long long prow = (long long)rows.q_row0 + row;  // the packed row (= row when dense)
            store_row<T, DT, VEC, LANES>(static_cast<T*>(p.o) + b * p.o_s.b + h * p.o_s.h + prow * p.o_s.n, acc[i],
                                         inv, lane, d, v16);
            if (lane == 0)
                p.lse[b * p.lse_s.b + h * p.lse_s.h + prow * p.lse_s.n] =
                    lt > 0.f ? m[i] * 0.6931471805599453f + logf(lt) : neg_inf();
        }
    }
}
