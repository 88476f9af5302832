#!/usr/bin/env bash
# Device run 1: full GPU suite + sanitizers on the smoke script.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 400 python -m pytest -q -p no:cacheprovider -rfs tests 2>&1 | tee "$OUT/pytest.log" | tail -8
for tool in memcheck racecheck initcheck; do
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 3 python tests/gpu_smoke.py >"$OUT/$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $?; $(tail -1 "$OUT/$tool.log")"
done
