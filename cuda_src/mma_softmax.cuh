// Masking and the online softmax on mma C fragments (scores live in registers; see mma_primitives.cuh
// for the fragment layout). Scores are kept in log2 units: s = S * scale * log2(e), so every
// exponential is one ex2 and the scale costs one multiply.
#pragma once
#include <math_constants.h>

#include "attention_policy.cuh"
#include "mma_primitives.cuh"

namespace cupyflash {
namespace mma {

// rule(x, q, k) applied to every element x of a strip: s holds NT C tiles of one 16-row strip whose first row
// is row0 and first column col0; lane (g, t) owns rows row0+g, row0+g+8 and columns col0 + 8n + 2t, +1.
// kKeyRows: the strip is transposed (rows are keys, columns queries), as in the backward's S^T; rule gets
// (query, key) either way.
template <int NT, bool kKeyRows, class Rule>
__device__ __forceinline__ void score_elements(float (&s)[NT][4], int row0, int col0, const Rule& rule) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + (lane >> 2) + (e >> 1) * 8;
      const int col = col0 + n * 8 + (lane & 3) * 2 + (e & 1);
      s[n][e] = rule(s[n][e], kKeyRows ? col : row, kKeyRows ? row : col);
    }
  }
}

// Set s to -inf where the mask hides a pair (a strip as in score_elements). A mask with its pairs as bits
// (StripBits: FlexMask<..., true>) gives each lane its two rows' words over the strip's columns (one or two
// 64-column chunks) once, shifted to the lane's first column, so a pair costs a shift and a test besides Base's
// rule. Strips start at multiples of their width (16-128 columns), so they never straddle a chunk they do not fill.
template <int NT, bool kKeyRows = false, class Mask>
__device__ __forceinline__ void mask_strip(float (&s)[NT][4], int row0, int col0, const Mask& mask) {
  if constexpr (StripBits<Mask>::value) {
    if (mask.needs_mod) {
      static_assert(NT == 2 || NT == 4 || NT == 8 || NT == 16, "strips of 16-128 columns");
      constexpr int kChunks = NT > 8 ? NT / 8 : 1;  // 64-column chunks
      // The chunks' words loaded together or one chunk at a time: whichever ptxas allocates without spilling
      // (NVRTC 13.5, sm_90a: the forwards' D = 64 strips spill 84 B loaded together, the wgmma D = 64 backward's
      // 84 B one at a time).
      constexpr int kGroup = kKeyRows ? kChunks : 1;
      const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
      for (int c0 = 0; c0 < kChunks; c0 += kGroup) {
        unsigned long long w64[2][kGroup];
        mask.template strip_words<kKeyRows, kGroup>(w64, row0 + (lane >> 2), col0 + 64 * c0,
                                                    (col0 & 63) + (lane & 3) * 2);
        unsigned w[2][kGroup][2];  // 32-bit halves: a pair's test is then one 32-bit LOP3 on a compile-time bit
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int c = 0; c < kGroup; ++c) {
            w[r][c][0] = static_cast<unsigned>(w64[r][c]);
            w[r][c][1] = static_cast<unsigned>(w64[r][c] >> 32);
          }
        }
#pragma unroll
        for (int nn = 0; nn < kGroup * NT / kChunks; ++nn) {  // (a constant trip count: unrolled, s stays in registers)
          const int n = c0 * NT / kChunks + nn;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = row0 + (lane >> 2) + (e >> 1) * 8;
            const int col = col0 + n * 8 + (lane & 3) * 2 + (e & 1);
            const int at = (n % 8) * 8 + (e & 1);  // a compile-time bit
            const bool bit = w[e >> 1][nn / 8][at >> 5] & (1u << (at & 31));
            if (!(bit && mask.base.visible(kKeyRows ? col : row, kKeyRows ? row : col))) s[n][e] = -CUDART_INF_F;
          }
        }
      }
      return;
    }
  }
  score_elements<NT, kKeyRows>(s, row0, col0,
                               [&](float x, int q, int k) { return mask.visible(q, k) ? x : -CUDART_INF_F; });
}

// The keep bits of a strip of NT / 2 16 x 16 blocks (8 each): one 32-bit register where they fit.
template <bool kFits32> struct KeepBitsOf { using type = unsigned long long; };
template <> struct KeepBitsOf<true> { using type = unsigned; };
template <int NT>
using KeepBits = typename KeepBitsOf<NT / 2 <= 4>::type;

