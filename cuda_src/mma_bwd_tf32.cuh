// The key-major backward (mma_bwd_keymajor.cuh) for float32: its five products as 3xTF32 m16n8k8 steps on the
// primitives of mma_tf32.cuh, and what else depends on the element type (shared-memory storage, tile loads).
// Everything the kernel does on C fragments (scores, masks, P^T, dS^T, dropout bits, dbias, dQ turns) is the same
// for m16n8k16 and m16n8k8 and is not here.
//
// Per k8 step of the contraction (a float32 "step" is 32 bytes of a row, as a k16 step of a 16-bit type):
//   S^T = K_j Q_i^T, dP^T = V_j dO_i^T   A = K_j / V_j rows, B = Q_i / dO_i rows: ldmatrix on both (mma_k8_rows)
//   dV_j += P^T dO_i, dK_j += dS^T Q_i  A = the C strip P^T / dS^T (pack_a_tf32), B = dO_i / Q_i, whose stored rows
//                                       are the queries, the contraction: ld_kpair_tf32 (mma_k8_kpair)
//   dQ_i += dS K_j                      A = dS from the dS^T tile (stored rows: keys, the contraction) by two
//                                       ld_kpair_tf32 (ld_ds_a), B = K_j (stored rows: keys) by ld_kpair_tf32
// Both operands of a product use the same permuted k order (mma_tf32.cuh), so each sum is the same sum. At 3 mma per
// product, the operands' splits are most of the kernel's non-mma instructions: split_tf32_cut (two instructions,
// mma_tf32.cuh) everywhere but S^T, whose operands keep the rounding split_tf32 (its error is scaled inside exp2).
#pragma once
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"  // KeepBits, is_kept
#include "mma_tf32.cuh"

