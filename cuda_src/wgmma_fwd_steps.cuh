// One consumer warpgroup's part of the warp-specialised Hopper forward (wgmma_forward_ws.cu): its 64 query rows of
// Q_i against the block's key tiles, as the software pipeline of FlashAttention-3's intra-warpgroup overlap. The
// products and the per-tile softmax are the lockstep kernel's (wgmma_forward.cu's lambdas, here as members); that
// kernel keeps its own copy because moving it onto this header renumbered registers in its PTX (checked with
// NVRTC 13.5), and its PTX stays byte-identical to the measured one. What the pipeline asks of its kernel (where a
// step waits for its tiles, whom it tells when it is done with them) goes through the Hooks of pipeline() below.
//
// Fragments (see wgmma_primitives.cuh): warp w of the warpgroup owns the 16-row strip row_w = 64g + 16w.. of
// Q_i, in the m16n8k16 C layout, so mask, scores and the online softmax are mma_softmax.cuh's. Key tile t is
// K_j/V_j with j = kt_end - 1 - t (last to first: only the first is masked under causal), in ring slot
// (t0 + t) % kStages; every tile is 64-column slabs of TileLayout<64>.
#pragma once
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"
#include "wgmma_primitives.cuh"

namespace cupyflash {
namespace wgmma_fwd {

using mma::uint32_t;

// A tile's keep form (dropout only, mma_softmax.cuh): with kMsbs the words for pack_a_kept's masks, else bits.
template <bool kMsbs, int NT> struct KeepOf { using type = mma::KeepBits<NT>; };
template <int NT> struct KeepOf<true, NT> { using type = mma::KeepMsbs<NT>; };

// The products and the per-tile softmax of one warpgroup. kQRows: rows of the Q_i tile in shared memory (its
// 64-column slabs are kQRows * 128 bytes apart); q_base: this warpgroup's first row in it.
template <typename T, int D, int Bc, int kQRows, int kStages, bool kUnrolledBits, class Policy>
struct Steps {
  static constexpr int kNT = Bc / 8;  // n8 tiles of S per warp strip
  static constexpr int kSlabBytesK = Bc * 128;
  static constexpr int kTileBytesK = D / 64 * kSlabBytesK;
  static constexpr int kScoreBytes = score_tile_bytes<typename Policy::Score>();
  // Plain scores (kUnrolledBits) keep dropout_msbs' 16 words through the softmax and mask the packed P; the others
  // have no room for them and draw bits rolled, zeroing P an FSEL a score.
  using Keep = typename KeepOf<Policy::Dropout::kOn && kUnrolledBits, kNT>::type;
  using Elem = T;

  const AttentionParams& p;
  Policy& pol;
  uint32_t q_base, sK_u, sV_u, sScore_u;  // shared addresses: Q rows, the K and V rings, the score-array slots
  int q0, row_w, kt_end;                  // Q_i's first row, the warp strip's row in it, the key tiles' end
  int t0 = 0;  // the ring index of key tile 0 (a persistent block's earlier query tiles used the ones before)

  // O += P V_t: P from registers, V_t MN-major (keys down the rows, the next 64 columns kSlabBytesK on).
  __device__ __forceinline__ void issue_pv(float (&acc)[D / 8][4], const uint32_t (&pa)[Bc / 16][4], int t) const {
    const uint32_t v_base = sV_u + ((t0 + t) % kStages) * kTileBytesK;
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      wgmma::mma_rs<T, D>(acc, pa[kk], wgmma::desc_sw128(v_base + kk * 16 * 128, kSlabBytesK));
    }
    wgmma::commit();
  }

  // S_t = Q_i K_t^T, issued (one m64 x Bc wgmma per k16 step of the head dim), not waited for.
  __device__ __forceinline__ void issue_s(float (&s)[kNT][4], int t) const {
#pragma unroll
    for (int n = 0; n < kNT; ++n) {  // the first k step overwrites s, but an undefined input would be
#pragma unroll                       // materialised between fence and wgmma (ptxas then serialises)
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
    }
    const uint32_t k_base = sK_u + ((t0 + t) % kStages) * kTileBytesK;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t off = (ks % 4) * 32;  // k16 step inside the 128-byte row
      wgmma::mma_ss<T, Bc>(s, wgmma::desc_sw128(q_base + (ks / 4) * kQRows * 128 + off),
                           wgmma::desc_sw128(k_base + (ks / 4) * kSlabBytesK + off), ks > 0);
    }
    wgmma::commit();
  }

  // Tile t's dropout keep form (none without dropout), drawn first in a step: before the warpgroup waits for its
  // tiles and its turn, while the other consumers' products run. (Drawn after the turn's products were issued,
  // ptxas moved the draws up into the turn, between its BAR.SYNC and BAR.ARV, and the next consumer waited for
  // them: 10% of the D = 64 forward with dropout, s15.) kUnrolledBits where the registers allow the draws
  // unrolled (ptxas interleaves their Philox chains) and the 16 words of dropout_msbs through the softmax.
  __device__ __forceinline__ Keep keep_bits(int t) const {
    const int row0 = q0 + row_w, j0 = (kt_end - 1 - t) * Bc;
    if constexpr (!Policy::Dropout::kOn) return Keep{};
    else if constexpr (kUnrolledBits) return mma::dropout_msbs<kNT>(row0, j0, pol.dropout);
    else return mma::dropout_bits<kNT, false>(row0, j0, pol.dropout);
  }

