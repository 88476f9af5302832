"""What every benchmarked implementation shares: the random input sets of a shape, the
``Prepared`` call an implementation hands to the timer, and ``Unavailable`` for cases it does
not run. The implementations themselves are in ``softmax_impls`` and ``linear_impls``."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Sequence

from .cli import Options
from .device import cupy_dtype
from .shapes import Shape


class Unavailable(Exception):
    """An implementation does not run this case (shown as n/a, with the reason)."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message, for a table note."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:limit] if lines else ""


@dataclass
class InputSet:
    """Random normal q, k, v, dO of one shape (CuPy), plus what implementations derive from
    them outside the timed region (cupyflash's o and lse, keyed by kernel)."""

    q: Any
    k: Any
    v: Any
    do: Any
    derived: dict[str, Any] = field(default_factory=dict)


def random_inputs(shape: Shape, rng: Any) -> InputSet:
    import cupy

    dt = cupy_dtype(shape.dtype)
    dims = (shape.b, shape.h, shape.n, shape.d)

    def normal() -> Any:
        return rng.standard_normal(dims, dtype=cupy.float32).astype(dt)

    return InputSet(normal(), normal(), normal(), normal())


@dataclass
class Prepared:
    """A timed call ``call(i)`` on input set i, the clock of the library that launches it,
    and a context held around the whole measurement (e.g. the SDPA backend choice)."""

    call: Callable[[int], Any]
    clock: str  # "cupy" or "torch"
    context: Callable[[], ContextManager[Any]] = contextlib.nullcontext


Impl = Callable[[Shape, str, Sequence[InputSet], Options], Prepared]


def require_cupy_matmul(dtype_name: str) -> None:
    """Naive implementations run CuPy matmuls, which have no bfloat16 (seen with CuPy 14.2)."""
    if dtype_name in ("bfloat16", "bf16"):
        raise Unavailable("CuPy's matmul has no bfloat16; compare the float16 rows")
