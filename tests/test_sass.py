"""Checks of the compiled SASS that CI can make without a GPU: NVRTC compiles as a run-time call does, nvdisasm
(the test extra's ``nvidia-cuda-nvdisasm`` wheel, or ``$NVDISASM``, or one on PATH) reads the cubin.

The decode kernel's K/V copies carry an L2 evict-first policy (``cp_async_16_once``), which a memory instruction
reads from a uniform register pair, ``desc[URn]``. ptxas (NVRTC 13.0 and 13.5) once put it in an odd register
(``desc[UR7]``: the pair's low half reused for the copies' uniform shared base), and the GPU rejected the kernel
with an illegal instruction (benchmarks/NOTES.md, s26). Every instantiation CI compiles, and the ones the issue's
shapes run, must keep every descriptor in an even register.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile

import pytest

from test_compile import NVRTC_REASON


def _nvdisasm() -> str | None:
    if os.environ.get("NVDISASM"):
        return os.environ["NVDISASM"]
    if shutil.which("nvdisasm"):
        return shutil.which("nvdisasm")
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(glob.glob(os.path.join(root, "*", "bin", "nvdisasm")))
        if found:
            return found[-1]
    return None


NVDISASM = _nvdisasm()
pytestmark = [
    pytest.mark.skipif(NVRTC_REASON is not None, reason=str(NVRTC_REASON)),
    pytest.mark.skipif(NVDISASM is None, reason="nvdisasm not found (pip install nvidia-cuda-nvdisasm)"),
]


def decode_tensor_core_kernels() -> list[str]:
    """The tensor-core decode kernel's instantiations CI compiles, and the bf16/fp16 ones of issue 15's shapes."""
    from cupyflash.kernels import decode
    from cupyflash.variants import Variant

    names = [n for _, n in decode.instantiations() if "decode_split_mma<" in n]
    plain = Variant().cpp_policy
    return names + [f"cupyflash::decode_split_mma<{t}, 128, 1, 3, {plain}>" for t in ("__nv_bfloat16", "__half")]


def descriptor_registers(blob: bytes) -> dict[str, set[int]]:
    """The uniform registers ``desc[URn]`` of every function's memory instructions, by the function's section."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(blob + b"\0")  # CuPy's getCUBIN drops the image's last (zero) byte
        f.flush()
        text = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True, check=True).stdout
    out: dict[str, set[int]] = {}
    function = "?"
    for line in text.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\S+?),", line)
        if m:
            function = m.group(1)
        for n in re.findall(r"desc\[UR(\d+)\]", line):
            out.setdefault(function, set()).add(int(n))
    return out


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_decode_cache_policies_sit_in_even_registers(arch):
    from cupyflash.kernels import build, decode

    names = decode_tensor_core_kernels()
    found = descriptor_registers(build.nvrtc_cubin(decode.SOURCE, names, arch))
    assert len([f for f in found if "decode_split_mma" in f]) == len(set(names))  # every kernel read, not vacuous
    odd = {f: sorted(n for n in regs if n % 2) for f, regs in found.items() if any(n % 2 for n in regs)}
    assert not odd, f"{arch}: memory descriptors in odd uniform registers (an illegal instruction on a GPU): {odd}"
