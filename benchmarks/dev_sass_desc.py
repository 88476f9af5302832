"""The L2 cache-policy descriptors of the decode kernel's copies, from SASS (s26): ptxas (NVRTC 13.0 and 13.5) once
read a `.L2::cache_hint` policy from an odd uniform register (`desc[UR7]`), an illegal instruction on the GPU.
Compiles every tensor-core decode instantiation CI compiles (plus the bf16/fp16 D = 128 plain ones) for sm_90 and
sm_80 with this environment's NVRTC and prints the descriptor registers of its memory instructions; ODD marks a
kernel to fix before it runs. No GPU needed; nvdisasm from the ``nvidia-cuda-nvdisasm`` wheel:
    NVDISASM=.../nvidia/cu13/bin/nvdisasm python benchmarks/dev_sass_desc.py
"""
from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    from cupy.cuda import nvrtc

    from cupyflash.kernels import decode
    from cupyflash.kernels.build import compile_options, read_source
    from dev_sass_lines import disassemble

    plain = "cupyflash::Policy<cupyflash::NoMask, cupyflash::PlainScore, cupyflash::NoDropout>"
    names = [n for _, n in decode.instantiations() if "decode_split_mma" in n]
    names += [f"cupyflash::decode_split_mma<{t}, 128, 1, 3, {plain}>" for t in ("__nv_bfloat16", "__half")]
    print("nvrtc", nvrtc.getVersion())
    bad = 0
    for name in names:
        for arch in ("sm_90", "sm_80"):
            prog = nvrtc.createProgram(read_source(decode.SOURCE), "k.cu", [], [])
            try:
                nvrtc.addNameExpression(prog, name)
                nvrtc.compileProgram(prog, [*compile_options(), f"-arch={arch}"])
                code = disassemble(nvrtc.getCUBIN(prog))
            finally:
                nvrtc.destroyProgram(prog)
            descs = collections.Counter(m for c in code for m in re.findall(r"desc\[(UR\d+)\]", c[2]))
            odd = any(int(k[2:]) % 2 for k in descs)
            bad += odd
            print(arch, name, dict(descs), "ODD" if odd else "")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
