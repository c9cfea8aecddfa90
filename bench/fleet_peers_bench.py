"""`dfo exec -- true` on N testbed nodes beside pdsh, parallel-ssh and Ansible on the same nodes, the same key
(issue 35): cold (no shared connection) and warm (every tool with its connections kept: dfo's ssh_persist,
the peers with OpenSSH's ControlPersist in their ssh config), best and median of R, runs alternating tool by
tool so each sees the same load; the load average is recorded before each round.

    python bench/fleet_peers_bench.py [--sizes 1,8,32,64] [--repeat 5] [--out bench/results/fleet_peers.json]

Peers: pdsh (Debian package pdsh, its ssh module, fanout 32 as shipped), parallel-ssh (Debian package pssh:
`parallel-ssh`, -p N), Ansible (ansible-core; `ansible -m raw -a true`, forks = N); each is skipped, with
the reason printed, where it is not installed (ANSIBLE=path/to/ansible picks a venv's). The nodes are
testbed nodes (real sshd, each in its own network namespace) on this machine: the nodes' sshd and shells
share its cores with the tools, as the issue's own figures did.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.bytecode import compile_trees  # noqa: E402
from orchestrator.testbed import Testbed  # noqa: E402


def ssh_config(tb: Testbed, path: Path, known: Path, control: Path | None) -> None:
    lines = []
    for n in tb.nodes:
        lines += [f"Host {n.name}", f"  HostName {n.address}", f"  Port {n.port}", f"  User {n.user}"]
    lines += ["Host *", f"  IdentityFile {tb.identity}", "  IdentitiesOnly yes", "  BatchMode yes",
              f"  UserKnownHostsFile {known}", "  StrictHostKeyChecking accept-new", "  LogLevel ERROR",
              "  ConnectTimeout 10"]
    if control is not None:
        lines += ["  ControlMaster auto", f"  ControlPath {control}/%C", "  ControlPersist 120"]
    path.write_text("\n".join(lines) + "\n")


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                       timeout=600)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"{argv[0]} failed (exit {r.returncode}): {(r.stdout + r.stderr)[-1500:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,8,32,64")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    compile_trees(ROOT)
    ansible = os.environ.get("ANSIBLE") or shutil.which("ansible")
    peers = {"pdsh": shutil.which("pdsh"), "parallel-ssh": shutil.which("parallel-ssh"), "ansible": ansible}
    for k, v in peers.items():
        if not v:
            print(f"{k}: not installed here: skipped")
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    loads: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dfo-peers-") as tmp_s, \
            Testbed(Path(tmp_s) / "tb", nodes=max(sizes), s3=False) as tb:
        tmp = Path(tmp_s)
        known = tmp / "known_hosts"
        ctl = tmp / "ctl"
        ctl.mkdir()
        cold_cfg, warm_cfg = tmp / "cold.cfg", tmp / "warm.cfg"
        ssh_config(tb, cold_cfg, known, None)
        ssh_config(tb, warm_cfg, known, ctl)
        inv_doc = yaml.safe_load(tb.inventory_path.read_text())
        inv_doc["defaults"]["known_hosts"] = str(tmp / "dfo_known_hosts")
        names = [n.name for n in tb.nodes]
        for s in sizes:
            inv_doc.setdefault("groups", {})[f"g{s}"] = names[:s]
        invs = {}
        for mode, persist in (("cold", 0), ("warm", 120)):
            doc = json.loads(json.dumps(inv_doc))
            doc["defaults"]["ssh_persist"] = persist
            invs[mode] = tmp / f"inv_{mode}.yaml"
            invs[mode].write_text(yaml.safe_dump(doc))
        hostfile = {s: tmp / f"hosts{s}" for s in sizes}
        for s in sizes:
            hostfile[s].write_text("\n".join(names[:s]) + "\n")
            (tmp / f"ansible{s}.ini").write_text("[all]\n" + "\n".join(names[:s]) + "\n")
        env = dict(os.environ, COLUMNS="200")

        def dfo(mode: str, s: int) -> list[str]:
            return [sys.executable, "-m", "orchestrator", "-i", str(invs[mode]), "exec", "-H", f"g{s}", "--", "true"]

        def pdsh(mode: str, s: int) -> list[str]:
            return [str(peers["pdsh"]), "-R", "ssh", "-w", ",".join(names[:s]), "true"]

        def pssh(mode: str, s: int) -> list[str]:
            cfg = cold_cfg if mode == "cold" else warm_cfg
            return [str(peers["parallel-ssh"]), "-h", str(hostfile[s]), "-p", str(s), "-x", f"-F {cfg}", "true"]

        def ans(mode: str, s: int) -> list[str]:
            return [str(ansible), "all", "-i", str(tmp / f"ansible{s}.ini"), "-m", "raw", "-a", "true",
                    "-f", str(s), "-o"]

        def env_for(tool: str, mode: str) -> dict[str, str]:
            cfg = cold_cfg if mode == "cold" else warm_cfg
            e = dict(env)
            if tool == "pdsh":
                e["PDSH_SSH_ARGS_APPEND"] = f"-F {cfg}"
            if tool == "ansible":
                e.update(ANSIBLE_HOST_KEY_CHECKING="False", ANSIBLE_SSH_ARGS=f"-F {cfg}",
                         ANSIBLE_PIPELINING="True", ANSIBLE_LOCALHOST_WARNING="False")
            return e

        tools: dict[str, Callable[[str, int], list[str]]] = {"dfo": dfo}
        if peers["pdsh"]:
            tools["pdsh"] = pdsh
        if peers["parallel-ssh"]:
            tools["parallel-ssh"] = pssh
        if ansible:
            tools["ansible"] = ans
        # first contact everywhere: host keys recorded, dfo's node code uploaded
        timed(dfo("cold", max(sizes)), env)
        timed(pssh("cold", max(sizes)) if peers["parallel-ssh"] else dfo("cold", max(sizes)), env)
        for mode in ("cold", "warm"):
            for s in sizes:
                for tool, make in tools.items():  # warm: one call first so every tool's connections are up
                    if mode == "warm":
                        timed(make(mode, s), env_for(tool, mode))
                for _ in range(a.repeat):
                    loads.append(os.getloadavg()[0])
                    for tool, make in tools.items():
                        wall = timed(make(mode, s), env_for(tool, mode))
                        results.setdefault(tool, {}).setdefault(mode, {}).setdefault(str(s), []).append(wall)
                line = [f"{mode} N={s:<3}"]
                for tool in tools:
                    w = results[tool][mode][str(s)]
                    line.append(f"{tool} {min(w):.2f}/{statistics.median(w):.2f}")
                base = results["pdsh"][mode][str(s)] if "pdsh" in tools else None
                if base:
                    d = results["dfo"][mode][str(s)]
                    line.append(f"dfo/pdsh {min(d) / min(base):.2f}x best, "
                                f"{statistics.median(d) / statistics.median(base):.2f}x median")
                print("  ".join(line), flush=True)
    print(f"load average (1 min) before the rounds: min {min(loads):.2f}, max {max(loads):.2f}; "
          f"{os.cpu_count()} cores; best/median of {a.repeat}, seconds")
    if a.out:
        a.out.write_text(json.dumps({"cores": os.cpu_count(), "repeat": a.repeat, "sizes": sizes, "walls": results,
                                     "load": loads}, indent=1) + "\n")


if __name__ == "__main__":
    main()
