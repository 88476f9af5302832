// FlashAttention forward on Hopper warpgroup MMA (sm_90a, fp16/bf16): S = Q_i K_j^T and O += P V_j are
// wgmma.mma_async (S from two shared-memory descriptors, P V with P in registers), K_j/V_j streamed
// through a kStages-deep cp.async ring, the online softmax of mma_softmax.cuh on the accumulators.
//
// Block = one Q_i tile of Br = 64 kWG rows of one (batch, query head); warpgroup g owns rows
// [64g, 64g + 64) and warp w of it the 16-row strip 16w.. (the m16n8k16 fragment layout, so the mask
// and softmax code is shared with the mma.sync forward). Tiles and grid order as in mma_forward.cu:
// last query tiles first, key tiles from the diagonal down, so only the first key tile is masked.
// Every tile is 64-column slabs of TileLayout<64> (the 128-byte swizzle wgmma reads, see
// wgmma_primitives.cuh); D is the padded head dim, d the true one.
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"
#include "wgmma_primitives.cuh"

using namespace cupyflash;
using namespace cupyflash::mma;

template <typename T, int D, int Bc, int kWG, int kStages, int kMinBlocks>
__global__ void __launch_bounds__(kWG * 128, kMinBlocks)
    wgmma_flash_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ o,
                    float* __restrict__ lse, int nq, int nk, int d, int hq, int group, long long q_sb, long long q_sh,
                    long long q_sn, long long k_sb, long long k_sh, long long k_sn, long long v_sb, long long v_sh,
                    long long v_sn, long long o_sb, long long o_sh, long long o_sn, long long lse_sb, long long lse_sh,
                    long long lse_sn, float scale_log2, int causal, int heads_on_x) {
  constexpr int kThreads = kWG * 128;
  constexpr int Br = 64 * kWG;
  constexpr int kSlabs = D / 64;     // 64-column slabs per tile
  constexpr int kNT = Bc / 8;        // n8 tiles of S per warp strip
  constexpr int kSlabBytesK = Bc * 128;
  constexpr int kTileBytesK = kSlabs * kSlabBytesK;
  static_assert(D % 64 == 0 && (Bc == 64 || Bc == 128) && (D == 64 || D == 128), "instantiated shapes");
  static_assert(kStages >= 3, "tile t+1 loads into the slot of tile t-2 while P V_{t-1} reads its own");

  // wgmma's swizzle pattern repeats every 1024 bytes: the host asks for 1 KB extra to align the base.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_u = smem_u32(smem_raw);
  const uint32_t sQ_u = (raw_u + 1023u) & ~1023u;
  const uint32_t sK_u = sQ_u + Br * D * 2;
  const uint32_t sV_u = sK_u + kStages * kTileBytesK;
  T* const sQ = reinterpret_cast<T*>(smem_raw + (sQ_u - raw_u));
  T* const sK = reinterpret_cast<T*>(smem_raw + (sK_u - raw_u));
  T* const sV = reinterpret_cast<T*>(smem_raw + (sV_u - raw_u));

  const int bh = heads_on_x ? blockIdx.x : blockIdx.y;
  const int q_tile = heads_on_x ? blockIdx.y : blockIdx.x;
  const int n_qtiles = heads_on_x ? gridDim.y : gridDim.x;
  const int b = bh / hq;
  const int h = bh % hq;
  const int hk = h / group;
  const int q0 = (n_qtiles - 1 - q_tile) * Br;
  const int wg = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int causal_offset = nk - nq;

  const T* gQ = q + b * q_sb + h * q_sh + q0 * q_sn;
  const T* gK = k + b * k_sb + hk * k_sh;
  const T* gV = v + b * v_sb + hk * v_sh;

  const int n_tiles = key_tiles_needed(nq, nk, q0, Br, Bc, causal, causal_offset);
  // One cp.async group per key tile (K_j and V_j), one tile ahead of the compute.
  auto load_kv = [&](int t, int slot) {
    const int j0 = (n_tiles - 1 - t) * Bc;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl) {
      load_tile_async<T, 64, Bc, kThreads>(sK + (slot * kSlabs + sl) * Bc * 64, gK + j0 * k_sn + 64 * sl, k_sn, nk - j0,
                                           d - 64 * sl, threadIdx.x);
      load_tile_async<T, 64, Bc, kThreads>(sV + (slot * kSlabs + sl) * Bc * 64, gV + j0 * v_sn + 64 * sl, v_sn, nk - j0,
                                           d - 64 * sl, threadIdx.x);
    }
    cp_async_commit();
  };

