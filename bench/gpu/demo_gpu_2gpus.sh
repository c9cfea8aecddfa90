#!/usr/bin/env bash
# The demo trainer's two target replicas on two real GPUs (cuda:0, cuda:1), driven by threads:
# without the guard (cold autotuning), then with guard + sequential warmup. Needs 2 GPUs.
set -u
HOST=h200x2; . bench/gpu/device_env.sh
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
