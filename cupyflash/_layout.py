"""Seeing (..., H, N, D) arrays as 4-D (B, H, N, D) views without copies.

Kernels take element strides, so any strided view works as long as the last dim is
contiguous. Leading batch dims are merged into one when their strides allow it; when they
don't, the launcher loops over the outer indices (a rare layout, still without copies).
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence


def _mergeable(shape: Sequence[int], strides: Sequence[int]) -> bool:
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    return all(s_outer == s_inner * n_inner for (_, s_outer), (n_inner, s_inner) in zip(dims, dims[1:]))


def unit_last_stride(x: Any) -> Any:
    """``x`` itself when its last dim is contiguous, else a contiguous copy (the one copy we make)."""
    if x.shape[-1] > 1 and x.strides[-1] != x.itemsize:
        import cupy

        return cupy.ascontiguousarray(x)
    return x


def rows_aligned(*arrays: Any) -> bool:
    """Every row of every (B, H, N, D) view (or (B, H, N) array) starts on a 16-byte boundary:
    an aligned base and (b, h, n) strides that are multiples of 16 bytes (a size-1 axis's stride
    never matters). This is what 16-byte vector loads and cp.async need."""
    for x in arrays:
        if x.data.ptr % 16:
            return False
        if any(n > 1 and s % 16 for n, s in zip(x.shape[:3], x.strides[:3])):
            return False
    return True


def as_4d(x: Any, nbatch: int) -> Any | None:
    """A (B, H, N, D) view of x with shape (*batch, H, N, D), or None if the batch dims can't merge."""
    from cupy.lib.stride_tricks import as_strided

    batch, tail = x.shape[:nbatch], x.shape[nbatch:]
    bstrides = x.strides[:nbatch]
    if not _mergeable(batch, bstrides):
        return None
    b = 1
    for n in batch:
        b *= n
    inner = [s for n, s in zip(batch, bstrides) if n != 1]
    sb = inner[-1] if inner else x.itemsize * max(1, x.size)
    # A trailing 3-D (H, N, D) array gets its batch axis prepended.
    return as_strided(x, (b, *tail), (sb, *x.strides[nbatch:]))


def batch_views(arrays: Sequence[Any], batch: tuple[int, ...]) -> Iterator[tuple[Any, ...]]:
    """Yield tuples of 4-D views that together cover every batch index of every array."""
    views = [as_4d(x, len(batch)) for x in arrays]
    if all(v is not None for v in views):
        yield tuple(views)
        return
    # Peel the outermost batch dim and try again on each slice.
    for i in range(batch[0]):
        yield from batch_views([x[i] for x in arrays], batch[1:])


# ---------------------------------------------------------------------------------------
# The same views as pure data (shapes and strides only): what the cached launch plans use.


def _merged(shape: Sequence[int], strides: Sequence[int], itemsize: int, nbatch: int, tail: int):
    """(B, element strides of the (b, *tail axes)) of one array's view, or None if its batch dims
    don't merge. ``tail``: how many trailing axes keep their own strides (H, N for (..., H, N, D))."""
    batch, bstrides = shape[:nbatch], strides[:nbatch]
    if not _mergeable(batch, bstrides):
        return None
    b = 1
    for n in batch:
        b *= n
    inner = [s for n, s in zip(batch, bstrides) if n != 1]
    sb = inner[-1] if inner else 0
    rest = strides[nbatch : nbatch + tail]
    return b, (sb // itemsize, *(s // itemsize for s in rest))


def views_of(arrays: dict[str, tuple[tuple[int, ...], tuple[int, ...], int]], nbatch: int):
    """For named arrays given as (shape, strides in bytes, itemsize), all with the same ``nbatch``
    leading batch dims: (B, element strides of each array's (b, h, n) axes, byte offsets of each
    sub-batch). Arrays of rank nbatch + 3 are (..., H, N, D); of rank nbatch + 2, (..., H, N)."""
    merged = {name: _merged(sh, st, it, nbatch, 2) for name, (sh, st, it) in arrays.items()}
    if all(m is not None for m in merged.values()):
        b = next(iter(merged.values()))[0] if merged else 1
        return b, {name: m[1] for name, m in merged.items()}, ({name: 0 for name in arrays},)
    # Peel the outermost batch dim: one sub-call per index, with the arrays' byte offsets.
    n0 = next(iter(arrays.values()))[0][0]
    sub = {name: (sh[1:], st[1:], it) for name, (sh, st, it) in arrays.items()}
    b, strides, offsets = views_of(sub, nbatch - 1)
    out = tuple({name: i * arrays[name][1][0] + off[name] for name in arrays} for i in range(n0) for off in offsets)
    return b, strides, out
