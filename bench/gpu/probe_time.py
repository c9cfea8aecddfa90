"""verify-env's node probe (remote.env.probe) timed on a GPU node: an old tree's against this one's.

    python3 bench/gpu/probe_time.py [OLD_ROOT]

OLD_ROOT (default .probe-old/ in the repository, an ignored folder the device call carries) holds the
old tree's remote/; it runs as `python3 -S -m remote.env.probe`, this tree's as the controller starts it now
(`-c 'from remote.env.probe import entry; entry()'`). One warm-up round (it writes the bytecode, as a node's
first call does), then 8 alternating rounds; prints each side's GPU data, best and median wall, and the
cost of a plain nvidia-smi and of its query. Figures: bench/results/gpu/probe-h200/.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    old = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".probe-old")
    trees = {"before": (old, ["-m", "remote.env.probe"]),
             "after": (ROOT, ["-c", "from remote.env.probe import entry; entry()"])}
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    print("python", py, subprocess.run([py, "-V"], capture_output=True, text=True).stdout.strip())
    res: dict[str, list[float]] = {k: [] for k in trees}
    for rnd in range(9):
        for name, (d, how) in trees.items():
            env = dict(os.environ, PYTHONPATH=d, PYTHONDONTWRITEBYTECODE="1", DFO_NODE_PYC="1")
            t0 = time.perf_counter()
            r = subprocess.run([py, "-S", *how], input=b"{}", capture_output=True, cwd=d, env=env)
            dt = time.perf_counter() - t0
            out = r.stdout.decode()
            doc = json.loads(out.split("@@DFO-RESULT@@ ", 1)[1]) if "@@DFO-RESULT@@" in out else None
            if rnd == 0:
                gpu = json.dumps((doc or {}).get("data", {}).get("nvidia"))[:400]
                print(name, "ok" if doc and doc.get("ok") else "FAILED", gpu, r.stderr.decode()[-300:])
                continue
            res[name].append(dt)
    for k, v in res.items():
        walls = ", ".join(f"{x * 1000:.0f}" for x in v)
        print(f"{k}: best {min(v) * 1000:.1f} ms, median {statistics.median(v) * 1000:.1f} ms, all {walls}")
    best = min(res["after"]) / min(res["before"])
    med = statistics.median(res["after"]) / statistics.median(res["before"])
    print(f"after / before: best {best:.2f}x, median {med:.2f}x")
    t0 = time.perf_counter()
    subprocess.run(["nvidia-smi"], capture_output=True)
    a = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,compute_cap,driver_version",
                    "--format=csv,noheader,nounits"], capture_output=True)
    b = time.perf_counter() - t0
    print(f"nvidia-smi alone: {a * 1000:.0f} ms; its query: {b * 1000:.0f} ms")


if __name__ == "__main__":
    main()
