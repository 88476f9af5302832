// FlashAttention-2 backward on Hopper warpgroup MMA (sm_90a, fp16/bf16): the main kernel of the mma
// family's three launches (mma_bwd_delta and mma_bwd_dq_convert from mma_backward.cu run around it).
//
// Block = one K_j/V_j tile of Bc = 64 kWG keys of one (batch, kv head), looping over the group's query
// heads and their Q_i tiles of Br rows; warpgroup g owns keys [64g, 64g + 64) and, for them, dK_j and dV_j
// in f32 registers. Per Q_i, all products are wgmma (key-major, so P^T and dS^T are A fragments):
//   S^T  = K_g Q_i^T   (SS)        P^T  = exp2(S^T * scale*log2e - lse*log2e)
//   dP^T = V_g dO_i^T  (SS)        dS^T = P^T * (dP^T - Delta)
//   dV_g += P^T dO_i   (RS)        dK_g += dS^T Q_i   (RS)
//   dQ_i += dS K_j     (SS: dS^T through shared memory, both operands MN-major), out by f32 red.add.
// dQ_i is split between the warpgroups by query rows when Br = 128 (each 64 rows x D), by columns when
// Br = 64 (each 64 rows x D/2, a 64-column slab of K_j). Every tile is 64-column slabs of TileLayout<64>
// (the 128-byte swizzle of wgmma_primitives.cuh); D is the padded head dim, d the true one.
//
// kDrawer (dropout only): a third warpgroup, the drawer, draws every step's keep bits (Philox) into a ring in shared
// memory, kKeepSlots steps ahead, while the two warpgroups that compute load them (32 bits at a time). The backward
// waits on latency (two warps a scheduler), so the drawer's dependent Philox chains fill issue slots that stood idle
// instead of lengthening the compute warps' steps; the compute warpgroups hand a slot back where they wait on the
// tensor cores, which is when the drawer runs. Each drawer thread draws both lanes of a lane pair
// (dropout_bits_pair: no shuffles). Its warpgroup gives its registers to the compute warpgroups (setmaxnreg), and it
// takes no part in their barriers (named barrier 1 of 256 threads).
#include "mma_primitives.cuh"
#include "mma_softmax.cuh"
#include "wgmma_primitives.cuh"
#include "dq_turns.cuh"
#include "dq_own.cuh"
#include "ws_primitives.cuh"

using namespace cupyflash;
using namespace cupyflash::mma;

// Registers with the drawer or the loader: the warp-specialised forward's split (ws::WsRegs<2>: the launch gives each
// of the 384 threads 168; the helper keeps the producer's 24 and the two compute warpgroups take 240 each).
using DrawerRegs = ws::WsRegs<2>;
constexpr int kKeepSlots = 4;  // steps the drawer may run ahead (plans.wgmma.KEEP_SLOTS)

// 32-bit word w of a lane's keep bits from the drawer's ring, in its place (the other bits 0): loaded where each
// use is (word 0 early), volatile so that the uses load again instead of holding the bits (held through the step,
// they spilled the tiles at the compute warpgroups' 240 registers).
template <typename Keep>
__device__ __forceinline__ Keep ring_keep_word(uint32_t addr, int w) {
  unsigned x;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(x) : "r"(addr + 4 * w));
  return static_cast<Keep>(x) << (32 * w);
}

// kLoader (plans.wgmma.uses_loader): a third warpgroup, the loader, copies K_j, V_j and every step's Q_i, dO_i, lse
// and Delta into the kStages ring, one cp.async group a step, published on the slot's FULL mbarrier as soon as it has
// landed (count: its 128 threads, each once its own copies have landed and been fenced for the async proxy). The
// compute warpgroups wait on FULL instead of their own cp.async groups and hand the slot back on EMPTY (one arrival a
// compute warp) once the step's last product reading it (dK) has landed. They lose the copies' issue and address
// arithmetic and the barrier at the top of a step: dS^T has two buffers (step it writes buffer it % 2), so a
// warpgroup a step ahead never writes the half the other still reads for dQ (tests/test_ws_backward_protocol.py
// models both rules). The barrier stays for deterministic turns, whose pass it orders. The loader also adds dQ_i
// into the f32 accumulator: the compute warpgroups store their parts into a shared tile (FULL/EMPTY of dq_pipe) and
// the loader hands each row to a bulk reduction (cp.reduce.async.bulk ... add.f32), instead of 16 red.global.add.v2 a
// compute thread a step; deterministic turns keep the red.add path. Not with dropout (the drawer's place), mask/bias
// arrays (staged tiles) or kOwnDQ. Measured against the lockstep kernel 1.01-1.05x (loader), then the bulk dQ adds
// 1.05-1.10x at D = 64, 1.17x with softcap at D = 128, 0.97-1.02x on its plain scores (H200, s24).
//
//
// kTma (with kLoader; plans.wgmma.uses_tma: dense calls whose q and dout TMA maps can describe; TmaParams): one
// loader thread copies Q_i and dO_i by TMA (a box of 64 columns x Br rows a slab, the maps' 128-byte swizzle = the
// tiles' TileLayout<64>, rows past Nq and columns past d zero-filled), their bytes completing on the slot's FULL
// (expect_tx first). Each loader thread's lse/Delta cp.async then counts on FULL by itself once landed
// (cp.async.mbarrier.arrive.noinc: FULL still expects 128 arrivals), so from step 1 on no loader thread waits for a
// copy and the dQ adds of step it - 1 follow step it's issue at once. Step 0 keeps the blocking publish: its K_j/V_j
// are cp.async writes that wgmma reads, which need the writer's proxy fence after they land.
//
// kOwnDQ: one key tile covers every key of the kv head, and the block does Delta and stores dQ (dq_own.cuh).
template <typename T, int D, int Br, int kWG, int kStages, class Policy, bool kOwnDQ = false, bool kDrawer = false,
          bool kLoader = false, bool kTma = false>
