// Variant policies: which (query, key) pairs an attention problem scores, and how it scores them.
//
// Every kernel of every family takes one policy type as a template argument (FlashAttention-3 passes its
// Is_causal/Is_local/Has_softcap flags the same way) and asks it, through one interface, everything that
// depends on the variant:
//
//   Policy pol(p);                        // from the kernel's AttentionParams (run-time arguments)
//   Policy pol(p, seq);                   // ... for one sequence of a varlen pack (its nq, nk)
//   pol.mask.visible(q, k)                // may query q see key k? (k >= nk is never visible)
//   pol.mask.keys_of(q0, q1)              // keys any query of [q0, q1) may see: a Range
//   pol.mask.queries_of(k0, k1)           // queries that may see any key of [k0, k1): a Range
//   pol.mask.partial(q0, q1, k0, k1)      // does the tile hide some pair? (else no per-element test)
//   Policy::Score::kIdentity              // scores are scale * q . k (the scale folds into exp2's FFMA)
//   pol.score.at_head(p, b, h)            // per-head run-time values (ALiBi slope)
//   mask_at_head(pol.mask, p, b, h)       // ... of a mask that has them (FlexMask); before partial/visible
//   pol.score.log2_score<kFast>(r, q, k)  // r = q . k -> the final score in log2 units
//   pol.score.ds_factor<kFast>(P, lse2, q, k)  // d(score)/d(scale * q . k), recomputed from P in the backward
//   sink_logit(p, h)                      // attention sinks: a per-head logit in every row's softmax
//   pol.score.add_dbias(ds, q, k)         // ArrayScore only (HasBiasGrad): the bias gradient, per pair
//   prefetch_score_arrays<kL1, Score, kRows, kCols>(p, b, h, q0, k0)  // cache hint: a tile's mask/bias rows
//   prefetch_score_arrays<kL1, kRows, kCols>(pol.score, q0, k0)        // ... from a score after at_head
//
// Kernels visit only the tiles that the ranges cover, test elements only in partial tiles, and never
// spell out a mask or score rule of their own. Python names the policy type (cupyflash/variants.py) and
// the NumPy reference implements the same rules (cupyflash/reference.py), so the three read side by side.
// Query and key indices are those of the problem: 0 <= q < nq, 0 <= k < nk; the order inside a score is
// scale -> softcap -> ALiBi -> mask -> softmax (with the sink).
#pragma once
#include "attention_params.cuh"
#include "common.cuh"
#include "dropout.cuh"
#include "score_tile.cuh"

