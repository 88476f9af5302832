// FlashAttention-2 backward on tensor cores (sm_80+, fp16/bf16; float32 as 3xTF32 in the key-major kernel), in three
// launches:
//   mma_bwd_delta:      Delta = rowsum(dO * O) per query row (and the dQ accumulator zeroed);
//   mma_flash_bwd:      one block per K_j/V_j tile of one (batch, kv head), looping over the group's
//                       query heads and their Q_i tiles; dK_j, dV_j stay in f32 registers, dQ goes
//                       out through f32 atomics (mma_flash_bwd2d: the same with a 2-D warp layout);
//   mma_bwd_dq_convert: dQ = scale * accumulator, in the output dtype and strides;
//   mma_bwd_kv_combine: float32 with query parts only (mma_bwd_tf32.cuh): dK, dV = the parts' partials summed.
//
// Main kernel, per (Q_i, K_j) pair, with the key-major products so P^T and dS^T are A fragments:
//   S^T  = K_j Q_i^T          P^T = exp2(S^T * scale*log2e - lse*log2e)
//   dV_j += P^T dO_i          dP^T = V_j dO_i^T        dS^T = P^T * (dP^T - Delta)
//   dK_j += dS^T Q_i          dQ_i += dS K_j           (scale applied once at the end)
// Warp w owns keys [16 (w % kKeyWarps), +16) of K_j and the d-slice w / kKeyWarps of dK_j/dV_j
// (kDSplit > 1 trades recomputing S^T/dP^T for registers at large head dims). dS^T goes
// through shared memory once so that dQ_i can be split over warps by query rows. kDPChunks > 1
// computes dP^T (and dS^T, dK_j) in query chunks so that large Br fits in 255 registers.
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"

using namespace cupyflash;
using namespace cupyflash::mma;

#include "mma_bwd_keymajor.cuh"
#include "mma_bwd_2d.cuh"

// Delta = rowsum(dO * O) in f32, kLanes lanes per query row (kLanes * kVec >= d: a 16-byte load of dO and of O per
// lane, kVec = 8 elements of a 16-bit type, 4 floats; 256 / kLanes rows a block); the row's dQ accumulator is zeroed
// too, and with attention sinks the rows' shares of dsinks are added (one atomic per block and head:
// add_dsinks_block). Measured at D = 64 (H100): a warp per
// row kept 24 of its 32 lanes idle and ran at half the copy bandwidth (176 us at B*H*N = 512k rows).
template <typename T, int kLanes>
__global__ void __launch_bounds__(256) mma_bwd_delta(const __grid_constant__ AttentionParams p) {
  static_assert(kLanes == 8 || kLanes == 16 || kLanes == 32, "a power-of-two share of a warp");
  constexpr int kRows = 256 / kLanes;
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));  // elements a 16-byte load
  const int sub = threadIdx.x % kLanes;
  const long long r = static_cast<long long>(blockIdx.x) * kRows + threadIdx.x / kLanes;
  const bool live = r < p.rows;
  const int nq = row_extent(p);  // varlen: the packed (Hq, total_q) rows, as one batch
  const int i = static_cast<int>(r % nq);
  const long long bh = r / nq;
  const int h = live ? static_cast<int>(bh % p.hq) : 0;
  const long long b = bh / p.hq;
  float sum = 0.f;
  if (live) {
    const T* dor = static_cast<const T*>(p.dout) + b * p.dout_s.b + h * p.dout_s.h + i * p.dout_s.n;
    const T* orow = static_cast<const T*>(p.o) + b * p.o_s.b + h * p.o_s.h + i * p.o_s.n;
    // 16-byte loads: d % 8 == 0, rows 16-byte aligned. float: one pass (kLanes * 4 >= d <= 128); unrolled, ptxas
    // kept this kernel at 32 registers with a spill.
    if constexpr (kVec == 4) {
#pragma unroll 1
      for (int c = sub * kVec; c < p.d; c += kLanes * kVec)
        sum = dot_vec16<T>(sum, *reinterpret_cast<const uint4*>(dor + c), *reinterpret_cast<const uint4*>(orow + c));
    } else {
      for (int c = sub * kVec; c < p.d; c += kLanes * kVec) {
        const uint4 x = *reinterpret_cast<const uint4*>(dor + c);
        const uint4 y = *reinterpret_cast<const uint4*>(orow + c);
        sum = dot_vec16<T>(sum, x, y);
      }
    }
  }
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
  if (p.dsinks != nullptr) {  // d sink_h = -sum over rows of P_sink * Delta, P_sink = exp(sink_h - lse)
    float share = 0.f;
    if (live) {
      const float l = p.lse[b * p.lse_s.b + h * p.lse_s.h + i * p.lse_s.n];
      if (l != -CUDART_INF_F) share = -__expf(p.sinks[h] - l) * sum;
    }
    add_dsinks_block<kRows>(p, h, share, threadIdx.x / kLanes, sub == 0);
  }
  if (!live) return;
  if (sub == 0) p.delta[r] = sum;
  float4* acc = reinterpret_cast<float4*>(p.dq_accum + r * p.d);
  for (int c = sub; c < p.d / 4; c += kLanes) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dQ = scale * accumulator, written in T with dq's strides; kLanes lanes per query row (256 / kLanes rows a block),
