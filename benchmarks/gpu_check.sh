#!/usr/bin/env bash
# The GPU machine's check, in one call: install, the whole test suite, every kernel under
# compute-sanitizer, and a quick benchmark. Logs go to $OUT (or ./gpu_logs).
#   bash benchmarks/gpu_check.sh            # tests + sanitizers + quick bench
#   bash benchmarks/gpu_check.sh bench      # the full benchmark grid instead
set -uo pipefail
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
if [ "${1:-}" = bench ]; then
  python -m cupyflash.bench --compare torch --json "$out/bench.json" --plot "$out/bench.png" 2>"$out/bench.err" | tee "$out/bench.md"
  exit
fi
python -m pytest -q -p no:cacheprovider -rfs --durations=10 tests 2>&1 | tee "$out/pytest.log" | tail -40
for tool in memcheck racecheck initcheck; do
  compute-sanitizer --tool $tool --error-exitcode 3 python tests/gpu_smoke.py >"$out/$tool.log" 2>&1
  echo "compute-sanitizer $tool: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$out/$tool.log") clean summaries) $(tail -1 "$out/$tool.log")"
done