namespace cupyflash {

// A compile-time flag that a policy type may declare (`static constexpr bool member`): Trait<P>::value is the flag,
// false for a type that does not declare it (the built-in policies declare few). Kernels test it with if constexpr.
#define CUPYFLASH_POLICY_FLAG(Trait, member)      \
  template <class P, class = void>                \
  struct Trait {                                  \
    static constexpr bool value = false;          \
  };                                              \
  template <class P>                              \
  struct Trait<P, decltype(void(P::member))> {    \
    static constexpr bool value = P::member;      \
  }

// A half-open index range; empty when begin >= end.
struct Range {
  int begin, end;
};

// The union of r over the warp's active lanes (r itself where they agree, as for a block's tile range), which ptxas
// then knows to be warp-uniform: REDUX (sm_80 and later) writes a uniform register. A range computed from values
// read from memory (block masks' tables) is a per-thread value to ptxas, and a tile loop bounded by it did its index
// and descriptor arithmetic on the vector pipe instead of the uniform datapath (s22: ~100 more instructions a
// wgmma backward step).
__device__ __forceinline__ Range uniform_range(Range r) {
#if __CUDA_ARCH__ >= 800
  const unsigned lanes = __activemask();
  return {__reduce_min_sync(lanes, r.begin), __reduce_max_sync(lanes, r.end)};
#else
  return r;
#endif
}

// The tiles of `tile` indices that cover r: [first, last) in tile units ({0, 0} when r is empty).
__device__ __forceinline__ Range tiles_covering(Range r, int tile) {
  if (r.end <= r.begin) return {0, 0};
  return {r.begin / tile, (r.end + tile - 1) / tile};
}

// Every key visible to every query (only the end of the key sequence is masked).
struct NoMask {
  int nq, nk;
  __device__ NoMask(const AttentionParams&, int nq_, int nk_) : nq(nq_), nk(nk_) {}
  __device__ __forceinline__ bool visible(int, int k) const { return k < nk; }
  __device__ __forceinline__ Range keys_of(int, int) const { return {0, nk}; }
  __device__ __forceinline__ Range queries_of(int, int) const { return {0, nq}; }
  __device__ __forceinline__ bool partial(int, int, int, int k1) const { return k1 > nk; }
};

// Causal, bottom-right aligned (FlashAttention >= 2.1): key k is visible to query q iff k <= q + nk - nq.
// With Nq > Nk the first Nq - Nk queries see no key at all.
struct Causal {
  static constexpr bool kOneSided = true;  // a query sees no key past its diagonal (OneSided)
  int nq, nk, offset;
  __device__ Causal(const AttentionParams&, int nq_, int nk_) : nq(nq_), nk(nk_), offset(nk_ - nq_) {}
  __device__ __forceinline__ bool visible(int q, int k) const { return k < nk && k <= q + offset; }
  // The last query of the range (clipped to nq) sees the most keys.
  __device__ __forceinline__ Range keys_of(int, int q1) const {
    return {0, max(0, min(nk, min(q1, nq) + offset))};
  }
  // The first query on or below the diagonal of key k0 sees it, and every later query does too.
  __device__ __forceinline__ Range queries_of(int k0, int) const { return {min(nq, max(0, k0 - offset)), nq}; }
  __device__ __forceinline__ bool partial(int q0, int, int, int k1) const { return k1 > nk || k1 - 1 > q0 + offset; }
};

// A local (sliding-window) mask, bottom-right aligned like Causal: query q sees keys
// q + nk - nq - left .. q + nk - nq + right (causal with a window is right = 0). The launcher clamps an
// unbounded side to nk + nq, which reaches past every key.
struct Window {
  int nq, nk, lo, hi;  // key k visible to q iff q + lo <= k <= q + hi
  __device__ Window(const AttentionParams& p, int nq_, int nk_)
      : nq(nq_), nk(nk_), lo(nk_ - nq_ - p.window_left), hi(nk_ - nq_ + p.window_right) {}
  __device__ __forceinline__ bool visible(int q, int k) const { return k < nk && k >= q + lo && k <= q + hi; }
  __device__ __forceinline__ Range keys_of(int q0, int q1) const {
    const int last = min(q1, nq) - 1;
    if (last < q0) return {0, 0};
    return {max(0, q0 + lo), max(0, min(nk, last + hi + 1))};
  }
  __device__ __forceinline__ Range queries_of(int k0, int k1) const {
    return {min(nq, max(0, k0 - hi)), max(0, min(nq, k1 - 1 - lo + 1))};
  }
  // Hidden pairs exist if the first query's last key is short of the tile's last key, or the last
  // query's first key is past the tile's first key.
  __device__ __forceinline__ bool partial(int q0, int q1, int k0, int k1) const {
    return k1 > nk || k1 - 1 > q0 + hi || k0 < min(q1, nq) - 1 + lo;
  }
};

// Scores as they are: s = scale * q . k. Kernels fold the scale into the exponential's FFMA.
struct PlainScore {
  static constexpr bool kIdentity = true;
  __device__ PlainScore(const AttentionParams&, int, int) {}
  __device__ __forceinline__ void at_head(const AttentionParams&, int, int) {}
};

// tanh on the fast path (MUFU, ~2^-11 relative: below 16-bit rounding) or to float accuracy.
template <bool kFast>
__device__ __forceinline__ float tanh_of(float x) {
  if constexpr (kFast) {
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
  } else {
    return tanhf(x);
  }
}

// |q + offset - k| as a float without an int-to-float conversion (a quarter-rate instruction, as the
// exponential's MUFU): the integer's bits under the exponent of 2^23 make 2^23 + n, exact for n < 2^23.
__device__ __forceinline__ float distance_of(int q, int offset, int k) {
  return __int_as_float(0x4B000000 | abs(q + offset - k)) - 8388608.f;
}

// Softcap and/or ALiBi, decided at run time: s = softcap * tanh(scale q.k / softcap) when softcap > 0,
// then s -= slope_h * |q + nk - nq - k| when slopes are given. Scores leave in log2 units, so the caller's
// exponential takes them as they are (scale 1). Per element, a run-time softcap test would be if-converted
// and pay the tanh (and the backward's log2) on ALiBi-only calls too, so the tensor-core strips test softcapped()
// once per strip and call the kCap forms, the forwards' strips sloped() too (the kSlope forms: no ALiBi distance,
// 4 instructions a score, on softcap-only calls; mma_softmax.cuh); log2_score/ds_factor test per element.
// kMayCap = false (AlibiScore): ALiBi alone, no softcap, known at compile time (the plans pick it for calls with
// slopes and softcap 0): softcapped() is the constant false, so its kernels hold no softcap code, and its key-major
// strips under a one-sided mask (the backwards') take ALiBi's distance without the abs (alibi_strip_one_sided_keys).
// kMaySlope = false (SoftcapScore): softcap alone, known at compile time (the plans pick it for calls with a softcap
// and no slopes): sloped() is the constant false, so no ALiBi distance is computed (the backward's key-major strips
// and its ds_factor computed one per score with a zero slope): the D = 64 wgmma backward went from 160-176 B of
// spill to none, and its loader warpgroup's compute path from 450-490 B to 8 B (NVRTC 13.5, sm_90a).
// The three share a type only in name: separate instantiations, so no kernel's schedule moves another's.
template <bool kMayCap, bool kMaySlope = true>
struct ModScoreOf {
  static_assert(kMayCap || kMaySlope, "a softcap, ALiBi or both");
  static constexpr bool kIdentity = false;
  static constexpr bool kSplitsSoftcap = true;  // has softcapped() and the kCap forms
  static constexpr bool kAlibiOnly = !kMayCap;
  static constexpr bool kMaySlope_ = kMaySlope;  // (MaySlope: the strips' ALiBi forms are compiled only where true)
  // The kernel's __grid_constant__ params: the softcap's scalars are read from the constant bank where they
  // are used (copies would cost registers in kernels at their limit), as ArrayScore does.
  const AttentionParams* P;
  int offset;
  float slope_log2 = 0.f;  // -slope_h * log2(e), or 0 without ALiBi
  __device__ ModScoreOf(const AttentionParams& p, int nq, int nk) : P(&p), offset(nk - nq) {}
  __device__ __forceinline__ void at_head(const AttentionParams& p, int b, int h) {
    if constexpr (kMaySlope) slope_log2 = p.alibi != nullptr ? -p.alibi[b * p.alibi_sb + h] * kLog2e : 0.f;
  }
  // (SoftcapScore: always true, as the plans pick it only with a softcap; the run-time test stays: as the constant
  // true, ptxas scheduled the mma 2-D backward with dropout worse, 168 B of spill on sm_80 against none)
  __device__ __forceinline__ bool softcapped() const { return kMayCap && P->softcap_log2 > 0.f; }
  // Does this head add an ALiBi term? (A zero slope adds exactly nothing, so its heads may skip the distances.)
  __device__ __forceinline__ bool sloped() const { return kMaySlope && slope_log2 != 0.f; }
  // kCap / kSlope: the softcap / ALiBi term, known present (the tensor-core strips' uniform tests) or absent.
  template <bool kFast, bool kCap, bool kSlope = true>
  __device__ __forceinline__ float log2_score_as(float r, int q, int k) const {
    const float x = kCap ? P->softcap_log2 * tanh_of<kFast>(r * P->softcap_scale) : r * P->scale_log2;
    return kSlope && kMaySlope ? fmaf(slope_log2, distance_of(q, offset, k), x) : x;
  }
  template <bool kFast>
  __device__ __forceinline__ float log2_score(float r, int q, int k) const {
    return softcapped() ? log2_score_as<kFast, true>(r, q, k) : log2_score_as<kFast, false>(r, q, k);
  }
  // The softcap's derivative 1 - tanh^2, with tanh recovered from P = exp2(score - lse2) (no extra
  // registers through the backward's products); 1 without softcap, 0 where P is 0.
  template <bool kFast, bool kCap>
  __device__ __forceinline__ float ds_factor_as(float Pij, float lse2, int q, int k) const {
    if constexpr (!kCap) {
      return 1.f;
    } else {
      if (!(Pij > 0.f)) return 0.f;
      const float lg = kFast ? fast_log2(Pij) : log2f(Pij);
      const float slope = kMaySlope ? slope_log2 * distance_of(q, offset, k) : 0.f;
      const float t = (lg + lse2 - slope) * P->softcap_inv_log2;
      return 1.f - t * t;
    }
  }
  template <bool kFast>
  __device__ __forceinline__ float ds_factor(float Pij, float lse2, int q, int k) const {
    return softcapped() ? ds_factor_as<kFast, true>(Pij, lse2, q, k) : 1.f;
  }
};

using ModScore = ModScoreOf<true>;     // softcap and/or ALiBi, decided at run time
using AlibiScore = ModScoreOf<false>;  // ALiBi alone
using SoftcapScore = ModScoreOf<true, false>;  // softcap alone

// Does a score type split its softcap out at compile time (ModScore's kCap forms)?
CUPYFLASH_POLICY_FLAG(SplitsSoftcap, kSplitsSoftcap);
// Is a score type ALiBi alone (AlibiScore)?
CUPYFLASH_POLICY_FLAG(AlibiOnly, kAlibiOnly);
// May a score type add an ALiBi term (ModScore, AlibiScore; not SoftcapScore)?
CUPYFLASH_POLICY_FLAG(MaySlope, kMaySlope_);
// Does a mask hide every key past a query's diagonal (k > q + nk - nq)? Then ALiBi's |q + nk - nq - k| of a visible
// pair is q + nk - nq - k (the forwards' alibi_strip_one_sided).
CUPYFLASH_POLICY_FLAG(OneSided, kOneSided);
// Does a mask read a partial strip's visibility as bits (FlexMask<..., true>: strip_words), in mma::mask_strip?
CUPYFLASH_POLICY_FLAG(StripBits, kStripBits);

// A cache hint for a kRows x kCols tile of a score-shaped array whose key axis is contiguous: rows q0.. and
// elements k0.. (clipped to nq x nk; sq = 0: one row serves every query), from kThreads threads together (a warp,
// or a block): thread t = threadIdx.x % kThreads takes rows q0 + t / kParts + i * (kThreads / kParts) and, of each,
// the 128-byte lines t % kParts, + kParts, ... (kParts threads share a row when there are more threads than
// rows). All trip counts are compile-time (few registers: the kernels sit at their limits). kL1: into L1 (the
// kernel reads the tile one step later), else L2 only. A hint: it changes no value, and every address lies
// inside the tile's rows.
// x through a register move the compiler cannot see through (as mma::opaque): addresses computed from it are
// rebuilt where they are used instead of being hoisted out of the kernels' loops into live registers.
__device__ __forceinline__ int prefetch_opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

template <bool kL1, int kRows, int kCols, int kThreads, class E>
__device__ __forceinline__ void prefetch_tile(const E* slice, int sq, int nq, int nk, int q0, int k0) {
  constexpr int kParts = kThreads > kRows ? kThreads / kRows : 1;
  constexpr int kRowStep = kThreads / kParts;
  constexpr int kLines = (kCols * static_cast<int>(sizeof(E)) + 127) / 128 + 1;  // + 1: unaligned rows
  const int t = prefetch_opaque(static_cast<int>(threadIdx.x)) % kThreads;
  q0 = prefetch_opaque(q0);
  const int k1 = min(k0 + kCols, nk);
  k0 = max(k0, 0);
  if (k1 <= k0) return;
  const int q_end = sq == 0 ? q0 + 1 : min(q0 + kRows, nq);
#pragma unroll
  for (int i = 0; i < (kRows + kRowStep - 1) / kRowStep; ++i) {
    const int q = q0 + t / kParts + i * kRowStep;
    if (q >= q_end) continue;
    const size_t first = __cvta_generic_to_global(slice + q * sq + k0);
    const size_t end = first + (k1 - k0) * sizeof(E);
#pragma unroll
    for (int line = 0; line < kLines; line += kParts) {
      const int l = line + t % kParts;
      const size_t at = l == 0 ? first : (first & ~size_t(127)) + l * 128;
      if (l >= kLines || at >= end) continue;
      if constexpr (kL1) asm volatile("prefetch.global.L1 [%0];\n" : : "l"(at));
      else asm volatile("prefetch.global.L2 [%0];\n" : : "l"(at));
    }
  }
}

// Masks and biases given as arrays (issue 17), on top of a built-in score rule Base (PlainScore or
// ModScore): s = Base(q . k) + bias[b, h, q, k] (after softcap and ALiBi), then -inf where mask[b, h, q, k] is
// false (ANDed with the built-in mask, which the kernels apply as before). kMask/kBias: which arrays the call
// has; BiasT is the bias's element type (float when there is none). The arrays are read through their
// (b, h, q, k) strides, 0 along broadcast dims: element by element from global memory, or (kCols > 0, the
// Hopper kernels, when the plan finds room) from a kRows x kCols tile that the kernel staged in shared memory
// (score_tile.cuh: stage_score_tile, then use_score_tile). It lives in the score hook because the score is the
// hook that knows (b, h); tiles are skipped only by the built-in mask. With dbias, the backward takes
// dS = P (dP - Delta) (the gradient of the score after the bias, before the softcap's derivative) through dbias's
// strides: a broadcast bias adds it into an f32 accumulator (atomics: broadcast dims have stride 0 there, so each
// element sums over them); a full-shape one (p.dbias_direct) stores it, in BiasT, straight into the output (each
// pair owns its element: no atomics, no accumulator, no conversion pass).
template <class Base, class BiasT, bool kMask, bool kBias, int kRows = 0, int kCols = 0>
struct ArrayScore {
  static constexpr bool kIdentity = false;
  static constexpr bool kBiasGrad = kBias;
  static constexpr bool kStaged = kCols > 0;
  static constexpr bool kPrefetch = !kStaged;
  using Tile = ScoreTile<BiasT, kMask, kBias, kRows, kCols>;
  Base base;
  // The kernel's __grid_constant__ params: sizes and (q, k) strides are read from the constant bank where
  // they are used (the tensor-core kernels run at their register limit; copies would spill).
  const AttentionParams* P;
  const unsigned char* mask = nullptr;  // this (b, h)'s slice (not staged)
  const BiasT* bias = nullptr;
  void* dbias = nullptr;  // float* (accumulator) or BiasT* (p.dbias_direct: the output)
  unsigned tile_bias = 0, tile_mask = 0;  // staged: the shared address the problem's element (0, 0) would have
  // (Dense calls only: the arrays are indexed by the call's (b, h, q, k), and inside() reads the call's nq, nk.)
  __device__ ArrayScore(const AttentionParams& p, int nq, int nk) : base(p, nq, nk), P(&p) {}
  __device__ __forceinline__ void at_head(const AttentionParams& p, int b, int h) {
    base.at_head(p, b, h);
    if constexpr (!kStaged) {
      mask = p.mask != nullptr ? p.mask + b * p.mask_s.b + h * p.mask_s.h : nullptr;
      bias = p.bias != nullptr ? static_cast<const BiasT*>(p.bias) + b * p.bias_s.b + h * p.bias_s.h : nullptr;
    }
    if constexpr (kBias) {
      const long long at = b * p.dbias_s.b + h * p.dbias_s.h;
      if (p.dbias == nullptr) dbias = nullptr;
      else if (p.dbias_direct) dbias = reinterpret_cast<BiasT*>(p.dbias) + at;
      else dbias = p.dbias + at;
    }
  }
  // Staged: the tile of (b, h) at (q0, k0) into shared memory at slot (tid of kThreads; cp.async, uncommitted).
  template <int kThreads>
  static __device__ __forceinline__ void stage(const AttentionParams& p, int b, int h, int q0, int k0, unsigned slot,
                                               int tid) {
    if constexpr (kBias)
      stage_array_tile<sizeof(BiasT), kRows, kCols, Tile::kBiasPitch, kThreads>(
          slot, static_cast<const BiasT*>(p.bias) + b * p.bias_s.b + h * p.bias_s.h, p.bias_s.q, p.bias_s.k, p.nq,
          p.nk, q0, k0, tid);
    if constexpr (kMask)
      stage_array_tile<1, kRows, kCols, Tile::kMaskPitch, kThreads>(
          slot + Tile::kBiasBytes, p.mask + b * p.mask_s.b + h * p.mask_s.h, p.mask_s.q, p.mask_s.k, p.nq, p.nk, q0,
          k0, tid);
  }
  // Staged: scores of (q0.., k0..) read the tile at slot from now on.
  __device__ __forceinline__ void use_tile(unsigned slot, int q0, int k0) {
    tile_bias = slot - q0 * Tile::kBiasPitch - k0 * static_cast<int>(sizeof(BiasT));
    tile_mask = slot + Tile::kBiasBytes - q0 * Tile::kMaskPitch - k0;
  }
  __device__ __forceinline__ bool inside(int q, int k) const { return q < P->nq && k < P->nk; }
  // The bias in log2 units (0 outside the problem: padded rows and keys of a tile read nothing).
  __device__ __forceinline__ float bias_log2(int q, int k) const {
    if constexpr (!kBias) {
      return 0.f;
    } else if constexpr (kStaged) {
      return to_float<BiasT>(staged<BiasT>(tile_bias + q * Tile::kBiasPitch + k * static_cast<int>(sizeof(BiasT)))) *
             kLog2e;
    } else {
      if (bias == nullptr || !inside(q, k)) return 0.f;
      return to_float<BiasT>(bias[q * P->bias_s.q + k * P->bias_s.k]) * kLog2e;
    }
  }
  template <bool kFast>
  __device__ __forceinline__ float log2_score(float r, int q, int k) const {
    float x;
    if constexpr (Base::kIdentity) x = r * P->scale_log2;
    else x = base.template log2_score<kFast>(r, q, k);
    x += bias_log2(q, k);
    if constexpr (kMask && kStaged) {
      if (staged<unsigned char>(tile_mask + q * Tile::kMaskPitch + k) == 0) x = -__int_as_float(0x7f800000);
    } else if constexpr (kMask) {
      if (mask != nullptr && inside(q, k) && !mask[q * P->mask_s.q + k * P->mask_s.k]) x = -__int_as_float(0x7f800000);
    }
    // From global memory, one element's loads are used before the next element's are issued: the compiler would
    // otherwise hoist a whole tile's loads (a register each) and the tensor-core kernels, at their register limit,
    // would spill. Shared-memory reads are short enough to schedule freely.
    if constexpr (!kStaged) asm volatile("" : "+f"(x) : : "memory");
    return x;
  }
  // The bias is added after the softcap, so the softcap's derivative sees the score without it.
  template <bool kFast>
  __device__ __forceinline__ float ds_factor(float Pij, float lse2, int q, int k) const {
    if constexpr (Base::kIdentity) return 1.f;
    else return base.template ds_factor<kFast>(Pij, lse2 - bias_log2(q, k), q, k);
  }
  // Speed (issue 17): unstaged, log2_score reads one element at a time (registers), so each of its loads waits for
  // the last. A warp (or block) first asks for a tile's rows here, all lines at once and a step ahead, so that those
  // loads hit L1 instead of waiting on HBM one by one (prefetch_tile; arrays whose key axis is strided or
  // broadcast are not prefetched: read as before). From this head's slices (after at_head):
  template <bool kL1, int kRows_, int kCols_, int kThreads>
  __device__ __forceinline__ void prefetch(int q0, int k0) const {
    prefetch_slices<kL1, kRows_, kCols_, kThreads>(*P, bias, mask, q0, k0);
  }
  // ... or static, from the params alone: for kernels that issue it where no policy object is live (the
  // backward's, which build theirs per step after the products).
  template <bool kL1, int kRows_, int kCols_, int kThreads>
  static __device__ __forceinline__ void prefetch(const AttentionParams& p, int b, int h, int q0, int k0) {
    b = prefetch_opaque(b);
    h = prefetch_opaque(h);
    const BiasT* b_slice = kBias ? static_cast<const BiasT*>(p.bias) + b * p.bias_s.b + h * p.bias_s.h : nullptr;
    const unsigned char* m_slice = kMask ? p.mask + b * p.mask_s.b + h * p.mask_s.h : nullptr;
    prefetch_slices<kL1, kRows_, kCols_, kThreads>(p, b_slice, m_slice, q0, k0);
  }
  template <bool kL1, int kRows_, int kCols_, int kThreads>
  static __device__ __forceinline__ void prefetch_slices(const AttentionParams& p, const BiasT* b_slice,
                                                         const unsigned char* m_slice, int q0, int k0) {
    if (b_slice != nullptr && p.bias_s.k == 1)
      prefetch_tile<kL1, kRows_, kCols_, kThreads>(b_slice, p.bias_s.q, p.nq, p.nk, q0, k0);
    if (m_slice != nullptr && p.mask_s.k == 1)
      prefetch_tile<kL1, kRows_, kCols_, kThreads>(m_slice, p.mask_s.q, p.nq, p.nk, q0, k0);
  }
  // dS = P (dP - Delta) of one (q, k) pair into dbias: stored when the pair owns its element (zeros too: the
  // output is not zeroed where tiles are visited), else added (zeros too: a test per pair would branch around
  // each reduction); pairs outside the problem touch nothing.
  __device__ __forceinline__ void add_dbias(float ds, int q, int k) const {
    if (dbias == nullptr || !inside(q, k)) return;
    const int at = q * P->dbias_s.q + k * P->dbias_s.k;
    if (P->dbias_direct) static_cast<BiasT*>(dbias)[at] = from_float<BiasT>(ds);
    else atomicAdd(static_cast<float*>(dbias) + at, ds);
  }
 private:
  // One element of a staged tile (a volatile load: it stays after the kernel's barrier that publishes the tile).
  template <class E>
  static __device__ __forceinline__ E staged(unsigned at) {
    if constexpr (sizeof(E) == 1) {
      unsigned short x;
      asm volatile("ld.shared.u8 %0, [%1];\n" : "=h"(x) : "r"(at));
      return static_cast<E>(x);
    } else if constexpr (sizeof(E) == 2) {
      unsigned short x;
      asm volatile("ld.shared.u16 %0, [%1];\n" : "=h"(x) : "r"(at));
      return *reinterpret_cast<const E*>(&x);
    } else {
      unsigned x;
      asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(x) : "r"(at));
      return *reinterpret_cast<const E*>(&x);
    }
  }
};

