// Decode attention against a KV cache (issue 15): in-place append of new keys/values, split-KV attention
// over a contiguous or paged cache, and the log-sum-exp merge of partial results.
//
// Decoding is bound by memory bandwidth: a few query rows per sequence read a long cache once. So one
// block owns (batch b, KV head, split of the key range) and packs every query row that reads that KV
// head (the Hq / Hk heads of its group times Nq rows, "GQA packing") into the M dimension of its tile:
// each K/V byte crosses the bus once per block. K/V tiles of kBc keys arrive by 16-byte cp.async
// (coalesced rows; a paged cache maps each key through the block table) into a ring of stages. Two kernels
// share that plan: decode_split_mma (decode_mma.cuh, included at the end) runs the tile products on tensor
// cores for fp16/bf16 caches; decode_split below runs them on FMA units in float32, for float32 caches (mma
// would round their operands) and as the kernel="fma" reference. Masks and score rules are the variant
// policies of attention_policy.cuh, built per block for that sequence's key count.
//
// Safety: whatever cache_seqlens, block_table and cache_batch_idx hold, every index is clamped on the
// device (lengths to [0, capacity - n_new], pages and cache rows to their arrays), so no access leaves
// the arrays; validate=True on the host checks the values themselves.
#include "attention_params.cuh"
#include "attention_policy.cuh"
#include "common.cuh"
#include "mma_primitives.cuh"

