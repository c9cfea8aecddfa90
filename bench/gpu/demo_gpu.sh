#!/usr/bin/env bash
# dfo on the GPU box itself (transport: local): verify-env --gpu, provision (no-op), stage-model from a node path, and the
# demo trainer with FLA Gated DeltaNet target replicas in threads -- without the guard (expect the
# autotuner race, diagnosed), with the guard, and with guard + sequential warmup.
# Run from the repo root on the device: bash bench/gpu/demo_gpu.sh  (writes into ${OUT:-/tmp/out})
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-dfo/*.whl
python3 -m pip install -q --no-index --no-deps .whl/*.whl          # FLA into the trainer's environment
export PYTHONPATH=/tmp/site:$PWD COLUMNS=160
mkdir -p /root/demo-src
python3 -c "from pathlib import Path; from orchestrator.demo_data import write_model, write_data; \
print(write_model(Path('/root/demo-src/model'), d=256, heads=4), write_data(Path('/root/demo-src/data')))"
printf 'defaults: {known_hosts: /tmp/kh}\nhosts:\n  h200: {transport: local}\n' > /tmp/inv.yaml
D() { echo "\$ dfo $*"; python3 -m orchestrator.cli -i /tmp/inv.yaml "$@"; echo "# exit status $?"; }
# each variant has its own job name and checkpoint folder (the trainer resumes from its folder)
sed -e 's/autotune_guard: true/autotune_guard: false/' -e 's/ --warmup//' -e 's/^name: demo-gpu/name: demo-gpu-noguard/' \
  -e 's|demo-gpu/checkpoints|demo-gpu/checkpoints-noguard|' jobs/demo-gpu.yaml > jobs/_noguard.yaml
sed -e 's/ --warmup//' -e 's/^name: demo-gpu/name: demo-gpu-guard/' -e 's|demo-gpu/checkpoints|demo-gpu/checkpoints-guard|' \
  jobs/demo-gpu.yaml > jobs/_guard.yaml
{
  nvidia-smi -L
  D verify-env -H h200 -j jobs/demo-gpu.yaml --gpu
  D provision -H h200 -j jobs/demo-gpu.yaml
  D stage-model -H h200 -j jobs/demo-gpu.yaml
  echo "=== A: two target replicas in threads, cold autotune, NO guard, no warmup"
  D launch -H h200 -j jobs/_noguard.yaml --wait 150
  D tail -H h200 -j jobs/_noguard.yaml --no-follow -n 12
  echo "=== B: the same with run.autotune_guard: true (no warmup)"
  D launch -H h200 -j jobs/_guard.yaml --wait 5
  D tail -H h200 -j jobs/_guard.yaml -n +0
  echo "=== C: guard + sequential warmup (jobs/demo-gpu.yaml as is)"
  D launch -H h200 -j jobs/demo-gpu.yaml --wait 5
  D tail -H h200 -j jobs/demo-gpu.yaml -n +0
  D status -H h200
} 2>&1 | tee "$OUT/demo_gpu.log"
python3 -m orchestrator.cli -i /tmp/inv.yaml verify-env -H h200 -j jobs/demo-gpu.yaml --gpu --json > "$OUT/verify_env_gpu.json"
python3 -m orchestrator.cli -i /tmp/inv.yaml status -H h200 --json > "$OUT/status.json"
for j in demo-gpu-guard demo-gpu; do
  r=$(ls -td /workspace/.dfo/runs/$j-* 2>/dev/null | head -1); [ -n "$r" ] && cp "$r/meta.json" "$OUT/$j.meta.json" && cat "$r"/autotune_guard.jsonl > "$OUT/$j.guard.jsonl" 2>/dev/null
done
ls /workspace/.dfo/runs/ > "$OUT/runs.txt"