__global__ void __launch_bounds__(kWG * 128 + (kDrawer || kLoader ? 128 : 0), 1)
    wgmma_flash_bwd(const __grid_constant__ typename KernelParams<kTma>::type kp) {
  const AttentionParams& p = params_of(kp);
  const T* __restrict__ q = static_cast<const T*>(p.q);
  const T* __restrict__ k = static_cast<const T*>(p.k);
  const T* __restrict__ v = static_cast<const T*>(p.v);
  const T* __restrict__ dout = static_cast<const T*>(p.dout);
  const float* __restrict__ lse = p.lse;
  const float* __restrict__ delta = p.delta;
  float* __restrict__ dq_accum = p.dq_accum;
  const int d = p.d, group = p.group;
  const long long q_sb = p.q_s.b, q_sh = p.q_s.h, q_sn = p.q_s.n;
  const long long k_sb = p.k_s.b, k_sh = p.k_s.h, k_sn = p.k_s.n;
  const long long v_sb = p.v_s.b, v_sh = p.v_s.h, v_sn = p.v_s.n;
  const long long do_sb = p.dout_s.b, do_sh = p.dout_s.h, do_sn = p.dout_s.n;
  const long long lse_sb = p.lse_s.b, lse_sh = p.lse_s.h, lse_sn = p.lse_s.n;
  const float scale_log2 = p.scale_log2;
  constexpr int kThreads = kWG * 128;  // the warpgroups that compute (the drawer or the loader comes after them)
  constexpr int kSync = kDrawer || kLoader ? kThreads : 0;  // their barrier: sync_block<kSync>
  constexpr int Bc = 64 * kWG;
  constexpr int kSlabs = D / 64;  // 64-column slabs of a Q/K/V/dO tile
  constexpr int kNQ = Br / 8;     // n8 tiles of S^T (queries) per warp strip
  constexpr bool kDQByRows = Br == 64 * kWG;  // else by columns: Br = 64, D = 64 kWG
  static_assert(D == 64 || D == 128, "instantiated head dims");
  static_assert(kWG == 2 && (Br == 64 || Br == 128), "instantiated tiles");
  static_assert(kDQByRows || (Br == 64 && D == 64 * kWG), "dQ split: by rows (Br = Bc) or by 64-column slabs");
  static_assert(kStages >= 2, "Q_i/dO_i ring needs a slot to fill while another is read");
  static_assert(!kDrawer || (Policy::Dropout::kOn && DrawerRegs::kThreads == kThreads + 128),
                "a drawer draws dropout's bits, beside 2 warpgroups");
  static_assert(!kLoader || (!kDrawer && !kOwnDQ && !Policy::Dropout::kOn && DrawerRegs::kThreads == kThreads + 128),
                "a loader beside 2 warpgroups, without the drawer or dQ ownership");
  constexpr int kKVBytes = Bc * D * 2;
  constexpr int kQBytes = Br * D * 2;
  constexpr int kSlabBytesKV = Bc * 128;
  constexpr int kSlabBytesQ = Br * 128;
  // Staged mask/bias tiles (ArrayScore<..., Br, Bc>, when the plan found room): one per Q_i/dO_i ring slot, the
  // step's Br queries x this block's Bc keys, copied in the same group as that step's Q_i and dO_i.
  constexpr int kScoreBytes = score_tile_bytes<typename Policy::Score>();
  static_assert(score_tile_is<typename Policy::Score, Br, Bc>(), "score tiles staged as the kernel's Br x Bc");
  static_assert(!kLoader || kScoreBytes == 0, "the loader copies no score tiles");
  static_assert(!kTma || kLoader, "TMA copies are the loader's");

  // wgmma's swizzle pattern repeats every 1024 bytes: the host asks for 1 KB extra to align the base.
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const uint32_t raw_u = smem_u32(smem_raw);
  const uint32_t sK_u = (raw_u + 1023u) & ~1023u;
  const uint32_t sV_u = sK_u + kKVBytes;
  const uint32_t sQ_u = sV_u + kKVBytes;           // [kStages] tiles
  const uint32_t sdO_u = sQ_u + kStages * kQBytes;  // [kStages] tiles
  const uint32_t sdS_u = sdO_u + kStages * kQBytes;  // dS^T: Bc keys x Br queries, Br / 64 slabs
  // kLoader: two dS^T buffers (step it writes buffer it % 2), so that the top-of-step barrier can go
  // (tests/test_ws_backward_protocol.py: with one, a warpgroup a step ahead overwrites its half under the other's dQ).
  constexpr int kDSBuffers = kLoader ? 2 : 1;
  const uint32_t sStat_u = sdS_u + kDSBuffers * Bc * Br * 2;  // [kStages][2][Br] f32: lse, Delta
  const uint32_t sScore_u = sStat_u + kStages * 2 * Br * 4;  // [kStages] score-array tiles (none: 0 bytes)
  // With the drawer: [kKeepSlots][4 kWG warps][32 lanes] keep bits, then the ring's barriers.
  using Keep = KeepBits<kNQ>;
  constexpr int kKeepPerSlot = kWG * 4 * 32;
  const uint32_t sKeep_u = (sScore_u + kStages * kScoreBytes + 15u) & ~15u;
  const ws::Pipe<kKeepSlots> keep_pipe{sKeep_u + kKeepSlots * kKeepPerSlot * static_cast<int>(sizeof(Keep))};
  // kLoader (no drawer then): the dQ tile for the loader's bulk adds (Br rows of D floats, kDQPitch bytes apart), then
  // the ring's FULL/EMPTY and the dQ tile's.
  constexpr int kDQPitch = D * 4 + 32;  // a row's float2 stores from 8 rows x 4 lanes fall in distinct banks
  const uint32_t sDQ_u = (sKeep_u + 127u) & ~127u;
  const ws::Pipe<kStages> load_pipe{sDQ_u + Br * kDQPitch};
  const ws::Pipe<1> dq_pipe{load_pipe.base + ws::Pipe<kStages>::kBytes};
  auto at = [&](uint32_t u) { return smem_raw + (u - raw_u); };
  T* const sK = reinterpret_cast<T*>(at(sK_u));
  T* const sV = reinterpret_cast<T*>(at(sV_u));
  T* const sQ = reinterpret_cast<T*>(at(sQ_u));
  T* const sdO = reinterpret_cast<T*>(at(sdO_u));
  float* const sStat = reinterpret_cast<float*>(at(sStat_u));

  const TileCoord tc = dq_key_tile_coord<Policy>(p, Bc);  // (batch * kv heads, key tile): dq_turns.cuh
  const int b = tc.bh / p.hk;
  const int hkv = tc.bh % p.hk;
  const int j0 = tc.tile * Bc;
  // Sequence b's rows and lengths (dense: the whole problem); the loop re-reads them where it needs them
  // (seq_geometry of an opaque b) instead of keeping them live.
  const SeqGeometry seq = seq_geometry(p, b);
  if (j0 >= seq.nk) return;  // past this sequence's keys (never when dense)
  const int wg = threadIdx.x / 128;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;

  // Query tiles that see any key of K_j (under causal, not those wholly above the diagonal).
  const Range mt = tiles_covering(Policy(p, seq).mask.queries_of(j0, j0 + Bc), Br);
  const int m_start = mt.begin;
  const int per_head = mt.end - mt.begin;
  const int total = group * per_head;

  auto tile_of = [&](int it, int& hh, int& i0) {
    hh = hkv * group + it / per_head;
    i0 = (m_start + it % per_head) * Br;
  };
  // Element e of step (hh, i0)'s lse (e < Br) and Delta (e >= Br) into ring slot buf by cp.async; rows past Nq: 0
  // (they then contribute nothing whatever P is). The lockstep kernel's load_step and the loader both copy so.
  auto copy_stat = [&](int e, int buf, int hh, int i0, int bo, const SeqRows& sq) {
    const int r = e % Br;
    const int i = min(i0 + r, sq.nq - 1);  // >= 0: a step exists only where the sequence has queries
    const float* src = e < Br ? lse + bo * lse_sb + hh * lse_sh + (sq.q_row0 + i) * lse_sn
                              : delta + scratch_row(p, sq, bo, hh) + i;
    cp_async_4(sStat_u + (buf * 2 * Br + e) * 4, src, i0 + r < sq.nq ? 4 : 0);
  };
  // kLoader: dQ_i's adds go through the loader's bulk reductions, unless deterministic turns order them (red.add)
  const bool bulk_dq = kLoader && p.dq_turns == nullptr;
  if constexpr (kDrawer) {
    if (threadIdx.x == 0) {
      keep_pipe.init(128, kThreads);
      ws::mbar_init_fence();
    }
    __syncthreads();  // the last barrier of all 384 threads
    if (threadIdx.x >= kThreads) {  // the drawer: warp w draws the strips of warp w of both compute warpgroups
      ws::regs_dec<DrawerRegs::kProducerRegs>();
      const int w = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
      // Lane 16 g + 4 c + t draws the lane pair (8 c + t, 8 c + 4 + t) of warp w's strip in warpgroup g.
      static_assert(kWG == 2, "32 lane pairs: 16 a strip, two strips");
      constexpr int kWords = sizeof(Keep) / 4;
      const int g = lane / 16, c = (lane / 4) % 4, t = lane % 4;
      Keep* const sKeep = reinterpret_cast<Keep*>(at(sKeep_u));
      for (int it = 0; it < total; ++it) {
        int hh, i0;
        tile_of(it, hh, i0);
        typename Policy::Dropout drop(p);
        drop.at_head(p, b, hh);
        ws::mbar_wait(keep_pipe.empty(it), ws::Ring<kKeepSlots>::refill_parity(it));
        Keep* const slot = sKeep + ws::Ring<kKeepSlots>::slot(it) * kKeepPerSlot;
        unsigned even[kWords], odd[kWords];
        dropout_bits_pair<kNQ>(j0 + g * 64 + w * 16 + 2 * c, i0 + 2 * t, drop, even, odd);
        unsigned* const words = reinterpret_cast<unsigned*>(slot + (g * 4 + w) * 32 + 8 * c + t);
#pragma unroll
        for (int h = 0; h < kWords; ++h) words[h] = even[h], words[4 * kWords + h] = odd[h];
        ws::mbar_arrive(keep_pipe.full(it));
      }
      return;
    }
    ws::regs_inc<DrawerRegs::kConsumerRegs>();
  }
  if constexpr (kLoader) {
    if (threadIdx.x == 0) {
      load_pipe.init(128, kWG * 4);
      dq_pipe.init(kWG * 4, 128);  // the compute warps write dQ_i, the loader's threads read it
      ws::mbar_init_fence();
    }
    __syncthreads();  // the last barrier of all 384 threads
    // dQ_i of step t, from the compute warpgroups' tile into dQ's f32 accumulator: one bulk reduction a row (thread
    // tid's row tid), read from shared memory before the tile goes back to the compute warpgroups.
    auto add_dq = [&](int t, int tid) {
      ws::mbar_wait(dq_pipe.full(t), ws::Ring<1>::fill_parity(t));
      int hh, i0;
      tile_of(t, hh, i0);
      const int bo = opaque(b);
      const SeqRows sq = seq_queries(p, bo);
      if (tid < Br && i0 + tid < sq.nq)
        ws::bulk_add_f32(dq_accum + (scratch_row(p, sq, bo, hh) + i0 + tid) * d, sDQ_u + tid * kDQPitch, d * 4);
      ws::bulk_commit();
      ws::bulk_wait_read<0>();
      ws::mbar_arrive(dq_pipe.empty(t));
    };
    if (threadIdx.x >= kThreads) {  // the loader: copies and dQ's bulk adds, in lean loops
      ws::regs_dec<DrawerRegs::kProducerRegs>();
      const int tid = threadIdx.x - kThreads;
      if constexpr (kTma) {
        if (tid == 0) ws::tma_prefetch_map(&kp.tma_q), ws::tma_prefetch_map(&kp.tma_dout);
      }
      if (total > 0) {  // K_j and V_j ride in step 0's group
        const long long ks = ws::opaque64(k_sn), vs = ws::opaque64(v_sn);
        ws::copy_tile<T, Bc, kSlabs>(sK_u, k + b * k_sb + hkv * k_sh + (seq.k_row0 + j0) * ks, ks, seq.nk - j0, d, tid);
        ws::copy_tile<T, Bc, kSlabs>(sV_u, v + b * v_sb + hkv * v_sh + (seq.k_row0 + j0) * vs, vs, seq.nk - j0, d, tid);
      }
      // Step it's copies are issued and published once they have landed. (Published after step it + 1's issue, as
      // the ws forward's producer does, FULL(it) waited for the consumers' EMPTY of step it - 1 and the next
      // issue: a bubble every step with two stages, 0.90-0.92x the lockstep kernel, s23.)
      for (int it = 0; it < total; ++it) {
        const int buf = ws::Ring<kStages>::slot(it);
        ws::mbar_wait(load_pipe.empty(it), ws::Ring<kStages>::refill_parity(it));
        int hh, i0;
        tile_of(it, hh, i0);
        const int bo = opaque(b);
        const SeqRows sq = seq_queries(p, bo);
        if constexpr (kTma) {  // dense: the maps' rows are the sequence's (q_row0 = 0)
          if (tid == 0) {
            const uint32_t full = load_pipe.full(it);
            ws::mbar_expect_tx(full, 2 * kQBytes);
#pragma unroll
            for (int sl = 0; sl < kSlabs; ++sl) {
              ws::tma_load_4d(sQ_u + buf * kQBytes + sl * kSlabBytesQ, &kp.tma_q, 64 * sl, i0, hh, bo, full);
              ws::tma_load_4d(sdO_u + buf * kQBytes + sl * kSlabBytesQ, &kp.tma_dout, 64 * sl, i0, hh, bo, full);
            }
          }
        } else {
          const long long qs = ws::opaque64(q_sn), dos = ws::opaque64(do_sn);
          const long long row = sq.q_row0 + i0;
          ws::copy_tile<T, Br, kSlabs>(sQ_u + buf * kQBytes, q + bo * q_sb + hh * q_sh + row * qs, qs, sq.nq - i0, d,
                                       tid);
          ws::copy_tile<T, Br, kSlabs>(sdO_u + buf * kQBytes, dout + bo * do_sb + hh * do_sh + row * dos, dos,
                                       sq.nq - i0, d, tid);
        }
#pragma unroll 1
        for (int e = kTma ? opaque(tid) : tid; e < 2 * Br; e += 128) copy_stat(e, buf, hh, i0, bo, sq);  // lse, Delta
        cp_async_commit();
        if (kTma && it > 0) ws::cp_async_arrive_noinc(load_pipe.full(it));  // lse/Delta: read by ld.shared only
        else ws::publish<0>(load_pipe.full(it));
        if (bulk_dq && it > 0) add_dq(it - 1, tid);
      }
      if (bulk_dq && total > 0) add_dq(total - 1, tid);
      if constexpr (kTma) cp_async_wait<0>();  // no copy outlives its thread (deterministic turns: no add_dq above)
      return;
    }
    ws::regs_inc<DrawerRegs::kConsumerRegs>();
  }
  if constexpr (kOwnDQ) {  // before step 0's cp.async reads Delta
    own_rows<T, D, kThreads>(p, b, hkv * group, group, m_start * Br, mt.end * Br);
    __threadfence_block();
    sync_block<kSync>();
  }
  // Q_i, dO_i, lse and Delta of iteration it into ring slot buf (one cp.async group, committed by the caller).
  // Rows past Nq are zeros with lse = Delta = 0: they contribute nothing whatever P is.
  auto load_step = [&](int it, int buf) {
    int hh, i0;
    tile_of(it, hh, i0);
    const int bo = opaque(b), tid = opaque(static_cast<int>(threadIdx.x));
    const SeqRows sq = seq_queries(p, bo);
    const int nq = sq.nq, row = sq.q_row0 + i0;
    const T* gQ = q + bo * q_sb + hh * q_sh + row * q_sn;
    const T* gdO = dout + bo * do_sb + hh * do_sh + row * do_sn;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl) {
      load_tile_async<T, 64, Br, kThreads>(sQ + (buf * kSlabs + sl) * Br * 64, gQ + 64 * sl, q_sn, nq - i0,
                                           d - 64 * sl, tid);
      load_tile_async<T, 64, Br, kThreads>(sdO + (buf * kSlabs + sl) * Br * 64, gdO + 64 * sl, do_sn, nq - i0,
                                           d - 64 * sl, tid);
    }
    if (tid < 2 * Br) copy_stat(tid, buf, hh, i0, bo, sq);
    stage_score_tile<typename Policy::Score, kThreads>(p, bo, hh, i0, j0, sScore_u + buf * kScoreBytes, tid);
  };

  float acc_dv[D / 8][4], acc_dk[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dv[n][e] = acc_dk[n][e] = 0.f;
  }

  if (total > 0 && !kLoader) {
    const T* gK = k + b * k_sb + hkv * k_sh + (seq.k_row0 + j0) * k_sn;
    const T* gV = v + b * v_sb + hkv * v_sh + (seq.k_row0 + j0) * v_sn;
#pragma unroll
    for (int sl = 0; sl < kSlabs; ++sl) {
      load_tile_async<T, 64, Bc, kThreads>(sK + sl * Bc * 64, gK + 64 * sl, k_sn, seq.nk - j0, d - 64 * sl,
                                           threadIdx.x);
      load_tile_async<T, 64, Bc, kThreads>(sV + sl * Bc * 64, gV + 64 * sl, v_sn, seq.nk - j0, d - 64 * sl,
                                           threadIdx.x);
    }
    load_step(0, 0);
  }
  if constexpr (!kLoader) {
    cp_async_commit();  // group 0: K_j, V_j and step 0
#pragma unroll
    for (int s = 1; s < kStages - 1; ++s) {
      if (s < total) load_step(s, s);
      cp_async_commit();
    }
  }

  const int key_w = j0 + wg * 64 + warp * 16;  // first key of this warp's strip
  // Dropout on plain scores: P^T comes out times z = 1 / (1 - p) (log2_z in its exponent) and Delta times 1 - p, so
  // that dS takes as many instructions as without dropout (ds_tile_kept) and dV no final scale. Once a step, the
  // thread that copied a query's lse or Delta turns it into what the loop uses (log2_lse with log2_z, Delta / z),
  // in shared memory, instead of every lane on every n8 tile (without dropout the same measured no faster, s16,
  // and the kernels keep their PTX).
  constexpr bool kFoldZ = Policy::Dropout::kOn && Policy::Score::kIdentity;
  const float keep_fraction = static_cast<float>(256 - static_cast<int>(p.dropout_threshold)) * (1.f / 256.f);
  const float log2_z = -log2f(keep_fraction);
  const uint32_t k_base = sK_u + wg * 64 * 128;  // this warpgroup's 64 keys inside each slab
  const uint32_t v_base = sV_u + wg * 64 * 128;

  for (int it = 0; it < total; ++it) {
    const int buf = it % kStages;
    int hh, i0;
    tile_of(it, hh, i0);
    if constexpr (kLoader) ws::mbar_wait(load_pipe.full(it), ws::Ring<kStages>::fill_parity(it));
    else cp_async_wait<kStages - 2>();  // step it (and K_j, V_j) landed for this thread...
    if constexpr (kFoldZ) {  // the lse or Delta this thread copied (load_step), in place
      const int tid = threadIdx.x;
      if (tid < 2 * Br) {
        float& x = sStat[buf * 2 * Br + tid];
        x = tid < Br ? log2_lse(x, log2_z) : x * keep_fraction;
      }
    }
    wgmma::fence_proxy_async();    // ...is visible to the tensor cores...
    // ...for every warpgroup, which are all done with step it-1 (and dS^T). The loader's kernel needs it only for the
    // deterministic turns' pass below (the ring's mbarriers and the two dS^T buffers order the rest).
    if (!kLoader || p.dq_turns != nullptr) sync_block<kSync>();
    if constexpr (!kOwnDQ) {  // deterministic: step it-1's pass, its adds ordered before it by this barrier
      if (it > 0 && threadIdx.x == 0)
        dq_turn_pass_step<Br, Bc, typename Policy::Mask>(p, opaque(b), j0, it - 1, tile_of);
    }
    if constexpr (!kLoader) {
      const int ahead = it + kStages - 1;  // into the slot step it-1 used
      if (ahead < total) load_step(ahead, ahead % kStages);
      cp_async_commit();
    }
    // Mask/bias arrays: this warp's strip of step it + 1 into L1, a whole step ahead (step 0's with it).
    prefetch_next_step<typename Policy::Score, Br, 16>(p, b, it, total, hh, i0, 0, key_w, tile_of);
    const uint32_t q_u = sQ_u + buf * kQBytes;
    const uint32_t do_u = sdO_u + buf * kQBytes;

    // S^T and dP^T issued back to back: K-major A (keys) and B (queries), one k16 step of D at a time.
    float st[kNQ][4], dpt[kNQ][4];
#pragma unroll
    for (int n = 0; n < kNQ; ++n) {  // zeroed although the first k step overwrites them: an undefined
#pragma unroll                       // input between fence and wgmma makes ptxas serialise (see forward)
      for (int e = 0; e < 4; ++e) st[n][e] = dpt[n][e] = 0.f;
    }
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t off = (ks / 4) * kSlabBytesKV + (ks % 4) * 32;
      const uint32_t offq = (ks / 4) * kSlabBytesQ + (ks % 4) * 32;
      wgmma::mma_ss<T, Br>(st, wgmma::desc_sw128(k_base + off), wgmma::desc_sw128(q_u + offq), ks > 0);
    }
    wgmma::commit();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t off = (ks / 4) * kSlabBytesKV + (ks % 4) * 32;
      const uint32_t offq = (ks / 4) * kSlabBytesQ + (ks % 4) * 32;
      wgmma::mma_ss<T, Br>(dpt, wgmma::desc_sw128(v_base + off), wgmma::desc_sw128(do_u + offq), ks > 0);
    }
    wgmma::commit();

    // Dropout's keep bits of this step: from the drawer's ring, or drawn while S^T and dP^T run on the tensor
    // cores where registers allow (plain scores: with softcap/ALiBi the bits held through score_strip spilled
    // 156 B at D = 64), else after.
    constexpr bool kEarlyBits = Policy::Dropout::kOn && Policy::Score::kIdentity && !kDrawer;
    Keep keep = 0;
    // (its address rebuilt at each load from the step's slot: nothing more held through the step)
    auto keep_u = [&]() {
      return sKeep_u + (ws::Ring<kKeepSlots>::slot(opaque(it)) * kKeepPerSlot + (wg * 4 + warp) * 32 + lane) *
                           static_cast<uint32_t>(sizeof(Keep));
    };
    if constexpr (kDrawer) {
      ws::mbar_wait(keep_pipe.full(it), ws::Ring<kKeepSlots>::fill_parity(it));
      keep = ring_keep_word<Keep>(keep_u(), 0);  // the first word before the wait for S^T: its latency off the path
    } else if constexpr (kEarlyBits) {
      typename Policy::Dropout drop(p);
      drop.at_head(p, b, hh);
      keep = dropout_bits<kNQ, true>(key_w, i0, drop);
    }

    // P^T, while dP^T is in flight.
    wgmma::wait<1>();
    wgmma::fence_operands(st);
    const int quad2 = (lane & 3) * 2;  // this lane's query pair inside each n8 tile
    const float* lse_b = sStat + buf * 2 * Br + quad2;
    const float* delta_b = lse_b + Br;
    Policy pol(p, seq_geometry(p, opaque(b)));  // per step, from lengths re-read here (see above)
    pol.score.at_head(p, b, hh);
    mask_at_head(pol.mask, p, b, hh);
    pol.dropout.at_head(p, b, hh);
    use_score_tile(pol.score, sScore_u + buf * kScoreBytes, i0, j0);
    const float c = score_strip<kNQ, true, true, OneSided<typename Policy::Mask>::value>(st, key_w, i0, pol.score,
                                                                                          scale_log2);
    if (pol.mask.partial(i0, i0 + Br, key_w, key_w + 16)) mask_strip<kNQ, true>(st, key_w, i0, pol.mask);
    probs_from_lse<kNQ, kFoldZ>(st, c, lse_b);
    // dV_g += P^T dO_i: P^T packed to the A fragments, dO_i MN-major (queries down the rows). With dropout
    // dV takes the kept P (times 1 / (1 - p): in P^T with kFoldZ, else at the end) and dS all of P.
    uint32_t pt[Br / 16][4];
    if constexpr (Policy::Dropout::kOn) {
      if constexpr (!kEarlyBits && !kDrawer) keep = dropout_bits<kNQ, true>(key_w, i0, pol.dropout);
#pragma unroll
      for (int kk = 0; kk < Br / 16; ++kk) {
        if constexpr (kDrawer) {  // a 32-bit word of the bits at a time (n8 tiles 8w.. of word w)
          if (kk % 4 == 0 && kk > 0) keep = ring_keep_word<Keep>(keep_u(), kk / 4);
        }
        pack_a_step_kept<T>(pt[kk], st, kk, keep);
      }
    } else {
      pack_a<T>(pt, st);
    }
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < Br / 16; ++kk) {
      wgmma::mma_rs<T, D>(acc_dv, pt[kk], wgmma::desc_sw128(do_u + kk * 16 * 128, kSlabBytesQ));
    }
    wgmma::commit();

    // dS^T = P^T (dP^T - Delta), packed: A of dK_g += dS^T Q_i, and to shared memory for dQ_i.
    wgmma::wait<1>();  // dP^T has landed (dV may still run)
    wgmma::fence_operands(dpt);
    uint32_t dst[Br / 16][4];
