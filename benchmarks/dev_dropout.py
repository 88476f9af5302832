"""Issue 16's speed questions: now ``python -m cupyflash.bench --suite dropout`` (cupyflash/bench/dropout.py);
this wrapper keeps the old command working and passes its arguments on (e.g. ``--kernels mma --json out.json``).

Usage: python benchmarks/dev_dropout.py [python -m cupyflash.bench options]
"""
from __future__ import annotations

import sys

from cupyflash.bench import main

if __name__ == "__main__":
    sys.exit(main(["--suite", "dropout", *sys.argv[1:]]))
