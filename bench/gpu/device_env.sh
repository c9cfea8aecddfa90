# Sourced by the bench/gpu/*.sh scripts that drive dfo on the GPU box itself (transport: local):
# dfo's dependencies (carried wheels, .whl-dfo) into /tmp/site, FLA (carried wheels, .whl) into the
# trainer's environment, the demo model and token shards under /root/demo-src, an inventory with one
# local host named $HOST, and D: run a dfo command and print it with its exit status.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-dfo/*.whl
python3 -m pip install -q --no-index --no-deps .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD COLUMNS=160
python3 -c "from pathlib import Path; from orchestrator.demo.data import write_model, write_data; \
print(write_model(Path('/root/demo-src/model'), d=256, heads=4), write_data(Path('/root/demo-src/data')))"
printf 'defaults: {known_hosts: /tmp/kh}\nhosts:\n  %s: {transport: local}\n' "$HOST" > /tmp/inv.yaml
D() { echo "\$ dfo $*"; python3 -m orchestrator.cli -i /tmp/inv.yaml "$@"; echo "# exit status $?"; }
# job variants: no guard (and no warmup), guard without warmup; each with its own checkpoint folder
sed -e 's/autotune_guard: true/autotune_guard: false/' -e 's/ --warmup//' -e 's/^name: demo-gpu/name: demo-gpu-noguard/' \
  -e 's|demo-gpu/checkpoints|demo-gpu/checkpoints-noguard|' jobs/demo-gpu.yaml > jobs/_noguard.yaml
sed -e 's/ --warmup//' -e 's/^name: demo-gpu/name: demo-gpu-guard/' -e 's|demo-gpu/checkpoints|demo-gpu/checkpoints-guard|' \
  jobs/demo-gpu.yaml > jobs/_guard.yaml
