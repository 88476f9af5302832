// Linear attention, fused chunk walk on 16-bit tensor cores (sm_80+): one block per (batch, output
// head, DV-column block) walks the chunks of C = 64 positions in order and keeps the running state
// in registers, so no per-chunk state ever reaches global memory (fla's "fused_chunk" form).
//
// Every pass of the forward and the backward is one product shape:
//   O_c = scale [ (X_c Y_c^T o W) Z_c + diag(b) X_c S_c ],   S_next = lambda^C S_c + Y_c^T diag(a) Z_c
// with the state S = Y^T Z (D x DV, float32 in registers, 16-bit in shared memory for the mma):
//   o : X = Q,  Y = K,  Z = V   (forward walk, W_rs = [s <= r] lambda^(r-s), b_r = lambda^r, a_s = lambda^(C-s))
//   dq: X = dO, Y = V,  Z = K   (same walk; the state V^T K is S^T of the forward)
//   dk: X = V,  Y = dO, Z = Q   (reverse walk, W_rs = [s >= r] lambda^(s-r), b_r = lambda^(C-1-r),
//   dv: X = K,  Y = Q,  Z = dO   a_s = lambda^(s+1)); the reverse state dO^T Q (dk) or Q^T dO (dv)
// Positions: chunk c covers key positions cC .. cC + C - 1; query rows sit at position - (Nk - Nq).
// Under GQA the reverse passes sum the group's query heads: one walk per head, partial sums in a
// float32 scratch that only this block touches (no atomics; the last head writes the output).
// Non-causal: a first walk sums the whole state over Y/Z, a second emits X S (no intra tile).
//
// Tiles: 4 warps, warp w owns rows 16w .. 16w + 15 of the chunk's outputs and rows w DK/4 .. of
// the state. mma.sync m16n8k16 (f32 accumulate) fed by ldmatrix from padded 16-bit tiles that
// cp.async fills STAGES chunks ahead; P = X Y^T o W stays in registers as the A operand of P Z
// (as in FlashAttention-2). Rows whose starts are not 16-byte aligned take plain loads instead.
#pragma once
#include "common.cuh"
#include "mma_primitives.cuh"

