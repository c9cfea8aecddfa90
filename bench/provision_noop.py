"""How long a no-op `dfo provision` takes on a provisioned testbed node, against peers.

    python bench/provision_noop.py [--repeat 7] [--installer uv|pip] [--out bench/results/provision_noop.json]

One testbed node (real sshd in its own namespaces), the fake wheelhouse of tests/_wheels.py
copied onto it, a job with three lines (faketorch==2.11.0, faketriton==3.6.0, fakefla==0.6.0).
After a first provision, each figure is the median (and min) of --repeat runs of:

* ``dfo provision`` -- the whole CLI: Python start, inventory and job, SSH connect, the agent's
  content-hash check, remote.env.provision with one pkgcheck in the venv, the report;
* ``provision()`` in-process over an open connection -- the same without CLI start and handshake;
* ``ssh node true`` -- the system OpenSSH client, a new connection each time (the floor for a CLI);
* ``ssh node uv pip install ...`` -- the installer's own no-op: the same three lines, already
  installed, with the same index options (what a shell script would run every time).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.config.models import load_job  # noqa: E402
from orchestrator.hosts import HostSession  # noqa: E402
from orchestrator.steps.provision import provision  # noqa: E402
from orchestrator.testbed import Testbed  # noqa: E402
from tests._provision_fixtures import tar_dir  # noqa: E402
from tests._wheels import build_wheelhouse  # noqa: E402

LINES = ["faketorch==2.11.0", "faketriton==3.6.0", "fakefla==0.6.0"]


def timed(fn, repeat: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    xs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return {"median_s": round(statistics.median(xs), 4), "min_s": round(min(xs), 4)}


def check(r: subprocess.CompletedProcess[bytes]) -> None:
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {r.args}\n{r.stdout[-2000:]!r}\n{r.stderr[-2000:]!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--installer", choices=["uv", "pip"], default="uv")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dfo-bench-provision-"))
    wh = build_wheelhouse(work / "wheels")
    with Testbed(work / "tb", nodes=1, s3=False) as tb:
        node = tb.nodes[0]
        wheels = "/root/bench-wheels" if tb.isolated else str(wh)
        if tb.isolated:
            check(subprocess.run(tb.ssh_argv(node, f"mkdir -p {wheels} && tar -xf - -C {wheels}"),
                                 input=tar_dir(wh), capture_output=True))
        base = "/root/bench-pv" if tb.isolated else str(work / "node")
        venv = f"{base}/venv"
        job = work / "job.yaml"
        job.write_text(yaml.safe_dump({
            "name": "bench", "venv": venv, "installer": a.installer, "workspace": f"{base}/ws", "packages": LINES,
            "index": {"find_links": [wheels], "no_index": True}}))
        cli = [sys.executable, "-m", "orchestrator", "-i", str(tb.inventory_path), "provision", "-H", node.name,
               "-j", str(job)]
        t = time.perf_counter()
        check(subprocess.run(cli, capture_output=True))
        first = time.perf_counter() - t
        out = subprocess.run(cli, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.count(": no change") == 3 + len(LINES), out.stdout

        figures: dict[str, dict[str, float]] = {}
        figures["dfo provision (CLI, no-op)"] = timed(lambda: check(subprocess.run(cli, capture_output=True)),
                                                      a.repeat)
        loaded = load_job(job)
        with HostSession(tb.inventory_path, [node.name]) as s:
            conn = s.conn(node.name)
            provision(conn, loaded)  # connect and upload the agent outside the timing

            def lib() -> None:
                assert provision(conn, loaded).ok

            figures["provision() in-process, open connection"] = timed(lib, a.repeat)
        figures["ssh node true"] = timed(lambda: check(subprocess.run(tb.ssh_argv(node, "true"), capture_output=True)),
                                         a.repeat)
        if a.installer == "uv":
            inst = (f"{venv}/bin/uv pip install --python {venv}/bin/python --no-index --find-links {wheels} "
                    + " ".join(shlex.quote(x) for x in LINES))
        else:
            inst = (f"{venv}/bin/python -m pip install --no-index --find-links {wheels} "
                    + " ".join(shlex.quote(x) for x in LINES))
        label = "uv pip install" if a.installer == "uv" else "python -m pip install"
        figures[f"ssh node {label} (no-op)"] = timed(
            lambda: check(subprocess.run(tb.ssh_argv(node, inst), capture_output=True)), a.repeat)

    print(f"first provision (fresh venv, {a.installer}): {first:.2f}s")
    width = max(len(k) for k in figures)
    base_s = figures["ssh node true"]["median_s"]
    for k, v in figures.items():
        print(f"{k:<{width}}  median {v['median_s'] * 1000:7.0f} ms  min {v['min_s'] * 1000:7.0f} ms"
              f"  ({v['median_s'] / base_s:4.1f}x ssh true)")
    if a.out:
        Path(a.out).write_text(json.dumps({"installer": a.installer, "repeat": a.repeat, "first_s": round(first, 2),
                                           "figures": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