// Staged score arrays (the Hopper kernels: the plan names ArrayScore<..., kRows, kCols> when the tiles fit in
// shared memory beside the kernel's own). score_tile_bytes: a staged tile's size (0: nothing to stage).
CUPYFLASH_POLICY_FLAG(IsStaged, kStaged);
template <class Score>
__device__ constexpr int score_tile_bytes() {
  if constexpr (IsStaged<Score>::value) return Score::Tile::kBytes;
  else return 0;
}
// Is a staged score's tile kRows x kCols (the kernel's own)? True for scores without one.
template <class Score, int kRows, int kCols>
__device__ constexpr bool score_tile_is() {
  if constexpr (IsStaged<Score>::value) return Score::Tile::kTileRows == kRows && Score::Tile::kTileCols == kCols;
  else return true;
}
// A step's score-array tile into its slot / scores read from it; nothing for scores without staged arrays.
template <class Score, int kThreads>
__device__ __forceinline__ void stage_score_tile(const AttentionParams& p, int b, int h, int q0, int k0, unsigned slot,
                                                 int tid) {
  if constexpr (IsStaged<Score>::value) Score::template stage<kThreads>(p, b, h, q0, k0, slot, tid);
}
template <class Score>
__device__ __forceinline__ void use_score_tile(Score& score, unsigned slot, int q0, int k0) {
  if constexpr (IsStaged<Score>::value) score.use_tile(slot, q0, k0);
}

