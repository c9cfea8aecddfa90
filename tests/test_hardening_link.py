"""Issue 10, items 2, 12, 13: liveness on every SSH call, known_hosts edge cases, an empty RUN.

All against real testbed nodes (real sshd); the link is cut with the testbed's link_down.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import threading
import time
from pathlib import Path

import pytest

from orchestrator import testbed_sys as tsys
from orchestrator.config import load_inventory, resolve_host
from orchestrator.connection import ALIVE_DEAD_S, Connection
from orchestrator.errors import HostError
from tests._runs_fixtures import COUNTER, RunsEnv, dfo_popen, inventory_copy
from tests._s3_fixtures import Xfer, random_files, upload

on_testbed = pytest.mark.testbed


def _conn(inv: Path, name: str) -> Connection:
    inventory, _ = load_inventory(inv)
    return Connection(resolve_host(inventory, name, inv))


def _in_thread(fn, *args):  # type: ignore[no-untyped-def]
    """Run fn(*args) on a daemon thread; returns (thread, box) with box["value"] or box["error"]."""
    box: dict[str, object] = {}

    def body() -> None:
        t0 = time.monotonic()
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        box["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=body, daemon=True)
    t.start()
    return t, box


# ------------------------------------------------------------------------------------ item 13


@on_testbed
def test_an_empty_run_id_is_refused_and_stops_nothing(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = RunsEnv(testbed, testbed.nodes[0], inventory_copy(testbed, tmp_path), tmp_path)
    job, _ = env.job("python3 count.py 3000 0.05", {"count.py": COUNTER})
    run = env.launch(job)["run"]
    try:
        for args in (["stop", "-H", env.node.name, ""], ["stop", "-H", env.node.name, "  "],
                     ["tail", "-H", env.node.name, "", "--no-follow"], ["status", "-H", env.node.name, ""]):
            r = env.dfo(*args)
            assert r.returncode == 2, (args, r.stdout, r.stderr)
            assert "empty" in r.stderr and "Traceback" not in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) <= 2, r.stderr
        assert env.status(run)["state"] == "running"  # the newest run was not stopped
    finally:
        env.dfo("stop", "-H", env.node.name, run, "--grace", "0")


# ------------------------------------------------------------------------------------ item 2


@on_testbed
def test_a_long_silent_command_on_a_live_link_is_not_a_dead_link(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    conn = _conn(inventory_copy(testbed, tmp_path), testbed.nodes[0].name)
    try:
        silent = 2 * ALIVE_DEAD_S  # twice the bound for an unanswered keepalive
        r = conn.run(f"sleep {silent:g}; echo done", timeout=silent + 60)
        assert r.exit_code == 0 and r.stdout == "done\n" and r.seconds >= silent
    finally:
        conn.close()


@on_testbed
def test_a_link_cut_during_a_call_is_exit_4_within_30s(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tb = make_testbed(s3=False)
    node = tb.nodes[0]
    conn = _conn(inventory_copy(tb, tmp_path), node.name)
    try:
        assert conn.run("echo up").stdout == "up\n"
        t, box = _in_thread(lambda: conn.run("sleep 300", timeout=600))
        time.sleep(2)
        tb.link_down(node)
        t_cut = time.monotonic()
        t.join(45)  # bounded: before the fix this call waits for TCP to give up (~15 min)
        waited = time.monotonic() - t_cut
        assert not t.is_alive(), f"Connection.run still waiting {waited:.0f}s after the link was cut"
        assert isinstance(box.get("error"), HostError), box
        err = box["error"]
        assert err.exit_code == 4 and "lost" in err.message and "answer" in err.message, err.render()
        assert waited < 30, waited
    finally:
        tb.link_up(node)
        conn.close()
    # the link is back: a new call reconnects (once the node is reachable again)
    deadline = time.monotonic() + 20
    while True:
        try:
            assert conn.run("echo back").stdout == "back\n"
            break
        except HostError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    conn.close()


@on_testbed
def test_launch_wait_on_a_cut_link_exits_4_within_30s_and_the_run_goes_on(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tb = make_testbed(s3=False)
    env = RunsEnv(tb, tb.nodes[0], inventory_copy(tb, tmp_path), tmp_path)
    job, _ = env.job("python3 count.py 3000 0.2", {"count.py": COUNTER})
    p = dfo_popen(env.inv, "launch", "-H", env.node.name, "-j", str(job), "--wait", "300")
    try:
        assert p.stdout is not None and "started run" in p.stdout.readline()  # it is watching now
        tb.link_down(env.node)
        t_cut = time.monotonic()
        try:
            _, err = p.communicate(timeout=45)  # before the fix: tail's 300 s reconnect budget, or exit 1
        except subprocess.TimeoutExpired:
            pytest.fail(f"dfo launch --wait still waiting {time.monotonic() - t_cut:.0f}s after the link was cut")
        waited = time.monotonic() - t_cut
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        tb.link_up(env.node)
    assert p.returncode == 4 and waited < 30, (p.returncode, waited, err)
    assert "the run is not affected; resume with: dfo tail" in err and "Traceback" not in err, err
    runs = None
    deadline = time.monotonic() + 20
    while runs is None:
        r = env.dfo("status", "-H", env.node.name, "--json")
        if r.returncode == 0:
            runs = json.loads(r.stdout)["hosts"][env.node.name]["runs"]
        elif time.monotonic() > deadline:
            pytest.fail(r.stderr)
        else:
            time.sleep(0.5)
    assert runs[0]["state"] == "running", runs  # the run never depended on the link
    env.dfo("stop", "-H", env.node.name, runs[0]["id"], "--grace", "0")


@on_testbed
def test_sync_data_on_a_cut_link_exits_4_within_30s_and_a_rerun_resumes(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tb = make_testbed(s3=True)
    if not tb.isolated:
        pytest.skip("needs the namespaced testbed (tc on the node's link)")
    node = tb.nodes[0]
    ds = upload(tb, "slow-" + secrets.token_hex(3), "d/", random_files(12, 512 * 1024))
    x = Xfer(tb, tmp_path)
    job = x.job(data={"source": ds.source, "dest": f"{x.base}/data"}, s3={"concurrency": 1})
    link = tb._st(node).link  # the host side of the node's veth: what S3 sends to the node leaves here
    assert link
    tsys.run(["tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", "1mbit", "burst", "32kbit", "latency", "400ms"])
    p = x.popen("sync-data", "-H", node.name, "-j", str(job))
    try:
        deadline = time.monotonic() + 60  # the transfer is under way: a first file has landed
        while not x.sh(f"ls {x.base}/data 2>/dev/null | head -1", check=False).stdout.strip():
            assert time.monotonic() < deadline and p.poll() is None, p.communicate()
            time.sleep(0.2)
        tb.link_down(node)
        t_cut = time.monotonic()
        try:
            _, err = p.communicate(timeout=45)  # before the fix: waits for TCP to give up (~15 min)
        except subprocess.TimeoutExpired:
            pytest.fail(f"dfo sync-data still waiting {time.monotonic() - t_cut:.0f}s after the link was cut")
        waited = time.monotonic() - t_cut
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        tb.link_up(node)
        tsys.run(["tc", "qdisc", "del", "dev", link, "root"], check=False)
    assert p.returncode == 4, err
    assert waited < 30, (waited, err)
    assert "lost" in err and "run the same command again" in err and "Traceback" not in err, err
    r = x.dfo("sync-data", "-H", node.name, "-j", str(job))
    assert r.returncode == 0, r.stderr
    assert x.digests(f"{x.base}/data") == ds.digests()
