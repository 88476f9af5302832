# s30 device call 3: persistent forward on short dense rows (the plans' new default): A/B at N = 512-4096, GPU suite
T0=$(date +%s); t() { echo "## t=$(( $(date +%s) - T0 )) s $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 100 python benchmarks/dev_persistent_ab.py --n 512 1024 2048 4096 --cases causal full > $OUT/persistent_short.txt 2>&1
t ab; cat $OUT/persistent_short.txt
timeout 450 python -m pytest -q -n 16 -p no:cacheprovider -rfs $(ls tests/test_*.py | grep -v -e test_compile.py -e kvcache -e linear -e float32 -e varlen) > $OUT/pytest_gpu_persistent.txt 2>&1
t suite; tail -15 $OUT/pytest_gpu_persistent.txt
