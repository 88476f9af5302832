// The one argument of every attention kernel, in every family and both passes.
//
// Kernels take `const __grid_constant__ AttentionParams p` (ThunderKittens' habit): one struct by
// value instead of 30-40 positional arguments, defined here and mirrored field by field in
// cupyflash/kernels/params.py (a CPU test compares the two layouts through NVRTC). A kernel reads
// what it needs; the launcher fills what any kernel of the call may read and zeroes the rest.
#pragma once

namespace cupyflash {

// Element strides of the b, h and n axes of a (B, H, N, D) view (D is contiguous), or of the three
// axes of a (B, H, N) array such as lse.
struct Strides {
  long long b, h, n;
};

struct AttentionParams {
  // Arrays. Forward: q, k, v -> o, lse. Backward: dout, q, k, v, o, lse -> dq, dk, dv.
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  // Backward scratch, dense rows of B * Hq * Nq: the f32 dQ accumulator (D wide), Delta = rowsum(dO O)
  // and, for the portable kernels, lse in log2 units.
  float* dq_accum;
  float* delta;
  float* lse_log2;
  // Variant arrays (attention_policy.cuh): ALiBi slopes (one row of Hq per batch, or one for all when
  // alibi_sb = 0), attention-sink logits (Hq) and their gradient (Hq, f32, accumulated by the Delta kernel).
  const float* alibi;
  const float* sinks;
  float* dsinks;
  // Deterministic backward (dq_turns.cuh): one int counter per (batch, query head, query tile), zeroed;
  // nullptr: dQ adds in whatever order the blocks run.
  int* dq_turns;

  Strides q_s, k_s, v_s, o_s, lse_s, dout_s, dq_s, dk_s, dv_s;

  long long rows;  // B * Hq * Nq
  int batch;       // B, the leading dims merged
  int hq, hk, group;  // query heads, key/value heads, hq / hk
  int nq, nk;
  int d;  // true head dim (kernels pad to a compile-time one)
  float scale;       // softmax scale on q . k
  float scale_log2;  // scale * log2(e): scores live in log2 units, every exponential is one ex2
  int heads_fastest;  // grid order: 1 = (batch, head) on blockIdx.x, tiles on y; 0 = the other way round
  int vec;            // portable kernels: 16-byte global loads and stores are safe

  // Variant scalars (attention_policy.cuh).
  long long alibi_sb;  // batch stride of the slopes (0: the same slopes for every batch)
  int window_left, window_right;  // Window: query q sees keys q + nk - nq - left .. q + nk - nq + right
  float softcap_scale;            // scale / softcap: the argument of tanh per raw q . k
  float softcap_log2;             // softcap * log2(e): the capped score in log2 units

  // Dropout (dropout.cuh): the seed and first batch index are written per call / per sub-batch launch.
  unsigned long long dropout_seed;
  unsigned int dropout_threshold;  // P_ij is kept iff its Philox draw >= this (floor(p * 2^32))
  float dropout_scale;             // 1 / (1 - p)
  int dropout_b0;                  // batch index of this launch's first batch (leading dims flattened)
};

// Which (batch * heads, tile) a block works on, in the grid order the launch plan chose: heads fastest
// puts every head's first tile in flight before any second one (under causal, the longest tiles go first);
// tiles fastest runs one head's tiles together so they share its K/V (forward) or Q/dO (backward) in L2.
struct TileCoord {
  int bh;       // batch * heads + head
  int tile;     // index along the tiled sequence axis
  int n_tiles;  // how many tiles that axis has
};

__device__ __forceinline__ TileCoord tile_coord(const AttentionParams& p) {
  if (p.heads_fastest) return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y), static_cast<int>(gridDim.y)};
  return {static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)};
}

}  // namespace cupyflash
