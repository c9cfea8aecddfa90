"""One run of the GPU health gate's node module, as dfo runs it, on this machine: its result into a JSON
file and a summary on stdout (the verdict, every check that did not pass, the figures, the time).

    python3 bench/gpu/health_bench.py OUT.json [REQUEST_JSON]     (with PYTHONPATH at the checkout)

Environment variables (CUDA_VISIBLE_DEVICES...) pass through to the gate as they would from a login shell.
Run on a GPU machine by bench/gpu/health_device.sh.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    out = argv[1]
    request = argv[2] if len(argv) > 2 else "{}"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "remote.gpu.health"], input=request + "\n", capture_output=True,
                       text=True, timeout=700)
    wall = time.monotonic() - t0
    result = None
    for line in r.stdout.splitlines():
        if line.startswith("@@DFO-RESULT@@ "):
            result = json.loads(line.split(" ", 1)[1])
    doc = {"request": json.loads(request), "wall_s": round(wall, 2), "exit": r.returncode, "result": result,
           "stderr_tail": r.stderr[-2000:]}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    if not result or not result.get("ok"):
        print("NO RESULT", r.returncode, (result or {}).get("error"), r.stderr[-1500:])
        return 1
    d = result["data"]
    print(f"gate: ok={d['ok']} seconds={d['seconds']:.1f} (wall {wall:.1f}) phases={d['phases']}")
    for c in d["checks"]:
        if c["verdict"] != "pass" or c.get("unit"):
            print(f"  {c['verdict']:<5} {c['check']:<20} {c['message']}")
    for g in d["gpus"]:
        print(f"  gpu {g['index']} {g['name']} model={g.get('model')} figures={g.get('figures')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
