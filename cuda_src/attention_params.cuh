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

// Element strides of the (b, h, q, k) axes of a score-shaped array (masks, biases), 0 where it broadcasts.
// Within one (b, h) slice offsets are 32-bit (validation checks the span): fewer registers per element.
struct Strides4 {
  long long b, h;
  int q, k;
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
  // Varlen (issue 14): packed sequences, FlashAttention's layout; all null for a dense call. Sequence b
  // owns q rows cu_seqlens_q[b]..cu_seqlens_q[b + 1] and k/v rows cu_seqlens_k[b].. (its first
  // seqused_k[b] keys when given); seq_geometry() below is the one place that reads them.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  const int* seqused_k;
  // User arrays (issue 17): a bool mask (True = may attend) and an additive bias, each read through its own
  // (b, h, q, k) strides (0 along a broadcast dim, never expanded), and the bias gradient's f32 accumulator
  // in the bias's own shape (its broadcast dims have stride 0 there too, so atomics sum over them), or with
  // dbias_direct (below) the gradient itself in the bias's dtype.
  const unsigned char* mask;
  const void* bias;
  float* dbias;
  // Deterministic backward (dq_turns.cuh): one int counter per (batch, query head, query tile), zeroed;
  // nullptr: dQ adds in whatever order the blocks run.
  int* dq_turns;
  // User snippets' aux arrays (issue 17 part 3, flex_policy.cuh): slot i's data, null for a scalar or an
  // unused slot (separate members rather than an array so that the layout test can name each one).
  const void *aux0, *aux1, *aux2, *aux3, *aux4, *aux5, *aux6, *aux7;
  // Block masks (create_block_mask, flex_policy.cuh's BlockMasked): per (b, h, query block) the [first, last)
  // key blocks that are not empty, and per (b, h, key block) the [first, last) query blocks; int pairs.
  const int* bm_kv;
  const int* bm_q;
  // Block masks' full runs (issue 17 speed, flex_policy.cuh's FlexMask): per (b, h, query block) the [first, last)
  // key blocks of its longest run of FULL blocks, and per (b, h, key block) the same over query blocks; int pairs.
  // Tiles inside a run skip mask_mod.
  const int* bm_full_kv;
  const int* bm_full_q;
  // Block masks' element bits (issue 17 speed, FlexMask<..., true>): per (b, h) and 64 x 64 bit tile (query tile,
  // key tile) an index: >= 0 the slot of a mixed tile's bits, -1 every pair visible, -2 none; a slot's bits as 64
  // words of 64 bits twice, one word per query row (bits_q: bit j = key 64 kt + j) and per key (bits_k).
  const int* bm_bit_index;
  const unsigned long long* bm_bits_q;
  const unsigned long long* bm_bits_k;
  // Query parts (float32 backward, plans.mma.query_parts): f32 partial dK_j/dV_j of each part, q_parts x
  // {dK, dV} slabs of B * Hk * Nk rows of d floats, summed in part order by mma_bwd_kv_combine; nullptr: none.
  float* kv_part;

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

  // Varlen (issue 14): the packed row counts (nq, nk above are then max_seqlen_q/k, the grid's extent,
  // and batch the number of sequences).
  int total_q, total_k;
  // Masks and biases (issue 17): element strides of the (b, h, q, k) axes of mask, bias and dbias.
  Strides4 mask_s, bias_s, dbias_s;
  // Dropout (dropout.cuh): the seed and first batch index are written per call / per sub-batch launch.
  unsigned long long dropout_seed;
  unsigned int dropout_threshold;  // P_ij is kept iff its 8-bit Philox draw >= this (round(p * 256), <= 255)
  float dropout_scale;             // 1 / (1 - threshold / 256)
  int dropout_b0;                  // batch index of this launch's first batch (leading dims flattened)
  // Softcap's backward: 1 / softcap_log2, so that tanh is recovered from P with a multiply, not a division.
  float softcap_inv_log2;
  // User snippets (issue 17 part 3, flex_policy.cuh): per aux slot, an array's element strides and extents
  // (up to 4 dims) or a scalar's value; run-time values, so new shapes or values do not recompile.
  long long aux_s[8][4];
  int aux_n[8][4];
  double aux_x[8];
  // Block masks: the block size, the query and key block counts, and the batch and head extents of the tables
  // (1: one table for every batch / head); an index's block is (x * bm_magic) >> bm_magic_shift (no division).
  int bm_size, bm_nqb, bm_nkb, bm_bb, bm_hb;
  unsigned int bm_magic;
  int bm_magic_shift;

  // dbias stores (issue 17 speed): 1 when no (b, h, q, k) of the problem shares a dbias element (the bias is
  // not broadcast): dbias is then the output itself, in the bias's dtype, and each dS is stored, not added.
  int dbias_direct;

  // Deterministic backward (issue 16, turns v2): heads per group of the key-major kernels' grid order while
  // dq_turns is set (dq_turns.cuh, dq_grid_coord); 0 or 1 = tiles fastest.
  int dq_head_group;
  // dbias summed over the batch (issue 17 speed): 1 puts the batches of one kv head next to each other in the
  // backward's grid order, so the B adds into each dbias element meet in L2 (dq_turns.cuh, batch_inner_bh).
  int batch_inner;
  // Query parts (float32 backward): how many blocks split each key tile's query tiles (blockIdx.z is the part);
  // 0 or 1 = none.
  int q_parts;
};

