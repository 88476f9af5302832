// mma_flash_bwd: the backward main kernel with key-major warp strips (see mma_backward.cu).
// Included by mma_backward.cu (after its `using namespace cupyflash::mma`), which holds the
// Delta and dQ-conversion kernels and the launch-facing overview.
#ifndef CUPYFLASH_MMA_BWD_KEYMAJOR_CUH
#define CUPYFLASH_MMA_BWD_KEYMAJOR_CUH
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"
#include "dq_turns.cuh"
#include "dq_own.cuh"
#include "mma_bwd_tf32.cuh"

// kOwnDQ: one key tile covers every key of the kv head, and the block does Delta and stores dQ (dq_own.cuh).
// T = float runs every product as 3xTF32 m16n8k8 steps (mma_bwd_tf32.cuh) on float tiles (TileLayout<2 D>, dS^T
// TileLayout<2 Br>); everything on C fragments is shared with the 16-bit types.
template <typename T, int D, int Br, int kKeyWarps, int kDSplit, int kStages, int kMinBlocks, int kDPChunks, class Policy,
          bool kOwnDQ = false>
__global__ void __launch_bounds__(kKeyWarps * kDSplit * 32, kMinBlocks)
    mma_flash_bwd(const __grid_constant__ AttentionParams p) {
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);
  const T* __restrict__ dout = static_cast<const T*>(p.dout);
  const float* __restrict__ lse = p.lse;
  const float* __restrict__ delta = p.delta;
  float* __restrict__ dq_accum = p.dq_accum;
  const int d = p.d, group = p.group;
  const long long q_sb = p.q_s.b, q_sh = p.q_s.h, q_sn = p.q_s.n;
  const long long k_sb = p.k_s.b, k_sh = p.k_s.h, k_sn = p.k_s.n;
  const long long v_sb = p.v_s.b, v_sh = p.v_s.h, v_sn = p.v_s.n;
  const long long do_sb = p.dout_s.b, do_sh = p.dout_s.h, do_sn = p.dout_s.n;
  const long long lse_sb = p.lse_s.b, lse_sh = p.lse_s.h, lse_sn = p.lse_s.n;
  const float scale_log2 = p.scale_log2;
  constexpr int kWarps = kKeyWarps * kDSplit;
  constexpr int kThreads = kWarps * 32;
  constexpr int Bc = 16 * kKeyWarps;
  constexpr int kDS = D / kDSplit;  // dK/dV columns per warp
  constexpr int kNQ = Br / 8;       // n8 tiles of S^T (queries) per warp
  constexpr int kNC = kNQ / kDPChunks;  // n8 tiles of dP^T per chunk
  // dQ_i = dS K_j: warps tile Br x D as kQRowWarps strips of 16 rows by kQColWarps column blocks.
  constexpr int kQRowWarps = (Br / 16) < kWarps ? (Br / 16) : kWarps;
  constexpr int kQColWarps = kWarps / kQRowWarps;
  constexpr int kQStrips = Br / 16 / kQRowWarps;
  constexpr int kDQ = D / kQColWarps;
  constexpr bool kF32 = is_same_v<T, float>;
  static_assert(kDS % 16 == 0 && kDQ % (kF32 ? 8 : 16) == 0 && Br % 16 == 0, "tile shape");  // float: n8 dQ tiles
  static_assert(kWarps % kQRowWarps == 0 && Br / 16 % kQRowWarps == 0, "dQ warp tiling");
  static_assert(kNQ % (2 * kDPChunks) == 0, "dP^T chunks are whole k16 blocks of queries");
  static_assert(kStages >= 2, "Q_i/dO_i ring needs a slot to fill while another is read");
  constexpr int kW = static_cast<int>(sizeof(T)) / 2;  // 16-bit units per element (float: 2)
  using U = typename SmemOf<T>::type;
  using L = TileLayout<D * kW>;
  using LS = TileLayout<Br * kW>;  // dS^T: Bc rows (keys) x Br columns (queries)

  extern __shared__ __align__(128) unsigned char smem_raw[];
  U* sK = reinterpret_cast<U*>(smem_raw);
  U* sV = sK + Bc * L::kPitch;
  U* sQ = sV + Bc * L::kPitch;             // [kStages][Br][pitch]
  U* sdO = sQ + kStages * Br * L::kPitch;  // [kStages][Br][pitch]
  U* sdS = sdO + kStages * Br * L::kPitch;
  float* sLse = reinterpret_cast<float*>(sdS + Bc * LS::kPitch);  // [kStages][Br]
  float* sDelta = sLse + kStages * Br;                             // [kStages][Br]
  // Staged mask/bias tiles (ArrayScore<..., Br, Bc>: the float32 plans, where they fit): a step's Br x Bc tile in
  // its Q_i/dO_i group, one a ring slot, refilled only after the barrier that follows the step, as Q_i's.
  constexpr int kScoreBytes = score_tile_bytes<typename Policy::Score>();
  static_assert(score_tile_is<typename Policy::Score, Br, Bc>(), "score tiles staged as the kernel's Br x Bc");
  const uint32_t sScore_u = smem_u32(sDelta + kStages * Br);  // [kStages] (none: 0 bytes)

  const TileCoord tc = dq_key_tile_coord<Policy>(p, Bc);  // (batch * kv heads, key tile): dq_turns.cuh
  const int b = tc.bh / p.hk;
  const int hkv = tc.bh % p.hk;
  const int j0 = tc.tile * Bc;
  // Sequence b's rows and lengths (dense: the whole problem). The loop's loads re-read them with their
  // addresses (seq_geometry of an opaque b) instead of keeping them live.
  const SeqGeometry seq = seq_geometry(p, b);
  if (j0 >= seq.nk) return;  // past this sequence's keys (never when dense)
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int kw = warp % kKeyWarps;
  const int dw = warp / kKeyWarps;

  // Query tiles that see any key of K_j (under causal, not those wholly above the diagonal); float32: those of
  // this block's query part (mma_bwd_tf32.cuh).
  Range mt = tiles_covering(Policy(p, seq).mask.queries_of(j0, j0 + Bc), Br);
  if constexpr (kF32) mt = query_part<Br>(p, mt, seq.nq);
  const int m_start = mt.begin;
  const int per_head = mt.end - mt.begin;
  const int total = group * per_head;

  const T* gK = k + b * k_sb + hkv * k_sh + (seq.k_row0 + j0) * k_sn;
  const T* gV = v + b * v_sb + hkv * v_sh + (seq.k_row0 + j0) * v_sn;

  // Iteration it -> (query head, Q tile); its Q_i, dO_i, lse and Delta arrive in one cp.async group.
  auto tile_of = [&](int it, int& hh, int& i0) {
    hh = hkv * group + it / per_head;
    i0 = (m_start + it % per_head) * Br;
  };
  // The loop's loads recompute their addresses from opaque copies of b and threadIdx.x (see opaque()).
  auto load_q_do = [&](int it, int buf) {
    int hh, i0;
    tile_of(it, hh, i0);
    const int bo = opaque(b), tid = opaque(static_cast<int>(threadIdx.x));
    const SeqRows sq = seq_queries(p, bo);
    const int row = sq.q_row0 + i0;
    load_tile_any_async<T, D, Br, kThreads>(sQ + buf * Br * L::kPitch, q + bo * q_sb + hh * q_sh + row * q_sn,
                                            q_sn, sq.nq - i0, d, tid);
    load_tile_any_async<T, D, Br, kThreads>(sdO + buf * Br * L::kPitch, dout + bo * do_sb + hh * do_sh + row * do_sn,
                                            do_sn, sq.nq - i0, d, tid);
    stage_score_tile<typename Policy::Score, kThreads>(p, bo, hh, i0, j0, sScore_u + buf * kScoreBytes, tid);
  };
  // lse and Delta of the tile's rows, copied raw (rows past Nq read nothing and become 0: their
  // Q and dO rows are zeros, so they contribute nothing whatever P is).
  auto load_stats = [&](int it, int buf) {
    int hh, i0;
    tile_of(it, hh, i0);
    const int r = opaque(static_cast<int>(threadIdx.x));
    if (r < Br) {
      const int bo = opaque(b);
      const SeqRows sq = seq_queries(p, bo);
      const int i = min(i0 + r, sq.nq - 1);  // >= 0: a step exists only where the sequence has queries
      const int nbytes = i0 + r < sq.nq ? 4 : 0;
      cp_async_4(smem_u32(sLse + buf * Br + r), lse + bo * lse_sb + hh * lse_sh + (sq.q_row0 + i) * lse_sn, nbytes);
      cp_async_4(smem_u32(sDelta + buf * Br + r), delta + scratch_row(p, sq, bo, hh) + i, nbytes);
    }
  };

  if constexpr (kOwnDQ) {  // before step 0's cp.async reads Delta
    own_rows<T, D, kThreads>(p, b, hkv * group, group, m_start * Br, mt.end * Br);
    __threadfence_block();
    __syncthreads();
  }

  float acc_dv[kDS / 8][4], acc_dk[kDS / 8][4];
