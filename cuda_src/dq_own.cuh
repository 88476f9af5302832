// A backward block that owns its queries' dQ (issue 12: a small backward in one launch).
//
// The tensor-core backward is three launches: Delta = rowsum(dO * O) (mma_bwd_delta), the main kernel adding
// dS K_j into an f32 dQ accumulator, and the conversion of that accumulator (mma_bwd_dq_convert). When one
// key tile of the main kernel covers every key of a (batch, kv head) (Nk <= Bc, dense), one block visits every
// query row of its kv head's group of query heads, and no other block touches those rows. Instantiated with
// kOwnDQ, the main kernel then does the helpers' work itself: own_rows() before its loop (Delta, each row's
// share of dsinks, and dQ = 0 on the rows its loop will not visit), and each step stores scale * dS K_j in
// dq's dtype and strides instead of adding it. For a tiny call that saves two launches of host time; with no
// adds whose order could vary, it is deterministic as it stands.
#pragma once
#include "attention_params.cuh"
#include "common.cuh"
#include "mma_primitives.cuh"  // store2

namespace cupyflash {

// sum + the dot product of two 16-byte vectors of T as loaded (uint4: 8 elements of a 16-bit type, 4 floats), in
// element order. Floats are read as the words themselves: through a pointer, as the 16-bit types are, the vectors
// of a float kernel went to the stack.
template <typename T>
__device__ __forceinline__ float dot_vec16(float sum, const uint4& x, const uint4& y) {
  if constexpr (sizeof(T) == 4) {
    sum += __uint_as_float(x.x) * __uint_as_float(y.x);
    sum += __uint_as_float(x.y) * __uint_as_float(y.y);
    sum += __uint_as_float(x.z) * __uint_as_float(y.z);
    sum += __uint_as_float(x.w) * __uint_as_float(y.w);
  } else {
    const T* xs = reinterpret_cast<const T*>(&x);
    const T* ys = reinterpret_cast<const T*>(&y);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += to_float<T>(xs[e]) * to_float<T>(ys[e]);
  }
  return sum;
}

// The smallest power of two >= x (threads per row below: one 16-byte chunk each).
__host__ __device__ constexpr int pow2_at_least(int x) { return x <= 1 ? 1 : 2 * pow2_at_least((x + 1) / 2); }

// For query heads [h0, h0 + nh) of batch b, every row i < nq: Delta_i into the scratch (and, with attention
// sinks, the row's share -P_sink,i * Delta_i of dsinks, summed per thread and head before its atomic), and
// dQ_i = 0 where i is outside [q_begin, q_end), the rows the block's loop stores. kPer threads per row (a
// power of two dividing 32), each one 16-byte chunk of dO and O (kVec elements: 8 of a 16-bit type, 4 floats; the
// tensor-core families' rows: d % 8 == 0, 16-byte aligned), so a pass reads kThreads / kPer rows with independent
// loads. The caller fences and syncs before reading Delta.
template <typename T, int D, int kThreads>
__device__ void own_rows(const AttentionParams& p, int b, int h0, int nh, int q_begin, int q_end) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kPer = pow2_at_least(D / kVec);
  static_assert(kPer <= 32 && kThreads % kPer == 0, "a row's threads sit in one warp");
  constexpr int kRows = kThreads / kPer;
  const int sub = threadIdx.x % kPer;
  const int c = sub * kVec;
  const int nq = p.nq, rows = nh * nq;
  float sink_run = 0.f;  // this thread's rows' dsinks shares for head sink_head, added once per head
  int sink_head = h0;
  for (int r0 = 0; r0 < rows; r0 += kRows) {  // uniform trip count: every lane reaches the shuffles
    const int r = r0 + static_cast<int>(threadIdx.x) / kPer;
    const bool live = r < rows;
    const int h = h0 + (live ? r / nq : 0), i = live ? r % nq : 0;
    float sum = 0.f;
    if (live && c < p.d) {
      const T* dor = static_cast<const T*>(p.dout) + b * p.dout_s.b + h * p.dout_s.h + i * p.dout_s.n + c;
      const T* orow = static_cast<const T*>(p.o) + b * p.o_s.b + h * p.o_s.h + i * p.o_s.n + c;
      const uint4 x = *reinterpret_cast<const uint4*>(dor);
      const uint4 y = *reinterpret_cast<const uint4*>(orow);
      sum = dot_vec16<T>(sum, x, y);
    }
#pragma unroll
    for (int off = kPer / 2; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (!live) continue;
    if (sub == 0) {
      p.delta[(static_cast<long long>(b) * p.hq + h) * nq + i] = sum;
      if (p.dsinks != nullptr) {  // d sink_h = -sum over rows of P_sink * Delta, P_sink = exp(sink_h - lse)
        if (h != sink_head) {
          atomicAdd(p.dsinks + sink_head, sink_run);
          sink_run = 0.f;
          sink_head = h;
        }
        const float l = p.lse[b * p.lse_s.b + h * p.lse_s.h + i * p.lse_s.n];
        if (l != -CUDART_INF_F) sink_run -= __expf(p.sinks[h] - l) * sum;
      }
    }
    if ((i < q_begin || i >= q_end) && c < p.d) {
      T* dq = static_cast<T*>(p.dq) + b * p.dq_s.b + h * p.dq_s.h + i * p.dq_s.n + c;
      *reinterpret_cast<uint4*>(dq) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  if (p.dsinks != nullptr && sub == 0 && sink_run != 0.f) atomicAdd(p.dsinks + sink_head, sink_run);
}

// A block that owns its rows stores dQ_i's (row, col) pairs as scale * dS K_j in dq's dtype and strides:
// own_dq_row once per row, then own_dq_store2 per pair.
template <typename T>
__device__ __forceinline__ T* own_dq_row(const AttentionParams& p, int b, int h, int row) {
  return static_cast<T*>(p.dq) + b * p.dq_s.b + h * p.dq_s.h + static_cast<long long>(row) * p.dq_s.n;
}

template <typename T>
__device__ __forceinline__ void own_dq_store2(const AttentionParams& p, T* row, int col, float x, float y) {
  mma::store2<T>(row + col, p.scale * x, p.scale * y);
}

// One row of a key-major backward's dQ_i share: with kOwnDQ stored complete in dq (own_dq_row, own_dq_store2),
// else added pair by pair into the f32 accumulator's row (gdq: the accumulator of the block's (batch, head), d
// floats a row). Built once per row that exists, then put2 per (col, col + 1).
template <bool kOwnDQ, typename T>
struct DQRow {
  T* own;
  float* acc;
  __device__ __forceinline__ DQRow(const AttentionParams& p, float* gdq, int b, int h, int row, int d)
      : own(kOwnDQ ? own_dq_row<T>(p, b, h, row) : nullptr),
        acc(kOwnDQ ? nullptr : gdq + static_cast<long long>(row) * d) {}
  __device__ __forceinline__ void put2(const AttentionParams& p, int col, float x, float y) const {
    if constexpr (kOwnDQ) own_dq_store2<T>(p, own, col, x, y);
    else mma::red_add2(acc + col, x, y);
  }
};

}  // namespace cupyflash
