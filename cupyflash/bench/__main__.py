"""``python -m cupyflash.bench``: the README's main command, useful on any machine.

With a usable GPU it runs the benchmark. Without one, and without arguments, it says why in
one line and runs the NumPy quickstart instead, exiting 0, so a first try on a laptop or a CI
box shows the package working rather than a CUDA traceback. With arguments it always goes to
the benchmark's own parser (``--help`` and ``--list`` need no GPU; the rest says it needs one).
"""
import sys


def main() -> int:
    from .._cuda_env import gpu_status

    if len(sys.argv) == 1:
        reason = gpu_status()
        if reason is not None:
            print(f"no GPU: {reason}")
            print("The benchmark needs an NVIDIA GPU; running the NumPy quickstart instead "
                  "(python -m cupyflash.quickstart).", flush=True)
            from .. import quickstart

            return quickstart.main()
    from .run import main as bench_main

    return bench_main()


sys.exit(main())
