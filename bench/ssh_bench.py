"""The OpenSSH transport against its peers (issue 18, Speed): dfo and the peer timed alternately, same run.

    python bench/ssh_bench.py [-n 7] [--out FILE]

1. `dfo status -H node` run again within the persist window (a shared connection is up: ControlMaster)
   against `ssh HOST true` without connection sharing (a full handshake each time). Goal: <= 1.0x. The same
   on the paramiko transport, for comparison (what `dfo status` cost before the OpenSSH transport).
2. `dfo status --help` against `python3 -c "import click"`. Goal: <= 1.5x.
   Also without any sharing (``ssh_persist: 0``): against `ssh HOST true`, and against itself with its ssh
   started after its start-up instead of at it (``DFO_EARLY_CONNECT=0``, transport/openssh_early.py).
3. `dfo status -H node` as the first connection to a new host (a fresh known_hosts each time, so the key
   exchange, accept-new and a new master happen every run) on the OpenSSH transport against the paramiko
   transport. Goal: no slower.

One testbed node (real sshd in its own network namespace) on this machine. Each pair runs N times in
turn (A, B, A, B, ...) after one warm-up of each; best and median wall time of each side, and their
ratios. `dfo` is the console script beside this Python.
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

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.bytecode import compile_trees  # noqa: E402
from orchestrator.testbed import Testbed  # noqa: E402


def dfo_argv() -> list[str]:
    script = Path(sys.executable).parent / "dfo"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from orchestrator.entry import main; sys.argv[0] = 'dfo'; main()"]


def timed(argv: list[str], env: dict[str, str], expect: int = 0) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, timeout=120,
                       stdin=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    if r.returncode != expect:
        raise SystemExit(f"ssh_bench: {' '.join(argv)} exited {r.returncode}: {r.stderr.decode()[-600:]}")
    return dt


def pair(name: str, a: tuple[str, object], b: tuple[str, object], n: int) -> dict[str, object]:
    """Run a() and b() alternately n times after a warm-up each; print and return best/median of each."""
    (na, fa), (nb, fb) = a, b
    fa(), fb()  # type: ignore[operator]
    ta: list[float] = []
    tb: list[float] = []
    for _ in range(n):
        ta.append(fa())  # type: ignore[operator]
        tb.append(fb())  # type: ignore[operator]
    out = {"what": name, na: {"best": min(ta), "median": statistics.median(ta)},
           nb: {"best": min(tb), "median": statistics.median(tb)},
           "ratio_best": min(ta) / min(tb), "ratio_median": statistics.median(ta) / statistics.median(tb)}
    print(f"{name}\n  {na:40} best {min(ta) * 1000:7.0f} ms  median {statistics.median(ta) * 1000:7.0f} ms\n"
          f"  {nb:40} best {min(tb) * 1000:7.0f} ms  median {statistics.median(tb) * 1000:7.0f} ms\n"
          f"  ratio: best {out['ratio_best']:.2f}x  median {out['ratio_median']:.2f}x", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    compile_trees(ROOT)
    work = Path(tempfile.mkdtemp(prefix="dfo-sshbench-"))
    env = dict(os.environ, COLUMNS="200")
    cfg = work / "ssh_config"  # no ~/.ssh: the bench's own (empty) user config
    cfg.write_text(f"Host *\n  UserKnownHostsFile {work}/user_known_hosts\n")
    env["DFO_SSH_CONFIG"] = str(cfg)
    env.pop("DFO_SSH_TRANSPORT", None)
    results = []
    with Testbed(work / "tb", nodes=1, s3=False) as tb:
        node = tb.nodes[0]
        doc = yaml.safe_load(Path(tb.inventory_path).read_text())
        doc["defaults"].update({"known_hosts": str(work / "known_hosts"), "transport": "openssh", "ssh_persist": 600})
        inv = work / "inventory.yaml"
        inv.write_text(yaml.safe_dump(doc))
        status = [*dfo_argv(), "-i", str(inv), "status", "-H", node.name]
        peer = [*tb.ssh_argv(node, "true", known_hosts=work / "peer_known_hosts")]
        peer[1:1] = ["-o", "ControlMaster=no", "-o", "ControlPath=none"]
        results.append(pair("status again within the persist window vs ssh HOST true (no sharing)",
                            ("dfo status -H node (openssh, shared)", lambda: timed(status, env)),
                            ("ssh HOST true (no sharing)", lambda: timed(peer, env)), args.n))

        odoc = dict(doc, defaults=dict(doc["defaults"], ssh_persist=0))  # no connection outlives a command
        oinv = work / "inventory-own.yaml"
        oinv.write_text(yaml.safe_dump(odoc))
        own = [*dfo_argv(), "-i", str(oinv), "status", "-H", node.name]
        timed(own, env)  # the host seen once: the record of how its ssh starts (openssh_early) is there
        late = dict(env, DFO_EARLY_CONNECT="0")
        results.append(pair("status, no shared connection (ssh_persist 0) vs ssh HOST true (no sharing)",
                            ("dfo status -H node (ssh_persist 0)", lambda: timed(own, env)),
                            ("ssh HOST true (no sharing)", lambda: timed(peer, env)), args.n))
        results.append(pair("the same: ssh started at dfo's start-up vs after it (DFO_EARLY_CONNECT=0)",
                            ("dfo status -H node (ssh_persist 0)", lambda: timed(own, env)),
                            ("the same, DFO_EARLY_CONNECT=0", lambda: timed(own, late)), args.n))

        pdoc = dict(doc, defaults=dict(doc["defaults"], transport="paramiko"))
        pinv = work / "inventory-paramiko.yaml"
        pinv.write_text(yaml.safe_dump(pdoc))
        pstatus = [*dfo_argv(), "-i", str(pinv), "status", "-H", node.name]
        results.append(pair("the same on the paramiko transport (before: no connection outlives dfo)",
                            ("dfo status -H node (paramiko)", lambda: timed(pstatus, env)),
                            ("ssh HOST true (no sharing)", lambda: timed(peer, env)), args.n))

        helpv = [*dfo_argv(), "status", "--help"]
        click = [sys.executable, "-c", "import click"]
        results.append(pair("dfo status --help vs python3 -c 'import click'",
                            ("dfo status --help", lambda: timed(helpv, env)),
                            ("python3 -c 'import click'", lambda: timed(click, env)), args.n))

        count = [0]

        def first(transport: str) -> float:
            count[0] += 1
            d = dict(doc)
            d["defaults"] = dict(doc["defaults"], transport=transport, ssh_persist=60,
                                 known_hosts=str(work / f"kh-first-{count[0]}"))
            p = work / f"inventory-first-{count[0]}.yaml"
            p.write_text(yaml.safe_dump(d))
            return timed([*dfo_argv(), "-i", str(p), "status", "-H", node.name], env)

        results.append(pair("first connection to a new host: openssh vs paramiko",
                            ("dfo status, new host (openssh)", lambda: first("openssh")),
                            ("dfo status, new host (paramiko)", lambda: first("paramiko")), args.n))
        load = os.getloadavg()
        print(f"load average during the run: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    if args.out:
        args.out.write_text(json.dumps({"results": results, "load": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
