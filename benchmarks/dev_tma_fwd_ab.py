"""A/B of the ws forward's producer by TMA (kTma, plans.wgmma.uses_tma_forward): two trees, and the branch tree with
TMA off, in alternating processes of ``dev_bwd_ab.py --pass fwd`` (CUDA-event medians, dev_ws_ab.per_call_ms), then a
table of each row's least ms per variant and the ratios. bf16, B = 1, H*D = 2048. The three must hash o and lse alike
(the same tiles in shared memory, the same products in the same order: bitwise equal).
From the main checkout's root on the GPU machine (the branch tree in .ab/tmafwd):
    python .ab/tmafwd/benchmarks/dev_tma_fwd_ab.py --old . --new .ab/tmafwd --rounds 2 > $OUT/tma_fwd_ab.txt
Defaults: D = 64 and 128, N = 4096 and 16384, rows full, causal, window-c (causal window 1024), softcap.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LINE = re.compile(r"^(\S+) D=(\d+) N=(\d+) (\S+)\s+fwd ([\d.]+) ms \| o,lse (\S+)")


def run(tag: str, tree: str, args: list[str]) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    cmd = [sys.executable, os.path.join(HERE, "dev_bwd_ab.py"), tag, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stdout.write(out.stdout)
    if out.returncode:
        sys.stdout.write(f"# {tag} failed ({out.returncode}):\n{out.stderr[-3000:]}\n")
    sys.stdout.flush()
    return out.stdout.splitlines()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the base tree (main)")
    ap.add_argument("--new", required=True, help="the branch tree (tmafwd)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--d", nargs="+", default=["64", "128"])
    ap.add_argument("--n", nargs="+", default=["4096", "16384"])
    ap.add_argument("--rows", nargs="+", default=["full", "causal", "window-c", "softcap"])
    ap.add_argument("--no-off", action="store_true", help="leave out the branch with TMA off")
    a = ap.parse_args()
    common = ["--pass", "fwd", "--d", *a.d, "--n", *a.n, "--rows", *a.rows]
    variants = [("old", a.old, []), ("new", a.new, [])]
    variants += [] if a.no_off else [("new-cpasync", a.new, ["--no-tma-fwd"])]
    best: dict = collections.defaultdict(dict)  # (D, N, row) -> tag -> (ms, digest)
    for r in range(a.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for tag, tree, extra in order:
            for line in run(tag, tree, common + extra):
                m = LINE.match(line)
                if m:
                    key = (int(m.group(2)), int(m.group(3)), m.group(4))
                    ms, digest = float(m.group(5)), m.group(6)
                    if tag not in best[key] or ms < best[key][tag][0]:
                        best[key][tag] = (ms, digest)
    tags = [t for t, _, _ in variants]
    print("\n# least ms over rounds; x = old / variant (> 1: faster than main); o,lse: hashes equal to old's")
    print(f"# {'D':>3} {'N':>6} {'row':9s} " + " ".join(f"{t:>12s}" for t in tags) + "   x new  x new-cpasync  o,lse")
    for key in sorted(best):
        row = best[key]
        if "old" not in row:
            continue
        old_ms, old_digest = row["old"]
        cells = " ".join(f"{row[t][0]:12.3f}" if t in row else f"{'-':>12s}" for t in tags)
        ratios = " ".join(f"{old_ms / row[t][0]:6.3f}" if t in row else "     -" for t in tags[1:])
        same = all(row[t][1] == old_digest for t in tags[1:] if t in row)
        print(f"  {key[0]:>3} {key[1]:>6} {key[2]:9s} {cells}   {ratios}  {'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