namespace cupyflash {
namespace linear_fused {

// ldmatrix, mma.sync, cp.async and 16-bit packing: the attention kernels' building blocks.
using namespace cupyflash::mma;

constexpr int kThreads = 128;
constexpr int kC = 64;  // chunk length
constexpr int kPowers = 68;  // floats of the decay table lambda^0 .. lambda^C, padded to 16 bytes
static_assert(kPowers > kC && kPowers % 4 == 0, "plans/linear.py POWER_BYTES = 4 * kPowers");

// lambda^e from lg = log2(lambda); e == 0 is exactly 1 even when lambda^1 underflows.
__device__ __forceinline__ float dpow(float lg, int e) { return e == 0 ? 1.f : exp2f(lg * float(e)); }

// Rows row0 .. row0 + 63 (those outside [0, nrows) as zeros) and columns col0 .. col0 + COLS - 1
// (those >= ncols as zeros) of a row-major matrix into a [64][PITCH] tile. vec: every row starts
// on 16 bytes, so cp.async moves 8 elements at a time; else plain loads (visible after a sync).
// A whole tile in range (most chunks) takes the short path: each thread owns one 8-column segment
// and walks rows 128 / SEG apart, with no per-element index arithmetic or bounds checks.
template <typename T, int COLS, int PITCH>
__device__ __forceinline__ void load_tile(T* dst, const T* src, long long ld, int row0, int nrows, int col0,
                                          int ncols, bool vec) {
  constexpr int SEG = COLS / 8;
  static_assert(kThreads % SEG == 0, "a thread's segment column stays fixed across its rows");
  if (vec && row0 >= 0 && row0 + kC <= nrows && col0 + COLS <= ncols) {
    constexpr int RSTEP = kThreads / SEG;
    const int r = threadIdx.x / SEG, c = 8 * (threadIdx.x % SEG);
    const T* g = src + (long long)(row0 + r) * ld + col0 + c;
    const uint32_t d = smem_u32(dst + r * PITCH + c);
#pragma unroll
    for (int j = 0; j < kC / RSTEP; ++j) cp_async_16(d + 2 * j * RSTEP * PITCH, g + j * RSTEP * ld, 16);
  } else if (vec) {
#pragma unroll 1
    for (int i = threadIdx.x; i < kC * SEG; i += kThreads) {
      const int r = i / SEG, c = 8 * (i % SEG);
      const int gr = row0 + r, gc = col0 + c;
      const int n = (gr >= 0 && gr < nrows) ? min(max(ncols - gc, 0), 8) : 0;
      cp_async_16(smem_u32(dst + r * PITCH + c), n ? src + (long long)gr * ld + gc : src, 2 * n);
    }
  } else {
    for (int i = threadIdx.x; i < kC * COLS; i += kThreads) {
      const int r = i / COLS, c = i % COLS;
      const int gr = row0 + r, gc = col0 + c;
      dst[r * PITCH + c] = (gr >= 0 && gr < nrows && gc < ncols) ? src[(long long)gr * ld + gc] : from_float<T>(0.f);
    }
  }
}

// Where step s of a block's walk reads and what it does.
struct Step {
  int g;                // query head of the GQA group (reverse passes), else 0
  int xrow0, yrow0;     // first X row, first Y/Z row (may be negative: zero rows)
  bool out, upd;        // emit outputs / add Y^T diag(a) Z into the state
  bool intra, inter;    // the chunk's own tile / X S_c
  bool first;           // first step of a walk: the state starts at zero
};

// Causal walks cover steps l0 .. l0 + per_g - 1 of the whole walk (a segment, see the kernel).
__device__ __forceinline__ Step step_of(int s, int per_g, int l0, int nck, int nyc, int off, bool causal, bool rev,
                                        bool state_only) {
  Step st;
  st.g = s / per_g;
  st.first = s % per_g == 0;
  if (causal) {
    const int l = l0 + s % per_g;
    const int c = rev ? nck - 1 - l : l;
    st.xrow0 = c * kC - (rev ? 0 : off);
    st.yrow0 = c * kC - (rev ? off : 0);
    st.upd = true;
    st.out = st.intra = !state_only;
    st.inter = st.out && l > 0;
  } else {
    const int l = s % per_g;
    const bool ph1 = l < nyc;
    st.yrow0 = l * kC;
    st.xrow0 = (l - nyc) * kC;
    st.upd = ph1;
    st.out = st.inter = !ph1;
    st.intra = false;
  }
  return st;
}

}  // namespace linear_fused
}  // namespace cupyflash

using namespace cupyflash::linear_fused;

// The walk; STATE (linear_fused_state) keeps only the state update: no X, no outputs, no Ss.
// Grid: x = b * Hout + ho, y = DV-column block, z = segment (walk) or U slot (state); 128 threads;
// dynamic shared memory (fused_shared_bytes / fused_state_bytes in plans/linear.py)
//   walk:  STAGES * (2 * 64 * (DK + 8) + 64 * (DV + 8)) + DK * (DV + 8) elements of T,
//   state: STAGES * (64 * (DK + 8) + 64 * (DV + 8)),
// then kPowers floats (the decay table).
// Segments (causal only) split a walk of n chunks into runs of seg_len chunks so that small batches
// still fill the GPU. The state kernel first writes the own sums of runs of sub_len chunks (sub_len
// divides seg_len; many short runs fill the GPU better than one per segment):
//   U_q = sum over chunks of slot q of the decayed Y^T diag(a) Z;
// the walk of segment p then starts from S = sum_{q < Q} lambda^(C sub_len (Q - 1 - q)) U_q,
// Q = p seg_len / sub_len, instead of 0.
// U: float32 (B, Hq, nslot, gridDim.y, DK * DV) in the accumulator's register order.
// rev = 0: Hout = Hq, X of head ho, Y/Z of kv head ho / group. rev = 1: Hout = Hk, X of kv head ho,
// Y/Z of query heads ho * group + g, summed over g (scratch: float32 (B, Hout, nx, D), group > 1).
#define LINEAR_FUSED_PARAMS                                                                                          \
  const T *__restrict__ X, long long xsb, long long xsh, long long xsn, const T *__restrict__ Y, long long ysb,      \
      long long ysh, long long ysn, const T *__restrict__ Z, long long zsb, long long zsh, long long zsn,            \
      T *__restrict__ O, long long osb, long long osh, long long osn, float *__restrict__ scratch,                    \
      float *__restrict__ U, const float *__restrict__ decay, int has_decay, int Hout, int group, int nx, int nyz,   \
      int D, int off, int causal, int rev, int vec, int nslot, int seg_len, int sub_len, float scale