// Dropout on a strip of probabilities (issue 16), layout as in score_elements; row0 and col0 are multiples of 16.
// One Philox draw covers a group {i, i+1, i+8, i+9} x {j, j+1, j+8, j+9} of a 16 x 16 block (dropout.cuh): of its
// four words this lane holds two (query-major: the words of its row parity i % 2 = g % 2; key-major, rows are
// keys: those of its key parity j % 2 = g % 2), lane g ^ 1 the other two. So each lane pair takes two blocks at
// a time (draw_block_pair): each lane draws one and hands the partner the two words it holds (two shuffles): one
// draw per 16 scores, none drawn twice. Two forms of the result:
// - dropout_bits: 8 keep bits a block (block m's bit 4a + 2c + d is word a of the pair, byte 2c + d; query-major:
//   a = j % 2, c = (j / 8) % 2 = n % 2, d = (i / 8) % 2 = e / 2; key-major: a = i % 2, c = (j / 8) % 2 = e / 2,
//   d = (i / 8) % 2 = n % 2), in one or two registers, which kernels may hold through a step (the backward does);
//   dropout_zero and pack_a_step_kept apply them, an FSEL a score. The bits are collected in a rolled loop
//   (unrolled, the draws' registers spilled the tiles that sit at 255 registers; kUnrolled where there is room, so
//   that ptxas interleaves the Philox chains).
// - dropout_bits_pair (key-major): dropout_bits of both lanes of a pair, drawn by one thread without shuffles (the
//   wgmma backward's drawer, which hands them over through shared memory).
// - dropout_msbs (query-major, unrolled): the block's two words as ByteThreshold::msbs leaves them, 16 registers
//   for a 128-key strip; pack_a_kept ANDs packed P with masks that one PRMT builds from them: 2 instructions a
//   packed pair against the bits' 5 a word of compares, the gather and an FSEL a score (the ws forward is
//   issue-bound: its D = 64 step went from 1082 to 1007 SASS instructions, 690 without dropout; s15).
// Kernels may draw early (before the scores are live, or while the tensor cores run). Every lane of the warp must
// call them together (they shuffle).

// The two words of a draw that the lane with g % 2 = odd holds, in word order a = 0, 1: words 2 (i % 2) + j % 2, so
// key-major (j % 2 = g % 2) (x, z) even, (y, w) odd; query-major (i % 2 = g % 2) (x, y) even, (z, w) odd.
template <bool kKeyRows>
__device__ __forceinline__ void half_words(const Philox4& r, bool odd, unsigned (&w)[2]) {
  if constexpr (kKeyRows) w[0] = odd ? r.y : r.x, w[1] = odd ? r.w : r.z;
  else w[0] = odd ? r.z : r.x, w[1] = odd ? r.w : r.y;
}

// The lane's words of blocks m and m + 1 of a strip (m even), each in word order a = 0, 1: own from its own draw
// (block m + g % 2), got from its partner's (block m + 1 - g % 2).
template <bool kKeyRows, class Dropout>
__device__ __forceinline__ void draw_block_pair(int m, bool odd, unsigned row_group, unsigned col_group,
                                                const Dropout& drop, unsigned (&own)[2], unsigned (&got)[2]) {
  const unsigned cg = col_group + 4u * static_cast<unsigned>(m + odd);
  const Philox4 r = kKeyRows ? drop.draw_group(cg, row_group) : drop.draw_group(row_group, cg);
  unsigned give[2];
  half_words<kKeyRows>(r, odd, own);
  half_words<kKeyRows>(r, !odd, give);
  got[0] = __shfl_xor_sync(0xFFFFFFFFu, give[0], 4);
  got[1] = __shfl_xor_sync(0xFFFFFFFFu, give[1], 4);
}

// The counter words of a lane's rows and of its first column group (block m: + 4m).
template <class Dropout>
struct LaneGroups {
  bool odd;  // g % 2: which half of each group
  unsigned row, col;
  __device__ __forceinline__ LaneGroups(int row0, int col0) {
    const int lane = static_cast<int>(threadIdx.x) & 31;
    odd = (lane >> 2) & 1;
    row = Dropout::group(row0 + (lane >> 2));  // the same for both rows of the lane
    col = Dropout::group(col0 + (lane & 3) * 2);
  }
};

