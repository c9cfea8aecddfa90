"""The run queue (issue 36) on the testbed: how long `dfo submit` takes, and how soon a queued run starts
after the run before it ends, with no dfo running anywhere.

    python bench/queue_bench.py [--submits 10] [--chain 10] [--out FILE]

A fresh 2-node testbed (real sshd nodes in network namespaces), each node 4 GPUs by the inventory's
``gpus:`` (the testbed has none). Printed:

* submit latency: the wall time of `dfo submit` as a user runs it (a new process each time), for
  ``-H node-1`` (one host: the submit goes straight there) and ``-H testbed`` (two hosts: both queues are
  looked at first, then the submit), each with the default shared connection (``ssh_persist: 60``, the
  second submit on reuses it) and with none (``ssh_persist: 0``: every submit makes its own SSH
  connections); the job pushes a small code: tree and uploads nothing. The clock runs from the process's
  start to its exit. Beside them, timed the same way: `dfo status -H node-1` (the floor of any dfo
  command that asks a node something) and `dfo launch -H node-1 --wait 0` (the same job started at once).
  One call of each series in turn, ``--submits`` rounds, after one untimed round (first contact).
* end to next start: ``--chain`` runs of 4 GPUs each (a whole node) submitted at once, so each waits for
  the one before; each prints ``time.time()`` as its first and last lines and exits 0.3 s later. Gap 1: the
  node's records, end.json's ``ended_ts`` (the supervisor saw its trainer end) to the next run's meta.json
  ``started_ts`` (its trainer has a pid); gap 2: the trainers' own stamps, the last line of one to the first
  line of the next (everything between: the trainer's exit, its supervisor's end record, the queue's lock,
  the GPUs' count, a new supervisor, bash, python's start). Both clocks are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.testbed import Testbed  # noqa: E402

TRAINER = """\
import sys, time
print("start %.6f" % time.time(), flush=True)
time.sleep(float(sys.argv[1]))
print("end %.6f" % time.time(), flush=True)
time.sleep(0.3)
"""


def dfo(inv: Path, env: dict[str, str], *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(inv), *args], capture_output=True,
                       text=True, env=env, cwd=ROOT, timeout=300)
    return time.perf_counter() - t0, r


def inventory(tb: Testbed, tmp: Path, persist: float) -> Path:
    inv = yaml.safe_load(Path(tb.inventory_path).read_text())
    inv["defaults"].update(ssh_persist=persist)
    for h in inv["hosts"].values():
        h["gpus"] = 4
    p = tmp / f"inventory-{persist:g}.yaml"
    p.write_text(yaml.safe_dump(inv))
    return p


def job(tmp: Path, name: str, gpus: int, hold: float) -> Path:
    code = tmp / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text(TRAINER)
    for i in range(2):
        (code / f"util{i}.py").write_text(f"X = {i}\n" * 50)
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump({"name": name, "venv": "/usr", "code": {"source": str(code)},
                                 "run": {"workdir": f"/root/{name}", "gpus": gpus, "wait": 0,
                                         "command": f"python3 train.py {hold}"}}))
    return p


def stats(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "best": round(min(xs), 3), "median": round(statistics.median(xs), 3),
            "worst": round(max(xs), 3)}


def submits(tb: Testbed, tmp: Path, env: dict[str, str], n: int) -> dict[str, Any]:
    """Every series one call at a time, in turn (round-robin), so that a load that changes while the bench
    runs weighs on all of them alike."""
    one = job(tmp, "bench-submit", 1, 0.1)
    series: list[tuple[str, Path, tuple[str, ...]]] = []
    for persist in (60.0, 0.0):
        inv = inventory(tb, tmp, persist)
        for hosts in ("node-1", "testbed"):
            series.append((f"submit -H {hosts}, ssh_persist {persist:g}", inv, ("submit", "-H", hosts, "-j", str(one))))
        series.append((f"reference: status -H node-1, ssh_persist {persist:g}", inv,
                       ("status", "-H", "node-1", "--limit", "1")))
        series.append((f"reference: launch -H node-1 --wait 0, ssh_persist {persist:g}", inv,
                       ("launch", "-H", "node-1", "-j", str(one), "--wait", "0", "--force")))
    for _, inv, args in series:  # first contact (host keys, dfo's node code) is not what is timed
        dfo(inv, env, *args)
    time.sleep(1.5)
    times: dict[str, list[float]] = {label: [] for label, _, _ in series}
    for _ in range(n):
        for label, inv, args in series:
            secs, r = dfo(inv, env, *args)
            if r.returncode != 0:
                raise SystemExit(f"{label} failed: {r.stderr}")
            times[label].append(secs)
            if args[0] == "launch":
                time.sleep(0.6)  # a launched run holds every GPU while it runs (0.4 s): the next submit finds them free
    return {label: stats(xs) for label, xs in times.items()}


def chain(tb: Testbed, tmp: Path, env: dict[str, str], n: int) -> dict[str, Any]:
    inv = inventory(tb, tmp, 60.0)
    whole = job(tmp, "bench-chain", 4, 0.5)
    ids = []
    for _ in range(n):
        _, r = dfo(inv, env, "submit", "-H", "node-2", "-j", str(whole), "--json")
        if r.returncode != 0:
            raise SystemExit(f"submit failed: {r.stderr}")
        ids.append(json.loads(r.stdout)["hosts"]["node-2"]["runs"][0]["run"])
    runs = tb.workdir / "node-2" / "workspace" / ".dfo" / "runs"
    deadline = time.monotonic() + 60 + 2 * n
    while time.monotonic() < deadline and not all((runs / i / "end.json").exists() for i in ids):
        time.sleep(0.5)
    rec_gaps, trainer_gaps = [], []
    for a, b in zip(ids, ids[1:], strict=False):
        end = json.loads((runs / a / "end.json").read_text())["ended_ts"]
        start = json.loads((runs / b / "meta.json").read_text())["started_ts"]
        rec_gaps.append(start - end)
        last = float((runs / a / "log").read_text().split("end ")[1].split()[0])
        first = float((runs / b / "log").read_text().split("start ")[1].split()[0])
        trainer_gaps.append(first - last - 0.3)  # less the 0.3 s the trainer sleeps after its last line
    return {"records: end.json -> next meta.json": stats(rec_gaps),
            "trainers: last line (+0.3 s) -> next first line": stats(trainer_gaps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--submits", type=int, default=10, help="submits timed per series")
    ap.add_argument("--chain", type=int, default=10, help="runs queued one behind the other")
    ap.add_argument("--out", help="write the results as JSON here too")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dfo-queue-bench-") as d:
        tmp = Path(d)
        env = {**os.environ, "XDG_STATE_HOME": str(tmp / "state"), "XDG_CACHE_HOME": str(tmp / "cache"),
               "COLUMNS": "200"}
        with Testbed(tmp / "tb", nodes=2, s3=False) as tb:
            res = {"load_before": os.getloadavg(), "submit_s": submits(tb, tmp, env, a.submits),
                   "end_to_next_start_s": chain(tb, tmp, env, a.chain), "load_after": os.getloadavg()}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
