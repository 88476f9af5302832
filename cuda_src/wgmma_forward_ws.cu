// Warp-specialised FlashAttention forward on Hopper (sm_90a, fp16/bf16): FlashAttention-3's block organisation on
// the products and softmax of wgmma_forward.cu (the same code, in wgmma_fwd_steps.cuh). Opt-in: plans/wgmma.py's
// WS_DEFAULT switch or an explicit configuration.
//
// Block = one Q_i tile of Br = 64 kConsumers rows of one (batch, query head), 128 (kConsumers + 1) threads:
// - warpgroup 0, the producer, only copies: Q_i once, then K_t and V_t of every key tile into a kStages-deep ring
//   (16-byte cp.async into the 128-byte swizzle wgmma reads, as the lockstep kernel's copies), and keeps few
//   registers (setmaxnreg.dec) so that the consumers can hold more (setmaxnreg.inc);
// - warpgroups 1..kConsumers, the consumers, own 64 rows of Q_i each and run the lockstep kernel's per-warpgroup
//   pipeline (S_t issued, then P_{t-1} V_{t-1}, the softmax of S_t while that runs) against the ring's mbarriers
//   instead of a block barrier per tile, and take turns issuing their products ("ping-pong"): consumer c issues a
//   step's products only after consumer c - 1 (cyclically) has issued its own, so one warpgroup's softmax runs
//   while the others' products keep the tensor cores busy, instead of every warpgroup doing its softmax at once.
//
// The ring (ws_primitives.cuh's Ring): per slot FULL_K, FULL_V (count: the producer's 128 threads) and EMPTY_K,
// EMPTY_V (count: the consumers' 4 kConsumers warps). A producer thread copies its share of a tile, commits it as a
// cp.async group, and once that group has landed (cp.async.wait_group on its own groups) runs fence.proxy.async
// (its generic-proxy writes made visible to the async proxy wgmma reads through) and arrives on the tile's FULL
// barrier: the thread that wrote is the thread that fences. Groups go K_0 (with Q_i), V_0, K_1, V_1, ...; K_t is
// published right after V_t is issued and V_{t-1} right after K_t, so one group is always in flight behind the
// one awaited. Consumers wait on FULL before the product that reads a tile and release it (one arrival per warp)
// once the wgmma that read it has completed: K_t after S_t (wait<1>), V_t after P_t V_t (wait<0>). The producer
// waits on EMPTY before refilling a slot. Parities follow from the tile index (Ring::fill_parity).
//
// Turns: named barrier kTurnBar + c (256 threads: consumer c syncs, consumer c - 1 arrives) opens consumer c's
// turn; a consumer syncs on its own before a step's products and arrives on the next one's after issuing them.
// Consumer 0 skips its first sync and the last consumer its last arrival, so every barrier ends balanced.
// Every consumer walks the same key tiles, so all take the same number of turns.
//
// Why it cannot deadlock: the key-tile range kt is computed once per block, before the roles split, so the
// producer fills exactly the n_tiles tiles the consumers read (and stops there); each fill of a slot's FULL barrier
// is waited for once by every consumer thread, each release (EMPTY) once by the producer's threads, in tile order,
// with the parity of the fill (tile t: (t / kStages) & 1), so no wait can match a phase of another fill. Every wait
// of step t depends only on earlier steps: FULL_K(t)/FULL_V(t - 1) on the producer having passed EMPTY of tile
// t - kStages, released by the consumers in steps t - kStages (K) and t - kStages + 1 (V) (kStages >= 2); a turn
// waits only for the previous consumer's issue of this step (the first consumer: the last one's of the step before),
// and no consumer waits on an mbarrier inside its turn. The producer never waits on the consumers' turns.
//
// Not taken (plans/wgmma.py's ws_unsupported; the lockstep kernel runs them): staged mask/bias tiles
// (score_tile.cuh). User snippets and block masks run here as the other policies do (flex_policy.cuh).
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"
#include "wgmma_fwd_steps.cuh"
#include "wgmma_primitives.cuh"
#include "ws_primitives.cuh"

