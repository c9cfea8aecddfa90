#!/usr/bin/env bash
# dfo on the GPU box itself (transport: local): verify-env --gpu, provision (no-op), stage-model from a node path, and the
# demo trainer with FLA Gated DeltaNet target replicas in threads -- without the guard (expect the
# autotuner race, diagnosed), with the guard, and with guard + sequential warmup.
# Run from the repo root on the device: bash bench/gpu/demo_gpu.sh  (writes into ${OUT:-/tmp/out})
set -u
HOST=h200; . bench/gpu/device_env.sh
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
