#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q -x -p no:cacheprovider tests/test_gpu_attention.py -k "wgmma" 2>&1 | tail -4
timeout 300 python benchmarks/dev_wgmma.py 2>&1 | tee $OUT/dev_wgmma.log
