"""Where a split decode call's time goes (issue 15): the tensor-core decode kernel rebuilt with per-block timestamps
(%globaltimer, comparable across SMs, and clock64) at its phase boundaries, then the phases of one call queued
behind nine others, with SDPA cuDNN's and our queued GPU time for the same shapes. The stamps are patched into a
copy of the source text here; the library's kernels carry none. GPU machine:
    python benchmarks/dev_decode_stamps.py [B:S[:splits] ...]      (default 1:4096 1:16384 1:131072 8:32768)

Stamps (thread 0 of each block): 0 entry, 1 tile 0 landed, 2 loop done, 6 the key slices in shared memory, 3
partials stored, 4 exit, 5 the merging block past its arrival count.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

STAMP_DEF = r"""
__device__ unsigned long long cf_stamps[4096 * 16];
__device__ __forceinline__ void cf_stamp(int i) {
  if (threadIdx.x != 0) return;
  unsigned long long g;
  unsigned sm;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  const unsigned blk = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  if (blk < 4096) {
    cf_stamps[blk * 16 + i] = g;
    cf_stamps[blk * 16 + 8 + i] = clock64();
    cf_stamps[blk * 16 + 7] = sm;
  }
}
"""


def patched_source() -> str:
    from cupyflash.kernels import build

    def sub(text: str, old: str, new: str) -> str:
        assert text.count(old) == 1, f"anchor not found once: {old!r}"
        return text.replace(old, new)

    head = build._read_file("decode_mma.cuh")
    head = sub(head, "  const int rw = warp / kKeyWarps, kw = warp % kKeyWarps;\n",
               "  const int rw = warp / kKeyWarps, kw = warp % kKeyWarps;\n  cf_stamp(0);\n")
    head = sub(head, "slot t - 1 is free again\n", "slot t - 1 is free again\n    if (t == 0) cf_stamp(1);\n")
    head = sub(head, "it becomes the combine buffer\n", "it becomes the combine buffer\n  cf_stamp(2);\n")
    head = sub(head, "  __syncthreads();\n\n  // Combine the key slices of each row",
               "  __syncthreads();\n  cf_stamp(6);\n\n  // Combine the key slices of each row")
    merge = next(line for line in head.splitlines(keepends=True) if "if (gridDim.z > 1) merge_if_last<" in line)
    head = sub(head, merge, "  cf_stamp(3);\n" + merge + "  cf_stamp(4);\n")
    body = build._read_file("decode.cu")
    body = sub(body, "namespace cupyflash {\n", STAMP_DEF + "namespace cupyflash {\n")  # global: unmangled
    body = sub(body, "  if (!__syncthreads_or(last)) return;\n", "  if (!__syncthreads_or(last)) return;\n  cf_stamp(5);\n")
    return sub(body, '#include "decode_mma.cuh"\n', head.replace("#pragma once\n", "") + "\n")


def cudnn_gpu_us(q, k, v) -> float | None:
    """SDPA cuDNN's GPU time (``bench.decode.gpu_ms``, us) on the same memory as the CuPy q, k, v; None without
    torch. dev_decode_stages.py uses it too."""
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention
    except ImportError:
        return None
    from cupyflash.bench import timing
    from cupyflash.bench.decode import gpu_ms
    from cupyflash.bench.device import to_torch

    tq, tk, tv = (to_torch(x) for x in (q, k, v))

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    with torch.no_grad():
        return gpu_ms(sdpa, torch.cuda.synchronize, timing.TorchClock()) * 1e3


def main(shapes: list[tuple[int, int, int]]) -> None:
    import cupy

    import cupyflash
    from cupyflash.bench.decode import gpu_ms
    from cupyflash.kernels import build

    text = patched_source()
    modules: dict[str, object] = {}
    original = build.get_function

    def get_function(source: str, name: str):
        if source == "decode.cu" and "decode_split_mma" in name:
            module = cupy.RawModule(code=text, options=build.source_options(source), name_expressions=[name])
            modules.setdefault(name, module)
            return modules[name].get_function(name)
        return original(source, name)

    build.get_function = get_function
    bf16 = cupy.dtype("bfloat16")
    rng = cupy.random.default_rng(0)
    for b, s, splits in shapes:
        q = rng.standard_normal((b, 32, 1, 128), dtype=np.float32).astype(bf16)
        kc, vc = (rng.standard_normal((b, 8, s, 128), dtype=np.float32).astype(bf16) for _ in range(2))
        lens = cupy.full((b,), s, dtype=cupy.int32)

        def step():
            return cupyflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)

        step()
        cupy.cuda.Device().synchronize()
        module = next(iter(modules.values()))
        stamps = cupy.ndarray((4096, 16), cupy.uint64, module.get_global("cf_stamps"))
        for _ in range(9):
            step()
        stamps.fill(0)  # queued between the ninth call and the tenth: only the tenth call's stamps remain
        step()
        cupy.cuda.Device().synchronize()
        st = stamps.get().astype(np.int64)
        used = st[:, 0] > 0
        st = st[used]
        g = st[:, :7] - st[:, 0].min()  # ns from the first block's entry
        merged = st[:, 5] > 0
        us = lambda x: f"{np.median(x) / 1e3:6.2f} [{np.min(x) / 1e3:6.2f}, {np.max(x) / 1e3:6.2f}]"
        ours = gpu_ms(step) * 1e3
        line = f"B={b} S={s} splits={splits or 'auto'} blocks={used.sum()} SMs={len(set(st[:, 7]))}: ours {ours:.1f} us"
        cudnn = cudnn_gpu_us(q, kc, vc)
        if cudnn is not None:
            line += f", cuDNN {cudnn:.1f} us"
        print(line)
        print(f"  kernel span (first entry -> last exit) {g[:, 4].max() / 1e3:.2f} us; entries {us(g[:, 0])}")
        print(f"  prologue (entry -> tile 0 landed)     {us(g[:, 1] - g[:, 0])}")
        print(f"  loop (tile 0 -> loop done)            {us(g[:, 2] - g[:, 1])}; loop done at {us(g[:, 2])}")
        print(f"  slices to shared memory + barrier     {us(g[:, 6] - g[:, 2])}")
        print(f"  combine loop + partial stores         {us(g[:, 3] - g[:, 6])}")
        print(f"  combine + partials                    {us(g[:, 3] - g[:, 2])}")
        print(f"  arrival (partials -> exit, others)    {us((g[:, 4] - g[:, 3])[~merged])}")
        if merged.any():
            print(f"  arrival (merging blocks)              {us((g[:, 5] - g[:, 3])[merged])}")
            print(f"  merge                                 {us((g[:, 4] - g[:, 5])[merged])}")
        print(f"  tail (last loop done -> last exit)    {(g[:, 4].max() - g[:, 2].max()) / 1e3:.2f} us; "
              f"first loop done {g[:, 2].min() / 1e3:.2f}")
        loops = (st[:, 10] - st[:, 9]) / 1.98e3  # clock64 cycles -> us at ~1.98 GHz (clock-free H200)
        print(f"  loop by clock64 (cycles / 1.98 GHz)   {us(loops * 1e3)}")
        del q, kc, vc


if __name__ == "__main__":
    args = sys.argv[1:] or ["1:4096", "1:16384", "1:131072", "8:32768"]
    parsed = []
    for a in args:
        parts = [int(x) for x in a.split(":")]
        parsed.append((parts[0], parts[1], parts[2] if len(parts) > 2 else 0))
    main(parsed)
