// Linear attention with an arbitrary mask: tiled O(Nq Nk D) work, W streamed tile by tile.
//
//   O = scale * (W o (X Y^T)) Z,   W[qi][kj] = mask[b, h, qi, kj] * [kj <= qi + off] * lambda^(qi + off - kj)
//
// The mask arrives as a float32 pointer plus four element strides (b, h, i, j); a broadcast dim
// has stride 0, so the broadcast is never materialised. Nothing N x N is written, except the
// mask gradient when DMASK is set:
//   dmask[b, h, i, j] += scale * (q_i . k_j) (do_i . v_j) * [causal] * lambda^(...)
// accumulated with atomics through the *mask's* strides: every (b, h, i, j) that a broadcast
// mask maps to one element adds into that element, which is exactly the sum over broadcast dims.
//
// rev = 0 (o, dq): each block owns 64 query rows and walks the key tiles (X = Q or dO,
// Y = K or V, Z = V or K), skipping key tiles past the last causal position.
// rev = 1 (dk, dv): each block owns 64 key rows of one kv head and walks the query tiles of
// every query head in its GQA group (X = V or K, Y = dO or Q, Z = Q or dO; W transposed).
// The tile products are the chunked kernels' (tile_scores, put_p, tile_pv in linear_chunked.cu).
#include "linear_chunked.cu"

// Grid: x = (b * Hout + ho) * ntiles + t, y = DV-column block.
template <typename T, int DV, bool TC, bool DMASK>
__global__ void __launch_bounds__(kThreads, 2) linear_masked(
    const T* __restrict__ X, long long xsb, long long xsh, long long xsn, const T* __restrict__ Y, long long ysb,
    long long ysh, long long ysn, const T* __restrict__ Z, long long zsb, long long zsh, long long zsn,
    T* __restrict__ O, long long osb, long long osh, long long osn, const float* __restrict__ M, long long msb,
    long long msh, long long msi, long long msj, int has_mask, const T* __restrict__ Q, long long qsb,
    long long qsh, long long qsn, const T* __restrict__ K, long long ksb, long long ksh, long long ksn,
    float* __restrict__ dM, long long dmsb, long long dmsh, long long dmsi, long long dmsj,
    const float* __restrict__ decay, int has_decay, int Hout, int Hq, int group, int nq, int nk, int ntiles, int D,
    int off, int causal, int rev, float scale) {
  __shared__ __align__(16) Smem<DV> sm;
  const int bo = blockIdx.x / ntiles, t = blockIdx.x % ntiles;
  const int b = bo / Hout, ho = bo % Hout;
  const int col0 = blockIdx.y * DV;
  const int row0 = t * kChunk;
  const int nx = rev ? nk : nq, npart = rev ? nq : nk;
  const T* Xb = X + b * xsb + ho * xsh;
  Tile<DV, TC> acc;
  acc.zero();
  const int G = rev ? group : 1;
  for (int g = 0; g < G; ++g) {
    const int hq = rev ? ho * group + g : ho;
    const int hyz = rev ? hq : ho / group;
    const float lg = has_decay ? log2f(decay[hq]) : 0.f;
    const T* Yb = Y + b * ysb + hyz * ysh;
    const T* Zb = Z + b * zsb + hyz * zsh;
    const float* Mb = M + b * msb + hq * msh;
    // W[r][s] of this block's tile pair, or 0 outside the problem; the mask is read only inside.
    auto weight_cd = [&](int p0, int r, int sc, int& qi, int& kj) -> float {
      qi = rev ? p0 + sc : row0 + r;
      kj = rev ? row0 + r : p0 + sc;
      if (qi >= nq || kj >= nk) return 0.f;
      const int dist = qi + off - kj;
      if (causal && dist < 0) return 0.f;
      return has_decay ? decay_pow(lg, dist) : 1.f;
    };
    for (int p0 = 0; p0 < npart; p0 += kChunk) {
      if (causal && !rev && p0 > row0 + kChunk - 1 + off) break;  // every later key tile is masked too
      if (causal && rev && p0 + kChunk - 1 + off < row0) continue;  // these queries precede every key
      Tile<64, TC> s;
      tile_scores<T, DV, TC>(s, sm, Xb, xsn, row0, nx, Yb, ysn, p0, npart, D);
      if constexpr (DMASK) {
        if (!rev && blockIdx.y == 0) {
          Tile<64, TC> qk;
          tile_scores<T, DV, TC>(qk, sm, Q + b * qsb + ho * qsh, qsn, row0, nq, K + b * ksb + hyz * ksh, ksn, p0, nk,
                                 D);
          float* dMb = dM + b * dmsb + hq * dmsh;
#pragma unroll
          for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < Tile<64, TC>::TN; ++j) {
              int qi, kj;
              const float w = weight_cd(p0, Tile<64, TC>::row(i, j), Tile<64, TC>::col(i, j), qi, kj);
              if (w != 0.f) atomicAdd(dMb + qi * dmsi + kj * dmsj, scale * w * qk.v[i][j] * s.v[i][j]);
            }
        }
      }
      put_p<DV, TC>(
          sm, s,
          [&](int r, int sc) {
            int qi, kj;
            const float w = weight_cd(p0, r, sc, qi, kj);
            if (w == 0.f) return 0.f;
            return has_mask ? scale * w * Mb[qi * msi + kj * msj] : scale * w;
          });
      __syncthreads();
      tile_pv<T, DV, TC>(acc, sm, Zb, zsn, p0, npart, col0, D);
    }
  }
  store_tile<T, DV, TC>(O + b * osb + ho * osh, osn, row0, nx, col0, D, acc);
}
