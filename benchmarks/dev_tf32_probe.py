"""GPU probe of cuda_src/mma_tf32.cuh (3xTF32 fragments): S = Q K^T with both operands through ldmatrix on
float tiles, then O = S V with S as the register A operand (permuted k) and V through ld_kpair_tf32.

    python benchmarks/dev_tf32_probe.py      # prints the relative errors against float64
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from cupyflash.kernels.build import compile_options

BODY = r'''
#include "mma_tf32.cuh"
using namespace cupyflash::mma;
constexpr int D = 64, N = 64;  // Q: 16 x D, K and V: N x D
extern "C" __global__ void probe(const float* q, const float* k, const float* v, float* s_out, float* o_out) {
  __shared__ __align__(128) unsigned char sm[(16 + 2 * N) * D * 4];
  using F = FloatTile<D>;
  const uint32_t sQ = smem_u32(sm), sK = sQ + 16 * F::kPitchBytes, sV = sK + N * F::kPitchBytes;
  unsigned char* raw = sm;
  for (int e = threadIdx.x; e < 16 * D; e += 32)
    *reinterpret_cast<float*>(raw + F::byte_of(e / D, e % D)) = q[e];
  for (int e = threadIdx.x; e < N * D; e += 32) {
    *reinterpret_cast<float*>(raw + 16 * F::kPitchBytes + F::byte_of(e / D, e % D)) = k[e];
    *reinterpret_cast<float*>(raw + (16 + N) * F::kPitchBytes + F::byte_of(e / D, e % D)) = v[e];
  }
  __syncthreads();
  const int lane = threadIdx.x;
  const LdmRows<2 * D> q_rows(lane & 15, lane >> 4);
  const LdmRows<2 * D> k_rows((lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);
  float s[N / 8][4] = {};
  for (int ks = 0; ks < D / 8; ++ks) {
    uint32_t a[4], ah[4], al[4];
    ldmatrix_x4(a, q_rows.at(sQ, ks));
    split_frag(ah, al, a);
    for (int n2 = 0; n2 < N / 16; ++n2) {
      uint32_t b[4], bh[4], bl[4];
      ldmatrix_x4(b, k_rows.at(sK, ks, n2 * 16));
      split_frag(bh, bl, b);
      mma_3xtf32(s[2 * n2], ah, al, Tf32Pair{bh[0], bl[0]}, Tf32Pair{bh[1], bl[1]});
      mma_3xtf32(s[2 * n2 + 1], ah, al, Tf32Pair{bh[2], bl[2]}, Tf32Pair{bh[3], bl[3]});
    }
  }
  const int g = lane / 4, t = lane % 4;
  for (int n = 0; n < N / 8; ++n) {
    s_out[g * N + n * 8 + 2 * t] = s[n][0];
    s_out[g * N + n * 8 + 2 * t + 1] = s[n][1];
    s_out[(g + 8) * N + n * 8 + 2 * t] = s[n][2];
    s_out[(g + 8) * N + n * 8 + 2 * t + 1] = s[n][3];
  }
  float o[D / 8][4] = {};
  for (int kk = 0; kk < N / 8; ++kk) {
    uint32_t ah[4], al[4];
    pack_a_tf32(ah, al, s, kk);
    for (int n = 0; n < D / 8; ++n) {
      Tf32Pair b0, b1;
      ld_kpair_tf32<D>(b0, b1, sV, kk * 8, n * 8);
      mma_3xtf32(o[n], ah, al, b0, b1);
    }
  }
  for (int n = 0; n < D / 8; ++n) {
    o_out[g * D + n * 8 + 2 * t] = o[n][0];
    o_out[g * D + n * 8 + 2 * t + 1] = o[n][1];
    o_out[(g + 8) * D + n * 8 + 2 * t] = o[n][2];
    o_out[(g + 8) * D + n * 8 + 2 * t + 1] = o[n][3];
  }
}
'''


def main() -> None:
    mod = cp.RawModule(code=BODY, options=compile_options(), backend="nvrtc")
    f = mod.get_function("probe")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((16, 64), (64, 64), (64, 64)))
    s_out = cp.full((16, 64), cp.nan, cp.float32)
    o_out = cp.full((16, 64), cp.nan, cp.float32)
    f((1,), (32,), (cp.asarray(q), cp.asarray(k), cp.asarray(v), s_out, o_out))
    s_ref = q.astype(np.float64) @ k.T.astype(np.float64)
    s_got = s_out.get()
    o_ref = s_got.astype(np.float64) @ v.astype(np.float64)
    o_got = o_out.get()
    rel = lambda x, r: float(np.linalg.norm(x - r) / np.linalg.norm(r))
    naive_s = q @ k.T  # float32 on the CPU, for scale
    print(f"S = Q K^T: rel err {rel(s_got, s_ref):.2e} (float32 matmul {rel(naive_s, s_ref):.2e}), "
          f"max abs {np.abs(s_got - s_ref).max():.2e}")
    print(f"O = S V:   rel err {rel(o_got, o_ref):.2e} (float32 matmul {rel(s_got @ v, o_ref):.2e})")
    assert rel(s_got, s_ref) < 1e-6 and rel(o_got, o_ref) < 1e-6, "3xTF32 layout or accuracy wrong"
    print("ok")


if __name__ == "__main__":
    main()
