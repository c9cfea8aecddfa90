"""`dfo verify-env` on 1 testbed node against 8 at once: wall time (best of N), and what bounds it.

    python bench/fleet_bench.py [--nodes 8] [--repeat 3] [--out FILE]

The nodes are testbed nodes (real sshd, each in its own network and mount namespace) on this one
machine, so their own work (sshd's key exchange, the node's python3 start, the probe) runs on the
same CPU cores as the controller. Beside the wall time the bench reports the CPU seconds spent:
the controller's (dfo's process: Python start, imports, N SSH handshakes in threads) and the nodes'
(their sshd sessions, shells, python3 and the probe; read from the nodes' process trees, so other
work on this machine is not counted). With C cores, a run cannot take less than (both) / C: that is
the CPU/cores column; the extra CPU of N nodes over 1, spread over C cores, added to the 1-node
wall is what the N-node run takes with perfect overlap (printed beside the ratio).

Runs alternate (1, N, 1, N, ...) after one warm-up run on every node (first contact: host keys are
recorded, dfo's remote code is uploaded), so both sides see the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.bytecode import compile_trees  # noqa: E402
from orchestrator.testbed import Testbed  # noqa: E402
from orchestrator.testbed import system as tsys  # noqa: E402


def nodes_cpu(tb: Testbed) -> float:
    """CPU seconds the nodes' finished processes used so far: every SSH session (its sshd, the shell,
    python3 and the probe) ends within the call, and its time rolls up into the cutime/cstime of the
    node's long-lived processes (the sshd listener and its namespace wrapper). Other work on this
    machine is not counted (unlike /proc/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for st in tb._state.values():
        if st.proc is None:
            continue
        for pid in [st.proc.pid, *tsys.descendants(st.proc.pid)]:
            try:
                f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(f[13]) + int(f[14])  # cutime, cstime (fields 16, 17 of stat(5))
    return total / tick


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(tb: Testbed, inv: Path, hosts: list[str]) -> dict[str, float]:
    argv = [sys.executable, "-m", "orchestrator", "-i", str(inv), "verify-env", "--json"]
    for h in hosts:
        argv += ["-H", h]
    c0, n0, t0 = children_cpu(), nodes_cpu(tb), time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    time.sleep(0.3)  # the last sessions' sshd exit and are reaped
    c1, n1 = children_cpu(), nodes_cpu(tb)
    if r.returncode != 0:
        raise SystemExit(f"verify-env failed (exit {r.returncode}): {r.stderr[-2000:]}")
    doc = json.loads(r.stdout)
    assert sorted(doc["hosts"]) == sorted(hosts), doc
    return {"wall": wall, "controller_cpu": c1 - c0, "nodes_cpu": n1 - n0,
            "cpu": (c1 - c0) + (n1 - n0)}


def arrivals(inv: Path, hosts: list[str]) -> tuple[list[float], float]:
    """Human output (results print as each host is done): when each host's line arrived, and the exit,
    in seconds from the start."""
    argv = [sys.executable, "-m", "orchestrator", "-i", str(inv), "verify-env"]
    for h in hosts:
        argv += ["-H", h]
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                         stdin=subprocess.DEVNULL, env=dict(os.environ, COLUMNS="200"))
    assert p.stdout is not None
    seen = [time.monotonic() - t0 for line in p.stdout if any(line.startswith(f"{h}: ") for h in hosts)]
    p.wait()
    return seen, time.monotonic() - t0


def import_wall() -> float:
    """Wall seconds of a python that imports verify-env's command module and exits (dfo's start-up)."""
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "import orchestrator.commands.verify_env"], cwd=ROOT, check=True)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    a = ap.parse_args()
    compile_trees(ROOT)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="dfo-fleet-bench-") as tmp, \
            Testbed(Path(tmp) / "tb", nodes=a.nodes, s3=False) as tb:
        inv_doc = yaml.safe_load(tb.inventory_path.read_text())
        inv_doc["defaults"]["known_hosts"] = str(Path(tmp) / "known_hosts")
        inv = Path(tmp) / "inventory.yaml"
        inv.write_text(yaml.safe_dump(inv_doc))
        names = [n.name for n in tb.nodes]
        run_once(tb, inv, names)  # warm-up: host keys, the remote code on every node
        rows: dict[str, list[dict[str, float]]] = {"1": [], str(a.nodes): []}
        for _ in range(a.repeat):
            rows["1"].append(run_once(tb, inv, names[:1]))
            rows[str(a.nodes)].append(run_once(tb, inv, names))
        seen1, end1 = arrivals(inv, names[:1])
        seen, end = arrivals(inv, names)
    start = min(import_wall() for _ in range(a.repeat))
    best = {k: min(v, key=lambda r: r["wall"]) for k, v in rows.items()}
    one, many = best["1"], best[str(a.nodes)]
    print(f"machine: {cores} cores; testbed: {'namespaces' if tb.isolated else 'loopback'}; best of {a.repeat}")
    print(f"{'hosts':>5} {'wall s':>8} {'dfo CPU s':>10} {'nodes CPU s':>12} {'CPU/cores s':>12}  all walls")
    for k, r in best.items():
        walls = ", ".join(f"{x['wall']:.2f}" for x in rows[k])
        print(f"{k:>5} {r['wall']:8.2f} {r['controller_cpu']:10.2f} {r['nodes_cpu']:12.2f} "
              f"{r['cpu'] / cores:12.2f}  {walls}")
    extra = many["cpu"] - one["cpu"]
    bound = one["wall"] + extra / cores
    print(f"ratio {a.nodes} nodes / 1 node: {many['wall'] / one['wall']:.2f}x (best walls)")
    print(f"what bounds it: the {a.nodes - 1} more nodes cost {extra:.2f} CPU s more (dfo "
          f"{many['controller_cpu'] - one['controller_cpu']:+.2f}, nodes {many['nodes_cpu'] - one['nodes_cpu']:+.2f}); "
          f"spread over all {cores} cores that is +{extra / cores:.2f} s: with perfect overlap the {a.nodes}-node run "
          f"takes about {bound:.2f} s = {bound / one['wall']:.2f}x of the 1-node wall on this machine")
    print(f"per node: {many['nodes_cpu'] / a.nodes:.2f} CPU s on the node (sshd, python3, the probe); dfo's own "
          f"process: {one['controller_cpu']:.2f} CPU s for 1 host, {many['controller_cpu']:.2f} for {a.nodes}")
    print(f"dfo's start-up (python + imports, best of {a.repeat}): {start:.2f} s")
    print(f"one human-output run: 1 node: its result at {seen1[0]:.2f} s, exit at {end1:.2f} s; {a.nodes} nodes: "
          f"results at {', '.join(f'{x:.2f}' for x in seen)} s, exit at {end:.2f} s")
    if a.out:
        a.out.write_text(json.dumps({"cores": cores, "runs": rows, "best": best, "startup": start,
                                     "arrivals": {"1": seen1, str(a.nodes): seen}}, indent=2) + "\n")


if __name__ == "__main__":
    main()