#pragma unroll
  for (int n = 0; n < kDS / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[n][e] = acc_dk[n][e] = 0.f;
  }

  if (total > 0) {
    load_tile_any_async<T, D, Bc, kThreads>(sK, gK, k_sn, seq.nk - j0, d, threadIdx.x);
    load_tile_any_async<T, D, Bc, kThreads>(sV, gV, v_sn, seq.nk - j0, d, threadIdx.x);
    load_q_do(0, 0);
    load_stats(0, 0);
  }
  cp_async_commit();  // group 0: K_j, V_j and step 0
#pragma unroll
  for (int s = 1; s < kStages - 1; ++s) {
    if (s < total) {
      load_q_do(s, s);
      load_stats(s, s);
    }
    cp_async_commit();
  }

  // ldmatrix rows: one register each where the warp's first chunk is a multiple of 8 (see LdmRows).
  const LdmRows<D * kW, true> kv_a(16 * kw + (lane & 15), lane >> 4);                // A of K Q^T, V dO^T
  const LdmRows<D * kW, true> qn_b((lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);  // B of K Q^T, V dO^T
  const LdmRows<D, kDSplit == 1 || kDS % 64 == 0> qt_b(lane & 15, 2 * (dw * kDS / 16) + (lane >> 4));  // B of P^T dO, dS^T Q
  const uint32_t sK_u = smem_u32(sK), sV_u = smem_u32(sV), sdS_u = smem_u32(sdS);
  const int key_w = j0 + 16 * kw;  // first key of this warp

  for (int it = 0; it < total; ++it) {
    const int buf = it % kStages;
    int hh, i0;
    tile_of(it, hh, i0);
    cp_async_wait<kStages - 2>();
    __syncthreads();  // step it landed (and K_j, V_j); every warp is done with step it-1
    if constexpr (!kOwnDQ) {  // deterministic: step it-1's pass, its adds ordered before it by this barrier
      if (it > 0 && threadIdx.x == 0)
        dq_turn_pass_step<Br, Bc, typename Policy::Mask>(p, opaque(b), j0, it - 1, tile_of);
    }
    {
      const int ahead = it + kStages - 1;  // into the slot step it-1 used
      if (ahead < total) {
        load_q_do(ahead, ahead % kStages);
        load_stats(ahead, ahead % kStages);
      }
      cp_async_commit();
    }
    // Mask/bias arrays: this warp's strip of step it + 1 into L1, a whole step ahead (step 0's with it).
    prefetch_next_step<typename Policy::Score, Br, 16>(p, b, it, total, hh, i0, 0, key_w, tile_of);
    const uint32_t sQ_u = smem_u32(sQ + buf * Br * L::kPitch);
    const uint32_t sdO_u = smem_u32(sdO + buf * Br * L::kPitch);
    const int quad2 = (opaque(static_cast<int>(threadIdx.x)) & 3) * 2;  // this lane's query pair
    const float* lse_b = sLse + buf * Br + quad2;
    const float* delta_b = sDelta + buf * Br + quad2;

    // S^T = K_j Q_i^T -> P^T.
    float pt[kNQ][4];
#pragma unroll
    for (int n = 0; n < kNQ; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) pt[n][e] = 0.f;
    }
    if constexpr (kF32) {
#pragma unroll
      for (int ks = 0; ks < D / 8; ++ks)
        // float32 splits (mma_tf32.cuh): S^T's operands are rounded (split_tf32), since an error in S^T is multiplied
        // by the scale inside exp2 (test_mma_float32_bwd_gpu.py::test_large_logits, scale 10, failed with them cut);
        // every other product's are cut (split_tf32_cut: two instructions and no register for hi).
        mma_k8_rows<false>(pt, kv_a.at(sK_u, ks), [&](int n2) { return qn_b.at(sQ_u, ks, n2 * 16); });
    } else {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, kv_a.at(sK_u, ks));
        mma_k16<T, false>(pt, a, [&](int n2) { return qn_b.at(sQ_u, ks, n2 * 16); });
      }
    }
    // The policy per step, from the sequence's lengths re-read here (kept live, they would spill).
    Policy pol(p, seq_geometry(p, opaque(b)));
    pol.score.at_head(p, b, hh);
    use_score_tile(pol.score, sScore_u + buf * kScoreBytes, i0, j0);
    mask_at_head(pol.mask, p, b, hh);
    pol.dropout.at_head(p, b, hh);
    const float c = score_strip<kNQ, true, true, OneSided<typename Policy::Mask>::value>(pt, key_w, i0, pol.score,
                                                                                          scale_log2);
    if (pol.mask.partial(i0, i0 + Br, key_w, key_w + 16)) mask_strip<kNQ, true>(pt, key_w, i0, pol.mask);
    probs_from_lse<kNQ>(pt, c, lse_b);
    // Dropout's keep bits, held through the step: dV takes the kept P (scaled at the end), dS all of P with dP
    // zeroed where dropped.
    KeepBits<kNQ> keep = 0;
    if constexpr (Policy::Dropout::kOn) keep = dropout_bits<kNQ, true>(key_w, i0, pol.dropout);

    // dV_j += P^T dO_i (this warp's d-slice).
    if constexpr (kF32) {
      const KpairLanes<D> kp(lane);
#pragma unroll
      for (int kq = 0; kq < Br / 8; ++kq) {
        uint32_t ah[4], al[4];
        pack_a_tf32_kept<Policy::Dropout::kOn>(ah, al, pt, kq, keep);
        mma_k8_kpair<D>(acc_dv, ah, al, kp, sdO_u, kq * 8, kDSplit == 1 ? 0 : dw * kDS);
      }
    } else {
#pragma unroll
      for (int kq = 0; kq < Br / 16; ++kq) {
        uint32_t a[4];
        if constexpr (Policy::Dropout::kOn) pack_a_step_kept<T>(a, pt, kq, keep);
        else pack_a_step<T>(a, pt, kq);
        mma_k16<T, true>(acc_dv, a, [&](int n2) { return qt_b.at(sdO_u, n2, kq * 16); });
      }
    }

    // Deterministic: thread 0 reads dQ_i's turn now, its L2 round trip under dP^T, dS^T and dK_j.
    const int turn_seen = kOwnDQ ? 0 : dq_turn_peek(dq_turn_slot<Br>(p, b, hh, i0));

    // dP^T = V_j dO_i^T, dS^T = P^T (dP^T - Delta), dK_j += dS^T Q_i, one chunk of kNC query tiles at a
    // time: only one chunk of dP^T is ever live next to P^T and dK_j/dV_j (which is what lets Br = 64
    // at D = 128 stay off the stack), at the price of re-reading the V_j fragments once per chunk.
