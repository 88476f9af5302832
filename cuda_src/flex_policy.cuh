// User-written mask and score functions (issue 17 part 3, FlexAttention's mask_mod / score_mod).
//
// cupyflash/flex.py pastes a user's snippets into a generated struct `Fns` (static device functions
// mask_mod, score_mod, score_grad with the documented names in scope) and compiles one kernel family's source
// after it; the kernels are instantiated with `Policy<Mask, FlexScore<Base, Fns>>`. Nothing in the kernels
// knows about snippets: FlexScore is one more score policy, like ArrayScore, because the score hook is the one
// that knows (b, h) (at_head). With a block mask, mask_mod moves into the mask policy instead (FlexMask, below:
// only partial tiles evaluate it) and the score keeps score_mod alone (ScoreFns). Per element, in this order:
//
//   s = Base(q . k)                     // the built-in rules: scale, softcap, ALiBi (natural units here)
//   if (!mask_mod(b, h, q, k)) -inf     // ANDed with the built-in causal/window mask, which kernels apply
//   else s = score_mod(s, b, h, q, k)
//
// The backward's ds_factor is d(new score)/d(score) = score_grad(new_score, ...), with new_score recovered from
// P and lse (the kernels keep P, not the raw score: no extra registers in backwards at their register limit).
// The built-in softcap's own derivative needs the score before score_mod, so softcap with score_mod has no
// backward (refused in Python). Snippets are evaluated only inside the problem (q < nq, k < nk): padded rows
// and keys of a tile never reach them.
#pragma once
#include "attention_policy.cuh"

namespace cupyflash {

// What an aux array's accessor returns: float for the float types, the integer type itself, bool.
template <class T> struct AuxValue { using type = T; };
template <> struct AuxValue<__half> { using type = float; };
template <> struct AuxValue<__nv_bfloat16> { using type = float; };

template <class T> __device__ __forceinline__ typename AuxValue<T>::type aux_value(T x) { return x; }
template <> __device__ __forceinline__ float aux_value<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float aux_value<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// A user's aux array of N <= 4 dims, read through its element strides: name(i, j, ...) with exactly N
// indices. An index outside [0, extent) reads 0 (never memory outside the array, whatever the snippet computes).
// Extents and strides stay in the kernel's constant bank (read where used, no registers held).
template <class T, int N>
class AuxArray {
  const AttentionParams* P;  // private: a snippet reads values through operator() only
  int slot;
  const T* data;

