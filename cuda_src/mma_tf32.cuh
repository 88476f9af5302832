// float32 on tensor cores: mma.sync m16n8k8 .tf32 in the "3xTF32" form, for the mma family's float32
// kernels (sm_80+). A float x is split as x = hi + lo with hi = tf32(x) and lo = tf32(x - hi) (10 + 1 bits
// each), and a product a*b as a_lo*b_hi + a_hi*b_lo + a_hi*b_hi (lo*lo, ~2^-22 relative, is dropped): three
// tf32 mma per product, float32 accumulation, about float32's accuracy (DESIGN.md 4: well under 1e-5 for o).
//
// Fragment layouts of mma.m16n8k8.tf32 (lane = 4*g + t), one 32-bit float per register:
//   A (16x8):  a[0] = (row g, k t)   a[1] = (row g+8, k t)   a[2] = (row g, k t+4)   a[3] = (row g+8, k t+4)
//   B (8x8):   b[0] = (k t, col g)   b[1] = (k t+4, col g)
//   C (16x8):  as m16n8k16's: c[0..1] = (row g, cols 2t, 2t+1), c[2..3] = (row g+8, cols 2t, 2t+1)
// So the score strips, masks, softmax and dropout of the 16-bit kernels (which only see C fragments) serve float32
// unchanged; what differs is how operands reach the registers:
//
// - Tiles. A float32 tile of D columns is stored as a 16-bit TileLayout<2 * D> (same bytes, same swizzle): a
//   "step" of the contraction dimension is 32 bytes in both cases (k16 of a 16-bit type, k8 of float32), so the
//   ldmatrix row addresses of LdmRows<2 * D> (.at(base, ks, ...)) serve k8 step ks unchanged.
// - Operands whose stored rows are the M or N index (Q and K in Q K^T, K and Q in S^T = K Q^T, V and dO in dP^T):
//   ldmatrix.x4 (b16) on a float tile hands lane (g, t) the 32-bit word at (row g, word t) of each 8 x 4 float
//   block, which is exactly A's a[0..3] (lane rows as for the 16-bit A) and B's b[0..1] of two n8 tiles (lane rows as
//   for the 16-bit B).
// - Operands whose stored rows are the contraction index (V in P V, dO in P^T dO, Q in dS^T Q, K and dS^T in
//   dS K): ldmatrix.trans moves 16-bit halves, not floats, so these are read with 32-bit shared loads. The k index of
//   a k8 step is permuted, k t <-> row 2t and k t+4 <-> row 2t+1 of the step's 8 rows (a sum over k does not care
//   about its order, as long as both operands use the same one). Then the A operand held in registers as C tiles (P,
//   P^T, dS^T) needs no shuffle: a = (c[0], c[2], c[1], c[3]) of C tile kk is k8 step kk, and the stored operand's
//   b[0], b[1] are rows 2t and 2t+1 of column g. In the swizzled layout those eight rows x eight floats fall in 32
//   different banks (rows 2t have r % 8 in {0, 2, 4, 6}, which XOR the 16-byte chunks apart): conflict-free.
#pragma once
#include "mma_primitives.cuh"

