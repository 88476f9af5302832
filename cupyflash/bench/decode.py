"""Decode benchmark (issue 15, "Speed"): ``python -m cupyflash.bench.decode``.

bf16, Hq = 32 over Hk = 8, D = 128, the issue's shapes: one (or 16, speculative) query row per sequence against a
full cache. Per shape: ``attention_with_kvcache`` (contiguous cache, then paged with page size 16 and 1), the same
step replayed from a CUDA graph, the FMA kernel forced (``kernel="fma"``, decode v1) on the contiguous cache, a
device-to-device copy of the same K/V bytes measured in the same run (its bandwidth counts the bytes read and
written), and, where torch is importable, SDPA with the cuDNN and FLASH backends on the same memory. The floor is
the K/V bytes read once at the copy's bandwidth. The working sets are far larger than L2.

Two times per call, for ours and SDPA alike: ``*_ms``, CUDA events around one call into an idle GPU (the median
of 30 after warm-up), which counts the host's path to the launch as well (a decode step alone); and
``*_gpu_ms``, the GPU time of calls queued behind a spin kernel (``overhead.queued_us``, the median of 5 runs of
20 calls), which is what a step costs inside a model's forward, where the host runs ahead of the GPU.
"""
from __future__ import annotations

import argparse
import contextlib
from typing import Any, Callable

import numpy as np

HQ, HK, D = 32, 8, 128
#: (Nq, B, Nk): the issue's table.
SHAPES = ((1, 8, 32768), (1, 64, 4096), (1, 1, 131072), (1, 128, 1024), (16, 8, 32768))
WARMUP, RUNS = 5, 30
#: Queued GPU time: runs of calls behind one spin kernel, and the host time per call the spin allows for.
QUEUED_RUNS, QUEUED_CALLS, QUEUED_HOST_US = 5, 20, 1000.0


def median_ms(fn: Callable[[], Any], runs: int = RUNS, warmup: int = WARMUP) -> float:
    import cupy

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def gpu_ms(fn: Callable[[], Any], sync: Callable[[], None] | None = None, clock: Any = None) -> float:
    """GPU time of one call with the host out of the way (the median of QUEUED_RUNS runs of QUEUED_CALLS calls
    queued behind a spin kernel); CuPy's synchronise and clock unless given (SDPA: torch's)."""
    import cupy

    from . import overhead, timing

    t = overhead.Timed(fn, sync or cupy.cuda.Device().synchronize, clock or timing.CupyClock())
    try:
        runs = [overhead.queued_us(t, QUEUED_HOST_US, calls=QUEUED_CALLS) for _ in range(QUEUED_RUNS)]
    except RuntimeError as e:  # the host fell behind the spin: no GPU-only time for this cell
        print(f"  queued timing: {e}")
        return float("nan")
    return float(np.median(runs)) * 1e-3


def _paged(k: Any, v: Any, page: int, rng: np.random.Generator) -> tuple[Any, Any, Any]:
    """The same keys in shuffled pages of ``page`` slots, with their block table."""
    import cupy

    b, hk, nk, d = k.shape
    per_seq = nk // page
    order = cupy.asarray(rng.permutation(b * per_seq).astype(np.int32))
    table = order.reshape(b, per_seq)
    kp = cupy.empty((b * per_seq, hk, page, d), k.dtype)
    vp = cupy.empty_like(kp)
    for dst, src in ((kp, k), (vp, v)):  # bit copies through uint16 views: no bfloat16 arithmetic needed
        pages = src.view(cupy.uint16).reshape(b, hk, per_seq, page, d).transpose(0, 2, 1, 3, 4)
        dst.view(cupy.uint16)[order] = pages.reshape(b * per_seq, hk, page, d)
    return kp, vp, table


def _graph_ms(step: Callable[[], Any]) -> float:
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        step()  # compiled, workspace cached for this stream
        stream.synchronize()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        return median_ms(lambda: graph.launch(stream))


def _sdpa(q: Any, k: Any, v: Any) -> dict[str, float]:
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention
    except Exception:
        return {}
    from . import timing
    from .device import to_torch

    tq, tk, tv = (to_torch(x) for x in (q, k, v))
    out = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                fn = lambda: scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                out[name] = median_ms(fn)
                out[f"{name}_gpu"] = gpu_ms(fn, torch.cuda.synchronize, timing.TorchClock())
        except Exception as e:  # a backend that refuses the shape
            out[name] = out[f"{name}_gpu"] = float("nan")
            print(f"  SDPA {name}: {type(e).__name__}: {str(e)[:80]}")
    return out


