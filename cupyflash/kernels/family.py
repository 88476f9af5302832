"""What every attention kernel family provides, and what they share.

A family (``portable``, ``mma``, ``wgmma``) is a module with:

- ``NAME`` and ``NEEDS_ALIGNED_ROWS`` (16-byte aligned rows for vector loads / cp.async),
- ``supports(problem, limits) -> str | None``: ``None`` if it can run the problem, else the reason,
- ``forward_plan(problem, geometry, limits) -> CallPlan`` and ``backward_plan(...)``: pure functions of
  the call's signature (no GPU work), so the API caches them per signature,
- ``instantiations() -> list[(source, name expression)]``: everything it may launch with the built-in
  policies (CI compiles each); a tensor-core backward kernel may also launch in its ``kOwnDQ`` form (one
  more template flag, one key tile per kv head: ``cuda_src/dq_own.cuh``), which CI compiles for
  representatives (``tests/test_compile.py``), as it does the mask, dropout and snippet policies.

A ``CallPlan`` is the launches of one pass with their ``AttentionParams`` bytes minus the array
pointers, plus the scratch buffers to allocate; ``run`` fills in the pointers and launches. Nothing in
a plan depends on array contents or addresses, only on shapes, strides, dtypes and the variant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import operator
import sys
import threading
from typing import Any, Callable, Protocol, Sequence

from ..plans import DeviceLimits, LaunchPlan
from ..validation import AttentionProblem
from . import build
from .build import cupy_module
from .params import POINTERS, Params, PointerPacker, with_tensor_maps, write_batch0, write_dropout

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
    #: Score-shaped arrays (mask, bias, dbias; issue 17): the element stride of their last (key) axis, which
    #: may be anything (0 where the array broadcasts along the keys).
    inner: dict[str, int] = field(default_factory=dict)
    #: dbias has an element of its own for every (b, h, q, k) of the problem (no broadcast dim): the kernels store
    #: dS into it in the bias's dtype instead of adding into a float32 accumulator.
    dbias_direct: bool = False

#: Arrays shaped like the scores, (*batch, Hq, Nq, Nk) by broadcasting: their params get (b, h, q, k) strides.
SCORE_ARRAYS = ("mask", "bias", "dbias")


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

    def ready(self) -> tuple[build.Launch, ...]:
        """The launches as ``build.Launch`` objects, made once per plan (plans are cached per call
        signature and device, so their argument buffers are reused call after call)."""
        made = self.__dict__.get("_ready")
        if made is None:
            made = tuple(build.Launch(lp, base) for lp, base in self.launches)
            object.__setattr__(self, "_ready", made)
        return made

    def runner(self, g: Geometry, names: tuple[str, ...]) -> "Runner":
        """The plan's ``Runner`` for the geometry ``g`` and these pointer names, made once per set of names (and
        remade if another geometry's sub-batches come with them)."""
        made = self.__dict__.get("_runners")
        if made is None:
            made = {}
            object.__setattr__(self, "_runners", made)
        r = made.get(names)
        if r is None or r.batch != g.batch or (r.offsets is not g.offsets and r.offsets != g.offsets):
            r = made[names] = Runner(self, g, names)
        return r

    @property
    def scratch_layout(self) -> tuple[int, tuple[tuple[str, int, int, bool], ...]]:
        """All scratch buffers in one allocation: (total bytes, (field, byte offset, bytes, zeroed) each),
        each buffer 256-byte aligned."""
        made = self.__dict__.get("_scratch_layout")
        if made is None:
            at, parts = 0, []
            for s in self.scratch:
                nbytes = 4 * max(1, s.size)
                parts.append((s.field, at, nbytes, s.zeroed))
                at += -(-nbytes // 256) * 256
            made = (at, tuple(parts))
            object.__setattr__(self, "_scratch_layout", made)
        return made


class Family(Protocol):  # pragma: no cover - a description of the module interface
    NAME: str
    NEEDS_ALIGNED_ROWS: bool

    def supports(self, p: AttentionProblem, limits: DeviceLimits) -> str | None: ...
    def forward_plan(self, p: AttentionProblem, g: Geometry, limits: DeviceLimits) -> CallPlan: ...
    def backward_plan(self, p: AttentionProblem, g: Geometry, limits: DeviceLimits) -> CallPlan: ...
    def instantiations(self) -> list[tuple[str, str]]: ...


def base_params(p: AttentionProblem, g: Geometry, heads_fastest: bool, **extra: Any) -> Params:
    """The fields every kernel of a call shares: sizes, strides, scales, grid order, the variant's scalars."""
    fields = {f"{name}_s": s for name, s in g.strides.items() if name != "alibi" and name not in SCORE_ARRAYS}
    for name in SCORE_ARRAYS:
        if name in g.strides:
            fields[f"{name}_s"] = (*g.strides[name], g.inner[name])
    if "dbias" in g.strides:
        fields["dbias_direct"] = int(g.dbias_direct)
        fields["batch_inner"] = int(batch_inner(p, g))
    if "alibi" in g.strides:
        fields["alibi_sb"] = g.strides["alibi"][0]
    fields.update(p.variant.params(p.scale, p.nq, p.nk))
    if p.varlen:  # packed sequences: the per-row kernels and scratch cover the (Hq, total_q) rows
        fields.update(total_q=p.total_q, total_k=p.total_k)
    return Params().set(
        **fields,
        rows=scratch_rows(p, g),
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


def batch_inner(p: AttentionProblem, g: Geometry) -> bool:
    """Does the backward's grid run one kv head's batches side by side (params.batch_inner)? When dbias is a
    float32 accumulator that every batch adds into (the bias broadcasts over a dense batch): the B adds into an
    element then meet in L2, instead of each batch sweeping the whole accumulator through DRAM."""
    return not g.dbias_direct and g.strides["dbias"][0] == 0 and g.batch > 1 and not p.varlen


def scratch_rows(p: AttentionProblem, g: Geometry) -> int:
    """Rows of the backward's dense float32 scratch (Delta, lse2, dQ accumulator): one per query row of
    every head, B * Hq * Nq dense, Hq * total_q varlen (no padding to max_seqlen_q)."""
    return p.hq * p.total_q if p.varlen else g.batch * p.hq * p.nq


def call_plan(launches: Sequence[LaunchPlan], params: Params, scratch: Sequence[Scratch] = ()) -> CallPlan:
    """Every launch of a pass with the same params (kernels read the fields they need); a launch with TMA maps
    takes them as TmaParams, the maps zeroed until a call writes them."""
    base = params.to_bytes()
    return CallPlan(tuple((lp, with_tensor_maps(base) if lp.tensor_maps else base) for lp in launches),
                    tuple(scratch))  # fmt: skip


# Launches of one plan share argument buffers: one thread writes and queues them at a time.
_launching = threading.Lock()


def allocate(nbytes: int) -> Any:
    """Device memory for a call's scratch (a CuPy ``MemoryPointer``: from the pool, no array object)."""
    return cupy_module().cuda.alloc(nbytes)


class Runner:
    """``run`` for one plan, one geometry's sub-batch offsets and one fixed set of pointer names, made once: per
    call it takes the pointers as a tuple in ``names``' order, and each launch's pointer block is one
    ``PointerPacker.pack_into`` (the scratch fields' pointers are the runner's to fill in). ``CallPlan.runner``
    makes them; cached signatures keep theirs (``cuda_backend._Prepared.run``)."""

    __slots__ = ("names", "launches", "offsets", "batch", "_pack", "_take", "_shifts", "_scratch_total",
                 "_scratch_at", "_zeroed", "_maps")  # fmt: skip

    def __init__(self, plan: CallPlan, g: Geometry, names: tuple[str, ...]) -> None:
        total, parts = plan.scratch_layout
        parts = tuple(sorted(parts, key=lambda part: POINTERS.index(part[0])))  # in struct order: often no reordering
        given = (*names, *(f for f, _, _, _ in parts))
        if len(set(given)) != len(given):
            raise ValueError(f"pointer names given twice (or a scratch field's name): {given}")
        packer = PointerPacker(given)
        self.names, self.launches, self.offsets, self.batch = names, plan.ready(), g.offsets, g.batch
        self._pack = packer.pack_into
        where = {n: i for i, n in enumerate(given)}
        self._take = tuple(where[n] for n in packer.names)  # struct order from the given order
        if self._take == tuple(range(len(given))):
            self._take = None  # given in struct order already
        self._scratch_total = total if parts else 0
        self._scratch_at = tuple(at for _, at, _, _ in parts)
        self._zeroed = tuple((at, nbytes) for _, at, nbytes, zeroed in parts if zeroed)
        # Byte offsets of each sub-batch, per packed value (None: one sub-batch at offset 0, the common case).
        offsets = g.offsets
        single = len(offsets) == 1 and not any(offsets[0].values())
        self._shifts = None if single else tuple(tuple(off.get(n, 0) for n in packer.names) for off in offsets)
        # Per launch, the getter of its TMA maps' addresses from the packed values (None: a launch without maps).
        self._maps = tuple(None if launch.maps is None else _map_getter(launch, packer.names)
                           for launch in self.launches)  # fmt: skip
        if not any(self._maps):
            self._maps = None

    def __call__(self, pointers: tuple[int, ...], dropout_seed: int | None = None, scratch: int | None = None) -> None:
        """Launch the plan with these pointers (``names``' order): with dropout, the seed and each sub-batch's first
        batch index (the mask is keyed by the global batch index). ``scratch``: the address of the plan's
        ``scratch_layout`` bytes of device memory, allocated until the launches are queued at least, or None to take
        them from the pool here."""
        memory = None
        if self._scratch_at:
            if scratch is None:
                memory = allocate(self._scratch_total)  # alive until every launch is queued (the pool orders reuse)
                scratch = memory.ptr
            pointers = (*pointers, *[scratch + at for at in self._scratch_at])
        values = pointers if self._take is None else tuple([pointers[i] for i in self._take])
        stream = cupy_module().cuda.get_current_stream().ptr
        pack, launches = self._pack, self.launches
        with _launching:
            if self._shifts is None and not self._zeroed and dropout_seed is None:  # the common call
                if self._maps is None:
                    for launch in launches:
                        pack(launch.buffer, 0, *values)
                        launch.fire(stream)
                    return
                for launch, at in zip(launches, self._maps):
                    pack(launch.buffer, 0, *values)
                    if at is not None:  # TMA maps of the arrays
                        launch.maps(at(values))
                    launch.fire(stream)
                return
            maps = self._maps or (None,) * len(launches)
            for i, shifts in enumerate(self._shifts or ((0,) * len(values),)):
                for at, nbytes in self._zeroed:  # every sub-batch accumulates from zero
                    cupy_module().cuda.runtime.memsetAsync(scratch + at, 0, nbytes, stream)
                shifted = values if self._shifts is None else [v + d for v, d in zip(values, shifts)]
                for launch, at in zip(launches, maps):
                    pack(launch.buffer, 0, *shifted)
                    if at is not None:  # TMA maps of this sub-batch's arrays
                        launch.maps(at(shifted))
                    if dropout_seed is not None:
                        write_dropout(launch.buffer, dropout_seed, i * self.batch)
                    elif len(self.offsets) > 1:  # user snippets see the global batch index too
                        write_batch0(launch.buffer, i * self.batch)
                    launch.fire(stream)
        del memory


def _map_getter(launch: build.Launch, names: tuple[str, ...]) -> Callable[[Sequence[int]], tuple[int, ...]]:
    """The addresses of ``launch``'s TMA maps, as a tuple, from a runner's packed pointer values (``names``' order)."""
    missing = [s.pointer for s in launch.maps.specs if s.pointer not in names]
    if missing:
        raise ValueError(f"{launch.plan.name} maps {missing} by TMA, which the call does not pass")
    at = [names.index(s.pointer) for s in launch.maps.specs]
    return operator.itemgetter(*at) if len(at) > 1 else lambda values: (values[at[0]],)


def run(plan: CallPlan, g: Geometry, pointers: dict[str, int], dropout_seed: int | None = None) -> None:
    """Allocate the plan's scratch, then launch it once per sub-batch with the arrays' pointers (and, with
    dropout, the seed and the sub-batch's first batch index: the mask is keyed by the global batch index)."""
    plan.runner(g, tuple(pointers))(tuple(pointers.values()), dropout_seed)


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
