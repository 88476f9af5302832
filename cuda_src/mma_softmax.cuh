// Masking and the online softmax on mma C fragments (scores live in registers; see mma_primitives.cuh
// for the fragment layout). Scores are kept in log2 units: s = S * scale * log2(e), so every
// exponential is one ex2 and the scale costs one multiply.
#pragma once
#include <math_constants.h>

#include "mma_primitives.cuh"

namespace cupyflash {
namespace mma {

// Set s to -inf where key col > row + causal_offset (causal) or col >= nk. s holds NT C tiles of
// one 16-row strip whose first row is row0 and first key col0; lane (g, t) owns rows row0+g,
// row0+g+8 and columns col0 + 8n + 2t, +1.
template <int NT>
__device__ __forceinline__ void mask_strip(float (&s)[NT][4], int row0, int col0, int nk, bool causal,
                                           int causal_offset) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
#pragma unroll
  for (int n = 0; n < NT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = row0 + (lane >> 2) + (e >> 1) * 8;
      const int col = col0 + n * 8 + (lane & 3) * 2 + (e & 1);
      const bool out = col >= nk || (causal && col > row + causal_offset);
      if (out) s[n][e] = -CUDART_INF_F;
    }
  }
}

// One step of the online softmax for a 16-row strip (rows g and g+8 of this lane: h = 0, 1).
// On entry s holds log2-scaled scores; on exit s holds P = exp2(s - m), m/l are updated and the
// returned factors rescale the output accumulator. l stays a per-lane partial sum (reduced once at
// the end). A row that has seen only -inf keeps m = -inf and contributes p = 0, never NaN.
template <int NT>
__device__ __forceinline__ void online_softmax(float (&s)[NT][4], float (&m)[2], float (&l)[2], float (&alpha)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = m[h];
#pragma unroll
    for (int n = 0; n < NT; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * h], s[n][2 * h + 1]));
    mx = quad_max(mx);
    const float m_use = mx == -CUDART_INF_F ? 0.f : mx;
    alpha[h] = fast_exp2(m[h] - m_use);
    m[h] = mx;
    float sum = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      s[n][2 * h] = fast_exp2(s[n][2 * h] - m_use);
      s[n][2 * h + 1] = fast_exp2(s[n][2 * h + 1] - m_use);
      sum += s[n][2 * h] + s[n][2 * h + 1];
    }
    l[h] = l[h] * alpha[h] + sum;
  }
}

}  // namespace mma
}  // namespace cupyflash
