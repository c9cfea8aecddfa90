#!/usr/bin/env bash
# The guard through dfo's launch wiring, final code: B (guard, no warmup) and C (guard + warmup) on one GPU.
# Run on the GPU box from the repo root (carry .whl and .whl-dfo); writes $OUT/final_guard_check.log.
set -u; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-dfo/*.whl
python3 -m pip install -q --no-index --no-deps .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD COLUMNS=160
python3 -c "from pathlib import Path; from orchestrator.demo_data import write_model, write_data; write_model(Path('/root/demo-src/model'), d=256, heads=4); write_data(Path('/root/demo-src/data'))"
printf 'defaults: {known_hosts: /tmp/kh}\nhosts:\n  h200: {transport: local}\n' > /tmp/inv.yaml
D() { echo "\$ dfo $*"; python3 -m orchestrator.cli -i /tmp/inv.yaml "$@"; echo "# exit status $?"; }
sed -e 's/ --warmup//' -e 's/^name: demo-gpu/name: demo-gpu-guard/' -e 's|demo-gpu/checkpoints|demo-gpu/checkpoints-guard|' \
  jobs/demo-gpu.yaml > jobs/_guard.yaml
{ D stage-model -H h200 -j jobs/demo-gpu.yaml
  D launch -H h200 -j jobs/_guard.yaml --wait 3; D tail -H h200 -j jobs/_guard.yaml -n +0
  D launch -H h200 -j jobs/demo-gpu.yaml --wait 3; D tail -H h200 -j jobs/demo-gpu.yaml -n +0
  D status -H h200 --json
  for r in /workspace/.dfo/runs/*; do echo "$r"; cat "$r/autotune_guard.jsonl"
    python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print({'autotune_guard': m.get('autotune_guard')}, (m.get('env') or {}).get('PYTHONPATH'))" "$r/meta.json"
  done; } 2>&1 | tee "$OUT/final_guard_check.log"
