// Split-KV decode on tensor cores (issue 15, v2), for fp16/bf16 caches. Included by decode.cu after
// DecodeParams and its helpers (cached_len, sequence_params); float32 caches keep the FMA kernel there
// (mma with float32 operands would round them).
//
// One block owns (batch b, KV head, chunk of kM = 16 * kRowWarps packed rows, split of the key range), as the
// FMA kernel. The packed rows (the group's Hq / Hk heads x Nq queries, "GQA packing") are the M dimension of
// m16n8k16, padded to 16 per warp strip. The 4 warps are laid out as kRowWarps strips x kKeyWarps key slices:
//   - M <= 16 (Nq = 1): one strip, 4 key slices. Each warp takes its own 16 keys of every 64-key tile, with its
//     own running max/sum and O accumulators; the four partial states meet once, at the end, through shared
//     memory (the log-sum-exp merge of merge_states).
//   - M = 64 (speculative Nq = 16): 4 strips, 1 slice: warps split the rows and share the key tiles, as the
//     prefill forward (mma_forward.cu). M = 32 sits between (2 x 2).
// S = Q K^T with K through ldmatrix, online softmax in registers (exp2, scale folded in), P rounded to T as the
// A operand of O += P V (V through ldmatrix.trans). K/V tiles stream through a kStages-deep cp.async ring of
// 16-byte copies; a paged cache is located once per key row (one block-table read per row and thread, a shift
// when page_size is a power of two), never per element, and (v3) the reads for a tile go out one loop iteration
// before its copies, so a scattered table (page size 1: 64 entries a tile) never stalls a warp. With several
// splits, the last block of a row chunk merges the chunk's partials in the same launch (merge_if_last). (v5) The
// block's ends are short: Q's rows go out by cp.async ahead of the ring's copies; (v8) the merge loads a batch
// of splits' partials (16 at D = 128) together with their lse values, one L2 round trip, and padding rows of the
// combine are not stored.
#pragma once
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"

