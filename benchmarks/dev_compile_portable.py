"""CPU: compile the portable family's instantiations of tests/test_compile.py (all its job lists: built-in, dropout,
array and flex policies) and check registers and spills against its allowances, without the whole fixture.

    python benchmarks/dev_compile_portable.py [PREFIX ...] [--workers N] [--out FILE]

PREFIX (default ``portable_``) selects jobs by kernel name, e.g. ``portable_fwd<float, 64,``. The tree compiled is
the one ``cupyflash`` is imported from (set PYTHONPATH to compile another checkout); its tests/test_compile.py is
used. Exit status 1 if any job fails to compile or exceeds ``allowance``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix", nargs="*", default=["portable_"])
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=None, help="also write the lines to this file")
    args = ap.parse_args()

    import cupyflash

    root = os.path.dirname(os.path.dirname(os.path.abspath(cupyflash.__file__)))
    sys.path.insert(0, os.path.join(root, "tests"))
    import test_compile as tc

    assert os.path.dirname(os.path.abspath(tc.__file__)) == os.path.join(root, "tests"), tc.__file__
    print(f"tree: {root}", flush=True)
    jobs = [j for j in tc.all_jobs() if any(j[2].startswith(p) for p in args.prefix)]
    programs = tc._programs(jobs)
    print(f"{len(jobs)} jobs in {len(programs)} NVRTC programs", flush=True)
    lines, bad, start = [], 0, time.time()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, (program, results) in enumerate(zip(programs, pool.map(tc._compile, programs)), 1):
            for job, usage in zip(program, results):
                if isinstance(usage, str):
                    lines.append(f"FAIL {job[2]} [{job[3]}]: {usage[:2000]}")
                    bad += 1
                    continue
                allowed = tc.allowance(job[2], job[3])
                ok = max(usage.spill_stores, usage.spill_loads, usage.stack_frame) <= allowed
                ok = ok and 0 < usage.registers <= 255
                bad += not ok
                lines.append(f"{'ok  ' if ok else 'OVER'} {usage.line()} (allowed {allowed} B)")
            print(f"[{i}/{len(programs)}] {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    lines.sort(key=lambda s: s[5:])
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    print(f"{len(jobs) - bad} ok, {bad} failed or over their allowance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
