# s30 device call 7: D = 64's few-tiles form (the lockstep tile in the persistent ws forward): GPU suite, grid rows
T0=$(date +%s); t() { echo "## t=$(( $(date +%s) - T0 )) s $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 40 python -m cupyflash.bench --suite grid --dtype bf16 --d 64 --causal 1 --n 512,1024,2048 --passes fwd --compare sdpa-flash,sdpa-cudnn --json $OUT/grid_d64_causal_short.json > $OUT/grid_d64_causal_short.txt 2>&1
t grid; grep "^|" $OUT/grid_d64_causal_short.txt
timeout 470 python -m pytest -q -n 16 -p no:cacheprovider -rfs $(ls tests/test_*.py | grep -v -e test_compile.py -e kvcache -e linear -e float32 -e varlen) > $OUT/pytest_gpu_final.txt 2>&1
t suite; tail -4 $OUT/pytest_gpu_final.txt; grep -E "^FAILED|^ERROR" $OUT/pytest_gpu_final.txt | head