template <int NT, bool kKeyRows, bool kUnrolled = false, class Dropout>
__device__ __forceinline__ KeepBits<NT> dropout_bits(int row0, int col0, const Dropout& drop) {
  static_assert(NT % 2 == 0 && NT <= 16, "whole 16 x 16 blocks; keep bits in one 64-bit word");
  constexpr int kBlocks = NT / 2;
  const LaneGroups<Dropout> lg(row0, col0);
  const ByteThreshold ge(drop.threshold);
  using Bits = KeepBits<NT>;
  constexpr int kTop = 8 * static_cast<int>(sizeof(Bits));
  Bits bits = 0;  // filled from the top, 16 bits (two blocks) per step
#pragma unroll(kUnrolled ? kBlocks / 2 : 1)
  for (int m = 0; m + 1 < kBlocks; m += 2) {  // the even lane draws block m, the odd one m + 1
    unsigned own[2], got[2];
    draw_block_pair<kKeyRows>(m, lg.odd, lg.row, lg.col, drop, own, got);
    const unsigned o8 = ge.kept8(own[0], own[1]), g8 = ge.kept8(got[0], got[1]);
    const unsigned pair = lg.odd ? g8 | (o8 << 8) : o8 | (g8 << 8);
    bits = (bits >> 16) | (static_cast<Bits>(pair) << (kTop - 16));
  }
  if constexpr (kBlocks % 2 == 1) {  // an odd last block: both lanes draw it (Bc = 16 only)
    const unsigned cg = lg.col + 4u * static_cast<unsigned>(kBlocks - 1);
    const Philox4 r = kKeyRows ? drop.draw_group(cg, lg.row) : drop.draw_group(lg.row, cg);
    unsigned w[2];
    half_words<kKeyRows>(r, lg.odd, w);
    bits = (bits >> 8) | (static_cast<Bits>(ge.kept8(w[0], w[1])) << (kTop - 8));
  }
  return bits >> (kTop - 8 * kBlocks);
}

// dropout_bits<NT, true> of both lanes of a key-major lane pair (lanes 8 c + t and 8 c + 4 + t: keys key_pair,
// key_pair + 1 and + 8, + 9; queries query0 + 2t.. of each 16 x 16 block), drawn by one thread with no exchange:
// for a drawer that hands them over through shared memory. Word h of each holds blocks 4h.. (32-bit halves of
// KeepBits<NT>). A rolled loop: a drawer keeps few registers.
template <int NT, class Dropout>
__device__ __forceinline__ void dropout_bits_pair(int key_pair, int query0, const Dropout& drop,
                                                  unsigned (&even)[NT / 8], unsigned (&odd)[NT / 8]) {
  static_assert(NT % 8 == 0, "whole 32-bit words: 4 blocks each");
  const ByteThreshold ge(drop.threshold);
  const unsigned key_group = Dropout::group(key_pair);
  unsigned query_group = Dropout::group(query0);
#pragma unroll
  for (int h = 0; h < NT / 8; ++h) {
    unsigned e = 0, o = 0;
#pragma unroll 1
    for (int m = 0; m < 4; ++m, query_group += 4) {
      const Philox4 r = drop.draw_group(query_group, key_group);
      unsigned we[2], wo[2];
      half_words<true>(r, false, we);
      half_words<true>(r, true, wo);
      e = (e >> 8) | (ge.kept8(we[0], we[1]) << 24);
      o = (o >> 8) | (ge.kept8(wo[0], wo[1]) << 24);
    }
    even[h] = e, odd[h] = o;
  }
}

// dropout_msbs' form: msb[m][a] is the lane's word a of 16 x 16 block m after ByteThreshold::msbs (bit 7 of byte
// 2c + d set: score (c, d) of that word kept; the other bits mean nothing).
template <int NT>
struct KeepMsbs {
  unsigned msb[NT / 2][2];
};

template <int NT, class Dropout>
__device__ __forceinline__ KeepMsbs<NT> dropout_msbs(int row0, int col0, const Dropout& drop) {
  static_assert(NT % 4 == 0, "pairs of 16 x 16 blocks");
  const LaneGroups<Dropout> lg(row0, col0);
  const ByteThreshold ge(drop.threshold);
  KeepMsbs<NT> k;
#pragma unroll
  for (int m = 0; m < NT / 2; m += 2) {
    unsigned own[2], got[2];
    draw_block_pair<false>(m, lg.odd, lg.row, lg.col, drop, own, got);
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const unsigned o = ge.msbs(own[a]), g = ge.msbs(got[a]);
      k.msb[m][a] = lg.odd ? g : o, k.msb[m + 1][a] = lg.odd ? o : g;
    }
  }
  return k;
}

