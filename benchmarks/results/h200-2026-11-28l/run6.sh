# s30 device call 6: grid (README's table) and overhead on the landed tree; two-consumer D = 64 rows for the record
T0=$(date +%s); t() { echo "## t=$(( $(date +%s) - T0 )) s $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python -m cupyflash.bench --suite grid --dtype bf16 --n 1024,4096,16384 --compare sdpa-flash,sdpa-cudnn --json $OUT/grid.json > $OUT/grid.txt 2>&1
t grid; grep -v "^\[" $OUT/grid.txt | tail -40
for r in 1 2; do timeout 60 python -m cupyflash.bench --suite overhead > $OUT/overhead_$r.txt 2>&1; t overhead $r; grep -v "^\[" $OUT/overhead_$r.txt | tail -14; done
timeout 100 python benchmarks/dev_persistent_ab.py --d 64 --n 512 2048 --cases causal window256 --two > $OUT/ws_two_consumers_d64_more.txt 2>&1
t two; cat $OUT/ws_two_consumers_d64_more.txt
