"""What one `dfo exec -- sleep S` costs the laptop per host (issue 35): peak descriptors, threads, memory (RSS)
of dfo's process, and its ssh processes, sampled every 50 ms while it runs on N testbed nodes, cold (first
contact: host keys, dfo's node code uploaded) and warm (shared connections up).

    python bench/fleet_cost.py [--sizes 16,64,128] [--out bench/results/fleet_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from orchestrator.testbed import Testbed  # noqa: E402
from orchestrator.testbed import system as tsys  # noqa: E402


def sample(pid: int) -> dict[str, int]:
    out = {"fds": 0, "threads": 0, "rss_kb": 0, "ssh": 0}
    try:
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                out["threads"] = int(line.split()[1])
            elif line.startswith("VmRSS:"):
                out["rss_kb"] = int(line.split()[1])
    except OSError:
        pass
    out["ssh"] = sum(1 for p in tsys.descendants(pid) if tsys.comm(p) == "ssh")
    return out


def run(inv: Path, group: str, seconds: float) -> dict[str, float]:
    argv = [sys.executable, "-m", "orchestrator", "-i", str(inv), "exec", "-H", group, "--", "sleep", str(seconds)]
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         stdin=subprocess.DEVNULL)
    peak = {"fds": 0, "threads": 0, "rss_kb": 0, "ssh": 0}
    while p.poll() is None:
        s = sample(p.pid)
        peak = {k: max(peak[k], s[k]) for k in peak}
        time.sleep(0.05)
    err = p.stderr.read() if p.stderr else ""
    if p.returncode != 0:
        raise SystemExit(f"exec failed (exit {p.returncode}): {err[-1500:]}")
    return {**peak, "wall": round(time.monotonic() - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,128")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dfo-cost-") as tmp, Testbed(Path(tmp) / "tb", nodes=max(sizes),
                                                                           s3=False) as tb:
        doc = yaml.safe_load(tb.inventory_path.read_text())
        doc["defaults"]["known_hosts"] = str(Path(tmp) / "kh")
        names = [n.name for n in tb.nodes]
        doc["groups"] = {f"g{s}": names[:s] for s in sizes}
        inv = Path(tmp) / "inv.yaml"
        inv.write_text(yaml.safe_dump(doc))
        for s in sizes:
            cold = run(inv, f"g{s}", a.seconds)
            warm = run(inv, f"g{s}", a.seconds)
            for mode, r in (("cold", cold), ("warm", warm)):
                row = {"hosts": s, "mode": mode, **r}
                rows.append(row)
                print(f"N={s:<4} {mode}: wall {r['wall']:.2f}s  fds {r['fds']} ({r['fds'] / s:.2f}/host)  threads "
                      f"{r['threads']} ({r['threads'] / s:.2f}/host)  RSS {r['rss_kb'] / 1024:.0f} MiB "
                      f"({r['rss_kb'] / 1024 / s:.2f} MiB/host)  ssh processes {r['ssh']}", flush=True)
    if a.out:
        a.out.write_text(json.dumps({"rows": rows, "cores": os.cpu_count()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
