#!/usr/bin/env bash
# One batched device call: re-check what failed, then the overhead, grid and variants benchmarks.
set -uo pipefail
out="${OUT:-gpu_logs}"; mkdir -p "$out"; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
t() { timeout "$@"; }
(t 300 python -m pytest -q -p no:cacheprovider tests/test_gpu_attention.py -k "portable" >"$out/t_a.log" 2>&1) &
(t 300 python -m pytest -q -p no:cacheprovider tests/test_linear_gpu.py tests/test_launch_abi.py >"$out/t_b.log" 2>&1) &
(t 300 python -m pytest -q -p no:cacheprovider tests/test_variants_gpu.py -k "portable" >"$out/t_c.log" 2>&1) &
wait
for f in t_a t_b t_c; do echo "$f: $(tail -1 $out/$f.log)"; grep -h "^FAILED" $out/$f.log | head -5; done
t 120 python -m cupyflash.bench --suite overhead --json "$out/overhead.json" 2>"$out/overhead.err" | tee "$out/overhead.md"
t 170 python -m cupyflash.bench --suite grid --dtype bf16 --n 4096,16384 --compare sdpa-flash,sdpa-cudnn \
  --json "$out/grid.json" 2>"$out/grid.err" | tail -30
t 200 python -m cupyflash.bench --suite variants --d 128 --n 16384 --json "$out/variants.json" 2>"$out/variants.err" \
  | tee "$out/variants.md" | tail -30
tail -5 "$out/variants.err"
