"""Fleet commands (issue 13): exec on every host at once, and per-host results printed as they come.

Real sshd nodes (the testbed) and, for "a host that does not answer", a TCP listener in this test
that accepts and never says a word (no SSH banner): dfo waits there until the test lets it go (the
listener hangs up once the fast host's result is on the screen), long before its connect timeout. Order
is asserted from events (what the listener saw, what the node runs), never from durations.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import _cli
from tests._cli import dfo_argv
from tests._s3_fixtures import upload

pytestmark = pytest.mark.testbed

# ---------------------------------------------------------------------------------------------- helpers


class SilentHost:
    """A TCP port that accepts connections and never answers (an sshd that hangs before its banner).
    ``open`` counts the connections the client still holds; ``events`` records accept/close."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.events: list[str] = []
        self.open = 0
        self._lock = threading.Lock()
        self._stop = False
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.open += 1
                self.events.append("accept")
                self._held.append(c)
            threading.Thread(target=self._hold, args=(c,), daemon=True).start()

    def _hold(self, c: socket.socket) -> None:
        try:
            while c.recv(4096):
                pass
        except OSError:
            pass
        with self._lock:
            self.open -= 1
            self.events.append("close")
        c.close()

    def held(self) -> bool:
        with self._lock:
            return self.open > 0

    def hang_up(self) -> None:
        """Drop the connections held now (dfo's wait for a banner ends: exit 4 for that host)."""
        with self._lock:
            held, self._held = self._held, []
        for c in held:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture
def silent() -> Iterator[SilentHost]:
    s = SilentHost()
    yield s
    s.close()


def fleet_inventory(tb: Any, tmp_path: Path, connect_timeout: float = 10, **extra: dict[str, Any]) -> Path:
    inv = yaml.safe_load(Path(tb.inventory_path).read_text())
    inv["defaults"]["known_hosts"] = str(tmp_path / "known_hosts")
    inv["defaults"]["connect_timeout"] = connect_timeout
    inv["hosts"].update(extra)
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(inv))
    return p


def env_for(tb: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["COLUMNS"] = "200"
    env.pop("PYTHONUNBUFFERED", None)  # what a user piping dfo gets: each result must still come out at once
    if tb is not None and tb.s3 is not None:
        env.update({"AWS_ACCESS_KEY_ID": tb.s3.access_key, "AWS_SECRET_ACCESS_KEY": tb.s3.secret_key,
                    "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"})
    return env


def argv(inv: Path, *args: str) -> list[str]:
    return dfo_argv(inv, *args)


def dfo(inv: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180
        ) -> subprocess.CompletedProcess[str]:
    return _cli.dfo(inv, *args, timeout=timeout, env=env or env_for(None))


class Watched:
    """A dfo process whose stdout and stderr lines are read as they come, each stamped with what
    ``probe()`` said at the moment the line arrived."""

    def __init__(self, cmd: list[str], env: dict[str, str], probe: Any) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     stdin=subprocess.DEVNULL)
        self.lines: list[tuple[str, str, Any]] = []  # (stream, line, probe() when it arrived)
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._read, args=(name, f, probe), daemon=True)
                        for name, f in (("out", self.proc.stdout), ("err", self.proc.stderr))]
        for t in self.threads:
            t.start()

    def _read(self, name: str, f: Any, probe: Any) -> None:
        for line in f:
            seen = probe()
            with self._lock:
                self.lines.append((name, line.rstrip("\n"), seen))

    def wait(self, timeout: float = 180) -> int:
        rc = self.proc.wait(timeout)
        for t in self.threads:
            t.join(10)
        return rc

    def wait_for(self, stream: str, needle: str, timeout: float = 180) -> None:
        """Until a line of ``stream`` holds ``needle`` (or dfo ended)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            with self._lock:
                if any(s == stream and needle in line for s, line, _ in self.lines):
                    return
            time.sleep(0.05)

    def first(self, stream: str, needle: str) -> tuple[int, Any]:
        """(index, probe value) of the first line of ``stream`` holding ``needle``."""
        with self._lock:
            for i, (s, line, seen) in enumerate(self.lines):
                if s == stream and needle in line:
                    return i, seen
        raise AssertionError(f"no {stream} line with {needle!r}: {self.lines}")

    def text(self, stream: str) -> str:
        return "\n".join(line for s, line, _ in self.lines if s == stream)


# ---------------------------------------------------------------------------------------------- group commands


def _xfer_job(tb: Any, tmp_path: Path, what: str) -> Path:
    assert tb.s3 is not None
    ds = upload(tb, "fleet-" + secrets.token_hex(3), "d/", {f"f{i}.bin": os.urandom(2048) for i in range(5)})
    dest = f"/workspace/fleet-{secrets.token_hex(3)}" if what == "data" else f"/dev/shm/fleet-{secrets.token_hex(3)}"
    doc = {"name": "fleetjob", "s3": {"endpoint_url": tb.s3.url, "region": tb.s3.region},
           what: {"source": ds.source, "dest": dest}}
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.mark.parametrize("command", ["verify-env", "sync-data", "stage-model", "status"])
def test_a_fast_hosts_result_prints_while_a_dead_host_still_hangs(testbed2, silent: SilentHost, tmp_path: Path,
                                                                  command: str) -> None:  # type: ignore[no-untyped-def]
    """-H dead,node-1: node-1's result is on the screen while dfo still waits on the silent host (its
    connection is still held open by dfo); then the dead host's error, and exit 4 (the highest)."""
    node = testbed2.nodes[0]
    inv = fleet_inventory(testbed2, tmp_path, connect_timeout=120,
                          dead={"host": "127.0.0.1", "port": silent.port})
    extra: list[str] = []
    if command != "verify-env":
        extra = ["-j", str(_xfer_job(testbed2, tmp_path, "data" if command == "sync-data" else "model"))]
    w = Watched(argv(inv, command, "-H", "dead", "-H", node.name, *extra), env_for(testbed2), silent.held)
    fast_line = {"verify-env": f"{node.name}: ok", "status": node.name}.get(command, f"{node.name}: {command}")
    w.wait_for("out", fast_line)
    silent.hang_up()  # the dead host never answers; dfo stops waiting on it when the listener hangs up
    rc = w.wait()
    out, err = w.text("out"), w.text("err")
    assert rc == 4, out + err
    i_fast, dead_still_held = w.first("out", fast_line)
    i_dead, _ = w.first("err", "dead")
    assert dead_still_held, f"node-1's result came only after dfo gave up on the dead host:\n{out}\n{err}"
    assert silent.events[:2] == ["accept", "close"]  # dfo did connect there, and let go in the end
    assert "Traceback" not in err
    if command in ("verify-env", "status"):  # the summary after every host's own result
        assert f"dfo: {command}: 2 hosts; ok: 1; exit 4: 1 (dead)" in err, err


