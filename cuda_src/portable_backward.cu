// Portable FlashAttention backward (FlashAttention-2 algorithm, SIMT, any NVIDIA GPU).
//
// Every kernel takes one `const __grid_constant__ AttentionParams p`; the main ones also a mask Policy.
//
//   portable_bwd_delta : Delta = rowsum(dO * O) and lse_log2 = lse * log2(e), float32, one warp per row
//                        (1-D grid over p.rows); with attention sinks also each row's share of dsinks.
//   portable_bwd_kv    : one block per (K_j/V_j tile, batch * kv head), 2-D grid via tile_coord(p);
//                        dK_j, dV_j stay in registers while the block walks the group's query heads
//                        and the Q_i tiles that the policy's queries_of(K_j keys) covers.
//                        With p.dq_accum set it also adds scale * dS K_j into dQ (float32 atomics).
//   portable_bwd_dq    : the alternative to atomics (p.dq_accum == nullptr): one block per (Q_i tile,
//                        batch * query head) recomputes S, P, dP, dS against the K_j/V_j tiles of
//                        keys_of(Q_i rows) and writes dQ_i once.
//   portable_bwd_dq_convert : float32 dQ accumulator to the input dtype (after the atomics; 1-D grid).
//
// Recomputation: P = exp2(S * scale * log2e - lse_log2), dS = P * (dP - Delta), with P forced to 0
// where the mask hides a key or lse = -inf (a row that saw no key), so such rows get zero
// gradients and never NaN. A non-identity score policy replaces S * scale * log2e by its log2-unit
// score (softcap, ALiBi) and multiplies dS by d(score)/d(scale q.k), both to float accuracy
// (kFast = false). A sink needs nothing here: it lives in lse, and its gradient in the Delta kernel.
#include "portable_tile.cuh"
#include "dq_turns.cuh"

using namespace cupyflash;
using namespace cupyflash::portable;

template <typename T>
__global__ void __launch_bounds__(256)
portable_bwd_delta(const __grid_constant__ AttentionParams p) {  // 256 threads (plans.portable.DELTA_THREADS)
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const bool live = row < p.rows;
    const int lane = threadIdx.x % 32;
    const int hq = p.hq, nq = row_extent(p);  // varlen: the packed rows, as one batch of total_q
    const long long b = row / ((long long)hq * nq);
    const int h = live ? (int)(row / nq % hq) : 0, n = (int)(row % nq);
    float acc = 0.f, lse = 0.f;
    if (live) {
        const T* orow = static_cast<const T*>(p.o) + b * p.o_s.b + h * p.o_s.h + n * p.o_s.n;
        const T* drow = static_cast<const T*>(p.dout) + b * p.dout_s.b + h * p.dout_s.h + n * p.dout_s.n;
        for (int c = lane; c < p.d; c += 32) acc = fmaf(to_float<T>(orow[c]), to_float<T>(drow[c]), acc);
        lse = p.lse[b * p.lse_s.b + h * p.lse_s.h + n * p.lse_s.n];
    }
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, s);
    // d sink_h = -sum over rows of P_sink * Delta, P_sink = exp(sink_h - lse); a -inf sink of a row that saw no
    // key (lse = -inf) adds 0, not NaN. One atomic per block and head (add_dsinks_block).
    if (p.dsinks != nullptr)
        add_dsinks_block<8>(p, h, live && lse != neg_inf() ? -expf(p.sinks[h] - lse) * acc : 0.f, threadIdx.x / 32,
                            lane == 0);
    if (live && lane == 0) {
        p.delta[row] = acc;
        p.lse_log2[row] = lse * kLog2e;  // -inf stays -inf
    }
}

template <typename T>
__global__ void __launch_bounds__(256)
portable_bwd_dq_convert(const __grid_constant__ AttentionParams p) {
    const float* __restrict__ dq_acc = p.dq_accum;
    T* __restrict__ dq = static_cast<T*>(p.dq);
    const int hq = p.hq, nq = row_extent(p), d = p.d;  // varlen: the packed rows, as one batch of total_q
    const long long total = p.rows * d;  // the dense (B * Hq * Nq, D) accumulator
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += (long long)gridDim.x * blockDim.x) {
        const int c = (int)(idx % d);
        const long long row = idx / d;
        const int n = (int)(row % nq), h = (int)(row / nq % hq);
        const long long b = row / ((long long)nq * hq);
        dq[b * p.dq_s.b + h * p.dq_s.h + n * p.dq_s.n + c] = from_float<T>(dq_acc[idx]);
    }
}

