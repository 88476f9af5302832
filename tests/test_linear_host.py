"""The host (Python) path of a CuPy linear-attention call, measured and checked without a GPU.

Launches, allocations and device queries are replaced by host stand-ins (as in
``test_launch_abi``), so what is left is cupyflash's own per-call Python: the argument checks,
the plan lookup and the argument tuples. The tests check that repeated calls reuse what depends
only on the problem's signature and that bad input still fails before anything launches.
``python tests/test_linear_host.py`` prints microseconds per call (issue 12: <= 25 us).
"""
from __future__ import annotations

import contextlib
import time
import types
from typing import Any, Iterator
from unittest import mock

import numpy as np
import pytest

from cupyflash import _dtypes

cupy = pytest.importorskip("cupy")


class HostArray:
    """A NumPy array that passes for a CuPy one (``validation.array_kind`` reads the type's module)."""

    __module__ = "cupy._host_stand_in"

    def __init__(self, a: np.ndarray) -> None:
        self._a = a
        self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
        self.ndim, self.size, self.itemsize = a.ndim, a.size, a.itemsize
        self.data = types.SimpleNamespace(ptr=a.__array_interface__["data"][0])  # CuPy: a MemoryPointer

    def fill(self, x: Any) -> None:
        self._a.fill(x)

    def __getitem__(self, i: Any) -> "HostArray":
        return HostArray(self._a[i])

    def __setitem__(self, i: Any, x: Any) -> None:
        self._a[i] = x

    def astype(self, dtype: Any, copy: bool = True) -> "HostArray":
        return HostArray(self._a.astype(dtype, copy=copy))


def _host(x: Any) -> np.ndarray:
    return x._a if isinstance(x, HostArray) else np.asarray(x)