#define LINEAR_FUSED_ARGS                                                                                            \
  X, xsb, xsh, xsn, Y, ysb, ysh, ysn, Z, zsb, zsh, zsn, O, osb, osh, osn, scratch, U, decay, has_decay, Hout, group, \
      nx, nyz, D, off, causal, rev, vec, nslot, seg_len, sub_len, scale

template <typename T, int DK, int DV, int STAGES, bool STATE>
__device__ __forceinline__ void fused_walk(LINEAR_FUSED_PARAMS) {
  static_assert(DK % 64 == 0 && DV % 16 == 0, "the state splits into 4 warps x 16-row tiles, DV into n8 pairs");
  constexpr int XP = DK + 8, ZP = DV + 8;  // pitches: 8 rows of one ldmatrix fall in 8 bank groups
  constexpr int XT = STATE ? 0 : kC * XP;  // the X tile (none in the state kernel)
  constexpr int TILE = XT + kC * XP + kC * ZP;
  constexpr int NT = DV / 8;   // n8 tiles of an output row block / of a state row block
  constexpr int MT = DK / 64;  // m16 tiles of the state per warp
  constexpr int KU = DK >= 256 ? 1 : 2;  // unroll of the pass over D (DK = 256 would spill on sm_80)
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const ring = reinterpret_cast<T*>(smem_raw);
  T* const Ss = ring + STAGES * TILE;  // S_c as the B operand of X S, [DK][ZP] (walk only)
  // lambda^e, e = 0 .. C, of the walk's current head: every decay factor of a step is one of them
  float* const pw = reinterpret_cast<float*>(STATE ? Ss : Ss + DK * ZP);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
  const int b = blockIdx.x / Hout, ho = blockIdx.x % Hout;
  const int col0 = blockIdx.y * DV;
  const int G = rev ? group : 1;
  // causal: chunks of key positions (keys are the X rows of the reverse passes, else the Y/Z rows)
  const int nchunks = causal ? (((rev ? nx : nyz) + kC - 1) / kC) : 0;
  const int nyc = (nyz + kC - 1) / kC, nxc = (nx + kC - 1) / kC;
  const int l0 = causal ? blockIdx.z * (STATE ? sub_len : seg_len) : 0;
  const int run = STATE ? sub_len : seg_len;
  const int per_g = causal ? min(run, nchunks - l0) : nyc + nxc;
  const int total = G * per_g;

  const T* const Xb = X + b * xsb + ho * xsh;
  auto yz_head = [&](int g) { return rev ? ho * group + g : ho / group; };

  auto issue = [&](int s) {
    if (s < total) {
      const Step st = step_of(s, per_g, l0, nchunks, nyc, off, causal, rev, STATE);
      T* buf = ring + (s % STAGES) * TILE;
      const int hyz = yz_head(st.g);
      if (!STATE && st.out) load_tile<T, DK, XP>(buf, Xb, xsn, st.xrow0, nx, 0, D, vec);
      if (st.intra || st.upd) {
        load_tile<T, DK, XP>(buf + XT, Y + b * ysb + hyz * ysh, ysn, st.yrow0, nyz, 0, D, vec);
        load_tile<T, DV, ZP>(buf + XT + kC * XP, Z + b * zsb + hyz * zsh, zsn, st.yrow0, nyz, col0, D, vec);
      }
    }
    cp_async_commit();  // empty groups keep the wait count uniform
  };

  // Per-lane ldmatrix offsets (bytes). A of X (rows m, cols k); B of Y (rows n, cols k) and A of
  // Y^T share one pattern; B of S / Z (rows k, cols n) is the transposed load.
  const uint32_t off_a = 2 * ((16 * warp + lane % 8 + 8 * ((lane / 8) % 2)) * XP + 8 * (lane / 16));
  const uint32_t off_y = 2 * ((lane % 8 + 8 * (lane / 16)) * XP + 8 * ((lane / 8) % 2));
  const uint32_t off_t = 2 * ((lane % 8 + 8 * ((lane / 8) % 2)) * ZP + 8 * (lane / 16));
  const uint32_t s_base = smem_u32(Ss);

  float S[MT][NT][4];  // this warp's rows of the running state (float32)
  auto store_state = [&]() {  // S as the 16-bit B operand of the next X S
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int d = warp * (DK / 4) + 16 * m + gq, c = 8 * n + 2 * tq;
        *reinterpret_cast<uint32_t*>(Ss + d * ZP + c) = pack2<T>(S[m][n][0], S[m][n][1]);
        *reinterpret_cast<uint32_t*>(Ss + (d + 8) * ZP + c) = pack2<T>(S[m][n][2], S[m][n][3]);
      }
  };
  const int Hq = rev ? Hout * group : Hout;
  // this block's part of U slot q for decay head hq (thread-private register order)
  auto u_slot = [&](int hq, int q) {
    return U + (((long long)(b * Hq + hq) * nslot + q) * gridDim.y + blockIdx.y) * (DK * DV) + threadIdx.x;
  };

  // A later segment (G == 1 then: the launcher splits no GQA reverse pass) starts from the
  // decayed sum of the own sums of the slots before it.
  const bool seg0 = STATE || !(causal && l0 > 0);
  if (!seg0) {
    const float f = (has_decay) ? dpow(log2f(decay[ho]), kC * sub_len) : 1.f;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[m][n][e] = 0.f;
#pragma unroll 2
    for (int q = 0; q < l0 / sub_len; ++q) {  // unrolled so that one slot's loads overlap the last one's FMAs
      const float* u = u_slot(ho, q);
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) S[m][n][e] = fmaf(S[m][n][e], f, u[((m * NT + n) * 4 + e) * kThreads]);
    }
    store_state();  // visible after the first step's sync
  }
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  for (int s = 0; s < total; ++s) {
    issue(s + STAGES - 1);
    const Step st = step_of(s, per_g, l0, nchunks, nyc, off, causal, rev, STATE);
    const bool dec = causal && has_decay;
    if (dec && st.first) {  // a new head: its powers, visible after the sync (the last reads were before one)
      const float lg = log2f(decay[rev ? ho * group + st.g : ho]);
      for (int e = threadIdx.x; e <= kC; e += kThreads) pw[e] = dpow(lg, e);
    }
    cp_async_wait<STAGES - 1>();
    __syncthreads();
    const uint32_t xs = smem_u32(ring + (s % STAGES) * TILE), ys = xs + 2 * XT, zs = ys + 2 * kC * XP;
    if (st.first) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) S[m][n][e] = seg0 ? 0.f : S[m][n][e];
    }

    float acc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    uint32_t P[4][4];  // the weighted scores as A fragments of P Z (k = chunk rows, 16 per step)

    if (!STATE && st.out) {
      float sc[8][4];
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[n][e] = 0.f;
      // One pass over D feeds both X Y^T (intra) and X S_c (inter) from the same X fragments.
#pragma unroll KU
      for (int k0 = 0; k0 < DK; k0 += 16) {
        uint32_t a[4];
        ldmatrix_x4(a, xs + off_a + 2 * k0);
        if (st.intra) {
#pragma unroll
          for (int np = 0; np < 4; ++np) {
            uint32_t bf[4];
            ldmatrix_x4(bf, ys + off_y + 2 * (np * 16 * XP + k0));
            mma_16816<T>(sc[2 * np], a, bf[0], bf[1]);
            mma_16816<T>(sc[2 * np + 1], a, bf[2], bf[3]);
          }
        }
        if (st.inter) {
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            uint32_t bf[4];
            ldmatrix_x4_trans(bf, s_base + off_t + 2 * (k0 * ZP + np * 16));
            mma_16816<T>(acc[2 * np], a, bf[0], bf[1]);
            mma_16816<T>(acc[2 * np + 1], a, bf[2], bf[3]);
          }
        }
      }
      if (st.inter && dec) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 16 * warp + gq + 8 * h;
          const float f = pw[rev ? kC - 1 - r : r];
