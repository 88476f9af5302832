"""GPU time of a decode call against the depth of its K/V ring (issue 15): the Nq = 1 tensor-core layout (one
16-row strip) with its ring forced to each depth that fits, against SDPA cuDNN in the same run. Calls queued behind
a spin kernel (``bench.decode.gpu_ms``), alternating rounds. bf16, Hq 32 / Hk 8, D 128. GPU machine:
    python benchmarks/dev_decode_stages.py [ROUNDS] [B:S ...]     (default 2 rounds, 1:131072 1:16384 8:32768)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

DEPTHS = (0, 3, 4, 5, 6)  # 0: the plan's own choice


def main(rounds: int, shapes: list[tuple[int, int]]) -> None:
    import cupy

    import cupyflash
    from cupyflash import kvcache
    from cupyflash.bench.decode import gpu_ms
    from cupyflash.kernels import decode
    from dev_decode_stamps import cudnn_gpu_us

    original = decode._mma_tile

    def forced(depth: int):
        def tile(kd, m_rows, limits):
            got = original(kd, m_rows, limits)
            if depth and got is not None and m_rows <= 16:
                if decode.mma_smem_bytes(kd, 1, depth) > limits.max_shared_per_block:
                    return got
                return (1, depth)
            return got
        return tile

    bf16 = cupy.dtype("bfloat16")
    rng = cupy.random.default_rng(0)
    for b, s in shapes:
        q = rng.standard_normal((b, 32, 1, 128), dtype=np.float32).astype(bf16)
        kc, vc = (rng.standard_normal((b, 8, s, 128), dtype=np.float32).astype(bf16) for _ in range(2))
        lens = cupy.full((b,), s, dtype=cupy.int32)
        ref = None
        for r in range(rounds):
            cells = []
            for depth in DEPTHS:
                decode._mma_tile = forced(depth)
                kvcache._prepared.clear()
                step = lambda: cupyflash.attention_with_kvcache(q, kc, vc, cache_seqlens=lens)
                o, lse = step()
                if ref is None:
                    ref = (o.copy(), lse.copy())
                same = bool((o == ref[0]).all() and (lse == ref[1]).all())
                pl = next(iter(kvcache._prepared.values())).plan
                cells.append(f"{depth or 'plan'}({pl.stages}st x{pl.splits}){'' if same else '!DIFF'}: "
                             f"{gpu_ms(step) * 1e3:.1f}")
            decode._mma_tile = original
            kvcache._prepared.clear()
            line = f"B={b} S={s} round {r}: " + "  ".join(cells)
            cudnn = cudnn_gpu_us(q, kc, vc)
            if cudnn is not None:
                line += f"  cuDNN: {cudnn:.1f}"
            print(line, flush=True)
        del q, kc, vc


if __name__ == "__main__":
    args = sys.argv[1:]
    rounds = int(args.pop(0)) if args and ":" not in args[0] else 2
    shapes = [tuple(int(x) for x in a.split(":")) for a in args] or [(1, 131072), (1, 16384), (8, 32768)]
    main(rounds, shapes)
