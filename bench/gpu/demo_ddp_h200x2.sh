#!/usr/bin/env bash
# Issue 13 on nvidia-h200-x2, one node: the demo trainer under torchrun, one process per GPU (NCCL),
# DistributedDataParallel, FLA target, dfo's autotune guard on, through dfo (transport: local).
#   1. plain run, 200 steps: every rank must log the same all-reduced loss
#   2. a second launch of the same job resumes from rank 0's checkpoint (max-steps raised to 240)
#   3. rank 1 exits 1 at step 30: torchrun ends the other rank, dfo records the failure (exit 5)
#   launcher: dfo's own launcher: torchrun, nproc_per_node auto (jobs/demo-ddp-gpu-launcher.yaml)
# Run from the repo root on the device (carry .whl .whl-dfo):  bash bench/gpu/demo_ddp_h200x2.sh [launcher]
set -u
HOST=h200x2; . bench/gpu/device_env.sh
J=jobs/demo-ddp-gpu.yaml
sed -e 's/^name: demo-ddp-gpu/name: demo-ddp-gpu-more/' -e 's/--max-steps 200/--max-steps 240/' $J > jobs/_ddp_more.yaml
sed -e 's/^name: demo-ddp-gpu/name: demo-ddp-gpu-fail/' -e 's|demo-ddp-gpu/checkpoints|demo-ddp-gpu/ckpt-fail|' \
    -e 's/--save-interval 100/--save-interval 100 --exit-at-step 30 --exit-rank 1/' $J > jobs/_ddp_fail.yaml
if [ "${1:-}" = launcher ]; then
  L=jobs/demo-ddp-gpu-launcher.yaml
  {
    nvidia-smi -L
    D stage-model -H $HOST -j $L
    echo "=== 4: launcher: torchrun, nproc_per_node: auto (dfo wraps the command), FLA target, guard on"
    D launch -H $HOST -j $L --wait 3 --json
    D tail -H $HOST -j $L -n +0
    D status -H $HOST -j $L
  } 2>&1 | tee "$OUT/demo_ddp_launcher_h200x2.log"
  r=$(ls -td /workspace/.dfo/runs/demo-ddp-gpu-launcher-2* 2>/dev/null | head -1)
  [ -n "$r" ] && cp "$r/meta.json" "$OUT/launcher.meta.json" && { cat "$r"/autotune_guard.jsonl > "$OUT/launcher.guard.jsonl" 2>/dev/null || true; }
  exit 0
fi
{
  nvidia-smi -L
  D stage-model -H $HOST -j $J
  echo "=== 1: 2 ranks (torchrun --nproc_per_node gpu), FLA target, guard on, 200 steps"
  D launch -H $HOST -j $J --wait 3
  D tail -H $HOST -j $J -n +0
  echo "=== 2: the same checkpoint folder, max-steps 240: every rank resumes from rank 0's checkpoint"
  D launch -H $HOST -j jobs/_ddp_more.yaml --wait 3
  D tail -H $HOST -j jobs/_ddp_more.yaml -n +0
  echo "=== 3: rank 1 exits 1 at step 30"
  D launch -H $HOST -j jobs/_ddp_fail.yaml --wait 3
  D tail -H $HOST -j jobs/_ddp_fail.yaml -n +0
  D status -H $HOST
} 2>&1 | tee "$OUT/demo_ddp_h200x2.log"
python3 -m orchestrator.cli -i /tmp/inv.yaml status -H $HOST --json > "$OUT/status.json"
r=$(ls -td /workspace/.dfo/runs/demo-ddp-gpu-2* 2>/dev/null | head -1)
[ -n "$r" ] && cp "$r/meta.json" "$OUT/ddp.meta.json" && { cat "$r"/autotune_guard.jsonl > "$OUT/ddp.guard.jsonl" 2>/dev/null || true; }
