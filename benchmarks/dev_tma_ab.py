"""A/B of the wgmma kernels' TMA copies: the backward's loader (``--pass bwd``: kTma, plans.wgmma.uses_tma) or the
warp-specialised forward's producer (``--pass fwd``: plans.wgmma.uses_tma_forward). Two trees, and the branch tree with
TMA off, in alternating processes of ``dev_bwd_ab.py`` (CUDA-event medians), then a table of each row's least ms per
variant and the ratios. bf16, H*D = 2048. Both paths put the same tiles in shared memory, so the backward's dk and dv
sums must agree exactly with the base's (dq's to ~1e-6: bulk adds in any order), and the forward's o and lse hashes
bit for bit.
From the main checkout's root on the GPU machine (a branch tree in .ab/<branch>):
    python benchmarks/dev_tma_ab.py --old . --new .ab/<branch> --rounds 2 > $OUT/tma_ab.txt
    python benchmarks/dev_tma_ab.py --pass fwd --old . --new .ab/<branch> --rounds 2 > $OUT/tma_fwd_ab.txt
Defaults: backward D = 128, rows full, causal, window-c (causal window 1024), alibi-c (causal ALiBi); forward D = 64
and 128, rows full, causal, window-c, softcap; N = 4096 and 16384.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
#: dev_bwd_ab.py's lines per pass: (tag, D, N, row, ms, what must agree)
LINE = {"bwd": re.compile(r"^(\S+) D=(\d+) N=(\d+) (\S+)\s+bwd ([\d.]+) ms \| sums dq dk dv (\S+) (\S+) (\S+)"),
        "fwd": re.compile(r"^(\S+) D=(\d+) N=(\d+) (\S+)\s+fwd ([\d.]+) ms \| o,lse (\S+)")}
DEFAULTS = {"bwd": (["128"], ["full", "causal", "window-c", "alibi-c"], "--no-tma"),
            "fwd": (["64", "128"], ["full", "causal", "window-c", "softcap"], "--no-tma-fwd")}


def run(tag: str, tree: str, args: list[str]) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, os.path.join(HERE, "dev_bwd_ab.py"), tag, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stdout.write(out.stdout)
    if out.returncode:
        sys.stdout.write(f"# {tag} failed ({out.returncode}):\n{out.stderr[-3000:]}\n")
    sys.stdout.flush()
    return out.stdout.splitlines()


def agreement(pass_: str, row: dict, tags: list[str]) -> str:
    """'equal' or 'DIFFER' against the base: the backward's dk/dv sums (and dq's relative spread), the forward's
    o/lse hash."""
    base = row["old"][1]
    if pass_ == "fwd":
        return "equal" if all(row[t][1] == base for t in tags if t in row) else "DIFFER"
    same = all(row[t][1][1:] == base[1:] for t in tags if t in row)
    dq = max((abs(float(row[t][1][0]) / float(base[0]) - 1) for t in tags if t in row), default=0.0)
    return f"{'equal' if same else 'DIFFER'} (dq rel {dq:.1e})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pass", dest="pass_", choices=("bwd", "fwd"), default="bwd")
    ap.add_argument("--old", required=True, help="the base tree (main)")
    ap.add_argument("--new", required=True, help="the branch tree")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--d", nargs="+")
    ap.add_argument("--n", nargs="+", default=["4096", "16384"])
    ap.add_argument("--rows", nargs="+")
    ap.add_argument("--no-off", action="store_true", help="leave out the branch with TMA off")
    a = ap.parse_args()
    d, rows, off = DEFAULTS[a.pass_]
    common = ["--pass", a.pass_, "--d", *(a.d or d), "--n", *a.n, "--rows", *(a.rows or rows)]
    variants = [("old", a.old, []), ("new", a.new, [])] + ([] if a.no_off else [("new-cpasync", a.new, [off])])
    best: dict = collections.defaultdict(dict)  # (D, N, row) -> tag -> (ms, what must agree)
    for r in range(a.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for tag, tree, extra in order:
            for line in run(tag, tree, common + extra):
                m = LINE[a.pass_].match(line)
                if m:
                    key = (int(m.group(2)), int(m.group(3)), m.group(4))
                    ms, check = float(m.group(5)), m.groups()[5:]
                    if tag not in best[key] or ms < best[key][tag][0]:
                        best[key][tag] = (ms, check)
    tags = [t for t, _, _ in variants]
    what = "o,lse: hashes" if a.pass_ == "fwd" else "dk/dv: sums"
    print(f"\n# least ms over rounds; x = old / variant (> 1: faster than main); {what} equal to old's")
    print(f"# {'D':>3} {'N':>6} {'row':9s} " + " ".join(f"{t:>12s}" for t in tags) + "   x new  x new-cpasync  agree")
    for key in sorted(best):
        row = best[key]
        if "old" not in row:
            continue
        old_ms = row["old"][0]
        cells = " ".join(f"{row[t][0]:12.3f}" if t in row else f"{'-':>12s}" for t in tags)
        ratios = " ".join(f"{old_ms / row[t][0]:6.3f}" if t in row else "     -" for t in tags[1:])
        print(f"  {key[0]:>3} {key[1]:>6} {key[2]:9s} {cells}   {ratios}  {agreement(a.pass_, row, tags[1:])}")


if __name__ == "__main__":
    main()
