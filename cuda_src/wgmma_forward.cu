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

template <typename T, int D, int Bc, int kWG, int kStages, int kMinBlocks, class Policy>
__global__ void __launch_bounds__(kWG * 128, kMinBlocks) wgmma_flash_fwd(const __grid_constant__ AttentionParams p) {
  constexpr int kThreads = kWG * 128;
  constexpr int Br = 64 * kWG;
  constexpr int kSlabs = D / 64;     // 64-column slabs per tile
  constexpr int kNT = Bc / 8;        // n8 tiles of S per warp strip
  constexpr int kSlabBytesK = Bc * 128;
  constexpr int kTileBytesK = kSlabs * kSlabBytesK;
  static_assert(D % 64 == 0 && (Bc == 64 || Bc == 128) && (D == 64 || D == 128), "instantiated shapes");
  static_assert(kStages >= 3, "tile t+1 loads into the slot of tile t-2 while P V_{t-1} reads its own");
  // Staged mask/bias tiles (attention_policy.cuh's ArrayScore<..., Br, Bc>): two slots, tile t in slot t % 2.
  // Tile t+1's copies are issued with its K/V after step t's barrier; slot (t+1) % 2 was last read by step
  // t-1's softmax, which every thread finished before that barrier.
  constexpr int kScoreBytes = score_tile_bytes<typename Policy::Score>();
  static_assert(score_tile_is<typename Policy::Score, Br, Bc>(),
                "score tiles staged as the kernel's Br x Bc");

  // wgmma's swizzle pattern repeats every 1024 bytes: the host asks for 1 KB extra to align the base.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_u = smem_u32(smem_raw);
  const uint32_t sQ_u = (raw_u + 1023u) & ~1023u;
  const uint32_t sK_u = sQ_u + Br * D * 2;
  const uint32_t sV_u = sK_u + kStages * kTileBytesK;
  const uint32_t sScore_u = sV_u + kStages * kTileBytesK;  // [2] score-array tiles (none: 0 bytes)
  T* const sQ = reinterpret_cast<T*>(smem_raw + (sQ_u - raw_u));
  T* const sK = reinterpret_cast<T*>(smem_raw + (sK_u - raw_u));
  T* const sV = reinterpret_cast<T*>(smem_raw + (sV_u - raw_u));

  const TileCoord tc = query_tile_coord(p, Br);
  const int b = tc.bh / p.hq;
  const int h = tc.bh % p.hq;
  const int hk = h / p.group;
  const int q0 = (tc.n_tiles - 1 - tc.tile) * Br;
  const SeqGeometry seq = seq_geometry(p, b);  // sequence b's rows and lengths (dense: the whole problem)
  if (q0 >= seq.nq) return;                    // past this sequence's queries (never when dense)
  const int wg = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;
  Policy pol(p, seq);
  pol.score.at_head(p, b, h);
  mask_at_head(pol.mask, p, b, h);
  pol.dropout.at_head(p, b, h);

  const T* gQ = static_cast<const T*>(p.q) + b * p.q_s.b + h * p.q_s.h + (seq.q_row0 + q0) * p.q_s.n;
  const T* gK = static_cast<const T*>(p.k) + b * p.k_s.b + hk * p.k_s.h + seq.k_row0 * p.k_s.n;
  const T* gV = static_cast<const T*>(p.v) + b * p.v_s.b + hk * p.v_s.h + seq.k_row0 * p.v_s.n;

  // Key tiles from the last to the first (see mma_forward.cu).
  const Range kt = tiles_covering(pol.mask.keys_of(q0, q0 + Br), Bc);
  const int n_tiles = kt.end - kt.begin;
  // One cp.async group per key tile (K_j and V_j), one tile ahead of the compute.
  auto load_kv = [&](int t, int slot) {
    const int j0 = (kt.end - 1 - t) * Bc;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl) {
      load_tile_async<T, 64, Bc, kThreads>(sK + (slot * kSlabs + sl) * Bc * 64, gK + j0 * p.k_s.n + 64 * sl, p.k_s.n,
                                           seq.nk - j0, p.d - 64 * sl, threadIdx.x);
      load_tile_async<T, 64, Bc, kThreads>(sV + (slot * kSlabs + sl) * Bc * 64, gV + j0 * p.v_s.n + 64 * sl, p.v_s.n,
                                           seq.nk - j0, p.d - 64 * sl, threadIdx.x);
    }
    stage_score_tile<typename Policy::Score, kThreads>(p, b, h, q0, j0, sScore_u + (t & 1) * kScoreBytes, threadIdx.x);
    cp_async_commit();
  };