namespace cupyflash {
namespace mma {

struct Tf32Pair {
  uint32_t hi, lo;
};

// x = hi + lo, both tf32 bit patterns, lo the part of x that hi cannot hold, in four integer/float operations
// (cvt.rna.tf32.f32 lowers to an |x| < inf test, a predicated add and a mask: seven for the pair): hi rounds x to
// tf32 by adding half a tf32 ulp to the bits and clearing the 13 low ones (ties away from zero, as .rna), lo = x - hi
// is exact in float and is cut to tf32 by its mask (an error of at most 2^-10 |lo| <= 2^-21 |x|, next to the dropped
// lo * lo of 2^-22 |x y|). Infinities stay infinite in hi (their low bits are zero) and make lo NaN; a NaN stays NaN
// in lo (in hi too unless its payload carries out of the sign bit); a product with either is NaN.
__device__ __forceinline__ Tf32Pair split_tf32(float x) {
  const uint32_t hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  return Tf32Pair{hi, __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u};
}

// The backward's split for its linear products (mma_bwd_tf32.cuh; S^T keeps split_tf32), in two operations and no
// register for hi: hi is x itself, which the tensor cores cut to tf32 (mma.sync reads a tf32 operand's top 19 bits and
// ignores the 13 low ones: tests/test_mma_float32_fwd_gpu.py's test_tf32_operands_are_cut holds the GPU to that), and
// lo = x - cut(x), exact in float and cut in turn. Against split_tf32, |lo| < 2^-10 |x| rather than 2^-11, so lo's cut
// and the dropped lo * lo are 2^-20 rather than 2^-21 and 2^-22. Measured on an H100 (benchmarks/NOTES.md, s19): the
// backward 1.02-1.06x; in the forward it doubled o's error (2.1e-6 -> 5.8e-6 max-relative at N = 4096) and in the
// backward's S^T it failed test_large_logits (an error in S^T is multiplied by the scale inside exp2).
__device__ __forceinline__ Tf32Pair split_tf32_cut(float x) {
  const uint32_t hi = __float_as_uint(x);
  return Tf32Pair{hi, __float_as_uint(x - __uint_as_float(hi & 0xffffe000u))};
}

// N registers (floats as bits, e.g. from ldmatrix) split into hi and lo parts (kCut: split_tf32_cut).
template <bool kCut = false, int N>
__device__ __forceinline__ void split_frag(uint32_t (&hi)[N], uint32_t (&lo)[N], const uint32_t (&raw)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const Tf32Pair s = kCut ? split_tf32_cut(__uint_as_float(raw[i])) : split_tf32(__uint_as_float(raw[i]));
    hi[i] = s.hi;
    lo[i] = s.lo;
  }
}

__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b to about float32 accuracy: the two small cross terms first, then the large one.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const uint32_t (&a_hi)[4], const uint32_t (&a_lo)[4],
                                           const Tf32Pair b0, const Tf32Pair b1) {
  mma_1688_tf32(c, a_lo, b0.hi, b1.hi);
  mma_1688_tf32(c, a_hi, b0.lo, b1.lo);
  mma_1688_tf32(c, a_hi, b0.hi, b1.hi);
}

// The A operand of k8 step kk of a product whose A is a C strip in registers (P, P^T, dS^T), split, with the
// permuted k order above: C tile kk's (c[0], c[2], c[1], c[3]).
template <int NT>
__device__ __forceinline__ void pack_a_tf32(uint32_t (&hi)[4], uint32_t (&lo)[4], const float (&c)[NT][4], int kk) {
  const float x[4] = {c[kk][0], c[kk][2], c[kk][1], c[kk][3]};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const Tf32Pair s = split_tf32(x[i]);
    hi[i] = s.hi;
    lo[i] = s.lo;
  }
}

// A float32 tile of D columns in shared memory: TileLayout<2 D> over the same bytes.
template <int D>
struct FloatTile {
  using L = TileLayout<2 * D>;
  static constexpr int kPitchBytes = L::kPitch * 2;
  // Byte offset of element (row, col).
  __device__ static __forceinline__ uint32_t byte_of(int row, int col) {
    return static_cast<uint32_t>(L::offset(row, col >> 2) * 2 + (col & 3) * 4);
  }
};

__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float x;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr));
  return x;
}

// The permuted-k operand read from a tile whose stored rows are the contraction index (V in P V, ...): for the k8
// step whose rows start at row0 (a multiple of 8) and the n8 tile whose columns start at col0, lane (g, t) reads rows
// row0 + 2t and row0 + 2t + 1 of column col0 + g, split. Used as B (b0, b1) of m16n8k8, or twice (columns col0 and
// col0 + 8) as A (a[0], a[2] and a[1], a[3]) where A's stored rows are its k index (dS^T in dS K).
template <int D>
__device__ __forceinline__ void ld_kpair_tf32(Tf32Pair& x0, Tf32Pair& x1, uint32_t base, int row0, int col0) {
  using F = FloatTile<D>;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int r = row0 + 2 * (lane & 3), c = col0 + (lane >> 2);
  x0 = split_tf32(lds_f32(base + F::byte_of(r, c)));
  x1 = split_tf32(lds_f32(base + F::byte_of(r + 1, c)));
}

