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
// The ring (ws_primitives.cuh's Ring): per slot FULL_K, FULL_V (count: the producer's 128 threads; kTma: 1, below) and
// EMPTY_K, EMPTY_V (count: the consumers' 4 kConsumers warps). A producer thread copies its share of a tile, commits it
// as a cp.async group, and once that group has landed (cp.async.wait_group on its own groups) runs fence.proxy.async
// (its generic-proxy writes made visible to the async proxy wgmma reads through) and arrives on the tile's FULL
// barrier: the thread that wrote is the thread that fences. Groups go K_0 (with Q_i), V_0, K_1, V_1, ...; K_t is
// published right after V_t is issued and V_{t-1} right after K_t, so one group is always in flight behind the one
// awaited. Consumers wait on FULL before the product that reads a tile and release it (one arrival per warp) once the
// wgmma that read it has completed: K_t after S_t (wait<1>), V_t after P_t V_t (wait<0>). The producer waits on EMPTY
// before refilling a slot. Parities follow from the tile index (Ring::fill_parity).
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
// Persistent blocks (kPersistent: several query tiles, "items", a block; tests/test_ws_protocol.py's
// ChainedPersistentBlock models it) keep that argument over the concatenation of their items' tiles: the ring's tile
// index runs on (item i's tile t is ring tile t0_i + t, and every slot is released, the item's last V too), the
// producer's publish chain runs on (an item's last V is published behind the next item's first K group), and the
// turns run on (only the block's first turn skips consumer 0's sync, only its last the last consumer's arrival; an
// item with no key tile takes no turn and no copy in any role). One more mbarrier, Q_EMPTY (count 4 kConsumers
// warps), orders the Q_i buffer: each consumer warp arrives once an item's last S product has landed, before it
// waits for the item's last V, and the producer waits for that phase before it copies the next item's Q_i (into
// that item's first K group). Its waits depend only on earlier steps, so the argument above holds.
//
// kTma (plans/wgmma.py's uses_tma_forward: dense calls whose q, k and v TMA maps can describe; TmaParams): one
// producer thread copies everything by TMA, one cp.async.bulk.tensor per 64-column slab (the maps' 128-byte swizzle =
// TileLayout<64>; rows past Nq/Nk and columns past d zero-filled, as copy_tile's), and the other 127 exit at once.
// FULL_K/FULL_V then expect one arrival: that thread's expect_tx of the tile's bytes (Q_i's too on an item's first K),
// its copies, then its arrival; the phase completes once the bytes have landed. TMA writes through the async proxy
// wgmma reads by, so no proxy fence and no publish chain; EMPTY and Q_EMPTY keep their counts and meaning.
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

// The pipeline's hooks (wgmma_fwd_steps.cuh) of consumer c for one query tile, whose key tile t is the ring's
// tile t0 + t. A block's first turn skips consumer 0's sync and its last one the last consumer's arrival: the
// turns run on across a persistent block's query tiles (first_item / last_item: is this tile the block's first /
// last with key tiles). kPersistent: each warp also releases Q_i (q_empty) once S of the tile's last key tile
// (n_tiles - 1) has landed, so that the producer may copy the next query tile's rows over it.
template <int kStages, int kConsumers, bool kPersistent>
struct WsHooks {
  ws::Ring<kStages> ring;
  int t0;
  int own_bar, next_bar;  // this consumer's turn barrier, the next one's
  bool skip_first_sync, skip_last_arrival, lead;  // lead: lane 0, the warp's arrival on EMPTY barriers
  uint32_t q_empty;
  int last_tile;
  __device__ __forceinline__ WsHooks(ws::Ring<kStages> r, int c, int t0_, bool first_item, bool last_item,
                                     uint32_t q_empty_, int n_tiles)
      : ring(r), t0(t0_), own_bar(kTurnBar + c), next_bar(kTurnBar + (c + 1) % kConsumers),
        skip_first_sync(c == 0 && first_item), skip_last_arrival(c == kConsumers - 1 && last_item),
        lead((threadIdx.x & 31) == 0), q_empty(q_empty_), last_tile(n_tiles - 1) {}
  __device__ __forceinline__ void tile_ready(int t) {
    ws::mbar_wait(ring.full_k(t0 + t), ring.fill_parity(t0 + t));
  }
  __device__ __forceinline__ void v_ready(int t) { ws::mbar_wait(ring.full_v(t0 + t), ring.fill_parity(t0 + t)); }
  __device__ __forceinline__ void turn_begin(bool first) {
    if (!(first && skip_first_sync)) ws::bar_sync(own_bar, 256);
  }
  __device__ __forceinline__ void turn_end(bool last) {
    if (!(last && skip_last_arrival)) ws::bar_arrive(next_bar, 256);
  }
  __device__ __forceinline__ void k_done(int t) {
    if (lead) {
      ws::mbar_arrive(ring.empty_k(t0 + t));
      if (kPersistent && t == last_tile) ws::mbar_arrive(q_empty);
    }
  }
  __device__ __forceinline__ void v_done(int t) {
    if (lead) ws::mbar_arrive(ring.empty_v(t0 + t));
  }
};

