"""Issue 10, items 2, 12, 13: liveness on every SSH call, known_hosts edge cases, an empty RUN.

All against real testbed nodes (real sshd); the link is cut with the testbed's link_down.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import threading
import time
from pathlib import Path

import pytest

from orchestrator.config.models import load_inventory
from orchestrator.errors import HostError
from orchestrator.testbed import system as tsys
from orchestrator.transport import open_connection
from orchestrator.transport.base import Transport
from orchestrator.transport.liveness import bounds
from orchestrator.transport.resolve import resolve_host
from tests._runs_fixtures import COUNTER, RunsEnv, dfo, dfo_popen, inventory_copy
from tests._s3_fixtures import Xfer, random_files, upload

on_testbed = pytest.mark.testbed
# From the cut to exit 4: dfo promises under 30 s (its dead-link bound, 20 s, plus 10); the tests run with a
# bound of a few seconds (DFO_ALIVE_DEAD_S, tests/conftest.py), so they wait that plus 10.
LOST_WITHIN = bounds().dead + 10


def _conn(inv: Path, name: str) -> Transport:
    """The host's transport as dfo opens it (DFO_SSH_TRANSPORT, set by the each_ssh_transport fixture)."""
    inventory, _ = load_inventory(inv)
    return open_connection(resolve_host(inventory, name, inv))


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
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_long_silent_command_on_a_live_link_is_not_a_dead_link(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    conn = _conn(inventory_copy(testbed, tmp_path), testbed.nodes[0].name)
    try:
        silent = 2 * bounds().dead  # twice the bound for an unanswered keepalive (the tests' bound: conftest)
        r = conn.run(f"sleep {silent:g}; echo done", timeout=silent + 60)
        assert r.exit_code == 0 and r.stdout == "done\n" and r.seconds >= silent
    finally:
        conn.close()


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
@pytest.mark.parametrize("mode", ["default", "loopback"])
def test_a_link_cut_during_a_call_is_exit_4_within_30s(make_testbed, tmp_path: Path, mode: str) -> None:  # type: ignore[no-untyped-def]
    """default: a namespaced node whose link goes down (as root); loopback: sshd frozen with SIGSTOP
    (a hung node: TCP stays up, nothing answers)."""
    tb = make_testbed(s3=False, **({"use_netns": False} if mode == "loopback" else {}))
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
        assert waited < LOST_WITHIN, waited
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
@pytest.mark.usefixtures("each_ssh_transport")
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
    # 30: the dead-link bound, then --wait's own reconnect budget (10 s) with connect attempts (3 s each)
    assert p.returncode == 4 and waited < 30, (p.returncode, waited, err)
    assert "the run is not affected; resume with: dfo " in err and f" tail -H {env.node.name} " in err, err
    assert "Traceback" not in err, err
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
    assert waited < LOST_WITHIN, (waited, err)
    assert "lost" in err and "run the same command again" in err and "Traceback" not in err, err
    r = x.dfo("sync-data", "-H", node.name, "-j", str(job))
    assert r.returncode == 0, r.stderr
    assert x.digests(f"{x.base}/data") == ds.digests()


# ------------------------------------------------------------------------------------ item 12

SK_LINE = ("laptop.example sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5QG9wZW5zc2guY29tAAAAIDq0a2ZbOzY8WKc1e"
           "PQcO7Y6E5+fxhjoM7D2XHkp2m5nAAAABHNzaDo= my security key")


def _other_key(tmp_path: Path, name: str = "other") -> str:
    """A real ed25519 public key that no testbed node has: "ssh-ed25519 AAAA..."."""
    f = tmp_path / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(f)], check=True, capture_output=True)
    return " ".join(f.with_suffix(".pub").read_text().split()[:2])


def _label(node) -> str:  # type: ignore[no-untyped-def]
    return node.address if node.port == 22 else f"[{node.address}]:{node.port}"