// Does a score type take the bias gradient hook (add_dbias)? Built-in scores do not.
CUPYFLASH_POLICY_FLAG(HasBiasGrad, kBiasGrad);

// Does a score type read arrays worth prefetching (prefetch<kL1>)? Built-in scores do not.
CUPYFLASH_POLICY_FLAG(HasPrefetch, kPrefetch);

// The kernels' call: a cache hint for the score arrays of (batch b, query head h), the kRows x kCols tile at
// (q0, k0), from kThreads threads together (a warp, or a block's first kThreads); nothing for scores without
// arrays. kL1: the tile is scored next step; else later (into L2). Dense calls only, as ArrayScore.
template <bool kL1, class Score, int kRows, int kCols, int kThreads = 32>
__device__ __forceinline__ void prefetch_score_arrays(const AttentionParams& p, int b, int h, int q0, int k0) {
  if constexpr (HasPrefetch<Score>::value) Score::template prefetch<kL1, kRows, kCols, kThreads>(p, b, h, q0, k0);
}
// The same from a score whose at_head has run (its slice pointers are live already: the forward's).
template <bool kL1, int kRows, int kCols, int kThreads = 32, class Score>
__device__ __forceinline__ void prefetch_score_arrays(const Score& score, int q0, int k0) {
  if constexpr (HasPrefetch<Score>::value) score.template prefetch<kL1, kRows, kCols, kThreads>(q0, k0);
}