namespace cupyflash {

using mma::cp_async_16;
using mma::cp_async_commit;
using mma::cp_async_wait;
using mma::fast_exp2;
using mma::smem_u32;

// The one argument of the append and decode kernels: an AttentionParams for what the variant policies
// and the q/o/lse epilogue read (its nk is set per sequence), then the cache's own fields. Mirrored by
// cupyflash/kernels/decode.py (DECODE_PARAMS; tests/test_kvcache.py checks the layout through NVRTC).
struct DecodeParams {
  AttentionParams attn;
  const void* k_new;  // (B, Hk, n_new, D) keys/values to append, or null
  const void* v_new;
  void* k_cache;  // contiguous: (B_cache, Hk, S, D); paged: (num_pages, Hk, page_size, D)
  void* v_cache;
  const int* cache_seqlens;    // (B,) keys cached before this call, or null: seqlen_const for all
  const int* block_table;      // (B, pages_per_seq) page of each block of page_size keys, or null
  const int* cache_batch_idx;  // (B,) cache row of each batch row (contiguous caches), or null
  float* o_part;               // split partials: (splits, B * Hq * Nq, d) float32
  float* lse_part;             // (splits, B * Hq * Nq), natural log
  Strides kc_s, vc_s;          // cache strides of (page or cache row, head, slot)
  Strides kn_s, vn_s;          // k_new / v_new strides of (b, h, n)
  long long bt_stride;         // block_table row stride in elements
  int n_new;
  int page_size;      // keys per page (contiguous: S)
  int num_pages;      // pages in the cache (contiguous: B_cache)
  int pages_per_seq;  // block-table width (contiguous: 1)
  int seqlen_const;
  int m_rows;         // rows that read one KV head: group * nq
  // Rotary embedding (null cos: none): cos/sin (rotary_rows, rotary_dim / 2) float32; q is rotated into q_rot
  // (dense (B, Hq, Nq, D)), which the decode kernel then reads as attn.q.
  const float* rotary_cos;
  const float* rotary_sin;
  void* q_rot;
  int rotary_dim;          // leading dims rotated (even, <= d)
  int rotary_interleaved;  // 1: pairs (2j, 2j + 1) (GPT-J); 0: halves (j, j + rotary_dim / 2) (GPT-NeoX)
  int rotary_rows;         // positions cos/sin cover
  int rotary_q_step;       // q row i sits at position cache_seqlens + i (1: causal/local) or cache_seqlens (0)
  // Decode v3, the merge inside the split launch: (B * gridDim.y) arrival counters, one per (b, row chunk), zero
  // between launches (the merging block resets its own); null without splits.
  int* split_count;
};

// Keys this call attends to for sequence b: its cached length (clamped so the append fits) + n_new.
__device__ __forceinline__ int cached_len(const DecodeParams& p, int b) {
  const int cap = p.page_size * p.pages_per_seq - p.n_new;
  const int s = p.cache_seqlens != nullptr ? p.cache_seqlens[b] : p.seqlen_const;
  return min(max(s, 0), max(cap, 0));
}

// Element offset of key `key` of sequence b, head h in a cache with strides s (clamped to the arrays).
__device__ __forceinline__ long long slot_offset(const DecodeParams& p, const Strides& s, int b, int h, int key) {
  int page, row;
  if (p.block_table != nullptr) {
    const int blk = min(key / p.page_size, p.pages_per_seq - 1);
    page = p.block_table[b * p.bt_stride + blk];
    row = key - blk * p.page_size;
  } else {
    page = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    row = key;
  }
  page = min(max(page, 0), p.num_pages - 1);
  row = min(max(row, 0), p.page_size - 1);
  return page * s.b + h * s.h + row * s.n;
}

// What the variant policies read of AttentionParams, for one sequence of nk keys. (Copying the whole
// __grid_constant__ struct instead puts it in local memory; this small one stays in registers.)
__device__ __forceinline__ AttentionParams sequence_params(const AttentionParams& a, int nk) {
  AttentionParams s{};
  s.nq = a.nq;
  s.nk = nk;
  s.scale = a.scale;
  s.scale_log2 = a.scale_log2;
  s.window_left = a.window_left;
  s.window_right = a.window_right;
  s.softcap_scale = a.softcap_scale;
  s.softcap_log2 = a.softcap_log2;
  return s;
}

// Element c of a row x rotated to position pos (elements past rotary_dim pass through).
template <typename T>
__device__ __forceinline__ float rotated(const DecodeParams& p, const T* x, int c, int pos) {
  const int rd = p.rotary_dim, half = rd / 2;
  if (c >= rd) return to_float<T>(x[c]);
  pos = min(max(pos, 0), p.rotary_rows - 1);
  int j, i1, i2;
  if (p.rotary_interleaved) {
    j = c / 2, i1 = 2 * j, i2 = 2 * j + 1;
  } else {
    j = c % half, i1 = j, i2 = j + half;
  }
  const float co = p.rotary_cos[pos * half + j], si = p.rotary_sin[pos * half + j];
  const float x1 = to_float<T>(x[i1]), x2 = to_float<T>(x[i2]);
  const bool first = p.rotary_interleaved ? (c % 2 == 0) : (c < half);
  return first ? x1 * co - x2 * si : x1 * si + x2 * co;
}

// q rotated to its positions, into the dense q_rot: one block per (b, query head).
template <typename T>
__global__ void rotate_q(const __grid_constant__ DecodeParams p) {
  const AttentionParams& a = p.attn;
  const int b = blockIdx.x, h = blockIdx.y;
  const int base = cached_len(p, b);
  for (int e = threadIdx.x; e < a.nq * a.d; e += blockDim.x) {
    const int i = e / a.d, c = e - i * a.d;
    const T* src = static_cast<const T*>(a.q) + b * a.q_s.b + h * a.q_s.h + i * a.q_s.n;
    T* dst = static_cast<T*>(p.q_rot) + ((static_cast<long long>(b) * a.hq + h) * a.nq + i) * a.d;
    dst[c] = from_float<T>(rotated<T>(p, src, c, base + i * p.rotary_q_step));
  }
}

// Writes k_new / v_new into the cache at [seqlen_b, seqlen_b + n_new) of every (b, kv head): one block
// per (b, head), threads over (new key, element). Touches no other slot.
template <typename T>
__global__ void kv_append(const __grid_constant__ DecodeParams p) {
  const int b = blockIdx.x, h = blockIdx.y;
  const int base = cached_len(p, b);
  const int d = p.attn.d;
  const T* kn = static_cast<const T*>(p.k_new);
  const T* vn = static_cast<const T*>(p.v_new);
  T* kc = static_cast<T*>(p.k_cache);
  T* vc = static_cast<T*>(p.v_cache);
  for (int e = threadIdx.x; e < p.n_new * d; e += blockDim.x) {
    const int i = e / d, c = e - i * d;
    const T* krow = kn + b * p.kn_s.b + h * p.kn_s.h + i * p.kn_s.n;
    kc[slot_offset(p, p.kc_s, b, h, base + i) + c] =
        p.rotary_cos != nullptr ? from_float<T>(rotated<T>(p, krow, c, base + i)) : krow[c];
    vc[slot_offset(p, p.vc_s, b, h, base + i) + c] = vn[b * p.vn_s.b + h * p.vn_s.h + i * p.vn_s.n + c];
  }
}

// Shared-memory layout of the decode kernel (dynamic; the host sizes it with the same formula).
template <typename T, int kD, int kM, int kBc>
struct DecodeSmem {
  static constexpr int kVec = 16 / sizeof(T);     // elements per 16-byte load
  static constexpr int kPitch = kD + kVec;        // row pitch: rows shift by 16 bytes, so conflict-free
  static constexpr int kTile = kBc * kPitch;      // elements of one K or V tile
  float q[kM][kD];                                // Q rows of the group, float32, zero-padded
  float s[kM][kBc];                               // scores, then probabilities of the current tile
  float m[kM], l[kM], alpha[kM];                  // running max (log2 units), sum, this tile's rescale
  T kv[2][2][kTile];                              // [stage][K or V] tiles
  static_assert(kM % 4 == 0, "the K/V tiles must start 16-byte aligned");
};

constexpr int kDecodeThreads = 128;

// Queue the K and V rows [k0, k0 + kBc) of (b, kvh) into one stage; rows past `end` and columns past d
// are zero-filled (P is 0 there, and 0 * garbage could be NaN).
template <typename T, int kD, int kM, int kBc>
__device__ __forceinline__ void load_kv_tile(DecodeSmem<T, kD, kM, kBc>& sm, int stage, const DecodeParams& p, int b,
                                             int kvh, int k0, int end) {
  using S = DecodeSmem<T, kD, kM, kBc>;
  constexpr int kChunks = kD / S::kVec;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  for (int e = threadIdx.x; e < kBc * kChunks; e += kDecodeThreads) {
    const int r = e / kChunks, c = e - r * kChunks;
    const int key = k0 + r;
    const bool ok = key < end && c * S::kVec < p.attn.d;
    const int kk = ok ? key : 0;
    const T* ksrc = kc + (ok ? slot_offset(p, p.kc_s, b, kvh, kk) + c * S::kVec : 0);
    const T* vsrc = vc + (ok ? slot_offset(p, p.vc_s, b, kvh, kk) + c * S::kVec : 0);
    cp_async_16(smem_u32(&sm.kv[stage][0][r * S::kPitch + c * S::kVec]), ksrc, ok ? 16 : 0);
    cp_async_16(smem_u32(&sm.kv[stage][1][r * S::kPitch + c * S::kVec]), vsrc, ok ? 16 : 0);
  }
}

template <typename T>
__device__ __forceinline__ void to_floats(const uint4& u, float (&f)[16 / sizeof(T)]) {
  const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
  for (int i = 0; i < 16 / static_cast<int>(sizeof(T)); ++i) f[i] = to_float<T>(e[i]);
}

// Split-KV's merge inside the decode launch ("last block done"): every split block of a (b, row chunk) has
// written its float32 partials; it counts itself in, and the block that arrives last combines the chunk's rows by
// merge_states' rule (the sink joins once, here) and resets the counter for the next launch. So a split call is one
// launch: no merge kernel, no memset. Rows m0 .. m0 + km - 1 of KV head kvh's group; every thread of the block
// calls it (it synchronises). Partials are read through L2 (__ldcg): other SMs wrote them during this launch, and
// L1 is not coherent with them.
//
// Ordering: the barrier orders every thread's partial stores before thread 0's count (CTA scope); the count is one
// acq_rel atomic at GPU scope, a release of those stores (cumulative through the barrier) and, in the last block,
// the acquire of every earlier block's; the second barrier orders that acquire before its threads' loads. So no
// thread fences: __threadfence() is fence.sc (MEMBAR.SC), and the tail of a split call is ~0.3 us shorter without
// it (per-block timestamps, benchmarks/NOTES.md s27).
//
// One warp per row; lane l owns columns [l * kV, l * kV + kV) (kV = kD / 32, float2 loads) and the weights of
// splits l, l + 32, ..., handed out by shuffles. The merge is the launch's tail, after the slowest split's loop,
// and each L2 round trip there costs ~1 us while other blocks still stream the cache (per-block timestamps,
// benchmarks/NOTES.md s27): so a batch of kBatch splits' columns (64 floats a lane) is loaded at once, the first
// batch together with the lse values it is weighted by, and each lse is read once. Up to kBatch splits (16 at
// D = 128) the merge waits on one round trip.
template <typename T, int kD>
__device__ __forceinline__ void merge_if_last(const DecodeParams& p, int b, int kvh, int m0, int km) {
  __syncthreads();  // the block's partials are stored (CTA order)
  const int splits = gridDim.z;
  int last = 0;
  if (threadIdx.x == 0) {
    int* count = p.split_count + (static_cast<long long>(b) * gridDim.y + blockIdx.y);
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(count) : "memory");
    last = before == splits - 1;
    if (last) atomicExch(count, 0);  // every split has arrived: ready for the next launch
  }
  if (!__syncthreads_or(last)) return;

