// Warp specialisation on Hopper (sm_90a): shared-memory mbarriers for a producer/consumer ring of tiles, named
// barriers between warpgroups, and setmaxnreg (a producer warpgroup's registers handed to the consumers).
//
// mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier"): a 64-bit object in
// shared memory whose current phase completes when the count given to init has arrived; it then starts the next
// phase. Phases alternate in parity (0, 1, 0, ...): waiting for parity x returns once the phase of that parity
// has completed, and at once for parity 1 on a fresh barrier (phase 0 under way, the one "before" it counts as
// complete), which is how a producer's first pass over empty slots goes through. arrive releases this thread's
// earlier memory operations (.release.cta by default) and a successful wait acquires them.
#pragma once
#include "mma_primitives.cuh"
#include "wgmma_primitives.cuh"

namespace cupyflash {
namespace ws {

using mma::uint32_t;

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Orders the inits before other threads' (and the async proxy's) use of the barriers; a block barrier follows.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}

// Has the phase of this parity completed? (try_wait may also give up after a time of its own choosing.)
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// x through a register move the compiler cannot see through (mma::opaque's 64-bit twin): what is computed from
// it inside a loop is rebuilt there instead of being hoisted out into registers held through the loop (the
// producer warpgroup keeps few).
__device__ __forceinline__ long long opaque64(long long x) {
  long long y;
  asm volatile("mov.b64 %0, %1;\n" : "=l"(y) : "l"(x));
  return y;
}

// Named barrier `id` (1..15; 0 is __syncthreads') of `threads` threads: sync waits for the count, arrive counts
// this warp without waiting. Every thread of a warp takes the same one.
__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The executing warpgroup's per-thread register count, from the block's pool (every warp of the warpgroup runs
// the same one): dec gives registers back, inc waits until the pool has them.
template <int kRegs>
__device__ __forceinline__ void regs_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes multiples of 8 in [24, 256]");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg takes multiples of 8 in [24, 256]");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Registers of a block of kConsumers warpgroups beside one helper warpgroup (the warp-specialised forward's producer,
// the wgmma backward's keep-bit drawer): the launch gives every thread kLaunchRegs (65536 over the block's threads, a
// multiple of 8); the helper drops to kProducerRegs (regs_dec) and the consumers take what that frees (regs_inc; the
// pool is the block's).
template <int kConsumers>
struct WsRegs {
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kLaunchRegs = (65536 / kThreads) / 8 * 8;
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = ((kConsumers + 1) * kLaunchRegs - kProducerRegs) / kConsumers / 8 * 8;
  static_assert(kProducerRegs + kConsumers * kConsumerRegs <= (kConsumers + 1) * kLaunchRegs, "the block's pool");
};

// A ring of kStages K/V slots: per slot a FULL barrier for K and one for V (the producer's threads arrive once
// their copies into it have landed) and an EMPTY barrier for each (the consumer warps arrive once their last
// product reading it has completed). Tile t sits in slot t % kStages; its fill is that slot's (t / kStages)-th,
// so consumers wait for FULL parity (t / kStages) % 2 and the producer, before refilling, for EMPTY parity
// (t / kStages + 1) % 2 (the release of tile t - kStages; at once on the first pass).
template <int kStages>
struct Ring {
  static constexpr int kBytes = 4 * kStages * 8;
  uint32_t base;  // 8-byte aligned shared address of the 4 kStages barriers
  __device__ __forceinline__ uint32_t full_k(int t) const { return base + 8 * slot(t); }
  __device__ __forceinline__ uint32_t full_v(int t) const { return base + 8 * (kStages + slot(t)); }
  __device__ __forceinline__ uint32_t empty_k(int t) const { return base + 8 * (2 * kStages + slot(t)); }
  __device__ __forceinline__ uint32_t empty_v(int t) const { return base + 8 * (3 * kStages + slot(t)); }
  static __device__ __forceinline__ int slot(int t) { return static_cast<int>(static_cast<unsigned>(t) % kStages); }
  static __device__ __forceinline__ uint32_t fill_parity(int t) { return (static_cast<unsigned>(t) / kStages) & 1u; }
  static __device__ __forceinline__ uint32_t refill_parity(int t) { return fill_parity(t) ^ 1u; }
  __device__ __forceinline__ void init(uint32_t producers, uint32_t consumers) const {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_k(s), producers);
      mbar_init(full_v(s), producers);
      mbar_init(empty_k(s), consumers);
      mbar_init(empty_v(s), consumers);
    }
  }
};