namespace cupyflash {

constexpr int kDecodeMmaThreads = 128;
constexpr int kDecodeMmaBc = 64;  // keys per tile (per stage)

// Shared memory of decode_split_mma: Q, then the K/V ring; after the loop the same bytes hold each warp's
// O (float32), m and l for the combine. The host sizes it with the same formulas (kernels/decode.py).
template <typename T, int kD, int kRowWarps, int kStages>
struct DecodeMmaSmem {
  using L = mma::TileLayout<kD>;
  static constexpr int kM = 16 * kRowWarps;
  static constexpr int kQ = kM * L::kPitch;                // elements
  static constexpr int kTile = kDecodeMmaBc * L::kPitch;  // elements of one K or V tile
  static constexpr int kLoopBytes = (kQ + 2 * kStages * kTile) * static_cast<int>(sizeof(T));
  static constexpr int kOPitch = kD + 8;  // floats: a quad's float2 stores of 8 rows fill two wavefronts
  static constexpr int kWarps = kDecodeMmaThreads / 32;
  static constexpr int kEpiBytes = 4 * (kWarps * 16 * kOPitch + 2 * kWarps * 16);
  static constexpr int kBytes = kLoopBytes > kEpiBytes ? kLoopBytes : kEpiBytes;
};

// Where the keys of sequence b live: a block-table row (paged) or one cache row (contiguous), with the
// device-side clamps of slot_offset (pages and rows inside the arrays whatever the tables hold).
struct CacheRows {
  const int* bt;  // this sequence's block-table row, or null (contiguous)
  int page_fixed, page_size, shift, last_blk, num_pages;
  bool pow2;
  __device__ __forceinline__ CacheRows(const DecodeParams& p, int b) {
    bt = p.block_table != nullptr ? p.block_table + b * p.bt_stride : nullptr;
    page_fixed = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    page_fixed = min(max(page_fixed, 0), p.num_pages - 1);
    page_size = p.page_size;
    pow2 = (page_size & (page_size - 1)) == 0;
    shift = __ffs(page_size) - 1;
    last_blk = p.pages_per_seq - 1;
    num_pages = p.num_pages;
  }
  __device__ __forceinline__ int block_of(int key) const {
    return min(pow2 ? key >> shift : key / page_size, last_blk);
  }
  // The raw block-table entry of key `key` (>= 0); contiguous: the fixed cache row. Issued a tile ahead of use
  // (decode v3): the load is in flight while the current tile is computed, so no warp stalls on it.
  __device__ __forceinline__ int fetch(int key) const { return bt == nullptr ? page_fixed : bt[block_of(key)]; }
  // Page (or cache row) and slot of key `key` from its fetched entry (clamped into the arrays).
  __device__ __forceinline__ void place(int key, int entry, int& page, int& row) const {
    if (bt == nullptr) {
      page = page_fixed;
      row = min(key, page_size - 1);
      return;
    }
    page = min(max(entry, 0), num_pages - 1);
    row = min(key - block_of(key) * page_size, page_size - 1);
  }
};

// Rows of a K/V tile that one thread copies (one 16-byte column chunk each).
template <int kD>
struct KVLoadShape {
  static constexpr int kChunks = kD / 8;
  static constexpr int kRowStep = kDecodeMmaThreads / kChunks;
  static constexpr int kRows = kDecodeMmaBc / kRowStep;
  static_assert(kDecodeMmaThreads % kChunks == 0 && kDecodeMmaBc % kRowStep == 0, "load layout");
};

// This thread's block-table entries for the rows of the tile at k0 (rows at or past k_end: unused, 0).
template <int kD>
__device__ __forceinline__ void fetch_pages(int (&entry)[KVLoadShape<kD>::kRows], const CacheRows& rows, int k0,
                                            int k_end) {
  using LS = KVLoadShape<kD>;
  const int r0 = threadIdx.x / LS::kChunks;
#pragma unroll
  for (int i = 0; i < LS::kRows; ++i) {
    const int key = k0 + r0 + i * LS::kRowStep;
    entry[i] = key < k_end ? rows.fetch(key) : 0;
  }
}

// Queue K and V rows [k0, k0 + 64) of head kvh into one ring slot, their block-table entries fetched before
// (fetch_pages). Thread: one 16-byte column chunk, rows r0, r0 + kRowStep, ...; rows at or past k_end and chunks
// past d are zero-filled (their P is 0, and 0 * garbage could be NaN).
template <typename T, int kD>
__device__ __forceinline__ void load_kv_mma(T* sK, T* sV, const DecodeParams& p, const CacheRows& rows, int kvh,
                                            int k0, int k_end, const int (&entry)[KVLoadShape<kD>::kRows]) {
  using L = mma::TileLayout<kD>;
  constexpr int kChunks = KVLoadShape<kD>::kChunks;
  constexpr int kRowStep = KVLoadShape<kD>::kRowStep;
  constexpr int kRows = KVLoadShape<kD>::kRows;
  const int c = threadIdx.x % kChunks, r0 = threadIdx.x / kChunks;
  const bool col_ok = c * 8 < p.attn.d;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);
  if (k0 + kDecodeMmaBc <= k_end && (rows.bt == nullptr || rows.pow2)) {
    // A whole tile (v7) of a contiguous cache or of a paged one with power-of-two pages: every row is below k_end
    // (<= the sequence's capacity, cached_len), so a row's slot is its key (contiguous) or the key's low bits
    // (paged; the page is still clamped into the array, whatever the table holds), with no per-row test or
    // division. The loop was bound by its instructions' latencies at two warps a scheduler (ncu, H200), and the
    // general path below spends ~40 instructions a row. The tile's shared bases go through a shuffle: left
    // uniform, ptxas addressed the copies as [R + UR + imm] and reused the policy's uniform register pair for
    // it, reading the L2 hint from an odd register (desc[UR1] / desc[UR7]: an illegal instruction on the GPU;
    // benchmarks/NOTES.md, s26).
    const unsigned long long policy = mma::l2_evict_first();  // each K/V byte is read once per call
    const unsigned k_base = __shfl_sync(0xffffffffu, mma::smem_u32(sK), 0);
    const unsigned v_base = __shfl_sync(0xffffffffu, mma::smem_u32(sV), 0);
    const int bytes = col_ok ? 16 : 0;
    const int col = col_ok ? c * 8 : 0;  // a chunk past d copies nothing; its address stays in the row
    const long long k_head = kvh * p.kc_s.h + col, v_head = kvh * p.vc_s.h + col;
    if (rows.bt == nullptr) {
      const long long k_row = rows.page_fixed * p.kc_s.b + k_head, v_row = rows.page_fixed * p.vc_s.b + v_head;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = r0 + i * kRowStep;
        const unsigned at = L::offset(r, c) * static_cast<int>(sizeof(T));
        mma::cp_async_16_once(k_base + at, kc + (k_row + (k0 + r) * p.kc_s.n), bytes, policy);
        mma::cp_async_16_once(v_base + at, vc + (v_row + (k0 + r) * p.vc_s.n), bytes, policy);
      }
    } else {
      const int slot_mask = rows.page_size - 1;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const int r = r0 + i * kRowStep, sl = (k0 + r) & slot_mask;
        const long long pg = min(max(entry[i], 0), rows.num_pages - 1);
        const unsigned at = L::offset(r, c) * static_cast<int>(sizeof(T));
        mma::cp_async_16_once(k_base + at, kc + (pg * p.kc_s.b + sl * p.kc_s.n + k_head), bytes, policy);
        mma::cp_async_16_once(v_base + at, vc + (pg * p.vc_s.b + sl * p.vc_s.n + v_head), bytes, policy);
      }
    }
    return;
  }
  const unsigned long long policy = mma::l2_evict_first();  // each K/V byte is read once per call
  int page[kRows], slot[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int key = k0 + r0 + i * kRowStep;
    page[i] = slot[i] = 0;
    if (col_ok && key < k_end) rows.place(key, entry[i], page[i], slot[i]);
  }
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int r = r0 + i * kRowStep;
    const bool ok = col_ok && k0 + r < k_end;
    const long long ko = ok ? page[i] * p.kc_s.b + kvh * p.kc_s.h + slot[i] * p.kc_s.n + c * 8 : 0;
    const long long vo = ok ? page[i] * p.vc_s.b + kvh * p.vc_s.h + slot[i] * p.vc_s.n + c * 8 : 0;
    mma::cp_async_16_once(mma::smem_u32(sK + L::offset(r, c)), kc + ko, ok ? 16 : 0, policy);
    mma::cp_async_16_once(mma::smem_u32(sV + L::offset(r, c)), vc + vo, ok ? 16 : 0, policy);
  }
}

