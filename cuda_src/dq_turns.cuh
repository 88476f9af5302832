// Deterministic dQ (issue 16): ordered turns on the f32 dQ accumulator.
//
// A backward block owns one key tile K_j and adds dS K_j into dQ_i for every query tile it visits. With
// `p.dq_turns` set, those adds to one (batch, query head, query tile) slot happen in a fixed order of the key
// tiles, whatever the scheduling: the key tile with turn t waits until the slot's counter reads t, adds, and
// passes the turn on. Floating-point addition then happens in one fixed order, so dQ is bitwise reproducible.
//
// The order is DESCENDING key tile (the diagonal's first). The key tiles that visit Q_i are a contiguous run
// [s, e) (masks are bands; e - 1 = the tile of keys_of(Q_i).end - 1), and every kernel walks a key tile's
// query tiles upward from the first one it sees (queries_of(K_j).begin, which grows with j). So on Q_i the
// key tile with the latest start arrives first: under causal K_i reaches Q_i at its step 0, K_{i-1} at step
// 1, ..., and the descending turn order is the order of arrival: with a head's key tiles running together
// nobody waits (with Br > Bc, Br / Bc key tiles share each first query tile and the last query tile takes
// all T adds one after another, so some waits remain). Non-causal has every key tile start at Q_0: with a
// fixed order the t-th of key tiles that start together waits t steps there (a pipeline fill, whatever the
// order), so the grid order (dq_grid_coord) keeps few key tiles of a head starting together.
//
// No deadlock: a block only ever waits on blocks of the same head with a LARGER key tile. With dq_turns set,
// dq_key_tile_coord reverses the grid's key-tile axis (grid tile t works on key tile n_tiles - 1 - t, per
// sequence when varlen), and in its grid order (dq_grid_coord) a head's grid tiles grow with the linear block
// index, so those blocks have smaller linear block indices: the hardware has started them before this one
// (blocks start in linear order), and by induction on that index they finish without waiting on it.
// tests/test_deterministic.py checks the runs against queries_of for every built-in mask and simulates the
// turns (each taken exactly once, no deadlock with few blocks resident, the waits predicted above).
#pragma once
#include "attention_params.cuh"
#include "attention_policy.cuh"

