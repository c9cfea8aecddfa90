#!/bin/bash
# Records real nvidia-smi output on a GPU node for tests/data/ (the fake nvidia-smi replays it) and
# bench/results/gpu/. Run on the device: `bash bench/gpu_record_smi.sh` with $OUT set (the `run` tool).
# Samples idle, then under a ~30 s bf16 matmul load, then idle again; also times what one query costs.
O=${OUT:-/tmp/smi-out}; mkdir -p "$O"
F=index,uuid,name,pci.bus_id,utilization.gpu,utilization.memory,memory.used,memory.total,power.draw,power.limit
F=$F,temperature.gpu,clocks.sm,clocks.mem,clocks.max.sm,ecc.errors.uncorrected.volatile.total
F=$F,clocks_event_reasons.active
{ nvidia-smi; nvidia-smi --version; python3 -V; nproc; cat /proc/loadavg; uname -r
  echo "--- dmesg xid"; dmesg 2>&1 | grep -i -m5 xid; echo "rc=$?"; } > "$O/env.txt" 2>&1
nvidia-smi --help-query-gpu > "$O/help-query-gpu.txt" 2>&1
nvidia-smi --query-gpu=$F --format=csv > "$O/query-header.csv" 2>&1
sample() { echo "# $1 $(date +%s.%N)" >> "$O/query-samples.txt"
  nvidia-smi --query-gpu=$F --format=csv,noheader,nounits >> "$O/query-samples.txt" 2>&1; }
for i in 1 2 3; do sample idle; sleep 1; done
nvidia-smi -q -d CLOCK,PERFORMANCE,ECC,POWER,TEMPERATURE,MEMORY,UTILIZATION > "$O/smi-q-idle.txt" 2>&1
python3 - <<'PY' &
import time, torch
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)
t = time.time()
while time.time() - t < 30:
    for _ in range(50): c = a @ b
    torch.cuda.synchronize()
PY
LOAD=$!
sleep 4
for i in $(seq 1 10); do sample load; sleep 2; done
nvidia-smi -q -d CLOCK,PERFORMANCE,ECC,POWER,TEMPERATURE,MEMORY,UTILIZATION > "$O/smi-q-load.txt" 2>&1
wait $LOAD
for i in 1 2 3; do sample after; sleep 1; done
python3 - "$F" >> "$O/env.txt" 2>&1 <<'PY'
import resource, subprocess, sys, time
fields = sys.argv[1]
r0 = resource.getrusage(resource.RUSAGE_CHILDREN); t0 = time.time()
for _ in range(20):
    subprocess.run(['nvidia-smi', '--query-gpu=' + fields, '--format=csv,noheader,nounits'], stdout=subprocess.DEVNULL)
r1 = resource.getrusage(resource.RUSAGE_CHILDREN); t1 = time.time()
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print('--- one nvidia-smi query: cpu %.4f s, wall %.4f s (mean of 20)' % (cpu / 20, (t1 - t0) / 20))
PY
