"""Gangs (issue 13), the building blocks: the plan, the preflight comparison, the address check, the
gang watch, each on its own (docs/gangs.md); tests/test_gang.py runs them wired into launch."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.models import Job, ResolvedHost
from orchestrator.errors import EXIT_USAGE, ConfigError, UsageError
from orchestrator.steps.gang import address_problems, plan_gang, preflight_problems
from remote.gang import ops as rgang
from remote.gang.watch import GangWatch
from remote.gang.wire import _Chan, _mac

ROOT = Path(__file__).resolve().parent.parent
# a watch thread that dies on a stranger's bytes is a failure here, not a warning
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


def _job(**run: Any) -> Job:
    base = {"command": "train.py --lr 3e-4", "nodes": 3, "launcher": "torchrun"}
    base.update(run)
    return Job.model_validate({"name": "g", "venv": "/root/venv", "run": base})


def _hosts(n: int = 3) -> list[ResolvedHost]:
    return [ResolvedHost(name=f"node-{i + 1}", hostname=f"203.0.113.{i + 1}", port=10000 + i,
                         private_address=f"10.1.0.{i + 1}" if i != 2 else None) for i in range(n)]


# --------------------------------------------------------------------------- the plan
def test_the_plan_gives_every_rank_its_env_and_torchrun_command() -> None:
    plan = plan_gang(_job(), _hosts(), "g-20260101-000000-abcd", gpus={"node-1": 4, "node-2": None})
    addrs = ["10.1.0.1", "10.1.0.2", "203.0.113.3"]  # node-3 has no private_address: its SSH host
    assert [n.rank for n in plan.nodes] == [0, 1, 2] and [n.address for n in plan.nodes] == addrs
    for n in plan.nodes:
        e = n.env
        assert e["DFO_RUN_ID"] == "g-20260101-000000-abcd" and e["DFO_NODE_RANK"] == str(n.rank)
        assert e["DFO_NUM_NODES"] == "3" and e["DFO_NODE_ADDRS"] == ",".join(addrs)
        assert e["MASTER_ADDR"] == "10.1.0.1" and e["MASTER_PORT"] == "29400"
        assert e["SKYPILOT_NODE_RANK"] == str(n.rank) and e["SKYPILOT_NUM_NODES"] == "3"
        assert e["SKYPILOT_NODE_IPS"].splitlines() == addrs
        assert e["DSTACK_NODE_RANK"] == str(n.rank) and e["DSTACK_NODES_NUM"] == "3"
        assert e["DSTACK_NODES_IPS"].splitlines() == addrs and e["DSTACK_MASTER_NODE_IP"] == "10.1.0.1"
        assert n.gloo_ifname
        argv = shlex.split(n.command)
        assert argv[:3] == ["/root/venv/bin/python", "-m", "torch.distributed.run"]
        opts = dict(zip(argv[3:-3:2], argv[4:-3:2], strict=True))
        assert argv[-3:] == ["train.py", "--lr", "3e-4"]
        assert opts["--nnodes"] == "3" and opts["--rdzv-backend"] == "c10d"
        assert opts["--rdzv-endpoint"] == "10.1.0.1:29400" and opts["--rdzv-id"] == plan.run_id
        assert opts["--local-addr"] == n.address
        assert opts["--rdzv-conf"] == ("is_host=1" if n.rank == 0 else "is_host=0")
        assert "--node-rank" not in argv  # the c10d backend ignores it (and warns)
    assert [n.nproc for n in plan.nodes] == [4, 1, 1]  # auto: the GPU count, 1 without GPUs
    assert plan.watch_port == 29401 and len(bytes.fromhex(plan.secret)) == 32
    assert plan.secret not in repr(plan)


def test_the_plan_with_a_fixed_nproc_one_node_and_launcher_none() -> None:
    plan = plan_gang(_job(nproc_per_node=2, rdzv_port=31000), _hosts(), "r1", gpus={"node-1": 8})
    assert [n.nproc for n in plan.nodes] == [2, 2, 2] and "--rdzv-endpoint 10.1.0.1:31000" in plan.master.command
    one = plan_gang(_job(nodes=1), _hosts(1), "r2", gpus={"node-1": 2})
    argv = shlex.split(one.master.command)
    assert "--standalone" in argv and "--rdzv-endpoint" not in argv and argv[argv.index("--nproc-per-node") + 1] == "2"
    assert not one.master.gloo_ifname
    none = plan_gang(_job(launcher="none", env={"GLOO_SOCKET_IFNAME": "eth1"}), _hosts(), "r3")
    assert [n.command for n in none.nodes] == ["train.py --lr 3e-4"] * 3
    assert not any(n.gloo_ifname for n in none.nodes)  # the job's own choice wins
    assert none.nodes[2].env["MASTER_ADDR"] == "10.1.0.1"


def test_the_plan_needs_exactly_run_nodes_hosts_with_distinct_addresses() -> None:
    with pytest.raises(UsageError) as ei:
        plan_gang(_job(nodes=3), _hosts(2), "r")
    assert "run.nodes is 3" in ei.value.message and "names 2 hosts" in ei.value.message
    assert ei.value.exit_code == EXIT_USAGE and "node-1, node-2" in ei.value.message
    twins = _hosts(2) + [ResolvedHost(name="node-9", hostname="x", private_address="10.1.0.2")]
    with pytest.raises(ConfigError) as ei2:
        plan_gang(_job(), twins, "r")
    assert "node-2 and node-9" in ei2.value.message and "private_address" in (ei2.value.hint or "")


# --------------------------------------------------------------------------- preflight
def _facts(torch: str = "2.11.0", data: str = "d1", **extra: Any) -> dict[str, Any]:
    f = {"provision": {"ok": True, "python": "3.12.3", "packages": {"torch": torch, "numpy": "2.2.0"}},
         "manifests": {"data": {"path": "/workspace/d", "source": "s3://b/d/", "files": 3, "bytes": 30,
                                "digest": data}, "model": None}}
    f.update(extra)
    return f


def test_preflight_names_the_node_that_differs_and_how() -> None:
    same = {"node-1": _facts(), "node-2": _facts(), "node-3": _facts()}
    assert preflight_problems("g", same) == []
    bad = {"node-1": _facts(), "node-2": _facts(), "node-3": _facts(torch="2.10.0")}
    assert preflight_problems("g", bad) == ["node-3: torch 2.10.0, node-1 has 2.11.0"]
    gone = {"node-1": _facts(), "node-2": _facts(provision=None)}
    assert preflight_problems("g",
                              gone) == ["node-2: no provision record for job g (run dfo provision -H node-2 -j JOB)"]
    failed = _facts()
    failed["provision"] = dict(failed["provision"], ok=False)
    assert "node-2: the last provision of job g failed" in preflight_problems("g", {"node-1": _facts(),
                                                                                    "node-2": failed})[0]
    extra = _facts()
    extra["provision"]["packages"] = dict(extra["provision"]["packages"], nccl="2.21")
    assert preflight_problems("g", {"node-1": _facts(),
                                    "node-2": extra}) == ["node-2: nccl 2.21, node-1 does not have it"]
    data = preflight_problems("g", {"node-1": _facts(), "node-2": _facts(data="d2")})
    assert data == ["node-2: data at /workspace/d: 3 files, 30 bytes from s3://b/d/, node-1 has 3 files, 30 bytes "
                    "from s3://b/d/ (same count and size, other ETags)"]
    nodata = _facts()
    nodata["manifests"] = {"data": None, "model": None}
    assert preflight_problems("g", {"node-1": _facts(),
                                    "node-2": nodata})[0].startswith("node-2: no data manifest at /workspace/d")


def test_the_facts_op_reads_the_provision_record_and_the_manifests(tmp_path: Path) -> None:
    """remote.gang facts on real files in the layout remote/env/provision.py and remote/s3/manifest.py write."""
    ws = tmp_path / "ws"
    (ws / ".dfo/provision").mkdir(parents=True)
    (ws / ".dfo/provision/g.json").write_text(json.dumps({"ok": True, "python": "3.12.3",
                                                          "packages_after": {"torch": "2.11.0"}}))
    for name, etag in (("a", "e1"), ("b", "e2")):
        d = tmp_path / name / ".dfo"
        d.mkdir(parents=True)
        files = {"x.bin": {"size": 5, "etag": "e0", "mtime_ns": 1, "ino": 7 if name == "a" else 9}}
        (d / "manifest.json").write_text(json.dumps({"version": 1, "source": "s3://b/p/", "files": files}))
        (d / "journal.jsonl").write_text(json.dumps({"source": "s3://b/p/", "k": "y.bin", "size": 2, "etag": etag,
                                                     "mtime_ns": 5}) + "\n{torn")
    req = {"op": "facts", "workspace": str(ws), "job": "g", "manifests": {"data": str(tmp_path / "a"),
                                                                           "model": str(tmp_path / "none")}}
    out = subprocess.run([sys.executable, "-m", "remote.gang"], input=json.dumps(req), capture_output=True, text=True,
                         cwd=ROOT, timeout=30).stdout
    got = json.loads(out.split("@@DFO-RESULT@@ ")[1])["data"]
    assert got["provision"]["packages"] == {"torch": "2.11.0"} and got["provision"]["ok"] is True
    assert got["manifests"]["model"] is None
    a = got["manifests"]["data"]
    assert (a["files"], a["bytes"], a["source"]) == (2, 7, "s3://b/p/")
    b = rgang.manifest_facts(str(tmp_path / "b"))
    assert b["files"] == 2 and b["digest"] != a["digest"]  # y.bin's ETag differs; the inode does not count
    (tmp_path / "b/.dfo/journal.jsonl").write_text(json.dumps({"source": "s3://b/p/", "k": "y.bin", "size": 2,
                                                               "etag": "e1", "mtime_ns": 99}) + "\n")
    assert rgang.manifest_facts(str(tmp_path / "b"))["digest"] == a["digest"]
    assert rgang.provision_facts(str(ws), "other") is None


# --------------------------------------------------------------------------- address check (localhost)
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_the_address_check_on_localhost() -> None:
    token = secrets.token_hex(8)
    for _ in range(3):  # a free port can be taken by another test's server before listen() binds it: new ones
        ports = [_free_port(), _free_port()]
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda b=box, p=ports: b.update(r=rgang.listen({"ports": p, "token": token,
                                                                                   "expect": 1, "window": 20})))
        t.start()
        got = rgang.connect({"address": "127.0.0.1", "ports": ports, "token": token, "rank": 1, "window": 10})
        t.join(25)
        if box["r"]["ok"] or "in use" not in str(box["r"].get("error")):
            break
    assert got == {"ok": True, "port": None, "error": None}, box
    assert box["r"]["ok"] and box["r"]["peers"] == {str(p): ["1"] for p in ports}
    refused = rgang.connect({"address": "127.0.0.1", "ports": [_free_port()], "token": token, "window": 1})
    assert not refused["ok"] and "refused" in refused["error"]
    # a listener that does not know the token (another service on the port) does not count as reachable
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def banner() -> None:
        try:
            while True:
                srv.accept()[0].sendall(b"SSH-2.0-x\n")
        except OSError:
            return  # closed by the test

    threading.Thread(target=banner, daemon=True).start()
    other = rgang.connect({"address": "127.0.0.1", "ports": [srv.getsockname()[1]], "token": token, "window": 1})
    srv.close()
    assert not other["ok"] and "something else answers" in other["error"]
    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen(1)
    inuse = rgang.listen({"ports": [busy.getsockname()[1]], "token": token, "expect": 1, "window": 1})
    busy.close()
    assert not inuse["ok"] and "in use" in inuse["error"]


def test_address_problems_name_both_nodes() -> None:
    plan = plan_gang(_job(), _hosts(), "r")
    res = {"node-1": {"ok": True, "error": None}, "node-2": {"ok": True},
           "node-3": {"ok": False, "port": 29400, "error": "connection timed out"}}
    probs = address_problems(plan, res)
    assert len(probs) == 1 and probs[0].startswith("node-3 cannot reach node-1 at 10.1.0.1:29400: connection timed out")
    assert address_problems(plan, {"node-1": {}, "node-2": {"ok": True}, "node-3": {"ok": True}}) == []
    lp = address_problems(plan, {"node-1": {"error": "port in use", "port": 29401}, "node-2": {"ok": True},
                                 "node-3": {"ok": True}})
    assert lp == ["node-1: cannot listen on port 29401 for the gang: port in use"]


def test_the_interface_for_an_address() -> None:
    assert rgang.interface_for("127.0.0.1") == "lo"
    assert rgang.interface_for("192.0.2.77", peer="127.0.0.1") == "lo"  # not ours: the route to the peer
    assert rgang.interface_for("192.0.2.77") is None


# --------------------------------------------------------------------------- the gang watch
FAST = {"interval": 0.1, "silence": 1.5, "join_timeout": 5.0}


class _Gang:
    """A gang of watches in threads on localhost; each records its stop calls."""

    def __init__(self, n: int = 3, secret: bytes | None = None, **kw: Any) -> None:
        self.hosts = [f"node-{i + 1}" for i in range(n)]
        self.secret = secret or secrets.token_bytes(32)
        self.stops = {h: threading.Event() for h in self.hosts}
        opts = dict(FAST, **kw)
        self.hub = GangWatch(0, self.hosts, "127.0.0.1", 0, self.secret, self.stops["node-1"].set, gang_id="run-1",
                             bind="127.0.0.1", **opts).start()
        self.w = [self.hub] + [GangWatch(i, self.hosts, "127.0.0.1", self.hub.port, self.secret,
                                         self.stops[h].set, gang_id="run-1", **opts).start()
                               for i, h in enumerate(self.hosts) if i]

    def joined(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(m["state"] == "running" for m in self.hub.members.values()):
                return
            time.sleep(0.05)
        raise AssertionError(f"members did not join: {self.hub.state()}")

    def close(self) -> None:
        for w in self.w:
            w.close()


def test_a_failing_member_stops_every_other_node() -> None:
    g = _Gang()
    try:
        g.joined()
        g.w[2].trainer_ended(3)
        assert g.stops["node-1"].wait(10) and g.stops["node-2"].wait(10)
        assert not g.stops["node-3"].is_set()  # its own trainer ended: nothing to stop there
        # the failing member hears the gang's verdict after the hub has sent it to the others: under load
        # node-1 and node-2 may be stopped before node-3's watch has read its gang-failed line
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(w.first_failure is None for w in g.w):
            time.sleep(0.05)
        for w in g.w:
            assert w.first_failure == {"host": "node-3", "how": "exit 3"}
        assert g.hub.state()["state"] == "failed"
        # the stopped trainers end; every watch finishes
        g.w[0].trainer_ended(-15)
        g.w[1].trainer_ended(-15)
        assert all(w.wait(10) for w in g.w)
        assert g.hub.state()["members"] == {"node-2": "failed", "node-3": "failed"}
        kinds = [e["event"] for e in g.hub.events]
        assert kinds.count("gang-failed") == 1 and "member-ended" in kinds
    finally:
        g.close()


def test_a_gang_that_succeeds_stops_nothing() -> None:
    g = _Gang()
    try:
        g.joined()
        for w in reversed(g.w):
            w.trainer_ended(0)
        assert all(w.wait(10) for w in g.w)
        assert not any(e.is_set() for e in g.stops.values())
        assert [w.state()["state"] for w in g.w] == ["succeeded"] * 3 and g.hub.first_failure is None
    finally:
        g.close()


def test_rank_0_failing_stops_the_members() -> None:
    g = _Gang(n=2)
    try:
        g.joined()
        g.hub.trainer_ended(-9)
        assert g.stops["node-2"].wait(10) and not g.stops["node-1"].is_set()
        assert g.w[1].first_failure == {"host": "node-1", "how": "signal 9"}
    finally:
        g.close()


def test_lines_without_the_secret_are_ignored() -> None:
    """A stranger on the network: a join with a wrong MAC, then a forged 'failed' line; and a member
    session's own line altered or replayed. None of them stops anything."""
    g = _Gang(n=2)
    try:
        g.joined()
        s = socket.create_connection(("127.0.0.1", g.hub.port), timeout=5)
        hello = s.recv(200).decode().split()
        assert hello[0] == "hello"
        s.sendall(f"join 1 {'ab' * 16} {'00' * 32}\n".encode())
        try:  # the hub may already have closed the stranger's connection after its bad join (then: a reset)
            s.sendall(f"1 failed exit 1 {'00' * 32}\n".encode())
        except (ConnectionResetError, BrokenPipeError):
            pass
        wrong = _mac(b"x" * 32, "join", "run-1", hello[1], 1, "cd" * 16)
        s2 = socket.create_connection(("127.0.0.1", g.hub.port), timeout=5)
        h2 = s2.recv(200).decode().split()
        s2.sendall(f"join 1 {'cd' * 16} {_mac(b'x' * 32, 'join', 'run-1', h2[1], 1, 'cd' * 16)}\n".encode())
        assert wrong  # a MAC under another secret
        s3 = socket.create_connection(("127.0.0.1", g.hub.port), timeout=5)
        s3.recv(200)
        s3.sendall("join ² \u00e9 \u00e9\n".encode() + b"\xff\xfe\n")  # not ASCII, not UTF-8
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sum(e["event"] == "bad-line" for e in g.hub.events) < 3:
            time.sleep(0.05)
        assert sum(e["event"] == "bad-line" for e in g.hub.events) >= 3
        s3.close()
        time.sleep(0.5)
        assert g.hub.first_failure is None and not any(e.is_set() for e in g.stops.values())
        s.close()
        s2.close()
        # the channel itself: a tampered payload and a replayed line are refused
        secret = b"k" * 32
        a, b = socket.socketpair()
        tx, rx = _Chan(a, secret, "sess", "m", "h"), _Chan(b, secret, "sess", "h", "m")
        tx.send("hb")
        tx.send("failed exit 1")
        first, second = b.recv(1000).decode().splitlines()[:2]
        assert rx.check(first) == "hb" and rx.check(first) is None  # replayed: old SEQ
        assert rx.check(second.replace("exit 1", "exit 2")) is None and rx.check(second) == "failed exit 1"
        a.close()
        b.close()
    finally:
        g.close()