// pack_a of a query-major strip of P with the dropped scores zeroed: packed pair i of block kk (pack_a_step's a[i]:
// n8 tile 2 kk + i / 2, row half i % 2, so byte i of both words, j even in the low half) is ANDed with a mask that
// PRMT's sign-replicating selector builds from bit 7 of those bytes (0xFFFF per kept half). fp16 and bf16 zeros
// are both 0x0000.
template <typename T, int K>
__device__ __forceinline__ void pack_a_kept(uint32_t (&a)[K][4], const float (&c)[2 * K][4], const KeepMsbs<2 * K>& k) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    pack_a_step<T>(a[kk], c, kk);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      constexpr unsigned kSel[4] = {0xCC88u, 0xDD99u, 0xEEAAu, 0xFFBBu};  // nibble 8 | byte: replicate its bit 7
      uint32_t mask;
      asm("prmt.b32 %0, %1, %2, %3;" : "=r"(mask) : "r"(k.msb[kk][0]), "r"(k.msb[kk][1]), "r"(kSel[i]));
      a[kk][i] &= mask;
    }
  }
}

// Bit of score (n, e) of a strip in its keep bits (dropout_bits' layout).
template <bool kKeyRows>
__device__ __forceinline__ constexpr int keep_bit(int n, int e) {
  return 8 * (n >> 1) + 4 * (e & 1) + (kKeyRows ? 2 * (e >> 1) + (n & 1) : 2 * (n & 1) + (e >> 1));
}
template <int NT, bool kKeyRows>
__device__ __forceinline__ bool is_kept(KeepBits<NT> bits, int n, int e) {
  return (bits >> keep_bit<kKeyRows>(n, e)) & 1;
}

// Zero the dropped scores of n8 tile n: the forward's P (O takes 1 / (1 - p) once at the end: dropout_scale_o)
// and the backward's dP^T (its 1 / (1 - p) goes into ds_tile's z). The backward keeps P^T itself whole: dS needs
// P where it was dropped too (dS = P (Z dP - Delta)), and dV takes its kept part as it is packed.
template <int NT, bool kKeyRows>
__device__ __forceinline__ void dropout_zero(float (&s)[4], KeepBits<NT> bits, int n) {
#pragma unroll
  for (int e = 0; e < 4; ++e) s[e] = is_kept<NT, kKeyRows>(bits, n, e) ? s[e] : 0.f;
}
template <int NT, bool kKeyRows>
__device__ __forceinline__ void dropout_zero(float (&s)[NT][4], KeepBits<NT> bits) {
#pragma unroll
  for (int n = 0; n < NT; ++n) dropout_zero<NT, kKeyRows>(s[n], bits, n);
}

// The forward's O accumulators times 1 / (1 - p) (dropout_zero kept P unscaled): once per block.
template <int NT, class Dropout>
__device__ __forceinline__ void dropout_scale_o(float (&acc)[NT][4], const Dropout& drop) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] *= drop.scale;
  }
}

// pack_a_step of the kept probabilities of a key-major P^T (keep bits from dropout_bits<NT, true>): dV's A operand
// (its 1 / (1 - p) is applied to dV once at the end).
template <typename T, int NT>
__device__ __forceinline__ void pack_a_step_kept(uint32_t (&a)[4], const float (&c)[NT][4], int kk, KeepBits<NT> bits) {
  auto kept = [&](int n, int e) { return is_kept<NT, true>(bits, n, e) ? c[n][e] : 0.f; };
  a[0] = pack2<T>(kept(2 * kk, 0), kept(2 * kk, 1));
  a[1] = pack2<T>(kept(2 * kk, 2), kept(2 * kk, 3));
  a[2] = pack2<T>(kept(2 * kk + 1, 0), kept(2 * kk + 1, 1));
  a[3] = pack2<T>(kept(2 * kk + 1, 2), kept(2 * kk + 1, 3));
}