def run(shapes=SHAPES, pages=(16, 1), seed: int = 0) -> list[dict[str, Any]]:
    import cupy

    import cupyflash as cf

    from .device import cupy_dtype

    rng = np.random.default_rng(seed)
    dev_rng = cupy.random.default_rng(seed)
    bf16 = cupy_dtype("bfloat16")
    rows = []
    for nq, b, nk in shapes:
        q = dev_rng.standard_normal((b, HQ, nq, D), dtype=cupy.float32).astype(bf16)
        k = dev_rng.standard_normal((b, HK, nk, D), dtype=cupy.float32).astype(bf16)
        v = dev_rng.standard_normal((b, HK, nk, D), dtype=cupy.float32).astype(bf16)
        nbytes = 2 * k.nbytes
        src = cupy.concatenate([k.reshape(-1).view(cupy.uint8), v.reshape(-1).view(cupy.uint8)])
        dst = cupy.empty_like(src)
        copy_ms = median_ms(lambda: dst.__setitem__(Ellipsis, src))
        bw = 2 * nbytes / copy_ms / 1e9  # TB/s, read + write
        floor_ms = nbytes / bw / 1e9
        row: dict[str, Any] = {"nq": nq, "b": b, "nk": nk, "copy_TBps": bw, "floor_ms": floor_ms}
        step = lambda: cf.attention_with_kvcache(q, k, v, cache_seqlens=nk)  # noqa: E731
        row["ours_ms"] = median_ms(step)
        row["ours_gpu_ms"] = gpu_ms(step)
        row["graph_ms"] = _graph_ms(step)
        # the FMA kernel (decode v1) on the same call: the tensor-core kernel's gain, measured in the same run
        row["fma_ms"] = median_ms(lambda: cf.attention_with_kvcache(q, k, v, cache_seqlens=nk, kernel="fma"))
        for page in pages:
            kp, vp, table = _paged(k, v, page, rng)
            lens = cupy.full((b,), nk, dtype=cupy.int32)
            paged = lambda: cf.attention_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)  # noqa: E731
            row[f"paged{page}_ms"] = median_ms(paged)
            row[f"paged{page}_gpu_ms"] = gpu_ms(paged)
            del kp, vp, table
        row.update({f"sdpa_{n}_ms": t for n, t in _sdpa(q, k, v).items()})
        row["of_copy_bw"] = floor_ms / row["ours_ms"]
        row["gpu_of_copy_bw"] = floor_ms / row["ours_gpu_ms"]
        rows.append(row)
        print(_line(row), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def _line(r: dict[str, Any]) -> str:
    """One shape: per call (events around one call) and, after the slash, GPU time (calls queued)."""

    def pair(name: str) -> str:
        return f"{r[name + '_ms']:.3f}/{r.get(name + '_gpu_ms', float('nan')):.3f}"

    extra = " ".join(f"{n} {pair(n)}" for n in ("paged16", "paged1", "sdpa_cudnn", "sdpa_flash") if n + "_ms" in r)
    extra += "".join(f" {n} {r[n + '_ms']:.3f}" for n in ("graph", "fma") if n + "_ms" in r)
    vs = ""
    if "sdpa_cudnn_ms" in r:
        vs = (f" | vs cuDNN {r['sdpa_cudnn_ms'] / r['ours_ms']:.2f}x per call, "
              f"{r.get('sdpa_cudnn_gpu_ms', float('nan')) / r['ours_gpu_ms']:.2f}x GPU")  # fmt: skip
    return (f"Nq={r['nq']:2d} B={r['b']:3d} Nk={r['nk']:6d}: ours {pair('ours')} ms per call/GPU ("
            f"{100 * r['of_copy_bw']:.0f}%/{100 * r['gpu_of_copy_bw']:.0f}% of copy bw {r['copy_TBps']:.2f} TB/s, "
            f"floor {r['floor_ms']:.3f}) {extra}{vs}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cupyflash.bench.decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--quick", action="store_true", help="the first shape only")
    a = ap.parse_args(argv)
    from .device import require_gpu

    require_gpu()
    rows = run(SHAPES[:1] if a.quick else SHAPES)
    if a.json:
        import json

        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
