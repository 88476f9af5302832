#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 250 python -m pytest -q -x -p no:cacheprovider tests/test_gpu_attention.py -k "wgmma" 2>&1 | tail -3
timeout 200 python benchmarks/dev_wgmma.py --d 128 --n 1024,2048,4096 2>&1 | tee $OUT/fwd_d128.log