 public:
  __device__ AuxArray(const AttentionParams* p, int slot_, const void* data_)
      : P(p), slot(slot_), data(static_cast<const T*>(data_)) {}
  template <class... I>
  __device__ __forceinline__ typename AuxValue<T>::type operator()(I... idx) const {
    static_assert(sizeof...(I) == N, "an aux array takes one index per dimension");
    const long long ix[N] = {static_cast<long long>(idx)...};
    long long off = 0;
    bool ok = true;
#pragma unroll
    for (int d = 0; d < N; ++d) {
      ok = ok && ix[d] >= 0 && ix[d] < P->aux_n[slot][d];
      off += ix[d] * P->aux_s[slot][d];
    }
    return ok ? aux_value<T>(data[off]) : typename AuxValue<T>::type(0);
  }
};

// The user's functions on top of a built-in score rule Base (PlainScore or ModScore). Fns (generated) says
// which snippets exist (kMask, kScore) and holds them.
template <class Base, class Fns>
struct FlexScore {
  static constexpr bool kIdentity = false;
  Base base;
  const AttentionParams* P;  // the kernel's __grid_constant__ params (sizes and aux read in place)
  int b = 0, h = 0;          // the global batch index (leading dims flattened) and the query head
  __device__ FlexScore(const AttentionParams& p, int nq, int nk) : base(p, nq, nk), P(&p) {}
  __device__ __forceinline__ void at_head(const AttentionParams& p, int b_, int h_) {
    base.at_head(p, b_, h_);
    b = p.dropout_b0 + b_;  // a launch of one sub-batch of leading dims starts at dropout_b0
    h = h_;
  }
  __device__ __forceinline__ bool inside(int q, int k) const { return q < P->nq && k < P->nk; }
  template <bool kFast>
  __device__ __forceinline__ float log2_score(float r, int q, int k) const {
    float x;
    if constexpr (Base::kIdentity) x = r * P->scale_log2;
    else x = base.template log2_score<kFast>(r, q, k);
    if (inside(q, k)) {
      bool keep = true;
      if constexpr (Fns::kMask) keep = Fns::mask_mod(*P, b, h, q, k);
      if (!keep) {
        x = -__int_as_float(0x7f800000);
      } else if constexpr (Fns::kScore) {
        const float s = Base::kIdentity ? r * P->scale : x * kLn2;
        x = Fns::score_mod(*P, s, b, h, q, k) * kLog2e;
      }
    }
    // As ArrayScore: one element's loads are used before the next element's are issued (no hoisting of a
    // tile's worth of aux loads into registers the tensor-core kernels do not have).
    asm volatile("" : "+f"(x) : : "memory");
    return x;
  }
  template <bool kFast>
  __device__ __forceinline__ float ds_factor(float Pij, float lse2, int q, int k) const {
    if constexpr (Fns::kScore) {
      if (!(Pij > 0.f) || !inside(q, k)) return 0.f;
      const float lg = kFast ? fast_log2(Pij) : log2f(Pij);
      return Fns::score_grad(*P, (lg + lse2) * kLn2, b, h, q, k);
    } else if constexpr (Base::kIdentity) {
      return 1.f;
    } else {
      return base.template ds_factor<kFast>(Pij, lse2, q, k);  // mask_mod alone leaves visible scores as they are
    }
  }
};

// Fns without its mask_mod: the scores' half of a set of snippets when FlexMask (below) evaluates the mask.
template <class Fns>
struct ScoreFns : Fns {
  static constexpr bool kMask = false;
};

}  // namespace cupyflash