// A TMA descriptor (the driver's CUtensorMap, encoded on the host by cupyflash/kernels/tensor_map.py): 128 opaque
// bytes that cp.async.bulk.tensor reads by address. The PTX ISA wants it 64-byte aligned in the parameter space;
// CUDA 13's cuda.h aligns CUtensorMap to 128, which we follow (it holds for both).
struct alignas(128) TensorMap {
  unsigned long long opaque[16];
};

// The one argument of the kernels that copy by TMA (the wgmma backward's and ws forward's kTma): AttentionParams at
// offset 0, as every other kernel's, then the maps of q and dout as (B, Hq, Nq, d) views and of k and v as (B, Hk, Nk,
// d) views (params.TMA_MAPS' order), written per call with the addresses of the arrays a kernel maps (the others
// stay zero: the backward reads q and dout, the forward q, k and v).
// A struct of its own so that AttentionParams keeps its 8-byte alignment: aligned to 64 or more, ptxas loads its
// fields differently in every kernel (the wgmma loader kernels' spills grew from 20/28 B to 28/44 B).
struct TmaParams {
  AttentionParams p;
  TensorMap tma_q, tma_dout, tma_k, tma_v;
};

// A kernel's parameter type by its kTma flag, and the AttentionParams inside it.
template <bool kTma>
struct KernelParams {
  using type = AttentionParams;
};
template <>
struct KernelParams<true> {
  using type = TmaParams;
};
__device__ __forceinline__ const AttentionParams& params_of(const AttentionParams& p) { return p; }
__device__ __forceinline__ const AttentionParams& params_of(const TmaParams& t) { return t.p; }

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

// A persistent grid's virtual block g (its blocks walk the grid a dense launch would have): tile_coord's answer
// for that block, numbered x fastest as the hardware launches blocks, so the items keep the launch plan's order.
// Dense only (varlen grids map blocks to sequences through varlen_tile_coord).
__device__ __forceinline__ int dense_grid_blocks(const AttentionParams& p, int tile) {
  return p.batch * p.hq * ((p.nq + tile - 1) / tile);
}
__device__ __forceinline__ TileCoord dense_tile_coord(const AttentionParams& p, int tile, int g) {
  const int heads = p.batch * p.hq, tiles = (p.nq + tile - 1) / tile;
  if (p.heads_fastest) return {g % heads, g / heads, tiles};
  return {g / tiles, g % tiles, tiles};
}

// Where a block's sequence lies and how long it is. Dense: the whole (b, h) problem (row offsets 0, nq, nk).
// Varlen: sequence b's first q and k rows in the packed arrays and its own nq, nk, clipped so that no
// value of cu_seqlens/seqused_k reaches outside [0, total) and no sequence outgrows the grid (nq, nk are
// max_seqlen_q/k there). Kernels add q_row0/k_row0 rows to their base pointers, build the policy from
// this nq, nk (masks are bottom-right aligned per sequence), and index scratch rows by scratch_row().
struct SeqGeometry {
  int q_row0, k_row0;
  int nq, nk;
};

// The query side alone (first row, length), for code that needs no key lengths: the reads below are never
// dropped, even unused, so a loop that only addresses query rows reads two values instead of five.
struct SeqRows {
  int q_row0, nq;
};

// One int of cu_seqlens/seqused_k through the read-only path: an L1 hit after the first read (the arrays do
// not change during a launch). A C++ volatile load would be a relaxed system-scope load, which skips L1 and
// waits on L2 each time: the backward's per-step re-reads paid that on their critical path. What keeps the
// values from being hoisted and held live through a main loop is the caller's opaque() sequence index.
__device__ __forceinline__ int reread(const int* a, int i) { return __ldg(a + i); }

// A kernel may call these again inside its main loop and get the values re-read instead of kept live
// across the loop: dense calls answer from the constant bank as before, and varlen calls cost no
// registers where the tiles have none to spare.
__device__ __forceinline__ SeqRows seq_queries(const AttentionParams& p, int b) {
  if (p.cu_seqlens_q == nullptr) return {0, p.nq};  // uniform: dense calls pay one test
  const int q0 = min(max(reread(p.cu_seqlens_q, b), 0), p.total_q);
  const int q1 = min(max(reread(p.cu_seqlens_q, b + 1), q0), p.total_q);
  return {q0, min(q1 - q0, p.nq)};
}

__device__ __forceinline__ SeqGeometry seq_geometry(const AttentionParams& p, int b) {
  if (p.cu_seqlens_q == nullptr) return {0, 0, p.nq, p.nk};  // uniform: dense calls pay one test
  const SeqRows q = seq_queries(p, b);
  const int k0 = min(max(reread(p.cu_seqlens_k, b), 0), p.total_k);
  const int k1 = min(max(reread(p.cu_seqlens_k, b + 1), k0), p.total_k);
  int nk = min(k1 - k0, p.nk);
  if (p.seqused_k != nullptr) nk = min(nk, max(reread(p.seqused_k, b), 0));
  return {q.q_row0, k0, q.nq, nk};
}

