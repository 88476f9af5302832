#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_attention.py tests/test_plans_wgmma.py -k "wgmma" 2>&1 | tail -2
for dt in bf16 fp16; do
  timeout 200 python -m cupyflash.bench --suite grid --dtype $dt --compare sdpa-flash,sdpa-cudnn --json $OUT/grid_$dt.json 2>$OUT/grid_$dt.err >$OUT/grid_$dt.md
  tail -1 $OUT/grid_$dt.err
done