// ------------------------------------------------------------------------------ dK, dV (+ dQ atomics)

// Threads = BC / TM * LANES. Rows of the S-like tiles are keys (TM per thread), columns are
// queries (TN = BR / LANES per thread). The optional dQ partial product regroups the same
// threads over the BR query rows (TMQ rows per thread, LANESQ lanes per row).
template <typename T, int DP, int BC, int BR, int TM, int LANES, class Policy>
__global__ void __launch_bounds__(BC / TM * LANES, 1)
portable_bwd_kv(const __grid_constant__ AttentionParams p) {
    const T* __restrict__ q = static_cast<const T*>(p.q);
    const T* __restrict__ dout = static_cast<const T*>(p.dout);
    const float* __restrict__ lse2 = p.lse_log2;
    const float* __restrict__ delta = p.delta;
    float* __restrict__ dq_acc = p.dq_accum;
    const long long sqn = p.q_s.n, sdn = p.dout_s.n;
    const int d = p.d, group = p.group;
    const float scale_log2 = p.scale_log2, scale = p.scale;
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

    const TileCoord tc = dq_key_tile_coord<Policy>(p, BC);  // (batch * kv heads, key tile): dq_turns.cuh
    const int tid = threadIdx.x, lane = tid % LANES, g = tid / LANES;
    const int c0 = tc.tile * BC, b = tc.bh / p.hk, hk = tc.bh % p.hk;
    // Sequence b's rows and lengths (varlen; dense: the whole problem). They are re-read where needed
    // below rather than kept live through the loops (the D=64 float tiles sit at 255 registers).
    const SeqGeometry seq = seq_geometry(p, b);
    if (c0 >= seq.nk) return;  // past this sequence's keys (never when dense)
    const long long krow = (long long)seq.k_row0 + c0;
    const bool v16 = p.vec != 0;

    load_tile<T, BC, DP, THREADS>(Ks, static_cast<const T*>(p.k) + b * p.k_s.b + hk * p.k_s.h + krow * p.k_s.n, p.k_s.n,
                                  seq.nk - c0, d, v16);
    load_tile<T, BC, DP, THREADS>(Vs, static_cast<const T*>(p.v) + b * p.v_s.b + hk * p.v_s.h + krow * p.v_s.n, p.v_s.n,
                                  seq.nk - c0, d, v16);

    float dk_acc[TM][DT], dv_acc[TM][DT];
    zero(dk_acc);
    zero(dv_acc);

    // Only the query tiles with a row that may see some key of K_j (under causal, none wholly above
    // the diagonal).
    const Range qt = tiles_covering(Policy(p, seq).mask.queries_of(c0, c0 + BC), BR);

#pragma unroll 1
    for (int hh = 0; hh < group; ++hh) {
        const int h = hk * group + hh;
        const SeqGeometry seq_h = seq_geometry(p, b);
        const T* qh = q + b * p.q_s.b + h * p.q_s.h + seq_h.q_row0 * sqn;
        const T* dh = dout + b * p.dout_s.b + h * p.dout_s.h + seq_h.q_row0 * sdn;
        const long long rowbase = scratch_row(p, seq_h, b, h);
#pragma unroll 1
        for (int it = qt.begin; it < qt.end; ++it) {
            const int r0 = it * BR;
            const int nq = seq_geometry(p, b).nq;
            __syncthreads();  // previous tile's products are done with Qs, dOs, Pts, dSts
            if constexpr (Policy::Dropout::kOn) {
                // Z_ij into this thread's own P^T slots while few registers are live (see portable_fwd).
                Policy dpol(p, seq_geometry(p, b));
                dpol.dropout.at_head(p, b, h);
#pragma unroll 1
                for (int i = 0; i < TM; ++i)
#pragma unroll 1
                    for (int t = 0; t < TN; ++t)
                        Pts[(g * TM + i) * LDS + lane + t * LANES] =
                            dpol.dropout.factor(r0 + lane + t * LANES, c0 + g * TM + i);
            }
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

            // The policy per tile, after the products (see seq above; dense: from the constant bank).
            Policy pol(p, seq_geometry(p, b));
            pol.score.at_head(p, b, h);  // ALiBi slope of this query head
            mask_at_head(pol.mask, p, b, h);
            // Only partial tiles (the end of the keys, the diagonal) test elements.
            const bool masked = pol.mask.partial(r0, r0 + BR, c0, c0 + BC);
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                const int key = c0 + g * TM + i;
#pragma unroll
                for (int t = 0; t < TN; ++t) {
                    const int qc = lane + t * LANES;
                    const float L = lse2s[qc];
                    const bool zero_p = L == neg_inf() || (masked && !pol.mask.visible(r0 + qc, key));
                    float x;
                    if constexpr (Policy::Score::kIdentity) x = s[i][t] * scale_log2;
                    else x = pol.score.template log2_score<false>(s[i][t], r0 + qc, key);
                    const float pij = zero_p ? 0.f : exp2f(x - L);
                    float z = 1.f;
                    if constexpr (Policy::Dropout::kOn) z = Pts[(g * TM + i) * LDS + qc];  // Z_ij, from above
                    Pts[(g * TM + i) * LDS + qc] = pij * z;
                    float ds = pij * (dp[i][t] * z - deltas[qc]);
                    if constexpr (HasBiasGrad<typename Policy::Score>::value) pol.score.add_dbias(ds, r0 + qc, key);
                    if constexpr (!Policy::Score::kIdentity) ds *= pol.score.template ds_factor<false>(pij, L, r0 + qc, key);
                    dSts[(g * TM + i) * LDS + qc] = ds;
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
                int* const turn_slot = dq_turn_slot<BR>(p, b, h, r0);  // deterministic: after the earlier key tiles
                const int turn = dq_turn_of<BR, BC>(pol.mask, r0, c0);
                dq_turn_wait(turn_slot, turn);
#pragma unroll
                for (int i = 0; i < TMQ; ++i) {
                    const int row = r0 + gq * TMQ + i;
                    if (row < seq_geometry(p, b).nq) {
                        float* dst = dq_acc + (rowbase + row) * d;
#pragma unroll
                        for (int c = 0; c < DTQ; ++c) {
                            const int col = col_of<VECQ, LANESQ>(c, laneq);
                            if (col < d) atomicAdd(dst + col, dq[i][c] * scale);
                        }
                    }
                }
                dq_turn_pass(turn_slot, turn);
            }
        }
    }

    const SeqGeometry seq_e = seq_geometry(p, b);
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int key = c0 + g * TM + i;
        if (key < seq_e.nk) {
            const long long prow = (long long)seq_e.k_row0 + key;  // the packed row (= key when dense)
            T* dk_row = static_cast<T*>(p.dk) + b * p.dk_s.b + hk * p.dk_s.h + prow * p.dk_s.n;
            T* dv_row = static_cast<T*>(p.dv) + b * p.dv_s.b + hk * p.dv_s.h + prow * p.dv_s.n;
            store_row<T, DT, VEC, LANES>(dk_row, dk_acc[i], scale, lane, d, v16);
            store_row<T, DT, VEC, LANES>(dv_row, dv_acc[i], 1.f, lane, d, v16);
        }
    }
}