// Varlen grids are compact: the head axis holds heads only, and the tile axis "virtual tiles": sequence b's
// tiles of `tile` rows sit at [s_b, s_b + n_b) with s_b = floor(cu[b] / tile) + b, which increases and leaves
// room for n_b = ceil(len_b / tile) (floor((a + L) / T) - floor(a / T) + 1 >= ceil(L / T)); all of them fit
// below floor(total / tile) + B (cupyflash/plans grid_axes), where B * ceil(max_seqlen / tile) blocks, most
// of them with nothing to do, were launched before.
//
// The largest b with s_b <= t: a warp-wide 32-ary search (a load per lane and a ballot per step, so
// ceil(log32 B) dependent loads). Every lane of the warp calls it; values of cu are clamped, and whatever
// they hold the answer is a b in [0, B).
__device__ __forceinline__ int varlen_sequence_of(const int* cu, int batch, int total, int tile, int t) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  int lo = 0, n = batch;  // the answer lies in [lo, lo + n)
  while (n > 1) {
    const int step = (n + 31) / 32;
    bool below = false;
    if (lane * step < n) {
      const int i = lo + lane * step;
      below = min(max(reread(cu, i), 0), total) / tile + i <= t;
    }
    const unsigned m = __ballot_sync(0xffffffffu, below);
    const int k = m ? 31 - __clz(m) : 0;  // the last candidate at or below t
    lo += k * step;
    n = min(step, n - k * step);
  }
  return lo;
}

// tile_coord for a grid over tiles of `tile` rows of one axis (cu, total, longest: that axis's cu_seqlens,
// packed rows and max_seqlen): dense calls as tile_coord; varlen calls get bh = b * heads + h, the tile
// inside sequence b and b's tile count, or, for a virtual tile b does not use, a tile past every sequence
// (past its n_tiles too, so kernels counting tiles down from n_tiles - 1 also land past the end).
// `c` is the block's (head axis, grid tile) in the grid order in use (tile_coord's, or dq_grid_coord's).
__device__ __forceinline__ TileCoord varlen_tile_coord(const AttentionParams& p, int tile, const int* cu, int total,
                                                       int longest, TileCoord c) {
  if (p.cu_seqlens_q == nullptr) return c;  // uniform: dense calls pay one test
  const int b = varlen_sequence_of(cu, p.batch, total, tile, c.tile);
  const int r0 = min(max(reread(cu, b), 0), total);
  const int r1 = min(max(reread(cu, b + 1), r0), total);
  const int n = (min(r1 - r0, longest) + tile - 1) / tile;
  const int local = c.tile - (r0 / tile + b);
  c.bh += b * static_cast<int>(p.heads_fastest ? gridDim.x : gridDim.y);
  if (local < 0 || local >= n) {
    const int past = (max(p.nq, p.nk) + tile - 1) / tile;
    return {c.bh, past, 2 * past + 1};
  }
  return {c.bh, local, n};
}
__device__ __forceinline__ TileCoord varlen_tile_coord(const AttentionParams& p, int tile, const int* cu, int total,
                                                       int longest) {
  return varlen_tile_coord(p, tile, cu, total, longest, tile_coord(p));
}

// Grids over query tiles (forwards, the dQ pass) and over key tiles (the backward's dK/dV kernels).
__device__ __forceinline__ TileCoord query_tile_coord(const AttentionParams& p, int tile) {
  return varlen_tile_coord(p, tile, p.cu_seqlens_q, p.total_q, p.nq);
}
__device__ __forceinline__ TileCoord key_tile_coord(const AttentionParams& p, int tile) {
  return varlen_tile_coord(p, tile, p.cu_seqlens_k, p.total_k, p.nk);
}

// The first dense scratch row (dQ accumulator, Delta, lse2) of query head h of sequence/batch b: rows are
// (b * Hq + h) * Nq + i dense, and h * total_q + q_row0 + i varlen (one row per real query, no padding).
__device__ __forceinline__ long long scratch_row(const AttentionParams& p, const SeqGeometry& s, int b, int h) {
  if (p.cu_seqlens_q == nullptr) return ((long long)b * p.hq + h) * p.nq;
  return (long long)h * p.total_q + s.q_row0;
}
__device__ __forceinline__ long long scratch_row(const AttentionParams& p, const SeqRows& s, int b, int h) {
  if (p.cu_seqlens_q == nullptr) return ((long long)b * p.hq + h) * p.nq;
  return (long long)h * p.total_q + s.q_row0;
}

// The query-row count the per-row kernels (Delta, dQ conversion) decode rows with: Nq dense, total_q
// varlen (there the scratch rows are the packed (Hq, total_q) rows, as lse is).
__device__ __forceinline__ int row_extent(const AttentionParams& p) {
  return p.cu_seqlens_q == nullptr ? p.nq : p.total_q;
}

}  // namespace cupyflash