def _kh_env(tb, tmp_path: Path, text: str) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """A copy of the testbed's inventory whose known_hosts is a fresh file holding ``text``."""
    inv = inventory_copy(tb, tmp_path)
    kh = tmp_path / "known_hosts"
    kh.write_text(text)
    return inv, kh


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_known_hosts_lines_dfo_does_not_use_are_kept_and_a_new_key_is_appended(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = testbed.nodes[0]
    other = _other_key(tmp_path)
    hashed_other = tmp_path / "hashed"
    hashed_other.write_text(f"elsewhere.example {other}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(hashed_other)], check=True, capture_output=True)
    before = ("# dfo's known hosts, kept by hand too\n"
              f"@cert-authority *.corp.example {other} the corp CA\n"  # a CA line that covers the node: test_openssh
              f"@revoked gone.example {_other_key(tmp_path, 'gone')}\n"
              f"{SK_LINE}\n"
              "\n"
              f"{hashed_other.read_text().strip()}\n"
              f"box.example,10.9.9.9 {other}   # no newline at the end")
    inv, kh = _kh_env(testbed, tmp_path, before)
    # OpenSSH reads every line of it (the oracle that the file is valid)
    assert subprocess.run(["ssh-keygen", "-lf", str(kh)], capture_output=True).returncode == 0
    r = dfo(inv, "status", "-H", node.name)
    assert r.returncode == 0, r.stderr
    after = kh.read_text()
    assert after.startswith(before + "\n"), after  # appended, not rewritten: comments, markers, sk-* kept
    added = after[len(before) + 1:]
    assert added == f"{_label(node)} {testbed.host_public_key(node)}\n"
    found = subprocess.run(["ssh-keygen", "-F", _label(node), "-f", str(kh)], capture_output=True, text=True)
    assert testbed.host_public_key(node) in found.stdout  # OpenSSH finds the line dfo added
    assert dfo(inv, "status", "-H", node.name).returncode == 0
    assert kh.read_text() == after  # a known key adds nothing


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_hashed_host_line_is_honoured(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = testbed.nodes[0]
    inv, kh = _kh_env(testbed, tmp_path, f"{_label(node)} {testbed.host_public_key(node)}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    hashed = kh.read_text()
    assert hashed.startswith("|1|")
    assert dfo(inv, "status", "-H", node.name).returncode == 0
    assert kh.read_text() == hashed  # found under its hashed name: nothing added
    # a hashed line with another key for the node: a changed key, refused
    kh.write_text(f"{_label(node)} {_other_key(tmp_path)}\n")
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    r = dfo(inv, "status", "-H", node.name)
    assert r.returncode == 4 and "CHANGED" in r.stderr, r.stderr


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_first_contact_from_many_connections_at_once_records_each_key_once(testbed2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    inv, kh = _kh_env(testbed2, tmp_path, "# shared by several dfo processes\n")
    procs = [dfo_popen(inv, "status", "-H", "testbed") for _ in range(4)]  # each: both nodes in parallel
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    lines = kh.read_text().splitlines()
    assert lines[0] == "# shared by several dfo processes"
    assert sorted(lines[1:]) == sorted(f"{_label(n)} {testbed2.host_public_key(n)}" for n in testbed2.nodes)


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
@pytest.mark.parametrize("also_plain", [False, True])
def test_a_revoked_host_key_is_refused(testbed, tmp_path: Path, also_plain: bool) -> None:  # type: ignore[no-untyped-def]
    node = testbed.nodes[0]
    pub = testbed.host_public_key(node)
    text = f"# revoked after a leak\n@revoked * {pub}\n" + (f"{_label(node)} {pub}\n" if also_plain else "")
    inv, kh = _kh_env(testbed, tmp_path, text)
    r = dfo(inv, "status", "-H", node.name)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "REVOKED" in r.stderr and f"{kh}:2" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert kh.read_text() == text


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
@pytest.mark.parametrize("damage", ["cut_key", "no_key", "bad_marker", "bad_hash", "wrong_type", "not_base64"])
def test_a_damaged_known_hosts_line_is_exit_2_naming_file_and_line(testbed, tmp_path: Path, damage: str) -> None:  # type: ignore[no-untyped-def]
    node = testbed.nodes[0]
    label, pub = _label(node), testbed.host_public_key(node)
    kind, key = pub.split()
    line = {"cut_key": f"{label} {kind} {key[:40]}",  # a write cut short
            "no_key": f"{label} {kind}",
            "bad_marker": f"@cert-authorty * {pub}",
            "bad_hash": f"|1|c2FsdA==|aGFzaA== {pub}",
            "wrong_type": f"{label} ecdsa-sha2-nistp256 {key}",
            "not_base64": f"{label} {kind} {key[:30]}!!{key[32:]}"}[damage]
    text = f"# first line\n{SK_LINE}\n{line}\n"
    inv, kh = _kh_env(testbed, tmp_path, text)
    r = dfo(inv, "status", "-H", node.name)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{kh}:3:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert kh.read_text() == text  # never treated as absent: nothing was trusted anew


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_command_that_exits_without_reading_its_stdin_is_no_lost_connection(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Its channel closes while dfo still sends stdin (a remote module that asks for the agent upload
    does this): the exit code comes back; it was exit 4 "connection lost: Socket is closed"."""
    conn = _conn(inventory_copy(testbed, tmp_path), testbed.nodes[0].name)
    try:
        r = conn.run("echo early; exit 3", stdin=b"x" * (16 << 20))
        assert (r.exit_code, r.stdout) == (3, "early\n")
        assert conn.run("cat | wc -c", stdin=b"y" * 1000).stdout.strip() == "1000"  # the connection is fine
    finally:
        conn.close()


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_big_stdin_arrives_whole(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """32 MiB through stdin arrive byte for byte (stdin is sent as a memoryview: paramiko's sendall
    re-slices what is left after every packet, which copied a bytes payload each time)."""
    conn = _conn(inventory_copy(testbed, tmp_path), testbed.nodes[0].name)
    try:
        data = bytes(range(256)) * (32 * 4096)
        r = conn.run("sha256sum | cut -c1-64", stdin=data, timeout=120)
        assert r.exit_code == 0 and r.stdout.strip() == hashlib.sha256(data).hexdigest()
        print(f"32 MiB on stdin: {r.seconds:.1f}s")
    finally:
        conn.close()
