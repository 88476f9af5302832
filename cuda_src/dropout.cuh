// Attention dropout's policy member (issue 16): which probabilities P_ij survive, from Philox4x32-10 keyed by
// (seed, batch, head, i, j), so every family and both passes regenerate the same mask whatever their tiles.
// The rule (cupyflash/dropout.py has its NumPy twin): key = (seed low, seed high), counter = (j / 2, i / 2,
// h, b); one draw covers the 2 x 2 block of (i, j) it names, output (i % 2) * 2 + j % 2; P_ij is kept iff
// that output is >= floor(p * 2^32), and a kept one is scaled by 1 / (1 - p). lse stays undropped.
//
//   pol.dropout.at_head(p, b, h)   // the (batch, query head) whose mask follows
//   pol.dropout.keep(i, j)         // is P_ij kept?
//   pol.dropout.scale              // 1 / (1 - p), applied once by the caller
//   pol.dropout.factor(i, j)       // keep ? 1 / (1 - p) : 0 (1 without dropout)
//   Policy::Dropout::kOn           // false for NoDropout: kernels compile the dropout code out
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
  // The four draws of the 2 x 2 block holding (i, j): x = (even i, even j), y = (even, odd), z = (odd, even),
  // w = (odd, odd). Callers that hold several elements of a block draw once and pick with kept().
  __device__ __forceinline__ Philox4 draw(int i, int j) const {
    return philox4x32_10({static_cast<unsigned>(j) >> 1, static_cast<unsigned>(i) >> 1, h, b}, k0, k1);
  }
  __device__ __forceinline__ bool kept(const Philox4& r, int i, int j) const {
    const unsigned u = (i & 1) ? ((j & 1) ? r.w : r.z) : ((j & 1) ? r.y : r.x);
    return u >= threshold;
  }
  __device__ __forceinline__ bool keep(int i, int j) const { return kept(draw(i, j), i, j); }
  // Z_ij = keep / (1 - p): the factor on P_ij in O and dV, and on dP_ij in dS = P (Z dP - Delta).
  __device__ __forceinline__ float factor(int i, int j) const { return keep(i, j) ? scale : 0.f; }
};

}  // namespace cupyflash
