"""PTX of every kernel instantiation, to check on a CPU that a refactor changed no code.

    python benchmarks/dev_ptx.py dump /tmp/before          # before the change
    python benchmarks/dev_ptx.py dump /tmp/after           # after it
    python benchmarks/dev_ptx.py diff /tmp/before /tmp/after

One NVRTC program per (source, arch) with every name expression the kernel families launch,
for sm_80 and sm_90a. The compiler banner and the lines naming file-local symbols (their names
carry a hash of the source text) are left out, so identical output means identical kernel code:
ptxas then makes the same SASS, and timings measured before the change still hold.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ARCHS = ("sm_80", "sm_90a")


def instantiations() -> dict[str, list[str]]:
    from cupyflash.kernels import linear, mma, portable, wgmma

    by_source: dict[str, list[str]] = {}
    for family in (portable, mma, linear, wgmma):
        for source, name in family.instantiations():
            by_source.setdefault(source, []).append(name)
    return by_source


def ptx(source: str, names: list[str], arch: str) -> str:
    from cupy.cuda import nvrtc

    from cupyflash.kernels.build import compile_options, read_source

    prog = nvrtc.createProgram(read_source(source), source, [], [])
    try:
        for n in names:
            nvrtc.addNameExpression(prog, n)
        nvrtc.compileProgram(prog, [*compile_options(), f"-arch={arch}", "-ftz=true"])
        text = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    text = text.decode() if isinstance(text, bytes) else text
    return "\n".join(ln for ln in text.splitlines() if not ln.startswith("//") and "_INTERNAL_" not in ln)


def dump(out: pathlib.Path) -> None:
    from cupyflash.kernels.build import ARCH_SPECIFIC

    out.mkdir(parents=True, exist_ok=True)
    for source, names in instantiations().items():
        for arch in (ARCH_SPECIFIC[source],) if source in ARCH_SPECIFIC else ARCHS:
            (out / f"{source}.{arch}.ptx").write_text(ptx(source, names, arch))
            print(f"{source} {arch}: {len(names)} kernels", flush=True)


def diff(a: pathlib.Path, b: pathlib.Path) -> int:
    changed = 0
    for fa in sorted(a.glob("*.ptx")):
        fb = b / fa.name
        same = fb.exists() and fa.read_text() == fb.read_text()
        print(f"{fa.name}: {'identical' if same else 'DIFFERS'}")
        changed += not same
    return 1 if changed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dump").add_argument("out", type=pathlib.Path)
    d = sub.add_parser("diff")
    d.add_argument("a", type=pathlib.Path)
    d.add_argument("b", type=pathlib.Path)
    args = p.parse_args()
    if args.cmd == "dump":
        dump(args.out)
        return 0
    return diff(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