#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl) {
    load_tile_async<T, 64, Br, kThreads>(sQ + sl * Br * 64, gQ + 64 * sl, p.q_s.n, seq.nq - q0, p.d - 64 * sl,
                                         threadIdx.x);
  }
  if (n_tiles > 0) {
    load_kv(0, 0);  // Q_i rides in the first group
  } else {
    cp_async_commit();
  }

  float acc[D / 8][4];
  float m_run[2], l_run[2];
  softmax_start(m_run, l_run, sink_log2(p, h));
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  }

  const int row_w = wg * 64 + warp * 16;  // first row of this warp's strip inside Q_i
  const uint32_t q_base = sQ_u + wg * 64 * 128;
  uint32_t pa[Bc / 16][4] = {};  // P_{t-1}: the A operand of the P V product in flight

  // O += P V_t: P from registers, V_t MN-major (keys down the rows, the next 64 columns kSlabBytesK on).
  auto issue_pv = [&](int t) {
    const uint32_t v_base = sV_u + (t % kStages) * kTileBytesK;
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      wgmma::mma_rs<T, D>(acc, pa[kk], wgmma::desc_sw128(v_base + kk * 16 * 128, kSlabBytesK));
    }
    wgmma::commit();
  };

  // Tile t is in smem for every warpgroup; then tile t+1 starts loading.
  auto await_tile = [&](int t) {
    cp_async_wait<0>();          // K_t/V_t (and Q_i) have landed for this thread...
    wgmma::fence_proxy_async();  // ...are visible to the tensor cores' reads...
    __syncthreads();             // ...and to every warpgroup
    if (t + 1 < n_tiles) load_kv(t + 1, (t + 1) % kStages);
    // (No L1 prefetch of the next tile's mask/bias rows here, unlike the mma forward: measured on an H100 it
    // took the D = 128 bias forward from 0.98-1.03x to 0.73-0.77x of SDPA EFFICIENT; benchmarks/NOTES.md.)
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
  // Tile t's dropout keep bits (none without dropout): drawn after S_t and P_{t-1} V_{t-1} are issued, so that
  // Philox's integer work runs while the tensor cores do (and before the softmax's registers are live).
  // At D = 64 with plain scores the registers allow the draws unrolled, so ptxas interleaves their Philox chains.
  constexpr bool kUnrolledBits = D == 64 && Policy::Score::kIdentity;
  auto keep_bits = [&](int t) {
    if constexpr (Policy::Dropout::kOn)
      return dropout_bits<kNT, false, kUnrolledBits>(q0 + row_w, (kt.end - 1 - t) * Bc, pol.dropout);
    else return 0u;
  };
  // Mask (only partial tiles) and online softmax: s becomes P_t unrounded.
  auto softmax = [&](float (&s)[kNT][4], int t, float (&alpha)[2], KeepBits<kNT> keep) {
    const int j0 = (kt.end - 1 - t) * Bc;
    const int row0 = q0 + row_w;
    use_score_tile(pol.score, sScore_u + (t & 1) * kScoreBytes, q0, j0);
    const float c = score_strip<kNT, false, true, OneSided<typename Policy::Mask>::value>(s, row0, j0, pol.score,
                                                                                    p.scale_log2);
    if (pol.mask.partial(row0, row0 + 16, j0, j0 + Bc)) mask_strip<kNT>(s, row0, j0, pol.mask);
    online_softmax<kNT>(s, c, m_run, l_run, alpha);
    // Dropout after the row sums (lse stays undropped): P V takes P * keep, O is scaled by 1 / (1 - p) at the end.
    if constexpr (Policy::Dropout::kOn) dropout_zero<kNT, false>(s, keep);
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
      const KeepBits<kNT> keep = keep_bits(0);
      wgmma::wait<0>();
      wgmma::fence_operands(s);
      softmax(s, 0, alpha, keep);  // acc is still zero: no rescale
      pack_a<T>(pa, s);
    }
    for (int t = 1; t < n_tiles; ++t) {
      float s[kNT][4], alpha[2];
      await_tile(t);
      issue_s(s, t);
      issue_pv(t - 1);
      const KeepBits<kNT> keep = keep_bits(t);
      wgmma::wait<1>();  // S_t has landed; P_{t-1} V_{t-1} may still run
      wgmma::fence_operands(s);
      softmax(s, t, alpha, keep);
      wgmma::wait<0>();  // P_{t-1} V_{t-1} has landed: acc and p are free again
      wgmma::fence_operands(acc);
      wgmma::fence_operands(pa);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
      }
      pack_a<T>(pa, s);
    }
    issue_pv(n_tiles - 1);
    wgmma::wait<0>();
    wgmma::fence_operands(acc);
  }
  cp_async_wait<0>();

  // Epilogue: O = acc / l, lse = (m + log2 l) ln 2.
  if constexpr (Policy::Dropout::kOn) dropout_scale_o(acc, pol.dropout);
  store_o_lse<T>(p, b, h, q0 + row_w, acc, m_run, l_run);
}
