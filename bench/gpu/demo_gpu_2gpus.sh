#!/usr/bin/env bash
# The demo trainer's two target replicas on two real GPUs (cuda:0, cuda:1), driven by threads:
# without the guard (cold autotuning), then with guard + sequential warmup. Needs 2 GPUs.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-dfo/*.whl
python3 -m pip install -q --no-index --no-deps .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD COLUMNS=160
python3 -c "from pathlib import Path; from orchestrator.demo_data import write_model, write_data; \
print(write_model(Path('/root/demo-src/model'), d=256, heads=4), write_data(Path('/root/demo-src/data')))"
printf 'defaults: {known_hosts: /tmp/kh}\nhosts:\n  h200x2: {transport: local}\n' > /tmp/inv.yaml
D() { echo "\$ dfo $*"; python3 -m orchestrator.cli -i /tmp/inv.yaml "$@"; echo "# exit status $?"; }
sed -e 's/autotune_guard: true/autotune_guard: false/' -e 's/ --warmup//' -e 's/^name: demo-gpu/name: demo-gpu-noguard/' \
  -e 's|demo-gpu/checkpoints|demo-gpu/checkpoints-noguard|' jobs/demo-gpu.yaml > jobs/_noguard.yaml
{
  nvidia-smi -L
  D stage-model -H h200x2 -j jobs/demo-gpu.yaml
  echo "=== A: replicas on cuda:0 and cuda:1 in threads, cold autotuning, NO guard"
  D launch -H h200x2 -j jobs/_noguard.yaml --wait 150
  echo "=== C: guard + sequential warmup"
  D launch -H h200x2 -j jobs/demo-gpu.yaml --wait 3
  D tail -H h200x2 -j jobs/demo-gpu.yaml -n +0
  D status -H h200x2
} 2>&1 | tee "$OUT/demo_gpu_2gpus.log"
r=$(ls -td /workspace/.dfo/runs/demo-gpu-2* | head -1); cp "$r/meta.json" "$OUT/demo-gpu.meta.json"; cp "$r/autotune_guard.jsonl" "$OUT/demo-gpu.guard.jsonl"
