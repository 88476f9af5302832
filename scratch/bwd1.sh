#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 500 python benchmarks/dev_wgmma_bwd.py --n 1024,4096,16384 2>&1 | tee $OUT/bwd1.log
