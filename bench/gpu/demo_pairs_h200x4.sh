#!/usr/bin/env bash
# Issue 14 on nvidia-h200-x4: the seed run's shape, 2 data-parallel pairs over 4 GPUs (pair 0: target
# cuda:0, drafter cuda:1; pair 1: target cuda:2, drafter cuda:3), the pairs' steps in threads, through
# dfo (transport: local). Each launch gets its own empty TRITON_CACHE_DIR (cold compile and autotune).
#   verify: dfo verify-env --gpu on every GPU (exit 3 expected on Hopper with triton 3.6.0: FLA #640)
#   race:   2 pairs, NO guard, no warmup, cold caches, 3 times: launch should diagnose the race (exit 5)
#   guard:  2 pairs, guard without warmup, 200 steps; then guard + sequential warmup, 200 steps
#   ddp:    the trainer under torchrun, one process per GPU (4, NCCL), guard on (jobs/demo-ddp-gpu.yaml)
# Run from the repo root on the device (carry .whl .whl-dfo), all parts or some, each part ~3-4 min:
#   bash bench/gpu/demo_pairs_h200x4.sh                 # = verify race guard
#   bash bench/gpu/demo_pairs_h200x4.sh verify guard
set -u
HOST=h200x4; . bench/gpu/device_env.sh
J=jobs/demo-gpu-pairs.yaml
D() { echo "\$ dfo $*"; timeout 300 python3 -m orchestrator.cli -i /tmp/inv.yaml "$@"; echo "# exit status $?"; }
variant() {  # variant NAME GUARD(true|false) WARMUP(1|0) -> jobs/_NAME.yaml, 2 pairs
  local w=' --warmup'; [ "$3" = 1 ] || w=''
  sed -e "s/^name: demo-gpu-pairs/name: $1/" -e "s/--dp-pairs 2 --warmup/--dp-pairs 2$w/" \
      -e "s/autotune_guard: true/autotune_guard: $2/" -e "s|demo-gpu-pairs/checkpoints|demo-gpu-pairs/ckpt-$1|" \
      -e "s|FLA_CACHE_MODE: disabled|FLA_CACHE_MODE: disabled\n    TRITON_CACHE_DIR: /tmp/triton-$1|" "$J" > "jobs/_$1.yaml"
}
PARTS=${*:-verify race guard}
{
  nvidia-smi -L
  n=$(nvidia-smi -L | wc -l); [ "$n" -ge 4 ] || echo "WARNING: $n GPUs: the 2 pairs share devices; this is not the 4-GPU run"
  D stage-model -H $HOST -j $J
  for part in $PARTS; do case $part in
  verify)
    echo "=== 1: verify-env --gpu on every GPU"
    D verify-env -H $HOST -j $J --gpu
    python3 -m orchestrator.cli -i /tmp/inv.yaml verify-env -H $HOST -j $J --gpu --json > "$OUT/verify_env_gpu.json" ;;
  race)
    for k in 1 2 3; do
      variant p2-noguard-$k false 0
      echo "=== 2 #$k: 2 pairs in threads, NO guard, no warmup, cold caches (expect exit 5, the race)"
      D launch -H $HOST -j jobs/_p2-noguard-$k.yaml --wait 150
      D tail -H $HOST -j jobs/_p2-noguard-$k.yaml --no-follow -n 3
    done ;;
  guard)
    variant p2-guard true 0; variant p2-guard-warm true 1
    for j in p2-guard p2-guard-warm; do
      echo "=== 3: $j: 200 steps"
      D launch -H $HOST -j jobs/_$j.yaml --wait 3
      D tail -H $HOST -j jobs/_$j.yaml -n +0
    done ;;
  ddp)
    echo "=== 4: the trainer under torchrun, one process per GPU, 200 steps"
    D stage-model -H $HOST -j jobs/demo-ddp-gpu.yaml
    D launch -H $HOST -j jobs/demo-ddp-gpu.yaml --wait 3
    D tail -H $HOST -j jobs/demo-ddp-gpu.yaml -n +0 ;;
  *) echo "unknown part $part (verify, race, guard, ddp)"; exit 2 ;;
  esac; done
  D status -H $HOST
} 2>&1 | tee "$OUT/demo_pairs_h200x4.log"
python3 -m orchestrator.cli -i /tmp/inv.yaml status -H $HOST --json > "$OUT/status.json"
for j in p2-guard p2-guard-warm; do
  r=$(ls -td /workspace/.dfo/runs/$j-2* 2>/dev/null | head -1)
  [ -n "$r" ] && cp "$r/meta.json" "$OUT/$j.meta.json" && { cat "$r"/autotune_guard.jsonl > "$OUT/$j.guard.jsonl" 2>/dev/null || true; }
done