// The backward's P^T = exp2(S^T * c - lse * log2 e) on a key-major strip: column n8 tile n, pair
// 2t, 2t+1 of this lane takes lse_cols[8n], [8n + 1] (the lane's query pair; lse in natural log).
// A query that saw no key (lse = -inf) gets P = 0 even where its scores are -inf. kLog2: lse_cols holds
// log2_lse's values already (made once a step in shared memory instead of in every lane).
__device__ __forceinline__ float log2_lse(float lse, float log2_z = 0.f) {
  return lse == -CUDART_INF_F ? CUDART_INF_F : fmaf(lse, kLog2e, -log2_z);
}
template <int NT, bool kLog2 = false>
__device__ __forceinline__ void probs_from_lse(float (&s)[NT][4], float c, const float* lse_cols) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const float2 ls = *reinterpret_cast<const float2*>(lse_cols + n * 8);
    const float2 l2 = kLog2 ? ls
                            : make_float2(ls.x == -CUDART_INF_F ? CUDART_INF_F : ls.x * kLog2e,
                                          ls.y == -CUDART_INF_F ? CUDART_INF_F : ls.y * kLog2e);
    s[n][0] = fast_exp2(fmaf(s[n][0], c, -l2.x));
    s[n][1] = fast_exp2(fmaf(s[n][1], c, -l2.y));
    s[n][2] = fast_exp2(fmaf(s[n][2], c, -l2.x));
    s[n][3] = fast_exp2(fmaf(s[n][3], c, -l2.y));
  }
}

// One step of the online softmax for a 16-row strip (rows g and g+8 of this lane: h = 0, 1).
// On entry s holds raw scores (or -inf where masked) and c > 0 the log2-space scale; on exit s
// holds P = exp2(s * c - m), with m the running max of s * c, l is updated and alpha returns the
// factors that rescale the output accumulator. Scaling inside the exponent's FFMA is free; it needs
// c > 0 (callers pre-multiply and pass c = 1 otherwise). l stays a per-lane partial sum (reduced
// once at the end). A row that has seen only -inf keeps m = -inf and gets p = 0, never NaN.
template <int NT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float c, float (&m)[2], float (&l)[2],
                                               float (&alpha)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -CUDART_INF_F;
#pragma unroll
    for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
    mx = fmaxf(m[h], quad_max(mx) * c);
    const float m_use = mx == -CUDART_INF_F ? 0.f : mx;
    alpha[h] = fast_exp2(m[h] - m_use);
    m[h] = mx;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      s[n][2 * h] = fast_exp2(fmaf(s[n][2 * h], c, -m_use));
      s[n][2 * h + 1] = fast_exp2(fmaf(s[n][2 * h + 1], c, -m_use));
      sum += s[n][2 * h] + s[n][2 * h + 1];
    }
    l[h] = l[h] * alpha[h] + sum;
  }
}

// Scores times c when c <= 0 (a rare, uniform path), so that the FFMA form above can take c = 1.
template <int NT>
__device__ __forceinline__ float positive_scale(float (&s)[NT][4], float c) {
  if (c > 0.f) return c;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] *= c;
  }
  return 1.f;
}

// A strip's scores by a ModScore-like policy with its softcap / ALiBi terms known (log2_score_as<kFast, kCap, kSlope>).
template <int NT, bool kKeyRows, bool kFast, bool kCap, bool kSlope, class Score>
__device__ __forceinline__ void score_strip_as(float (&s)[NT][4], int row0, int col0, const Score& score) {
  score_elements<NT, kKeyRows>(s, row0, col0, [&](float r, int q, int k) {
    return score.template log2_score_as<kFast, kCap, kSlope>(r, q, k);
  });
}

// ALiBi alone (no softcap) under a one-sided mask (OneSided: Causal), a query-major strip: a visible pair's distance
// q + offset - k is this lane's base plus a compile-time step, exact as a float (one FADD serves two scores), and the
// slope is divided by the scale once a strip, so a score takes one FFMA, s + (slope / scale) distance, and the scale
// folds into the exponential's FFMA as for plain scores (the strip returns it). Against slope distance + s scale (an
// FMUL more a score): the D = 64 wgmma forward 1.07x and backward 1.11x (s29, benchmarks/NOTES.md). score_strip takes
// these forms only for scale > 0. Keys past the diagonal get negative distances (finite): the mask sets them to -inf
// next (they sit in partial tiles only).
template <int NT, bool kFast, class Score>
__device__ __forceinline__ float alibi_strip_one_sided(float (&s)[NT][4], int row0, int col0, const Score& score) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const float base = static_cast<float>(row0 + (lane >> 2) + score.offset - col0 - (lane & 3) * 2);
  const float scale = score.P->scale_log2;  // > 0 (score_strip)
  const float slope = kFast ? __fdividef(score.slope_log2, scale) : score.slope_log2 / scale;  // (float32: exact)
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = fmaf(slope, base + static_cast<float>((e >> 1) * 8 - n * 8 - (e & 1)), s[n][e]);
    }
  }
  return scale;
}