namespace cupyflash {
namespace mma {

// How a tile of T sits in shared memory: 16-bit types as themselves; float as pairs of 16-bit units, a tile of D
// floats being TileLayout<2 D> (mma_tf32.cuh's FloatTile). (16-bit units per element: sizeof(T) / 2; a static
// constexpr member for it would put a global into every PTX of the source.)
template <typename T>
struct SmemOf {
  using type = T;
};
template <>
struct SmemOf<float> {
  using type = __half;
};

// load_tile_async for any element type: a float tile is loaded as the 16-bit tile of twice the width (the same
// bytes, the same 16-byte chunks, zero-filled past d_valid floats).
template <typename T, int D, int ROWS, int NTHREADS>
__device__ __forceinline__ void load_tile_any_async(typename SmemOf<T>::type* smem, const T* g, int64_t row_stride,
                                                    int rows_valid, int d_valid, int tid) {
  if constexpr (is_same_v<T, float>) {
    load_tile_async<__half, 2 * D, ROWS, NTHREADS>(smem, reinterpret_cast<const __half*>(g), 2 * row_stride,
                                                   rows_valid, 2 * d_valid, tid);
  } else {
    load_tile_async<T, D, ROWS, NTHREADS>(smem, g, row_stride, rows_valid, d_valid, tid);
  }
}

// pack_a_tf32 (C tile kk of a strip held in registers: P^T, dS^T), with kKeep: only the kept probabilities (dV's A
// operand under dropout; keep bits of dropout_bits<NT, true>).
template <bool kKeep = false, int NT>
__device__ __forceinline__ void pack_a_tf32_kept(uint32_t (&hi)[4], uint32_t (&lo)[4], const float (&c)[NT][4],
                                                 int kk, KeepBits<NT> bits = 0) {
  constexpr int kE[4] = {0, 2, 1, 3};  // pack_a_tf32's (permuted k) order
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float x = c[kk][kE[i]];
    const Tf32Pair s = split_tf32_cut(kKeep ? (is_kept<NT, true>(bits, kk, kE[i]) ? x : 0.f) : x);
    hi[i] = s.hi;
    lo[i] = s.lo;
  }
}

// ld_kpair_tf32's reads with the lane's part of the address computed once: for a float tile D wide (TileLayout<2 D>),
// lane (g, t) reads rows row0 + 2t, + 1 of column col0 + g. In the swizzled layout chunk c of row r sits at
// 16 ((c ^ r) % 8) of its 128-byte group; with row0 and col0 multiples of 8 the lane's (2t + e, g / 4) and the step's
// (col0 / 4) % 8 combine by XOR (bit 0 of the chunk is g / 4 ^ e, bits 1-2 are t ^ the step's), so an address is the
// lane's offset XOR a constant plus a constant: one LOP3 for a compile-time (row0, col0). The tile base must be
// 128-byte aligned (every float tile of the kernels is: they follow the 128-byte aligned dynamic smem base in
// whole 128-byte rows).
template <int D>
struct KpairLanes {
  using L = TileLayout<2 * D>;
  static constexpr int kPitchB = L::kPitch * 2;
  uint32_t off;  // byte offset of (row 2t, column g)
  __device__ __forceinline__ explicit KpairLanes(int lane) : off(FloatTile<D>::byte_of(2 * (lane & 3), lane >> 2)) {}
  __device__ __forceinline__ void load(Tf32Pair& x0, Tf32Pair& x1, uint32_t base, int row0, int col0) const {
    uint32_t a0, a1;
    if constexpr (L::kSwizzle) {
      const uint32_t c4 = static_cast<uint32_t>(col0) * 4u;  // col0 / 4 chunks: bits 5-6 in the group, the rest groups
      a0 = ((base + off) ^ (c4 & 0x60u)) + (c4 & ~0x7fu) + static_cast<uint32_t>(row0 * kPitchB);
      a1 = (a0 ^ 16u) + kPitchB;  // row 2t + 1: chunk bit 0 flips
    } else {
      a0 = base + off + static_cast<uint32_t>(row0 * kPitchB + col0 * 4);
      a1 = a0 + kPitchB;
    }
    x0 = split_tf32_cut(lds_f32(a0));
    x1 = split_tf32_cut(lds_f32(a1));
  }
};

// One k8 step of acc[n] += A B_n where both operands' stored rows are the M and N index (K_j Q_i^T, V_j dO_i^T):
// A's 16 rows by ldmatrix at a_addr, B's kN n8 tiles two per ldmatrix at b_addr(n2); both split into tf32 pairs, by
// split_tf32_cut (kCut) or the rounding split_tf32.
template <bool kCut, int kN, typename BAddr>
__device__ __forceinline__ void mma_k8_rows(float (&acc)[kN][4], uint32_t a_addr, BAddr b_addr) {
  static_assert(kN % 2 == 0, "B fragments come in pairs");
  uint32_t raw[4], ah[4], al[4];
  ldmatrix_x4(raw, a_addr);
  split_frag<kCut>(ah, al, raw);
#pragma unroll
  for (int n2 = 0; n2 < kN / 2; ++n2) {
    uint32_t b[4], bh[4], bl[4];
    ldmatrix_x4(b, b_addr(n2));
    split_frag<kCut>(bh, bl, b);
    mma_3xtf32(acc[2 * n2], ah, al, Tf32Pair{bh[0], bl[0]}, Tf32Pair{bh[1], bl[1]});
    mma_3xtf32(acc[2 * n2 + 1], ah, al, Tf32Pair{bh[2], bl[2]}, Tf32Pair{bh[3], bl[3]});
  }
}

// One k8 step of acc[n] += A B_n with A split in registers and B from a float tile D wide whose stored rows are the
// contraction index: rows row0 .. row0 + 7, B_n the columns col0 + 8 n .. + 7.
template <int D, int kN>
__device__ __forceinline__ void mma_k8_kpair(float (&acc)[kN][4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                             const KpairLanes<D>& lanes, uint32_t base, int row0, int col0) {
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    Tf32Pair b0, b1;
    lanes.load(b0, b1, base, row0, col0 + 8 * n);
    mma_3xtf32(acc[n], ah, al, b0, b1);
  }
}

// The A operand of dQ_i += dS K_j, k8 step of keys row0 .. row0 + 7, for queries q0 .. q0 + 15: from the dS^T tile
// (keys x Br queries, floats), whose stored rows are the keys. Columns q0 and q0 + 8 give rows g and g + 8.
template <int Br>
__device__ __forceinline__ void ld_ds_a(uint32_t (&ah)[4], uint32_t (&al)[4], const KpairLanes<Br>& lanes,
                                        uint32_t base, int row0, int q0) {
  Tf32Pair x0, x1, y0, y1;
  lanes.load(x0, x1, base, row0, q0);
  lanes.load(y0, y1, base, row0, q0 + 8);
  ah[0] = x0.hi, ah[1] = y0.hi, ah[2] = x1.hi, ah[3] = y1.hi;
  al[0] = x0.lo, al[1] = y0.lo, al[2] = x1.lo, al[3] = y1.lo;
}

// dS^T's C tile n (keys key_row + g, + 8; queries 8 n + 2t, + 1) into the float dS^T tile, as it is (no rounding).
template <int Br>
__device__ __forceinline__ void store_ds_f32(unsigned char* tile, const float (&c)[4], int key_row, int n) {
  using F = FloatTile<Br>;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int col = 8 * n + (lane & 3) * 2;
  *reinterpret_cast<float2*>(tile + F::byte_of(key_row, col)) = make_float2(c[0], c[1]);
  *reinterpret_cast<float2*>(tile + F::byte_of(key_row + 8, col)) = make_float2(c[2], c[3]);
}

// Query parts. The tensor cores add into their f32 accumulators with truncation, so dK_j/dV_j drift with the
// number of query rows a block sums (group x Nq: 3.0e-5 relative at 4096 rows, 5.9e-5 at 8192, 1.16e-4 at 16384;
// benchmarks/NOTES.md, s20). Past plans.mma.MAX_ROWS_F32 rows the plan splits each key tile's query tiles over
// p.q_parts blocks (blockIdx.z: the part; the same query tiles per part for every key tile, so each query tile's
// dQ adds come from blocks of one part, which keeps the deterministic turns' order argument within a part). Each
// part writes its partial sums to p.kv_part and mma_bwd_kv_combine adds them in part order: the same bits
// whatever order the blocks ran in.

// The query tiles [mt.begin, mt.end) of this block's part: its share of the nq / Br tiles (the plans' formula).
template <int Br>
__device__ __forceinline__ Range query_part(const AttentionParams& p, Range mt, int nq) {
  if (p.q_parts <= 1) return mt;
  const int per = ((nq + Br - 1) / Br + p.q_parts - 1) / p.q_parts;
  const int lo = static_cast<int>(blockIdx.z) * per;
  const int begin = max(mt.begin, lo);
  return {begin, max(begin, min(mt.end, lo + per))};
}

// A part's dV_j and scale * dK_j (as store_dk_dv would store them), f32, into its slabs of p.kv_part: row
// (b * Hk + hkv) * Nk + key of d floats; keys past nk are not written (the combine reads only keys < nk).
template <int NT>
__device__ __forceinline__ void store_kv_part(const AttentionParams& p, int b, int hkv, int key0, int col0,
                                              const float (&acc_dk)[NT][4], const float (&acc_dv)[NT][4]) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const long long slab = static_cast<long long>(p.batch) * p.hk * p.nk * p.d;
  float* dk = p.kv_part + 2 * blockIdx.z * slab + (static_cast<long long>(b) * p.hk + hkv) * p.nk * p.d;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int key = key0 + (lane >> 2) + hf * 8;
    if (key < p.nk) {
      float* dk_row = dk + static_cast<long long>(key) * p.d;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int col = col0 + n * 8 + (lane & 3) * 2;
        if (col < p.d) {
          *reinterpret_cast<float2*>(dk_row + col) =
              make_float2(acc_dk[n][2 * hf] * p.scale, acc_dk[n][2 * hf + 1] * p.scale);
          *reinterpret_cast<float2*>(dk_row + slab + col) = make_float2(acc_dv[n][2 * hf], acc_dv[n][2 * hf + 1]);
        }
      }
    }
  }
}

}  // namespace mma
}  // namespace cupyflash
