#!/usr/bin/env bash
# wgmma forward: correctness on the GPU test subset, then fwd timings vs mma and SDPA FLASH/cuDNN.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_gpu_attention.py -k "wgmma" 2>&1 | tail -15
timeout 300 python -m cupyflash.bench --suite grid --dtype bf16 --passes fwd --kernels wgmma,mma --compare sdpa-flash,sdpa-cudnn \
   --json $OUT/wg_grid.json 2>$OUT/wg_grid.err | tee $OUT/wg_grid.md