def test_a_member_that_never_joins_is_lost() -> None:
    stopped = threading.Event()
    hub = GangWatch(0, ["node-1", "node-2"], "127.0.0.1", 0, secrets.token_bytes(32), stopped.set, bind="127.0.0.1",
                    interval=0.1, silence=1.0, join_timeout=1.0).start()
    try:
        assert stopped.wait(10)
        assert hub.first_failure == {"host": "node-2", "how": "lost"} and hub.state()["members"] == {"node-2": "lost"}
    finally:
        hub.close()


def _spawn(rank: int, hosts: list[str], port: int, secret: bytes, command: list[str],
           **kw: Any) -> subprocess.Popen[str]:
    spec = dict(FAST, rank=rank, hosts=hosts, hub="127.0.0.1", port=port, secret=secret.hex(), gang_id="run-p",
                command=command, stop_grace=2, linger=20, **kw)
    p = subprocess.Popen([sys.executable, "-m", "remote.gang.watch"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    assert p.stdin is not None
    p.stdin.write(json.dumps(spec) + "\n")
    p.stdin.close()
    p.stdin = None  # communicate() later reads stdout only
    return p


def _events(p: subprocess.Popen[str], timeout: float = 40) -> list[dict[str, Any]]:
    out, _ = p.communicate(timeout=timeout)
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


@pytest.mark.parametrize("how", ["SIGSTOP", "SIGKILL"])
def test_a_silent_member_process_is_declared_lost_and_the_others_stop(how: str) -> None:
    """Real processes: a hub and two members, each running `sleep 60` under remote.gang.watch. One
    member process is frozen (SIGSTOP: no FIN, no heartbeat) or killed (its trainer keeps running,
    orphaned, as when a supervisor dies): the hub declares it lost and every other trainer stops."""
    hosts, secret, port = ["node-1", "node-2", "node-3"], secrets.token_bytes(32), _free_port()
    procs = [_spawn(i, hosts, port, secret, ["sleep", "60"]) for i in range(3)]
    orphan: list[int] = []
    try:
        assert procs[0].stdout is not None and procs[2].stdout is not None
        orphan.append(json.loads(procs[2].stdout.readline())["pid"])
        # wait until both members joined (the hub prints its events)
        joined = 0
        while joined < 2:
            ev = json.loads(procs[0].stdout.readline())
            joined += ev["event"] == "joined"
        os.kill(procs[2].pid, getattr(signal, how))
        hub_events = [ev for ev in (json.loads(ln) for ln in procs[0].stdout)]
        procs[0].wait(30)
        m1 = _events(procs[1])
        lost = [e for e in hub_events if e["event"] == "member-lost"]
        assert lost and lost[0]["host"] == "node-3"
        final = [e for e in hub_events if e["event"] == "final"][0]
        assert final["state"]["first_failure"] == {"host": "node-3", "how": "lost"}
        assert final["code"] == -signal.SIGTERM  # its sleep was stopped
        m1_final = [e for e in m1 if e["event"] == "final"][0]
        assert m1_final["state"]["first_failure"] == {"host": "node-3", "how": "lost"}
        assert m1_final["code"] == -signal.SIGTERM
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(10)
        if orphan:  # the killed watch's trainer, left running as a dead supervisor leaves it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(orphan[0], signal.SIGKILL)


def test_a_hub_that_vanishes_stops_the_members() -> None:
    hosts, secret, port = ["node-1", "node-2"], secrets.token_bytes(32), _free_port()
    hub = _spawn(0, hosts, port, secret, ["sleep", "60"])
    member = _spawn(1, hosts, port, secret, ["sleep", "60"])
    assert hub.stdout is not None
    orphan = json.loads(hub.stdout.readline())["pid"]
    try:
        assert member.stdout is not None
        while json.loads(member.stdout.readline())["event"] != "joined":
            pass
        os.kill(hub.pid, signal.SIGSTOP)  # frozen: no heartbeat, no FIN
        evs = [json.loads(ln) for ln in member.stdout]
        member.wait(30)
        assert [e for e in evs if e["event"] == "hub-lost"][0]["host"] == "node-1"
        final = [e for e in evs if e["event"] == "final"][0]
        assert final["state"]["first_failure"] == {"host": "node-1", "how": "lost"} and final["code"] == -signal.SIGTERM
    finally:
        os.kill(hub.pid, signal.SIGCONT)
        for p in (hub, member):
            if p.poll() is None:
                p.kill()
                p.wait(10)
        with contextlib.suppress(ProcessLookupError):  # the hub may have ended it once it woke up
            os.killpg(orphan, signal.SIGKILL)  # the frozen hub's trainer


def test_a_failing_member_process_stops_the_others() -> None:
    hosts, secret, port = ["node-1", "node-2", "node-3"], secrets.token_bytes(32), _free_port()
    procs = [_spawn(0, hosts, port, secret, ["sleep", "60"]), _spawn(1, hosts, port, secret, ["sleep", "60"]),
             _spawn(2, hosts, port, secret, ["sh", "-c", "sleep 2; exit 7"])]
    try:
        finals = [[e for e in _events(p) if e["event"] == "final"][0] for p in procs]
        assert [f["code"] for f in finals] == [-signal.SIGTERM, -signal.SIGTERM, 7]
        assert all(f["state"]["first_failure"] == {"host": "node-3", "how": "exit 7"} for f in finals)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


# --------------------------------------------------------------------------- on the testbed (2 real nodes)
@pytest.mark.testbed
def test_the_gang_checks_on_two_real_nodes(testbed2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Over SSH on two testbed nodes: the address check passes when node-b reaches node-a's
    gang address, and fails naming both nodes with a wrong private_address; the preflight names
    the node whose provision record has another torch; the node finds the interface for gloo."""
    from orchestrator.agent import run_module
    from orchestrator.config.models import load_inventory
    from orchestrator.transport import open_connection
    from orchestrator.transport.resolve import resolve_host
    from tests._runs_fixtures import inventory_copy

    inv, p = load_inventory(inventory_copy(testbed2, tmp_path))
    a, b = (resolve_host(inv, n.name, p) for n in testbed2.nodes)
    conns = {a.name: open_connection(a), b.name: open_connection(b)}
    port = _free_port() if not testbed2.isolated else 29400

    def check(hosts: list[ResolvedHost]) -> list[str]:
        plan = plan_gang(_job(nodes=2, rdzv_port=port), hosts, "gang-check")
        token, out = secrets.token_hex(8), {}
        ports = [plan.rdzv_port, plan.watch_port]

        def call(n: Any) -> None:
            req = ({"op": "listen", "ports": ports, "token": token, "expect": 1, "window": 8} if n.rank == 0 else
                   {"op": "connect", "address": plan.master.address, "ports": ports, "token": token, "rank": n.rank,
                    "window": 4, "connect_timeout": 2})
            out[n.host] = run_module(conns[n.host], "remote.gang", req, timeout=60)

        threads = [threading.Thread(target=call, args=(n,)) for n in plan.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        return address_problems(plan, out)

    try:
        assert check([a, b]) == []
        wrong = a.replace(private_address="127.0.0.1")  # node-b's own loopback: not node-a
        probs = check([wrong, b])
        assert len(probs) == 1 and probs[0].startswith(f"{b.name} cannot reach {a.name} at 127.0.0.1:{port}: ")
        assert "refused" in probs[0] and f"hosts.{a.name}.private_address" in probs[0]
        # preflight: provision records written as remote/env/provision.py writes them, one torch differs
        facts = {}
        for h, torch in ((a, "2.11.0"), (b, "2.10.0")):
            rec = json.dumps({"ok": True, "python": "3.12.3", "packages_after": {"torch": torch}})
            r = testbed2.ssh(testbed2.node(h.name), "mkdir -p /workspace/.dfo/provision && cat > "
                             f"/workspace/.dfo/provision/g.json <<'EOF'\n{rec}\nEOF\n")
            assert r.returncode == 0, r.stderr
            facts[h.name] = run_module(conns[h.name], "remote.gang", {"op": "facts", "workspace": "/workspace",
                                                                     "job": "g", "manifests": {}}, timeout=60)
        assert preflight_problems("g", facts) == [f"{b.name}: torch 2.10.0, {a.name} has 2.11.0"]
        ifname = run_module(conns[b.name], "remote.gang", {"op": "iface", "address": b.gang_address}, timeout=60)
        if testbed2.isolated:
            shown = testbed2.node_exec(testbed2.node(b.name), "ip -o addr show").stdout
            assert ifname["ifname"] and ifname["ifname"] != "lo" and f" {ifname['ifname']} " in shown
            assert b.gang_address in shown
        else:
            assert ifname["ifname"] == "lo"
    finally:
        for c in conns.values():
            c.close()
        for n in testbed2.nodes:
            testbed2.ssh(n, "rm -f /workspace/.dfo/provision/g.json")


def test_gpu_count_is_what_the_driver_lists_within_cuda_visible_devices(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """nproc_per_node: auto takes the node's GPU count from the facts op when the inventory gives none."""
    from remote.gang.ops import gpu_count

    assert gpu_count(str(tmp_path / "none")) == 0  # no NVIDIA driver: 0 GPUs (auto then means 1 process)
    for i in range(4):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_count(str(tmp_path)) == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    assert gpu_count(str(tmp_path)) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpu_count(str(tmp_path)) == 0