// Grid: (B, Hk * m_chunks, splits); 128 threads. Packed row r of the block is row m0 + r of KV head kvh's
// group: query head kvh * group + (m0 + r) / nq, query (m0 + r) % nq.
template <typename T, int kD, int kRowWarps, int kStages, class Policy>
__global__ void __launch_bounds__(kDecodeMmaThreads, 2) decode_split_mma(const __grid_constant__ DecodeParams p) {
  using S = DecodeMmaSmem<T, kD, kRowWarps, kStages>;
  using L = mma::TileLayout<kD>;
  using namespace mma;
  constexpr int kKeyWarps = S::kWarps / kRowWarps;
  constexpr int kBcW = kDecodeMmaBc / kKeyWarps;  // keys of a tile per warp
  constexpr int kNT = kBcW / 8;                   // n8 tiles of a warp's S
  constexpr int kKS = kD / 16;                    // k16 steps over the head dim
  constexpr bool kQInRegs = kD <= 128;            // Q fragments held through the loop (D = 256: reloaded)
  static_assert(S::kWarps % kRowWarps == 0 && kBcW % 16 == 0, "warp layout");
  static_assert(kStages >= 2, "the ring needs a slot to fill while another is read");

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + S::kQ;
  T* sV = sK + kStages * S::kTile;

  const AttentionParams& a = p.attn;
  const int b = blockIdx.x;
  const int m_chunks = (p.m_rows + S::kM - 1) / S::kM;
  const int kvh = blockIdx.y / m_chunks, m0 = (blockIdx.y - kvh * m_chunks) * S::kM;
  const int nk = cached_len(p, b) + p.n_new;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rw = warp / kKeyWarps, kw = warp % kKeyWarps;

  Policy pol(sequence_params(a, nk));
  const CacheRows rows(p, b);

  // This split's keys: the keys any row may see, cut into gridDim.z chunks of whole tiles (as the FMA kernel).
  const Range keys = pol.mask.keys_of(0, a.nq);
  const int span = max(0, keys.end - keys.begin);
  const int chunk = ((span + gridDim.z - 1) / gridDim.z + kDecodeMmaBc - 1) / kDecodeMmaBc * kDecodeMmaBc;
  const int k_begin = keys.begin + blockIdx.z * chunk;
  const int k_end = min(keys.end, k_begin + chunk);
  const int n_tiles = k_end > k_begin ? (k_end - k_begin + kDecodeMmaBc - 1) / kDecodeMmaBc : 0;

  // Q rows of the chunk (zero past m_rows and d) by 16-byte cp.async, issued before any K/V copy so that they do
  // not queue behind the ring's; the ring's first group carries them with tile 0. Only where q and its strides are
  // 16-byte aligned (a dense or rotated q is): else plain loads below.
  const T* gq = static_cast<const T*>(a.q);
  constexpr int kQVec = 16 / static_cast<int>(sizeof(T));
  const bool q_async = reinterpret_cast<unsigned long long>(gq) % 16 == 0 && a.q_s.b % kQVec == 0 &&
                       a.q_s.h % kQVec == 0 && a.q_s.n % kQVec == 0;
  if (q_async) {
    constexpr int kQChunks = kD / kQVec;
    for (int e = threadIdx.x; e < S::kM * kQChunks; e += kDecodeMmaThreads) {
      const int r = e / kQChunks, c = e - r * kQChunks, row = m0 + r;
      const bool ok = row < p.m_rows && c * kQVec < a.d;
      const T* src = gq;
      if (ok) src += b * a.q_s.b + (kvh * a.group + row / a.nq) * a.q_s.h + (row % a.nq) * a.q_s.n + c * kQVec;
      cp_async_16(smem_u32(sQ + L::offset(r, c)), src, ok ? 16 : 0);
    }
  }

  // The ring's first kStages - 1 tiles (their table entries read and used at once), then the entries of the
  // next tile to queue: from here on each tile's entries are fetched one loop iteration before its copies.
  int entry[KVLoadShape<kD>::kRows];
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n_tiles) {
      fetch_pages<kD>(entry, rows, k_begin + s * kDecodeMmaBc, k_end);
      load_kv_mma<T, kD>(sK + s * S::kTile, sV + s * S::kTile, p, rows, kvh, k_begin + s * kDecodeMmaBc, k_end, entry);
    }
    cp_async_commit();
  }
  fetch_pages<kD>(entry, rows, k_begin + (kStages - 1) * kDecodeMmaBc, k_end);

  // Q rows of an unaligned q: few bytes, plain loads (its rows need no alignment).
  if (!q_async) {
    for (int e = threadIdx.x; e < S::kM * kD; e += kDecodeMmaThreads) {
      const int r = e / kD, c = e - r * kD, row = m0 + r;
      T x = from_float<T>(0.f);
      if (row < p.m_rows && c < a.d) {
        const int h = kvh * a.group + row / a.nq, qi = row % a.nq;
        x = gq[b * a.q_s.b + h * a.q_s.h + qi * a.q_s.n + c];
      }
      sQ[L::offset(r, c / 8) + c % 8] = x;
    }
  }

  // This lane's two rows (g, g + 8 of its strip): query index and score rule (ALiBi's slope is per head).
  // Rows past m_rows borrow the last row's head (they are computed, on zero Q, and never stored).
  int qi[2];
  typename Policy::Score score[2] = {pol.score, pol.score};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = min(m0 + rw * 16 + lane / 4 + 8 * h, p.m_rows - 1);
    qi[h] = row % a.nq;
    score[h].at_head(a, b, kvh * a.group + row / a.nq);
  }

  float acc[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  float m_run[2], l_run[2];
  softmax_start(m_run, l_run, -CUDART_INF_F);  // the sink joins once, in the combine

  const LdmRows<kD> q_rows(rw * 16 + (lane & 15), lane >> 4);                 // A of Q K^T
  const LdmRows<kD> k_rows((lane >> 4) * 8 + (lane & 7), (lane >> 3) & 1);    // B of Q K^T
  const LdmRows<kD> v_rows(lane & 15, lane >> 4);                              // B of P V (.trans)
  const uint32_t sQ_u = smem_u32(sQ), sK_u = smem_u32(sK), sV_u = smem_u32(sV);
  constexpr int kQFrags = kQInRegs ? kKS : 1;
  uint32_t qa[kQFrags][4];
  if (q_async) cp_async_wait<kStages - 2>();  // Q's copies landed (with tile 0, which the loop waits for anyway)
  __syncthreads();  // Q stored
  if constexpr (kQInRegs) {
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) ldmatrix_x4(qa[ks], q_rows.at(sQ_u, ks));
  }

  for (int t = 0; t < n_tiles; ++t) {
    const int slot = t % kStages;
    cp_async_wait<kStages - 2>();  // tile t has landed for this thread...
    __syncthreads();               // ...and for every thread; slot t - 1 is free again
    {
      const int tp = t + kStages - 1;
      if (tp < n_tiles) {
        load_kv_mma<T, kD>(sK + (tp % kStages) * S::kTile, sV + (tp % kStages) * S::kTile, p, rows, kvh,
                           k_begin + tp * kDecodeMmaBc, k_end, entry);
        // The next iteration's table entries (a contiguous cache has none to read).
        if (rows.bt != nullptr) fetch_pages<kD>(entry, rows, k_begin + (tp + 1) * kDecodeMmaBc, k_end);
      }
      cp_async_commit();
    }
    const int key0 = k_begin + t * kDecodeMmaBc + kw * kBcW;  // this warp's first key

    // S = Q K^T on this warp's rows and keys.
    float s[kNT][4];
#pragma unroll
    for (int n = 0; n < kNT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    const uint32_t sKs = sK_u + slot * S::kTile * 2;
#pragma unroll
    for (int ks = 0; ks < kKS; ++ks) {
      uint32_t qf[4];
      if constexpr (kQInRegs) {
#pragma unroll
        for (int i = 0; i < 4; ++i) qf[i] = qa[ks][i];
      } else {
        ldmatrix_x4(qf, q_rows.at(sQ_u, ks));
      }
      mma_k16<T, false>(s, qf, [&](int n2) { return k_rows.at(sKs, ks, kw * kBcW + n2 * 16); });
    }

    // Scores and mask. Rows are packed (query qi[h] of some head), so the strip helpers of mma_softmax.cuh,
    // which take rows as consecutive queries, are spelled out here. A conservative test over every query
    // keeps full tiles free of per-element checks.
    float c = 1.f;
    if constexpr (Policy::Score::kIdentity) {
      c = positive_scale<kNT>(s, a.scale_log2);
    } else {
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + n * 8 + (lane & 3) * 2 + (e & 1);
          s[n][e] = score[e >> 1].template log2_score<true>(s[n][e], qi[e >> 1], key);
        }
      }
    }
    if (key0 + kBcW > k_end || pol.mask.partial(0, a.nq, key0, key0 + kBcW)) {
#pragma unroll
      for (int n = 0; n < kNT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + n * 8 + (lane & 3) * 2 + (e & 1);
          if (!(key < k_end && pol.mask.visible(qi[e >> 1], key))) s[n][e] = -CUDART_INF_F;
        }
      }
    }
    float alpha[2];
    online_softmax<kNT>(s, c, m_run, l_run, alpha);
    // O is rescaled only when some row's running max moved (v7): after the first tiles a max rarely moves, and
    // the skipped multiplies are by exactly 1, so O is bit for bit the same.
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        acc[n][0] *= alpha[0];
        acc[n][1] *= alpha[0];
        acc[n][2] *= alpha[1];
        acc[n][3] *= alpha[1];
      }
    }

    // O += P V on this warp's keys: C tiles 2kk, 2kk + 1 of S are the A fragment of k16 step kk.
    const uint32_t sVs = sV_u + slot * S::kTile * 2;
