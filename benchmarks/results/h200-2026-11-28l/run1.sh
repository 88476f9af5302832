# s30 device call 1: main (df40adc's SoftcapScore without the ALiBi strip) against f762755, softcap tests, persistent N=1k
T0=$(date +%s); t() { echo "## t=$(( $(date +%s) - T0 )) s $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python -m pytest -q -n 16 -p no:cacheprovider -rfs tests/test_variants_gpu.py -k softcap > $OUT/pytest_softcap_main.txt 2>&1
t tests; tail -2 $OUT/pytest_softcap_main.txt
timeout 150 python benchmarks/dev_tma_ab.py --pass fwd --old .ab/f762755 --new . --no-off --rows softcap softcap-c causal --rounds 2 > $OUT/softcap_main_fwd_ab.txt 2>&1
t fwd; grep -A20 "least ms" $OUT/softcap_main_fwd_ab.txt
timeout 150 python benchmarks/dev_tma_ab.py --pass bwd --old .ab/f762755 --new . --no-off --d 64 128 --rows softcap causal --rounds 2 > $OUT/softcap_main_bwd_ab.txt 2>&1
t bwd; grep -A20 "least ms" $OUT/softcap_main_bwd_ab.txt
timeout 90 python benchmarks/dev_persistent_ab.py --n 1024 --cases causal full > $OUT/persistent_n1k.txt 2>&1
t pers; cat $OUT/persistent_n1k.txt