#pragma unroll
          for (int n = 0; n < NT; ++n) {
            acc[n][2 * h] *= f;
            acc[n][2 * h + 1] *= f;
          }
        }
      }
      if (st.intra) {
#pragma unroll
        for (int n = 0; n < 8; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = 16 * warp + gq + 8 * (e / 2), c = 8 * n + 2 * tq + (e % 2);
            const int dist = rev ? c - r : r - c;
            sc[n][e] = dist < 0 ? 0.f : (dec ? sc[n][e] * pw[dist] : sc[n][e]);
          }
        pack_a<T>(P, sc);
      }
    }

    if (st.upd && dec) {
      const float f = pw[kC];
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) S[m][n][e] *= f;
    }
    // Over the chunk's rows k: acc += P Z (intra) and S += Y^T diag(a) Z share the Z fragments.
    if (st.intra || st.upd) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t zf[NT / 2][4];
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) ldmatrix_x4_trans(zf[np], zs + off_t + 2 * (16 * kk * ZP + np * 16));
        if (!STATE && st.intra) {
#pragma unroll
          for (int np = 0; np < NT / 2; ++np) {
            mma_16816<T>(acc[2 * np], P[kk], zf[np][0], zf[np][1]);
            mma_16816<T>(acc[2 * np + 1], P[kk], zf[np][2], zf[np][3]);
          }
        }
        if (st.upd) {
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            uint32_t a[4];
            ldmatrix_x4_trans(a, ys + off_y + 2 * (16 * kk * XP + warp * (DK / 4) + 16 * m));
            if (dec) {
              // a_s on the k index: registers 0, 1 hold rows 2t, 2t + 1; registers 2, 3 rows + 8
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int s0 = 16 * kk + 2 * tq + 8 * h;
                const float f0 = pw[rev ? s0 + 1 : kC - s0];
                const float f1 = pw[rev ? s0 + 2 : kC - s0 - 1];
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                  const float2 v = unpack2<T>(a[2 * h + j]);
                  a[2 * h + j] = pack2<T>(v.x * f0, v.y * f1);
                }
              }
            }
