#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
dt=${1:-bf16}
timeout 560 python -m cupyflash.bench --suite grid --dtype $dt --compare sdpa-flash,sdpa-cudnn \
   --json $OUT/grid_$dt.json 2>$OUT/grid_$dt.err | tee $OUT/grid_$dt.md
tail -3 $OUT/grid_$dt.err
