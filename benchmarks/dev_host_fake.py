"""The cached host path of a small call (issue 12) timed off the GPU: CuPy's device calls are faked, everything
else is the real code. No GPU, no compiler. Any machine with CuPy installed:
    python benchmarks/dev_host_fake.py [--rounds 21] [--calls 5000]

What is real: the API, the checks and plans of a first call (on an H100's ``DeviceLimits``), the signature
keys, the pointer packing, and ``cupy.ndarray`` itself (inputs and outputs are CuPy arrays over a fake
address range, ``cupy.cuda.memory.UnownedMemory``, so ``type(x)``, ``x.data.ptr`` and the outputs' views cost
what they cost on the GPU machine). What is faked (``FakeDevice``): ``cupy.cuda.alloc``, ``cupy.empty`` and
``cupy.zeros`` (a bump allocator over that range, never written), ``cupy.cuda.runtime.getDevice``, ``cupy.cuda.Device``,
``cupy.cuda.get_current_stream``, ``cupy.cuda.driver.launchKernel`` (counts launches), ``DeviceLimits.current``,
libcuda's TMA map encoder (``tensor_map.driver_functions``) and the kernel's function handle
(``build._function_ptr``), so nothing is compiled. Their own costs are
printed too (the "fake ..." rows), to subtract; on the GPU machine the real ones cost more (a launch ~5.9 us,
``cupy.cuda.alloc`` ~1 us) and its CPU runs Python ~3-4x slower than a workstation.

Each row is the median and the least over ``--rounds`` rounds of the mean of ``--calls`` back-to-back calls, in
us per call.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

#: The fake device range: inputs first, then the bump allocator's pool.
BASE = 0x7F00_0000_0000
SIZE = 1 << 30


class _Stream:
    ptr = 0


class _Device:
    """``cupy.cuda.Device()`` as the host path reads it (its id; synchronize does nothing)."""

    def __init__(self, device: int | None = None) -> None:
        self.id = 0 if device is None else device

    def synchronize(self) -> None:
        pass


def _no_driver_call(*args: Any) -> int:
    """libcuda's cuTensorMapEncodeTiled / cuTensorMapReplaceAddress (the TMA maps' bytes): CUDA_SUCCESS, nothing
    written (no kernel reads them here)."""
    return 0


class FakeDevice:
    """Patches CuPy's device calls (see the module docstring); ``install()`` / ``restore()``, or a ``with`` block.
    ``launches`` counts the driver launches, ``device`` is what ``getDevice`` answers (tests change it)."""

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.memory = cupy.cuda.memory.UnownedMemory(BASE, SIZE, None, device_id=0)
        self.launches = 0
        self.device = 0
        self._next = SIZE // 2  # inputs below, allocations above
        self._saved: list[tuple[Any, str, Any]] = []

    # ---- the fakes

    def alloc(self, nbytes: int) -> Any:
        """A 256-byte aligned slice of the fake range (wraps around: nothing is ever read or written)."""
        at = self._next
        self._next = at + -(-max(nbytes, 1) // 256) * 256
        if self._next > SIZE:
            at, self._next = SIZE // 2, SIZE // 2 + -(-max(nbytes, 1) // 256) * 256
        return self.cupy.cuda.MemoryPointer(self.memory, at)

    def empty(self, shape: Any, dtype: Any = float, order: str = "C") -> Any:
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return self.cupy.ndarray(shape, dt, memptr=self.alloc(math.prod(shape) * dt.itemsize), order=order)

    def array(self, shape: tuple[int, ...], dtype: Any, offset: int = 0, strides: tuple[int, ...] | None = None) -> Any:
        """An input array at a fixed place of the fake range (``offset`` bytes in: 0 is 256-byte aligned)."""
        return self.cupy.ndarray(shape, np.dtype(dtype), memptr=self.cupy.cuda.MemoryPointer(self.memory, offset),
                                 strides=strides)  # fmt: skip

    def launch(self, *args: Any) -> None:
        self.launches += 1

    # ---- patching

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, owner.__dict__.get(name, getattr(owner, name))))
        setattr(owner, name, value)

    def install(self) -> "FakeDevice":
        cupy = self.cupy
        from cupyflash import plans
        from cupyflash.kernels import build, linear

        stream = _Stream()
        self._set(cupy.cuda, "alloc", self.alloc)
        self._set(cupy, "empty", self.empty)
        self._set(cupy, "zeros", self.empty)  # the KV-cache's split-KV counters: nothing here reads them
        self._set(cupy.cuda.runtime, "getDevice", lambda: self.device)
        self._set(cupy.cuda, "Device", _Device)
        self._set(cupy.cuda, "get_current_stream", lambda: stream)
        self._set(cupy.cuda.driver, "launchKernel", self.launch)
        self._set(plans.DeviceLimits, "current", classmethod(lambda cls: plans.H100))
        self._set(build, "_function_ptr", lambda plan: 1)
        from cupyflash.kernels import tensor_map

        if tensor_map.driver_functions.__module__ == tensor_map.__name__:  # (a test may have put a recorder there)
            self._set(tensor_map, "driver_functions", lambda: (_no_driver_call, _no_driver_call))  # TMA maps
        dummies = dict(linear._dummies)
        self._saved.append((linear, "_dummies", linear._dummies))
        linear._dummies = {**dummies, **{d: self.empty((1,), np.float32) for d in range(4)}}
        return self

    def restore(self) -> None:
        """Undo the patches and forget every cached launch made under them (their function handles are fake):
        the dense, varlen and KV-cache signature caches, the linear kernels' launches."""
        from cupyflash import cuda_backend, kvcache, varlen_cuda
        from cupyflash.kernels import build, linear

        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)
        for cache in (cuda_backend._forward_cache, cuda_backend._backward_cache, varlen_cuda._forward_cache,
                      varlen_cuda._backward_cache, kvcache._prepared, kvcache._workspace, build._args_launches,
                      getattr(linear, "_plain_forwards", {})):  # fmt: skip
            cache.clear()

    def __enter__(self) -> "FakeDevice":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def per_call_us(f: Callable[[], Any], calls: int, rounds: int) -> tuple[float, float]:
    """(median, least) over ``rounds`` of the mean time of ``calls`` back-to-back calls, in us. This host's
    per-round means spread by up to 2x (a shared virtual machine): the least is the steadier figure to compare."""
    for _ in range(min(calls, 1000)):
        f()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(times), min(times)