#pragma unroll
            for (int np = 0; np < NT / 2; ++np) {
              mma_16816<T>(S[m][2 * np], a, zf[np][0], zf[np][1]);
              mma_16816<T>(S[m][2 * np + 1], a, zf[np][2], zf[np][3]);
            }
          }
        }
      }
    }

    if (!STATE && st.out) {
      // Output rows of this warp; under GQA (reverse) the first heads park float partial sums.
      T* const Ob = O + b * osb + ho * osh;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = st.xrow0 + 16 * warp + gq + 8 * h;
        if (row < 0 || row >= nx) continue;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const int col = col0 + 8 * n + 2 * tq;
          if (col >= D) continue;
          float v0 = scale * acc[n][2 * h], v1 = scale * acc[n][2 * h + 1];
          const bool two = col + 1 < D;
          if (G > 1) {
            float* sp = scratch + (((long long)b * Hout + ho) * nx + row) * D + col;
            if (st.g > 0) {
              v0 += sp[0];
              if (two) v1 += sp[1];
            }
            if (st.g < G - 1) {
              sp[0] = v0;
              if (two) sp[1] = v1;
              continue;
            }
          }
          T* op = Ob + (long long)row * osn + col;
          if (two && vec) {
            *reinterpret_cast<uint32_t*>(op) = pack2<T>(v0, v1);
          } else {
            op[0] = cupyflash::from_float<T>(v0);
            if (two) op[1] = cupyflash::from_float<T>(v1);
          }
        }
      }
    }
    __syncthreads();  // every read of this stage's tiles and of Ss is done
    if (!STATE && st.upd) store_state();
  }
  cp_async_wait<0>();
  if (STATE) {
    float* u = u_slot(ho, blockIdx.z);
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) u[((m * NT + n) * 4 + e) * kThreads] = S[m][n][e];
  }
}

// min blocks 1: without it NVRTC 13.0's ptxas capped DK = 128, DV = 16 at 128 registers on sm_90a and spilled.
template <typename T, int DK, int DV, int STAGES>
__global__ void __launch_bounds__(kThreads, 1) linear_fused_walk(LINEAR_FUSED_PARAMS) {
  fused_walk<T, DK, DV, STAGES, false>(LINEAR_FUSED_ARGS);
}

// The state-only kernel holds no scores, outputs or X tiles: it fits 168 registers and about half
// the shared memory, so three of its blocks share an SM where two walk blocks do.
template <typename T, int DK, int DV, int STAGES>
__global__ void __launch_bounds__(kThreads, 3) linear_fused_state(LINEAR_FUSED_PARAMS) {
  fused_walk<T, DK, DV, STAGES, true>(LINEAR_FUSED_ARGS);
}
