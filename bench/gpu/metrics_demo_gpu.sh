#!/usr/bin/env bash
# dfo's metrics on the GPU box itself (transport: local): the demo GPU job (jobs/demo-gpu.yaml: FLA Gated
# DeltaNet target replicas in threads, guard + warmup) with the sampler every 2 s, then `dfo top --once`
# while it trains, `dfo plot -o`, `dfo report` and `dfo status` after it ends.
# Run from the repo root on the device: bash bench/gpu/metrics_demo_gpu.sh  (carry: .whl .whl-dfo; writes ${OUT:-/tmp/out})
set -u
HOST=h200; . bench/gpu/device_env.sh
sed -e 's/^name: demo-gpu/name: demo-gpu-metrics/' -e 's/--max-steps 200/--max-steps 1500/' \
    -e 's|demo-gpu/checkpoints|demo-gpu/checkpoints-metrics|' -e 's/^  wait: 20/  wait: 20\n  metrics_every: 2/' \
    jobs/demo-gpu.yaml > jobs/_metrics.yaml
{
  nvidia-smi -L
  D stage-model -H h200 -j jobs/_metrics.yaml
  D launch -H h200 -j jobs/_metrics.yaml --wait 5
  sleep 40
  D top -H h200 --once
} 2>&1 | tee "$OUT/log.txt"
python3 -m orchestrator.cli -i /tmp/inv.yaml top -H h200 --once --json > "$OUT/top.json" 2>>"$OUT/log.txt"
{
  D tail -H h200 -j jobs/_metrics.yaml -n 5
  D status -H h200
  D report -H h200
  D plot -H h200 -o "$OUT/plot.png"
  D plot -H h200 loss
} 2>&1 | tee -a "$OUT/log.txt"
r=$(ls -td /workspace/.dfo/runs/demo-gpu-metrics-* 2>/dev/null | head -1)
[ -n "$r" ] && cp "$r/metrics.jsonl" "$OUT/metrics.jsonl" && cp "$r/meta.json" "$OUT/meta.json"