  constexpr int kV = kD / 32;          // columns per lane: 2, 4 or 8
  constexpr int kBatch = 64 / kV;      // splits loaded at once: 32, 16 or 8 (a divisor of 32)
  static_assert(kD % 64 == 0, "columns per lane in float2 pairs");
  const AttentionParams& a = p.attn;
  const long long rows_total = static_cast<long long>(a.batch) * a.hq * a.nq;
  const int lane = threadIdx.x % 32, c0 = lane * kV;
  const float neg_inf = -__int_as_float(0x7f800000);
  const bool cols = c0 < a.d;  // d is even and c0 too: a pair is in or out as a whole
  for (int r = threadIdx.x / 32; r < km && m0 + r < p.m_rows; r += blockDim.x / 32) {
    const int row = m0 + r, h = kvh * a.group + row / a.nq, qi = row % a.nq;
    const long long prow = (static_cast<long long>(b) * a.hq + h) * a.nq + qi;
    const float* lse_p = p.lse_part + prow;             // split s at lse_p[s * rows_total]
    const float* o_p = p.o_part + prow * a.d + c0;      // split s at o_p[s * rows_total * d]
    const long long o_step = rows_total * a.d;
    // Splits s0 .. s0 + kBatch - 1 of this lane's columns (zeros past the last split or past d).
    float2 x[kBatch][kV / 2];
    auto load_batch = [&](int s0) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
#pragma unroll
        for (int v = 0; v < kV / 2; ++v) {
          const bool ok = cols && s0 + j < splits && c0 + 2 * v < a.d;
          const float2* src = reinterpret_cast<const float2*>(o_p + (s0 + j) * o_step + 2 * v);
          x[j][v] = ok ? __ldcg(src) : make_float2(0.f, 0.f);
        }
      }
    };
    const float lse_lane = lane < splits ? __ldcg(lse_p + lane * rows_total) * kLog2e : neg_inf;
    load_batch(0);  // in flight with lse_lane
    const float sink2 = sink_log2(a, h);
    float mx = fmaxf(sink2, lse_lane);
    for (int s = lane + 32; s < splits; s += 32) mx = fmaxf(mx, __ldcg(lse_p + s * rows_total) * kLog2e);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_use = mx == neg_inf ? 0.f : mx;

    float acc[kV], tot = 0.f;