// The same for a key-major strip (the backwards': rows are keys row0 + g, + 8, columns queries col0 + 8n + 2t, + 1;
// the returned scale goes into probs_from_lse's FFMA),
// for AlibiScore only: in ModScore's kernels the shorter form scheduled the softcap path 12-14% slower (s17,
// benchmarks/NOTES.md), and there the two share one kernel.
template <int NT, bool kFast, class Score>
__device__ __forceinline__ float alibi_strip_one_sided_keys(float (&s)[NT][4], int row0, int col0, const Score& score) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const float base = static_cast<float>(col0 + (lane & 3) * 2 + score.offset - row0 - (lane >> 2));
  const float scale = score.P->scale_log2;  // > 0 (score_strip)
  const float slope = kFast ? __fdividef(score.slope_log2, scale) : score.slope_log2 / scale;  // (float32: exact)
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = fmaf(slope, base + static_cast<float>(n * 8 + (e & 1) - (e >> 1) * 8), s[n][e]);
    }
  }
  return scale;
}

// The policy's scores for one strip (a strip as in score_elements), before masking. Returns the scale the
// exponential's FFMA takes next: the log2-space scale for plain scores and the one-sided ALiBi strips (folded in,
// never multiplied here), 1 once a score policy has produced log2 units itself. kFast: the score's MUFU forms
// (tanh.approx, ~2^-11: below 16-bit rounding); float32 kernels take the accurate ones.
// kOneSided: the kernel's mask is OneSided (ALiBi then skips the distance's abs: the forwards with ModScore or
// AlibiScore, the backwards with AlibiScore).
template <int NT, bool kKeyRows = false, bool kFast = true, bool kOneSided = false, class Score>
__device__ __forceinline__ float score_strip(float (&s)[NT][4], int row0, int col0, const Score& score,
                                             float scale_log2) {
  if constexpr (Score::kIdentity) {
    return positive_scale<NT>(s, scale_log2);
  } else if constexpr (SplitsSoftcap<Score>::value) {  // uniform tests per strip, not a tanh per element
    // The forwards' strips also skip the ALiBi distance (4 instructions a score) where the head has no slope:
    // softcap-only forward 6 / 11% faster at D = 64 / 128 (H100). The key-major backward strips keep it: with the
    // split, ptxas scheduled the backward's step worse (softcap backward 8% / 5% slower, benchmarks/NOTES.md).
    if constexpr (kOneSided && !kKeyRows && MaySlope<Score>::value) {  // (SoftcapScore: no ALiBi code at all)
      if (!score.softcapped() && score.P->scale_log2 > 0.f) {
        return alibi_strip_one_sided<NT, kFast>(s, row0, col0, score);
      }
    }
    if constexpr (kOneSided && kKeyRows && AlibiOnly<Score>::value) {
      if (score.P->scale_log2 > 0.f) return alibi_strip_one_sided_keys<NT, kFast>(s, row0, col0, score);
    }
    if (!score.softcapped()) score_strip_as<NT, kKeyRows, kFast, false, true>(s, row0, col0, score);  // ALiBi
    else if (kKeyRows || score.sloped()) score_strip_as<NT, kKeyRows, kFast, true, true>(s, row0, col0, score);
    else score_strip_as<NT, kKeyRows, kFast, true, false>(s, row0, col0, score);
    return 1.f;
  } else {
    score_elements<NT, kKeyRows>(s, row0, col0, [&](float r, int q, int k) {
      return score.template log2_score<kFast>(r, q, k);
    });
    return 1.f;
  }
}

// z dP - Delta: with kZ (dropout) z = 1 / (1 - p), else plain dP - Delta (the kernels without dropout unchanged).
template <bool kZ>
__device__ __forceinline__ float dp_minus_delta(float dp, float z, float delta) {
  if constexpr (kZ) return fmaf(dp, z, -delta);
  else return dp - delta;
}

// The backward's dS^T of one key-major C tile (keys key0 + g, + 8; queries q0 + 2t, + 1):
// P^T (z dP^T - Delta), times the score policy's derivative where it has one (ds may alias pt); kZ: with dropout,
// z = 1 / (1 - p) on a dP^T zeroed where dropped (dropout_zero), else z = 1.
// lse_q: the tile's queries' lse (natural log), delta_q: their Delta. grad_owner: this warp gives the pairs'
// dbias (false on the warps that recompute the same tile for other head-dim columns).
template <bool kZ, class Score, class Factor>
__device__ __forceinline__ void ds_elements(float (&ds)[4], const float (&pt)[4], const float (&dpt)[4], float2 delta_q,
                                            float2 lse_q, const Score& score, int key0, int q0, bool grad_owner,
                                            float z, const Factor& factor) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int key = key0 + (lane >> 2) + (e >> 1) * 8;
    const int query = q0 + (lane & 3) * 2 + (e & 1);
    const float l2 = ((e & 1) ? lse_q.y : lse_q.x) * kLog2e;
    const float f = factor(pt[e], l2, query, key);
    const float dsc = pt[e] * dp_minus_delta<kZ>(dpt[e], z, (e & 1) ? delta_q.y : delta_q.x);  // d loss / d score
    if constexpr (HasBiasGrad<Score>::value) {
      if (grad_owner) score.add_dbias(dsc, query, key);
    }
    ds[e] = dsc * f;
  }
}