#pragma unroll
    for (int ch = 0; ch < kDPChunks; ++ch) {
      float dpt[kNC][4];
#pragma unroll
      for (int n = 0; n < kNC; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[n][e] = 0.f;
      }
      if constexpr (kF32) {
#pragma unroll
        for (int ks = 0; ks < D / 8; ++ks)
          mma_k8_rows<true>(dpt, kv_a.at(sV_u, ks),
                              [&](int n2) { return qn_b.at(sdO_u, ks, (ch * kNC / 2 + n2) * 16); });
      } else {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          uint32_t a[4];
          ldmatrix_x4(a, kv_a.at(sV_u, ks));
          mma_k16<T, false>(dpt, a, [&](int n2) { return qn_b.at(sdO_u, ks, (ch * kNC / 2 + n2) * 16); });
        }
      }
#pragma unroll
      for (int n = 0; n < kNC; ++n) {
        const float2 dl = *reinterpret_cast<const float2*>(delta_b + (ch * kNC + n) * 8);
        float2 lq = {0.f, 0.f};
        if constexpr (!Policy::Score::kIdentity) lq = *reinterpret_cast<const float2*>(lse_b + (ch * kNC + n) * 8);
        if constexpr (Policy::Dropout::kOn) dropout_zero<kNQ, true>(dpt[n], keep, ch * kNC + n);
        ds_tile<Policy::Dropout::kOn>(pt[ch * kNC + n], pt[ch * kNC + n], dpt[n], dl, lq, pol.score, key_w,
                                      i0 + (ch * kNC + n) * 8,
                                      kDSplit == 1 || dw == 0,  // with a d split every dw warp has the same dS^T:
                                      pol.dropout.scale);       // one adds dbias
      }

      // dK_j += dS^T Q_i, and dS^T to shared memory (one copy: the d-slice 0 warps write it).
      if constexpr (kF32) {
        const KpairLanes<D> kp(lane);
#pragma unroll
        for (int kc = 0; kc < kNC; ++kc) {
          const int kq = ch * kNC + kc;
          uint32_t ah[4], al[4];
          pack_a_tf32_kept(ah, al, pt, kq);
          if (dw == 0) store_ds_f32<Br>(reinterpret_cast<unsigned char*>(sdS), pt[kq], 16 * kw + (lane >> 2), kq);
          mma_k8_kpair<D>(acc_dk, ah, al, kp, sQ_u, kq * 8, kDSplit == 1 ? 0 : dw * kDS);
        }
      } else {
#pragma unroll
        for (int kc = 0; kc < kNC / 2; ++kc) {
          const int kq = ch * kNC / 2 + kc;
          uint32_t a[4];
          pack_a_step<T>(a, pt, kq);
          if (dw == 0) {
            const int r = 16 * kw + (lane >> 2);
            const int e = (lane & 3) * 2;
            *reinterpret_cast<uint32_t*>(sdS + LS::offset(r, 2 * kq) + e) = a[0];
            *reinterpret_cast<uint32_t*>(sdS + LS::offset(r + 8, 2 * kq) + e) = a[1];
            *reinterpret_cast<uint32_t*>(sdS + LS::offset(r, 2 * kq + 1) + e) = a[2];
            *reinterpret_cast<uint32_t*>(sdS + LS::offset(r + 8, 2 * kq + 1) + e) = a[3];
          }
          mma_k16<T, true>(acc_dk, a, [&](int n2) { return qt_b.at(sQ_u, n2, kq * 16); });
        }
      }
    }
    __syncthreads();  // dS^T complete

    // dQ_i += dS K_j for this warp's rows and columns, straight into the f32 accumulator. (Its lane
    // addresses are rebuilt here from an opaque thread index, so they hold no register before.)
    int* const turn_slot = dq_turn_slot<Br>(p, b, hh, i0);  // deterministic: add after the earlier key tiles
    const int turn = dq_turn_at<Br, Bc, typename Policy::Mask>(p, turn_slot, opaque(b), i0, j0);
    dq_turn_wait(turn_slot, turn, turn_seen);
    const int tid_dq = opaque(static_cast<int>(threadIdx.x));
    const int lane_dq = tid_dq % 32;
    const int qs = (tid_dq / 32) % kQRowWarps;  // strip group
    const int qc = (tid_dq / 32) / kQRowWarps;  // column block
    const LdmRows<Br, kQRowWarps == 1 || kQStrips % 4 == 0> ds_a((lane_dq >> 4) * 8 + (lane_dq & 7),
                                                                 2 * (qs * kQStrips) + ((lane_dq >> 3) & 1));  // A
    const LdmRows<D, kQColWarps == 1 || kDQ % 64 == 0> kt_b(lane_dq & 15, 2 * (qc * kDQ / 16) + (lane_dq >> 4));  // B
