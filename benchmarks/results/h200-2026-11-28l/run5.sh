# s30 device call 5: the D = 64 ws forward with two consumers (Br = 128) against three (Br = 192), one tile a block and persistent
T0=$(date +%s); t() { echo "## t=$(( $(date +%s) - T0 )) s $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 200 python benchmarks/dev_persistent_ab.py --d 64 --n 1024 4096 16384 --cases causal full window1024 window256 --two > $OUT/ws_two_consumers_d64.txt 2>&1
t ab; cat $OUT/ws_two_consumers_d64.txt