#pragma unroll
    for (int kk = 0; kk < kBcW / 16; ++kk) {
      uint32_t pa[4];
      pack_a_step<T>(pa, s, kk);
#pragma unroll
      for (int n2 = 0; n2 < kD / 16; ++n2) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_rows.at(sVs, n2, kw * kBcW + kk * 16));
        mma_16816<T>(acc[2 * n2], pa, bv[0], bv[1]);
        mma_16816<T>(acc[2 * n2 + 1], pa, bv[2], bv[3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every copy landed and every warp is done with the ring: it becomes the combine buffer

  // Each warp's partial state (O unnormalised, m in log2 units, l) into shared memory.
  float* so = reinterpret_cast<float*>(smem_raw);
  float* sm_m = so + S::kWarps * 16 * S::kOPitch;
  float* sm_l = sm_m + S::kWarps * 16;
  {
    const int g = lane / 4, t2 = (lane & 3) * 2;
    // Only rows below m_rows are combined: padding rows (12 of 16 at Nq = 1, group 4) are not stored.
    const bool lo_row = m0 + rw * 16 + g < p.m_rows, hi_row = m0 + rw * 16 + g + 8 < p.m_rows;
    float* o_lo = &so[(warp * 16 + g) * S::kOPitch + t2];
    float* o_hi = o_lo + 8 * S::kOPitch;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      if (lo_row) *reinterpret_cast<float2*>(o_lo + n * 8) = make_float2(acc[n][0], acc[n][1]);
      if (hi_row) *reinterpret_cast<float2*>(o_hi + n * 8) = make_float2(acc[n][2], acc[n][3]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = quad_sum(l_run[h]);
      if ((lane & 3) == 0) {
        sm_m[warp * 16 + g + 8 * h] = m_run[h];
        sm_l[warp * 16 + g + 8 * h] = l;
      }
    }
  }
  __syncthreads();

  // Combine the key slices of each row (merge_states' rule; with one split the sink joins here as a part
  // of weight exp2(sink) and no output) and store: o and lse, or the float32 partials that the chunk's last
  // split block merges (merge_if_last, decode.cu).
  const long long rows_total = static_cast<long long>(a.batch) * a.hq * a.nq;
  const int rows_here = min(S::kM, p.m_rows - m0);
  for (int e = threadIdx.x; e < rows_here * (kD / 2); e += kDecodeMmaThreads) {
    const int r = e / (kD / 2), col = (e - r * (kD / 2)) * 2, row = m0 + r;
    const int h = kvh * a.group + row / a.nq, q = row % a.nq;
    const int w0 = (r / 16) * kKeyWarps, rr = r % 16;
    const float sink2 = gridDim.z == 1 ? sink_log2(a, h) : -CUDART_INF_F;
    float mx = sink2;
#pragma unroll
    for (int k = 0; k < kKeyWarps; ++k) mx = fmaxf(mx, sm_m[(w0 + k) * 16 + rr]);
    const float m_use = mx == -CUDART_INF_F ? 0.f : mx;
    float tot = sink2 == -CUDART_INF_F ? 0.f : fast_exp2(sink2 - m_use);
    float o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int k = 0; k < kKeyWarps; ++k) {
      const int w = w0 + k;
      const float wt = fast_exp2(sm_m[w * 16 + rr] - m_use);  // 0 for a slice that saw no key
      tot = fmaf(sm_l[w * 16 + rr], wt, tot);
      const float2 x = *reinterpret_cast<const float2*>(&so[(w * 16 + rr) * S::kOPitch + col]);
      o0 = fmaf(wt, x.x, o0);
      o1 = fmaf(wt, x.y, o1);
    }
    // MUFU reciprocal and log2 (~2^-22 relative): this tail runs once a block, its code cold in the instruction
    // cache, and IEEE division and log2f (a polynomial, slow-path calls) took it from 0.6 to 1.3 us (s27 stamps).
    const float inv = tot > 0.f ? __fdividef(1.f, tot) : 0.f;
    const float lse = tot > 0.f ? (m_use + fast_log2(tot)) * kLn2 : -CUDART_INF_F;
    if (gridDim.z == 1) {
      T* o = static_cast<T*>(a.o) + b * a.o_s.b + h * a.o_s.h + q * a.o_s.n;
      if (col < a.d) store2<T>(o + col, o0 * inv, o1 * inv);
      if (col == 0) a.lse[b * a.lse_s.b + h * a.lse_s.h + q * a.lse_s.n] = lse;
    } else {
      const long long prow = blockIdx.z * rows_total + (static_cast<long long>(b) * a.hq + h) * a.nq + q;
      if (col < a.d) *reinterpret_cast<float2*>(p.o_part + prow * a.d + col) = make_float2(o0 * inv, o1 * inv);
      if (col == 0) p.lse_part[prow] = lse;
    }
  }
  if (gridDim.z > 1) merge_if_last<T, kD>(p, b, kvh, m0, S::kM);
}

}  // namespace cupyflash