#pragma unroll
    for (int v = 0; v < kV; ++v) acc[v] = 0.f;
    float wl = 0.f;  // this lane's split weight in the current group of 32 (0 for a split that saw no key)
    for (int s0 = 0; s0 < splits; s0 += kBatch) {
      if (s0 % 32 == 0) {
        const int s = s0 + lane;
        const float l2 = s0 == 0 ? lse_lane : (s < splits ? __ldcg(lse_p + s * rows_total) * kLog2e : neg_inf);
        wl = fast_exp2(l2 - m_use);
        tot += wl;
      }
      if (s0 > 0) load_batch(s0);
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const float w = __shfl_sync(0xffffffffu, wl, (s0 + j) % 32);
#pragma unroll
        for (int v = 0; v < kV / 2; ++v) {
          acc[2 * v] = fmaf(w, x[j][v].x, acc[2 * v]);
          acc[2 * v + 1] = fmaf(w, x[j][v].y, acc[2 * v + 1]);
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
    tot += fast_exp2(sink2 - m_use);  // 0 without a sink
    const float inv = tot > 0.f ? __fdividef(1.f, tot) : 0.f;  // MUFU paths, as the combine's (decode_mma.cuh)
    T* o = static_cast<T*>(a.o) + b * a.o_s.b + h * a.o_s.h + qi * a.o_s.n;
#pragma unroll
    for (int v = 0; v < kV; ++v) {
      if (c0 + v < a.d) o[c0 + v] = from_float<T>(acc[v] * inv);
    }
    if (lane == 0) a.lse[b * a.lse_s.b + h * a.lse_s.h + qi * a.lse_s.n] = tot > 0.f ? (m_use + fast_log2(tot)) * kLn2
                                                                                     : neg_inf;
  }
}