def test_provision_prints_each_hosts_summary_as_it_is_done(testbed2, silent: SilentHost, tmp_path: Path
                                                           ) -> None:  # type: ignore[no-untyped-def]
    node = testbed2.nodes[0]
    inv = fleet_inventory(testbed2, tmp_path, connect_timeout=120, dead={"host": "127.0.0.1", "port": silent.port})
    job = tmp_path / "pv.yaml"
    job.write_text(yaml.safe_dump({"name": "fleetpv", "installer": "pip", "venv": "/root/fleet-venv",
                                   "packages": []}))
    w = Watched(argv(inv, "provision", "-H", "dead", "-H", node.name, "-j", str(job)), env_for(testbed2),
                silent.held)
    w.wait_for("out", f"{node.name}: provisioned", 240)
    silent.hang_up()
    rc = w.wait(240)
    out, err = w.text("out"), w.text("err")
    assert rc == 4, out + err
    _, dead_still_held = w.first("out", f"{node.name}: provisioned")
    assert dead_still_held, f"the summary waited for the dead host:\n{out}\n{err}"
    assert "dead" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------- dfo exec


def node_pids(tb: Any, node: Any, marker: str) -> list[int]:
    """Processes on the node whose command line starts with ``marker`` (exec -a marker ...): the
    shells that mention it (and the one running pgrep) do not match."""
    r = tb.node_exec(node, f"pgrep -f '^{marker}' || true")
    return [int(x) for x in r.stdout.split()]


