"""Launch geometry of the linear-attention kernels (cuda_src/linear_chunked.cu, linear_masked.cu).

Pure functions of the shape: every kernel runs 256 threads on 64-row tiles (the chunk length C)
and DV-column blocks of the head dim, with 43 KB or less of static shared memory; the device
only decides ``tc`` (TF32 tensor cores need sm_80, see ``use_tensor_cores``).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import LaunchPlan, cdiv

CHUNKED_SOURCE = "linear_chunked.cu"
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
    tc: bool = False  # TF32 tensor-core tiles (16-bit inputs on sm_80+) instead of FFMA

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
    """TF32 mma.sync tiles for 16-bit inputs on sm_80+; FFMA for float32 and older GPUs."""
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
                out.append((CHUNKED_SOURCE, f"linear_chunk_state<{t}, {dv}, {tc}>"))
                out.append((CHUNKED_SOURCE, f"linear_chunk_out<{t}, {dv}, {tc}>"))
                for flag in ("false", "true"):
                    out.append((MASKED_SOURCE, f"linear_masked<{t}, {dv}, {tc}, {flag}>"))
    return out
