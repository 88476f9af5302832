// Masking and the online softmax on mma C fragments (scores live in registers; see mma_primitives.cuh
// for the fragment layout). Scores are kept in log2 units: s = S * scale * log2(e), so every
// exponential is one ex2 and the scale costs one multiply.
#pragma once
#include <math_constants.h>

#include "mma_primitives.cuh"

namespace cupyflash {
namespace mma {

// Set s to -inf where key > query + causal_offset (causal) or key >= nk. s holds NT C tiles of
// one 16-row strip whose first row is row0 and first key col0; lane (g, t) owns rows row0+g,
// row0+g+8 and columns col0 + 8n + 2t, +1.
// kKeyRows: the strip is transposed (rows are keys, columns queries), as in the backward's S^T.
template <int NT, bool kKeyRows = false>
__device__ __forceinline__ void mask_strip(float (&s)[NT][4], int row0, int col0, int nk, bool causal,
                                           int causal_offset) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + (lane >> 2) + (e >> 1) * 8;
      const int col = col0 + n * 8 + (lane & 3) * 2 + (e & 1);
      const int query = kKeyRows ? col : row;
      const int key = kKeyRows ? row : col;
      const bool out = key >= nk || (causal && key > query + causal_offset);
      if (out) s[n][e] = -CUDART_INF_F;
    }
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

}  // namespace mma
}  // namespace cupyflash