// ------------------------------------------------------------------------------ dQ, separate pass

// Threads = BR / TM * LANES; rows are queries, columns keys (TN = BC / LANES per thread).
template <typename T, int DP, int BR, int BC, int TM, int LANES, class Policy>
__global__ void __launch_bounds__(BR / TM * LANES, 1)
portable_bwd_dq(const __grid_constant__ AttentionParams p) {
    const float* __restrict__ lse2 = p.lse_log2;
    const float* __restrict__ delta = p.delta;
    const long long skn = p.k_s.n, svn = p.v_s.n;
    const int d = p.d;
    const float scale_log2 = p.scale_log2;
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

    const TileCoord tc = query_tile_coord(p, BR);  // (batch * query heads, query tile)
    const int tid = threadIdx.x, lane = tid % LANES, g = tid / LANES;
    const int r0 = tc.tile * BR, b = tc.bh / p.hq, h = tc.bh % p.hq, hk = h / p.group;
    const SeqGeometry seq = seq_geometry(p, b);  // varlen: sequence b's rows and lengths
    if (r0 >= seq.nq) return;                     // past this sequence's queries (never when dense)
    const int nq = seq.nq, nk = seq.nk;
    const bool v16 = p.vec != 0;
    Policy pol(p, seq);
    pol.score.at_head(p, b, h);
    mask_at_head(pol.mask, p, b, h);
    pol.dropout.at_head(p, b, h);
    const long long rowbase = scratch_row(p, seq, b, h);
    const long long qrow = (long long)seq.q_row0 + r0;

    const T* qi = static_cast<const T*>(p.q) + b * p.q_s.b + h * p.q_s.h + qrow * p.q_s.n;
    const T* doi = static_cast<const T*>(p.dout) + b * p.dout_s.b + h * p.dout_s.h + qrow * p.dout_s.n;
    load_tile<T, BR, DP, THREADS>(Qs, qi, p.q_s.n, nq - r0, d, v16);
    load_tile<T, BR, DP, THREADS>(dOs, doi, p.dout_s.n, nq - r0, d, v16);
    if (tid < BR) {
        const bool in = r0 + tid < nq;
        lse2s[tid] = in ? lse2[rowbase + r0 + tid] : neg_inf();
        deltas[tid] = in ? delta[rowbase + r0 + tid] : 0.f;
    }
    const T* kb = static_cast<const T*>(p.k) + b * p.k_s.b + hk * p.k_s.h + seq.k_row0 * skn;
    const T* vb = static_cast<const T*>(p.v) + b * p.v_s.b + hk * p.v_s.h + seq.k_row0 * svn;

    float acc[TM][DT];
    zero(acc);
    // Only the key tiles that some row of Q_i may see (under causal, none wholly above the diagonal).
    const Range kt = tiles_covering(pol.mask.keys_of(r0, r0 + BR), BC);

    prefetch_score_arrays<true, typename Policy::Score, BR, BC, THREADS>(p, b, h, r0, kt.begin * BC);
#pragma unroll 1
    for (int j = kt.begin; j < kt.end; ++j) {
        const int c0 = j * BC;
        __syncthreads();
        {  // Mask/bias arrays: the block's next key tile into L1, a whole step ahead (the first before the loop).
            using S = typename Policy::Score;
            if (j + 1 < kt.end) prefetch_score_arrays<true, S, BR, BC, THREADS>(p, b, h, r0, c0 + BC);
        }
        if constexpr (Policy::Dropout::kOn) {
            // Z_ij into this thread's own dS slots while few registers are live (see portable_fwd).
#pragma unroll 1
            for (int i = 0; i < TM; ++i)
#pragma unroll 1
                for (int t = 0; t < TN; ++t)
                    dSs[(g * TM + i) * LDS + lane + t * LANES] =
                        pol.dropout.factor(r0 + g * TM + i, c0 + lane + t * LANES);
        }
        load_tile<T, BC, DP, THREADS>(Ks, kb + c0 * skn, skn, nk - c0, d, v16);
        load_tile<T, BC, DP, THREADS>(Vs, vb + c0 * svn, svn, nk - c0, d, v16);
        __syncthreads();

        float s[TM][TN], dp[TM][TN];
        zero(s);
        zero(dp);
        mma_abT<TM, TN, DP, LDD, LDD, LANES>(s, Qs + g * TM * LDD, Ks + lane * LDD);    // S = Q K^T
        mma_abT<TM, TN, DP, LDD, LDD, LANES>(dp, dOs + g * TM * LDD, Vs + lane * LDD);  // dP = dO V^T

        // Only partial tiles (the end of the keys, the diagonal) test elements.
        const bool masked = pol.mask.partial(r0, r0 + BR, c0, c0 + BC);
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int rl = g * TM + i;
            const float L = lse2s[rl], dl = deltas[rl];
#pragma unroll
            for (int t = 0; t < TN; ++t) {
                const int kc = lane + t * LANES;
                const bool zero_p = L == neg_inf() || (masked && !pol.mask.visible(r0 + rl, c0 + kc));
                float x;
                if constexpr (Policy::Score::kIdentity) x = s[i][t] * scale_log2;
                else x = pol.score.template log2_score<false>(s[i][t], r0 + rl, c0 + kc);
                const float pij = zero_p ? 0.f : exp2f(x - L);
                float z = 1.f;
                if constexpr (Policy::Dropout::kOn) z = dSs[rl * LDS + kc];  // Z_ij, from above
                float ds = pij * (dp[i][t] * z - dl);
                if constexpr (!Policy::Score::kIdentity) ds *= pol.score.template ds_factor<false>(pij, L, r0 + rl, c0 + kc);
                dSs[rl * LDS + kc] = ds;
            }
        }
        __syncthreads();
        mma_ab<TM, DT, LANES, BC, LDS, LDD>(acc, dSs + g * TM * LDS, Ks + lane * VEC);  // dQ += dS K
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = r0 + g * TM + i;
        if (row < nq)
            store_row<T, DT, VEC, LANES>(static_cast<T*>(p.dq) + b * p.dq_s.b + h * p.dq_s.h +
                                             ((long long)seq.q_row0 + row) * p.dq_s.n,
                                         acc[i], p.scale, lane, d, v16);
    }
}