using namespace cupyflash;
using namespace cupyflash::mma;

// First named barrier of the consumers' turns (0 is __syncthreads').
constexpr int kTurnBar = 1;

// The pipeline's hooks (wgmma_fwd_steps.cuh) of consumer c.
template <int kStages, int kConsumers>
struct WsHooks {
  ws::Ring<kStages> ring;
  int own_bar, next_bar;  // this consumer's turn barrier, the next one's
  bool first_consumer, last_consumer, lead;  // lead: lane 0, the warp's arrival on EMPTY barriers
  __device__ __forceinline__ WsHooks(ws::Ring<kStages> r, int c)
      : ring(r), own_bar(kTurnBar + c), next_bar(kTurnBar + (c + 1) % kConsumers), first_consumer(c == 0),
        last_consumer(c == kConsumers - 1), lead((threadIdx.x & 31) == 0) {}
  __device__ __forceinline__ void tile_ready(int t) { ws::mbar_wait(ring.full_k(t), ring.fill_parity(t)); }
  __device__ __forceinline__ void v_ready(int t) { ws::mbar_wait(ring.full_v(t), ring.fill_parity(t)); }
  __device__ __forceinline__ void turn_begin(bool first) {
    if (!(first && first_consumer)) ws::bar_sync(own_bar, 256);
  }
  __device__ __forceinline__ void turn_end(bool last) {
    if (!(last && last_consumer)) ws::bar_arrive(next_bar, 256);
  }
  __device__ __forceinline__ void k_done(int t) {
    if (lead) ws::mbar_arrive(ring.empty_k(t));
  }
  __device__ __forceinline__ void v_done(int t) {
    if (lead) ws::mbar_arrive(ring.empty_v(t));
  }
};

using ws::copy_tile;  // the producer's copies (ws_primitives.cuh)
using ws::publish;
using ws::WsRegs;  // the producer's and the consumers' registers (ws_primitives.cuh)

