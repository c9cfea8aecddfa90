#!/usr/bin/env bash
# The guard through dfo's launch wiring, final code: B (guard, no warmup) and C (guard + warmup) on one GPU.
# Run on the GPU box from the repo root (carry .whl and .whl-dfo); writes $OUT/final_guard_check.log.
set -u; HOST=h200; . bench/gpu/device_env.sh
{ D stage-model -H h200 -j jobs/demo-gpu.yaml
  D launch -H h200 -j jobs/_guard.yaml --wait 3; D tail -H h200 -j jobs/_guard.yaml -n +0
  D launch -H h200 -j jobs/demo-gpu.yaml --wait 3; D tail -H h200 -j jobs/demo-gpu.yaml -n +0
  D status -H h200 --json
  for r in /workspace/.dfo/runs/*; do echo "$r"; cat "$r/autotune_guard.jsonl"
    python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print({'autotune_guard': m.get('autotune_guard')}, (m.get('env') or {}).get('PYTHONPATH'))" "$r/meta.json"
  done; } 2>&1 | tee "$OUT/final_guard_check.log"
