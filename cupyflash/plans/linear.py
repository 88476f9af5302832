"""Launch geometry of the linear-attention kernels (cuda_src/linear_chunked.cu, linear_masked.cu,
linear_fused.cu).

Pure functions of the shape and the device limits. The FFMA / TF32 kernels run 256 threads on
64-row tiles (the chunk length C) and DV-column blocks of the head dim, with 43 KB or less of
static shared memory. The fused tensor-core walk (16-bit inputs, sm_80+, ``fused_plan``) runs 128
threads per (batch, head, DV-column block) with a cp.async ring of STAGES chunks in dynamic
shared memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import DeviceLimits, LaunchPlan, cdiv

CHUNKED_SOURCE = "linear_chunked.cu"
FUSED_SOURCE = "linear_fused.cu"
MASKED_SOURCE = "linear_masked.cu"
THREADS = 256
CHUNK = 64  # chunk length C = rows of every tile (kChunk in the source)
ROW_BLOCK = 64  # rows of D per state block (kRows)
COLUMN_BLOCKS = (64, 128)  # DV instantiations
MAX_GRID_X = 2**31 - 1

#: scan modes of linear_state_scan
SCAN_FORWARD, SCAN_REVERSE, SCAN_TOTAL = 0, 1, 2


def column_block(d: int) -> int:
    """DV: 64 for D <= 64 (one block), else 128 (D = 128 in one block, 256 in two)."""
    if d < 1:
        raise ValueError(f"head dim must be positive; got {d}")
    return 64 if d <= 64 else 128


@dataclass(frozen=True)
class LinearGeometry:
    """What the launch geometry depends on, for 4-D (B, H, N, D) views."""

    batch: int  # B: the merged batch dims of one launch
    hq: int
    hk: int
    nq: int
    nk: int
    d: int
    causal: bool
    ctype: str  # "float", "__half" or "__nv_bfloat16"
    tc: bool = False  # tensor cores (16-bit inputs on sm_80+): the fused walk (chunked), TF32 tiles (masked)

    def __post_init__(self) -> None:
        if self.tc and self.ctype == "float":
            raise ValueError("float32 runs the FFMA tiles (TF32 would miss the 1e-5 accuracy bound)")
        if min(self.batch, self.hq, self.hk, self.nq, self.nk, self.d) < 1:
            raise ValueError(f"every size must be positive: {self}")
        if self.hq % self.hk:
            raise ValueError(f"hq={self.hq} is not a multiple of hk={self.hk}")

    @property
    def group(self) -> int:
        return self.hq // self.hk

    @property
    def off(self) -> int:
        """Nk - Nq: the key position of query row 0 (bottom-right aligned causal mask)."""
        return self.nk - self.nq

    @property
    def dv(self) -> int:
        return column_block(self.d)

    @property
    def targs(self) -> str:
        """Template arguments shared by every kernel: element type, DV, TC."""
        return f"{self.ctype}, {self.dv}, {'true' if self.tc else 'false'}"


def use_tensor_cores(ctype: str, compute_capability: int) -> bool:
    """Tensor cores for 16-bit inputs on sm_80+ (16-bit mma in the fused walk, TF32 in the masked
    tiles); FFMA for float32 and older GPUs."""
    return ctype != "float" and compute_capability >= 80


def _plan(source: str, name: str, grid: tuple[int, int, int]) -> LaunchPlan:
    if grid[0] > MAX_GRID_X:
        raise ValueError(f"{name}: {grid[0]} blocks exceed the grid limit; split the batch")
    return LaunchPlan(source, name, grid, (THREADS, 1, 1), 0)


# ---------------------------------------------------------------------------- chunked (state form)


def state_chunks(g: LinearGeometry, rev: bool) -> int:
    """Chunks of the state pass. Causal: chunks of key positions (queries sit at i + Nk - Nq).
    Non-causal: chunks of the rows summed into the one total state (keys forward, queries reverse)."""
    if g.causal:
        return cdiv(g.nk, CHUNK)
    return cdiv(g.nq if rev else g.nk, CHUNK)


def out_chunks(g: LinearGeometry, rev: bool) -> int:
    """Chunks of output rows: positions when causal, else the output's own rows."""
    if g.causal:
        return cdiv(g.nk, CHUNK)
    return cdiv(g.nk if rev else g.nq, CHUNK)


