"""The tensor-core decode kernel's ring depth and residency (issue 15): run dev_decode_gpu.py's shapes with the
plan's (stages, blocks per SM) replaced, one configuration per process. GPU machine:
    python benchmarks/dev_decode_ring.py STAGES [PAD_KB]   # PAD_KB: shared memory asked per block (limits residency)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    from cupyflash.kernels import decode

    stages = int(sys.argv[1])
    pad = int(sys.argv[2]) * 1024 if len(sys.argv) > 2 else 0
    decode.MMA_STAGES = (stages,)
    smem = decode.mma_smem_bytes
    decode.mma_smem_bytes = lambda kd, rw, s: max(smem(kd, rw, s), pad)
    import dev_decode_gpu

    dev_decode_gpu.main(f"stages={stages} pad={pad // 1024}KB")


if __name__ == "__main__":
    main()
