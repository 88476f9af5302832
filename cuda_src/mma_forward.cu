// FlashAttention-2 forward on tensor cores (sm_80+, fp16/bf16): mma.sync m16n8k16 fed by ldmatrix,
// K_j/V_j streamed through a kStages-deep cp.async ring, softmax in registers.
//
// Block = one Q_i tile of Br rows of one (batch, query head), last query tiles first so that causal
// blocks with the most key tiles start early.
// Warp w owns rows [w*16*kM, (w+1)*16*kM) of Q_i (kM m16 strips): no inter-warp reduction.
// D is the padded head dim (template); d the true one (columns >= d are zero-filled on load and
// never stored).
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"

using namespace cupyflash;
using namespace cupyflash::mma;

template <typename T, int D, int Br, int Bc, int kWarps, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    mma_flash_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                  float* __restrict__ lse, int nq, int nk, int d, int hq, int group, long long q_sb, long long q_sh,
                  long long q_sn, long long k_sb, long long k_sh, long long k_sn, long long v_sb, long long v_sh,
                  long long v_sn, long long o_sb, long long o_sh, long long o_sn, long long lse_sb, long long lse_sh,
                  long long lse_sn, float scale_log2, int causal, int heads_on_x) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kM = Br / (16 * kWarps);  // m16 strips per warp
  constexpr int kNT = Bc / 8;             // n8 tiles of S per strip
  constexpr int kKS = D / 16;             // k16 steps over the head dim
  static_assert(Br % (16 * kWarps) == 0 && Bc % 16 == 0 && D % 16 == 0, "tile shape");
  static_assert(kStages >= 2, "the ring needs a slot to fill while another is read");
  using L = TileLayout<D>;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Br * L::kPitch;
  T* sV = sK + kStages * Bc * L::kPitch;

  // heads_on_x: grid (B*Hq, query tiles), heads fastest, so under causal every head's longest tiles
  // go first. Otherwise grid (query tiles, B*Hq): the blocks of one head run together and share its K/V
  // through L2 (heads fastest re-read K/V from DRAM once per query tile at short N).
  const int bh = heads_on_x ? blockIdx.x : blockIdx.y;
  const int q_tile = heads_on_x ? blockIdx.y : blockIdx.x;
  const int n_qtiles = heads_on_x ? gridDim.y : gridDim.x;
  const int b = bh / hq;
  const int h = bh % hq;
  const int hk = h / group;
  const int q0 = (n_qtiles - 1 - q_tile) * Br;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int causal_offset = nk - nq;  // key j is visible to query i iff j <= i + causal_offset

  const T* gQ = q + b * q_sb + h * q_sh + q0 * q_sn;
  const T* gK = k + b * k_sb + hk * k_sh;
  const T* gV = v + b * v_sb + hk * v_sh;

  // Key tiles this block needs; causal blocks stop at the diagonal.
  const int n_tiles = key_tiles_needed(nq, nk, q0, Br, Bc, causal, causal_offset);
  // Tiles run from the last (diagonal, masked) to the first, so masking happens up front.
  auto load_kv = [&](int t, int slot) {
    const int j0 = (n_tiles - 1 - t) * Bc;
    load_tile_async<T, D, Bc, kThreads>(sK + slot * Bc * L::kPitch, gK + j0 * k_sn, k_sn, nk - j0, d, threadIdx.x);
    cp_async_commit();
    load_tile_async<T, D, Bc, kThreads>(sV + slot * Bc * L::kPitch, gV + j0 * v_sn, v_sn, nk - j0, d, threadIdx.x);
    cp_async_commit();
  };

  load_tile_async<T, D, Br, kThreads>(sQ, gQ, q_sn, nq - q0, d, threadIdx.x);  // rides in the first K group
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
    m_run[mi][0] = m_run[mi][1] = -CUDART_INF_F;
    l_run[mi][0] = l_run[mi][1] = 0.f;
  }

  const int row_w = warp * 16 * kM;  // first row of this warp inside Q_i
  const LdmRows<D> q_rows(row_w + (lane & 15), lane >> 4);                  // A of Q K^T
  const LdmRows<D> k_rows((lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);   // B of Q K^T
  const LdmRows<D> v_rows(lane & 15, lane >> 4);                             // B of P V (.trans)
  const uint32_t sQ_u = smem_u32(sQ);
  const uint32_t sK_u = smem_u32(sK);
  const uint32_t sV_u = smem_u32(sV);

  for (int t = 0; t < n_tiles; ++t) {
    const int slot = t % kStages;
    const int j0 = (n_tiles - 1 - t) * Bc;
    cp_async_wait<2 * kStages - 3>();  // K_t (and Q_i) have landed for this thread...
    __syncthreads();                   // ...and for every thread; slot t-1 is free again
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
      uint32_t a[kM][4];
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) ldmatrix_x4(a[mi], q_rows.at(sQ_u, ks, mi * 16));
      mma_k16<T, false>(s, a, [&](int n2) { return k_rows.at(sKs, ks, n2 * 16); });
    }

    // Mask (only tiles that cross N or the diagonal), online softmax with the scale in the exponent.
    const bool tail = j0 + Bc > nk;
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
      const int row0 = q0 + row_w + mi * 16;
      const float c = positive_scale<kNT>(s[mi], scale_log2);
      if (tail || (causal && j0 + Bc - 1 > row0 + causal_offset)) {
        mask_strip<kNT>(s[mi], row0, j0, nk, causal, causal_offset);
      }
      float alpha[2];
      online_softmax<kNT>(s[mi], c, m_run[mi], l_run[mi], alpha);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[mi][n][0] *= alpha[0];
        acc[mi][n][1] *= alpha[0];
        acc[mi][n][2] *= alpha[1];
        acc[mi][n][3] *= alpha[1];
      }
    }

    // P as A fragments: C tiles 2kk and 2kk+1 form the k16 block kk.
    uint32_t p[kM][Bc / 16][4];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) pack_a<T>(p[mi], s[mi]);

    cp_async_wait<2 * kStages - 2>();  // V_t
    __syncthreads();

    // O += P V_j.
    const uint32_t sVs = sV_u + slot * Bc * L::kPitch * 2;
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
#pragma unroll
      for (int n2 = 0; n2 < D / 16; ++n2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_rows.at(sVs, n2, kk * 16));
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) {
          mma_16816<T>(acc[mi][2 * n2], p[mi][kk], bv[0], bv[1]);
          mma_16816<T>(acc[mi][2 * n2 + 1], p[mi][kk], bv[2], bv[3]);
        }
      }
    }
  }
  cp_async_wait<0>();  // no copy may outlive the block

  // Epilogue: O = acc / l, lse = (m + log2 l) ln 2; rows that saw no key get 0 and -inf.
  T* gO = o + b * o_sb + h * o_sh;
  float* gL = lse + b * lse_sb + h * lse_sh;
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float l = quad_sum(l_run[mi][hh]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = q0 + row_w + mi * 16 + (lane >> 2) + hh * 8;
      if (row < nq) {
        T* orow = gO + row * o_sn;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          const int col = n * 8 + (lane & 3) * 2;
          if (col < d) store2<T>(orow + col, acc[mi][n][2 * hh] * inv, acc[mi][n][2 * hh + 1] * inv);
        }
        if ((lane & 3) == 0) {
          gL[row * lse_sn] = l > 0.f ? (m_run[mi][hh] + log2f(l)) * 0.6931471805599453f : -CUDART_INF_F;
        }
      }
    }
  }
}