#pragma unroll
    for (int n = 0; n < kNQ; ++n) {
      if constexpr (kDrawer) {
        if (n % 8 == 0) keep = ring_keep_word<Keep>(keep_u(), n / 8);
      }
      const float2 dl = *reinterpret_cast<const float2*>(delta_b + n * 8);
      float2 lq = {0.f, 0.f};
      if constexpr (!Policy::Score::kIdentity) lq = *reinterpret_cast<const float2*>(lse_b + n * 8);
      if constexpr (kFoldZ) {
        ds_tile_kept<kNQ>(dpt[n], st[n], dpt[n], dl, keep, n);
      } else {
        if constexpr (Policy::Dropout::kOn) dropout_zero<kNQ, true>(dpt[n], keep, n);
        ds_tile<Policy::Dropout::kOn>(dpt[n], st[n], dpt[n], dl, lq, pol.score, key_w, i0 + n * 8, true,
                                      pol.dropout.scale);
      }
    }
    pack_a<T>(dst, dpt);
    {
      // dS^T row r (key), queries 16kk.. of slab kk / 4: the C-fragment pairs, 4-byte stores into the
      // swizzled rows (the 8 rows of a store hit 8 different 16-byte bank groups).
      const int r = wg * 64 + warp * 16 + (lane >> 2);
#pragma unroll
      for (int kk = 0; kk < Br / 16; ++kk) {
        const uint32_t slab = sdS_u + (it % kDSBuffers) * Bc * Br * 2 + (kk / 4) * Bc * 128;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = r + (e & 1) * 8;
          const int chunk = (2 * kk + (e >> 1)) % 8;
          const uint32_t addr = slab + row * 128 + ((chunk ^ (row & 7)) << 4) + (lane & 3) * 4;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(dst[kk][e]) : "memory");
        }
      }
    }
    wgmma::fence_proxy_async();
    sync_block<kSync>();  // dS^T complete for both warpgroups

    // dQ_i (+)= dS K_j for this warpgroup's part: A = dS^T (queries contiguous), B = K_j (D contiguous).
    float acc_dq[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dq[n][e] = 0.f;
    }
    const uint32_t ds_a = sdS_u + (it % kDSBuffers) * Bc * Br * 2 + (kDQByRows ? wg * Bc * 128 : 0);
    const uint32_t k_b = sK_u + (kDQByRows ? 0 : wg * kSlabBytesKV);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < Bc / 16; ++kk) {
      wgmma::mma_ss<T, 64, 1, 1>(acc_dq, wgmma::desc_sw128(ds_a + kk * 16 * 128),
                                  wgmma::desc_sw128(k_b + kk * 16 * 128), kk > 0);
    }
    wgmma::commit();
    // dK_g += dS^T Q_i, issued after dQ's product: dQ's adds below then run while the tensor cores do dK (issued
    // first, dK ran under the dS^T stores and the barrier, and the adds waited for both products).