def test_exec_streams_each_host_and_a_timeout_kills_the_slow_hosts_group(testbed2, tmp_path: Path
                                                                         ) -> None:  # type: ignore[no-untyped-def]
    """node-2 sleeps; node-1 ends as soon as node-2's sleep runs (the test tells it so): node-1's output
    and exit status are printed while node-2's sleep still runs; at --timeout node-2's whole group
    (the shell and its sleep) is killed, status 124, and dfo exits 124 (the highest)."""
    n1, n2 = testbed2.nodes[0], testbed2.nodes[1]
    inv = fleet_inventory(testbed2, tmp_path)
    marker = f"fleetsleep{secrets.token_hex(3)}"
    go = f"/root/go-{marker}"
    # the sleep's argv carries the marker so the node can be asked whether it still runs
    script = (f'echo "hello from $(hostname)"; echo "warn from $(hostname)" >&2; '
              f'if [ "$(hostname)" = {n2.name} ]; then exec -a {marker} sleep 300 & wait; fi; '
              f'i=0; while [ ! -e {go} ] && [ $i -lt 600 ]; do i=$((i+1)); sleep 0.1; done; echo done')
    assert testbed2.node_exec(n2, "hostname").stdout.strip() == n2.name  # the test's premise

    def release_node1() -> None:
        deadline = time.monotonic() + 60
        while not node_pids(testbed2, n2, marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        testbed2.node_exec(n1, f"touch {go}")

    threading.Thread(target=release_node1, daemon=True).start()
    w = Watched(argv(inv, "exec", "-H", n1.name, "-H", n2.name, "--timeout", "12", "--", "bash", "-c", script),
                env_for(None), lambda: bool(node_pids(testbed2, n2, marker)))
    rc = w.wait()
    out, err = w.text("out"), w.text("err")
    assert rc == 124, out + err
    assert f"[{n1.name}] hello from {n1.name}" in out and f"[{n1.name}] done" in out
    assert f"[{n2.name}] hello from {n2.name}" in out and f"[{n2.name}] done" not in out
    assert f"[{n1.name}] warn from {n1.name}" in err and f"[{n1.name}] warn" not in out
    _, slow_running = w.first("err", f"dfo: {n1.name}: exit 0")
    assert slow_running, f"node-1's status was held back until node-2 ended:\n{out}\n{err}"
    i1, _ = w.first("err", f"dfo: {n1.name}: exit 0")
    i2, _ = w.first("err", f"dfo: {n2.name}: timed out")
    assert i1 < i2 and "exit 124" in err
    assert f"exit 0 on {n1.name}; exit 124 on {n2.name}" in err
    assert node_pids(testbed2, n2, marker) == []  # the whole group went, not just the shell


def test_exec_json_one_document_highest_exit_and_an_unreachable_host(testbed2, tmp_path: Path
                                                                      ) -> None:  # type: ignore[no-untyped-def]
    n1, n2 = testbed2.nodes[0], testbed2.nodes[1]
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: refused at once
    inv = fleet_inventory(testbed2, tmp_path, gone={"host": "127.0.0.1", "port": port})
    script = f'echo out-$(hostname); echo err-$(hostname) >&2; [ "$(hostname)" = {n1.name} ] && exit 0; exit 3'
    r = dfo(inv, "exec", "-H", n1.name, "-H", n2.name, "--json", "--", "sh", "-c", script)
    assert r.returncode == 3, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit"] == 3 and list(doc["hosts"]) == [n1.name, n2.name]
    h1, h2 = doc["hosts"][n1.name], doc["hosts"][n2.name]
    assert h1["host"] == n1.name and h1["exit"] == 0 and h1["stdout"] == f"out-{n1.name}\n"
    assert h1["stderr"] == f"err-{n1.name}\n" and h1["timed_out"] is False and h1["seconds"] >= 0
    assert h2["exit"] == 3 and h2["stdout"] == f"out-{n2.name}\n"
    assert [ln for ln in r.stderr.splitlines() if "recorded host key" not in ln] == []  # --json: only the document
    # (and, on stderr, the host keys recorded on first contact)
    r = dfo(inv, "exec", "-H", "gone", "-H", n1.name, "--json", "--", "true")
    assert r.returncode == 4, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["hosts"]["gone"]["exit"] == 4 and "refused" in doc["hosts"]["gone"]["error"]["message"]
    assert doc["hosts"][n1.name]["exit"] == 0


def test_exec_passes_each_word_as_given(testbed2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """argv is joined with shlex.join: spaces, quotes, $VARS and ; reach the command as they were given."""
    n1 = testbed2.nodes[0]
    inv = fleet_inventory(testbed2, tmp_path)
    words = ["a b", "$HOME", "it's", ";", "x|y", "*"]
    r = dfo(inv, "exec", "-H", n1.name, "--", "printf", "<%s>\\n", *words)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"[{n1.name}] <{w}>" for w in words]
    # no `--` needed when the command's options come after its name; the node's exit status is dfo's
    r = dfo(inv, "exec", "-H", n1.name, "sh", "-c", "exit 7")
    assert r.returncode == 7 and f"dfo: {n1.name}: exit 7" in r.stderr
    # a node's control characters are shown, never obeyed; tabs are kept
    r = dfo(inv, "exec", "-H", n1.name, "--", "printf", "a\\tb\\033]0;pwned\\007c\\n")
    assert r.stdout == f"[{n1.name}] a\tb\\x1b]0;pwned\\x07c\n"


def test_exec_ctrl_c_ends_the_commands_on_the_node(testbed2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C on dfo exec: the node's command group goes too (the node's watcher reads EOF on the call's stdin)."""
    n1 = testbed2.nodes[0]
    inv = fleet_inventory(testbed2, tmp_path)
    marker = f"fleetint{secrets.token_hex(3)}"
    w = Watched(argv(inv, "exec", "-H", n1.name, "--", "bash", "-c", f"echo started; exec -a {marker} sleep 300"),
                dict(env_for(None), PYTHONFAULTHANDLER="1"), lambda: None)
    deadline = time.monotonic() + 60
    while "started" not in w.text("out"):
        assert w.proc.poll() is None and time.monotonic() < deadline, w.text("err")
        time.sleep(0.1)
    assert node_pids(testbed2, n1, marker)
    w.proc.send_signal(signal.SIGINT)
    try:
        code = w.wait(60)
    except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread's stack on SIGABRT
        w.proc.send_signal(signal.SIGABRT)
        w.proc.wait(30)
        time.sleep(1)
        raise AssertionError("dfo exec outlived Ctrl-C by 60 s: " + w.text("err")[-6000:]) from None
    assert code == 130, w.text("err")[-2000:]
    deadline = time.monotonic() + 20  # the watcher: SIGTERM at EOF, SIGKILL 2 s later
    while node_pids(testbed2, n1, marker):
        assert time.monotonic() < deadline, "the command outlived dfo exec"
        time.sleep(0.5)


def test_exec_local_transport_timeout_kills_the_group(tmp_path: Path) -> None:
    """transport: local runs the same module on this machine: a background child of the command is in
    its group and goes at the timeout."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"defaults: {{known_hosts: {tmp_path / 'kh'}}}\nhosts:\n  me: {{transport: local}}\n")
    r = dfo(inv, "exec", "-H", "me", "--timeout", "2", "--", "sh", "-c", "sleep 300 & echo $!; wait")
    assert r.returncode == 124, r.stdout + r.stderr
    pid = int(r.stdout.split()[-1])
    assert r.stdout.startswith("[me] ")
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}/stat").exists() else ""
        if ") Z " in stat:  # a zombie waiting for its reaper is dead
            break
        assert time.monotonic() < deadline, f"sleep {pid} outlived the timeout"
        time.sleep(0.2)
    assert "timed out" in r.stderr and "exit 124" in r.stderr


def test_exec_usage_errors_are_exit_2() -> None:
    r = _cli.dfo(None, "exec", "-H", "x", env=dict(os.environ))
    assert r.returncode == 2 and "CMD" in r.stderr
    r = _cli.dfo(None, "exec", "-H", "x", "--timeout", "0", "--", "true", env=dict(os.environ))
    assert r.returncode == 2 and "timeout" in r.stderr.lower()


def test_exec_runs_every_host_at_once_beyond_the_connect_limit(tmp_path: Path) -> None:
    """20 hosts (more than the 16 hosts other commands work on at once): each host's command waits
    until all 20 have started, which only ends if every host runs at the same time."""
    n = 20
    hosts = "".join(f"  h{i:02d}: {{transport: local}}\n" for i in range(n))
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"defaults: {{known_hosts: {tmp_path / 'kh'}}}\nhosts:\n{hosts}")
    room = tmp_path / "room"
    room.mkdir()
    script = ('touch "$1/$$"; i=0; while [ "$(ls "$1" | wc -l)" -lt "$2" ]; do i=$((i+1)); '
              '[ $i -gt 600 ] && exit 9; sleep 0.1; done; echo all-here')
    r = dfo(inv, "exec", "-H", "all", "--timeout", "120", "--", "sh", "-c", script, "sh", str(room), str(n),
            timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("all-here") == n


def test_exec_a_lost_link_is_exit_4_for_that_host_and_its_command_ends(testbed2, tmp_path: Path
                                                                       ) -> None:  # type: ignore[no-untyped-def]
    """node-2's link is cut while its command runs: node-1 is reported (exit 0), node-2 is a lost
    connection (exit 4, within dfo's liveness bound); once the link is back, the node's sshd drops the
    dead session and the command's group goes with it (the node's watcher reads EOF on the call's stdin)."""
    n1, n2 = testbed2.nodes[0], testbed2.nodes[1]
    inv = fleet_inventory(testbed2, tmp_path)
    marker = f"fleetlost{secrets.token_hex(3)}"
    script = f'echo started; [ "$(hostname)" = {n2.name} ] && exec -a {marker} sleep 300; echo done'
    w = Watched(argv(inv, "exec", "-H", n1.name, "-H", n2.name, "--", "bash", "-c", script), env_for(None),
                lambda: None)
    try:
        deadline = time.monotonic() + 60
        while f"[{n2.name}] started" not in w.text("out") or not node_pids(testbed2, n2, marker):
            assert w.proc.poll() is None and time.monotonic() < deadline, w.text("out") + w.text("err")
            time.sleep(0.2)
        testbed2.link_down(n2)
        rc = w.wait(90)
    finally:
        testbed2.link_up(n2)
    out, err = w.text("out"), w.text("err")
    assert rc == 4, out + err
    assert f"[{n1.name}] done" in out and f"dfo: {n1.name}: exit 0" in err
    assert "connection lost" in err and n2.name in err and "Traceback" not in err
    deadline = time.monotonic() + 90
    while node_pids(testbed2, n2, marker):
        assert time.monotonic() < deadline, "the command outlived its lost session"
        time.sleep(1)


def test_each_reports_hosts_in_the_order_they_finish_and_never_hangs(tmp_path: Path) -> None:
    """HostSession.each: on_done runs (in the caller's thread) for a host as soon as it is done: the
    slow host here cannot finish until the fast host's on_done has run. A worker that dies of a
    BaseException still gives its host an outcome (exit 1) instead of leaving the wait hanging."""
    from orchestrator.config.models import load_inventory
    from orchestrator.hosts import HostSession

    p = tmp_path / "inventory.yaml"
    p.write_text(f"defaults: {{known_hosts: {tmp_path / 'kh'}}}\nhosts:\n  slow: {{transport: local}}\n"
                 "  fast: {transport: local}\n  dies: {transport: local}\n")
    inv, path = load_inventory(p)
    s = HostSession.from_inventory(inv, path, ["slow", "fast", "dies"])
    fast_reported = threading.Event()
    seen: list[tuple[str, bool]] = []

    def fn(conn: Any) -> str:
        if conn.name == "slow":
            assert fast_reported.wait(30)
        if conn.name == "dies":
            raise SystemExit(3)
        return conn.name

    def on_done(o: Any) -> None:
        assert threading.current_thread() is threading.main_thread()
        seen.append((o.host, o.error is None))
        if o.host == "fast":
            fast_reported.set()

    outs = s.each(fn, on_done=on_done)
    assert [o.host for o in outs] == ["slow", "fast", "dies"]  # the list keeps -H order
    assert seen.index(("fast", True)) < seen.index(("slow", True))
    assert ("dies", False) in seen and outs[2].exit_code == 1 and outs[0].value == "slow"


def test_top_shows_each_hosts_row_while_another_host_hangs(testbed2, silent: SilentHost, tmp_path: Path
                                                            ) -> None:  # type: ignore[no-untyped-def]
    """The live view (a terminal: a pty here) refreshes each host on its own: node-1's row is on the screen
    while the silent host still holds dfo's connection; that host's row says it is waiting."""
    import pty

    node = testbed2.nodes[0]
    inv = fleet_inventory(testbed2, tmp_path, connect_timeout=120, dead={"host": "127.0.0.1", "port": silent.port})
    def answered(raw: bytes) -> bool:
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode(errors="replace"))
        return any(ln.startswith(node.name + " ") and "waiting" not in ln for ln in text.splitlines())

    leader, follower = pty.openpty()
    env = dict(env_for(testbed2), TERM="xterm", COLUMNS="200", LINES="50")
    p = subprocess.Popen(argv(inv, "top", "-H", "dead", "-H", node.name, "--every", "1"), stdin=follower,
                         stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            import select as _select

            if _select.select([leader], [], [], 0.5)[0]:
                try:
                    seen += os.read(leader, 65536)
                except OSError:
                    break
            if answered(seen):
                break
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", seen.decode(errors="replace"))
        # node-1's row says what node-1 answered (its view, or its own error: no run there) ...
        assert answered(seen), text[-3000:]
        # ... while dfo still waits on the silent host, whose row says so
        assert silent.held(), "dfo no longer waits on the silent host: the test proves nothing"
        assert any(ln.startswith("dead ") and "waiting for its first answer" in ln for ln in text.splitlines())
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        silent.hang_up()
        os.close(leader)