class Launches:
    """Stands in for compiled functions: records (name, grid, number of arguments) per launch."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple, int]] = []

    def get_function(self, source: str, name: str) -> Any:
        seen = self.seen

        class Function:
            max_dynamic_shared_size_bytes = 0

            def __call__(self, grid, block, args, shared_mem=0) -> None:
                seen.append((name, grid, len(args)))

        return Function()

    def launch_plan(self, plan: Any, args: tuple) -> None:
        """Stands in for ``build.launch_plan`` (the packed positional launch the linear kernels use)."""
        self.seen.append((plan.name, plan.grid, len(args)))


@contextlib.contextmanager
def stubbed_device(limits: Any = None) -> Iterator[Launches]:
    """Host stand-ins for the GPU: launches are recorded, arrays are ``HostArray``s, H100 limits."""
    from cupyflash import plans
    from cupyflash.kernels import build, linear

    launches = Launches()
    functions: dict[tuple[str, str], Any] = {}

    def get_function(source: str, name: str) -> Any:  # cached like build's own
        fn = functions.get((source, name))
        if fn is None:
            fn = functions[(source, name)] = launches.get_function(source, name)
        return fn

    def empty(shape, dtype=np.float32):
        return HostArray(np.empty(shape, dtype))

    def zeros(shape, dtype=np.float32):
        return HostArray(np.zeros(shape, dtype))

    def as_strided(x, shape, strides):
        return HostArray(np.lib.stride_tricks.as_strided(_host(x), shape, strides))

    lim = plans.H100 if limits is None else limits
    stream = types.SimpleNamespace(synchronize=lambda: None)
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context
        patch(mock.patch.object(build, "get_function", get_function))
        patch(mock.patch.object(linear, "_launch", launches.launch_plan))
        patch(mock.patch.object(plans.DeviceLimits, "current", classmethod(lambda cls: lim)))
        patch(mock.patch.object(cupy, "empty", empty))
        patch(mock.patch.object(cupy, "zeros", zeros))
        patch(mock.patch.object(cupy, "asarray", lambda x, dtype=None: HostArray(np.asarray(_host(x), dtype))))
        patch(mock.patch.object(cupy, "ascontiguousarray",
                                lambda x, dtype=None: HostArray(np.ascontiguousarray(_host(x), dtype))))  # fmt: skip
        patch(mock.patch.object(cupy, "broadcast_to", lambda x, shape: HostArray(np.broadcast_to(_host(x), shape))))
        patch(mock.patch.object(cupy.lib.stride_tricks, "as_strided", as_strided))
        patch(mock.patch.object(cupy.cuda, "Device", lambda *a: types.SimpleNamespace(id=0)))
        patch(mock.patch.object(cupy.cuda, "get_current_stream", lambda: stream))
        yield launches


def inputs(b: int, h: int, n: int, d: int, dtype: Any) -> tuple[HostArray, HostArray, HostArray]:
    rng = np.random.default_rng(0)
    return tuple(HostArray(rng.standard_normal((b, h, n, d)).astype(dtype)) for _ in range(3))  # type: ignore


RATES = (1.0 - 2.0 ** (-5.0 - np.arange(8))).astype(np.float32)  # host decay, as a model holds it

#: (label, call) for the issue's shape: bf16 B=1, H=8, N=128, D=64, causal
CASES = {
    "causal": dict(causal=True),
    "causal + host decay": dict(causal=True, decay=RATES),
    "non-causal": dict(causal=False),
}


def us_per_call(call: Any, calls: int = 2000, rounds: int = 3) -> float:
    """Microseconds per call: the best of ``rounds`` loops of ``calls`` (the least disturbed one)."""
    call()  # the first call fills the caches
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, time.perf_counter() - t0)
    return best / calls * 1e6


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("label", list(CASES))
def test_repeated_calls_launch_the_same_work(label):
    import cupyflash as cf

    q, k, v = inputs(1, 8, 128, 64, _dtypes.BFLOAT16)
    with stubbed_device() as launches:
        cf.linear_attention_forward(q, k, v, **CASES[label])
        first = list(launches.seen)
        cf.linear_attention_forward(q, k, v, **CASES[label])
    assert first and launches.seen == first + first


def test_cached_signature_still_checks_bad_input():
    """A signature seen before takes the fast path only after every check has passed again."""
    import cupyflash as cf

    q, k, v = inputs(1, 8, 128, 64, _dtypes.BFLOAT16)
    with stubbed_device() as launches:
        cf.linear_attention_forward(q, k, v, causal=True, decay=RATES)
        n = len(launches.seen)
        bad = RATES.copy()
        bad[3] = 1.5
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            cf.linear_attention_forward(q, k, v, causal=True, decay=bad)
        with pytest.raises(ValueError, match="decay needs causal"):
            cf.linear_attention_forward(q, k, v, causal=False, decay=RATES)
        with pytest.raises(TypeError, match="dtype"):
            cf.linear_attention_forward(q, k, HostArray(_host(v).astype(np.float16)), causal=True)
        with pytest.raises(ValueError, match="shape"):
            cf.linear_attention_forward(q, k, v, causal=True, decay=RATES[:4])
        assert len(launches.seen) == n


def test_new_decay_values_reach_the_device():
    """The device copy of host rates is keyed by their values, not by the array object."""
    import cupyflash as cf
    from cupyflash.kernels import linear

    q, k, v = inputs(1, 8, 128, 64, _dtypes.BFLOAT16)
    with stubbed_device():
        rates = RATES.copy()
        cf.linear_attention_forward(q, k, v, causal=True, decay=rates)
        a = _host(linear._device_decay(rates, 0))
        rates[0] = 0.5  # mutated in place, as a model's parameter may be
        b = _host(linear._device_decay(rates, 0))
    assert a[0] == RATES[0] and b[0] == np.float32(0.5)


def main() -> None:
    import cupyflash as cf

    q, k, v = inputs(1, 8, 128, 64, _dtypes.BFLOAT16)
    with stubbed_device():
        for label, kw in CASES.items():
            us = us_per_call(lambda: cf.linear_attention_forward(q, k, v, **kw))
            print(f"linear_attention_forward bf16 B=1 H=8 N=128 D=64 {label}: {us:.1f} us/call (launches stubbed)")


if __name__ == "__main__":
    main()
