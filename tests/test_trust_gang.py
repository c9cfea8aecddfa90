"""Issue 19, finding 5: nobody outside a gang can break it through its hub (remote/gang/watch.py), and the
address check's listen op (remote/gang/ops.py) works whatever the number of descriptors.

The hub binds rank 0's gang address only; connections that have not joined are capped (in all and per
address) and timed out quickly, the excess closed at once; the accept loop outlives EMFILE/ENFILE/ENOBUFS;
the watch raises its soft open-file limit; finished threads are dropped. On the testbed a node outside the
gang floods the hub with 2,000 connections while a gang of 2 runs and a member's connection is cut: the
member rejoins, the hub still accepts, and the gang succeeds.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.testbed import Testbed
from remote.gang import ops as rgang
from remote.gang.watch import GangWatch
from remote.gang.wire import _Chan, _lines, _mac, _read_line, _same
from tests._runs_fixtures import dfo, inventory_copy
from tests.conftest import start_testbed
from tests.test_gang import NODE, provision_record

ROOT = Path(__file__).resolve().parent.parent
# a watch thread that dies on a stranger's bytes is a failure here, not a warning
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _wait(cond: Any, timeout: float, what: Any) -> None:
    """Wait for cond(); else fail with ``what`` (a callable: computed then)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.05)


def _open_idle(port: int, n: int, source: str | None = None) -> list[socket.socket]:
    """n connections to 127.0.0.1:port that never say anything (non-blocking connects: a full accept
    queue does not hold the test up), from ``source`` (a 127.x.y.z address) when given."""
    out = []
    for _ in range(n):
        s = socket.socket()
        if source is not None:
            s.bind((source, 0))
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        out.append(s)
    return out


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return True
    except (BlockingIOError, InterruptedError):
        return False
    except (ConnectionResetError, ConnectionAbortedError):
        return True
    except OSError:  # not connected yet (a SYN still in flight): not closed by the hub
        return False


# --------------------------------------------------------------------------- the hub, in threads on localhost
def test_the_hub_closes_strangers_beyond_the_cap_at_once_and_times_out_the_rest() -> None:
    """300 idle connections that never join: the excess is closed at once, the rest within the hello
    timeout; the hub does not keep a thread per stranger; a member whose connection drops meanwhile
    rejoins, and the gang never fails."""
    hosts, secret = ["node-1", "node-2"], secrets.token_bytes(32)
    stops = {h: threading.Event() for h in hosts}
    opts = {"interval": 0.2, "silence": 15.0, "join_timeout": 15.0}
    hub = GangWatch(0, hosts, "127.0.0.1", 0, secret, stops["node-1"].set, gang_id="g", bind="127.0.0.1",
                    **opts).start()
    member = GangWatch(1, hosts, "127.0.0.1", hub.port, secret, stops["node-2"].set, gang_id="g", **opts).start()
    strangers: list[socket.socket] = []
    try:
        _wait(lambda: hub.members[1]["state"] == "running", 10, "the member did not join")
        threads_before = threading.active_count()
        # from an address of their own: 127.0.0.1 is the member's, whose newcomers are admitted apart (issue 32)
        strangers = _open_idle(hub.port, 300, source="127.0.0.9")
        time.sleep(2)
        at_once = sum(_closed_by_peer(s) for s in strangers)
        peak_threads = threading.active_count() - threads_before
        # the member's connection drops: it reconnects and joins again while the strangers are there
        joined = sum(e["event"] == "joined" for e in hub.events)
        assert member.chan is not None
        member.chan.close()
        _wait(lambda: sum(e["event"] == "joined" for e in hub.events) > joined, 15,
              lambda: f"the member did not rejoin: {hub.state()} {hub.events[-5:]}")
        _wait(lambda: all(_closed_by_peer(s) for s in strangers), 10,
              lambda: f"strangers were not timed out: {sum(not _closed_by_peer(s) for s in strangers)} of 300 open")
        assert at_once >= 200, f"only {at_once} of 300 strangers closed within 2 s (the excess is closed at once)"
        assert peak_threads <= 5, f"{peak_threads} more threads with 300 strangers connected"
        assert hub.first_failure is None and not any(e.is_set() for e in stops.values())
        assert hub.state()["members"] == {"node-2": "running"}
        assert len(hub._threads) <= 5, f"the hub keeps {len(hub._threads)} threads"  # finished ones are dropped
        member.trainer_ended(0)
        hub.trainer_ended(0)
        assert hub.wait(10) and member.wait(10)
        assert hub.state()["state"] == "succeeded"
    finally:
        for s in strangers:
            s.close()
        hub.close()
        member.close()