namespace cupyflash {

// The counter of (b, h, query tile i0 / Br), or nullptr when the backward is not deterministic.
template <int Br>
__device__ __forceinline__ int* dq_turn_slot(const AttentionParams& p, int b, int h, int i0) {
  if (p.dq_turns == nullptr) return nullptr;
  const int tiles = (p.nq + Br - 1) / Br;
  return p.dq_turns + (static_cast<long long>(b) * p.hq + h) * tiles + i0 / Br;
}

// Masks whose calls never take turns (kNoDQTurns: block masks, whose key tiles need not form one run; the API
// refuses deterministic=True with them) compile no turn arithmetic: it sat in the backwards' steps, cold but
// taking registers and the uniform datapath's place (s22).
CUPYFLASH_POLICY_FLAG(NoDQTurns, kNoDQTurns);

// This key tile's turn on query tile [i0, i0 + Br): how many key tiles of Bc keys after it visit it.
template <int Br, int Bc, class Mask>
__device__ __forceinline__ int dq_turn_of(const Mask& mask, int i0, int j0) {
  if constexpr (NoDQTurns<Mask>::value) return 0;
  else return (mask.keys_of(i0, i0 + Br).end - 1) / Bc - j0 / Bc;
}

// The deterministic backward's grid order: heads in groups of p.dq_head_group, each group's blocks grid tile
// by grid tile with its heads fastest (1: tiles fastest; every head: heads fastest), whichever grid axis
// holds the heads (p.heads_fastest). Within a head the grid tile grows with the linear block index, as in
// tile_coord's orders. A few heads at a time, each with a few key tiles in flight, start those key tiles a
// step apart as earlier blocks finish (non-causal turns cost a pipeline fill only where a head's key tiles
// start together; benchmarks/NOTES.md, "Deterministic turns v2").
__device__ __forceinline__ TileCoord dq_grid_coord(const AttentionParams& p) {
  const int heads = static_cast<int>(p.heads_fastest ? gridDim.x : gridDim.y);
  const int tiles = static_cast<int>(p.heads_fastest ? gridDim.y : gridDim.x);
  const long long lin = blockIdx.x + static_cast<long long>(blockIdx.y) * gridDim.x;
  const int per = max(1, min(p.dq_head_group, heads));
  const int h0 = static_cast<int>(lin / (static_cast<long long>(per) * tiles)) * per;  // the group's first head
  const int n = min(per, heads - h0);                                                // heads in this group
  const long long r = lin - static_cast<long long>(h0) * tiles;                      // in [0, n * tiles)
  return {h0 + static_cast<int>(r % n), static_cast<int>(r / n), tiles};
}

// tile_coord, or with p.batch_inner (the plan's choice for a dense call whose dbias float32 accumulator every batch
// adds into; only kernels whose score adds dbias compile the test) its head axis read batch fastest: the B blocks
// that add into the same dbias elements then run side by side and their adds meet in L2, instead of each batch
// sweeping the whole accumulator through DRAM. (Deterministic calls never sum dbias: the API refuses them.)
template <class Policy>
__device__ __forceinline__ TileCoord dbias_tile_coord(const AttentionParams& p) {
  TileCoord c = tile_coord(p);
  if constexpr (HasBiasGrad<typename Policy::Score>::value) {
    if (p.batch_inner) c.bh = (c.bh % p.batch) * p.hk + c.bh / p.batch;
  }
  return c;
}

// key_tile_coord for the backward's key-major kernels; when the backward is deterministic, in dq_grid_coord's
// order with the key-tile axis reversed (grid tile t works on key tile n_tiles - 1 - t, per sequence when
// varlen), so the key tiles a block waits on (larger ones) have the smaller block indices. Varlen's "past"
// tile (tile P of 2P + 1) maps to itself.
template <class Policy>
__device__ __forceinline__ TileCoord dq_key_tile_coord(const AttentionParams& p, int tile) {
  const bool turns = p.dq_turns != nullptr;  // one varlen mapping for both orders (code size at 255 registers)
  TileCoord c = varlen_tile_coord(p, tile, p.cu_seqlens_k, p.total_k, p.nk,
                                  turns ? dq_grid_coord(p) : dbias_tile_coord<Policy>(p));
  if (turns) c.tile = c.n_tiles - 1 - c.tile;
  return c;
}

// The same, with the mask built here from sequence b's lengths (re-read, so no register is held through the
// step for it), and 0 when the backward is not deterministic.
template <int Br, int Bc, class Mask>
__device__ __forceinline__ int dq_turn_at(const AttentionParams& p, const int* slot, int b, int i0, int j0) {
  if (slot == nullptr) return 0;
  const SeqGeometry s = seq_geometry(p, b);
  return dq_turn_of<Br, Bc>(Mask(p, s.nq, s.nk), i0, j0);
}

// Thread 0's early read of the slot, for dq_turn_wait: issued well before the dQ adds (under the step's
// products), so that its L2 round trip is off the critical path; where it already shows the turn, the wait
// is only its barrier. An acquire, like the spin's: it synchronizes with the pass whose value it reads, and
// dq_turn_wait's barrier then orders every thread's adds after it, as after a spin. 0 for the other threads,
// without turns, and before sm_70 (the wait spins as before).
__device__ __forceinline__ int dq_turn_peek(const int* slot) {
  int seen = 0;
#if __CUDA_ARCH__ >= 700
  if (slot != nullptr && threadIdx.x == 0) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(slot) : "memory");
  }
#endif
  return seen;
}