template <typename T, int D, int Bc, int kConsumers, int kStages, class Policy>
__global__ void __launch_bounds__(WsRegs<kConsumers>::kThreads, 1)
    wgmma_flash_fwd_ws(const __grid_constant__ AttentionParams p) {
  using Regs = WsRegs<kConsumers>;
  constexpr int Br = 64 * kConsumers;
  constexpr int kSlabs = D / 64;  // 64-column slabs per tile
  constexpr int kTileBytesK = kSlabs * Bc * 128;
  static_assert(D % 64 == 0 && (Bc == 64 || Bc == 128) && (D == 64 || D == 128), "instantiated shapes");
  static_assert(kConsumers == 2 || kConsumers == 3, "turn barriers of 256 threads: two warpgroups each");
  static_assert(kStages >= 2, "a tile loads while the one before it is read");
  static_assert(!IsStaged<typename Policy::Score>::value, "staged score tiles go to wgmma_flash_fwd");

  // wgmma's swizzle pattern repeats every 1024 bytes: the host asks for 1 KB extra to align the base.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_u = smem_u32(smem_raw);
  const uint32_t sQ_u = (raw_u + 1023u) & ~1023u;
  const uint32_t sK_u = sQ_u + Br * D * 2;
  const uint32_t sV_u = sK_u + kStages * kTileBytesK;
  const ws::Ring<kStages> ring{sV_u + kStages * kTileBytesK};

  const TileCoord tc = query_tile_coord(p, Br);
  const int b = tc.bh / p.hq;
  const int h = tc.bh % p.hq;
  const int hk = h / p.group;
  const int q0 = (tc.n_tiles - 1 - tc.tile) * Br;
  const SeqGeometry seq = seq_geometry(p, b);  // sequence b's rows and lengths (dense: the whole problem)
  if (q0 >= seq.nq) return;                    // past this sequence's queries (never when dense)
  Policy pol(p, seq);
  pol.score.at_head(p, b, h);
  mask_at_head(pol.mask, p, b, h);
  pol.dropout.at_head(p, b, h);
  // Key tiles from the last to the first (see mma_forward.cu); every warpgroup walks all of them.
  const Range kt = tiles_covering(pol.mask.keys_of(q0, q0 + Br), Bc);
  const int n_tiles = kt.end - kt.begin;

  if (threadIdx.x == 0) {
    ring.init(128, 4 * kConsumers);
    ws::mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // the producer warpgroup
    ws::regs_dec<Regs::kProducerRegs>();
    if (n_tiles > 0) {
      const int tid = threadIdx.x;
      const T* gQ = static_cast<const T*>(p.q) + b * p.q_s.b + h * p.q_s.h + (seq.q_row0 + q0) * p.q_s.n;
      const T* gK = static_cast<const T*>(p.k) + b * p.k_s.b + hk * p.k_s.h + seq.k_row0 * p.k_s.n;
      const T* gV = static_cast<const T*>(p.v) + b * p.v_s.b + hk * p.v_s.h + seq.k_row0 * p.v_s.n;
      // Q_i rides in K_0's group (whose FULL barrier the consumers wait for first).
      copy_tile<T, Br, kSlabs>(sQ_u, gQ, p.q_s.n, seq.nq - q0, p.d, tid);
      for (int t = 0; t < n_tiles; ++t) {
        const int j0 = (kt.end - 1 - t) * Bc;
        const uint32_t slot_off = ring.slot(t) * kTileBytesK;
        const long long k_stride = ws::opaque64(p.k_s.n), v_stride = ws::opaque64(p.v_s.n);  // nothing hoisted
        ws::mbar_wait(ring.empty_k(t), ring.refill_parity(t));
        copy_tile<T, Bc, kSlabs>(sK_u + slot_off, gK + j0 * k_stride, k_stride, seq.nk - j0, p.d, tid);
        cp_async_commit();
        if (t > 0) publish<1>(ring.full_v(t - 1));  // V_{t-1}: all but K_t have landed
        ws::mbar_wait(ring.empty_v(t), ring.refill_parity(t));
        copy_tile<T, Bc, kSlabs>(sV_u + slot_off, gV + j0 * v_stride, v_stride, seq.nk - j0, p.d, tid);
        cp_async_commit();
        publish<1>(ring.full_k(t));  // K_t (and Q_i): all but V_t have landed
      }
      publish<0>(ring.full_v(n_tiles - 1));
    }
    return;  // the producer's registers never meet the consumers' code
  }

  ws::regs_inc<Regs::kConsumerRegs>();
  const int c = threadIdx.x / 128 - 1;  // consumer warpgroup
  const int warp = (threadIdx.x / 32) % 4;
  float acc[D / 8][4];
  float m_run[2], l_run[2];
  softmax_start(m_run, l_run, sink_log2(p, h));
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  }
  const int row_w = c * 64 + warp * 16;  // first row of this warp's strip inside Q_i
  const uint32_t q_base = sQ_u + c * 64 * 128;
  uint32_t pa[Bc / 16][4] = {};  // P_{t-1}: the A operand of the P V product in flight

  // With 160 or more registers the dropout draws go unrolled (ptxas interleaves their Philox chains).
  constexpr bool kUnrolledBits = Policy::Score::kIdentity;
  const wgmma_fwd::Steps<T, D, Bc, Br, kStages, kUnrolledBits, Policy> steps{p, pol, q_base, sK_u, sV_u, 0u,
                                                                           q0, row_w, kt.end};
  WsHooks<kStages, kConsumers> hooks(ring, c);
  wgmma_fwd::pipeline(steps, hooks, n_tiles, acc, m_run, l_run, pa);

  // Epilogue: O = acc / l, lse = (m + log2 l) ln 2.
  if constexpr (Policy::Dropout::kOn) dropout_scale_o(acc, pol.dropout);
  store_o_lse<T>(p, b, h, q0 + row_w, acc, m_run, l_run);
}