namespace cupyflash {

// A built-in mask (NoMask, Causal, Window) narrowed by a block mask (create_block_mask): keys_of/queries_of
// intersect Base's range with the blocks that are not empty for this block's (b, h), so the kernels' tile
// loops never visit tiles before the first or after the last visible block of a row or column (for a document
// or prefix-LM mask that is every empty tile). The ranges are conservative for any kernel tile: a tile covering
// part of a block takes that block's whole range. Per-element decisions stay with Base and mask_mod.
//
// The (b, h) of a kernel's block comes from its grid: the bh axis spans batch * heads, with heads = Hq for
// query-major kernels (forwards, the separate dQ pass) and Hk for key-major ones (backwards), where the range is
// the union over the kv head's group of query heads.
template <class Base>
struct BlockMasked {
  static constexpr bool kNoDQTurns = true;  // deterministic=True with a block mask is refused (dq_turns.cuh)
  Base base;
  const AttentionParams* P;
  __device__ BlockMasked(const AttentionParams& p, int nq, int nk) : base(p, nq, nk), P(&p) {}
  __device__ __forceinline__ bool visible(int q, int k) const { return base.visible(q, k); }
  __device__ __forceinline__ bool partial(int q0, int q1, int k0, int k1) const { return base.partial(q0, q1, k0, k1); }
  __device__ __forceinline__ Range keys_of(int q0, int q1) const {
    return narrow(base.keys_of(q0, q1), P->bm_kv, q0, q1, P->bm_nqb);
  }
  __device__ __forceinline__ Range queries_of(int k0, int k1) const {
    return narrow(base.queries_of(k0, k1), P->bm_q, k0, k1, P->bm_nkb);
  }
  // r intersected with the union of the [first, last) blocks of table rows covering [x0, x1), over the query heads
  // [h0, h0 + nh) of this kernel block's batch b. (Decoded here, where the ranges are asked, once or twice a
  // block: kernels that rebuild their policy per step, as the backwards do, then pay nothing per step for it.)
  __device__ Range narrow(Range r, const int* table, int x0, int x1, int rows) const {
    if (r.end <= r.begin || table == nullptr) return r;
    const AttentionParams& p = *P;
    const TileCoord tc = tile_coord(p);
    const int heads = (p.heads_fastest ? gridDim.x : gridDim.y) / p.batch;
    const int nh = heads == p.hq ? 1 : p.group, h0 = tc.bh % heads * nh;
    const int bb = p.bm_bb == 1 ? 0 : tc.bh / heads + p.dropout_b0;
    const int s = p.bm_size;
    const int i0 = max(x0, 0) / s, i1 = min((x1 + s - 1) / s, rows);
    int lo = 0x7fffffff, hi = 0;
    for (int h = h0; h < h0 + nh; ++h) {
      const int hb = p.bm_hb == 1 ? 0 : h;
      const int* row = table + 2LL * ((static_cast<long long>(bb) * p.bm_hb + hb) * rows);
      for (int i = i0; i < i1; ++i) {
        lo = min(lo, row[2 * i]);
        hi = max(hi, row[2 * i + 1]);
      }
      if (p.bm_hb == 1) break;
    }
    const Range out = {max(r.begin, lo >= hi ? 0 : lo * s), min(r.end, lo >= hi ? 0 : hi * s)};
    return uniform_range(out.end > out.begin ? out : Range{0, 0});  // read from memory: uniform only by REDUX
  }
};

// mask_mod as a mask policy (issue 17 speed): a pair is visible iff Base shows it and mask_mod(b, h, q, k) holds,
// evaluated where the built-in masks are, in the kernels' mask_strip, which runs only on partial tiles. A tile
// is partial when Base says so or when it is not inside a run of FULL blocks (create_block_mask's full runs, per
// block row and per block column the longest run): tiles inside one skip mask_mod and its aux loads altogether
// (for a document or prefix-LM mask every FULL block of a row or column lies in one run). The ranges stay
// BlockMasked's (the union over a key-major block's group of heads); visible and partial are those of one
// (b, h), set by at_head, which every kernel calls next to the score's before asking partial or visible.
// Pairs outside the problem (q >= nq: a tile's padded rows) are Base's alone: snippets never see them.
//
// kBits: the block mask also holds mask_mod's value of every pair of its mixed 64 x 64 tiles as bits
// (BlockMask.bits_q / bits_k, AttentionParams.bm_bit_index), and partial tiles read those instead of running
// mask_mod: mask_strip (mma_softmax.cuh) loads each lane's two rows' words once a strip (strip_words), then a
// shift and a test a pair. (s23: per pair, mask_mod cost ~25 instructions and two dependent loads; the doc8
// forward's partial tiles, 15% of its steps, took 40% of its time.)
template <class Base, class Fns, bool kBits = false>
struct FlexMask : BlockMasked<Base> {
  static_assert(Fns::kMask, "FlexMask evaluates a mask_mod");
  static constexpr bool kPerHead = true;    // kernels call at_head (mask_at_head)
  static constexpr bool kStripBits = kBits;  // mask_strip reads strip_words
  int fb = 0, fh = 0;  // the global batch index and query head of at_head
  int table = 0;       // the first line of this (b, h)'s tables, in (b, h) units (0 where the tables broadcast)
  // Does the tile of the last partial() call leave the full runs? Only then does visible() run mask_mod: a tile
  // that is partial for Base alone (the causal diagonal) inside FULL blocks tests Base only. Every kernel asks
  // partial() for a tile right before its visible() calls; true until then (safe).
  mutable bool needs_mod = true;
  __device__ FlexMask(const AttentionParams& p, int nq, int nk) : BlockMasked<Base>(p, nq, nk) {}
  __device__ __forceinline__ void at_head(const AttentionParams& p, int b_, int h_) {
    fb = p.dropout_b0 + b_;  // as FlexScore: a launch of one sub-batch starts at dropout_b0
    fh = h_;
    table = (p.bm_bb == 1 ? 0 : fb) * p.bm_hb + (p.bm_hb == 1 ? 0 : fh);
  }
  __device__ __forceinline__ bool visible(int q, int k) const {
    const AttentionParams& p = *this->P;
    if (!this->base.visible(q, k)) return false;
    if (!needs_mod || q >= p.nq) return true;
    if constexpr (kBits) {  // one pair (the portable and decode kernels; mask_strip reads a strip's words at once)
      const int nqt = (p.nq + 63) >> 6, nkt = (p.nk + 63) >> 6;  // (q < nq, and k < nk as Base shows it)
      const int slot = __ldg(p.bm_bit_index + (static_cast<long long>(table) * nqt + (q >> 6)) * nkt + (k >> 6));
      if (slot < 0) return slot == -1;
      return (__ldg(p.bm_bits_q + 64LL * slot + (q & 63)) >> (k & 63)) & 1ull;
    }
    int keep = Fns::mask_mod(p, fb, fh, q, k) ? 1 : 0;
    // As FlexScore: one element's aux loads are used before the next element's are issued.
    asm volatile("" : "+r"(keep) : : "memory");
    return keep != 0;
  }
  // kBits: the words of rows row and row + 8 (query rows, or keys with kKeyRows) over kChunks 64-column
  // chunks from col0 & ~63 (columns: keys, or queries with kKeyRows), each shifted right by `shift`. Rows past the
  // problem's tiles read all ones (Base decides there, as without bits).
  template <bool kKeyRows, int kChunks>
  __device__ __forceinline__ void strip_words(unsigned long long (&w)[2][kChunks], int row, int col0, int shift) const {
    const AttentionParams& p = *this->P;
    const int nqt = (p.nq + 63) >> 6, nkt = (p.nk + 63) >> 6;
    const unsigned long long* bits = kKeyRows ? p.bm_bits_k : p.bm_bits_q;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int ct = (col0 >> 6) + c, rt = row >> 6;  // row and row + 8 share a tile (rows start at multiples of 16)
      const int qt = kKeyRows ? ct : rt, kt = kKeyRows ? rt : ct;
      int slot = -1;
      if (qt < nqt && kt < nkt) slot = __ldg(p.bm_bit_index + (static_cast<long long>(table) * nqt + qt) * nkt + kt);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const unsigned long long word =
            slot >= 0 ? __ldg(bits + 64LL * slot + ((row + 8 * r) & 63)) : slot == -1 ? ~0ull : 0ull;
        w[r][c] = word >> shift;
      }
    }
  }
  __device__ __forceinline__ bool partial(int q0, int q1, int k0, int k1) const {
    needs_mod = !all_full(q0, q1, k0, k1);
    return needs_mod || this->base.partial(q0, q1, k0, k1);
  }
  // The block holding index x >= 0: x / bm_size as a multiply and a shift (BlockMask.params' magic number).
  __device__ __forceinline__ static int block_of(const AttentionParams& p, int x) {
    return static_cast<int>((static_cast<unsigned long long>(x) * p.bm_magic) >> p.bm_magic_shift);
  }
  // Are the blocks covering [q0, q1) x [k0, k1) (clipped to the problem) inside this (b, h)'s full runs? Asked per
  // tile or warp strip, so it costs one 8-byte load: a strip one block wide (the backwards' 16 keys) asks its block
  // column's run, one block high (the forwards' 16 rows) its block row's. (s22: a loop over the tile's byte states,
  // its table address rebuilt per block, was ~70 of a prefix-LM backward step's ~1600 instructions a warp.)
  __device__ bool all_full(int q0, int q1, int k0, int k1) const {
    const AttentionParams& p = *this->P;
    q0 = max(q0, 0), q1 = min(q1, p.nq) - 1, k0 = max(k0, 0), k1 = min(k1, p.nk) - 1;  // the last row and key
    if (q1 < q0 || k1 < k0) return true;  // no pair of the problem (a padded strip): nothing for mask_mod, no read
    const int i0 = block_of(p, q0), i1 = block_of(p, q1), j0 = block_of(p, k0), j1 = block_of(p, k1);
    if (j0 == j1) {
      const int2 run = __ldg(reinterpret_cast<const int2*>(p.bm_full_q) + table * p.bm_nkb + j0);
      return run.x <= i0 && i1 < run.y;
    }
    const int2* const row_runs = reinterpret_cast<const int2*>(p.bm_full_kv) + table * p.bm_nqb;
#pragma unroll 1
    for (int i = i0; i <= i1; ++i) {  // (peeling the first row measured 0-2% faster but spills in portable_fwd)
      const int2 run = __ldg(row_runs + i);
      if (j0 < run.x || j1 >= run.y) return false;
    }
    return true;
  }
};

}  // namespace cupyflash