// Every thread of the block calls both with the same turn (they hold sync_block<kSync>: the block's barrier, or
// the first kSync threads'); thread 0 spins (unless its early read `seen`, from dq_turn_peek, already shows the
// turn) and signals.
template <int kSync = 0>
__device__ __forceinline__ void dq_turn_wait(const int* slot, int turn, int seen = 0) {
  if (slot == nullptr || turn == 0) return;  // the first turn follows only the launch's zeroing of the counters
  if (threadIdx.x == 0) {
#if __CUDA_ARCH__ >= 700
    while (seen < turn) {  // the early value is stale: read again at once, then every 64 ns
      asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(seen) : "l"(slot) : "memory");
      if (seen >= turn) break;
      __nanosleep(64);
    }
#else
    while (*reinterpret_cast<const volatile int*>(slot) < turn) {
    }
    __threadfence();
#endif
  }
  sync_block<kSync>();
}

__device__ __forceinline__ void dq_turn_pass(int* slot, int turn) {
  if (slot == nullptr) return;
#if __CUDA_ARCH__ >= 700
  // The barrier orders every thread's adds before thread 0's release, which is cumulative at gpu scope: the
  // next turn's acquire sees them all. (A fence per thread would wait out each thread's reductions first.)
  __syncthreads();
  if (threadIdx.x == 0) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(slot), "r"(turn + 1) : "memory");
  }
#else
  __threadfence();  // this thread's adds are visible before the next turn starts
  __syncthreads();
  if (threadIdx.x == 0) *reinterpret_cast<volatile int*>(slot) = turn + 1;
#endif
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
// dq_turn_pass for the key-major tensor-core kernels, made late: after the barrier that opens the block's next
// step (or one after its loop), by thread 0, for the step with query head h and query tile i0. That barrier
// orders every thread's adds before the release, as dq_turn_pass's own does, so the release's wait for the
// block's reductions to reach L2 no longer holds every warp at that barrier: only warp 0 waits, while the
// others start the step. The pass is still made before the block's next wait (which comes later in the
// step), so no wait depends on one more pass than before (the deadlock argument above is unchanged). The
// slot and turn are recomputed from (h, i0), so nothing is held through the step for them. Not before sm_70:
// there a release needs every thread's fence before the barrier (dq_turn_pass).
template <int Br, int Bc, class Mask>
__device__ __forceinline__ void dq_turn_pass_late(const AttentionParams& p, int b, int h, int i0, int j0) {
  if (threadIdx.x != 0) return;
  int* const slot = dq_turn_slot<Br>(p, b, h, i0);
  if (slot == nullptr) return;
  const int next = dq_turn_at<Br, Bc, Mask>(p, slot, b, i0, j0) + 1;
  asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(slot), "r"(next) : "memory");
}

// The late pass of a key-major kernel's step `step`, its (query head, query tile) from the kernel's walk
// (tile_of(step, h, i0)): by thread 0 right after the barrier that opens step `step + 1` (or, for the last
// step, one barrier after the loop).
template <int Br, int Bc, class Mask, class TileOf>
__device__ __forceinline__ void dq_turn_pass_step(const AttentionParams& p, int b, int j0, int step,
                                                  const TileOf& tile_of) {
  int h, i0;
  tile_of(step, h, i0);
  dq_turn_pass_late<Br, Bc, Mask>(p, b, h, i0, j0);
}

// The last step's pass, one barrier after the loop (that barrier orders every thread's last adds before the
// release): the same for every key-major kernel, so they call this after their loop (total: the block's steps).
template <int Br, int Bc, class Mask, int kSync = 0, class TileOf>
__device__ __forceinline__ void dq_turn_pass_last(const AttentionParams& p, int b, int j0, int total,
                                                  const TileOf& tile_of) {
  if (p.dq_turns == nullptr || total <= 0) return;
  sync_block<kSync>();
  dq_turn_pass_step<Br, Bc, Mask>(p, b, j0, total - 1, tile_of);
}

#endif

}  // namespace cupyflash
