// Deterministic dQ (issue 16): ordered turns on the f32 dQ accumulator.
//
// A backward block owns one key tile K_j and adds dS K_j into dQ_i for every query tile it visits. With
// `p.dq_turns` set, those adds to one (batch, query head, query tile) slot happen in the order of the key
// tiles, whatever the scheduling: the key tile with turn t (t-th key tile that visits Q_i) waits until the
// slot's counter reads t, adds, and passes the turn on. Floating-point addition then happens in one fixed
// order, so dQ is bitwise reproducible. A block only ever waits on blocks of the same head with a smaller
// key tile, which have a smaller linear block index in both grid orders (tile_coord), so the hardware has
// started them before it and they never wait on it: no deadlock.
//
// The key tiles that visit Q_i are a contiguous run starting at the tile of keys_of(Q_i).begin (masks are
// bands); tests/test_deterministic.py checks that against queries_of for every built-in mask.
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

// This key tile's turn on query tile [i0, i0 + Br): how many key tiles of Bc keys before it visit it.
template <int Br, int Bc, class Mask>
__device__ __forceinline__ int dq_turn_of(const Mask& mask, int i0, int j0) {
  return j0 / Bc - mask.keys_of(i0, i0 + Br).begin / Bc;
}

// The same, with the mask built here from sequence b's lengths (re-read, so no register is held through the
// step for it), and 0 when the backward is not deterministic.
template <int Br, int Bc, class Mask>
__device__ __forceinline__ int dq_turn_at(const AttentionParams& p, const int* slot, int b, int i0, int j0) {
  if (slot == nullptr) return 0;
  const SeqGeometry s = seq_geometry(p, b);
  return dq_turn_of<Br, Bc>(Mask(p, s.nq, s.nk), i0, j0);
}

// Every thread of the block calls both (they hold __syncthreads); thread 0 spins and signals.
__device__ __forceinline__ void dq_turn_wait(const int* slot, int turn) {
  if (slot == nullptr) return;
  if (threadIdx.x == 0) {
#if __CUDA_ARCH__ >= 700
    int seen;
    for (;;) {
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
  __syncthreads();
}

__device__ __forceinline__ void dq_turn_pass(int* slot, int turn) {
  if (slot == nullptr) return;
  __threadfence();  // this thread's adds are visible before the next turn starts
  __syncthreads();
  if (threadIdx.x == 0) {
#if __CUDA_ARCH__ >= 700
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(slot), "r"(turn + 1) : "memory");
#else
    *reinterpret_cast<volatile int*>(slot) = turn + 1;
#endif
  }
}

}  // namespace cupyflash
