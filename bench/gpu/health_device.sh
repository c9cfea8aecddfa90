#!/usr/bin/env bash
# The GPU health gate on a GPU machine (issue 34): captures of nvidia-smi and the kernel log for tests/data,
# the gate on a healthy GPU (3 runs: figures, time), three faults made with processes only (another tenant's
# matmuls, a process holding 90% of the memory, CUDA_VISIBLE_DEVICES hiding the GPUs), the quick gate
# (measure: false), dfo itself (verify-env --health, up and launch with run.health, transport: local), and
# the GPU tests. No clock, power limit or MIG setting is touched.
# Run from the repo root on the device: bash bench/gpu/health_device.sh  (carry: .whl-dfo; writes ${OUT:-/tmp/out})
set -u
O=${OUT:-/tmp/out}; W=/tmp/hw; rm -rf $W; mkdir -p "$O" $W/cap $W/runs $W/dfo
export PYTHONUNBUFFERED=1 COLUMNS=160
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-dfo/*.whl
export PYTHONPATH=/tmp/site:$PWD
LOG=$W/log.txt
say() { echo "### $* ($(date +%T))" | tee -a $LOG; }
T() { local t0=$(date +%s.%N); "$@"; local rc=$?; echo "# exit $rc, $(python3 -c "import time;print('%.2f'%(time.time()-$(printf %s "$t0")))") s: $*"; return $rc; }
fault() {  # start a fault process, wait for "ready"
  python3 bench/gpu/health_faults.py "$@" > $W/fault.out 2>&1 & FP=$!
  for i in $(seq 1 120); do grep -q ready $W/fault.out && break; sleep 0.25; done; cat $W/fault.out | tee -a $LOG; sleep 2
}
cap() {  # nvidia-smi as the gate reads it, and as people read it
  nvidia-smi -q -x > $W/cap/$1-q.xml 2>&1; nvidia-smi -q > $W/cap/$1-q.txt 2>&1
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > $W/cap/$1-compute-apps.csv 2>&1
  nvidia-smi --query-gpu=index,name,pci.bus_id,memory.used,memory.total,utilization.gpu,pcie.link.gen.gpucurrent,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max,power.limit,power.default_limit,clocks_event_reasons.active --format=csv > $W/cap/$1-query.csv 2>&1
}
{
say environment
nvidia-smi; nvidia-smi -L; python3 -V; python3 -c "import torch; print('torch', torch.__version__, torch.cuda.device_count())"
nproc; uname -r; cat /proc/loadavg
say captures, idle
T cap idle
T nvidia-smi topo -m > $W/cap/topo-m.txt 2>&1; T nvidia-smi nvlink -s > $W/cap/nvlink-s.txt 2>&1
T dmesg > $W/cap/dmesg.txt 2>&1; echo "dmesg rc=$?"; (journalctl -k -q --no-pager -o short > $W/cap/journalctl-k.txt 2>&1; echo "journalctl rc=$?")
ls -la /var/log/kern.log 2>&1; grep -c NVRM $W/cap/dmesg.txt
for i in 1 2 3; do say healthy gate $i; T python3 bench/gpu/health_bench.py $W/runs/healthy-$i.json; done
say quick gate, measure false; T python3 bench/gpu/health_bench.py $W/runs/quick.json '{"measure": false}'
say fault 1: another tenant running bf16 matmuls
fault matmul; cap tenant; T python3 bench/gpu/health_bench.py $W/runs/tenant.json; kill $FP; wait $FP 2>/dev/null
say fault 2: a process holding 90% of the memory
fault hold 0.9; cap hog; T python3 bench/gpu/health_bench.py $W/runs/hog.json; kill $FP; wait $FP 2>/dev/null
say fault 3: CUDA_VISIBLE_DEVICES hides the GPUs
CUDA_VISIBLE_DEVICES= T python3 bench/gpu/health_bench.py $W/runs/hidden.json
say dfo itself, transport local
printf 'defaults: {known_hosts: /tmp/kh}\nhosts:\n  gpu: {transport: local, gpus: %s}\n' "$(nvidia-smi -L | grep -c ^GPU)" > /tmp/inv.yaml
cat > jobs/_health.yaml <<'EOF'
name: health-gate
venv: /opt/torch/.venv
run:
  workdir: /tmp/health-run
  command: >-
    {python} -c "import torch; print('trainer sees', torch.cuda.device_count(), 'GPU(s)')"
  wait: 3
  health: {min_fraction: 0.8}
EOF
sed -e 's/^name: health-gate/name: health-hidden/' -e 's/^  wait: 3/  wait: 3\n  env: {CUDA_VISIBLE_DEVICES: ""}/' jobs/_health.yaml > jobs/_health_hidden.yaml
D() { echo "\$ dfo $*"; python3 -m orchestrator.cli -i /tmp/inv.yaml "$@"; echo "# exit status $?"; }
T D verify-env -H gpu --health
python3 -m orchestrator.cli -i /tmp/inv.yaml verify-env -H gpu -j jobs/_health.yaml --health --json > $W/dfo/verify-env-health.json; echo "# exit $?"
T D up -H gpu -j jobs/_health.yaml
fault hold 0.9; T D up -H gpu -j jobs/_health.yaml; kill $FP; wait $FP 2>/dev/null
T D launch -H gpu -j jobs/_health_hidden.yaml
say GPU tests
T python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_gpu_health.py 2>&1 | tail -15
} 2>&1 | tee -a $W/log.txt
cp $W/log.txt "$O/log.txt"
tar -C $W -czf "$O/health.tar.gz" cap runs dfo log.txt
ls -la "$O"