#pragma unroll
    for (int kk = 0; kk < Br / 16; ++kk) {
      wgmma::mma_rs<T, D>(acc_dk, dst[kk], wgmma::desc_sw128(q_u + kk * 16 * 128, kSlabBytesQ));
    }
    wgmma::commit();
    // The step's keep bits are all loaded: the slot goes back to the drawer now, so that its next draws (a burst of
    // Philox) run while this warpgroup waits for dV, dK and dQ. Released after the last load (in the dS loop),
    // they ran beside the dS arithmetic and the D = 64 backward took 4% longer (s16).
    if constexpr (kDrawer) ws::mbar_arrive(keep_pipe.empty(it));
    // Deterministic: thread 0 reads dQ_i's turn now, its L2 round trip under the tensor cores' dK and dQ.
    int turn_seen = 0;
    if constexpr (!kOwnDQ) turn_seen = dq_turn_peek(dq_turn_slot<Br>(p, b, hh, i0));
    wgmma::wait<1>();  // dV and dQ have landed (dK may still run): pt, acc_dq and acc_dv are free
    wgmma::fence_operands(acc_dq);
    wgmma::fence_operands(acc_dv);
    wgmma::fence_operands(pt);
    if constexpr (!kOwnDQ) {  // deterministic: add after the earlier key tiles
      int* const turn_slot = dq_turn_slot<Br>(p, b, hh, i0);
      const int turn = dq_turn_at<Br, Bc, typename Policy::Mask>(p, turn_slot, opaque(b), i0, j0);
      dq_turn_wait<kSync>(turn_slot, turn, turn_seen);
    }
    if (bulk_dq) {  // dQ_i's part into the loader's tile, once it has read step it-1's
      ws::mbar_wait(dq_pipe.empty(it), ws::Ring<1>::refill_parity(it));
      const int row0 = (kDQByRows ? wg * 64 : 0) + warp * 16 + (lane >> 2);
      const int col0 = (kDQByRows ? 0 : wg * 64) + quad2;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
#pragma unroll
        for (int n = 0; n < 8; ++n) {
          const uint32_t addr = sDQ_u + (row0 + hf * 8) * kDQPitch + (col0 + n * 8) * 4;
          asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(acc_dq[n][2 * hf]),
                       "f"(acc_dq[n][2 * hf + 1]) : "memory");
        }
      }
      wgmma::fence_proxy_async();  // for the loader's bulk reads (the async proxy)
      __syncwarp();
      if (lane == 0) ws::mbar_arrive(dq_pipe.full(it));
    } else {  // dQ_i's part, added into the f32 accumulator; kOwnDQ: the only block on these rows, so dQ_i is
              // complete and stored as scale * dS K_j (dq_own.cuh)
      const int bo = opaque(b);
      const SeqRows sq = seq_queries(p, bo);
      const int nq = kOwnDQ ? p.nq : sq.nq;
      float* gdq = kOwnDQ ? nullptr : dq_accum + scratch_row(p, sq, bo, hh) * d;
      const int row0 = i0 + (kDQByRows ? wg * 64 : 0) + warp * 16 + (lane >> 2);
      const int col0 = (kDQByRows ? 0 : wg * 64) + quad2;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int row = row0 + hf * 8;
        if (row < nq) {
          const DQRow<kOwnDQ, T> out(p, gdq, bo, hh, row, d);
#pragma unroll
          for (int n = 0; n < 8; ++n) {
            const int col = col0 + n * 8;
            if (col < d) out.put2(p, col, acc_dq[n][2 * hf], acc_dq[n][2 * hf + 1]);
          }
        }
      }
    }
    wgmma::wait<0>();  // dK has landed: dst and acc_dk are free
    wgmma::fence_operands(acc_dk);
    wgmma::fence_operands(dst);
    if constexpr (kLoader) {  // every product reading the slot has landed: the loader may refill it
      if (lane == 0) ws::mbar_arrive(load_pipe.empty(it));
    }
  }
  if constexpr (!kOwnDQ) dq_turn_pass_last<Br, Bc, typename Policy::Mask, kSync>(p, opaque(b), j0, total, tile_of);
  cp_async_wait<0>();

  // dV_j and scale * dK_j (this warp's 16 keys); with dropout and no kFoldZ dV took P * keep: times 1 / (1 - p).
  if constexpr (Policy::Dropout::kOn && !kFoldZ) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dv[n][e] *= p.dropout_scale;
    }
  }
  store_dk_dv<T>(p, b, hkv, key_w, 0, acc_dk, acc_dv);
}