#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl) {
    load_tile_async<T, 64, Br, kThreads>(sQ + sl * Br * 64, gQ + 64 * sl, q_sn, nq - q0, d - 64 * sl, threadIdx.x);
  }
  if (n_tiles > 0) {
    load_kv(0, 0);  // Q_i rides in the first group
  } else {
    cp_async_commit();
  }

  float acc[D / 8][4];
  float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F};
  float l_run[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  }

  const int row_w = wg * 64 + warp * 16;  // first row of this warp's strip inside Q_i
  const uint32_t q_base = sQ_u + wg * 64 * 128;
  uint32_t p[Bc / 16][4] = {};  // P_{t-1}: the A operand of the P V product in flight

  // O += P V_t: P from registers, V_t MN-major (keys down the rows, the next 64 columns kSlabBytesK on).
  auto issue_pv = [&](int t) {
    const uint32_t v_base = sV_u + (t % kStages) * kTileBytesK;
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      wgmma::mma_rs<T, D>(acc, p[kk], wgmma::desc_sw128(v_base + kk * 16 * 128, kSlabBytesK));
    }
    wgmma::commit();
  };

  // Tile t is in smem for every warpgroup; then tile t+1 starts loading.
  auto await_tile = [&](int t) {
    cp_async_wait<0>();          // K_t/V_t (and Q_i) have landed for this thread...
    wgmma::fence_proxy_async();  // ...are visible to the tensor cores' reads...
    __syncthreads();             // ...and to every warpgroup
    if (t + 1 < n_tiles) load_kv(t + 1, (t + 1) % kStages);
  };
  // S_t = Q_i K_t^T, issued (one m64 x Bc wgmma per k16 step of the head dim), not waited for.
  auto issue_s = [&](float (&s)[kNT][4], int t) {
#pragma unroll
    for (int n = 0; n < kNT; ++n) {  // the first k step overwrites s, but an undefined input would be
#pragma unroll                       // materialised between fence and wgmma (ptxas then serialises)
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
    }
    const uint32_t k_base = sK_u + (t % kStages) * kTileBytesK;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t off = (ks % 4) * 32;  // k16 step inside the 128-byte row
      wgmma::mma_ss<T, Bc>(s, wgmma::desc_sw128(q_base + (ks / 4) * Br * 128 + off),
                           wgmma::desc_sw128(k_base + (ks / 4) * kSlabBytesK + off), ks > 0);
    }
    wgmma::commit();
  };
  // Mask (only tiles that cross N or the diagonal) and online softmax: s becomes P_t unrounded.
  auto softmax = [&](float (&s)[kNT][4], int t, float (&alpha)[2]) {
    const int j0 = (n_tiles - 1 - t) * Bc;
    const int row0 = q0 + row_w;
    const float c = positive_scale<kNT>(s, scale_log2);
    if (j0 + Bc > nk || (causal && j0 + Bc - 1 > row0 + causal_offset)) {
      mask_strip<kNT>(s, row0, j0, nk, causal, causal_offset);
    }
    online_softmax<kNT>(s, c, m_run, l_run, alpha);
  };

  // Software pipeline (FlashAttention-3's intra-warpgroup overlap): step t issues S_t and then
  // O += P_{t-1} V_{t-1}, and runs the softmax of S_t while the second product is in flight; O is
  // rescaled once it has landed. Slot t+1 (loaded in step t) last held tile t-2, whose P V was waited
  // for in step t-1 by every thread before this step's barrier: hence kStages >= 3. Step 0 is peeled
  // so that every step in the loop has the same wgmma groups (with a branch inside, ptxas cannot tell
  // which group wait<1> retires and serialises all of them).
  if (n_tiles > 0) {
    {
      float s[kNT][4], alpha[2];
      await_tile(0);
      issue_s(s, 0);
      wgmma::wait<0>();
      wgmma::fence_operands(s);
      softmax(s, 0, alpha);  // acc is still zero: no rescale
      pack_a<T>(p, s);
    }
    for (int t = 1; t < n_tiles; ++t) {
      float s[kNT][4], alpha[2];
      await_tile(t);
      issue_s(s, t);
      issue_pv(t - 1);
      wgmma::wait<1>();  // S_t has landed; P_{t-1} V_{t-1} may still run
      wgmma::fence_operands(s);
      softmax(s, t, alpha);
      wgmma::wait<0>();  // P_{t-1} V_{t-1} has landed: acc and p are free again
      wgmma::fence_operands(acc);
      wgmma::fence_operands(p);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
      }
      pack_a<T>(p, s);
    }
    issue_pv(n_tiles - 1);
    wgmma::wait<0>();
    wgmma::fence_operands(acc);
  }
  cp_async_wait<0>();

  // Epilogue: O = acc / l, lse = (m + log2 l) ln 2; rows that saw no key get 0 and -inf.
  T* gO = o + b * o_sb + h * o_sh;
  float* gL = lse + b * lse_sb + h * lse_sh;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float l = quad_sum(l_run[hh]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = q0 + row_w + (lane >> 2) + hh * 8;
    if (row < nq) {
      T* orow = gO + row * o_sn;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        const int col = n * 8 + (lane & 3) * 2;
        if (col < d) store2<T>(orow + col, acc[n][2 * hh] * inv, acc[n][2 * hh + 1] * inv);
      }
      if ((lane & 3) == 0) {
        gL[row * lse_sn] = l > 0.f ? (m_run[hh] + log2f(l)) * 0.6931471805599453f : -CUDART_INF_F;
      }
    }
  }
}