// four floats (one 16-byte load) a lane: twice the bytes in flight of a warp a row with 8-byte loads.
template <typename T, int kLanes>
__global__ void __launch_bounds__(256) mma_bwd_dq_convert(const __grid_constant__ AttentionParams p) {
  static_assert(kLanes == 8 || kLanes == 16 || kLanes == 32, "a power-of-two share of a warp");
  const long long r = static_cast<long long>(blockIdx.x) * (256 / kLanes) + threadIdx.x / kLanes;
  const int sub = threadIdx.x % kLanes;
  if (r >= p.rows) return;
  const int nq = row_extent(p);  // varlen: the packed (Hq, total_q) rows, as one batch
  const int i = static_cast<int>(r % nq);
  const long long bh = r / nq;
  const int h = static_cast<int>(bh % p.hq);
  const long long b = bh / p.hq;
  T* out = static_cast<T*>(p.dq) + b * p.dq_s.b + h * p.dq_s.h + i * p.dq_s.n;
  const float* acc = p.dq_accum + r * p.d;
  for (int c = sub * 4; c < p.d; c += kLanes * 4) {  // d % 8 == 0: whole float4s (the Delta kernel zeroed them so)
    const float4 x = *reinterpret_cast<const float4*>(acc + c);
    store2<T>(out + c, x.x * p.scale, x.y * p.scale);
    store2<T>(out + c + 2, x.z * p.scale, x.w * p.scale);
  }
}

// dK and dV of a float32 backward with query parts (mma_bwd_tf32.cuh's query_part): each key row's partials summed
// in part order (the same bits whatever order the main kernel's blocks ran in), written in T with dk's and dv's
// strides. kLanes lanes per (b, kv head, key) row, four floats (one 16-byte load) a lane and slab.
template <typename T, int kLanes>
__global__ void __launch_bounds__(256) mma_bwd_kv_combine(const __grid_constant__ AttentionParams p) {
  static_assert(kLanes == 8 || kLanes == 16 || kLanes == 32, "a power-of-two share of a warp");
  const long long rows = static_cast<long long>(p.batch) * p.hk * p.nk;
  const long long r = static_cast<long long>(blockIdx.x) * (256 / kLanes) + threadIdx.x / kLanes;
  if (r >= rows) return;
  const int sub = threadIdx.x % kLanes;
  const int key = static_cast<int>(r % p.nk);
  const long long bh = r / p.nk;
  const int h = static_cast<int>(bh % p.hk);
  const long long b = bh / p.hk;
  T* dk = static_cast<T*>(p.dk) + b * p.dk_s.b + h * p.dk_s.h + key * p.dk_s.n;
  T* dv = static_cast<T*>(p.dv) + b * p.dv_s.b + h * p.dv_s.h + key * p.dv_s.n;
  const long long slab = rows * p.d;
  const float* src = p.kv_part + r * p.d;
  for (int c = sub * 4; c < p.d; c += kLanes * 4) {  // d % 8 == 0: whole float4s
    float4 k = *reinterpret_cast<const float4*>(src + c);
    float4 v = *reinterpret_cast<const float4*>(src + slab + c);
    for (int part = 1; part < p.q_parts; ++part) {
      const float4 kp = *reinterpret_cast<const float4*>(src + 2 * part * slab + c);
      const float4 vp = *reinterpret_cast<const float4*>(src + (2 * part + 1) * slab + c);
      k = make_float4(k.x + kp.x, k.y + kp.y, k.z + kp.z, k.w + kp.w);
      v = make_float4(v.x + vp.x, v.y + vp.y, v.z + vp.z, v.w + vp.w);
    }
    store2<T>(dk + c, k.x, k.y);
    store2<T>(dk + c + 2, k.z, k.w);
    store2<T>(dv + c, v.x, v.y);
    store2<T>(dv + c + 2, v.z, v.w);
  }
}
