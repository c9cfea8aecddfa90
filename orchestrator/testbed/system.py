"""Low-level helpers of the testbed: processes, ports, readiness, namespaces, stale state.

Only orchestrator/testbed/__init__.py and orchestrator/testbed/s3.py use this module. Everything here
runs on the controller's machine; nothing here ever touches a real remote node.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

STATE_DIR = Path("/run/dfo-testbed")  # one JSON file per live testbed (root mode only)
LOCK_PATH = Path("/run/lock/dfo-testbed.lock")


class TestbedError(RuntimeError):
    """The testbed could not start or act: says what failed and where its log is."""

    __test__ = False  # not a pytest test class


def refuse_if_forbidden(what: str) -> None:
    """tests/conftest.py sets DFO_TESTBED_FORBIDDEN=<test id> while a test that is not marked testbed runs
    (the unit lane, -m "not testbed", must not start one): starting one then is that test's bug."""
    test = os.environ.get("DFO_TESTBED_FORBIDDEN")
    if test:
        raise TestbedError(f"{test} started {what} but is not marked testbed: use a testbed fixture, or mark it "
                           "@pytest.mark.testbed (tests/conftest.py, test lanes)")


def run(argv: Sequence[str], *, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a local command (never through a shell), capturing its output."""
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return proc


def run_input(argv: Sequence[str], text: str, *, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``run`` with ``text`` on stdin (a secret stays out of argv); TestbedError when it fails."""
    proc = subprocess.run(list(argv), input=text, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise TestbedError(f"{argv[0]} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return proc


def free_ports(count: int, host: str = "") -> list[int]:
    """Ports that are free right now (held open together so they differ)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_banner(host: str, port: int, *, timeout: float, alive: subprocess.Popen[bytes] | None = None,
                prefix: bytes = b"SSH-") -> float:
    """Connect until the server greets with `prefix` (b"": accepts); returns the seconds waited."""
    start = time.monotonic()
    last = "no attempt"
    while time.monotonic() - start < timeout:
        if alive is not None and alive.poll() is not None:
            raise TestbedError(f"{host}:{port}: the server exited with {alive.returncode} before it listened")
        try:
            with socket.create_connection((host, port), timeout=1) as s:
                if not prefix:  # a server that speaks second (HTTP): connecting is enough
                    return time.monotonic() - start
                s.settimeout(2)
                if s.recv(64).startswith(prefix):
                    return time.monotonic() - start
                last = "unexpected greeting"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.02)
    raise TestbedError(f"{host}:{port}: no {prefix!r} greeting within {timeout:.0f}s ({last})")


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def children_map() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def descendants(pid: int) -> list[int]:
    kids = children_map()
    out: list[int] = []
    todo = list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def signal_pids(pids: Sequence[int], sig: int) -> int:
    sent = 0
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)
            sent += 1
    return sent


def stop_process(proc: subprocess.Popen[bytes], grace: float = 1.0) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; always reaps."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@cache
def netns_usable() -> str | None:
    """None when this process can build namespace nodes, else the reason it cannot."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (apt-get install iproute2 util-linux)"
    probe = subprocess.run(["unshare", "--net", "--mount", "--uts", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"unshare --net --mount failed: {probe.stderr.strip()}"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns list` failed"
    return None


@contextlib.contextmanager
def global_lock() -> Iterator[None]:
    """Serialises address allocation between testbeds of concurrent processes."""
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    with open(LOCK_PATH, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def used_subnets(prefix: str = "10.77.") -> set[int]:
    """Third octets of 10.77.X.0/24 ranges that some interface of this namespace already has."""
    out = run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    used: set[int] = set()
    for word in out.split():
        if word.startswith(prefix):
            with contextlib.suppress(ValueError, IndexError):
                used.add(int(word.split(".")[2]))
    return used


def write_state(tb_id: str, state: dict[str, object]) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    path = STATE_DIR / f"{tb_id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)


def drop_state(tb_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / f"{tb_id}.json").unlink()


def teardown_netns(netns: Sequence[str], links: Sequence[str]) -> None:
    """Kill every process in each namespace, delete the namespaces, then our own links."""
    for ns in netns:
        pids = [int(p) for p in run(["ip", "netns", "pids", ns], check=False).stdout.split() if p.isdigit()]
        signal_pids(pids, signal.SIGKILL)
    for ns in netns:
        deadline = time.monotonic() + 5
        while run(["ip", "netns", "pids", ns], check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.02)
        run(["ip", "netns", "delete", ns], check=False)
    for link in links:
        if Path(f"/sys/class/net/{link}").exists():
            run(["ip", "link", "delete", link], check=False)


def reap_stale() -> list[str]:
    """Tear down testbeds whose owning process died without stopping them (e.g. SIGKILL).

    Only testbeds recorded in STATE_DIR are touched, and only the namespaces, links and
    processes they recorded (a process only if its command line still names its workdir).
    """
    reaped: list[str] = []
    if not STATE_DIR.is_dir():
        return reaped
    for path in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if pid_alive(int(state.get("owner", 0))):
            continue
        marker = str(state.get("workdir", "\0"))
        signal_pids([p for p in state.get("pids", []) if marker in cmdline(p)], signal.SIGKILL)
        teardown_netns(state.get("netns", []), state.get("links", []))
        path.unlink(missing_ok=True)
        reaped.append(path.stem)
    return reaped


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def node_namespaces(anchor: int | None) -> set[tuple[str, int]]:
    """(kind, inode) of the network and mount namespaces of `anchor` (a node's sshd listener) that
    are not this process's own: a node's processes are found by them and never match ours."""
    out: set[tuple[str, int]] = set()
    for kind in ("net", "mnt"):
        node = _ns_inode(anchor, kind) if anchor else None
        if node is not None and node != _ns_inode(os.getpid(), kind):
            out.add((kind, node))
    return out


def namespace_pids(netns: str, spaces: set[tuple[str, int]]) -> list[int]:
    """Every live process of a namespace node: `ip netns pids NETNS` plus those in `spaces`."""
    listed = run(["ip", "netns", "pids", netns], check=False).stdout.split()
    out = {int(p) for p in listed if p.isdigit()}
    if spaces:
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and any(_ns_inode(int(entry.name), k) == ino for k, ino in spaces):
                out.add(int(entry.name))
    out.discard(os.getpid())
    return sorted(p for p in out if pid_alive(p))


def vanish_netns(netns: str, listener: subprocess.Popen[bytes], link: str | None, timeout: float = 10) -> list[int]:
    """Kill every process of a namespace node (SIGKILL, no warning, as a reclaimed machine), reap its
    sshd `listener`, then delete its network namespace and link. Returns the pids killed;
    TestbedError if some survive."""
    spaces = node_namespaces(listener.pid if listener.poll() is None else None)
    killed: set[int] = set()
    pids = namespace_pids(netns, spaces)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:  # again: a process may fork while we kill
        killed.update(pids)
        signal_pids(pids, signal.SIGKILL)
        time.sleep(0.02)
        pids = namespace_pids(netns, spaces)
    if pids:
        raise TestbedError(f"{netns}: processes {pids} survived SIGKILL for {timeout:.0f}s")
    stop_process(listener)
    run(["ip", "netns", "delete", netns], check=False)
    if link and Path(f"/sys/class/net/{link}").exists():
        run(["ip", "link", "delete", link], check=False)
    if run(["ip", "netns", "pids", netns], check=False).returncode == 0:
        raise TestbedError(f"{netns}: the network namespace is still there after `ip netns delete`")
    return sorted(killed)
