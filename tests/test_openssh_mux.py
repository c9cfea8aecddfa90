"""Calls over the shared connection without an ssh client each (transport/openssh_mux.py): on a real testbed
node, the OpenSSH transport opens each session on its ControlMaster's socket itself (no `ssh` process
started for it), and what a call gives is what the ssh client gave: stdout, stderr, the exit status,
stdin's bytes, a binary stream; a master killed while a command runs is ConnectionLost within seconds, a
call that outlives its timeout is stopped; DFO_MUX_CLIENT=0 goes back to the ssh client."""

from __future__ import annotations

import hashlib
import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import ConnectionLost, HostError
from orchestrator.hosts import HostSession
from orchestrator.transport import openssh, openssh_mux
from orchestrator.transport.base import Transport
from tests._runs_fixtures import inventory_copy
from tests.test_openssh import _master_pid

on_testbed = pytest.mark.testbed


class Spawns:
    """Every process the OpenSSH transport starts (its ssh clients)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.argv: list[list[str]] = []
        real = subprocess.Popen

        def popen(argv: Any, *a: Any, **kw: Any) -> Any:
            self.argv.append(list(argv))
            return real(argv, *a, **kw)

        monkeypatch.setattr(openssh.subprocess, "Popen", popen)


@pytest.fixture
def conn(testbed: Any, tmp_path: Path, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Transport]:
    monkeypatch.setenv("DFO_SSH_TRANSPORT", "openssh")
    monkeypatch.delenv("DFO_MUX_CLIENT", raising=False)
    inv = inventory_copy(testbed, tmp_path)
    with HostSession(inv, [testbed.nodes[0].name]) as s:
        c = s.conn(testbed.nodes[0].name)
        assert c.run("true").ok  # the master: made by the ssh client of this first call
        yield c


@on_testbed
def test_calls_over_the_master_start_no_ssh_and_give_what_ssh_gave(conn: Transport,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spawns = Spawns(monkeypatch)
    r = conn.run("printf 'out\\n'; printf 'err\\n' >&2; exit 7")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 7)
    data = secrets.token_bytes(3 << 20)  # more than any pipe holds: stdin fed while the output is read
    r = conn.run("sha256sum", stdin=data)
    assert r.ok and r.stdout.split()[0] == hashlib.sha256(data).hexdigest(), r
    assert conn.run("wc -c", stdin=data).stdout.strip() == str(len(data))
    got = bytearray()
    r = conn.run_stream("head -c 5000000 /dev/zero | tr '\\0' 'z'", on_data=got.extend)
    assert r.ok and len(got) == 5_000_000 and set(got) == {ord("z")}
    assert conn.run("exit 255").exit_code == 255  # the command's own 255, told from a lost connection
    assert spawns.argv == []  # no ssh client for any of them
    monkeypatch.setenv("DFO_MUX_CLIENT", "0")
    assert conn.run("exit 3").exit_code == 3
    assert len(spawns.argv) == 1 and spawns.argv[0][0].endswith("ssh")


@on_testbed
def test_output_that_comes_after_the_exit_status_arrives_whole(conn: Transport) -> None:
    """The command's shell exits (the master sends its exit message) while a process it left writes on:
    the session ends when the master closes it, and all the output arrives, as with ssh's client.
    (Ending the session at the exit message made the master drop the rest: dfo pull's stream lost its tail.)"""
    got = bytearray()
    r = conn.run_stream("(sleep 0.5; head -c 2000000 /dev/zero | tr '\\0' 'q') & true", on_data=got.extend)
    assert r.ok and len(got) == 2_000_000 and set(got) == {ord("q")}, (r, len(got))


@on_testbed
def test_a_master_killed_while_a_command_runs_is_a_lost_connection(conn: Transport) -> None:
    prep = conn._prepared()  # type: ignore[attr-defined]
    pid = _master_pid(prep.control)
    got: dict[str, BaseException | None] = {}

    def call() -> None:
        try:
            conn.run("sleep 30", timeout=60)
            got["err"] = None
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            got["err"] = exc

    t = threading.Thread(target=call)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(20)
    assert not t.is_alive() and time.monotonic() - t0 < 10
    assert isinstance(got["err"], ConnectionLost), got


@on_testbed
def test_a_call_past_its_timeout_is_stopped(conn: Transport) -> None:
    t0 = time.monotonic()
    with pytest.raises(HostError) as ei:
        conn.run("sleep 20", timeout=1.5)
    assert "did not finish within 1.5s" in ei.value.message and time.monotonic() - t0 < 5
    assert conn.run("echo again").stdout == "again\n"  # the shared connection serves the next call


def test_no_master_or_a_refusal_is_none_and_nothing_left_open(tmp_path: Path) -> None:
    """open_session gives None (the ssh client is then started) for a socket nobody listens on, and for a
    listener that is no ControlMaster; it leaves no descriptor open."""
    import socket

    before = len(os.listdir("/proc/self/fd"))
    assert openssh_mux.open_session(str(tmp_path / "none"), "true", stdin=True, env=[], timeout=2) is None
    path = str(tmp_path / "s")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def answer() -> None:
        c, _ = srv.accept()
        c.recv(100)
        c.sendall(b"\x00\x00\x00\x08\x00\x00\x00\x02\x00\x00\x00\x04")  # not a hello
        c.close()

    t = threading.Thread(target=answer)
    t.start()
    assert openssh_mux.open_session(path, "true", stdin=False, env=[], timeout=2) is None
    t.join(5)
    srv.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_send_env_passes_what_sendenv_names() -> None:
    env = {"LANG": "C.UTF-8", "LC_ALL": "C", "LC_TIME": "x", "AWS_SECRET_ACCESS_KEY": "s", "PATH": "/bin"}
    assert sorted(openssh_mux.send_env(["LANG", "LC_*"], env)) == ["LANG=C.UTF-8", "LC_ALL=C", "LC_TIME=x"]
    assert openssh_mux.send_env([], env) == [] and openssh_mux.send_env(["-LANG"], env) == []
