# s30 device call 2: branch own (second form): its GPU tests inside its tree, then the forward A/B against main
T0=$(date +%s); t() { echo "## t=$(( $(date +%s) - T0 )) s $*"; }
(cd .ab/own && PYTHONPATH=$PWD timeout 330 python -m pytest -q -n 16 -p no:cacheprovider -rfs tests/test_wgmma_ws_gpu.py tests/test_wgmma_tma_fwd_gpu.py tests/test_flex_tiles_gpu.py tests/test_ws_protocol.py > $OUT/pytest_own.txt 2>&1)
t tests; tail -3 $OUT/pytest_own.txt
timeout 200 python benchmarks/dev_tma_ab.py --pass fwd --old . --new .ab/own --no-off --rows window-c causal full --rounds 2 > $OUT/own_fwd_ab.txt 2>&1
t ab; grep -A20 "least ms" $OUT/own_fwd_ab.txt
