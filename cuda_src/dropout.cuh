// Attention dropout's policy member (issue 16): which probabilities P_ij survive, from Philox4x32-10 keyed by
// (seed, batch, head, i, j), so every family and both passes regenerate the same mask whatever their tiles.
// The rule (cupyflash/dropout.py has its NumPy twin and the why): key = (seed low, seed high); one draw serves
// the 16 scores {i, i+1, i+8, i+9} x {j, j+1, j+8, j+9} of a 16 x 16 block, counter = (group(j), group(i), h, b)
// with group(x) = (x / 16) * 4 + (x / 2) % 4; P_ij takes byte 2 ((j / 8) % 2) + (i / 8) % 2 of output word
// 2 (i % 2) + j % 2 and is kept iff that byte is >= threshold = round(p * 256) (<= 255); a kept one is scaled by
// 1 / (1 - threshold / 256). lse stays undropped.
//
//   pol.dropout.at_head(p, b, h)   // the (batch, query head) whose mask follows
//   pol.dropout.keep(i, j)         // is P_ij kept? (one draw per call: the portable kernels' per-element path)
//   pol.dropout.scale              // 1 / (1 - threshold / 256), applied once by the caller
//   pol.dropout.factor(i, j)       // keep ? scale : 0 (1 without dropout)
//   pol.dropout.draw_group(gi, gj) // one draw: the 16 bytes of row group gi x column group gj
//   Policy::Dropout::kOn           // false for NoDropout: kernels compile the dropout code out
// The tensor-core kernels draw a strip's groups through dropout_bits, dropout_bits_pair or dropout_msbs
// (mma_softmax.cuh): one draw per 16 scores.
#pragma once
#include "attention_params.cuh"
#include "philox.cuh"

namespace cupyflash {

struct NoDropout {
  static constexpr bool kOn = false;
  static constexpr float scale = 1.f;
  __device__ explicit NoDropout(const AttentionParams&) {}
  __device__ __forceinline__ void at_head(const AttentionParams&, int, int) {}
  __device__ __forceinline__ bool keep(int, int) const { return true; }
  __device__ __forceinline__ float factor(int, int) const { return 1.f; }
};

// byte >= threshold for the four bytes of a word at once: the carry out of byte + (256 - threshold), with the low
// seven bits of each byte added in one 32-bit add (no carry crosses a byte) and the top bits by a majority.
struct ByteThreshold {
  unsigned add;  // (256 - threshold) % 128 in every byte (0x80 in every byte for threshold 0: all kept)
  unsigned top;  // 0x80808080 where 256 - threshold has its top bit (and for threshold 0), else 0
  __device__ explicit ByteThreshold(unsigned threshold) {
    const unsigned u = 256u - threshold;
    add = threshold == 0u ? 0x80808080u : (u & 0x7Fu) * 0x01010101u;
    top = (threshold == 0u || (u & 0x80u)) ? 0x80808080u : 0u;
  }
  // The bytes' low seven bits plus add's: bit 7 of each byte is the carry into its top bit.
  __device__ __forceinline__ unsigned low_sums(unsigned w) const { return (w & 0x7F7F7F7Fu) + add; }
  // Bit 7 of each byte: the majority of the byte's top bit (from t), that of 256 - threshold and the carry into
  // them (from x = low_sums), one LOP3.
  __device__ __forceinline__ unsigned majority(unsigned t, unsigned x) const { return (t & x) | (t & top) | (x & top); }
  // The carries of w's bytes at bits 7, 15, 23, 31 (top has no other bits, so neither has the result).
  __device__ __forceinline__ unsigned carries(unsigned w) const { return majority(w & 0x80808080u, low_sums(w)); }
  // The same carries with whatever the other bits hold (for users that read bit 7 of each byte only).
  __device__ __forceinline__ unsigned msbs(unsigned w) const { return majority(w, low_sums(w)); }
  // Keep bits of two words: bit k = byte k of w0 kept, bit 4 + k = byte k of w1 (the multiply gathers bits
  // 8k + 3 and 8k + 7 to 24 + k and 28 + k; the other partial products land on distinct bits below 24).
  __device__ __forceinline__ unsigned kept8(unsigned w0, unsigned w1) const {
    return ((carries(w1) | (carries(w0) >> 4)) * 0x00204081u) >> 24;
  }
};

struct Dropout {
  static constexpr bool kOn = true;
  unsigned k0, k1, threshold;
  float scale;
  unsigned b = 0, h = 0;
  __device__ explicit Dropout(const AttentionParams& p)
      : k0(static_cast<unsigned>(p.dropout_seed)), k1(static_cast<unsigned>(p.dropout_seed >> 32)),
        threshold(p.dropout_threshold), scale(p.dropout_scale) {}
  // b: the launch's batch index (the kernels' own); the mask's is offset by the sub-batch's first one.
  __device__ __forceinline__ void at_head(const AttentionParams& p, int batch, int head) {
    b = static_cast<unsigned>(p.dropout_b0 + batch);
    h = static_cast<unsigned>(head);
  }
  // The counter word of a row (or column) index: its 16-block, and its pair inside the block's first 8.
  static __device__ __forceinline__ unsigned group(int x) {
    return ((static_cast<unsigned>(x) >> 4) << 2) | ((static_cast<unsigned>(x) >> 1) & 3u);
  }
  __device__ __forceinline__ Philox4 draw_group(unsigned gi, unsigned gj) const {
    return philox4x32_10({gj, gi, h, b}, k0, k1);
  }
  // The byte of P_ij in its group's draw.
  static __device__ __forceinline__ unsigned byte_of(const Philox4& r, int i, int j) {
    const int word = 2 * (i & 1) + (j & 1);
    const unsigned w = word == 0 ? r.x : word == 1 ? r.y : word == 2 ? r.z : r.w;
    return (w >> (8 * (2 * ((j >> 3) & 1) + ((i >> 3) & 1)))) & 0xFFu;
  }
  __device__ __forceinline__ bool keep(int i, int j) const {
    return byte_of(draw_group(group(i), group(j)), i, j) >= threshold;
  }
  // Z_ij = keep / (1 - p_eff): the factor on P_ij in O and dV, and on dP_ij in dS = P (Z dP - Delta).
  __device__ __forceinline__ float factor(int i, int j) const { return keep(i, j) ? scale : 0.f; }
};

}  // namespace cupyflash
