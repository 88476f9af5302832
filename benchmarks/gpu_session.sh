#!/usr/bin/env bash
# One device call's worth of checks for a working session (logs to $OUT): the GPU test files named in $TESTS
# through pytest-xdist, then compute-sanitizer memcheck on both smoke scripts.
#   TESTS="tests/test_varlen_gpu.py tests/test_kvcache_gpu.py" bash benchmarks/gpu_session.sh
set -uo pipefail
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the smoke scripts run from tests/: find the package even if pip's editable install does not take
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
python -m pytest -q -n 12 -p no:cacheprovider -rf ${TESTS:-tests --ignore=tests/test_compile.py} 2>&1 \
  | tee "$out/pytest.log" | grep -v "^\[gw\|Warning\|warner" | tail -${TAIL:-15}
for smoke in gpu_smoke gpu_smoke_breadth; do
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 python tests/$smoke.py >"$out/memcheck_$smoke.log" 2>&1
  echo "memcheck $smoke: exit $?; $(grep -c ': ok\|: ran' "$out/memcheck_$smoke.log") cases; $(tail -1 "$out/memcheck_$smoke.log")"
done
