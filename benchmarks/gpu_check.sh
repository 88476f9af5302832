#!/usr/bin/env bash
# The GPU machine's checks, batched so that one call does a lot. Logs go to $OUT (or ./gpu_logs).
#   bash benchmarks/gpu_check.sh tests      # whole test suite + every kernel under memcheck
#   bash benchmarks/gpu_check.sh tests-par  # the same suite in parallel shards (first-use NVRTC compiles are
#                                           # CPU-bound: shards compile on separate cores), then memcheck
#   bash benchmarks/gpu_check.sh tests-n    # the suite through pytest-xdist (12 workers), then memcheck
#   bash benchmarks/gpu_check.sh sanitize   # racecheck and initcheck too
#   bash benchmarks/gpu_check.sh examples   # every example, train_gpt with both attentions
#   bash benchmarks/gpu_check.sh bench      # the DESIGN grid against naive CuPy and SDPA
#   bash benchmarks/gpu_check.sh bench-fp32 # float32 shapes, N = 131072
#   bash benchmarks/gpu_check.sh bench-linear # linear attention vs naive CuPy and fla (n/a without fla-core)
# Several modes may follow one another: bash benchmarks/gpu_check.sh tests examples
set -uo pipefail
out="${OUT:-gpu_logs}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for mode in "${@:-tests}"; do
  case "$mode" in
  tests)
    python -m pytest -q -p no:cacheprovider -rfs tests 2>&1 | tee "$out/pytest.log" | tail -25
    compute-sanitizer --tool memcheck --error-exitcode 3 python tests/gpu_smoke.py >"$out/memcheck.log" 2>&1
    echo "compute-sanitizer memcheck: exit $?; $(tail -1 "$out/memcheck.log")" ;;
  tests-par)
    shards=("tests/test_gpu_attention.py -k portable" "tests/test_gpu_attention.py -k 'not portable and not wgmma'"
            "tests/test_gpu_attention.py -k wgmma" "tests/test_variants_gpu.py -k portable"
            "tests/test_variants_gpu.py -k 'not portable'"
            "tests --ignore=tests/test_gpu_attention.py --ignore=tests/test_variants_gpu.py --ignore=tests/test_compile.py")
    for i in "${!shards[@]}"; do
      eval "python -m pytest -q -p no:cacheprovider -rfs ${shards[$i]}" >"$out/pytest_$i.log" 2>&1 &
    done
    wait
    for i in "${!shards[@]}"; do echo "shard $i (${shards[$i]}): $(tail -1 "$out/pytest_$i.log")"; done
    grep -h "^FAILED\|^ERROR" "$out"/pytest_*.log | head -40
    compute-sanitizer --tool memcheck --error-exitcode 3 python tests/gpu_smoke.py >"$out/memcheck.log" 2>&1
    echo "compute-sanitizer memcheck: exit $?; $(tail -1 "$out/memcheck.log")" ;;
  tests-n)
    python -m pytest -q -n 12 -p no:cacheprovider -rfs tests --ignore=tests/test_compile.py 2>&1 \
      | tee "$out/pytest.log" | grep -v "^\[gw" | tail -30
    compute-sanitizer --tool memcheck --error-exitcode 3 python tests/gpu_smoke.py >"$out/memcheck.log" 2>&1
    echo "compute-sanitizer memcheck: exit $?; $(tail -1 "$out/memcheck.log")" ;;
  sanitize)
    for tool in racecheck initcheck; do
      compute-sanitizer --tool $tool --error-exitcode 3 python tests/gpu_smoke.py >"$out/$tool.log" 2>&1
      echo "compute-sanitizer $tool: exit $?; $(tail -1 "$out/$tool.log")"
    done ;;
  examples)
    for ex in quickstart interop long_context linear_attention; do
      echo "== examples/$ex.py"; timeout 120 python examples/$ex.py 2>&1 | tail -12
    done
    echo "== train_gpt (cupyflash attention)"
    timeout 200 python examples/train_gpt.py --time-limit 90 --log-json "$out/train_flash.json" >"$out/train_flash.log" 2>&1
    tail -22 "$out/train_flash.log"
    for a in flash naive; do
      timeout 100 python examples/train_gpt.py --attention $a --steps 40 --eval-every 0 --sample-chars 0 \
        --log-json "$out/cmp_$a.json" >"$out/cmp_$a.log" 2>&1
      echo "== $a, 40 steps:"; tail -8 "$out/cmp_$a.log"
    done ;;
  bench)
    python -m cupyflash.bench --suite grid --compare torch --json "$out/bench_grid.json" --plot "$out/bench_grid.png" \
      2>"$out/bench_grid.err" | tee "$out/bench_grid.md" ;;
  bench-fp32)
    python -m cupyflash.bench --suite fp32,long --compare torch --json "$out/bench_fp32.json" \
      2>"$out/bench_fp32.err" | tee "$out/bench_fp32.md" ;;
  bench-linear)
    python -m cupyflash.bench --mode linear --compare naive,fla --json "$out/bench_linear.json" \
      2>"$out/bench_linear.err" | tee "$out/bench_linear.md" ;;
  *) echo "unknown mode $mode"; exit 2 ;;
  esac
done