  // Mask (only partial tiles) and online softmax: s becomes P_t unrounded.
  __device__ __forceinline__ void softmax(float (&s)[kNT][4], int t, float (&m_run)[2], float (&l_run)[2],
                                          float (&alpha)[2], Keep keep) const {
    const int j0 = (kt_end - 1 - t) * Bc;
    const int row0 = q0 + row_w;
    use_score_tile(pol.score, sScore_u + (t & 1) * kScoreBytes, q0, j0);
    const float c = mma::score_strip<kNT, false, true, OneSided<typename Policy::Mask>::value>(s, row0, j0, pol.score,
                                                                                          p.scale_log2);
    if (pol.mask.partial(row0, row0 + 16, j0, j0 + Bc)) mma::mask_strip<kNT>(s, row0, j0, pol.mask);
    mma::online_softmax<kNT>(s, c, m_run, l_run, alpha);
    // Dropout after the row sums (lse stays undropped): P V takes P * keep, O is scaled by 1 / (1 - p) at the end.
    if constexpr (Policy::Dropout::kOn && !kUnrolledBits) mma::dropout_zero<kNT, false>(s, keep);
  }

  // P_t as the A operand of P V (dropped scores zeroed, with the masks where the keep form has them).
  __device__ __forceinline__ void pack_p(uint32_t (&pa)[Bc / 16][4], const float (&s)[kNT][4], const Keep& keep) const {
    if constexpr (Policy::Dropout::kOn && kUnrolledBits) mma::pack_a_kept<T>(pa, s, keep);
    else mma::pack_a<T>(pa, s);
  }
};

// The pipeline over n_tiles key tiles (FlashAttention-3's intra-warpgroup overlap): step t issues S_t and then
// O += P_{t-1} V_{t-1}, and runs the softmax of S_t while the second product is in flight; O is rescaled once it
// has landed. Step 0 is peeled so that every step in the loop has the same wgmma groups (with a branch inside,
// ptxas cannot tell which group wait<1> retires and serialises all of them).
//
// Hooks (all inlined):
//   tile_ready(t)      K_t (and what else rides with it) is in shared memory for this warpgroup's products
//   v_ready(t)         V_t likewise, before P_t V_t is issued
//   turn_begin(first)  before a step's products are issued (first: step 0's)
//   turn_end(last)     after they are issued (last: the final P V)
//   k_done(t)          S_t has landed: K_t is no longer read
//   v_done(t)          P_t V_t has landed: V_t is no longer read
template <class St, class Hooks, int kN, int kK>
__device__ __forceinline__ void pipeline(const St& st, Hooks& hooks, int n_tiles, float (&acc)[kN][4],
                                         float (&m_run)[2], float (&l_run)[2], uint32_t (&pa)[kK][4]) {
  constexpr int kNT = St::kNT;
  if (n_tiles > 0) {
    {
      float s[kNT][4], alpha[2];
      const typename St::Keep keep = st.keep_bits(0);
      hooks.tile_ready(0);
      hooks.turn_begin(true);
      st.issue_s(s, 0);
      hooks.turn_end(false);
      wgmma::wait<0>();
      hooks.k_done(0);
      wgmma::fence_operands(s);
      st.softmax(s, 0, m_run, l_run, alpha, keep);  // acc is still zero: no rescale
      st.pack_p(pa, s, keep);
    }
    for (int t = 1; t < n_tiles; ++t) {
      float s[kNT][4], alpha[2];
      const typename St::Keep keep = st.keep_bits(t);
      hooks.tile_ready(t);
      hooks.v_ready(t - 1);
      hooks.turn_begin(false);
      st.issue_s(s, t);
      st.issue_pv(acc, pa, t - 1);
      hooks.turn_end(false);
      wgmma::wait<1>();  // S_t has landed; P_{t-1} V_{t-1} may still run
      hooks.k_done(t);
      wgmma::fence_operands(s);
      st.softmax(s, t, m_run, l_run, alpha, keep);
      wgmma::wait<0>();  // P_{t-1} V_{t-1} has landed: acc and p are free again
      hooks.v_done(t - 1);
      wgmma::fence_operands(acc);
      wgmma::fence_operands(pa);
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
      }
      st.pack_p(pa, s, keep);
    }
    hooks.v_ready(n_tiles - 1);
    hooks.turn_begin(false);
    st.issue_pv(acc, pa, n_tiles - 1);
    hooks.turn_end(true);
    wgmma::wait<0>();
    hooks.v_done(n_tiles - 1);  // (a persistent block's ring runs on: the next query tile refills this slot)
    wgmma::fence_operands(acc);
  }
}

}  // namespace wgmma_fwd
}  // namespace cupyflash
