// mma_flash_bwd2d: the backward main kernel in FlashAttention-2's 2-D warp layout (see mma_backward.cu).
// Included by mma_backward.cu (after its `using namespace cupyflash::mma`), which holds the
// Delta and dQ-conversion kernels and the launch-facing overview.
#ifndef CUPYFLASH_MMA_BWD_2D_CUH
#define CUPYFLASH_MMA_BWD_2D_CUH
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"
#include "dq_turns.cuh"
#include "dq_own.cuh"

// The same backward with FlashAttention-2's 2-D warp layout, for large head dims: S^T and dP^T are
// tiled over kSKeyWarps x (kWarps / kSKeyWarps) warps (keys x queries), so each K_j/V_j and Q_i/dO_i
// fragment read from smem feeds several mma (at Bc = 128, Br = 64, 4 x 2 warps of 32 x 32: 0.5
// ldmatrix per mma, against 0.75 for the key-major strips of mma_bwd_keymajor.cuh). P^T and dS^T then go through smem
// (they are needed by other warps): dK_j/dV_j are tiled kVKeyWarps (keys) x the rest (head-dim
// columns), dQ_i kQRowWarps (queries) x the rest (columns). Two barriers per step, as above.
// kPackedP: P^T stays live through dP^T only as the 16-bit values written to smem (half the registers;
// dS^T = P^T (dP^T - Delta) then starts from P^T rounded to T, one more rounding before dS^T's own).
// kOwnDQ: one key tile covers every key of the kv head, and the block does Delta and stores dQ (dq_own.cuh).
template <typename T, int D, int Br, int Bc, int kWarps, int kSKeyWarps, int kVKeyWarps, int kQRowWarps, int kStages,
          int kMinBlocks, bool kPackedP, class Policy, bool kOwnDQ = false>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    mma_flash_bwd2d(const __grid_constant__ AttentionParams p) {
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
  constexpr int kThreads = kWarps * 32;
  // S^T / dP^T warp tile: kSK keys (kMS strips of 16) x kSQ queries (kNS n8 tiles).
  constexpr int kSK = Bc / kSKeyWarps, kSQ = Br / (kWarps / kSKeyWarps);
  constexpr int kMS = kSK / 16, kNS = kSQ / 8;
  // dK_j / dV_j warp tile: kVK keys x kVD columns.
  constexpr int kVK = Bc / kVKeyWarps, kVD = D / (kWarps / kVKeyWarps);
  constexpr int kMV = kVK / 16, kNV = kVD / 8;
  // dQ_i warp tile: kQR queries x kQD columns.
  constexpr int kQR = Br / kQRowWarps, kQD = D / (kWarps / kQRowWarps);
  constexpr int kMQ = kQR / 16, kNQ = kQD / 8;
  static_assert(kSK % 16 == 0 && kSQ % 16 == 0 && kVK % 16 == 0 && kVD % 16 == 0 && kQR % 16 == 0 && kQD % 16 == 0,
                "warp tiles are whole 16 x 16 blocks");
  static_assert(kStages >= 2, "Q_i/dO_i ring needs a slot to fill while another is read");
  using L = TileLayout<D>;
  using LS = TileLayout<Br>;  // P^T and dS^T: Bc rows (keys) x Br columns (queries)

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + Bc * L::kPitch;
  T* sQ = sV + Bc * L::kPitch;             // [kStages][Br][pitch]
  T* sdO = sQ + kStages * Br * L::kPitch;  // [kStages][Br][pitch]
  T* sP = sdO + kStages * Br * L::kPitch;
  T* sdS = sP + Bc * LS::kPitch;
  float* sLse = reinterpret_cast<float*>(sdS + Bc * LS::kPitch);  // [kStages][Br]
  float* sDelta = sLse + kStages * Br;                             // [kStages][Br]

  const TileCoord tc = dq_key_tile_coord<Policy>(p, Bc);  // (batch * kv heads, key tile): dq_turns.cuh
  const int b = tc.bh / p.hk;
  const int hkv = tc.bh % p.hk;
  const int j0 = tc.tile * Bc;
  // Sequence b's rows and lengths (dense: the whole problem); the loop re-reads them where it needs them
  // (seq_geometry of an opaque b) instead of keeping them live, as mma_bwd_keymajor.cuh does.
  const SeqGeometry seq = seq_geometry(p, b);
  if (j0 >= seq.nk) return;  // past this sequence's keys (never when dense)
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  const Range mt = tiles_covering(Policy(p, seq).mask.queries_of(j0, j0 + Bc), Br);
  const int m_start = mt.begin;
  const int per_head = mt.end - mt.begin;
  const int total = group * per_head;

  const T* gK = k + b * k_sb + hkv * k_sh + (seq.k_row0 + j0) * k_sn;
  const T* gV = v + b * v_sb + hkv * v_sh + (seq.k_row0 + j0) * v_sn;

  auto tile_of = [&](int it, int& hh, int& i0) {
    hh = hkv * group + it / per_head;
    i0 = (m_start + it % per_head) * Br;
  };
  auto load_q_do = [&](int it, int buf) {
    int hh, i0;
    tile_of(it, hh, i0);
    const int bo = opaque(b), tid = opaque(static_cast<int>(threadIdx.x));
    const SeqRows sq = seq_queries(p, bo);
    const int row = sq.q_row0 + i0;
    load_tile_async<T, D, Br, kThreads>(sQ + buf * Br * L::kPitch, q + bo * q_sb + hh * q_sh + row * q_sn, q_sn,
                                        sq.nq - i0, d, tid);
    load_tile_async<T, D, Br, kThreads>(sdO + buf * Br * L::kPitch, dout + bo * do_sb + hh * do_sh + row * do_sn,
                                        do_sn, sq.nq - i0, d, tid);
  };
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

  float acc_dv[kMV][kNV][4], acc_dk[kMV][kNV][4];
#pragma unroll
  for (int m = 0; m < kMV; ++m) {
#pragma unroll
    for (int n = 0; n < kNV; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dv[m][n][e] = acc_dk[m][n][e] = 0.f;
    }
  }

  if (total > 0) {
    load_tile_async<T, D, Bc, kThreads>(sK, gK, k_sn, seq.nk - j0, d, threadIdx.x);
    load_tile_async<T, D, Bc, kThreads>(sV, gV, v_sn, seq.nk - j0, d, threadIdx.x);
    load_q_do(0, 0);
    load_stats(0, 0);
  }
  cp_async_commit();
#pragma unroll
  for (int s = 1; s < kStages - 1; ++s) {
    if (s < total) {
      load_q_do(s, s);
      load_stats(s, s);
    }
    cp_async_commit();
  }

  const uint32_t sK_u = smem_u32(sK), sV_u = smem_u32(sV), sP_u = smem_u32(sP), sdS_u = smem_u32(sdS);

  for (int it = 0; it < total; ++it) {
    const int buf = it % kStages;
    int hh, i0;
    tile_of(it, hh, i0);
    cp_async_wait<kStages - 2>();
    __syncthreads();  // step it landed (and K_j, V_j); every warp is done with step it-1 (sP, sdS free)
    if constexpr (!kOwnDQ) {  // deterministic: step it-1's pass, its adds ordered before it by this barrier
      if (it > 0 && threadIdx.x == 0)
        dq_turn_pass_step<Br, Bc, typename Policy::Mask>(p, opaque(b), j0, it - 1, tile_of);
    }
    {
      const int ahead = it + kStages - 1;
      if (ahead < total) {
        load_q_do(ahead, ahead % kStages);
        load_stats(ahead, ahead % kStages);
      }
      cp_async_commit();
    }
    const uint32_t sQ_u = smem_u32(sQ + buf * Br * L::kPitch);
    const uint32_t sdO_u = smem_u32(sdO + buf * Br * L::kPitch);

    // ---- S^T = K_j Q_i^T -> P^T, then dP^T = V_j dO_i^T -> dS^T, on this warp's kSK x kSQ tile.
    {
      const int tid = opaque(static_cast<int>(threadIdx.x));
      const int sw = (tid / 32) % kSKeyWarps, qw = (tid / 32) / kSKeyWarps, ln = tid % 32;
      const LdmRows<D, true> kv_a(sw * kSK + (ln & 15), ln >> 4);                              // A: K, V
      const LdmRows<D, true> qn_b(qw * kSQ + (ln >> 4) * 8 + (ln & 7), (ln >> 3) & 1);         // B: Q, dO
      const int key0 = j0 + sw * kSK, query0 = i0 + qw * kSQ;
      // Mask/bias arrays: this warp's tile of step it + 1 into L1, a whole step ahead (step 0's with it).
      prefetch_next_step<typename Policy::Score, kSQ, kSK>(p, b, it, total, hh, i0, qw * kSQ, key0, tile_of);
      const float* lse_b = sLse + buf * Br + qw * kSQ + (ln & 3) * 2;
      const float* delta_b = sDelta + buf * Br + qw * kSQ + (ln & 3) * 2;

      float pt[kMS][kNS][4];
#pragma unroll
      for (int m = 0; m < kMS; ++m) {
#pragma unroll
        for (int n = 0; n < kNS; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) pt[m][n][e] = 0.f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[kMS][4];
#pragma unroll
        for (int m = 0; m < kMS; ++m) ldmatrix_x4(a[m], kv_a.at(sK_u, ks, m * 16));
        mma_k16<T, false>(pt, a, [&](int n2) { return qn_b.at(sQ_u, ks, n2 * 16); });
      }
      float c = scale_log2;
      Policy pol(p, seq_geometry(p, opaque(b)));  // per step, from lengths re-read here (see above)
      pol.score.at_head(p, b, hh);
      mask_at_head(pol.mask, p, b, hh);
      pol.dropout.at_head(p, b, hh);
#pragma unroll
      for (int m = 0; m < kMS; ++m)
        c = score_strip<kNS, true, true, OneSided<typename Policy::Mask>::value>(pt[m], key0 + 16 * m, query0,
                                                                                 pol.score, scale_log2);
      if (pol.mask.partial(query0, query0 + kSQ, key0, key0 + kSK)) {
#pragma unroll
        for (int m = 0; m < kMS; ++m) mask_strip<kNS, true>(pt[m], key0 + 16 * m, query0, pol.mask);
      }
#pragma unroll
      for (int n = 0; n < kNS; ++n) {
        // A row that saw no key (lse = -inf) must give P = 0 even where its scores are -inf. (Not
        // probs_from_lse per strip: one lse load for all kMS strips, n outermost.)
        const float2 ls = *reinterpret_cast<const float2*>(lse_b + n * 8);
        const float2 l2 = make_float2(ls.x == -CUDART_INF_F ? CUDART_INF_F : ls.x * kLog2e,
                                      ls.y == -CUDART_INF_F ? CUDART_INF_F : ls.y * kLog2e);
#pragma unroll
        for (int m = 0; m < kMS; ++m) {
          pt[m][n][0] = fast_exp2(fmaf(pt[m][n][0], c, -l2.x));
          pt[m][n][1] = fast_exp2(fmaf(pt[m][n][1], c, -l2.y));
          pt[m][n][2] = fast_exp2(fmaf(pt[m][n][2], c, -l2.x));
          pt[m][n][3] = fast_exp2(fmaf(pt[m][n][3], c, -l2.y));
        }
      }
      // Dropout's keep bits, held through the step: sP takes the kept P (dV scaled at the end), dS all of P with
      // dP zeroed where dropped.
      KeepBits<kNS> keep[kMS] = {};
      if constexpr (Policy::Dropout::kOn) {
#pragma unroll
        for (int m = 0; m < kMS; ++m) keep[m] = dropout_bits<kNS, true>(key0 + 16 * m, query0, pol.dropout);
      }
      // Fragment (m, n) of this lane -> rows key r, r + 8 and queries (chunk, e) of the P^T/dS^T tiles.
      const int r = sw * kSK + (ln >> 2);
      const int e = (ln & 3) * 2;
      const int chunk0 = qw * kSQ / 8;
      uint32_t pp[kMS][kNS][2];
#pragma unroll
      for (int m = 0; m < kMS; ++m) {
#pragma unroll
        for (int n = 0; n < kNS; ++n) {
          pp[m][n][0] = pack2<T>(pt[m][n][0], pt[m][n][1]);
          pp[m][n][1] = pack2<T>(pt[m][n][2], pt[m][n][3]);
          uint32_t lo = pp[m][n][0], hi = pp[m][n][1];
          if constexpr (Policy::Dropout::kOn) {
            auto kept = [&](int e2) { return is_kept<kNS, true>(keep[m], n, e2) ? pt[m][n][e2] : 0.f; };
            lo = pack2<T>(kept(0), kept(1));
            hi = pack2<T>(kept(2), kept(3));
          }
          *reinterpret_cast<uint32_t*>(sP + LS::offset(r + 16 * m, chunk0 + n) + e) = lo;
          *reinterpret_cast<uint32_t*>(sP + LS::offset(r + 16 * m + 8, chunk0 + n) + e) = hi;
        }
      }

      float dpt[kMS][kNS][4];
#pragma unroll
      for (int m = 0; m < kMS; ++m) {
#pragma unroll
        for (int n = 0; n < kNS; ++n) {
#pragma unroll
          for (int e2 = 0; e2 < 4; ++e2) dpt[m][n][e2] = 0.f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[kMS][4];
#pragma unroll
        for (int m = 0; m < kMS; ++m) ldmatrix_x4(a[m], kv_a.at(sV_u, ks, m * 16));
        mma_k16<T, false>(dpt, a, [&](int n2) { return qn_b.at(sdO_u, ks, n2 * 16); });
      }
#pragma unroll
      for (int n = 0; n < kNS; ++n) {
        const float2 dl = *reinterpret_cast<const float2*>(delta_b + n * 8);
#pragma unroll
        for (int m = 0; m < kMS; ++m) {
          float p4[4] = {pt[m][n][0], pt[m][n][1], pt[m][n][2], pt[m][n][3]};
          if constexpr (kPackedP) {
            const float2 lo2 = unpack2<T>(pp[m][n][0]), hi2 = unpack2<T>(pp[m][n][1]);
            p4[0] = lo2.x, p4[1] = lo2.y, p4[2] = hi2.x, p4[3] = hi2.y;
          }
          float2 lq = {0.f, 0.f};
          if constexpr (!Policy::Score::kIdentity) lq = *reinterpret_cast<const float2*>(lse_b + n * 8);
          float ds[4];
          if constexpr (Policy::Dropout::kOn) dropout_zero<kNS, true>(dpt[m][n], keep[m], n);
          ds_tile<Policy::Dropout::kOn>(ds, p4, dpt[m][n], dl, lq, pol.score, key0 + 16 * m, query0 + n * 8, true,
                                        pol.dropout.scale);
          const uint32_t lo = pack2<T>(ds[0], ds[1]);
          const uint32_t hi = pack2<T>(ds[2], ds[3]);
          *reinterpret_cast<uint32_t*>(sdS + LS::offset(r + 16 * m, chunk0 + n) + e) = lo;
          *reinterpret_cast<uint32_t*>(sdS + LS::offset(r + 16 * m + 8, chunk0 + n) + e) = hi;
        }
      }
    }
    __syncthreads();  // P^T and dS^T complete

    // ---- dV_j += P^T dO_i, dK_j += dS^T Q_i on this warp's kVK x kVD tile.
    {
      const int tid = opaque(static_cast<int>(threadIdx.x));
      const int vw = (tid / 32) % kVKeyWarps, cw = (tid / 32) / kVKeyWarps, ln = tid % 32;
      const LdmRows<Br, true> p_a(vw * kVK + (ln & 15), ln >> 4);  // A: P^T, dS^T (keys x queries)
      const LdmRows<D, kVKeyWarps == kWarps || kVD % 64 == 0> qt_b(ln & 15, 2 * (cw * kVD / 16) + (ln >> 4));  // B
#pragma unroll
      for (int kq = 0; kq < Br / 16; ++kq) {
        uint32_t a[kMV][4];
#pragma unroll
        for (int m = 0; m < kMV; ++m) ldmatrix_x4(a[m], p_a.at(sP_u, kq, m * 16));
        mma_k16<T, true>(acc_dv, a, [&](int n2) { return qt_b.at(sdO_u, n2, kq * 16); });
#pragma unroll
        for (int m = 0; m < kMV; ++m) ldmatrix_x4(a[m], p_a.at(sdS_u, kq, m * 16));
        mma_k16<T, true>(acc_dk, a, [&](int n2) { return qt_b.at(sQ_u, n2, kq * 16); });
      }
    }

    // ---- dQ_i += dS K_j on this warp's kQR x kQD tile, straight into the f32 accumulator.
    {
      // Deterministic: thread 0 reads dQ_i's turn now, its L2 round trip under the dQ_i product. (Read before
      // dV_j and dK_j, the value held through them spilled at sm_90a.)
      const int turn_seen = kOwnDQ ? 0 : dq_turn_peek(dq_turn_slot<Br>(p, b, hh, i0));
      const int tid = opaque(static_cast<int>(threadIdx.x));
      const int qs = (tid / 32) % kQRowWarps, qc = (tid / 32) / kQRowWarps, ln = tid % 32;
      const LdmRows<Br, kQRowWarps == 1 || kMQ % 4 == 0> ds_a((ln >> 4) * 8 + (ln & 7), 2 * (qs * kMQ) + ((ln >> 3) & 1));
      const LdmRows<D, kQRowWarps == kWarps || kQD % 64 == 0> kt_b(ln & 15, 2 * (qc * kQD / 16) + (ln >> 4));
      float acc_dq[kMQ][kNQ][4];
#pragma unroll
      for (int m = 0; m < kMQ; ++m) {
#pragma unroll
        for (int n = 0; n < kNQ; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_dq[m][n][e] = 0.f;
        }
      }
#pragma unroll
      for (int ks = 0; ks < Bc / 16; ++ks) {
        uint32_t a[kMQ][4];
#pragma unroll
        for (int m = 0; m < kMQ; ++m) ldmatrix_x4_trans(a[m], ds_a.at(sdS_u, m, ks * 16));
        mma_k16<T, true>(acc_dq, a, [&](int n2) { return kt_b.at(sK_u, n2, ks * 16); });
      }
      const int bo = opaque(b);
      const SeqRows sq = seq_queries(p, bo);
      if constexpr (!kOwnDQ) {  // deterministic: add after the earlier key tiles
        int* const turn_slot = dq_turn_slot<Br>(p, b, hh, i0);
        const int turn = dq_turn_at<Br, Bc, typename Policy::Mask>(p, turn_slot, bo, i0, j0);
        dq_turn_wait(turn_slot, turn, turn_seen);
      }
      // Added into the f32 accumulator; kOwnDQ: the only block on these rows, so dQ_i is complete and stored as
      // scale * dS K_j (dq_own.cuh).
      const int nq = kOwnDQ ? p.nq : sq.nq;
      float* gdq = kOwnDQ ? nullptr : dq_accum + scratch_row(p, sq, bo, hh) * d;
#pragma unroll
      for (int m = 0; m < kMQ; ++m) {
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int row = i0 + qs * kQR + m * 16 + (ln >> 2) + hf * 8;
          if (row < nq) {
            const DQRow<kOwnDQ, T> out(p, gdq, bo, hh, row, d);
#pragma unroll
            for (int n = 0; n < kNQ; ++n) {
              const int col = qc * kQD + n * 8 + (ln & 3) * 2;
              if (col < d) out.put2(p, col, acc_dq[m][n][2 * hf], acc_dq[m][n][2 * hf + 1]);
            }
          }
        }
      }
    }
  }
  if constexpr (!kOwnDQ) dq_turn_pass_last<Br, Bc, typename Policy::Mask>(p, opaque(b), j0, total, tile_of);
  cp_async_wait<0>();

  // dV_j and scale * dK_j (this warp's kVK keys and kVD columns).
  const int vw = warp % kVKeyWarps, cw = warp / kVKeyWarps;
  if constexpr (Policy::Dropout::kOn) {  // dV took P * keep: times 1 / (1 - p)
#pragma unroll
    for (int m = 0; m < kMV; ++m) {
#pragma unroll
      for (int n = 0; n < kNV; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dv[m][n][e] *= p.dropout_scale;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kMV; ++m) store_dk_dv<T>(p, b, hkv, j0 + vw * kVK + m * 16, cw * kVD, acc_dk[m], acc_dv[m]);
}

#endif  // CUPYFLASH_MMA_BWD_2D_CUH
