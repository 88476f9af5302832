"""Launch geometry as data: pure functions of the problem shape and the device limits.

Each kernel family has a module here (``portable``, ``mma``, ``linear``) that turns an
``AttentionProblem`` and ``DeviceLimits`` into ``LaunchPlan`` objects; nothing in them touches
a GPU, so they are unit-tested on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grid_heads(batch: int, heads: int, total: int | None = None) -> int:
    """The head axis of a grid over tiles: B*H dense; H varlen (``total`` given: the sequences ride on the
    tile axis, see grid_axes)."""
    return heads if total is not None else batch * heads


def dq_head_group(heads: int, sm_count: int, longest_first: bool, heads_first: bool) -> int:
    """Heads per group of the deterministic backward's key-major grid order (``dq_grid_coord`` in
    cuda_src/dq_turns.cuh). Its ordered dQ turns make the t-th of a head's key tiles that start their walks
    at the same query tile together wait t steps: every key tile without a causal-like mask. About an SM count
    / 4 heads at a time keeps a few key tiles per head in flight, started a step apart as earlier blocks
    finish (a simulation in tests/test_deterministic.py: 0.71-0.89 of the steps busy with tiles fastest, 0.98-1.0
    with this). Under a triangle (``longest_first``) no key tile waits in the model, but measured on an H100
    (``benchmarks/dev_det_order.py``, B=1 H=16 N=16k causal, deterministic / default backward) every head at
    once lost most: wgmma 0.68x (D=128) / 0.77x (D=64) against 0.86-0.88x / 0.85-0.87x with 1 to 4 heads, mma
    0.86-0.88x against 0.90-0.93x; two heads per group was within 0.02 of the best in all four."""
    if longest_first:
        return min(heads, 2)
    return max(1, min(heads, sm_count // 4))


def grid_axes(batch: int, heads: int, n: int, tile: int, total: int | None = None) -> tuple[int, int]:
    """(head axis, tile axis) of a grid over tiles of ``tile`` rows. Dense: B*H heads x ceil(n / tile) tiles.
    Varlen (``total`` packed rows of B sequences): H heads x (total // tile + B) "virtual tiles", which the
    kernels map back to (sequence, tile) (``varlen_tile_coord`` in cuda_src/attention_params.cuh): no block
    for the tiles a short sequence lacks."""
    tiles = cdiv(n, tile) if total is None else total // tile + batch
    return grid_heads(batch, heads, total), tiles


@dataclass(frozen=True)
class DeviceLimits:
    """The few device properties that launch geometry depends on."""

    compute_capability: int  # 80 for sm_80, 90 for sm_90
    sm_count: int
    max_shared_per_block: int  # opt-in maximum of dynamic + static shared bytes per block

    @classmethod
    def current(cls) -> "DeviceLimits":
        import cupy

        dev = cupy.cuda.Device()
        return _current(dev.id)


def blocks_by_smem(nbytes: int, limits: DeviceLimits) -> int:
    """Blocks of ``nbytes`` dynamic shared memory an SM holds: the per-block opt-in maximum plus 1 KB, and 1 KB
    reserved per block (sm_80+: 228 / 227 KB on an H100, 164 / 163 on an A100, 100 / 99 on sm_86/89)."""
    return (limits.max_shared_per_block + 1024) // (nbytes + 1024)


def _query(device_id: int) -> DeviceLimits:
    import cupy

    dev = cupy.cuda.Device(device_id)
    attrs = dev.attributes
    return DeviceLimits(
        compute_capability=int(dev.compute_capability),
        sm_count=attrs["MultiProcessorCount"],
        max_shared_per_block=attrs["MaxSharedMemoryPerBlockOptin"],
    )


_cache: dict[int, DeviceLimits] = {}


def _current(device_id: int) -> DeviceLimits:
    if device_id not in _cache:
        _cache[device_id] = _query(device_id)
    return _cache[device_id]


#: Limits of common GPUs, for tests and for planning without a device.
A100 = DeviceLimits(compute_capability=80, sm_count=108, max_shared_per_block=163 * 1024)
RTX4090 = DeviceLimits(compute_capability=89, sm_count=128, max_shared_per_block=99 * 1024)
H100 = DeviceLimits(compute_capability=90, sm_count=132, max_shared_per_block=227 * 1024)
T4 = DeviceLimits(compute_capability=75, sm_count=40, max_shared_per_block=64 * 1024)


@dataclass(frozen=True)
class LaunchPlan:
    """One kernel launch: which instantiation, and how big."""

    source: str  # file in cuda_src/
    name: str  # C++ name expression, e.g. "flash_fwd<float, 64, 64, 64>"
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int  # dynamic shared memory
    max_carveout: bool = False  # ask for the largest shared-memory carveout (tensor-core tiles)
    #: TMA maps the kernel reads (kernels.tensor_map.TensorMapSpec, in params.TMA_MAPS order): it then takes TmaParams,
    #: whose maps each call writes with the arrays' addresses (build.Launch)
    tensor_maps: tuple = ()

    def __post_init__(self) -> None:
        if min(self.grid) < 1 or self.grid[1] > 65535 or self.grid[2] > 65535:
            raise ValueError(f"grid {self.grid} out of range for {self.name}")
        if self.block[0] * self.block[1] * self.block[2] > 1024:
            raise ValueError(f"block {self.block} has more than 1024 threads ({self.name})")