template <bool kZ = false, class Score>
__device__ __forceinline__ void ds_tile(float (&ds)[4], const float (&pt)[4], const float (&dpt)[4], float2 delta_q,
                                        float2 lse_q, const Score& score, int key0, int q0, bool grad_owner = true,
                                        float z = 1.f) {
  if constexpr (Score::kIdentity) {
    ds[0] = pt[0] * dp_minus_delta<kZ>(dpt[0], z, delta_q.x);
    ds[1] = pt[1] * dp_minus_delta<kZ>(dpt[1], z, delta_q.y);
    ds[2] = pt[2] * dp_minus_delta<kZ>(dpt[2], z, delta_q.x);
    ds[3] = pt[3] * dp_minus_delta<kZ>(dpt[3], z, delta_q.y);
  } else if constexpr (SplitsSoftcap<Score>::value) {  // no log2 and no ALiBi distance without a softcap
    const auto capped = [&](float P, float l2, int q, int k) {
      return score.template ds_factor_as<true, true>(P, l2, q, k);
    };
    const auto one = [](float, float, int, int) { return 1.f; };
    if (score.softcapped()) ds_elements<kZ>(ds, pt, dpt, delta_q, lse_q, score, key0, q0, grad_owner, z, capped);
    else ds_elements<kZ>(ds, pt, dpt, delta_q, lse_q, score, key0, q0, grad_owner, z, one);
  } else {
    const auto factor = [&](float P, float l2, int q, int k) { return score.template ds_factor<true>(P, l2, q, k); };
    ds_elements<kZ>(ds, pt, dpt, delta_q, lse_q, score, key0, q0, grad_owner, z, factor);
  }
}

// dS^T of one key-major C tile (n8 tile n of the keep bits' strip) with dropout on plain scores, from pz = P^T z
// (z = 1 / (1 - p)) and delta_q = Delta / z: P (Z dP - Delta) = pz (dP - delta_q) where kept and -pz delta_q where
// dropped. An FMUL and an FFMA predicated on the keep bit, as many instructions as without dropout (dropout_zero's
// FSEL and ds_tile's z take one more a score).
template <int NT>
__device__ __forceinline__ void ds_tile_kept(float (&ds)[4], const float (&pz)[4], const float (&dpt)[4],
                                             float2 delta_q, KeepBits<NT> bits, int n) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float u = -pz[e] * ((e & 1) ? delta_q.y : delta_q.x);
    if (is_kept<NT, true>(bits, n, e)) u = fmaf(pz[e], dpt[e], u);
    ds[e] = u;
  }
}

// Start of the forward's running max and sum for one row pair: -inf and 0, or with an attention sink
// its logit and its exp2(0) = 1 (on lane t = 0 only: l is a per-lane partial sum, reduced over the quad).
__device__ __forceinline__ void softmax_start(float (&m)[2], float (&l)[2], float sink) {
  const bool first = (threadIdx.x & 3) == 0;
  m[0] = m[1] = sink;
  l[0] = l[1] = (first && sink != -CUDART_INF_F) ? 1.f : 0.f;
}

// ------------------------------------------------------------------------------ epilogues and loaders

