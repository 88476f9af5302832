"""dev_sass.py's ``local`` mode with source lines: NVRTC (with -lineinfo) to its own cubin, nvdisasm with inline
line info (-gi), then the instructions counted per innermost source line inside the kernel's largest loop (its main
loop's step). Two cases side by side show what a policy adds to a step (s22: the --suite flex snippets' wgmma
backward against dense causal; their forwards with --kernel fwd / ws), and the registers and spills of each.
nvdisasm from the ``nvidia-cuda-nvdisasm`` wheel (pip download --no-deps, unzip; no GPU needed):
    NVDISASM=.../nvidia/cu13/bin/nvdisasm python benchmarks/dev_sass_lines.py --kernel bwd --d 64 \
        --case causal prefix-lm [--top 25] [--dump DIR]
Static counts: a cold branch counts as much as the hot path (ncu's source page gives executed counts).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

PREFIX_MASK = "kv_idx < prefix || kv_idx <= q_idx"
DOC_MASK = "doc(b, q_idx) == doc(b, kv_idx)"


def instantiation(kernel: str, d: int, case: str, bits: bool = False) -> tuple[str, str]:
    """(source, kernel name) of the wgmma kernel for a case: dense causal, or a --suite flex mask with its block
    mask (FlexMask, the plain score; ``bits``: FlexMask<..., true>, which reads the block mask's bits)."""
    from cupyflash import flex
    from cupyflash.kernels.build import generated_source
    from cupyflash.plans import wgmma as plans
    from cupyflash.variants import Variant

    config = {"bwd": plans.BACKWARD_CONFIGS, "fwd": plans.FORWARD_CONFIGS, "ws": plans.WS_FORWARD_CONFIGS}[kernel][d]
    source = plans.BACKWARD_SOURCE if kernel == "bwd" else config.source
    if case == "causal":
        return source, config.name("__nv_bfloat16", Variant(causal=True).cpp_policy)
    if case == "doc8":
        spec = flex.FlexSpec(mask_mod=DOC_MASK, aux=(flex.AuxSlot("doc", "int", 2),))
    else:
        spec = flex.FlexSpec(mask_mod=PREFIX_MASK, aux=(flex.AuxSlot("prefix", "int", 0),))
    variant = Variant(causal=case == "doc8", flex=spec, block_mask=(("bm_size", 64),), block_bits=bits)
    source = generated_source(source, spec.key, flex.source_of(spec, source))
    return source, config.name("__nv_bfloat16", variant.cpp_policy)


def cubin(source: str, name: str, arch: str = "sm_90a") -> tuple[bytes, str]:
    from cupy.cuda import nvrtc

    from cupyflash.kernels.build import compile_options, read_source

    prog = nvrtc.createProgram(read_source(source), "k.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, name)
        nvrtc.compileProgram(prog, [*compile_options(), f"-arch={arch}", "-ftz=true", "-lineinfo", "-Xptxas=-v"])
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


def disassemble(blob: bytes) -> list[tuple[int, str, str, str]]:
    """(offset, opcode, operands, innermost 'file:line') of every instruction."""
    nvdisasm = os.environ.get("NVDISASM", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(blob + b"\0")  # CuPy's getCUBIN drops the image's last (zero) byte
        f.flush()
        text = subprocess.run([nvdisasm, "-c", "-gi", f.name], capture_output=True, text=True, check=True).stdout
    out, where, fresh, labels, pending = [], "?", True, {}, []
    for line in text.splitlines():
        m = _LINE.search(line)
        if m:  # -gi prints the inline chain innermost first: keep the first line of each chain
            if fresh:
                where = f"{os.path.basename(m.group(1))}:{m.group(2)}"
            fresh = False
            continue
        m = re.match(r"^(\.L_x_\d+):", line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR.search(line)
        if m:
            fresh = True
            off = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = off
            pending = []
            args = re.sub(r"`\((\.L_x_\d+)\)", lambda t: f"{labels.get(t.group(1), -1):#x}" if t.group(1) in labels
                          else t.group(1), m.group(4).strip())
            out.append((off, m.group(3), args, where))
    # forward branch targets were not known yet: resolve them now
    return [(o, op, re.sub(r"(\.L_x_\d+)", lambda t: f"{labels.get(t.group(1), -1):#x}", args), w)
            for o, op, args, w in out]


def largest_loop(code: list[tuple[int, str, str, str]]) -> tuple[int, int]:
    """[first, last] offsets of the widest backward branch's span (the kernel's main loop)."""
    best = (0, -1)
    for off, op, args, _ in code:
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", args)
            if m and int(m.group(1), 16) < off and off - int(m.group(1), 16) > best[1] - best[0]:
                best = (int(m.group(1), 16), off)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("bwd", "fwd", "ws"), default="bwd")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--case", nargs="+", default=["causal", "prefix-lm"], choices=("causal", "prefix-lm", "doc8"))
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--bits", action="store_true", help="the block mask's bits (FlexMask<..., true>)")
    ap.add_argument("--dump", help="write each case's disassembly here")
    a = ap.parse_args()
    per_case = {}
    for case in a.case:
        source, name = instantiation(a.kernel, a.d, case, a.bits)
        blob, log = cubin(source, name)
        code = disassemble(blob)
        lo, hi = largest_loop(code)
        loop = [c for c in code if lo <= c[0] <= hi]
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores", log)
        print(f"{case}: {len(code)} instructions, largest loop {len(loop)} ({lo:#x}..{hi:#x}), "
              f"{regs.group(1) if regs else '?'} registers, {spill.group(1) if spill else 0} B spill stores")
        per_case[case] = collections.Counter(c[3] for c in loop)
        ops = collections.Counter(c[1].split(".")[0] for c in loop)
        print("  loop opcodes: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(18)))
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, f"{a.kernel}{a.d}_{case}.sass"), "w") as f:
                for off, op, args, where in code:
                    f.write(f"{off:6x} {where:28s} {op} {args}\n")
    if len(a.case) > 1:
        base = per_case[a.case[0]]
        for case in a.case[1:]:
            diff = collections.Counter(per_case[case])
            diff.subtract(base)
            print(f"loop instructions by source line, {case} minus {a.case[0]} (largest differences):")
            for where, n in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: a.top]:
                print(f"  {n:+5d}  {where}  ({base.get(where, 0)} -> {per_case[case].get(where, 0)})")


if __name__ == "__main__":
    main()
