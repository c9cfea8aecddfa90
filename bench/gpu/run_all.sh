#!/usr/bin/env bash
# Everything GPU-side in one device call: environment, preflight, reproducers, overhead, GPU tests.
#
#   bash bench/gpu/run_all.sh            # from the repo root; writes to $OUT (default ./out-gpu)
#
# FLA wheels in .whl/ (fla-core, flash-linear-attention) are installed to /tmp/site first when
# present. Each step has its own timeout and the whole run a deadline (RUN_ALL_BUDGET seconds,
# default 570) so that the outputs come back even if one step hangs. At most 8 files land in $OUT
# (the device tool returns no more): log.txt, env.txt, preflight.json, race.jsonl,
# fla_race.jsonl, overhead.jsonl, pytest.txt, guard_log.jsonl.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/out-gpu}
mkdir -p "$OUT"
BUDGET=${RUN_ALL_BUDGET:-570}
DEADLINE=$(( $(date +%s) + BUDGET ))
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

step() {  # step NAME MAX_SECONDS CMD...: run CMD with min(MAX, time left - 15 s), log the outcome
    local name=$1 max=$2; shift 2
    local left=$(( DEADLINE - $(date +%s) - 15 ))
    local lim=$(( max < left ? max : left ))
    if (( lim < 20 )); then echo "=== SKIP $name (deadline: ${left}s left)"; return 0; fi
    echo "=== STEP $name (limit ${lim}s) $(date -u +%H:%M:%S)"
    echo "+ $*"
    local t0=$(date +%s)
    timeout -k 5 "$lim" "$@"
    local rc=$?
    echo "=== END $name rc=$rc $(( $(date +%s) - t0 ))s"
}

main() {
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# One fresh Triton compile cache for the whole run: the autotune results are never on disk
# (TRITON_CACHE_AUTOTUNING=0, FLA_CACHE_RESULTS=0), so every trial tunes; compiled kernels are
# shared between steps to save lease time.
export TRITON_CACHE_DIR=$(mktemp -d /tmp/dfo-triton-XXXXXX)
export TRITON_CACHE_AUTOTUNING=0 FLA_CACHE_RESULTS=0 FLA_CACHE_MODE=disabled

{
    date -u; uname -a; nvidia-smi; python3 -V; which python3
    python3 -m pip list 2>/dev/null | grep -i -E '^(torch|triton|transformers|einops|fla-core|flash-linear-attention|tilelang) '
    python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_arch_list())'
    python3 -c 'import fla; print("fla", fla.__version__)'
    echo "TRITON_CACHE_DIR=$TRITON_CACHE_DIR"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

step preflight 240 bash -c 'echo "{}" | python3 -m remote.gpu.preflight > /tmp/preflight.out; rc=$?; cat /tmp/preflight.out; grep "^@@DFO-RESULT@@ " /tmp/preflight.out | sed "s/^@@DFO-RESULT@@ //" > "$0/preflight.json"; exit $rc' "$OUT"

R="python3 bench/gpu/autotune_race.py --json $OUT/race.jsonl"
step race-noguard-det 90 $R --no-guard --trials 20 --scenarios crash,foreign
step race-noguard-real 60 $R --no-guard --trials 20 --scenarios realistic
step race-guard-det 150 $R --guard --trials 200 --scenarios crash,foreign
step race-guard-real 90 $R --guard --trials 50 --scenarios realistic
# The launch integration: the guard comes from the sitecustomize on PYTHONPATH, not the script.
step race-sitecustomize 90 env PYTHONPATH="$PWD/remote/gpu/sitecustomize_guard:${PYTHONPATH:-}" \
    DFO_AUTOTUNE_GUARD_LOG="$OUT/guard_log.jsonl" $R --no-guard --trials 50 --scenarios crash,foreign

F="python3 bench/gpu/fla_race.py --json $OUT/fla_race.jsonl"
step fla-op-noguard 150 $F --mode op --no-guard --trials 6 --time-budget 60
step fla-op-guard 150 $F --mode op --guard --trials 6 --time-budget 60

step overhead 150 python3 bench/gpu/guard_overhead.py --json "$OUT/overhead.jsonl"

# --noconftest: tests/conftest.py imports the controller (fabric, pydantic), absent on a GPU node
step pytest-gpu 150 bash -c 'python3 -m pytest -p no:cacheprovider --noconftest -m gpu tests/test_gpu.py -q -rA > "$0/pytest.txt" 2>&1; rc=$?; tail -40 "$0/pytest.txt"; exit $rc' "$OUT"

step fla-layer-noguard 120 $F --mode layer --no-guard --trials 4 --time-budget 45
step fla-layer-guard 120 $F --mode layer --guard --trials 4 --time-budget 45

echo "=== DONE $(date -u +%H:%M:%S); triton cache $(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
}

main 2>&1 | tee -a "$OUT/log.txt"
