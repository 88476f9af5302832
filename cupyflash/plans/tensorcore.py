"""What the two tensor-core families (mma, wgmma) share in their launch geometry: the plan types and
the backward's helper launches (Delta = rowsum(dO * O) before the main kernel, the dQ conversion after),
which run unchanged around either family's main backward kernel."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..variants import Variant
from . import DeviceLimits, LaunchPlan, cdiv

#: The helper kernels live in the mma family's backward source (both families build it).
HELPER_SOURCE = "mma_backward.cu"

#: Threads a block of the per-row backward helpers (Delta, dQ conversion), which give each row kLanes lanes.
AUX_THREADS = 256

#: gridDim.y limit: B*H goes on y only up to this.
MAX_GRID_Y = 65535


def staged_policy(variant: Variant, rows: int, cols: int, slots: int, shared_bytes: int, limits: DeviceLimits
                  ) -> tuple[str, int]:  # fmt: skip
    """(C++ policy, shared bytes) of a kernel with ``shared_bytes`` of its own: a call with mask/bias arrays gets
    ``slots`` staged rows x cols tiles of them (``Variant.staged_policy``) where they fit beside the kernel's
    tiles, else reads them from global memory element by element (a step ahead through L1: ArrayScore's prefetch).
    The wgmma kernels stage them in slots of their own; the mma family's float32 kernels one a ring slot (K/V
    forward, Q_i/dO_i backward), its 16-bit kernels never (plans.mma._policy_and_smem)."""
    if variant.arrays:
        staged = shared_bytes + slots * variant.score_tile_bytes(rows, cols)
        if staged <= limits.max_shared_per_block:
            return variant.staged_policy(rows, cols), staged
    return variant.cpp_policy, shared_bytes


@dataclass(frozen=True)
class ForwardPlan:
    config: Any  # ForwardConfig, or the wgmma family's
    main: LaunchPlan
    heads_on_x: bool  # params.heads_fastest: how main.grid maps to (head, tile)


@dataclass(frozen=True)
class BackwardPlan:
    config: Any  # AnyBackwardConfig, or the wgmma family's BackwardConfig
    delta: LaunchPlan  # Delta = rowsum(dO * O), zeroes the dQ accumulator
    main: LaunchPlan
    convert: LaunchPlan  # dQ accumulator -> dq
    rows: int  # B * Hq * Nq: rows of Delta and of the dQ accumulator
    heads_on_x: bool  # params.heads_fastest: how main.grid maps to (kv head, key tile)
    own_dq: bool = False  # main is the kOwnDQ kernel: Delta and dQ itself, delta and convert are not launched
    delta_lanes: int = 8  # the Delta kernel's lanes per row (delta_lanes)
    convert_lanes: int = 16  # the dQ conversion's (convert_lanes)
    q_parts: int = 1  # float32: main.grid's z, blocks a key tile's query tiles are split over (plans.mma.query_parts)
    combine: LaunchPlan | None = None  # q_parts > 1: the parts' dK/dV partials summed into dk, dv

    @property
    def launches(self) -> tuple[LaunchPlan, ...]:
        """The launches in order: Delta, main, dQ conversion (own_dq: main alone), then the parts' combine."""
        out = (self.main,) if self.own_dq else (self.delta, self.main, self.convert)
        return out if self.combine is None else (*out, self.combine)


def owns_dq(key_tiles: int, total: int | None) -> bool:
    """Does one block own every query row of its kv head (cuda_src/dq_own.cuh)? When one key tile covers the
    keys of a dense call: then the main kernel computes Delta and stores dQ itself, one launch instead of three."""
    return key_tiles == 1 and total is None


#: Every kLanes the Delta kernel and the dQ conversion take (delta_lanes, convert_lanes): what CI compiles.
DELTA_LANES = (8, 16, 32)
CONVERT_LANES = (16, 32)
#: The float32 Delta kernel's (the mma family's float32 backward: D <= 128).
DELTA_LANES_F32 = (8, 16, 32)


def delta_lanes(d: int, elem: int = 2) -> int:
    """Lanes per query row of the Delta kernel (mma_bwd_delta's kLanes): a 16-byte load of dO and O each per lane,
    16 / ``elem`` elements (8 for fp16/bf16, 4 for float32), as few lanes as cover the row."""
    per = 16 // elem
    return 8 if d <= 8 * per else 16 if d <= 16 * per else 32


def convert_lanes(d: int) -> int:
    """Lanes per query row of the dQ conversion (mma_bwd_dq_convert's kLanes): four f32 of the accumulator each."""
    return 16 if d <= 64 else 32


def backward_plan_around(
    cfg: Any, main: LaunchPlan, heads_on_x: bool, batch: int, hq: int, nq: int, d: int, ctype: str,
    own_dq: bool = False,
) -> BackwardPlan:  # fmt: skip
    """A main backward kernel (this family's or the wgmma family's) with the Delta launch (``delta_lanes(d)`` lanes
    a row) and the dQ conversion (``convert_lanes(d)``) around it (``own_dq``: the main kernel does their work)."""
    rows = batch * hq * nq
    block = (AUX_THREADS, 1, 1)
    lanes, clanes = delta_lanes(d, 4 if ctype == "float" else 2), convert_lanes(d)
    return BackwardPlan(
        config=cfg,
        delta=LaunchPlan(HELPER_SOURCE, f"mma_bwd_delta<{ctype}, {lanes}>", _aux_grid(rows, lanes), block, 0),
        main=main,
        convert=LaunchPlan(HELPER_SOURCE, f"mma_bwd_dq_convert<{ctype}, {clanes}>", _aux_grid(rows, clanes), block,
                           0),
        rows=rows,
        heads_on_x=heads_on_x,
        own_dq=own_dq,
        delta_lanes=lanes,
        convert_lanes=clanes,
    )


def with_query_parts(plan: BackwardPlan, parts: int, kv_rows: int, ctype: str) -> BackwardPlan:
    """The plan with its main grid's z = ``parts`` and, past one part, the combine launch over ``kv_rows`` rows
    (B * Hk * Nk) of dK/dV, ``convert_lanes`` lanes a row (four floats each, as the dQ conversion)."""
    if parts == 1:
        return plan
    if plan.own_dq:
        raise ValueError("a backward whose main kernel owns dQ visits every query row: it takes no query parts")
    main = replace(plan.main, grid=(*plan.main.grid[:2], parts))
    lanes = plan.convert_lanes
    combine = LaunchPlan(HELPER_SOURCE, f"mma_bwd_kv_combine<{ctype}, {lanes}>", _aux_grid(kv_rows, lanes),
                         (AUX_THREADS, 1, 1), 0)  # fmt: skip
    return replace(plan, main=main, q_parts=parts, combine=combine)


def _aux_grid(rows: int, lanes: int) -> tuple[int, int, int]:
    """The grid of a per-row kernel with ``lanes`` lanes a row and AUX_THREADS threads a block."""
    return (cdiv(rows, AUX_THREADS // lanes), 1, 1)


def with_rows(plan: BackwardPlan, rows: int) -> BackwardPlan:
    """The same plan with the per-row launches (Delta, dQ conversion) and scratch sized for ``rows`` query
    rows (varlen: Hq * total_q, the packed rows, instead of B * Hq * max_seqlen_q)."""
    return replace(plan, delta=replace(plan.delta, grid=_aux_grid(rows, plan.delta_lanes)),
                   convert=replace(plan.convert, grid=_aux_grid(rows, plan.convert_lanes)), rows=rows)  # fmt: skip