// ld_kpair_tf32's reads with the lane's part of each address computed once (a kernel's loop form). In a swizzled
// FloatTile (D % 32 == 0) the float at (row r, column c) is at byte r P + 16 ((c / 4) ^ (r % 8)) + 4 (c % 4) of its
// 128-byte group (c / 4) / 8 (P: the row pitch, a multiple of 128). For row r = row0 + 2t + e (row0 % 8 == 0) and
// column c = 8n + g that is row0 P + 128 (n / 4) + [(2t + e) P + 32 t + 16 ((g / 4) ^ e) + 4 (g % 4)] ^ 32 (n % 4):
// the bracket is the lane's (one register per e), its bits 5-6 (= t) meet n's in one XOR, the rest is immediate.
template <int D>
struct KPairRows {
  using F = FloatTile<D>;
  static_assert(F::L::kSwizzle, "a swizzled float tile (D % 32 == 0)");
  uint32_t off[2];
  __device__ __forceinline__ KPairRows() {
    const int lane = static_cast<int>(threadIdx.x) & 31;
    const int t = lane & 3, g = lane >> 2;
#pragma unroll
    for (int e = 0; e < 2; ++e)
      off[e] = static_cast<uint32_t>((2 * t + e) * F::kPitchBytes + 32 * t + 16 * ((g >> 2) ^ e) + 4 * (g & 3));
  }
  // ld_kpair_tf32(x0, x1, base, row0, col0) for a 128-byte aligned tile base.
  __device__ __forceinline__ void load(Tf32Pair& x0, Tf32Pair& x1, uint32_t base, int row0, int col0) const {
    const int n = col0 >> 3;
    const uint32_t imm = static_cast<uint32_t>(row0 * F::kPitchBytes + 128 * (n >> 2));
    const uint32_t swz = static_cast<uint32_t>(32 * (n & 3));
    x0 = split_tf32(lds_f32(((base + off[0]) ^ swz) + imm));
    x1 = split_tf32(lds_f32(((base + off[1]) ^ swz) + imm));
  }
};

// ------------------------------------------------------------------------------ products of the kernels

// One k8 step of a warp's tile in float32, acc[m][n] += A_m B_n, with both operands read by ldmatrix from float tiles
// whose stored rows are M and N (Q and K in Q K^T): a_addr(m) the address of A strip m, b_addr(n2) that of B's n8
// fragments 2 n2 and 2 n2 + 1 (LdmRows<2 D>, as for a 16-bit k16 step). Each strip's A is split once for all kN n
// tiles, each B fragment pair once for all kM strips.
template <int kM, int kN, typename AAddr, typename BAddr>
__device__ __forceinline__ void mma_step_tf32(float (&acc)[kM][kN][4], AAddr a_addr, BAddr b_addr) {
  static_assert(kN % 2 == 0, "B fragments come in pairs");
  uint32_t a[kM][4], a_hi[kM][4], a_lo[kM][4];
#pragma unroll
  for (int m = 0; m < kM; ++m) ldmatrix_x4(a[m], a_addr(m));
#pragma unroll
  for (int m = 0; m < kM; ++m) split_frag(a_hi[m], a_lo[m], a[m]);
#pragma unroll
  for (int n2 = 0; n2 < kN / 2; ++n2) {
    uint32_t b[4], b_hi[4], b_lo[4];
    ldmatrix_x4(b, b_addr(n2));
    split_frag(b_hi, b_lo, b);
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      mma_3xtf32(acc[m][2 * n2], a_hi[m], a_lo[m], Tf32Pair{b_hi[0], b_lo[0]}, Tf32Pair{b_hi[1], b_lo[1]});
      mma_3xtf32(acc[m][2 * n2 + 1], a_hi[m], a_lo[m], Tf32Pair{b_hi[2], b_lo[2]}, Tf32Pair{b_hi[3], b_lo[3]});
    }
  }
}

// O += P V over one key tile in float32: P the warp's kM C strips of kNT n8 tiles (the keys), V the tile's
// FloatTile<D> at v_base (stored rows are the keys, the contraction index; 128-byte aligned). Per k8 step each
// strip's A is split once (pack_a_tf32) for all D / 8 n tiles, each V pair once (ld_kpair_tf32's reads) for all
// strips.
template <int D, int kM, int kNT>
__device__ __forceinline__ void mma_pv_tf32(float (&acc)[kM][D / 8][4], const float (&p)[kM][kNT][4],
                                            uint32_t v_base, const KPairRows<D>& v_rows) {
#pragma unroll
  for (int kk = 0; kk < kNT; ++kk) {
    uint32_t a_hi[kM][4], a_lo[kM][4];
#pragma unroll
    for (int m = 0; m < kM; ++m) pack_a_tf32(a_hi[m], a_lo[m], p[m], kk);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      Tf32Pair b0, b1;
      v_rows.load(b0, b1, v_base, kk * 8, n * 8);
#pragma unroll
      for (int m = 0; m < kM; ++m) mma_3xtf32(acc[m][n], a_hi[m], a_lo[m], b0, b1);
    }
  }
}

}  // namespace mma
}  // namespace cupyflash