#pragma unroll
    for (int st = 0; st < kQStrips; ++st) {
      float acc_dq[kDQ / 8][4];
#pragma unroll
      for (int n = 0; n < kDQ / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dq[n][e] = 0.f;
      }
      if constexpr (kF32) {
        const KpairLanes<Br> ds_lanes(lane_dq);
        const KpairLanes<D> k_lanes(lane_dq);
#pragma unroll
        for (int ks = 0; ks < Bc / 8; ++ks) {
          uint32_t ah[4], al[4];
          ld_ds_a<Br>(ah, al, ds_lanes, sdS_u, ks * 8, (qs * kQStrips + st) * 16);
          mma_k8_kpair<D>(acc_dq, ah, al, k_lanes, sK_u, ks * 8, qc * kDQ);
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < Bc / 16; ++ks) {
          uint32_t a[4];
          ldmatrix_x4_trans(a, ds_a.at(sdS_u, st, ks * 16));
          mma_k16<T, true>(acc_dq, a, [&](int n2) { return kt_b.at(sK_u, n2, ks * 16); });
        }
      }
      const int bo = opaque(b);
      // Added into the f32 accumulator; kOwnDQ: the only block on these rows, so dQ_i is complete and stored as
      // scale * dS K_j (dq_own.cuh).
      const SeqRows sq = seq_queries(p, bo);
      const int nq = kOwnDQ ? p.nq : sq.nq;
      float* gdq = kOwnDQ ? nullptr : dq_accum + scratch_row(p, sq, bo, hh) * d;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = i0 + (qs * kQStrips + st) * 16 + (lane_dq >> 2) + hf * 8;
        if (row < nq) {
          const DQRow<kOwnDQ, T> out(p, gdq, bo, hh, row, d);
#pragma unroll
          for (int n = 0; n < kDQ / 8; ++n) {
            const int col = qc * kDQ + n * 8 + (lane_dq & 3) * 2;
            if (col < d) out.put2(p, col, acc_dq[n][2 * hf], acc_dq[n][2 * hf + 1]);
          }
        }
      }
    }
  }
  if constexpr (!kOwnDQ) dq_turn_pass_last<Br, Bc, typename Policy::Mask>(p, opaque(b), j0, total, tile_of);
  cp_async_wait<0>();

  // dV_j and scale * dK_j (this warp's keys and d-slice); with dropout dV took P * keep: times 1 / (1 - p).
  if constexpr (Policy::Dropout::kOn) {
#pragma unroll
    for (int n = 0; n < kDS / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dv[n][e] *= p.dropout_scale;
    }
  }
  if constexpr (kF32) {
    if (p.kv_part != nullptr) {  // a query part: its partial sums, added up by mma_bwd_kv_combine
      store_kv_part(p, b, hkv, key_w, dw * kDS, acc_dk, acc_dv);
      return;
    }
  }
  store_dk_dv<T>(p, b, hkv, key_w, dw * kDS, acc_dk, acc_dv);
}

#endif  // CUPYFLASH_MMA_BWD_KEYMAJOR_CUH