using ws::copy_tile;  // the producer's copies (ws_primitives.cuh)
using ws::publish;
using ws::WsRegs;  // the producer's and the consumers' registers (ws_primitives.cuh)

// One query tile of a block (an "item"): its (batch, query head), first row, and the key tiles it visits.
struct WsItem {
  int b, h, q0;
  Range kt;
};

// kPersistent (dense calls without a block mask, plans/wgmma.py's persistent_by_default): the grid holds at most
// one block an SM, and each block takes several items (virtual blocks) of the grid a plain launch would have
// (dense_tile_coord; which ones: below), so that the producer copies the next item's Q_i and first K/V tiles while
// the consumers finish the last one (the ring and the turns run on across items; see the top of the file).
template <typename T, int D, int Bc, int kConsumers, int kStages, class Policy, bool kPersistent = false,
          bool kTma = false>
__global__ void __launch_bounds__(WsRegs<kConsumers>::kThreads, 1)
    wgmma_flash_fwd_ws(const __grid_constant__ typename KernelParams<kTma>::type kp) {
  const AttentionParams& p = params_of(kp);
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
  const uint32_t q_empty = ring.base + ws::Ring<kStages>::kBytes;  // kPersistent: Q_i read for the last time

  // The block's items: in round k, virtual block k G + (x + k) mod G of the plain grid's (G = gridDim.x, x =
  // blockIdx.x; one round of one item, from the grid, unless kPersistent). Each round runs G consecutive items of the
  // plain grid's order, as its blocks would run, rotated a block a round: without the rotation (item k G + x) a
  // block met the same query tile of every head when G was a multiple of a head's tile count (0.6x on causal rows);
  // consecutive runs of items a block left the blocks whose runs held a window's short first tiles idle (0.76-0.93x
  // on windows of 2048-4096 keys). benchmarks/NOTES.md, s25; tests/test_ws_protocol.py checks the order's cover.
  const int n_items = kPersistent ? dense_grid_blocks(p, Br) : 1;
  const int x = kPersistent ? static_cast<int>(blockIdx.x) : 0;
  const int G = kPersistent ? static_cast<int>(gridDim.x) : 1;
  const int rounds = (n_items + G - 1) / G;
  auto item_of_round = [&](int k) { return k * G + (x + k) % G; };
  const TileCoord tc0 = kPersistent ? dense_tile_coord(p, Br, x) : query_tile_coord(p, Br);  // round 0's item
  const SeqGeometry seq = seq_geometry(p, tc0.bh / p.hq);  // sequence b's rows and lengths (dense: the problem)
  if ((tc0.n_tiles - 1 - tc0.tile) * Br >= seq.nq) return;  // past this sequence's queries (never when dense)
  Policy pol(p, seq);  // (its mask is the same for every item of a persistent block: dense, no block mask)
  // Key tiles from the last to the first (see mma_forward.cu); every warpgroup walks all of them.
  auto item = [&](int g) {
    const TileCoord tc = kPersistent ? dense_tile_coord(p, Br, g) : tc0;
    const int q0 = (tc.n_tiles - 1 - tc.tile) * Br;
    return WsItem{tc.bh / p.hq, tc.bh % p.hq, q0, tiles_covering(pol.mask.keys_of(q0, q0 + Br), Bc)};
  };

  if (threadIdx.x == 0) {
    ring.init(kTma ? 1 : 128, 4 * kConsumers);  // FULL: the producer's threads, or the one TMA thread
    if (kPersistent) ws::mbar_init(q_empty, 4 * kConsumers);
    ws::mbar_init_fence();
  }
  __syncthreads();

  if (threadIdx.x < 128) {  // the producer warpgroup
    ws::regs_dec<Regs::kProducerRegs>();
    const int tid = threadIdx.x;
    if constexpr (kTma) {
      if (tid != 0) return;  // (after setmaxnreg, which the whole warpgroup runs)
      ws::tma_prefetch_map(&kp.tma_q), ws::tma_prefetch_map(&kp.tma_k), ws::tma_prefetch_map(&kp.tma_v);
    }
    int t0 = 0, started = 0;  // the ring index of the item's first tile; items with key tiles begun
    for (int k = 0; k < rounds; ++k) {
      const int g = item_of_round(k);
      if (g >= n_items) continue;  // (the last round's share of blocks past the grid's end)
      const WsItem it = item(g);
      const int n_tiles = it.kt.end - it.kt.begin;
      if (n_tiles == 0) continue;
      const int hk = it.h / p.group;
      const T* gQ = static_cast<const T*>(p.q) + it.b * p.q_s.b + it.h * p.q_s.h + (seq.q_row0 + it.q0) * p.q_s.n;
      const T* gK = static_cast<const T*>(p.k) + it.b * p.k_s.b + hk * p.k_s.h + seq.k_row0 * p.k_s.n;
      const T* gV = static_cast<const T*>(p.v) + it.b * p.v_s.b + hk * p.v_s.h + seq.k_row0 * p.v_s.n;
      // Q_i rides in K_0's group (whose FULL barrier the consumers wait for first), once the last item's S products
      // have read the one before it.
      if (kPersistent && started > 0) ws::mbar_wait(q_empty, (started - 1) & 1);
      if constexpr (kTma) {  // dense: the maps' rows are the sequences' (q_row0 = k_row0 = 0)
        for (int t = 0; t < n_tiles; ++t) {
          const int j0 = (it.kt.end - 1 - t) * Bc;
          const int r = t0 + t;
          const uint32_t slot_off = ring.slot(r) * kTileBytesK;
          ws::mbar_wait(ring.empty_k(r), ring.refill_parity(r));
          const uint32_t full_k = ring.full_k(r);
          ws::mbar_expect_tx(full_k, kTileBytesK + (t == 0 ? Br * D * 2 : 0));  // whole boxes, zero-filled or not
#pragma unroll
          for (int sl = 0; sl < kSlabs; ++sl) {
            if (t == 0) ws::tma_load_4d(sQ_u + sl * Br * 128, &kp.tma_q, 64 * sl, it.q0, it.h, it.b, full_k);
            ws::tma_load_4d(sK_u + slot_off + sl * Bc * 128, &kp.tma_k, 64 * sl, j0, hk, it.b, full_k);
          }
          ws::mbar_arrive(full_k);
          ws::mbar_wait(ring.empty_v(r), ring.refill_parity(r));
          const uint32_t full_v = ring.full_v(r);
          ws::mbar_expect_tx(full_v, kTileBytesK);
#pragma unroll
          for (int sl = 0; sl < kSlabs; ++sl)
            ws::tma_load_4d(sV_u + slot_off + sl * Bc * 128, &kp.tma_v, 64 * sl, j0, hk, it.b, full_v);
          ws::mbar_arrive(full_v);
        }
        t0 += n_tiles;
        ++started;
        continue;
      }
      copy_tile<T, Br, kSlabs>(sQ_u, gQ, p.q_s.n, seq.nq - it.q0, p.d, tid);
      for (int t = 0; t < n_tiles; ++t) {
        const int j0 = (it.kt.end - 1 - t) * Bc;
        const int r = t0 + t;  // the ring's tile index
        const uint32_t slot_off = ring.slot(r) * kTileBytesK;
        const long long k_stride = ws::opaque64(p.k_s.n), v_stride = ws::opaque64(p.v_s.n);  // nothing hoisted
        ws::mbar_wait(ring.empty_k(r), ring.refill_parity(r));
        copy_tile<T, Bc, kSlabs>(sK_u + slot_off, gK + j0 * k_stride, k_stride, seq.nk - j0, p.d, tid);
        cp_async_commit();
        if (r > 0) publish<1>(ring.full_v(r - 1));  // V_{r-1} (maybe the last item's): all but K_r have landed
        ws::mbar_wait(ring.empty_v(r), ring.refill_parity(r));
        copy_tile<T, Bc, kSlabs>(sV_u + slot_off, gV + j0 * v_stride, v_stride, seq.nk - j0, p.d, tid);
        cp_async_commit();
        publish<1>(ring.full_k(r));  // K_r (and Q_i): all but V_r have landed
      }
      t0 += n_tiles;
      ++started;
    }
    if (!kTma && t0 > 0) publish<0>(ring.full_v(t0 - 1));
    return;  // the producer's registers never meet the consumers' code
  }

  ws::regs_inc<Regs::kConsumerRegs>();
  const int c = threadIdx.x / 128 - 1;  // consumer warpgroup
  const int warp = (threadIdx.x / 32) % 4;
  const int row_w = c * 64 + warp * 16;  // first row of this warp's strip inside Q_i
  const uint32_t q_base = sQ_u + c * 64 * 128;
  // The block's last item with key tiles: its last P V is the block's last turn.
  int g_last = x;  // (round 0's item)
  if constexpr (kPersistent) {
    for (int k = rounds - 1; k > 0; --k) {
      const int g = item_of_round(k);
      if (g >= n_items) continue;
      const Range kt = item(g).kt;
      if (kt.end > kt.begin) {
        g_last = g;
        break;
      }
    }
  }
  int t0 = 0;
  for (int k = 0; k < rounds; ++k) {
    const int g = item_of_round(k);
    if (g >= n_items) continue;
    const WsItem it = item(g);
    const int n_tiles = it.kt.end - it.kt.begin;
    pol.score.at_head(p, it.b, it.h);
    mask_at_head(pol.mask, p, it.b, it.h);
    pol.dropout.at_head(p, it.b, it.h);
    float acc[D / 8][4];
    float m_run[2], l_run[2];
    softmax_start(m_run, l_run, sink_log2(p, it.h));
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
    }
    uint32_t pa[Bc / 16][4] = {};  // P_{t-1}: the A operand of the P V product in flight

    // With 160 or more registers the dropout draws go unrolled (ptxas interleaves their Philox chains).
    constexpr bool kUnrolledBits = Policy::Score::kIdentity;
    const wgmma_fwd::Steps<T, D, Bc, Br, kStages, kUnrolledBits, Policy> steps{p, pol, q_base, sK_u, sV_u, 0u,
                                                                             it.q0, row_w, it.kt.end, t0};
    WsHooks<kStages, kConsumers, kPersistent> hooks(ring, c, t0, t0 == 0, g == g_last, q_empty, n_tiles);
    wgmma_fwd::pipeline(steps, hooks, n_tiles, acc, m_run, l_run, pa);

    // Epilogue: O = acc / l, lse = (m + log2 l) ln 2.
    if constexpr (Policy::Dropout::kOn) dropout_scale_o(acc, pol.dropout);
    store_o_lse<T>(p, it.b, it.h, it.q0 + row_w, acc, m_run, l_run);
    t0 += n_tiles;
  }
}