def rows(dev: FakeDevice, calls: int, rounds: int) -> dict[str, tuple[float, float]]:
    import cupyflash
    from cupyflash import cuda_backend as cb
    from cupyflash.kernels import family
    from cupyflash.kernels import linear as lin
    from cupyflash.linear_validation import check_linear

    cupy = dev.cupy
    bf16 = np.dtype("bfloat16")
    shape, nbytes = (1, 8, 128, 64), 8 * 128 * 64 * 2
    q, k, v, o, do = (dev.array(shape, bf16, i * nbytes) for i in range(5))
    lse = dev.array(shape[:-1], np.float32, 5 * nbytes)
    timed: dict[str, Callable[[], Any]] = {}

    cupyflash.attention_forward(q, k, v)  # first calls: checks, plans (the fakes' H100), caches
    cupyflash.attention_backward(do, q, k, v, o, lse)
    cupyflash.linear_attention_forward(q, k, v, causal=True)
    fprep = next(iter(cb._forward_cache.values()))
    bprep = next(iter(cb._backward_cache.values()))
    short = hasattr(cb, "plain_forward")  # the plain calls' short paths (issue 12, branch host17)
    dev_id = cupy.cuda.runtime.getDevice

    timed["api forward"] = lambda: cupyflash.attention_forward(q, k, v)
    if short:
        timed["  plain_forward"] = lambda: cb.plain_forward(q, k, v, False, None)
    timed["  cuda_backend.forward (full)"] = lambda: cb.forward(q, k, v, False, None, "auto")
    if short:
        timed["  forward signature"] = lambda: cb._forward_signature(q, k, v, q.data.ptr, k.data.ptr, v.data.ptr,
                                                                     False, None, dev_id())  # fmt: skip
        timed["  forward rest of the key (full)"] = lambda: cb._forward_rest(
            "auto", None, 0.0, None, None, None, None, 0.0, None, None, None, None, None)
    else:
        timed["  forward key"] = lambda: (
            "auto", cb._key_of(False), cb._key_of(None), cb._key_of(None), cb._key_of(0.0), cb._key_of(None),
            cb._key_of(None), cb._key_of(None), cb._key_of(None), cb._key_of(0.0), dev_id(),
            cb._array_key(q), cb._array_key(k), cb._array_key(v), *cb._flex_key(None, None, None, None, None))
    timed["  forward _empty_outputs"] = lambda: cb._empty_outputs(fprep.outputs)
    fptrs = {"q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "o": o.data.ptr, "lse": lse.data.ptr}
    timed["  forward family.run"] = lambda: family.run(fprep.plan, fprep.geometry, fptrs)
    if short:
        fvalues = tuple(fptrs.values())
        timed["  forward prepared runner"] = lambda: fprep.run(fvalues)

    timed["api backward"] = lambda: cupyflash.attention_backward(do, q, k, v, o, lse)
    if short:
        timed["  plain_backward"] = lambda: cb.plain_backward(do, q, k, v, o, lse, False, None)
    timed["  cuda_backend.backward (full)"] = lambda: cb.backward(do, q, k, v, o, lse, False, None, "auto")
    if short:
        timed["  backward signature"] = lambda: cb._backward_signature(
            q, k, v, o, lse, do, (q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, lse.data.ptr, do.data.ptr), False,
            None, dev_id())  # fmt: skip
    else:
        timed["  backward key"] = lambda: (
            "auto", cb._key_of(False), cb._key_of(None), cb._key_of(None), cb._key_of(0.0), cb._key_of(None),
            cb._key_of(None), cb._key_of(None), cb._key_of(None), cb._key_of(False), cb._key_of(0.0),
            dev_id(), *(cb._array_key(x) for x in (do, q, k, v, o, lse)), False,
            *cb._flex_key(None, None, None, None, None))
    timed["  backward _empty_outputs"] = lambda: cb._empty_outputs(bprep.outputs)
    bptrs = {"dout": do.data.ptr, "q": q.data.ptr, "k": k.data.ptr, "v": v.data.ptr, "o": o.data.ptr,
             "lse": lse.data.ptr, "dq": q.data.ptr, "dk": k.data.ptr, "dv": v.data.ptr}  # fmt: skip
    timed["  backward family.run"] = lambda: family.run(bprep.plan, bprep.geometry, bptrs)
    if short:
        bvalues = tuple(bptrs[n] for n in bprep.run.names)
        timed["  backward prepared runner"] = lambda: bprep.run(bvalues)

    timed["linear forward (causal)"] = lambda: cupyflash.linear_attention_forward(q, k, v, causal=True)
    if hasattr(lin, "plain_forward"):
        timed["  linear plain_forward"] = lambda: lin.plain_forward(q, k, v, True, 1.0)
    timed["  check_linear"] = lambda: check_linear(q, k, v, causal=True, mask=None, decay=None, scale=1.0)
    lp = check_linear(q, k, v, causal=True, mask=None, decay=None, scale=1.0)
    timed["  kernels.linear.forward (full)"] = lambda: lin.forward(q, k, v, None, None, lp)

    # A decode step (issue 15, the overhead suite's decode row): B=1, Hq=32, Hk=8, a 4096-key cache, D=128.
    qd = dev.array((1, 32, 1, 128), bf16, 1 << 22)
    kc, vc = dev.array((1, 8, 4096, 128), bf16, 1 << 23), dev.array((1, 8, 4096, 128), bf16, 1 << 24)
    kn, vn = dev.array((1, 8, 1, 128), bf16, 1 << 25), dev.array((1, 8, 1, 128), bf16, (1 << 25) + 4096)
    lens = dev.array((1,), np.int32, 1 << 26)
    timed["decode (kvcache)"] = lambda: cupyflash.attention_with_kvcache(qd, kc, vc, cache_seqlens=lens)
    timed["decode, append k/v, causal"] = lambda: cupyflash.attention_with_kvcache(qd, kc, vc, kn, vn,
                                                                                   cache_seqlens=lens, causal=True)
    timed["decode, int cache_seqlens"] = lambda: cupyflash.attention_with_kvcache(qd, kc, vc, cache_seqlens=100)

    timed["fake alloc"] = lambda: cupy.cuda.alloc(1024)
    timed["fake launchKernel"] = lambda: cupy.cuda.driver.launchKernel(1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0)
    timed["fake get_current_stream().ptr"] = lambda: cupy.cuda.get_current_stream().ptr
    timed["cupy.ndarray(memptr=...)"] = lambda: cupy.ndarray(shape, bf16, memptr=dev.alloc(1))
    timed["cupy.ndarray(shape, dtype, memptr)"] = lambda: cupy.ndarray(shape, bf16, dev.alloc(1))
    timed["x.data.ptr"] = lambda: q.data.ptr

    out = {}
    for name, f in timed.items():
        dev.launches = 0
        f()
        launches = dev.launches
        out[name] = med, least = per_call_us(f, calls, rounds)
        print(f"{name:36s} {med:7.2f} {least:7.2f}" + (f"   ({launches} launch{'es' * (launches != 1)})"
                                                       if launches else ""), flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=5000)
    a = ap.parse_args()
    print(f"us per call, median and least of {a.rounds} rounds of {a.calls} calls; bf16 B=1 H=8 N=128 D=64; Python "
          f"{sys.version.split()[0]}")
    print(f"{'':36s} {'median':>7s} {'least':>7s}")
    with FakeDevice() as dev:
        rows(dev, a.calls, a.rounds)


if __name__ == "__main__":
    main()