// The forward's epilogue for one 16-row strip of C fragments (rows row0 + g, row0 + g + 8 of this lane):
// O = acc / l in T, lse = (m + log2 l) ln 2; rows that saw no key get 0 and -inf; rows past nq and
// columns past d are not stored. l is this lane's partial row sum (reduced over the quad here). Rows are
// those of sequence b (varlen: its rows of the pack, re-read here rather than kept live through the loop).
template <typename T, int NT>
__device__ __forceinline__ void store_o_lse(const AttentionParams& p, int b, int h, int row0, const float (&acc)[NT][4],
                                            const float (&m)[2], const float (&l)[2]) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const SeqGeometry seq = seq_geometry(p, b);
  T* gO = static_cast<T*>(p.o) + b * p.o_s.b + h * p.o_s.h + seq.q_row0 * p.o_s.n;
  float* gL = p.lse + b * p.lse_s.b + h * p.lse_s.h + seq.q_row0 * p.lse_s.n;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float sum = quad_sum(l[hh]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int row = row0 + (lane >> 2) + hh * 8;
    if (row < seq.nq) {
      T* orow = gO + row * p.o_s.n;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int col = n * 8 + (lane & 3) * 2;
        if (col < p.d) store2<T>(orow + col, acc[n][2 * hh] * inv, acc[n][2 * hh + 1] * inv);
      }
      if ((lane & 3) == 0) gL[row * p.lse_s.n] = sum > 0.f ? (m[hh] + log2f(sum)) * 0.6931471805599453f : -CUDART_INF_F;
    }
  }
}

// The backward's epilogue for one 16-key strip: dV_j and scale * dK_j in T, columns col0 + 8n + 2t, +1 of
// keys key0 + g, key0 + g + 8. Keys past nk are not stored; keys no query sees get zeros. Keys are those of
// sequence b (varlen: its rows of the pack, its first seqused_k[b]).
template <typename T, int NT>
__device__ __forceinline__ void store_dk_dv(const AttentionParams& p, int b, int hkv, int key0, int col0,
                                            const float (&acc_dk)[NT][4], const float (&acc_dv)[NT][4]) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const SeqGeometry seq = seq_geometry(p, b);
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int key = key0 + (lane >> 2) + hf * 8;
    if (key < seq.nk) {
      const long long krow = static_cast<long long>(seq.k_row0) + key;
      T* dv_row = static_cast<T*>(p.dv) + b * p.dv_s.b + hkv * p.dv_s.h + krow * p.dv_s.n;
      T* dk_row = static_cast<T*>(p.dk) + b * p.dk_s.b + hkv * p.dk_s.h + krow * p.dk_s.n;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int col = col0 + n * 8 + (lane & 3) * 2;
        if (col < p.d) {
          store2<T>(dv_row + col, acc_dv[n][2 * hf], acc_dv[n][2 * hf + 1]);
          store2<T>(dk_row + col, acc_dk[n][2 * hf] * p.scale, acc_dk[n][2 * hf + 1] * p.scale);
        }
      }
    }
  }
}

// The backward's per-row statistics of one Q_i tile (rows i0.. of query head h) into shared memory,
// as cp.async copies in the caller's current group: lse to s_lse[r], Delta to s_delta[r], thread r < Br
// copying row r. Rows past nq read nothing and become 0: their Q and dO rows are zero-filled too, so
// they contribute nothing whatever P is.
template <int Br>
__device__ __forceinline__ void load_row_stats_async(const AttentionParams& p, float* s_lse, float* s_delta, int b,
                                                     int h, int i0, int tid) {
  if (tid < Br) {
    const SeqGeometry seq = seq_geometry(p, b);
    const int i = max(min(i0 + tid, seq.nq - 1), 0);
    const int nbytes = i0 + tid < seq.nq ? 4 : 0;
    cp_async_4(smem_u32(s_lse + tid), p.lse + b * p.lse_s.b + h * p.lse_s.h + (seq.q_row0 + i) * p.lse_s.n, nbytes);
    cp_async_4(smem_u32(s_delta + tid), p.delta + scratch_row(p, seq, b, h) + i, nbytes);
  }
}

// Adds a warp's dQ_i fragments (rows row0 + g, + 8; columns col0 + 8n + 2t, +1) into the f32 accumulator
// row block of query head h; rows past nq and columns past d are skipped. (lane comes from the caller,
// which may rebuild it from an opaque thread index to keep address registers out of its main loop.)
template <int NT>
__device__ __forceinline__ void red_add_dq(const AttentionParams& p, int b, int h, int row0, int col0,
                                           const float (&acc)[NT][4], int lane) {
  const SeqGeometry seq = seq_geometry(p, b);
  float* gdq = p.dq_accum + scratch_row(p, seq, b, h) * p.d;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int row = row0 + (lane >> 2) + hf * 8;
    if (row < seq.nq) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int col = col0 + n * 8 + (lane & 3) * 2;
        if (col < p.d) red_add2(gdq + static_cast<long long>(row) * p.d + col, acc[n][2 * hf], acc[n][2 * hf + 1]);
      }
    }
  }
}

}  // namespace mma
}  // namespace cupyflash
