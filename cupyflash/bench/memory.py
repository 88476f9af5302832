"""The long suite's memory check: what cupyflash holds across one forward + backward, against
the O(N) bound and what naive N x N scores would need."""
from __future__ import annotations

from typing import Any

from .device import free_device_memory
from .impls import random_inputs
from .report import Record
from .shapes import MEMORY_FACTOR, Shape, fmt_bytes, linear_memory_bound, naive_scores_bytes


def measure_memory(shape: Shape, kernel: str, rng: Any) -> tuple[int, int]:
    """Bytes cupyflash holds across one forward + backward at ``shape``, inputs included:
    CuPy's pool after the calls (its high-water mark, since freed blocks stay pooled) and the
    drop in the driver's free memory."""
    import cupy

    import cupyflash as cf

    free_device_memory()
    pool = cupy.get_default_memory_pool()
    free0, _ = cupy.cuda.runtime.memGetInfo()
    s = random_inputs(shape, rng)
    o, lse = cf.attention_forward(s.q, s.k, s.v, shape.causal, kernel=kernel)
    grads = cf.attention_backward(s.do, s.q, s.k, s.v, o, lse, shape.causal, kernel=kernel)
    cupy.cuda.Device().synchronize()
    held = int(pool.total_bytes())
    free1, _ = cupy.cuda.runtime.memGetInfo()
    del s, o, lse, grads
    free_device_memory()
    return held, int(free0 - free1)


def memory_record(shape: Shape, impl: str, kernel: str, rng: Any, env: dict[str, Any]) -> Record:
    base = dict(workload="softmax", b=shape.b, h=shape.h, n=shape.n, d=shape.d, causal=shape.causal,
                dtype=shape.dtype, pass_="fwd+bwd", impl=impl, kind="memory", env=env)
    try:
        held, driver = measure_memory(shape, kernel, rng)
    except Exception as e:
        return Record(status="error", note=f"{type(e).__name__}: {e}", **base)  # type: ignore[arg-type]
    bound = linear_memory_bound(shape)
    ok = held <= bound
    note = (
        f"peak {fmt_bytes(held)} (CuPy pool; driver sees {fmt_bytes(driver)}), "
        f"{held / shape.tensor_bytes:.1f}x the size of q; O(N) bound {MEMORY_FACTOR}x = {fmt_bytes(bound)}: "
        f"{'ok' if ok else 'EXCEEDED'}; naive N x N scores would need {fmt_bytes(naive_scores_bytes(shape))}"
    )
    return Record(status="ok" if ok else "error", peak_bytes=held, note=note, **base)  # type: ignore[arg-type]
