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

// Key tiles of Bc that a query tile [q0, q0 + Br) needs: all of them, or under causal those up to the
// diagonal (0 when no row sees a key). causal_offset = nk - nq.
__device__ __forceinline__ int key_tiles_needed(int nq, int nk, int q0, int Br, int Bc, bool causal,
                                                int causal_offset) {
  int n_tiles = (nk + Bc - 1) / Bc;
  if (causal) {
    const int keys = min(q0 + Br, nq) + causal_offset;  // one past the last key any row sees
    n_tiles = keys <= 0 ? 0 : min(n_tiles, (keys + Bc - 1) / Bc);
  }
  return n_tiles;
}

// The first of m_tiles query tiles of Br that sees any key of the key tile starting at j0: 0, or under
// causal the tile of the first query on or below the diagonal (m_tiles when none is).
__device__ __forceinline__ int first_query_tile(int j0, int Br, int m_tiles, bool causal, int causal_offset) {
  int m_start = 0;
  if (causal) {
    const int first_query = j0 - causal_offset;
    m_start = first_query <= 0 ? 0 : min(first_query / Br, m_tiles);
  }
  return m_start;
}

// The backward's P^T = exp2(S^T * c - lse * log2 e) on a key-major strip: column n8 tile n, pair
// 2t, 2t+1 of this lane takes lse_cols[8n], [8n + 1] (the lane's query pair; lse in natural log).
// A query that saw no key (lse = -inf) gets P = 0 even where its scores are -inf.
template <int NT>
__device__ __forceinline__ void probs_from_lse(float (&s)[NT][4], float c, const float* lse_cols) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const float2 ls = *reinterpret_cast<const float2*>(lse_cols + n * 8);
    const float2 l2 = make_float2(ls.x == -CUDART_INF_F ? CUDART_INF_F : ls.x * kLog2e,
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

}  // namespace mma
}  // namespace cupyflash