@dataclass(frozen=True)
class ChunkedPlan:
    """One direction of the chunked algorithm: state pass, scan, output pass.

    rev = False: state of K^T V (o, dq); rev = True: state of Q^T dO (dk, dv).
    """

    rev: bool
    state: LaunchPlan
    scan: LaunchPlan
    out: LaunchPlan
    state_chunks: int
    out_chunks: int
    scan_mode: int
    state_shape: tuple[int, int, int, int]  # float32 (B * Hq, chunks, D, D)

    @property
    def state_chunk_stride(self) -> int:
        """Elements between consecutive chunks' states as the output pass reads them (0: one total)."""
        d = self.state_shape[-1]
        return d * d if self.scan_mode != SCAN_TOTAL else 0

    @property
    def state_bytes(self) -> int:
        b, c, d, _ = self.state_shape
        return 4 * b * c * d * d


def chunked_plan(g: LinearGeometry, rev: bool) -> ChunkedPlan:
    if g.tc:
        raise ValueError("16-bit tensor-core chunked passes run the fused walk (fused_plan)")
    dv = g.dv
    nst = state_chunks(g, rev)
    nout = out_chunks(g, rev)
    state = _plan(
        CHUNKED_SOURCE,
        f"linear_chunk_state<{g.targs}>",
        (g.batch * g.hq * nst, cdiv(g.d, ROW_BLOCK) * cdiv(g.d, dv), 1),
    )
    scan = _plan(CHUNKED_SOURCE, "linear_state_scan", (g.batch * g.hq * cdiv(g.d * g.d, THREADS), 1, 1))
    hout = g.hk if rev else g.hq
    out = _plan(CHUNKED_SOURCE, f"linear_chunk_out<{g.targs}>", (g.batch * hout * nout, cdiv(g.d, dv), 1))
    mode = SCAN_TOTAL if not g.causal else (SCAN_REVERSE if rev else SCAN_FORWARD)
    return ChunkedPlan(rev, state, scan, out, nst, nout, mode, (g.batch * g.hq, nst, g.d, g.d))


# ---------------------------------------------------------------------------- fused walk (16-bit, sm_80+)

FUSED_THREADS = 128
#: (DK, DV): head dim padded to DK (zeros), output columns per block
FUSED_SHAPES = ((64, 16), (64, 32), (64, 64), (128, 16), (128, 32), (128, 64), (256, 32))
FUSED_STAGES = (1, 2, 3)


def fused_stage_counts(dk: int) -> tuple[int, ...]:
    """Ring depths instantiated for DK: three only at DK = 64 (deeper ones cannot share an SM, and
    DK = 128 spills with three on sm_80)."""
    return FUSED_STAGES if dk == 64 else FUSED_STAGES[:2]


def fused_dk(d: int) -> int:
    """The head dim rounded up to a tile of the state split over 4 warps (64, 128 or 256)."""
    if not 1 <= d <= 256:
        raise ValueError(f"the fused walk takes head dims 1..256; got {d}")
    return 64 if d <= 64 else 128 if d <= 128 else 256


#: bytes of the decay table lambda^0 .. lambda^C (float32, padded to 16 bytes; kPowers in the source)
POWER_BYTES = 4 * 68


def fused_shared_bytes(dk: int, dv: int, stages: int) -> int:
    """STAGES x (X, Y chunk tiles [64][DK + 8] and a Z tile [64][DV + 8]) + the state [DK][DV + 8], 16-bit,
    + the decay table."""
    return 2 * (stages * (2 * CHUNK * (dk + 8) + CHUNK * (dv + 8)) + dk * (dv + 8)) + POWER_BYTES


#: ring depths of the state-only kernel (linear_fused_state)
STATE_STAGES = (1, 2)
#: blocks of the state-only kernel per SM (its __launch_bounds__ keeps it within 168 registers)
STATE_BLOCKS_PER_SM = 3