// A ring of kSlots slots of small data with one FULL barrier (the writers arrive once their stores are done) and
// one EMPTY barrier (the readers arrive once their loads are done) per slot; item t sits in slot t % kSlots, with
// Ring's parities (the wgmma backward's keep bits, written by a drawer warpgroup).
template <int kSlots>
struct Pipe {
  static constexpr int kBytes = 2 * kSlots * 8;
  uint32_t base;  // 8-byte aligned shared address of the 2 kSlots barriers
  __device__ __forceinline__ uint32_t full(int t) const { return base + 8 * Ring<kSlots>::slot(t); }
  __device__ __forceinline__ uint32_t empty(int t) const { return base + 8 * (kSlots + Ring<kSlots>::slot(t)); }
  __device__ __forceinline__ void init(uint32_t writers, uint32_t readers) const {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) {
      mbar_init(full(s), writers);
      mbar_init(empty(s), readers);
    }
  }
};

// A producer thread's copies into a tile: once all but its newest kInFlight cp.async groups have landed, the
// generic-proxy writes are fenced for the async proxy (wgmma's reads) and the tile's FULL barrier counts this thread.
template <int kInFlight>
__device__ __forceinline__ void publish(uint32_t full) {
  mma::cp_async_wait<kInFlight>();
  wgmma::fence_proxy_async();
  ws::mbar_arrive(full);
}

// Bulk reductions by the async proxy (PTX cp.reduce.async.bulk): dst[0, bytes) += the f32s at shared address src
// (16-byte aligned, bytes a multiple of 16), in this thread's bulk group; commit closes the group, wait_read<N>
// returns once all but the newest N groups have read their shared memory (which may then be written again).
__device__ __forceinline__ void bulk_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// TMA (PTX cp.async.bulk.tensor): one thread copies a box of a tensor described by a TensorMap (attention_params.cuh)
// into shared memory, out-of-bounds elements zero-filled, and the copy's bytes complete on an mbarrier. The barrier's
// phase then completes once its arrivals are in and the bytes announced by expect_tx (before the copies) have landed.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The box at coordinates (c0, c1, c2, c3), innermost first, of the 4-d map at generic address map, into dst (with the
// map's 128-byte swizzle: dst 1024-byte aligned so that the pattern's rows are the box's).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// The map into the TMA unit's descriptor cache ahead of its first copy.
__device__ __forceinline__ void tma_prefetch_map(const void* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}
// This thread's cp.async copies so far count as one arrival on bar once they have landed, without waiting for them
// (.noinc: the arrival is one of those the barrier was initialised to expect). Their writes are then visible to the
// threads that wait on bar through the generic proxy (ld.shared), not to wgmma (the async proxy).
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// A tile of kRows x (64 kSlabs) elements into shared memory at dst (64-column slabs of TileLayout<64>, kRows * 128
// bytes apart) by the producer's 128 threads (thread tid): as load_tile_async, but each thread walks its rows in a
// rolled loop, one source pointer and one shared address moved a step at a time, which fits the producer's few
// registers. Rows at or past rows_valid (>= 1) and columns at or past d_valid are zero-filled (a source size of 0,
// from row 0 of the tile: inside the array).
template <typename T, int kRows, int kSlabs>
__device__ __forceinline__ void copy_tile(uint32_t dst, const T* src, long long stride, int rows_valid, int d_valid,
                                          int tid) {
  constexpr int kRowStep = 128 / 8;  // 8 chunks of 16 bytes a row
  static_assert(kRows % kRowStep == 0, "whole steps");
  const int r0 = tid / 8;
  const int c = tid % 8;
#pragma unroll
  for (int sl = 0; sl < kSlabs; ++sl) {
    const int left = d_valid - 64 * sl - c * 8;
    const int col_bytes = left >= 8 ? 16 : (left > 0 ? left * 2 : 0);
    const T* g = src + r0 * stride + 64 * sl + (col_bytes ? c * 8 : 0);
    uint32_t d = dst + sl * kRows * 128 + mma::TileLayout<64>::offset(r0, c) * 2;  // the swizzle repeats every 8 rows
#pragma unroll 1
    for (int r = r0; r < kRows; r += kRowStep) {
      const bool ok = r < rows_valid;
      mma::cp_async_16(d, ok ? g : src, ok ? col_bytes : 0);
      g += kRowStep * stride;
      d += kRowStep * 128;
    }
  }
}

}  // namespace ws
}  // namespace cupyflash
