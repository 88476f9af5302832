"""SASS of chosen kernel instantiations and their opcode counts (GPU machine: needs the CUDA toolkit's ptxas and
cuobjdump), to see what a policy adds to a kernel's instruction stream, e.g. dropout's draws in the wgmma forward:

    python benchmarks/dev_sass.py sass OUTDIR "wgmma_forward.cu:wgmma_flash_fwd<__nv_bfloat16, 64, 64, 2, 4, 2, \
cupyflash::Policy<cupyflash::NoMask, cupyflash::PlainScore>>" ...
    python benchmarks/dev_sass.py call fwd|bwd D DROPOUT_P   # one bf16 call (B=1, H=16, N=8192) for ncu

Without a GPU machine (s15): ``python benchmarks/dev_sass.py local OUTDIR SPEC...`` takes NVRTC's own cubin and
the ``nvdisasm`` of the ``nvidia-cuda-nvdisasm`` wheel of the same CUDA version (pip install it beside CuPy; it is a
tool, not a dependency), so the SASS is exactly what the library runs.

Each name is compiled alone: NVRTC to PTX, the toolkit's ptxas to a cubin (NVRTC's own cubins come from a newer
ptxas than the toolkit's cuobjdump reads, so the PTX's .version is lowered to the toolkit's; the SASS can differ
from NVRTC's in detail, not in kind), cuobjdump to OUTDIR/<i>.sass; the opcode histogram (mnemonic without
modifiers) is printed beside the others'. Used in the 2026-11-25 session (benchmarks/NOTES.md) with
``ncu --clock-control none --section ComputeWorkloadAnalysis --section WarpStateStats --section InstructionStats``
on the ``call`` mode.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _nvrtc(source: str, name: str, arch_option: str, fetch: str):
    """One name compiled alone by NVRTC with the library's options; fetch: "getPTX" or "getCUBIN"."""
    from cupy.cuda import nvrtc

    from cupyflash.kernels.build import compile_options, read_source

    prog = nvrtc.createProgram(read_source(source), source, [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, [*compile_options(), arch_option, "-ftz=true"])
        return getattr(nvrtc, fetch)(prog)
    finally:
        nvrtc.destroyProgram(prog)


def cubin(source: str, name: str, path: str, arch: str = "sm_90a") -> None:
    ptx = _nvrtc(source, name, f"-arch=compute_{arch[3:]}", "getPTX")
    ptx = (ptx.decode() if isinstance(ptx, bytes) else ptx).rstrip("\x00")
    release = re.search(r"release (\d+)\.(\d+)", subprocess.run(["ptxas", "--version"], capture_output=True,
                                                                 text=True).stdout)  # fmt: skip
    if release and int(release.group(1)) >= 13:  # CUDA 13.y takes PTX ISA 9.y
        isa = f"{int(release.group(1)) - 4}.{release.group(2)}"
        ptx = re.sub(r"^\.version .*$", f".version {isa}", ptx, count=1, flags=re.M)
    with open(path + ".ptx", "w") as f:
        f.write(ptx)
    subprocess.run(["ptxas", f"-arch={arch}", path + ".ptx", "-o", path], check=True)


def cubin_nvrtc(source: str, name: str, path: str, arch: str = "sm_90a") -> None:
    """NVRTC's own cubin of one name (getCUBIN drops the image's last byte, a zero: put it back)."""
    with open(path, "wb") as f:
        f.write(_nvrtc(source, name, f"-arch={arch}", "getCUBIN") + b"\x00" * 8)


def nvdisasm() -> str:
    import glob
    import shutil

    import nvidia

    found = shutil.which("nvdisasm") or next(iter(glob.glob(f"{nvidia.__path__[0]}/cu*/bin/nvdisasm")), None)
    if not found:
        raise SystemExit("no nvdisasm: pip install nvidia-cuda-nvdisasm (the CUDA version of NVRTC)")
    return found


def opcodes(sass: str) -> collections.Counter:
    count: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            count[m.group(2)] += 1
    return count


def sass_main(outdir: str, specs: list[str], local: bool = False) -> None:
    os.makedirs(outdir, exist_ok=True)
    counts = []
    for i, spec in enumerate(specs):
        source, name = spec.split(":", 1)
        path = os.path.join(outdir, f"{i}.cubin")
        (cubin_nvrtc if local else cubin)(source, name, path)
        tool = [nvdisasm(), "-c"] if local else ["cuobjdump", "-sass"]
        run = subprocess.run([*tool, path], capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"{' '.join(tool)} {path}: {run.stderr}")
        text = run.stdout
        with open(os.path.join(outdir, f"{i}.sass"), "w") as f:
            f.write(f"// {name}\n{text}")
        counts.append(opcodes(text))
        print(f"[{i}] {name}: {sum(counts[-1].values())} instructions")
    keys = sorted(set().union(*counts), key=lambda k: -max(c[k] for c in counts))
    print("opcode".ljust(12) + "".join(f"[{i}]".rjust(8) for i in range(len(counts))))
    for k in keys:
        print(k.ljust(12) + "".join(str(c[k]).rjust(8) for c in counts))


def call_main(pass_: str, d: int, p: float) -> None:
    import cupy

    import cupyflash as cf

    rng = cupy.random.default_rng(0)
    bf16 = cupy.dtype("bfloat16")
    q, k, v = (rng.standard_normal((1, 16, 8192, d), dtype=cupy.float32).astype(bf16) for _ in range(3))
    kw = dict(dropout_p=p, dropout_seed=7) if p > 0 else {}
    for _ in range(2):
        o, lse = cf.attention_forward(q, k, v, **kw)
        if pass_ == "bwd":
            cf.attention_backward(o, q, k, v, o, lse, **kw)
    cupy.cuda.Device().synchronize()


if __name__ == "__main__":
    if sys.argv[1] in ("sass", "local"):
        sass_main(sys.argv[2], sys.argv[3:], local=sys.argv[1] == "local")
    else:
        call_main(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
