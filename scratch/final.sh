#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bash scratch/run_tests.sh 2>&1 | tail -5
timeout 120 python -m cupyflash.bench --suite grid --dtype bf16 --compare sdpa-flash,sdpa-cudnn --json $OUT/grid_bf16.json 2>$OUT/grid_bf16.err >$OUT/grid_bf16.md
tail -1 $OUT/grid_bf16.err
