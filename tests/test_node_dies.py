"""When a node dies: the testbed's node.vanish(), and the whole story of issue 12 on it
(a run on node A ships its checkpoints, A vanishes, `dfo up` on node B resumes from the last shipped one)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from orchestrator import testbed_sys as tsys
from orchestrator.testbed import Testbed, TestbedError

pytestmark = pytest.mark.testbed

MakeTestbed = Callable[..., Testbed]


def dfo(inv: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real CLI in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(inv), *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, COLUMNS="200"))


def _spaces(pid: int) -> set[tuple[str, int]]:
    return {(k, os.stat(f"/proc/{pid}/ns/{k}").st_ino) for k in ("net", "mnt")}


def _pids_in(spaces: set[tuple[str, int]]) -> list[int]:
    """Every live process of this machine in one of these namespaces (found afresh from /proc)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            mine = _spaces(int(entry.name))
        except OSError:
            continue  # gone, or a zombie (no namespaces left)
        if mine & spaces and tsys.pid_alive(int(entry.name)):
            out.append(int(entry.name))
    return out


# a detached process, as the supervisor, trainer and shipper are: setsid, no terminal, survives the session
DETACH = "setsid sh -c 'exec sleep 600' </dev/null >/dev/null 2>&1 & echo $!"


def test_vanish_kills_every_process_of_the_node_and_nothing_else(make_testbed: MakeTestbed) -> None:
    tb = make_testbed(nodes=2, s3=False)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    a, b = tb.nodes
    detached = {}
    for n in (a, b):
        r = tb.ssh(n, DETACH)
        assert r.returncode == 0, r.stderr
        detached[n.name] = int(r.stdout.split()[-1])
    # a process entered only by nsenter (not under sshd) is the node's too
    inner = int(tb.node_exec(a, DETACH).stdout.split()[-1])
    before = tb.node_pids(a)
    assert detached[a.name] in before and inner in before
    assert detached[b.name] not in before and os.getpid() not in before
    spaces = _spaces(detached[a.name])
    assert spaces.isdisjoint(_spaces(os.getpid())) and spaces.isdisjoint(_spaces(detached[b.name]))
    netns = {ln.split()[0] for ln in tsys.run(["ip", "netns", "list"]).stdout.splitlines() if ln.strip()}

    killed = tb.vanish(a)

    assert {detached[a.name], inner} <= set(killed)
    assert not any(tsys.pid_alive(p) for p in before), [p for p in before if tsys.pid_alive(p)]
    assert _pids_in(spaces) == []  # nothing at all left in the node's network or mount namespace
    after = {ln.split()[0] for ln in tsys.run(["ip", "netns", "list"]).stdout.splitlines() if ln.strip()}
    assert len(netns - after) == 1 and after < netns  # exactly one namespace went: the node's
    assert tb.node_pids(a) == []
    # nothing outside the node was touched: node B and its detached process live on
    assert tsys.pid_alive(detached[b.name])
    r = tb.ssh(b, "echo alive")
    assert r.returncode == 0 and r.stdout.strip() == "alive", r.stderr
    # dfo finds node A gone quickly: exit 4 (unreachable), naming it, no traceback
    t0 = time.monotonic()
    r = dfo(tb.inventory_path, "status", "-H", a.name, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 4, r.stdout + r.stderr
    assert a.name in r.stderr and "Traceback" not in r.stderr
    assert took < 20, f"dfo status took {took:.1f}s to find {a.name} gone"
    r = dfo(tb.inventory_path, "status", "-H", b.name, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    tsys.signal_pids([detached[b.name]], 9)


def test_vanish_needs_a_namespace_node(make_testbed: MakeTestbed) -> None:
    tb = make_testbed(nodes=1, s3=False, use_netns=False)
    with pytest.raises(TestbedError, match="vanish needs a namespace node"):
        tb.vanish(tb.nodes[0])
    assert tb.ssh(tb.nodes[0], "echo alive").stdout.strip() == "alive"
