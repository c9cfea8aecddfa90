"""Issue 10, items 1, 3, 4: framing that survives login-shell noise, bounded `tail` memory, and a log
truncated or rotated while it is followed. Real sshd nodes from the testbed, the real CLI."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator.transport.ssh import Result, _Collector
from tests._cli import dfo_argv
from tests._runs_fixtures import COUNTER, RunsEnv, dfo_popen, expected_lines, inventory_copy

on_testbed = pytest.mark.testbed

# What rented-node images put in root's ~/.bashrc (Debian's bash reads it for commands run by sshd):
# a terminal-title setter with no trailing newline, a coloured banner, colour codes, on stdout and on
# stderr. The title escape and the final colour code are what glued onto dfo's first frame.
NOISY_BASHRC = r"""
printf '\033]0;gpu-node\007'
printf '\033[1;32mWelcome to GPU Cloud\033[0m - 8x H200 - support: help@example.com\n'
printf '\033[33m*** maintenance window Sunday ***\033[0m\n\033]0;title-on-stderr\007' >&2
printf '\033[0m'
"""
NOISY_PROFILE = r"""
printf '\033]0;profile\007\033[35mprofile banner\033[0m'
printf '\033]0;profile-err\007' >&2
"""
MARK = " [dfo: line split, continues]"
LOG_DIR = "/workspace/.dfo/runs"


def _write_node_file(tb, path: str, text: str) -> None:  # type: ignore[no-untyped-def]
    r = tb.node_exec(tb.nodes[0], f"cat > {path} <<'DFO_EOF'\n{text}\nDFO_EOF")
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- item 1: framing


def test_frames_are_found_wherever_they_start_in_a_line() -> None:
    from orchestrator.agent import parse_output
    from remote._proto import split_frame

    noise = "\x1b]0;gpu-node\x07\x1b[0m"
    assert split_frame(noise + '@@DFO-RESULT@@ {"ok":true}') == ("result", '{"ok":true}')
    assert split_frame('junk\r@@DFO-EVENT@@ {"kind":"start","offset":0}') == ("event", '{"kind":"start","offset":0}')
    # a log chunk that quotes a result frame is still an event: the earliest prefix wins
    assert split_frame('@@DFO-EVENT@@ {"kind":"chunk","o":0,"t":"@@DFO-RESULT@@ {}"}')[0] == "event"  # type: ignore[index]
    assert split_frame("plain banner") is None

    class Conn:
        name = "node-x"

    out = noise + '@@DFO-EVENT@@ {"kind":"start","offset":0}\n@@DFO-RESULT@@ {"ok":true,"data":{"v":1}}\n'
    assert parse_output(Conn(), Result("node-x", "c", out, "", 0, 0.1), "remote.x") == {"v": 1}  # type: ignore[arg-type]
    glued = noise + '@@DFO-RESULT@@ {"ok":true,"data":2}\n'
    assert parse_output(Conn(), Result("node-x", "c", glued, "", 0, 0.1), "remote.x") == 2  # type: ignore[arg-type]


def _noisy_node(make_testbed, tmp_path: Path) -> RunsEnv:  # type: ignore[no-untyped-def]
    tb = make_testbed(s3=False)  # a private node: its /root is its own
    env = RunsEnv(tb, tb.nodes[0], inventory_copy(tb, tmp_path), tmp_path)
    _write_node_file(tb, "/root/.bashrc", NOISY_BASHRC)
    _write_node_file(tb, "/root/.profile", NOISY_PROFILE)
    _write_node_file(tb, "/root/.bash_profile", ". ~/.profile")
    # the noise really reaches a command's streams over SSH (sshd runs `bash -c CMD`; Debian's bash
    # then reads ~/.bashrc, not ~/.profile): stdout starts with the title escape, no newline after it
    r = tb.ssh(tb.nodes[0], "echo FIRST")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("\x1b]0;gpu-node\x07\x1b[1;32mWelcome")
    assert r.stdout.endswith("\x1b[0mFIRST\n")  # the command's first output is glued to the noise
    assert "maintenance window" in r.stderr and "\x1b]0;title-on-stderr\x07" in r.stderr
    return env


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_login_shell_noise_does_not_break_framing(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = _noisy_node(make_testbed, tmp_path)
    host = env.node.name
    r = env.dfo("verify-env", "-H", host, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["hosts"][host]["ok"] is True
    r = env.dfo("status", "-H", host, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["hosts"][host]["runs"] == []
    n = 40
    job, _ = env.job(f"python3 count.py {n} 0.01", {"count.py": COUNTER}, wait=30)
    r = env.dfo("launch", "-H", host, "-j", str(job))  # launch watches the run to its end: framed events
    assert r.returncode == 0, r.stdout + r.stderr
    assert "line 000039" in r.stdout
    run = env.dfo("status", "-H", host, "--json")
    runs = json.loads(run.stdout)["hosts"][host]["runs"]
    assert [x["state"] for x in runs] == ["succeeded"]
    r = env.dfo("tail", "-H", host, runs[0]["id"], "-n", "+1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == expected_lines(n)
    r = env.dfo("tail", "-H", host, "--no-follow", "-n", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == expected_lines(n)[-3:]


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_stream_that_never_starts_is_an_error_naming_the_host(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = _noisy_node(make_testbed, tmp_path)
    host = env.node.name
    job, _ = env.job("python3 count.py 5 0", {"count.py": COUNTER})
    run = env.launch(job)["run"]
    # now a login file that swallows what commands print on stdout: no frame can arrive
    _write_node_file(env.tb, "/root/.bashrc", NOISY_BASHRC + "\nexec >/dev/null\n")
    for args in (("tail", "-H", host, run, "-n", "+1"), ("tail", "-H", host, run, "--no-follow")):
        r = env.dfo(*args, timeout=60)
        assert r.returncode != 0 and r.stdout == ""
        first = r.stderr.splitlines()[0]
        assert host in first and "never started" in first, r.stderr
        assert "\x1b" not in r.stderr  # the node's escape codes are not replayed on this terminal


class _Canned:
    """A connection whose remote command prints ``lines`` (stands in for a node's stdout)."""

    name = "node-x"
    host = SimpleNamespace(python="python3")

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def run(self, command: str, *, timeout: float | None = None, stdin: Any = None,
            on_line: Callable[[str], Any] | None = None) -> Result:
        out = _Collector(on_line)
        for ln in self.lines:
            out.feed(ln.encode() + b"\n")
        out.flush()
        return Result(self.name, command, out.text(), "", 0, 0.0)

    def close(self) -> None:
        pass


def test_follow_without_a_start_event_is_an_error_not_silence() -> None:
    from orchestrator.errors import RemoteCommandError
    from orchestrator.steps.runs import follow

    info = '{"id":"r1","state":"succeeded"}'
    chunk = '@@DFO-EVENT@@ {"kind":"chunk","o":0,"t":"hello\\n"}'
    for lines in ([chunk, f'@@DFO-RESULT@@ {{"ok":true,"data":{info}}}'],  # chunks, but no start
                  [f'@@DFO-RESULT@@ {{"ok":true,"data":{info}}}']):  # a result, but no stream at all
        got: list[str] = []
        with pytest.raises(RemoteCommandError, match="never started") as exc:
            follow(_Canned(lines), "/workspace", on_line=got.append)  # type: ignore[arg-type]
        assert exc.value.host == "node-x" and got == []


# --------------------------------------------------------------------------- item 3: memory


def test_line_splitter_splits_a_huge_line_with_a_marker_and_loses_no_byte() -> None:
    from orchestrator.steps.runs import LineSplitter

    unit = "étape 1/9 ✓\r".encode()  # multi-byte characters: a cut never falls inside one
    body = unit * 40000  # ~560 KB, no newline
    got: list[str] = []
    split = LineSplitter(got.append, line_max=100_000)
    for i in range(0, len(body), 4093):
        split.feed(body[i:i + 4093])
    split.feed(b"\nshort\n")
    split.flush()
    assert got[-1] == "short" and len(got) > 5
    pieces = got[:-1]
    assert all(p.endswith(MARK) for p in pieces[:-1]) and not pieces[-1].endswith(MARK)
    assert all(len(p.encode()) <= 100_000 + len(MARK) for p in pieces)
    assert "".join(p.removesuffix(MARK) for p in pieces).encode() == body  # every byte, in order


def test_collector_in_streaming_mode_keeps_only_the_result() -> None:
    seen: list[str] = []

    def on_line(line: str) -> bool:
        seen.append(line)
        return line.startswith("@@DFO-RESULT@@ ")

    c = _Collector(on_line)
    for _ in range(2000):
        c.feed(b"@@DFO-EVENT@@ " + b"x" * 1000 + b"\n")
    c.feed(b'@@DFO-RESULT@@ {"ok":true}\n')
    c.flush()
    assert len(seen) == 2001
    assert len(c.text()) < 20000 and c.text().endswith('@@DFO-RESULT@@ {"ok":true}\n')


# Peak RSS of a command, as wait4 reports it. Linux carries the forking process's RSS into the child's
# ru_maxrss (fork copies the high-water mark, exec keeps it), so the command is forked from this small
# wrapper, not from pytest (over 100 MiB itself). The wrapper writes ru_maxrss (KiB) to argv[1].
_MAXRSS_WRAPPER = """\
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _run_measured(inv: Path, args: tuple[str, ...], sink: Callable[[bytes], None], tmp: Path,
                  timeout: float = 120) -> tuple[int, float, str]:
    """Run the CLI, hand its stdout to ``sink`` as it comes; (exit code, peak RSS in MiB, stderr)."""
    rss_file = tmp / f"maxrss-{time.monotonic_ns()}"
    argv = [sys.executable, "-c", _MAXRSS_WRAPPER, str(rss_file), *dfo_argv(inv, *args)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, COLUMNS="200"))
    assert p.stdout is not None and p.stderr is not None
    err: list[bytes] = []
    t = threading.Thread(target=lambda: err.append(p.stderr.read()), daemon=True)  # type: ignore[union-attr]
    t.start()
    timer = threading.Timer(timeout, p.kill)
    timer.start()
    try:
        while True:
            block = p.stdout.read(1 << 20)
            if not block:
                break
            sink(block)
        code = p.wait()
    finally:
        timer.cancel()
    t.join(10)
    return code, int(rss_file.read_text()) / 1024, b"".join(err).decode("utf-8", "replace")


def _node_sha256(env: RunsEnv, run: str) -> str:
    return env.node_sh(f"sha256sum {LOG_DIR}/{run}/log").split()[0]


RSS_LIMIT_MB = 100


@on_testbed
def test_tail_memory_is_bounded_on_a_big_log(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = RunsEnv(testbed, testbed.nodes[0], inventory_copy(testbed, tmp_path), tmp_path)
    text = "step 123456 loss 0.123456 lr 6.0e-04 tokens/s 123456 grad_norm 0.98765 padding padding\n"
    size = len(text) * 1_000_000  # ~90 MB, made on the node
    job, _ = env.job(f"yes {text.strip()!r} | head -c {size}")
    run = env.launch(job)["run"]
    assert env.wait_state(run, ("succeeded",))["state"] == "succeeded"
    want = _node_sha256(env, run)
    for extra in ((), ("--no-follow",)):
        h, n = hashlib.sha256(), [0]

        def sink(b: bytes, h=h, n=n) -> None:  # type: ignore[no-untyped-def]
            h.update(b)
            n[0] += len(b)

        code, rss, err = _run_measured(env.inv, ("tail", "-H", env.node.name, run, "-n", "+1", *extra), sink, tmp_path)
        assert code == 0, err
        assert n[0] == size and h.hexdigest() == want  # the whole log, byte for byte
        assert rss < RSS_LIMIT_MB, f"tail {' '.join(extra)} peaked at {rss:.0f} MiB"


@on_testbed
def test_tail_memory_is_bounded_on_one_huge_line(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = RunsEnv(testbed, testbed.nodes[0], inventory_copy(testbed, tmp_path), tmp_path)
    size = 100_000_000  # tqdm-style: \r-separated progress and not one newline
    job, _ = env.job(f"yes $'step 12345/99999 [=====>    ] 3.21it/s loss=0.1234\\r' | tr -d '\\n' | head -c {size}")
    run = env.launch(job)["run"]
    assert env.wait_state(run, ("succeeded",))["state"] == "succeeded"
    want = _node_sha256(env, run)
    h, state = hashlib.sha256(), {"rest": b"", "lines": 0, "marked": 0}

    def sink(b: bytes) -> None:  # rebuild the log: drop the marker and the newline dfo added after each piece
        data = state["rest"] + b  # type: ignore[operator]
        *whole, state["rest"] = data.split(b"\n")
        for ln in whole:
            state["lines"] += 1  # type: ignore[operator]
            if ln.endswith(MARK.encode()):
                state["marked"] += 1  # type: ignore[operator]
                ln = ln[: -len(MARK)]
            h.update(ln)

    code, rss, err = _run_measured(env.inv, ("tail", "-H", env.node.name, run, "-n", "+1"), sink, tmp_path)
    assert code == 0, err
    assert rss < RSS_LIMIT_MB, f"tail peaked at {rss:.0f} MiB"
    assert state["rest"] == b"" and state["marked"] == state["lines"] - 1 >= 100  # type: ignore[operator]
    assert h.hexdigest() == want  # every byte, in order


# --------------------------------------------------------------------------- item 4: truncation, rotation

# "a" lines, then waits for gate g1; "b" lines, then waits for g2; exits.
PHASED = """\
import os, sys, time
gates = sys.argv[1]
def phase(tag, n, gate):
    for i in range(n):
        print("%s %04d" % (tag, i), flush=True)
    while not os.path.exists(os.path.join(gates, gate)):
        time.sleep(0.02)
phase("a", int(sys.argv[2]), "g1")
phase("b", int(sys.argv[3]), "g2")
"""


class _Tail:
    """`dfo tail` running in the background; its stdout lines arrive in a queue."""

    def __init__(self, env: RunsEnv, run: str, made: list[_Tail], **extra_env: str) -> None:
        self.p = dfo_popen(env.inv, "tail", "-H", env.node.name, run, "-n", "+1", env=extra_env)
        made.append(self)
        self.lines: list[str] = []
        self.q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for ln in self.p.stdout:
            self.q.put(ln.rstrip("\n"))
        self.q.put(None)

    def until(self, line: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.lines:
            got = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            assert got is not None, f"tail ended before {line!r}: {self.p.stderr.read() if self.p.stderr else ''}"
            self.lines.append(got)

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        code = self.p.wait(timeout=timeout)
        while (got := self.q.get(timeout=10)) is not None:
            self.lines.append(got)
        return code, self.p.stderr.read() if self.p.stderr else ""


@pytest.fixture
def tails() -> Iterator[list[_Tail]]:
    """Tails a test started; any still running at its end (a failed test) is killed."""
    made: list[_Tail] = []
    yield made
    for t in made:
        if t.p.poll() is None:
            t.p.kill()
            t.p.wait(10)


def _lines(tag: str, n: int) -> list[str]:
    return [f"{tag} {i:04d}" for i in range(n)]


@on_testbed
def test_tail_follows_a_log_truncated_then_rotated(testbed, tmp_path: Path, tails: list[_Tail]) -> None:  # type: ignore[no-untyped-def]
    env = RunsEnv(testbed, testbed.nodes[0], inventory_copy(testbed, tmp_path), tmp_path)
    gates = f"/root/runs-test/gates-{tmp_path.name}"
    env.node_sh(f"mkdir -p {gates}")
    job, _ = env.job(f"python3 phased.py {gates} 300 20", {"phased.py": PHASED})
    run = env.launch(job)["run"]
    log = f"{LOG_DIR}/{run}/log"
    tail = _Tail(env, run, tails)
    tail.until("a 0299")
    env.node_sh(f": > {log} && touch {gates}/g1")  # copytruncate-style; the trainer appends on (O_APPEND)
    tail.until("b 0019")
    # rotation: the log moves away and a new file takes its name
    c = "".join(f"c {i:04d}\\n" for i in range(50))
    env.node_sh(f"mv {log} {log}.1 && printf '{c}' > {log}.new && mv {log}.new {log} && touch {gates}/g2")
    code, err = tail.finish()
    assert code == 0, err
    assert tail.lines == _lines("a", 300) + _lines("b", 20) + _lines("c", 50)  # nothing lost, nothing twice
    assert f"dfo: {env.node.name}: log {log} was truncated; following from its new start" in err
    assert f"dfo: {env.node.name}: log {log} was replaced; following from its new start" in err


@on_testbed
def test_tail_resumes_across_a_dead_link_during_truncation_and_rotation(make_testbed, tmp_path: Path,
                                                                       tails: list[_Tail]) -> None:  # type: ignore[no-untyped-def]
    tb = make_testbed(s3=False)
    env = RunsEnv(tb, tb.nodes[0], inventory_copy(tb, tmp_path), tmp_path)
    gates = "/root/runs-test/gates"
    env.node_sh(f"mkdir -p {gates}")
    job, _ = env.job(f"python3 phased.py {gates} 300 20", {"phased.py": PHASED})
    run = env.launch(job)["run"]
    log = f"{LOG_DIR}/{run}/log"
    tail = _Tail(env, run, tails, DFO_TAIL_STALL_S="2")
    tail.until("a 0299")
    tb.link_down(env.node)  # while the controller cannot see: truncate, and the trainer writes 20 lines
    env.node_sh(f": > {log} && touch {gates}/g1")
    deadline = time.monotonic() + 10
    while "b 0019" not in env.node_sh(f"cat {log}") and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(3)  # the watchdog has given the link up
    tb.link_up(env.node)
    tail.until("b 0019", timeout=40)
    tb.link_down(env.node)  # again: rotate, and the new file grows past the old offset
    c = "".join(f"c {i:04d}\\n" for i in range(400))
    env.node_sh(f"mv {log} {log}.1 && printf '{c}' > {log} && touch {gates}/g2")
    time.sleep(3)
    tb.link_up(env.node)
    code, err = tail.finish(timeout=60)
    assert code == 0, err
    assert tail.lines == _lines("a", 300) + _lines("b", 20) + _lines("c", 400)
    assert err.count("reconnected to") >= 2, err
    assert "was truncated; following from its new start" in err and "was replaced;" in err


def test_log_reader_notices_truncation_and_replacement(tmp_path: Path) -> None:
    from remote.runs.logfollow import LogReader

    log = tmp_path / "log"
    log.write_bytes(b"a\n" * 100)
    r = LogReader(str(log), 0)
    assert r.open() is None and r.read(1 << 20) == (0, b"a\n" * 100) and r.read(10) == (200, b"")
    assert r.changed() is None
    with open(log, "r+b") as f:  # truncated, then a little written: shorter than the offset
        f.truncate(0)
    with open(log, "ab") as f:
        f.write(b"b\n")
    assert r.changed() == "truncated" and r.reset_fields("truncated")["offset"] == 0
    assert r.read(100) == (0, b"b\n")
    os.rename(log, tmp_path / "log.1")
    assert r.changed() is None  # moved away, no new file yet: keep waiting
    log.write_bytes(b"c\n" * 300)  # the new file is longer than the offset: only its inode tells
    old = r.ino
    assert r.changed() == "replaced" and r.ino != old and r.offset == 0
    assert r.read(1 << 20) == (0, b"c\n" * 300)
    # a resume that names the file its offset belongs to: a different file is a reset, too
    assert LogReader(str(log), 2, ino=old).open() == "replaced"
    assert LogReader(str(log), 10_000, ino=r.ino).open() == "truncated"
    assert LogReader(str(log), 4, ino=r.ino).open() is None