def fused_state_bytes(dk: int, dv: int, stages: int) -> int:
    """The state-only kernel's ring: STAGES x (a Y tile [64][DK + 8] and a Z tile [64][DV + 8]), 16-bit,
    + the decay table."""
    return 2 * stages * (CHUNK * (dk + 8) + CHUNK * (dv + 8)) + POWER_BYTES


#: chunks per segment at least, when a causal walk is split into segments
MIN_SEGMENT_CHUNKS = 4
#: U slots a segment's walk sums at most before it starts (bounds the state kernel's split)
MAX_SLOTS_PER_WALK = 32


@dataclass(frozen=True)
class FusedPlan:
    """One pass of linear_fused_walk: o / dq (rev = False) or dk / dv (rev = True).

    With ``segments`` > 1 the causal walk is split into runs of ``seg_len`` chunks: ``state``
    (linear_fused_state) first writes the own state sums of the ``u_shape[2]`` slots of ``sub_len``
    chunks before the last run into a float32 buffer of ``u_shape``, then ``launch`` walks every run
    from the decayed sum of the slots before it."""

    rev: bool
    dk: int
    dv: int
    stages: int
    launch: LaunchPlan
    segments: int = 1
    seg_len: int = 0
    state: LaunchPlan | None = None
    u_shape: tuple[int, ...] = (1,)
    sub_len: int = 1

    @property
    def slots(self) -> int:
        return self.u_shape[2] if self.state is not None else 1


