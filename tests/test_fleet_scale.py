"""A fleet past 16 hosts (issue 35): no cap in the way. A command's hosts all run at once; the bound of
PARALLEL (orchestrator/hosts.py) holds connection set-ups only, never a host's call that then lasts as long
as its run (a launch's watch window, a tail).

The in-process tests use the local transport (fast, no testbed); the gang test runs on real sshd nodes."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator import hosts as hosts_mod
from orchestrator.config.models import load_inventory
from orchestrator.hosts import HostSession
from orchestrator.steps.gang import JOIN_BASE_S, join_limit


def _local_session(tmp_path: Path, n: int) -> HostSession:
    p = tmp_path / "inventory.yaml"
    p.write_text(f"defaults: {{known_hosts: {tmp_path / 'kh'}}}\nhosts:\n"
                 + "".join(f"  h{i:03d}: {{transport: local}}\n" for i in range(n)))
    inv, path = load_inventory(p)
    return HostSession.from_inventory(inv, path, [f"h{i:03d}" for i in range(n)])


def test_every_hosts_call_runs_at_once_past_the_set_up_bound(tmp_path: Path) -> None:
    """40 hosts (more than PARALLEL = 16): each host's call waits until all 40 calls have begun, which
    happens only if no call holds a slot another host waits for. On the old rule (a slot held for the whole
    call) 16 calls wait on a barrier the other 24 never reach."""
    n = 40
    s = _local_session(tmp_path, n)
    barrier = threading.Barrier(n, timeout=20)

    def fn(conn: Any) -> str:
        barrier.wait()
        return conn.name

    outs = s.each(fn)
    assert [o.error for o in outs] == [None] * n, [o.error.message for o in outs if o.error][:3]
    assert [o.value for o in outs] == s.names


def test_connection_set_ups_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound that stays: at most PARALLEL connection set-ups at once (handshakes cost CPU here)."""
    from orchestrator.transport.local import LocalConnection

    lock, now, most = threading.Lock(), [0], [0]

    def establish(self: Any) -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.05)
        with lock:
            now[0] -= 1

    monkeypatch.setattr(LocalConnection, "establish", establish, raising=False)
    s = _local_session(tmp_path, 48)
    outs = s.each(lambda conn: conn.name)
    assert all(o.error is None for o in outs)
    assert 1 < most[0] <= hosts_mod.PARALLEL, most[0]


def test_the_hubs_join_limit_covers_every_wave_of_set_ups() -> None:
    """A hub never gives up on a member dfo has not started: its join limit is JOIN_BASE_S after the last
    wave of connection set-ups (PARALLEL at a time, each bounded by connect_timeout + 10 s)."""
    p = hosts_mod.PARALLEL
    assert join_limit(1, 10) == join_limit(p, 10) == JOIN_BASE_S
    assert join_limit(p + 1, 10) == JOIN_BASE_S + 20
    assert join_limit(256, 10) == JOIN_BASE_S + (256 // p - 1) * 20
    assert join_limit(256, 3) < join_limit(256, 10)


# --------------------------------------------------------------------------- a gang of 32 on the testbed

GANG = 32  # the size: twice the set-up bound (PARALLEL), past what 16 at a time ever let launch


@pytest.mark.testbed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_gang_past_16_nodes_launches_with_the_default_wait(make_testbed: Any, tmp_path: Path) -> None:
    """32 nodes, the job's run.wait left at its default (60 s: launch watches each node that long). On the old
    rule, nodes 17-32 started only once the first 16 watch windows ended, after rank 0's hub had given up
    on them (30 s join limit): exit 5. Now every rank starts at once and the gang succeeds; `dfo tail`
    shows each host's lines."""
    from tests._runs_fixtures import dfo, inventory_copy
    from tests.test_gang import gang_job

    tb = make_testbed(nodes=GANG, s3=False)
    inv = inventory_copy(tb, tmp_path)
    # each rank runs 35 s: past the hub's 30 s join limit, so a rank started after the first 16 windows
    # (60 s, or the run's end) is one the hub has given up on
    job, _ = gang_job(tb, tmp_path, STEPS="35")
    doc = job.read_text().replace("  wait: 0\n", "")
    assert "wait:" not in doc
    job.write_text(doc)
    t0 = time.monotonic()
    r = dfo(inv, "launch", "-H", "testbed", "-j", str(job), "--json", timeout=300)
    took = time.monotonic() - t0
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    hosts = json.loads(r.stdout)["hosts"]
    names = [n.name for n in tb.nodes]
    assert sorted(hosts) == sorted(names)
    run = hosts[names[0]]["run"]
    assert {h["run"] for h in hosts.values()} == {run}
    assert sorted(h["rank"] for h in hosts.values()) == list(range(GANG))
    t = dfo(inv, "tail", "-H", "testbed", run, "-n", "+1", "--no-follow", timeout=120)
    assert t.returncode == 0, (t.stdout + t.stderr)[-4000:]
    for n in tb.nodes:
        mine = [ln for ln in t.stdout.splitlines() if ln.startswith(f"[{n.name}] ")]
        assert mine and mine[0].startswith(f"[{n.name}] rank=") and mine[-1] == f"[{n.name}] step 34", (n.name, mine)
    # the hub's join limit scales with the fleet: two waves of set-ups (32 = 2 x PARALLEL) -> 30 + 1 * (3 + 10) s
    meta = json.loads(tb.node_exec(names[0], f"cat /workspace/.dfo/runs/{run}/meta.json").stdout)
    assert meta["gang"]["join_timeout"] == join_limit(GANG, 3) == 43.0, meta["gang"]
    st = dfo(inv, "status", "-H", "testbed", run, "--json", timeout=120)
    assert json.loads(st.stdout)["gang"]["state"] == "succeeded", st.stdout[-3000:]
    print(f"{GANG}-node gang launched and ended in {took:.1f}s")

    # tail is live on every host: relaunched (12 steps, no watch window), followed at once; each host's first
    # line comes while every run still runs (on the old rule hosts 17-32 showed theirs once the first 16 ended)
    job.write_text(job.read_text().replace("STEPS: '35'", "STEPS: '12'"))
    assert "STEPS: '12'" in job.read_text()
    r = dfo(inv, "launch", "-H", "testbed", "-j", str(job), "--wait", "0", "--json", timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    run2 = json.loads(r.stdout)["hosts"][names[0]]["run"]
    t = dfo(inv, "tail", "-H", "testbed", run2, "-n", "+1", timeout=240)
    assert t.returncode == 0, (t.stdout + t.stderr)[-4000:]
    lines = t.stdout.splitlines()
    first = {n: next(i for i, ln in enumerate(lines) if ln.startswith(f"[{n}] ")) for n in names}
    ended = min(i for i, ln in enumerate(lines) if ln.endswith("] step 11"))
    late = [n for n in names if first[n] > ended]
    assert not late, f"{late}: first line only after a run had ended"