// Split-KV decode. Grid: (B, Hk * m_chunks, splits); block: 128 threads. Rows r of a block are query
// rows m0 + r of KV head kvh's group: head kvh * group + (m0 + r) / nq, query (m0 + r) % nq.
template <typename T, int kD, int kM, int kBc, class Policy>
__global__ void __launch_bounds__(kDecodeThreads, 2) decode_split(const __grid_constant__ DecodeParams p) {
  using S = DecodeSmem<T, kD, kM, kBc>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  S& sm = *reinterpret_cast<S*>(smem_raw);
  const AttentionParams& a = p.attn;
  const int tid = threadIdx.x;
  const int b = blockIdx.x;
  const int m_chunks = (p.m_rows + kM - 1) / kM;
  const int kvh = blockIdx.y / m_chunks, m0 = (blockIdx.y - kvh * m_chunks) * kM;
  const int nk = cached_len(p, b) + p.n_new;

  // The policy of this sequence: its key count is nk (causal/window offsets are bottom-right aligned).
  Policy pol(sequence_params(a, nk));

  // This split's keys: the keys any row may see, cut into gridDim.z chunks of whole tiles.
  const Range keys = pol.mask.keys_of(0, a.nq);
  const int span = max(0, keys.end - keys.begin);
  const int chunk = ((span + gridDim.z - 1) / gridDim.z + kBc - 1) / kBc * kBc;
  const int k_begin = keys.begin + blockIdx.z * chunk;
  const int k_end = min(keys.end, k_begin + chunk);
  const int n_tiles = k_end > k_begin ? (k_end - k_begin + kBc - 1) / kBc : 0;

  if (n_tiles > 0) load_kv_tile(sm, 0, p, b, kvh, k_begin, k_end);
  cp_async_commit();

  // Q rows of the group (float32, zero rows and columns past the problem).
  for (int e = tid; e < kM * kD; e += kDecodeThreads) {
    const int r = e / kD, c = e - r * kD;
    const int row = m0 + r;
    float x = 0.f;
    if (row < p.m_rows && c < a.d) {
      const int h = kvh * a.group + row / a.nq, qi = row % a.nq;
      x = to_float<T>(static_cast<const T*>(a.q)[b * a.q_s.b + h * a.q_s.h + qi * a.q_s.n + c]);
    }
    sm.q[r][c] = x;
  }
  const float neg_inf = -__int_as_float(0x7f800000);
  for (int r = tid; r < kM; r += kDecodeThreads) {
    sm.m[r] = neg_inf;
    sm.l[r] = 0.f;
  }

  // Scores: thread -> key column j_s, rows r = rg_s + i * kRowGroups (K read once per thread and tile).
  constexpr int kRowGroups = kDecodeThreads / kBc;
  constexpr int kRowsS = kM / kRowGroups;
  const int j_s = tid % kBc, rg_s = tid / kBc;
  // Output: thread -> column pair c_o, rows r = rg_o + i * kRowGroupsO.
  constexpr int kRowGroupsO = kDecodeThreads / (kD / 2);
  constexpr int kRowsO = kM / kRowGroupsO;
  static_assert(kRowsS >= 1 && kRowsO >= 1, "tile too small for the thread layout");
  const int c_o = (tid % (kD / 2)) * 2, rg_o = tid / (kD / 2);
  float acc[kRowsO][2];
#pragma unroll
  for (int i = 0; i < kRowsO; ++i) acc[i][0] = acc[i][1] = 0.f;

  typename Policy::Score score = pol.score;
  for (int t = 0; t < n_tiles; ++t) {
    const int k0 = k_begin + t * kBc;
    if (t + 1 < n_tiles) load_kv_tile(sm, (t + 1) & 1, p, b, kvh, k0 + kBc, k_end);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* Ks = sm.kv[t & 1][0];
    const T* Vs = sm.kv[t & 1][1];

    // S = Q K^T for this thread's key and rows, scored and masked by the policy (log2 units).
    float s[kRowsS];
#pragma unroll
    for (int i = 0; i < kRowsS; ++i) s[i] = 0.f;
#pragma unroll 4
    for (int c = 0; c < kD / S::kVec; ++c) {
      float kf[S::kVec];
      to_floats<T>(*reinterpret_cast<const uint4*>(&Ks[j_s * S::kPitch + c * S::kVec]), kf);
#pragma unroll
      for (int i = 0; i < kRowsS; ++i) {
        const float* qr = &sm.q[rg_s + i * kRowGroups][c * S::kVec];
#pragma unroll
        for (int e = 0; e < S::kVec; ++e) s[i] = fmaf(qr[e], kf[e], s[i]);
      }
    }
    const int key = k0 + j_s;
#pragma unroll
    for (int i = 0; i < kRowsS; ++i) {
      const int r = rg_s + i * kRowGroups, row = m0 + r;
      const int qi = row % a.nq;
      float x = neg_inf;
      if (row < p.m_rows && key < k_end && pol.mask.visible(qi, key)) {
        if constexpr (Policy::Score::kIdentity) {
          x = s[i] * a.scale_log2;
        } else {
          score.at_head(a, b, kvh * a.group + row / a.nq);
          x = score.template log2_score<true>(s[i], qi, key);
        }
      }
      sm.s[r][j_s] = x;
    }
    __syncthreads();

    // Online softmax, one warp per row: new max, rescale factor, probabilities, running sum.
    for (int r = tid / 32; r < kM; r += kDecodeThreads / 32) {
      const int lane = tid % 32;
      float mx = neg_inf;
      for (int j = lane; j < kBc; j += 32) mx = fmaxf(mx, sm.s[r][j]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_old = sm.m[r];
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == neg_inf ? 0.f : m_new;  // a row with nothing visible yet stays at 0
      float sum = 0.f;
      for (int j = lane; j < kBc; j += 32) {
        const float pj = fast_exp2(sm.s[r][j] - m_use);
        sm.s[r][j] = pj;
        sum += pj;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      __syncwarp();
      if (lane == 0) {
        const float alpha = fast_exp2(m_old - m_use);
        sm.alpha[r] = alpha;
        sm.l[r] = sm.l[r] * alpha + sum;
        sm.m[r] = m_new;
      }
    }
    __syncthreads();

    // O = alpha * O + P V for this thread's column pair and rows.
#pragma unroll
    for (int i = 0; i < kRowsO; ++i) {
      const float al = sm.alpha[rg_o + i * kRowGroupsO];
      acc[i][0] *= al;
      acc[i][1] *= al;
    }
#pragma unroll 4
    for (int j = 0; j < kBc; ++j) {
      const float v0 = to_float<T>(Vs[j * S::kPitch + c_o]);
      const float v1 = to_float<T>(Vs[j * S::kPitch + c_o + 1]);
#pragma unroll
      for (int i = 0; i < kRowsO; ++i) {
        const float pj = sm.s[rg_o + i * kRowGroupsO][j];
        acc[i][0] = fmaf(pj, v0, acc[i][0]);
        acc[i][1] = fmaf(pj, v1, acc[i][1]);
      }
    }
    __syncthreads();  // the stage and the scores are overwritten next
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: one split writes o and lse (with the sink); several write float32 partials that the last
  // block of the row chunk combines (merge_if_last; the sink joins there, once).
  const long long rows_total = static_cast<long long>(a.batch) * a.hq * a.nq;
#pragma unroll
  for (int i = 0; i < kRowsO; ++i) {
    const int r = rg_o + i * kRowGroupsO, row = m0 + r;
    if (row >= p.m_rows) continue;
    const int h = kvh * a.group + row / a.nq, qi = row % a.nq;
    const float l = sm.l[r];
    float lse2 = l > 0.f ? sm.m[r] + log2f(l) : neg_inf;
    float inv = l > 0.f ? 1.f / l : 0.f;
    if (gridDim.z == 1) {
      const float sink2 = sink_log2(a, h);
      if (sink2 > neg_inf) {
        const float mx = fmaxf(lse2, sink2);
        const float tot = mx + log2f(exp2f(lse2 - mx) + exp2f(sink2 - mx));
        inv *= exp2f(lse2 - tot);  // exp2(-inf) = 0 when the row saw no key
        lse2 = tot;
      }
      T* o = static_cast<T*>(a.o) + b * a.o_s.b + h * a.o_s.h + qi * a.o_s.n;
      if (c_o < a.d) o[c_o] = from_float<T>(acc[i][0] * inv);
      if (c_o + 1 < a.d) o[c_o + 1] = from_float<T>(acc[i][1] * inv);
      if (c_o == 0) a.lse[b * a.lse_s.b + h * a.lse_s.h + qi * a.lse_s.n] = lse2 / kLog2e;
    } else {
      const long long prow = blockIdx.z * rows_total + (static_cast<long long>(b) * a.hq + h) * a.nq + qi;
      float* o = p.o_part + prow * a.d;
      if (c_o < a.d) o[c_o] = acc[i][0] * inv;
      if (c_o + 1 < a.d) o[c_o + 1] = acc[i][1] * inv;
      if (c_o == 0) p.lse_part[prow] = lse2 / kLog2e;
    }
  }
  if (gridDim.z > 1) merge_if_last<T, kD>(p, b, kvh, m0, kM);
}

// o = sum_p exp(lse_p - lse) o_p, lse = log sum_p exp(lse_p) (natural log), over `parts` partial results
// of `rows` rows each: o_parts (parts, rows, d), lse_parts (parts, rows), both dense. Parts with
// lse = -inf weigh nothing; a row whose every part is -inf gives o = 0, lse = -inf. With sinks (Hq,),
// row (b * hq + h) * nq + i also adds sink h to its denominator. One warp per row: lanes read the parts' lse in
// parallel and hand the weights out by shuffles, and the parts loop over a lane's column is unrolled, so several
// loads are in flight per lane (not one round trip per part and column, as a plain loop would wait).
template <typename TIn, typename TOut>
__global__ void merge_states(const TIn* __restrict__ o_parts, const float* __restrict__ lse_parts,
                             TOut* __restrict__ o, float* __restrict__ lse, const float* __restrict__ sinks,
                             long long rows, int parts, int d, int nq, int hq) {
  const long long row = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps
  const float neg_inf = -__int_as_float(0x7f800000);
  const float sink = sinks != nullptr ? sinks[(row / nq) % hq] : neg_inf;
  float mx = sink;
  for (int i = lane; i < parts; i += 32) mx = fmaxf(mx, lse_parts[i * rows + row]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  const float m_use = mx == neg_inf ? 0.f : mx;
  float total = 0.f;
  for (int i = lane; i < parts; i += 32) total += expf(lse_parts[i * rows + row] - m_use);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  total += expf(sink - m_use);  // 0 without sinks
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int c0 = 0; c0 < d; c0 += 32) {
    const int c = c0 + lane;
    float x = 0.f;
    for (int i0 = 0; i0 < parts; i0 += 32) {
      const float wl = i0 + lane < parts ? expf(lse_parts[(i0 + lane) * rows + row] - m_use) : 0.f;
      const int n = min(32, parts - i0);
#pragma unroll 4
      for (int j = 0; j < n; ++j) {
        const float w = __shfl_sync(0xffffffffu, wl, j);  // an empty part (w = 0) is never read
        if (w > 0.f && c < d) x = fmaf(w, to_float<TIn>(o_parts[((i0 + j) * rows + row) * d + c]), x);
      }
    }
    if (c < d) o[row * d + c] = from_float<TOut>(x * inv);
  }
  if (lane == 0) lse[row] = total > 0.f ? m_use + logf(total) : neg_inf;
}

}  // namespace cupyflash

// The tensor-core kernel for fp16/bf16 caches (decode_split_mma): it reads the definitions above.
#include "decode_mma.cuh"
