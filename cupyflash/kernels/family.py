"""What every attention kernel family provides, and what they share.

A family (``portable``, ``mma``, ``wgmma``) is a module with:

- ``NAME`` and ``NEEDS_ALIGNED_ROWS`` (16-byte aligned rows for vector loads / cp.async),
- ``supports(problem, limits) -> str | None``: ``None`` if it can run the problem, else the reason,
- ``forward_plan(problem, geometry, limits) -> CallPlan`` and ``backward_plan(...)``: pure functions of
  the call's signature (no GPU work), so the API caches them per signature,
- ``instantiations() -> list[(source, name expression)]``: everything it may launch (CI compiles each).

A ``CallPlan`` is the launches of one pass with their ``AttentionParams`` bytes minus the array
pointers, plus the scratch buffers to allocate; ``run`` fills in the pointers and launches. Nothing in
a plan depends on array contents or addresses, only on shapes, strides, dtypes and the variant.
"""
from __future__ import annotations

from dataclasses import dataclass
import sys
from typing import Any, Callable, Protocol, Sequence

from ..plans import DeviceLimits, LaunchPlan
from ..validation import AttentionProblem
from . import build
from .params import Params, write_dropout

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Geometry:
    """The (B, H, N, D) views a call's arrays are seen through, from shapes and strides alone.

    ``strides[name]`` are element strides of the b, h, n axes (lse: of its three axes). When the
    leading batch dims cannot merge into one axis, the call runs once per ``offsets`` entry: byte
    offsets of each array's sub-batch from its base pointer (else ``offsets`` is one row of zeros).
    """

    batch: int
    strides: dict[str, tuple[int, int, int]]
    offsets: tuple[dict[str, int], ...]
    aligned: bool  # every row of every array starts on a 16-byte boundary


@dataclass(frozen=True)
class Scratch:
    """A float32 buffer a pass needs for itself (a params pointer field)."""

    field: str
    size: int
    zeroed: bool = False


@dataclass(frozen=True)
class CallPlan:
    """The launches of one pass, in order, each with its AttentionParams bytes (pointers still 0)."""

    launches: tuple[tuple[LaunchPlan, bytes], ...]
    scratch: tuple[Scratch, ...] = ()


class Family(Protocol):  # pragma: no cover - a description of the module interface
    NAME: str
    NEEDS_ALIGNED_ROWS: bool

    def supports(self, p: AttentionProblem, limits: DeviceLimits) -> str | None: ...
    def forward_plan(self, p: AttentionProblem, g: Geometry, limits: DeviceLimits) -> CallPlan: ...
    def backward_plan(self, p: AttentionProblem, g: Geometry, limits: DeviceLimits) -> CallPlan: ...
    def instantiations(self) -> list[tuple[str, str]]: ...


def base_params(p: AttentionProblem, g: Geometry, heads_fastest: bool, **extra: Any) -> Params:
    """The fields every kernel of a call shares: sizes, strides, scales, grid order, the variant's scalars."""
    fields = {f"{name}_s": s for name, s in g.strides.items() if name != "alibi"}
    if "alibi" in g.strides:
        fields["alibi_sb"] = g.strides["alibi"][0]
    fields.update(p.variant.params(p.scale, p.nq, p.nk))
    return Params().set(
        **fields,
        rows=g.batch * p.hq * p.nq,
        batch=g.batch,
        hq=p.hq,
        hk=p.hk,
        group=p.group,
        nq=p.nq,
        nk=p.nk,
        d=p.d,
        scale=p.scale,
        scale_log2=p.scale * LOG2E,
        heads_fastest=int(heads_fastest),
        **extra,
    )


def call_plan(launches: Sequence[LaunchPlan], params: Params, scratch: Sequence[Scratch] = ()) -> CallPlan:
    """Every launch of a pass with the same params (kernels read the fields they need)."""
    base = params.to_bytes()
    return CallPlan(tuple((lp, base) for lp in launches), tuple(scratch))


def run(plan: CallPlan, g: Geometry, pointers: dict[str, int], dropout_seed: int | None = None) -> None:
    """Allocate the plan's scratch, then launch it once per sub-batch with the arrays' pointers (and, with
    dropout, the seed and the sub-batch's first batch index: the mask is keyed by the global batch index)."""
    ptrs = dict(pointers)
    scratch, zeroed = [], []
    if plan.scratch:
        import cupy
        import numpy as np

        for s in plan.scratch:
            buf = (cupy.zeros if s.zeroed else cupy.empty)((max(1, s.size),), dtype=np.float32)
            scratch.append(buf)  # alive until every launch is queued (the pool then orders reuse on the stream)
            ptrs[s.field] = buf.data.ptr
            if s.zeroed:
                zeroed.append(buf)
    for i, offsets in enumerate(g.offsets):
        if i:
            for buf in zeroed:  # each sub-batch accumulates from zero
                buf.fill(0)
        shifted = {name: ptr + offsets.get(name, 0) for name, ptr in ptrs.items()}
        for lp, base in plan.launches:
            buf = Params.with_pointers(base, **shifted)
            if dropout_seed is not None:
                write_dropout(buf, dropout_seed, i * g.batch)
            build.launch_params(lp, buf)


def entry_points(module_name: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """A family module's ``forward(q, k, v, o, lse, p, **options)`` and ``backward(do, ..., dq, dk, dv, p,
    **options)`` with given outputs: how tests reach each family explicitly and benchmarks pass a tile
    configuration (the API goes through cuda_backend's cache instead)."""

    def forward(q: Any, k: Any, v: Any, o: Any, lse: Any, p: AttentionProblem, **options: Any) -> None:
        from ..cuda_backend import forward_into

        forward_into(sys.modules[module_name], q, k, v, o, lse, p, **options)

    def backward(do: Any, q: Any, k: Any, v: Any, o: Any, lse: Any, dq: Any, dk: Any, dv: Any,
                 p: AttentionProblem, **options: Any) -> None:  # fmt: skip
        from ..cuda_backend import backward_into

        backward_into(sys.modules[module_name], do, q, k, v, o, lse, dq, dk, dv, p, **options)

    return forward, backward
