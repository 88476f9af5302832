#!/usr/bin/env bash
# Device run: linear-attention harness, one process per (dtype, decay) group. Args: groups like bf16:decay:fla
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
for g in "$@"; do
  IFS=: read dt dec cmp <<<"$g"
  extra=""; [ "$dec" = decay ] && extra="--decay"
  name="linear_${dt}_${dec}"
  echo "== $g"
  timeout 330 python -m cupyflash.bench --mode linear --dtype $dt $extra --compare $cmp --json "$OUT/$name.json" \
    2>"$OUT/$name.err" | tee "$OUT/$name.md"
done
