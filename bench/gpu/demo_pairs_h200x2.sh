#!/usr/bin/env bash
# The demo trainer's pairs mode (--dp-pairs, the seed run's shape) on nvidia-h200-x2, through dfo
# (transport: local). Each launch gets its own empty TRITON_CACHE_DIR (cold compile and autotune).
#   A1: 1 pair (target cuda:0, drafter cuda:1), no guard, no warmup: one target thread only.
#   A2: 2 pairs sharing the 2 GPUs (both targets on cuda:0, both drafters on cuda:1), no guard,
#       no warmup: two target threads, as in the seed; run 3 times.
#   B1: 1 pair, guard + sequential warmup, 200 steps.   B2: 2 pairs on 2 GPUs, guard + warmup, 200 steps.
# Run from the repo root on the device (carry .whl .whl-dfo): bash bench/gpu/demo_pairs_h200x2.sh
set -u
HOST=h200x2; . bench/gpu/device_env.sh
J=jobs/demo-gpu-pairs.yaml
D() { echo "\$ dfo $*"; timeout 300 python3 -m orchestrator.cli -i /tmp/inv.yaml "$@"; echo "# exit status $?"; }  # no step hangs the call
variant() {  # variant NAME PAIRS GUARD(true|false) WARMUP(1|0) -> jobs/_NAME.yaml
  local w=' --warmup'; [ "$4" = 1 ] || w=''
  sed -e "s/^name: demo-gpu-pairs/name: $1/" -e "s/--dp-pairs 2 --warmup/--dp-pairs $2$w/" \
      -e "s/autotune_guard: true/autotune_guard: $3/" -e "s|demo-gpu-pairs/checkpoints|demo-gpu-pairs/ckpt-$1|" \
      -e "s|FLA_CACHE_MODE: disabled|FLA_CACHE_MODE: disabled\n    TRITON_CACHE_DIR: /tmp/triton-$1|" "$J" > "jobs/_$1.yaml"
}
variant p1-noguard 1 false 0; variant p1-guard-warm 1 true 1; variant p2-guard-warm 2 true 1
for k in 1 2 3; do variant p2-noguard-$k 2 false 0; done
{
  nvidia-smi -L
  D stage-model -H $HOST -j $J
  echo "=== A1: 1 pair on cuda:0 + cuda:1, NO guard, no warmup, cold caches"
  D launch -H $HOST -j jobs/_p1-noguard.yaml --wait 60
  D tail -H $HOST -j jobs/_p1-noguard.yaml -n +0
  for k in 1 2 3; do
    echo "=== A2 #$k: 2 pairs sharing cuda:0/cuda:1 (two target threads on cuda:0), NO guard, no warmup, cold caches"
    D launch -H $HOST -j jobs/_p2-noguard-$k.yaml --wait 150
  done
  echo "=== B1: 1 pair, guard + sequential warmup, 200 steps"
  D launch -H $HOST -j jobs/_p1-guard-warm.yaml --wait 3
  D tail -H $HOST -j jobs/_p1-guard-warm.yaml -n +0
  echo "=== B2: 2 pairs sharing 2 GPUs, guard + sequential warmup, 200 steps"
  D launch -H $HOST -j jobs/_p2-guard-warm.yaml --wait 3
  D tail -H $HOST -j jobs/_p2-guard-warm.yaml -n +0
  D status -H $HOST
} 2>&1 | tee "$OUT/demo_pairs_h200x2.log"
python3 -m orchestrator.cli -i /tmp/inv.yaml status -H $HOST --json > "$OUT/status.json"
for j in p1-noguard p1-guard-warm p2-guard-warm; do
  r=$(ls -td /workspace/.dfo/runs/$j-* 2>/dev/null | head -1)
  [ -n "$r" ] && cp "$r/meta.json" "$OUT/$j.meta.json" && { cat "$r"/autotune_guard.jsonl > "$OUT/$j.guard.jsonl" 2>/dev/null || true; }
done
