"""Issue 11, part 1: SSH through fabric. Multi-hop ProxyJump and ProxyCommand on real testbed nodes,
every hop's host key checked; typed ConnectionLost; bounded stderr; the local transport's clean-up."""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.config.models import load_inventory
from orchestrator.errors import ConnectionLost, HostError
from orchestrator.transport import open_connection
from orchestrator.transport.base import STDERR_KEEP, Transport
from orchestrator.transport.local import LocalConnection
from orchestrator.transport.resolve import resolve_host
from tests import _cli

on_testbed = pytest.mark.testbed


def dfo(inv: Path, *args: str, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return _cli.dfo(inv, *args, timeout=timeout, env=_cli.cli_env(**(env or {})))


def inventory(tb, tmp_path: Path, kh: Path | None = None, **hosts: dict) -> Path:  # type: ignore[no-untyped-def]
    doc = yaml.safe_load(Path(tb.inventory_path).read_text())
    doc["defaults"]["known_hosts"] = str(kh or tmp_path / "known_hosts")
    doc["defaults"]["connect_timeout"] = 3
    doc["hosts"].update(hosts)
    p = tmp_path / f"inventory-{random.randrange(1 << 30)}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def conn_for(inv: Path, name: str) -> Transport:
    """The host's transport as dfo opens it: `transport: ssh` is OpenSSH or paramiko as DFO_SSH_TRANSPORT says
    (the each_ssh_transport fixture, tests/conftest.py)."""
    inventory_, path = load_inventory(inv)
    return open_connection(resolve_host(inventory_, name, path))


def kh_keys(path: Path) -> dict[str, str]:
    """known_hosts as {name: "type base64"}."""
    out = {}
    for line in path.read_text().splitlines():
        f = line.split()
        if len(f) >= 3 and not line.startswith("#"):
            out[f[0]] = f"{f[1]} {f[2]}"
    return out


# --------------------------------------------------------------------------- a 2-hop path


def _sh(argv: list[str]) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


def _wait_key(tb, via, address: str, key: str | None = None, timeout: float = 20) -> str:  # type: ignore[no-untyped-def]
    """Wait until sshd at ``address`` (seen from node ``via``) serves a host key (``key``, if given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        scan = tb.node_exec(via, f"ssh-keyscan -T 2 -t ed25519 {address} 2>/dev/null").stdout
        got = [" ".join(line.split()[1:3]) for line in scan.splitlines() if line.strip()]
        if got and (key is None or key in got):
            return got[0]
        time.sleep(0.1)
    raise AssertionError(f"sshd at {address} (seen from {via.name}) did not serve {key or 'a key'}")


def _listen_only(tb, node, address: str, seen_from) -> None:  # type: ignore[no-untyped-def]
    """Make the node's sshd listen on ``address`` alone (sshd re-reads its config on SIGHUP)."""
    r = tb.node_exec(node, f"sed -i 's/^ListenAddress .*/ListenAddress {address}:22/' /etc/ssh/sshd_config && "
                           "kill -HUP $(cat /etc/ssh/sshd.pid)")
    assert r.returncode == 0, r.stderr
    _wait_key(tb, seen_from, address)


def _new_host_key(tb, node, address: str, seen_from) -> str:  # type: ignore[no-untyped-def]
    """A new host key for the node (inside its private /etc/ssh), served from now on."""
    r = tb.node_exec(node, "rm -f /etc/ssh/ssh_host_ed25519_key /etc/ssh/ssh_host_ed25519_key.pub && "
                           "ssh-keygen -q -t ed25519 -N '' -f /etc/ssh/ssh_host_ed25519_key && "
                           "kill -HUP $(cat /etc/ssh/sshd.pid)")
    assert r.returncode == 0, r.stderr
    new = tb.host_public_key(node)
    _wait_key(tb, seen_from, address, new)
    return new


@pytest.fixture
def chain(make_testbed):  # type: ignore[no-untyped-def]
    """Three nodes A, B, C: the controller reaches only A; B listens only on a link to A; C only on a
    link to B (veth pairs between their namespaces). Yields (tb, A, B, C, B's address, C's address,
    B's address on the B-C link)."""
    tb = make_testbed(nodes=3, s3=False)
    if not tb.isolated:
        pytest.skip("needs the testbed's network namespaces (root with ip netns)")
    a, b, c = tb.nodes
    ns = {n.name: f"dfo-{tb.id}-{i}" for i, n in enumerate(tb.nodes, start=1)}
    have = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert all(v in have for v in ns.values()), have
    r = random.randrange(1, 250)
    net = f"10.98.{r}"
    for (x, y), base in (((a, b), 0), ((b, c), 4)):  # A-B: .1/.2, B-C: .5/.6
        ex, ey = f"fx{tb.id}{base}", f"fy{tb.id}{base}"
        # made inside the namespaces (gone with them when the testbed stops), never in the host's
        _sh(["ip", "-n", ns[x.name], "link", "add", ex, "type", "veth", "peer", "name", ey, "netns", ns[y.name]])
        for end, node, host in ((ex, x, base + 1), (ey, y, base + 2)):
            _sh(["ip", "-n", ns[node.name], "addr", "add", f"{net}.{host}/30", "dev", end])
            _sh(["ip", "-n", ns[node.name], "link", "set", end, "up"])
    b_addr, c_addr = f"{net}.2", f"{net}.6"
    _listen_only(tb, c, c_addr, seen_from=b)
    _listen_only(tb, b, b_addr, seen_from=a)
    return tb, a, b, c, b_addr, c_addr, f"{net}.5"


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_two_hop_proxy_jump_checks_every_hop_and_a_changed_key_anywhere_refuses_the_path(  # type: ignore[no-untyped-def]
        chain, tmp_path: Path) -> None:
    """C is reachable only through B, B only through A. `proxy_jump: A,B` reaches C (fabric's own
    ProxyJump chain reverses the hops, and dfo's old code dropped every hop after the first); all
    three keys are recorded on first contact; a changed key on C, B or A refuses the path (exit 4)
    naming that hop, and nothing runs on C."""
    tb, a, b, c, b_addr, c_addr, b_side = chain
    kh0 = tmp_path / "known_hosts"
    jump = f"root@{a.address},root@{b_addr}"
    inv = inventory(tb, tmp_path, kh0, deep={"host": c_addr, "proxy_jump": jump},
                    onlya={"host": c_addr, "proxy_jump": f"root@{a.address}"}, direct_b={"host": b_addr})

    # the isolation is real: not directly, not through A alone
    for name in ("direct_b", "onlya"):
        r = dfo(inv, "verify-env", "-H", name)
        assert r.returncode == 4 and "Traceback" not in r.stderr, (name, r.stdout, r.stderr)
    r = dfo(inv, "verify-env", "-H", "deep", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["hosts"]["deep"]["node"]["hostname"] == c.name
    keys = kh_keys(kh0)
    assert keys.get(a.address) == tb.host_public_key(a)
    assert keys.get(b_addr) == tb.host_public_key(b)
    assert keys.get(c_addr) == tb.host_public_key(c)
    conn = conn_for(inv, "deep")
    try:
        assert conn.run("echo $SSH_CONNECTION").stdout.split()[0] == b_side  # C was entered from B
    finally:
        conn.close()
    recorded = kh0.read_text()

    # the same path from ssh_config: the target's ProxyJump names hop-b, whose own ProxyJump is hop-a
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host hop-a\n  HostName {a.address}\n  User root\n"
                   f"Host hop-b\n  HostName {b_addr}\n  ProxyJump hop-a\n"
                   f"Host deep-c\n  HostName {c_addr}\n  ProxyJump hop-b\n")
    r = dfo(inventory(tb, tmp_path, kh0, viacfg={"host": "deep-c"}), "verify-env", "-H", "viacfg", "--json",
            env={"DFO_SSH_CONFIG": str(cfg)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["hosts"]["viacfg"]["node"]["hostname"] == c.name
    assert kh0.read_text() == recorded  # the same three keys, checked, nothing new

    # a changed key on any hop refuses the whole path; try the target first, then the middle, then the first hop
    for node, address, seen_from in ((c, c_addr, b), (b, b_addr, a), (a, a.address, None)):
        if seen_from is None:
            tb.rotate_host_key(node)
        else:
            _new_host_key(tb, node, address, seen_from)
        kh = tmp_path / f"known_hosts.{node.name}"
        kh.write_text(recorded)
        tb.node_exec(c, "rm -rf /root/.cache/dfo")
        r = dfo(inventory(tb, tmp_path, kh, deep={"host": c_addr, "proxy_jump": jump}), "verify-env", "-H", "deep")
        assert r.returncode == 4, (node.name, r.stdout, r.stderr)
        assert f"host key for {address} CHANGED" in r.stderr and "Traceback" not in r.stderr, (node.name, r.stderr)
        assert tb.node_exec(c, "test -e /root/.cache/dfo && echo yes || echo no").stdout.strip() == "no"
        assert kh.read_text() == recorded  # the old key stays; nothing was appended


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_hop_cut_during_a_call_is_connection_lost_within_30s(chain, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Liveness covers the whole path: the first hop's link cut while C runs a silent command ends
    the call with ConnectionLost (exit 4) within 30 s, not after TCP's ~15 min."""
    tb, a, _b, c, b_addr, c_addr, _ = chain
    inv = inventory(tb, tmp_path, deep={"host": c_addr, "proxy_jump": f"root@{a.address},root@{b_addr}"})
    conn = conn_for(inv, "deep")
    box: dict[str, object] = {}

    def call() -> None:
        try:
            conn.run("sleep 120", timeout=300)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        box["t"] = time.monotonic()

    try:
        assert conn.run("hostname").stdout.strip() == c.name
        t = threading.Thread(target=call, daemon=True)
        t.start()
        time.sleep(1)
        tb.link_down(a)
        cut = time.monotonic()
        t.join(45)
        assert not t.is_alive(), "the call still waits 45 s after the first hop's link was cut"
        assert isinstance(box.get("error"), ConnectionLost), repr(box.get("error"))
        assert float(box["t"]) - cut < 30  # type: ignore[arg-type]
    finally:
        tb.link_up(a)
        conn.close()


# --------------------------------------------------------------------------- ProxyCommand


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_proxy_command_from_ssh_config_is_used_through_a_shell(testbed2, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """ssh_config's ProxyCommand (was ignored): run by a shell as OpenSSH runs it (a redirection
    works), %h/%p expanded, the target's key checked and recorded by dfo."""
    jump, target = testbed2.nodes
    log = tmp_path / "proxy.log"
    cfg = tmp_path / "ssh_config"
    cfg.write_text(
        f"Host pc-target\n  HostName {target.address}\n  Port {target.port}\n"
        f"  ProxyCommand ssh -v -i {testbed2.identity} -o BatchMode=yes -o IdentitiesOnly=yes "
        f"-o UserKnownHostsFile={tmp_path}/system_kh -o StrictHostKeyChecking=accept-new "
        f"-p {jump.port} {jump.user}@{jump.address} -W %h:%p 2>>{log}\n"
        "Host pc-broken\n  HostName 192.0.2.1\n  ProxyCommand false\n")
    inv = inventory(testbed2, tmp_path, pc={"host": "pc-target"}, broken={"host": "pc-broken"})
    env = {"DFO_SSH_CONFIG": str(cfg)}
    r = dfo(inv, "verify-env", "-H", "pc", "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["hosts"]["pc"]["node"]["hostname"] == target.name
    assert "debug1" in log.read_text()  # the system ssh ran, its stderr redirected by the shell
    label = target.address if target.port == 22 else f"[{target.address}]:{target.port}"
    assert kh_keys(tmp_path / "known_hosts") == {label: testbed2.host_public_key(target)}  # only the target's
    if testbed2.isolated:
        monkeypatch.setenv("DFO_SSH_CONFIG", str(cfg))
        conn = conn_for(inv, "pc")
        try:
            assert conn.run("echo $SSH_CONNECTION").stdout.split()[0] == jump.address
        finally:
            conn.close()
    r = dfo(inv, "verify-env", "-H", "broken", env=env, timeout=60)
    assert r.returncode == 4 and "broken" in r.stderr and "Traceback" not in r.stderr, r.stdout + r.stderr


@pytest.mark.usefixtures("each_ssh_transport")
def test_proxy_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inventory's proxy_jump wins over ssh_config's ProxyCommand; ssh_config's ProxyJump or
    ProxyCommand over defaults.proxy_jump; `none` means direct."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host pc\n  HostName 192.0.2.7\n  Port 2201\n  ProxyCommand nc -x proxy %h %p\n"
                   "Host pj\n  ProxyJump a,b@c:2\n")
    monkeypatch.setenv("DFO_SSH_CONFIG", str(cfg))
    inv_path = tmp_path / "inventory.yaml"
    inv_path.write_text(yaml.safe_dump({"defaults": {"proxy_jump": "dj", "known_hosts": "kh"}, "hosts": {
        "pc": {}, "pj": {}, "own": {"host": "pc", "proxy_jump": "x"}, "plain": {"host": "192.0.2.9"},
        "off": {"host": "192.0.2.9", "proxy_jump": "none"}}}))
    inv, path = load_inventory(inv_path)
    got = {n: (h.proxy_jump, h.proxy_command) for n in inv.hosts for h in [resolve_host(inv, n, path)]}
    assert got == {"pc": (None, "nc -x proxy 192.0.2.7 2201"), "pj": ("a,b@c:2", None), "own": ("x", None),
                   "plain": ("dj", None), "off": (None, None)}


# --------------------------------------------------------------------------- typed errors, bounded output


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_connection_killed_during_a_call_raises_connection_lost(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = testbed.nodes[0]
    conn = conn_for(inventory(testbed, tmp_path), node.name)
    box: dict[str, BaseException] = {}

    def call() -> None:
        try:
            conn.run("sleep 30", timeout=60)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    try:
        conn.run("true")
        t = threading.Thread(target=call, daemon=True)
        t.start()
        time.sleep(1)
        assert testbed.kill_ssh_sessions(node) >= 1
        t.join(25)
        assert not t.is_alive()
        err = box.get("error")
        assert isinstance(err, ConnectionLost) and err.exit_code == 4, repr(err)
        assert conn.run("echo back").stdout.strip() == "back"  # the next call connects again
    finally:
        conn.close()


@pytest.mark.parametrize("transport", [pytest.param("openssh", marks=on_testbed),
                                       pytest.param("paramiko", marks=on_testbed), "local"])
def test_stderr_is_bounded_to_its_tail(transport: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if transport != "local":
        tb = request.getfixturevalue("testbed")
        request.getfixturevalue("monkeypatch").setenv("DFO_SSH_TRANSPORT", transport)
        conn: Transport = conn_for(inventory(tb, tmp_path), tb.nodes[0].name)
    else:
        inv_path = tmp_path / "inventory.yaml"
        inv_path.write_text("hosts:\n  me: {transport: local}\n")
        inv, path = load_inventory(inv_path)
        conn = open_connection(resolve_host(inv, "me", path))
        assert isinstance(conn, LocalConnection)
    try:
        res = conn.run("head -c 3000000 /dev/zero | tr '\\0' x >&2; echo; echo THE-END >&2; echo out")
    finally:
        conn.close()
    assert res.ok and res.stdout.strip() == "out"
    assert len(res.stderr) < STDERR_KEEP + 200, len(res.stderr)
    assert res.stderr.endswith("THE-END\n") and "bytes of stderr were dropped" in res.stderr


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_output_written_after_the_exit_status_is_not_lost(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """sshd sends the exit status when the shell exits, and the output still in flight after it:
    the call reads on to the channel's EOF (as OpenSSH's client does), so the tail of stdout and
    stderr (a result frame, the end of a traceback) is never cut off."""
    conn = conn_for(inventory(testbed, tmp_path), testbed.nodes[0].name)
    try:
        res = conn.run("(sleep 1; echo LATE-ERR >&2; echo LATE-OUT) & echo now")
    finally:
        conn.close()
    assert res.ok and res.stdout.split() == ["now", "LATE-OUT"] and res.stderr.strip() == "LATE-ERR", res


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    state = stat.read_text().split(")")[-1].split()[0] if stat.exists() else "X"
    return state not in ("Z", "X")


@pytest.mark.parametrize("how", ["on_line raises", "timeout"])
def test_the_local_transport_kills_what_its_call_started_when_the_call_ends_early(how: str, tmp_path: Path) -> None:
    inv_path = tmp_path / "inventory.yaml"
    inv_path.write_text("hosts:\n  me: {transport: local}\n")
    inv, path = load_inventory(inv_path)
    conn = LocalConnection(resolve_host(inv, "me", path))
    pids: list[int] = []

    def on_line(line: str) -> bool:
        pids.extend(int(p) for p in line.split())
        if how == "on_line raises":
            raise RuntimeError("callback failed")
        return False

    cmd = "sleep 60 & echo $$ $!; wait"
    with pytest.raises(RuntimeError if how == "on_line raises" else HostError):
        conn.run(cmd, on_line=on_line, timeout=30 if how == "on_line raises" else 1.5)
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), f"still running: {[p for p in pids if _alive(p)]}"


@pytest.mark.parametrize("bad", ["Host x\n  Port\n", "Host x\n  Match foo\n"])
@pytest.mark.usefixtures("each_ssh_transport")
def test_an_unreadable_ssh_config_is_exit_2_naming_the_file(tmp_path: Path, bad: str) -> None:
    cfg = tmp_path / "ssh_config"
    cfg.write_text(bad)
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  a: {host: 192.0.2.1}\n")
    r = dfo(inv, "verify-env", "-H", "a", env={"DFO_SSH_CONFIG": str(cfg)}, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert str(cfg) in r.stderr and "Traceback" not in r.stderr, r.stderr
