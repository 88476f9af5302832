// FlashAttention-2 forward on tensor cores (sm_80+): mma.sync fed by ldmatrix, K_j/V_j streamed through a
// kStages-deep cp.async ring, softmax in registers. fp16/bf16 run m16n8k16; float32 runs every product as 3xTF32
// m16n8k8 (mma_tf32.cuh) on tiles of twice the bytes, with the same C fragments, so masking, softmax, dropout and
// the epilogue are shared: only the operand loads and the products differ (mma_step_tf32, mma_pv_tf32).
//
// Block = one Q_i tile of Br rows of one (batch, query head), last query tiles first so that causal
// blocks with the most key tiles start early.
// Warp w owns rows [w*16*kM, (w+1)*16*kM) of Q_i (kM m16 strips): no inter-warp reduction.
// D is the padded head dim (template); d the true one (columns >= d are zero-filled on load and
// never stored).
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"
#include "mma_tf32.cuh"

using namespace cupyflash;
using namespace cupyflash::mma;

template <typename T, int D, int Br, int Bc, int kWarps, int kStages, int kMinBlocks, class Policy>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) mma_flash_fwd(const __grid_constant__ AttentionParams p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kM = Br / (16 * kWarps);  // m16 strips per warp
  constexpr int kNT = Bc / 8;             // n8 tiles of S per strip
  constexpr bool kF32 = is_same_v<T, float>;
  constexpr int kW = kF32 ? 2 * D : D;    // a tile row in 16-bit units (float: FloatTile<D>)
  constexpr int kKS = kW / 16;            // 32-byte steps over the head dim: k16 (16-bit), k8 (float)
  static_assert(Br % (16 * kWarps) == 0 && Bc % 16 == 0 && D % 16 == 0, "tile shape");
  static_assert(kStages >= 2, "the ring needs a slot to fill while another is read");
  using L = TileLayout<kW>;
  constexpr int kPitch = L::kPitch * 2 / static_cast<int>(sizeof(T));  // elements of T per smem row

  // Staged mask/bias tiles (ArrayScore<..., Br, Bc>, where the plan finds room: plans.tensorcore.staged_policy):
  // one a ring slot, copied in K_j's cp.async group, so the K wait covers them; slot t % kStages is refilled only
  // after the barrier that follows step t's scores, as K's.
  constexpr int kScoreBytes = score_tile_bytes<typename Policy::Score>();
  static_assert(score_tile_is<typename Policy::Score, Br, Bc>(), "score tiles staged as the kernel's Br x Bc");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Br * kPitch;
  T* sV = sK + kStages * Bc * kPitch;
  const uint32_t sScore_u = smem_u32(sV + kStages * Bc * kPitch);  // [kStages] score-array tiles (none: 0 bytes)

  const TileCoord tc = query_tile_coord(p, Br);
  const int b = tc.bh / p.hq;
  const int h = tc.bh % p.hq;
  const int hk = h / p.group;
  const int q0 = (tc.n_tiles - 1 - tc.tile) * Br;  // last query tiles first: under causal, the longest
  const SeqGeometry seq = seq_geometry(p, b);      // sequence b's rows and lengths (dense: the whole problem)
  if (q0 >= seq.nq) return;                        // past this sequence's queries (never when dense)
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  Policy pol(p, seq);
  pol.score.at_head(p, b, h);
  mask_at_head(pol.mask, p, b, h);
  pol.dropout.at_head(p, b, h);
  const float sink = sink_log2(p, h);

  const T* gQ = static_cast<const T*>(p.q) + b * p.q_s.b + h * p.q_s.h + (seq.q_row0 + q0) * p.q_s.n;
  const T* gK = static_cast<const T*>(p.k) + b * p.k_s.b + hk * p.k_s.h + seq.k_row0 * p.k_s.n;
  const T* gV = static_cast<const T*>(p.v) + b * p.v_s.b + hk * p.v_s.h + seq.k_row0 * p.v_s.n;

  // Key tiles this block needs, visited from the last (on the diagonal under causal) to the first, so
  // that the partial tiles come first and the loop's tail runs unmasked.
  const Range kt = tiles_covering(pol.mask.keys_of(q0, q0 + Br), Bc);
  const int n_tiles = kt.end - kt.begin;
  auto load_kv = [&](int t, int slot) {
    const int j0 = (kt.end - 1 - t) * Bc;
    load_tile_async<T, D, Bc, kThreads>(sK + slot * Bc * kPitch, gK + j0 * p.k_s.n, p.k_s.n, seq.nk - j0,
                                        p.d, threadIdx.x);
    stage_score_tile<typename Policy::Score, kThreads>(p, b, h, q0, j0, sScore_u + slot * kScoreBytes, threadIdx.x);
    cp_async_commit();
    load_tile_async<T, D, Bc, kThreads>(sV + slot * Bc * kPitch, gV + j0 * p.v_s.n, p.v_s.n, seq.nk - j0,
                                        p.d, threadIdx.x);
    cp_async_commit();
  };

  load_tile_async<T, D, Br, kThreads>(sQ, gQ, p.q_s.n, seq.nq - q0, p.d, threadIdx.x);  // rides in the first K group
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) {
      load_kv(s, s);
    } else {
      cp_async_commit();
      cp_async_commit();
    }
  }

  float acc[kM][D / 8][4];
  float m_run[kM][2], l_run[kM][2];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][n][e] = 0.f;
    }
    softmax_start(m_run[mi], l_run[mi], sink);
  }

  const int row_w = warp * 16 * kM;  // first row of this warp inside Q_i
  // (float: the one-register XOR form of the row addresses, which keeps the D = 64 kernels off the stack)
  const LdmRows<kW, kF32> q_rows(row_w + (lane & 15), lane >> 4);                 // A of Q K^T
  const LdmRows<kW, kF32> k_rows((lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);  // B of Q K^T
  const LdmRows<kW> v_rows(lane & 15, lane >> 4);                            // B of P V (.trans; 16-bit only)
  const uint32_t sQ_u = smem_u32(sQ);
  const uint32_t sK_u = smem_u32(sK);
  const uint32_t sV_u = smem_u32(sV);
  // (Mask/bias arrays: tile 0's rows of this warp; the loop asks for each next tile.)
  prefetch_score_arrays<true, 16 * kM, Bc>(pol.score, q0 + row_w, (kt.end - 1) * Bc);

  for (int t = 0; t < n_tiles; ++t) {
    const int slot = t % kStages;
    const int j0 = (kt.end - 1 - t) * Bc;
    cp_async_wait<2 * kStages - 3>();  // K_t (and Q_i, and a staged score tile) have landed for this thread...
    __syncthreads();                   // ...and for every thread; slot t-1 is free again
    use_score_tile(pol.score, sScore_u + slot * kScoreBytes, q0, j0);
    {
      const int tp = t + kStages - 1;
      if (tp < n_tiles) {
        load_kv(tp, tp % kStages);
      } else {
        cp_async_commit();
        cp_async_commit();
      }
    }

    // S = Q_i K_j^T for this warp's strips.
    float s[kM][kNT][4];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][n][e] = 0.f;
      }
    }
    const uint32_t sKs = sK_u + slot * Bc * L::kPitch * 2;
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) {
      if constexpr (kF32) {
        mma_step_tf32(s, [&](int mi) { return q_rows.at(sQ_u, ks, mi * 16); },
                      [&](int n2) { return k_rows.at(sKs, ks, n2 * 16); });
      } else {
        uint32_t a[kM][4];
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) ldmatrix_x4(a[mi], q_rows.at(sQ_u, ks, mi * 16));
        mma_k16<T, false>(s, a, [&](int n2) { return k_rows.at(sKs, ks, n2 * 16); });
      }
    }

    // Mask (only partial tiles), online softmax with the scale in the exponent. With dropout each strip is packed
    // as soon as it is done (P as A fragments: half the registers while the next strip draws). float keeps P in s
    // (its A operand is split per k8 step of P V).
    uint32_t pa[kM][kF32 ? 1 : Bc / 16][4];
    float alpha_f32[kM][2];  // float: O's rescale waits for this tile's P V (below)
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
      const int row0 = q0 + row_w + mi * 16;
      const float c = score_strip<kNT, false, !kF32>(s[mi], row0, j0, pol.score, p.scale_log2);
      if (pol.mask.partial(row0, row0 + 16, j0, j0 + Bc)) mask_strip<kNT>(s[mi], row0, j0, pol.mask);
      float alpha[2];
      online_softmax<kNT>(s[mi], c, m_run[mi], l_run[mi], alpha);
      // Dropout after the row sums (lse stays undropped): P V takes P * keep, O is scaled by 1 / (1 - p) at the end.
      if constexpr (Policy::Dropout::kOn)
        dropout_zero<kNT, false>(s[mi], dropout_bits<kNT, false>(row0, j0, pol.dropout));
      if constexpr (kF32) {
        alpha_f32[mi][0] = alpha[0];
        alpha_f32[mi][1] = alpha[1];
      } else {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          acc[mi][n][0] *= alpha[0];
          acc[mi][n][1] *= alpha[0];
          acc[mi][n][2] *= alpha[1];
          acc[mi][n][3] *= alpha[1];
        }
      }
      if constexpr (Policy::Dropout::kOn && !kF32) pack_a<T>(pa[mi], s[mi]);
    }

    // P as A fragments: C tiles 2kk and 2kk+1 form the k16 block kk.
    if constexpr (!Policy::Dropout::kOn && !kF32) {
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) pack_a<T>(pa[mi], s[mi]);
    }
    // Mask/bias arrays: this warp's rows of tile t + 1 into L1 while P V and the next Q K^T run (here S is
    // packed: fewer live registers than before Q K^T).
    if (t + 1 < n_tiles) prefetch_score_arrays<true, 16 * kM, Bc>(pol.score, q0 + row_w, j0 - Bc);

    cp_async_wait<2 * kStages - 2>();  // V_t
    __syncthreads();

    // O += P V_j.
    const uint32_t sVs = sV_u + slot * Bc * L::kPitch * 2;
    if constexpr (kF32) {
      // This tile's P V in a fresh accumulator, folded into O with the rescale in one FFMA (round to nearest): the
      // tensor cores truncate what they add to an accumulator, and summed there over thousands of keys O drifts
      // with N (measured 2.9e-5 relative at N = 4096 when P V went straight into O; benchmarks/NOTES.md).
      float pv[kM][D / 8][4];
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) pv[mi][n][e] = 0.f;
        }
      }
      mma_pv_tf32<D>(pv, s, sVs, KPairRows<D>());
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[mi][n][e] = fmaf(acc[mi][n][e], alpha_f32[mi][e >> 1], pv[mi][n][e]);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < Bc / 16; ++kk) {
#pragma unroll
        for (int n2 = 0; n2 < D / 16; ++n2) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, v_rows.at(sVs, n2, kk * 16));
#pragma unroll
          for (int mi = 0; mi < kM; ++mi) {
            mma_16816<T>(acc[mi][2 * n2], pa[mi][kk], bv[0], bv[1]);
            mma_16816<T>(acc[mi][2 * n2 + 1], pa[mi][kk], bv[2], bv[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();  // no copy may outlive the block

  // Epilogue: O = acc / l, lse = (m + log2 l) ln 2.
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
    if constexpr (Policy::Dropout::kOn) dropout_scale_o(acc[mi], pol.dropout);
    store_o_lse<T>(p, b, h, q0 + row_w + mi * 16, acc[mi], m_run[mi], l_run[mi]);
  }
}