// A key-major backward's hint at the start of step it of a walk tile_of(step, h, i0) over `steps` steps: the
// warp's kRows x kCols tile (queries from dq past the step's first, keys from k0) of step it + 1 into L1, a whole
// step ahead, and at it = 0 step 0's (query head h, first query i0) with it. Nothing for scores without arrays.
template <class Score, int kRows, int kCols, class TileOf>
__device__ __forceinline__ void prefetch_next_step(const AttentionParams& p, int b, int it, int steps, int h, int i0,
                                                   int dq, int k0, const TileOf& tile_of) {
  if (it == 0) prefetch_score_arrays<true, Score, kRows, kCols>(p, b, h, i0 + dq, k0);
  if (HasPrefetch<Score>::value && it + 1 < steps) {
    int hn, in;
    tile_of(it + 1, hn, in);
    prefetch_score_arrays<true, Score, kRows, kCols>(p, b, hn, in + dq, k0);
  }
}

// Masks that depend on (b, h) (flex_policy.cuh's FlexMask, kPerHead) take the head's values in at_head, which
// kernels call through mask_at_head next to the score's at_head; the built-in masks do not, and compile to nothing.
CUPYFLASH_POLICY_FLAG(MaskPerHead, kPerHead);
template <class Mask>
__device__ __forceinline__ void mask_at_head(Mask& mask, const AttentionParams& p, int b, int h) {
  if constexpr (MaskPerHead<Mask>::value) mask.at_head(p, b, h);
}