HUB_UNDER_LIMIT = """\
import json, resource, sys
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
from remote.gang.watch import _run
sys.exit(_run(json.loads(sys.stdin.readline())) and 0)
"""


def test_the_hub_keeps_accepting_after_running_out_of_descriptors(tmp_path: Path) -> None:
    """A hub process whose hard open-file limit is tiny (12): strangers make accept() fail with EMFILE;
    the hub backs off and goes on accepting, so the member that drops meanwhile rejoins and the gang
    succeeds. Its soft limit (8 at start) is raised to the hard limit."""
    hosts, secret, port = ["node-1", "node-2"], secrets.token_bytes(32), _free_port()
    done = tmp_path / "rank0-may-end"  # rank 0's trainer runs until the test has seen the rejoin
    wait = f"for i in $(seq 600); do [ -e {shlex.quote(str(done))} ] && exit 0; sleep 0.1; done; exit 1"
    spec = {"rank": 0, "hosts": hosts, "hub": "127.0.0.1", "port": port, "secret": secret.hex(), "gang_id": "g",
            "command": ["sh", "-c", wait], "interval": 0.2, "silence": 20, "join_timeout": 20, "linger": 20}
    hub = subprocess.Popen([sys.executable, "-c", HUB_UNDER_LIMIT, "8", "12"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert hub.stdin is not None and hub.stdout is not None
    hub.stdin.write(json.dumps(spec) + "\n")
    hub.stdin.close()
    events: list[dict[str, Any]] = []

    def read() -> None:
        assert hub.stdout is not None
        for ln in hub.stdout:
            if ln.startswith("{"):
                events.append(json.loads(ln))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stop = threading.Event()
    member = GangWatch(1, hosts, "127.0.0.1", port, secret, stop.set, gang_id="g", interval=0.2, silence=20,
                       join_timeout=20).start()
    strangers: list[socket.socket] = []
    try:
        _wait(lambda: any(e["event"] == "joined" for e in events), 20, lambda: f"the member did not join: {events}")
        strangers = _open_idle(port, 200)
        time.sleep(1)
        assert member.chan is not None
        member.chan.close()  # the member's connection drops while the hub is out of descriptors
        _wait(lambda: sum(e["event"] == "joined" for e in events) >= 2, 20,
              lambda: f"the member did not rejoin: {[e for e in events if e['event'] != 'bad-line'][-8:]}")
        member.trainer_ended(0)
        done.touch()
        _wait(lambda: hub.poll() is not None, 40, "the hub did not end")
        reader.join(5)
        final = [e for e in events if e["event"] == "final"][0]
        assert final["state"]["first_failure"] is None and final["state"]["state"] == "succeeded", final
        assert not stop.is_set()
        start = [e for e in events if e["event"] == "start"][0]
        assert start["nofile"] == 12, start  # the soft limit raised to the hard one
        assert any(e["event"] == "accept-error" for e in events), "the flood never hit the descriptor limit"
    finally:
        for s in strangers:
            s.close()
        member.close()
        if hub.poll() is None:
            hub.kill()
            hub.wait(10)


# --------------------------------------------------------------------------- the address check's listen op
LISTEN_WITH_MANY_FDS = """\
import json, os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
assert max(held) > 1024
from remote.gang.ops import listen
print("ready", flush=True)
print(json.dumps(listen(json.loads(sys.argv[1]))), flush=True)
"""


def test_the_listen_op_works_above_1024_descriptors_and_bounds_the_sockets_it_holds() -> None:
    """The listen op in a process that already holds 1,100 descriptors (select() fails above 1,024):
    300 idle connections hold at most a bounded number of its descriptors, and the peer's check passes."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1500:
        pytest.skip(f"the hard open-file limit is {hard}: cannot hold 1,100 descriptors plus the test's")
    token = secrets.token_hex(8)
    for _ in range(5):  # a free port can be taken by another test's process before the op binds it: new ports
        ports = [_free_port(), _free_port()]
        req = {"ports": ports, "token": token, "expect": 1, "window": 30}
        p = subprocess.Popen([sys.executable, "-c", LISTEN_WITH_MANY_FDS, json.dumps(req)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        _wait(lambda p=p, ports=ports: p.poll() is not None or _listening(ports[0]), 10, "the listen op did not listen")
        if p.poll() is None:
            break
        out, err = p.communicate(timeout=10)
        assert p.returncode == 0 and '"ok": false' in out and "in use" in out, out + err[-2000:]
    strangers: list[socket.socket] = []
    try:
        assert p.poll() is None, "the listen op could not bind two free ports in 5 tries"
        strangers = _open_idle(ports[0], 300) + _open_idle(ports[1], 300)
        most = 0
        for _ in range(20):
            time.sleep(0.1)
            if p.poll() is not None:
                break
            most = max(most, len(os.listdir(f"/proc/{p.pid}/fd")))
        got = rgang.connect({"address": "127.0.0.1", "ports": ports, "token": token, "rank": 1, "window": 20})
        out, err = p.communicate(timeout=40)
        assert p.returncode == 0, err[-2000:]
        res = json.loads(out.strip().splitlines()[-1])
        assert got == {"ok": True, "port": None, "error": None}, got
        assert res["ok"] and res["peers"] == {str(q): ["1"] for q in ports}, res
        assert most - 1100 <= 150, f"the listen op held {most - 1100} descriptors for 600 idle connections"
    finally:
        for s in strangers:
            s.close()
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_the_hub_and_its_check_listen_on_the_gang_address_never_on_every_address() -> None:
    """bind_address: the gang address when it is the node's; a NAT'd one: the node's address toward a member;
    else None, and then the watch refuses to start and the check says why (nothing listens everywhere)."""
    from remote.gang.door import bind_address

    assert bind_address("127.0.0.1") == "127.0.0.1" and bind_address("localhost") in ("127.0.0.1", "::1")
    assert bind_address("192.0.2.77", peer="127.0.0.1") == "127.0.0.1"  # not ours: the route to the member
    assert bind_address("192.0.2.77") is None and bind_address("0.0.0.0") is None
    with pytest.raises(OSError, match="not an address of this node"):
        GangWatch(0, ["node-1", "node-2"], "192.0.2.77", 0, secrets.token_bytes(32), lambda: None).start()
    one = GangWatch(0, ["node-1"], "192.0.2.77", 0, secrets.token_bytes(32), lambda: None).start()
    assert one._listener is None  # a gang of one has no member to hear: nothing listens
    one.close()
    port = _free_port()
    req = {"ports": [port], "token": "t", "expect": 1, "window": 1, "bind": {"ports": [port], "address": "192.0.2.77"}}
    got = rgang.listen(req)
    assert not got["ok"] and got["port"] == port and "not an address of this node" in got["error"], got


# --------------------------------------------------------------------------- issue 32, item 4: members never wait
# Strangers from many addresses, each connection opened again as soon as the hub drops it: a separate process
# (no GIL shared with the hub's thread) whose sockets are bound to 127.x.y.z loopback addresses, which Linux
# gives every process. It notes how many of its connections hold a slot (got the hub's hello, still open).
STRANGERS = """\
import json, os, resource, selectors, socket, sys, time
host, port, plan, status = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
sel = selectors.DefaultSelector()
n = {"opened": 0, "greeted": 0, "closed_by_hub": 0, "holding": 0}
held = set()

def one(src):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((src, 0))
    s.setblocking(False)
    s.connect_ex((host, port))
    sel.register(s, selectors.EVENT_READ, src)
    n["opened"] += 1

def gone(s, src):
    sel.unregister(s)
    s.close()
    if s in held:
        held.discard(s)
    n["closed_by_hub"] += 1
    one(src)  # taken again at once

for src, count in plan:
    for _ in range(count):
        one(src)
last = 0.0
while not os.path.exists(status + ".stop"):
    for key, _ in sel.select(0.05):
        s, src = key.fileobj, key.data
        try:
            data = s.recv(4096)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if data:
            if s not in held:
                held.add(s)
                n["greeted"] += 1
        else:
            gone(s, src)
    now = time.monotonic()
    if now - last > 0.1:
        last = now
        n["holding"] = len(held)
        with open(status + ".tmp", "w") as f:
            json.dump(n, f)
        os.replace(status + ".tmp", status)
"""


def _strangers(tmp: Path, port: int, plan: list[tuple[str, int]]) -> tuple[subprocess.Popen[str], Path]:
    status = tmp / f"strangers-{secrets.token_hex(3)}.json"
    p = subprocess.Popen([sys.executable, "-c", STRANGERS, "127.0.0.1", str(port), json.dumps(plan), str(status)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return p, status


def _stranger_stats(status: Path) -> dict[str, int]:
    try:
        return dict(json.loads(status.read_text()))
    except (OSError, ValueError):
        return {}


def _member_gets_in(port: int, secret: bytes, source: str, within: float, interval: float) -> float | None:
    """Rank 1 of gang "g" joins the hub from ``source`` as a member does (remote/gang/watch.py ``_join``: the
    MAC'd hello, the MAC'd join; a refused or dropped try is tried again after min(1, interval) s) until the hub
    sends it a valid line (its heartbeat). Seconds it took, or None when not within ``within`` s."""
    t0 = time.monotonic()
    deadline = t0 + within
    while time.monotonic() < deadline:
        s = socket.socket()
        try:
            s.bind((source, 0))
            s.settimeout(max(0.05, deadline - time.monotonic()))
            s.connect(("127.0.0.1", port))
            hello = _read_line(s, max(0.05, deadline - time.monotonic())) or ""
            parts = hello.split(" ")
            if len(parts) == 3 and parts[0] == "hello" and _same(parts[2], _mac(secret, "hello", "g", parts[1])):
                mine = secrets.token_hex(16)
                s.sendall(f"join 1 {mine} {_mac(secret, 'join', 'g', parts[1], 1, mine)}\n".encode())
                chan = _Chan(s, secret, parts[1] + mine, "m", "h")
                buf = b""
                while time.monotonic() < deadline:
                    lines, buf, eof = _lines(s, buf, min(0.1, max(0.01, deadline - time.monotonic())))
                    if any(chan.check(ln) == "hb" for ln in lines):
                        return time.monotonic() - t0
                    if eof:
                        break
        except OSError:
            pass
        finally:
            s.close()
        time.sleep(min(1.0, interval))
    return None


@pytest.mark.parametrize("known", ["planned", "joined-before"])
def test_a_member_gets_in_while_strangers_from_64_addresses_hold_every_slot(tmp_path: Path, known: str) -> None:
    """Issue 32, item 4. Strangers from 64 addresses (127.0.1.1-64, two connections each, every one opened again
    as soon as the hub drops it) hold all 64 stranger slots of a real hub door. A member with the right secret,
    from its own address, gets in within 2 s, every one of 10 tries (it was 0 in 98 over 20 s). Its address is
    known to the hub from the gang's addresses (``planned``), or learned from the member's earlier join."""
    secret, interval = secrets.token_bytes(32), 0.2
    member = "127.0.0.2" if known == "planned" else "127.0.0.3"
    addrs = ["127.0.0.1", "127.0.0.2"] if known == "planned" else None
    hub = GangWatch(0, ["node-1", "node-2"], "127.0.0.1", 0, secret, lambda: None, gang_id="g", bind="127.0.0.1",
                    interval=interval, silence=30, join_timeout=30, addrs=addrs).start()
    strangers = None
    try:
        if known == "joined-before":  # its first join, before any stranger came (as a gang starts)
            assert _member_gets_in(hub.port, secret, member, 5, interval) is not None
        strangers, status = _strangers(tmp_path, hub.port, [(f"127.0.1.{i}", 2) for i in range(1, 65)])
        _wait(lambda: _stranger_stats(status).get("holding", 0) >= 64 and hub.noise.get("busy", 0) >= 64, 10,
              lambda: f"the strangers do not hold the 64 slots: {_stranger_stats(status)} {hub.noise}")
        took = [_member_gets_in(hub.port, secret, member, 2.0, interval) for _ in range(10)]
        stats = _stranger_stats(status)
        assert all(t is not None for t in took), f"the member got in {sum(t is not None for t in took)} of 10 times " \
                                                 f"within 2 s: {took}; strangers: {stats}"
        assert stats["holding"] >= 64 and stats["closed_by_hub"] >= 64, stats  # they held the pool all along
        assert hub.state()["members"] == {"node-2": "running"} and hub.first_failure is None
    finally:
        if strangers is not None:
            Path(str(status) + ".stop").touch()
            strangers.wait(10)
        hub.close()


def test_a_stranger_on_a_members_own_address_cannot_keep_the_member_out(tmp_path: Path) -> None:
    """Issue 32, item 4: whoever else connects from the member's own address (a process on its node, or a
    spoofer that completes TCP handshakes) holds 300 connections there, each opened again as soon as the hub
    drops it, while strangers from 64 other addresses hold their pool. The member still gets in within 2 s,
    every one of 10 tries: a newcomer from a member's address is never refused, and the oldest pending
    connection of that address gives way (128 at most pending from it, joins read between accept batches)."""
    secret, interval = secrets.token_bytes(32), 0.2
    hub = GangWatch(0, ["node-1", "node-2"], "127.0.0.1", 0, secret, lambda: None, gang_id="g", bind="127.0.0.1",
                    interval=interval, silence=30, join_timeout=30, addrs=["127.0.0.1", "127.0.0.2"]).start()
    strangers = None
    try:
        plan = [("127.0.0.2", 300)] + [(f"127.0.1.{i}", 2) for i in range(1, 65)]
        strangers, status = _strangers(tmp_path, hub.port, plan)
        _wait(lambda: _stranger_stats(status).get("holding", 0) >= 64, 10,
              lambda: f"the strangers do not hold their slots: {_stranger_stats(status)} {hub.noise}")
        took = [_member_gets_in(hub.port, secret, "127.0.0.2", 2.0, interval) for _ in range(10)]
        stats = _stranger_stats(status)
        assert all(t is not None for t in took), f"the member got in {sum(t is not None for t in took)} of 10 times " \
                                                 f"within 2 s: {took}; strangers: {stats}"
        assert stats["closed_by_hub"] >= 300, stats  # the member's address was contested all along
        assert hub.state()["members"] == {"node-2": "running"} and hub.first_failure is None
    finally:
        if strangers is not None:
            Path(str(status) + ".stop").touch()
            strangers.wait(10)
        hub.close()


def test_the_pools_a_newcomer_meets() -> None:
    """_Pending alone: strangers share 64 slots (8 per address, the address holding the most gives way to one
    holding fewer, else the newcomer is refused); a member's address is admitted apart, never refused, and
    takes its own oldest slot when it holds 128; an address learned later counts for newcomers from then on."""
    from remote.gang.door import MEMBER_PENDING_PER_ADDR, _Pending

    p = _Pending(members={"10.0.0.2"})
    socks = [object() for _ in range(64)]
    for i, s in enumerate(socks):
        assert p.admit(s, f"10.9.0.{i}") == (True, None)
    assert p.admit(object(), "10.9.1.1") == (False, None)  # every address holds one: refused
    firsts = [object() for _ in range(MEMBER_PENDING_PER_ADDR)]
    for s in firsts:
        assert p.admit(s, "10.0.0.2") == (True, None)  # outside the strangers' 64
    late = object()
    assert p.admit(late, "10.0.0.2") == (True, firsts[0])  # its own oldest gives way, no stranger's
    assert len(p) == 64 + MEMBER_PENDING_PER_ADDR and p.strangers == 64
    assert p.oldest() in socks  # out of descriptors: a stranger goes first
    p.members.add("10.9.1.1")
    assert p.admit(object(), "10.9.1.1") == (True, None)


# --------------------------------------------------------------------------- on the testbed: an outside host
FLOOD = """\
import json, os, resource, selectors, socket, sys, time
host, port, total, seconds, status = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
sel = selectors.DefaultSelector()
n = {"opened": 0, "connected": 0, "closed_by_hub": 0, "open": 0, "most": 0}
since = {}  # a connection still connecting -> when it started: after 1 s it is dropped and opened again

def one():
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex((host, port))
    sel.register(s, selectors.EVENT_WRITE, n["opened"] % 5 == 0)  # every 5th talks (a bad join), the rest idle
    since[s] = time.monotonic()
    n["opened"] += 1
    n["open"] += 1

def gone(s):
    sel.unregister(s)
    since.pop(s, None)
    s.close()
    n["open"] -= 1

end, last = time.monotonic() + seconds, 0.0
while time.monotonic() < end:
    budget = 200  # at most 200 new connections per round (a round is >= 0.1 s)
    while n["open"] < total and budget:
        one()
        budget -= 1
    n["most"] = max(n["most"], n["open"])
    for key, ev in sel.select(0.1):
        s = key.fileobj
        if s in since:  # connecting: done, or failed
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                gone(s)
            else:
                del since[s]
                n["connected"] += 1
                sel.modify(s, selectors.EVENT_READ, key.data)
            continue
        try:
            data = s.recv(4096)
        except OSError:
            data = b""
        if data and key.data:
            try:
                s.send(b"join 1 " + b"ab" * 16 + b" " + b"00" * 32 + b"\\n")
            except OSError:
                pass
            sel.modify(s, selectors.EVENT_READ, False)
        elif not data:
            gone(s)
            n["closed_by_hub"] += 1
    now = time.monotonic()
    for s in [s for s, t in since.items() if now - t > 1.0]:  # a SYN the hub's full queue dropped: try anew
        gone(s)
    if now - last > 0.5:
        last = now
        with open(status + ".tmp", "w") as f:
            json.dump(n, f)
        os.replace(status + ".tmp", status)
with open(status + ".tmp", "w") as f:
    json.dump(dict(n, done=True), f)
os.replace(status + ".tmp", status)
"""


@pytest.fixture(scope="module")
def tb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    tb = start_testbed(tmp_path_factory.mktemp("trust-gang"), nodes=3, s3=False)
    try:
        if not tb.isolated:
            pytest.skip("an outside host needs namespace nodes (root)")
        # a rented node's usual soft open-file limit: 1,024 (the hard one stays as it is)
        for n in tb.nodes:
            r = tb.node_exec(n.name, "ss -Hltnp 'sport = :22'")
            pid = int(re.findall(r"pid=(\d+)", r.stdout)[0])
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (1024, resource.prlimit(pid, resource.RLIMIT_NOFILE)[1]))
        yield tb
    finally:
        tb.stop()


def _gang_of_two(tb: Testbed, tmp: Path, steps: int) -> tuple[Path, int]:
    """A gang job over node-1 (rank 0) and node-2; node-3 is outside it. Returns (job file, watch port)."""
    name = f"tg-{secrets.token_hex(3)}"
    (tmp / "node.py").write_text(NODE)
    rdzv = 29400 + secrets.randbelow(500) * 2
    doc = {"name": name, "venv": "/usr",
           "run": {"workdir": "/root/gang-test", "upload": ["node.py"], "command": "python3 node.py", "wait": 0,
                   "nodes": 2, "launcher": "none", "rdzv_port": rdzv, "stop_grace": 5, "env": {"STEPS": str(steps)}}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    for n in ("node-1", "node-2"):
        provision_record(tb, n, name)
    return path, rdzv + 1


def _launch(tb: Testbed, inv: Path, job: Path) -> str:
    r = dfo(inv, "launch", "-H", "node-1", "-H", "node-2", "-j", str(job), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    return str(json.loads(r.stdout)["hosts"]["node-1"]["run"])


def _hub_record(tb: Testbed, run: str) -> dict[str, Any]:
    r = tb.node_exec("node-1", f"cat /workspace/.dfo/runs/{run}/gang.json 2>/dev/null")
    try:
        return dict(json.loads(r.stdout))
    except ValueError:
        return {}


def _gang_status(inv: Path, run: str) -> dict[str, Any]:
    r = dfo(inv, "status", "-H", "node-1", "-H", "node-2", run, "--json")
    return dict(json.loads(r.stdout)["gang"])


def _wait_ended(inv: Path, run: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        g = _gang_status(inv, run)
        if g["state"] != "running":
            return g
        assert time.monotonic() < deadline, f"the gang did not end within {timeout}s: {g}"
        time.sleep(1)


def _hello_from(tb: Testbed, node: str | None, address: str, port: int) -> str:
    """The first line the hub sends to a connection from ``node`` (None: the controller), or the error."""
    code = (f"import socket\ntry:\n    s = socket.create_connection(({address!r}, {port}), timeout=5)\n"
            "    s.settimeout(5)\n    print(s.recv(200).decode().split(' ')[0] or 'closed')\n"
            "except OSError as e:\n    print(type(e).__name__)\n")
    if node is None:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30).stdout.strip()
    r = tb.node_exec(node, f"python3 - <<'EOF'\n{code}EOF\n")
    return r.stdout.strip() or r.stderr.strip()


@pytest.mark.testbed
@pytest.mark.timeout(400)
def test_a_flood_from_outside_the_gang_does_not_break_it(tb: Testbed, tmp_path: Path) -> None:
    """node-3, outside a gang of node-1 (hub) and node-2, keeps 2,000 connections open on the hub (idle,
    and some sending a bad join), replacing every one the hub closes, for 40 s; node-2's connection to the
    hub is cut (ss -K) during the flood. node-2 rejoins, the hub still answers a new connection, and the
    gang is never ended as lost: it succeeds. The nodes' soft open-file limit is 1,024, as on many
    rented nodes."""
    inv = inventory_copy(tb, tmp_path)
    job, watch = _gang_of_two(tb, tmp_path, steps=75)
    run = _launch(tb, inv, job)
    hub_addr = tb.node("node-1").address
    flood = None
    try:
        _wait(lambda: _hub_record(tb, run).get("members", {}).get("node-2") == "running", 60, "node-2 never joined")
        w = tb.node_exec("node-3", f"cat > /root/flood.py <<'EOF'\n{FLOOD}EOF\n")
        assert w.returncode == 0, w.stderr
        r = tb.node_exec("node-3", f"nohup python3 /root/flood.py {hub_addr} {watch} 2000 40 /root/flood.json "
                                   "> /root/flood.log 2>&1 & echo $!")
        flood = int(r.stdout.strip())
        time.sleep(8)  # the flood is on
        cut = time.time()
        k = tb.node_exec("node-2", f"ss -K dst {hub_addr} dport = :{watch}")
        assert k.returncode == 0 and str(watch) in k.stdout, k.stdout + k.stderr  # one connection cut
        _wait(lambda: any(e.get("event") == "joined" and e.get("host") == "node-2" and e["t"] > cut
                          for e in _hub_record(tb, run).get("events", [])), 40,
              lambda: f"node-2 did not rejoin the hub during the flood: {_hub_record(tb, run)}")
        assert _hello_from(tb, None, hub_addr, watch) == "hello"  # the hub still accepts and answers
        assert _gang_status(inv, run)["state"] == "running"
        _wait(lambda: json.loads(tb.node_exec("node-3", "cat /root/flood.json").stdout or "{}").get("done"), 60,
              lambda: "the flood did not finish: " + tb.node_exec("node-3", "cat /root/flood.log").stdout[-2000:])
        stats = json.loads(tb.node_exec("node-3", "cat /root/flood.json").stdout)
        # thousands of connections, hundreds open at once (far above the hub's 64 pending slots); how close the
        # peak comes to the 2000 asked depends on how fast the hub closes them (1387 in one quiet run)
        assert stats["connected"] >= 2000 and stats["most"] >= 500, stats
        g = _wait_ended(inv, run, 150)
        assert g["state"] == "succeeded" and g["first_failure"] is None, g
    finally:
        if flood is not None:
            tb.node_exec("node-3", f"kill {flood} 2>/dev/null")
        dfo(inv, "stop", "-H", "node-1", "-H", "node-2", run)


@pytest.mark.testbed
def test_the_hub_listens_on_the_gang_address_only(tb: Testbed, tmp_path: Path) -> None:
    """Rank 0's watch listens on its gang address only: a connection to 127.0.0.1 inside node-1 is
    refused, one to node-1's gang address (from node-3, outside the gang) gets the hub's hello. The
    hub's soft open-file limit was raised from the node's 1,024."""
    inv = inventory_copy(tb, tmp_path)
    job, watch = _gang_of_two(tb, tmp_path, steps=20)
    run = _launch(tb, inv, job)
    hub_addr = tb.node("node-1").address
    try:
        _wait(lambda: _hub_record(tb, run).get("members", {}).get("node-2") == "running", 60, "node-2 never joined")
        shown = tb.node_exec("node-1", f"ss -Hltn 'sport = :{watch}'").stdout.split()
        assert f"{hub_addr}:{watch}" in shown, shown
        assert _hello_from(tb, "node-1", "127.0.0.1", watch) == "ConnectionRefusedError"
        assert _hello_from(tb, "node-3", hub_addr, watch) == "hello"
        start = [e for e in _hub_record(tb, run)["events"] if e["event"] == "start"][0]
        assert start["nofile"] > 1024, start
        g = _wait_ended(inv, run, 90)
        assert g["state"] == "succeeded", g
    finally:
        dfo(inv, "stop", "-H", "node-1", "-H", "node-2", run)


@pytest.mark.testbed
@pytest.mark.timeout(300)
def test_strangers_from_64_addresses_never_keep_a_member_out_of_the_hub(tb: Testbed, tmp_path: Path) -> None:
    """Issue 32, item 4, on real nodes: node-3, outside a gang of node-1 (hub) and node-2, takes 64 more
    addresses of the node network and holds every stranger slot of the hub from them (two connections each,
    every one opened again as soon as the hub drops it). node-2's connection to the hub is cut 3 times; each
    time the real member rejoins within 2 s (before: it stayed out, and after 20 s the gang would fail it as
    lost). The hub knows node-2's address from the gang's plan (its start event names it)."""
    inv = inventory_copy(tb, tmp_path)
    job, watch = _gang_of_two(tb, tmp_path, steps=60)
    hub_addr, member_addr = tb.node("node-1").address, tb.node("node-2").address
    extra = [f"{hub_addr.rsplit('.', 1)[0]}.{i}" for i in range(100, 164)]
    add = tb.node_exec("node-3", "; ".join(f"ip addr add {a}/24 dev eth0" for a in extra))
    assert add.returncode == 0, add.stderr
    run, flood = _launch(tb, inv, job), None
    try:
        _wait(lambda: _hub_record(tb, run).get("members", {}).get("node-2") == "running", 60, "node-2 never joined")
        w = tb.node_exec("node-3", f"cat > /root/strangers.py <<'EOF'\n{STRANGERS}EOF\n")
        assert w.returncode == 0, w.stderr
        plan = json.dumps([[a, 2] for a in extra])
        r = tb.node_exec("node-3", f"rm -f /root/strangers.json*; nohup python3 /root/strangers.py {hub_addr} {watch} "
                                   f"'{plan}' /root/strangers.json > /root/strangers.log 2>&1 & echo $!")
        flood = int(r.stdout.strip())

        def stats() -> dict[str, int]:
            return dict(json.loads(tb.node_exec("node-3", "cat /root/strangers.json").stdout or "{}"))

        _wait(lambda: stats().get("holding", 0) >= 64, 20,
              lambda: f"the strangers do not hold the hub's 64 slots: {stats()} "
                      + tb.node_exec("node-3", "cat /root/strangers.log").stdout[-2000:])
        took = []
        for _ in range(3):
            before = sum(e.get("event") == "joined" for e in _hub_record(tb, run).get("events", []))
            cut = time.time()
            k = tb.node_exec("node-2", f"ss -K dst {hub_addr} dport = :{watch}")
            assert k.returncode == 0 and str(watch) in k.stdout, k.stdout + k.stderr  # one connection cut
            _wait(lambda before=before: sum(e.get("event") == "joined"  # type: ignore[misc]
                                            for e in _hub_record(tb, run).get("events", [])) > before, 25,
                  lambda: f"node-2 did not rejoin: {_hub_record(tb, run)} strangers: {stats()}")
            joined = [e for e in _hub_record(tb, run)["events"] if e.get("event") == "joined"]
            took.append(round(joined[before]["t"] - cut, 3))
        s = stats()
        assert all(t < 2.0 for t in took), f"node-2 took {took} s to rejoin; strangers: {s}"
        assert s["holding"] >= 64 and s["closed_by_hub"] >= 64, s  # the strangers held the pool all along
        start = [e for e in _hub_record(tb, run)["events"] if e["event"] == "start"][0]
        assert start["members"] == [member_addr], start
        assert _gang_status(inv, run)["state"] == "running"
    finally:
        if flood is not None:
            tb.node_exec("node-3", f"touch /root/strangers.json.stop; sleep 0.5; kill {flood} 2>/dev/null")
        tb.node_exec("node-3", "; ".join(f"ip addr del {a}/24 dev eth0" for a in extra))
        dfo(inv, "stop", "-H", "node-1", "-H", "node-2", run)
