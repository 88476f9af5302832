# s30 device call 4: the grid against SDPA FLASH and cuDNN with the persistent default (new) and without it (old), alternated
T0=$(date +%s); t() { echo "## t=$(( $(date +%s) - T0 )) s $*"; }
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
cat > /tmp/grid_off.py <<'PY'
import runpy, sys
import cupyflash.plans.wgmma as p
p.PERSISTENT = False
sys.argv = ["cupyflash.bench", *sys.argv[1:]]
runpy.run_module("cupyflash.bench", run_name="__main__")
PY
ARGS="--suite grid --dtype bf16 --n 512,1024,2048,4096 --passes fwd --compare sdpa-flash,sdpa-cudnn"
for r in 1 2; do
  timeout 80 python -m cupyflash.bench $ARGS --json $OUT/grid_new_$r.json > $OUT/grid_new_$r.txt 2>&1; t new $r
  timeout 80 python /tmp/grid_off.py $ARGS --json $OUT/grid_old_$r.json > $OUT/grid_old_$r.txt 2>&1; t old $r
done
cat $OUT/grid_new_1.txt | head -40
timeout 100 python benchmarks/dev_persistent_ab.py --n 512 1024 4096 --cases causal full > $OUT/persistent_short2.txt 2>&1
t ab; cat $OUT/persistent_short2.txt