def fused_plan(
    g: LinearGeometry,
    rev: bool,
    limits: DeviceLimits,
    dv: int | None = None,
    stages: int | None = None,
    segments: int | None = None,
    sub_len: int | None = None,
) -> FusedPlan:
    """DV = 64 (DK = 256: 32, for registers): measured faster than 32 or 16 at D = 64 on an H200
    even with fewer blocks, as narrower blocks recompute the score tile per column block.
    STAGES: the deepest ring (chunks loaded ahead of the math) that still lets two blocks share an
    SM (255 registers allow two), else the deepest that fits one.
    A causal walk with fewer blocks than SMs is split into segments, up to one wave of two blocks
    per SM (at least MIN_SEGMENT_CHUNKS chunks each), except the GQA reverse passes (their blocks
    sum heads). The state kernel splits each segment but the last into k slots, as many as one wave
    of STATE_BLOCKS_PER_SM blocks per SM holds, with at most MAX_SLOTS_PER_WALK slots before a walk
    (``sub_len`` forces the chunks per slot)."""
    if g.ctype == "float":
        raise ValueError("the fused walk runs 16-bit tensor-core tiles only")
    dk = fused_dk(g.d)
    hout = g.hk if rev else g.hq
    if dv is None:
        dv = 64 if dk <= 128 else 32
    if (dk, dv) not in FUSED_SHAPES:
        raise ValueError(f"no fused instantiation for DK={dk}, DV={dv}")
    if stages is not None and stages not in fused_stage_counts(dk):
        raise ValueError(f"no fused instantiation for DK={dk} with {stages} stages")
    if stages is None:
        two = [s for s in fused_stage_counts(dk) if 2 * fused_shared_bytes(dk, dv, s) <= limits.max_shared_per_block]
        one = [s for s in fused_stage_counts(dk) if fused_shared_bytes(dk, dv, s) <= limits.max_shared_per_block]
        stages = max(two or one or [1])
    nbytes = fused_shared_bytes(dk, dv, stages)
    if nbytes > limits.max_shared_per_block:
        raise ValueError(
            f"the fused walk needs {nbytes} B of shared memory; the device allows {limits.max_shared_per_block}"
        )
    ncol = cdiv(g.d, dv)
    if g.batch * g.hq > MAX_GRID_X:
        raise ValueError(f"linear_fused_walk: {g.batch * g.hq} blocks exceed the grid limit; split the batch")
    nchunks = cdiv(g.nk, CHUNK)
    blocks = g.batch * hout * ncol
    if not g.causal or (rev and g.group > 1):
        segments = 1
    elif segments is None:
        segments = (2 * limits.sm_count) // blocks if blocks < limits.sm_count else 1
        segments = max(1, min(segments, nchunks // MIN_SEGMENT_CHUNKS))
    segments = max(1, min(segments, nchunks))
    seg_len = cdiv(nchunks, segments)
    segments = cdiv(nchunks, seg_len)  # no empty segment
    name = f"linear_fused_walk<{g.ctype}, {dk}, {dv}, {stages}>"
    block = (FUSED_THREADS, 1, 1)
    if segments == 1:
        walk = LaunchPlan(FUSED_SOURCE, name, (g.batch * hout, ncol, 1), block, nbytes)
        return FusedPlan(rev, dk, dv, stages, walk, 1, nchunks, sub_len=nchunks)
    heads = g.batch * g.hq * ncol  # state blocks per slot
    k = (STATE_BLOCKS_PER_SM * limits.sm_count) // (heads * (segments - 1))  # slots per segment
    k = max(1, min(k, MAX_SLOTS_PER_WALK // (segments - 1), seg_len))
    sub_len = cdiv(seg_len, k) if sub_len is None else max(1, min(sub_len, seg_len))
    seg_len = sub_len * cdiv(seg_len, sub_len)  # whole slots per segment
    segments = cdiv(nchunks, seg_len)
    slots = (segments - 1) * (seg_len // sub_len)
    walk = LaunchPlan(FUSED_SOURCE, name, (g.batch * hout, ncol, segments), block, nbytes)
    fits = [s for s in STATE_STAGES if fused_state_bytes(dk, dv, s) <= limits.max_shared_per_block]
    sst = max(fits or [1])
    state = LaunchPlan(FUSED_SOURCE, f"linear_fused_state<{g.ctype}, {dk}, {dv}, {sst}>",
                       (g.batch * g.hq, ncol, slots), block, fused_state_bytes(dk, dv, sst))  # fmt: skip
    return FusedPlan(rev, dk, dv, stages, walk, segments, seg_len, state, (g.batch, g.hq, slots, ncol, dk * dv), sub_len)


# ---------------------------------------------------------------------------- masked (tiled)


def masked_tiles(g: LinearGeometry, rev: bool) -> int:
    """64-row tiles of the output: query rows (o, dq) or key rows (dk, dv)."""
    return cdiv(g.nk if rev else g.nq, CHUNK)


def masked_plan(g: LinearGeometry, rev: bool, dmask: bool = False) -> LaunchPlan:
    if dmask and rev:
        raise ValueError("the mask gradient is accumulated by the query-row (dq) pass, not rev")
    hout = g.hk if rev else g.hq
    flag = "true" if dmask else "false"
    return _plan(
        MASKED_SOURCE,
        f"linear_masked<{g.targs}, {flag}>",
        (g.batch * hout * masked_tiles(g, rev), cdiv(g.d, g.dv), 1),
    )


def instantiations(ctypes: tuple[str, ...]) -> list[tuple[str, str]]:
    """Every (source, name expression) the linear family can launch."""
    out = [(CHUNKED_SOURCE, "linear_state_scan")]
    for t in ctypes:
        for tc in ("false",) if t == "float" else ("true", "false"):
            for dv in COLUMN_BLOCKS:
                if tc == "false":  # 16-bit tensor-core chunked passes run the fused walk instead
                    out.append((CHUNKED_SOURCE, f"linear_chunk_state<{t}, {dv}, {tc}>"))
                    out.append((CHUNKED_SOURCE, f"linear_chunk_out<{t}, {dv}, {tc}>"))
                for flag in ("false", "true"):
                    out.append((MASKED_SOURCE, f"linear_masked<{t}, {dv}, {tc}, {flag}>"))
        if t != "float":
            for dk, dv in FUSED_SHAPES:
                for st in fused_stage_counts(dk):
                    out.append((FUSED_SOURCE, f"linear_fused_walk<{t}, {dk}, {dv}, {st}>"))
                for st in STATE_STAGES:
                    out.append((FUSED_SOURCE, f"linear_fused_state<{t}, {dk}, {dv}, {st}>"))
    return out