// Attention sinks: the logit of head h's sink in log2 units (every row's softmax starts from it), or
// -inf without sinks.
__device__ __forceinline__ float sink_log2(const AttentionParams& p, int h) {
  return p.sinks != nullptr ? p.sinks[h] * kLog2e : -__int_as_float(0x7f800000);
}

// dsinks from a per-row kernel (kSlots rows per block, row slot `slot`): d sink_h = -sum over rows of P_sink * Delta.
// Every thread of the block calls it (it holds a barrier); the row's leader brings its share (0 for a row past the
// end) and head, and thread 0 adds one atomic per run of equal heads. One float atomic per row, all rows of a head
// on one address, serialised at the L2: 0.9 ms of a 7.7 ms backward at B = 1, H = 16, N = 16k (issue 13's sinks
// row measured 0.89x of plain).
template <int kSlots>
__device__ __forceinline__ void add_dsinks_block(const AttentionParams& p, int h, float share, int slot, bool leader) {
  __shared__ float s_share[kSlots];
  __shared__ int s_head[kSlots];
  if (leader) {
    s_share[slot] = share;
    s_head[slot] = h;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float run = s_share[0];
    int head = s_head[0];
    for (int w = 1; w < kSlots; ++w) {
      if (s_head[w] != head) {
        if (run != 0.f) atomicAdd(p.dsinks + head, run);
        run = 0.f;
        head = s_head[w];
      }
      run += s_share[w];
    }
    if (run != 0.f) atomicAdd(p.dsinks + head, run);
  }
}

// A variant = a mask, a score rule and (issue 16) dropout. Kernels are templates of one Policy type. Masks
// and scores are built for one problem's nq x nk: the call's (dense), or one packed sequence's (varlen,
// seq_geometry).
template <class MaskT, class ScoreT = PlainScore, class DropoutT = NoDropout>
struct Policy {
  using Mask = MaskT;
  using Score = ScoreT;
  using Dropout = DropoutT;
  Mask mask;
  Score score;
  DropoutT dropout;
  __device__ explicit Policy(const AttentionParams& p) : mask(p, p.nq, p.nk), score(p, p.nq, p.nk), dropout(p) {}
  __device__ Policy(const AttentionParams& p, const SeqGeometry& s)
      : mask(p, s.nq, s.nk), score(p, s.nq, s.nk), dropout(p) {}
};

}  // namespace cupyflash
