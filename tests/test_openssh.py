"""Issue 18, items 1-5: the OpenSSH client as a transport. ssh_config holds (Include, IdentitiesOnly,
IdentityAgent, CertificateFile), host certificates and @cert-authority, any login shell, a new key said on
stderr, connection sharing with a dead master passed over, and no paramiko on the OpenSSH path.

Every case runs against real testbed sshd nodes, with ssh_config files, agents and keys in tmp folders
(never the real ~/.ssh). Before this change each failed: `transport: openssh` was not a valid inventory
value (exit 2), and the paramiko transport ignored Include ("does not resolve", exit 4), offered every
agent key ("No existing session"), had no IdentityAgent or CertificateFile ("Authentication failed"),
recorded a plain key under a CA-only known_hosts without a word, and ran commands with the login shell
(fish, tcsh: every command failed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.transport.base import sh_command
from tests import _cli

on_testbed = pytest.mark.testbed
ROOT = Path(__file__).resolve().parent.parent


def inventory(tb: Any, tmp_path: Path, *, kh: Path | None = None, defaults: dict[str, Any] | None = None,
              **hosts: dict[str, Any]) -> Path:
    doc = yaml.safe_load(Path(tb.inventory_path).read_text())
    doc["defaults"]["known_hosts"] = str(kh or tmp_path / "known_hosts")
    doc["defaults"]["connect_timeout"] = 5
    doc["defaults"].update(defaults or {})
    doc["hosts"].update(hosts)
    p = tmp_path / f"inventory-{time.monotonic_ns()}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def dfo(inv: Path, *args: str, timeout: float = 120, **env: str | None) -> subprocess.CompletedProcess[str]:
    return _cli.dfo(inv, *args, timeout=timeout, env=_cli.cli_env(**env))


def hostname_of(r: subprocess.CompletedProcess[str], name: str) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    return str(json.loads(r.stdout)["hosts"][name]["node"]["hostname"])


def keygen(path: Path, comment: str = "dfo-test") -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)
    return path


def copy_key(src: Path, dest: Path) -> Path:
    dest.write_bytes(src.read_bytes())
    dest.chmod(0o600)
    dest.with_name(dest.name + ".pub").write_bytes(src.with_suffix(".pub").read_bytes())
    return dest


def node_sshd(tb: Any, node: Any, *lines: str) -> None:
    """Add lines to the node's sshd_config (its own /etc/ssh) and make sshd re-read it."""
    etc = Path(tb.workdir) / node.name / "etc"
    with open(etc / "sshd_config", "a") as f:
        f.write("".join(line + "\n" for line in lines))
    os.kill(tb._st(node).proc.pid, signal.SIGHUP)
    time.sleep(0.5)
    deadline = time.monotonic() + 15
    while tb.ssh(node, "true", known_hosts=tb.workdir / "kh-probe").returncode != 0:  # sshd re-executes on SIGHUP
        assert time.monotonic() < deadline, f"{node.name}: sshd did not come back after its config changed"
        time.sleep(0.2)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[str]:
    """A private ssh-agent (its socket under tmp_path); killed after the test."""
    sock = str(tmp_path / "agent.sock")
    p = subprocess.Popen(["ssh-agent", "-D", "-a", sock], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield sock
    finally:
        p.kill()
        p.wait()


def ssh_add(sock: str, *keys: Path) -> None:
    for k in keys:
        subprocess.run(["ssh-add", "-q", str(k)], check=True, capture_output=True,
                       env=dict(os.environ, SSH_AUTH_SOCK=sock))


# ------------------------------------------------------------------------------------------ the wrapper


@pytest.mark.parametrize("shell", ["dash", "bash", "fish", "tcsh"])
def test_a_command_reaches_sh_unchanged_through_any_login_shell(shell: str) -> None:
    """sshd runs `$SHELL -c STRING`: the wrapped command means the same to each shell (before: the raw
    command, which fish and tcsh parse their own way)."""
    path = subprocess.run(["sh", "-c", f"command -v {shell}"], capture_output=True, text=True).stdout.strip()
    if not path:
        pytest.fail(f"{shell} is not installed (apt-get install {shell})")
    cmd = """x='it''s'; printf '%s|%s|%s\\n' "$x" "$((1 + 2))" "a  b" ; echo "ü \\$HOME" >&2; exit 7"""
    r = subprocess.run([path, "-c", sh_command(cmd, "m1")], capture_output=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 7, r
    assert r.stdout == b"its|3|a  b\n"
    assert r.stderr == "ü $HOME\n".encode() + b"\x1edfo-exit:m1:7\x1e"


# ------------------------------------------------------------------------------------------ ssh_config


@on_testbed
@pytest.mark.parametrize("transport", ["openssh", "paramiko"])
def test_a_host_alias_defined_only_in_an_included_file(testbed: Any, tmp_path: Path, transport: str) -> None:
    """Both transports: OpenSSH applies the Include itself; paramiko connects where `ssh -G` says the host is
    (before: paramiko's own parser skipped the Include, and the alias did not resolve: exit 4)."""
    node = testbed.nodes[0]
    (tmp_path / "config.d").mkdir()
    (tmp_path / "config.d" / "gpu.conf").write_text(f"Host gpu-included\n  HostName {node.address}\n"
                                                    f"  Port {node.port}\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Include {tmp_path}/config.d/*.conf\nHost *\n  UserKnownHostsFile {tmp_path}/user_kh\n")
    inv = inventory(testbed, tmp_path, defaults={"ssh_config": str(cfg), "transport": transport},
                    inc={"host": "gpu-included"})
    r = dfo(inv, "verify-env", "-H", "inc", "--json")
    assert hostname_of(r, "inc") == node.name
    assert "does not apply" not in r.stderr, r.stderr  # the Include was applied: nothing to name


@on_testbed
def test_identities_only_with_an_agent_holding_seven_other_keys(testbed: Any, tmp_path: Path, agent: str) -> None:
    """The 1Password pattern: the agent holds many keys, ssh_config names the right one by its .pub with
    IdentitiesOnly; sshd (MaxAuthTries 6) hangs up on a client that offers them all."""
    node = testbed.nodes[0]
    others = [keygen(tmp_path / f"other{i}") for i in range(7)]
    key = copy_key(Path(testbed.identity), tmp_path / "gpu_key")
    ssh_add(agent, *others, key)
    key.unlink()  # only the .pub is left on disk: the private half is in the agent
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host gpu\n  HostName {node.address}\n  Port {node.port}\n  User {node.user}\n"
                   f"  IdentityFile {key}.pub\n  IdentitiesOnly yes\n"
                   f"Host *\n  UserKnownHostsFile {tmp_path}/user_kh\n")
    inv = inventory(testbed, tmp_path, defaults={"ssh_config": str(cfg), "transport": "openssh", "identity": None},
                    a={"host": "gpu"})
    assert hostname_of(dfo(inv, "verify-env", "-H", "a", "--json", SSH_AUTH_SOCK=agent), "a") == node.name


@on_testbed
def test_identity_agent_with_ssh_auth_sock_unset(testbed: Any, tmp_path: Path, agent: str) -> None:
    node = testbed.nodes[0]
    ssh_add(agent, copy_key(Path(testbed.identity), tmp_path / "k"))
    (tmp_path / "k").unlink()
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host gpu\n  HostName {node.address}\n  Port {node.port}\n  IdentityAgent {agent}\n"
                   f"Host *\n  UserKnownHostsFile {tmp_path}/user_kh\n")
    inv = inventory(testbed, tmp_path, defaults={"ssh_config": str(cfg), "transport": "openssh", "identity": None},
                    a={"host": "gpu"})
    assert hostname_of(dfo(inv, "verify-env", "-H", "a", "--json", SSH_AUTH_SOCK=None), "a") == node.name


@on_testbed
def test_a_user_certificate_named_by_certificate_file(make_testbed: Any, tmp_path: Path) -> None:
    """sshd trusts a user CA (TrustedUserCAKeys); the user's key is in no authorized_keys, only its
    certificate (a file name ssh would not guess: CertificateFile) gets it in."""
    tb = make_testbed(s3=False)
    node = tb.nodes[0]
    ca = keygen(tmp_path / "user_ca")
    (Path(tb.workdir) / node.name / "etc" / "user_ca.pub").write_bytes(ca.with_suffix(".pub").read_bytes())
    etc = "/etc/ssh" if tb.isolated else str(Path(tb.workdir) / node.name / "etc")
    node_sshd(tb, node, f"TrustedUserCAKeys {etc}/user_ca.pub")
    key = keygen(tmp_path / "me")
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", "dfo-test", "-n", node.user, f"{key}.pub"], check=True)
    signed = tmp_path / "me_cert-signed.pub"
    (tmp_path / "me-cert.pub").rename(signed)
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host gpu\n  HostName {node.address}\n  Port {node.port}\n  IdentityFile {key}\n"
                   f"  CertificateFile {signed}\n  IdentitiesOnly yes\nHost *\n  UserKnownHostsFile {tmp_path}/ukh\n")
    inv = inventory(tb, tmp_path, defaults={"ssh_config": str(cfg), "transport": "openssh", "identity": None},
                    a={"host": "gpu"})
    assert hostname_of(dfo(inv, "verify-env", "-H", "a", "--json", SSH_AUTH_SOCK=None), "a") == node.name


# ------------------------------------------------------------------------------------------ host keys


def _label(node: Any) -> str:
    return node.address if node.port == 22 else f"[{node.address}]:{node.port}"


@on_testbed
def test_a_host_certificate_is_verified_and_a_plain_key_under_a_ca_line_is_refused(make_testbed: Any,
                                                                                    tmp_path: Path) -> None:
    """known_hosts holds only `@cert-authority`: OpenSSH verifies node-1's host certificate and nothing is
    appended (before: paramiko trusted the plain key on first use, silently, and appended it). node-2
    has no certificate: refused on both transports (exit 4), nothing recorded. The paramiko transport,
    which cannot check certificates, refuses node-1 too, saying which transport does."""
    tb = make_testbed(nodes=2, s3=False)
    signed, plain = tb.nodes
    ca = keygen(tmp_path / "host_ca")
    etc = Path(tb.workdir) / signed.name / "etc"
    subprocess.run(["ssh-keygen", "-q", "-s", str(ca), "-I", signed.name, "-h", "-n", signed.address,
                    str(etc / "ssh_host_ed25519_key.pub")], check=True)
    inside = "/etc/ssh" if tb.isolated else str(etc)
    node_sshd(tb, signed, f"HostCertificate {inside}/ssh_host_ed25519_key-cert.pub")
    kh = tmp_path / "known_hosts"
    text = f"# only the CA\n@cert-authority {signed.address},{plain.address},{_label(signed)},{_label(plain)} " \
           f"{ca.with_suffix('.pub').read_text().split()[0]} {ca.with_suffix('.pub').read_text().split()[1]}\n"
    kh.write_text(text)
    inv = inventory(tb, tmp_path, kh=kh, defaults={"ssh_persist": 0})
    r = dfo(inv, "status", "-H", signed.name, DFO_SSH_TRANSPORT="openssh")
    assert r.returncode == 0, r.stderr
    assert "recorded host key" not in r.stderr and kh.read_text() == text
    for transport in ("openssh", "paramiko"):
        r = dfo(inv, "status", "-H", plain.name, DFO_SSH_TRANSPORT=transport)
        assert r.returncode == 4, (transport, r.stdout, r.stderr)
        assert "@cert-authority" in r.stderr or "certificate" in r.stderr, (transport, r.stderr)
        assert f"{kh}:2" in r.stderr and "Traceback" not in r.stderr, (transport, r.stderr)
        assert kh.read_text() == text
    r = dfo(inv, "status", "-H", signed.name, DFO_SSH_TRANSPORT="paramiko")
    assert r.returncode == 4 and "transport: openssh" in r.stderr, r.stderr
    assert kh.read_text() == text


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_new_host_key_is_said_on_stderr_once(testbed: Any, tmp_path: Path) -> None:
    """Before: recorded without a word."""
    node = testbed.nodes[0]
    inv = inventory(testbed, tmp_path)
    r = dfo(inv, "status", "-H", node.name)
    assert r.returncode == 0, r.stderr
    pub = testbed.host_public_key(node)
    fp = subprocess.run(["ssh-keygen", "-lf", "-"], input=pub, capture_output=True, text=True).stdout.split()[1]
    assert f"dfo: {node.name}: recorded host key ED25519 {fp}" in r.stderr, r.stderr
    assert (tmp_path / "known_hosts").read_text() == f"{_label(node)} {pub}\n"
    r = dfo(inv, "status", "-H", node.name)
    assert r.returncode == 0 and "recorded host key" not in r.stderr, r.stderr


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
def test_a_key_the_users_own_known_hosts_holds_is_trusted_as_ssh_trusts_it(testbed: Any, tmp_path: Path) -> None:
    """Before: dfo read only its own known_hosts (paramiko), so a key the user's ssh trusts was new to it."""
    node = testbed.nodes[0]
    user_kh = tmp_path / "user_kh"
    other = keygen(tmp_path / "x").with_suffix(".pub").read_text().split()[:2]
    user_kh.write_text(f"{_label(node)} {' '.join(other)}\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host *\n  UserKnownHostsFile {user_kh}\n")
    inv = inventory(testbed, tmp_path, defaults={"ssh_config": str(cfg), "ssh_persist": 0})
    r = dfo(inv, "status", "-H", node.name)  # the user's ssh would refuse this node: so does dfo
    assert r.returncode == 4 and "CHANGED" in r.stderr and str(user_kh) in r.stderr, r.stderr
    user_kh.write_text(f"{_label(node)} {testbed.host_public_key(node)}\n")
    r = dfo(inv, "status", "-H", node.name)
    assert r.returncode == 0 and "recorded host key" not in r.stderr, r.stderr
    assert not (tmp_path / "known_hosts").exists() or (tmp_path / "known_hosts").read_text() == ""


# ------------------------------------------------------------------------------------------ login shells


@on_testbed
@pytest.mark.usefixtures("each_ssh_transport")
@pytest.mark.parametrize("shell", ["/usr/bin/fish", "/usr/bin/tcsh"])
def test_every_command_runs_under_sh_whatever_the_login_shell(make_testbed: Any, tmp_path: Path, shell: str) -> None:
    """Before: every command failed under fish and tcsh (verify-env exit 1 or 4)."""
    tb = make_testbed(s3=False)
    if not tb.isolated:
        pytest.skip("needs the testbed's namespace nodes (root) to change a login shell")
    node = tb.nodes[0]
    tb.set_login_shell(node, shell)
    raw = tb.ssh(node, "x=2; test $((x + 1)) = 3")  # sh text, given to the login shell as it is
    assert raw.returncode != 0 or raw.stderr, raw  # fish and tcsh read it their own way (fish: an error, exit 0)
    inv = inventory(tb, tmp_path)
    assert hostname_of(dfo(inv, "verify-env", "-H", node.name, "--json"), node.name) == node.name
    r = dfo(inv, "exec", "-H", node.name, "--", "sh", "-c", "test \"$((2 * 3))\" = 6 && echo six 'a  b' && exit 3")
    assert r.returncode != 0 and "six a  b" in r.stdout, r.stdout + r.stderr


# ------------------------------------------------------------------------------------------ sharing


def _master_pid(control: Path) -> int:
    r = subprocess.run(["ssh", "-O", "check", "-o", f"ControlPath={control}", "x"], capture_output=True, text=True,
                       timeout=10)
    assert "Master running" in r.stderr, r.stderr
    return int(r.stderr.split("pid=")[1].split(")")[0])


def _masters(folder: Path) -> set[Path]:
    return {p for p in folder.glob("cm-*")} if folder.is_dir() else set()


@on_testbed
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_dead_master_never_makes_a_command_hang(testbed: Any, tmp_path: Path, runtime_dir: Path, how: str) -> None:
    """A shared connection whose master is stopped (SIGSTOP: it accepts, never answers) or killed (a stale
    socket): the next command goes over a fresh connection, within seconds."""
    folder = runtime_dir
    node = testbed.nodes[0]
    kh = tmp_path / "known_hosts"
    kh.write_text(f"{_label(node)} {testbed.host_public_key(node)}\n")  # known already: one master path throughout
    inv = inventory(testbed, tmp_path, kh=kh, defaults={"transport": "openssh"})
    r = dfo(inv, "status", "-H", node.name)
    assert r.returncode == 0, r.stderr
    sockets = _masters(folder)
    assert len(sockets) == 1 and (folder.stat().st_mode & 0o777) == 0o700, sockets
    pid = _master_pid(next(iter(sockets)))
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP if how == "stopped" else signal.SIGKILL)
    try:
        r = dfo(inv, "status", "-H", node.name, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr
        assert took < 15, took
        if how == "stopped":
            assert "does not answer; using a fresh connection" in r.stderr, r.stderr
        new = _master_pid(next(iter(_masters(folder))))  # a new master took the socket's place
        assert new != pid
        os.kill(new, signal.SIGTERM)
    finally:
        if how == "stopped":
            os.kill(pid, signal.SIGKILL)


@on_testbed
def test_ssh_persist_zero_shares_nothing(testbed: Any, tmp_path: Path, runtime_dir: Path) -> None:
    inv = inventory(testbed, tmp_path, defaults={"transport": "openssh", "ssh_persist": 0})
    assert dfo(inv, "status", "-H", testbed.nodes[0].name).returncode == 0
    assert _masters(runtime_dir) == set() and runtime_dir.is_dir()


@on_testbed
def test_the_openssh_path_imports_no_paramiko(testbed: Any, tmp_path: Path) -> None:
    """`dfo status` over OpenSSH: neither paramiko, fabric, invoke nor cryptography is imported."""
    inv = inventory(testbed, tmp_path, defaults={"transport": "openssh"})
    probe = ("import sys\nfrom orchestrator.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    code = e.code\nprint('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & "
             "{'paramiko', 'fabric', 'invoke', 'cryptography', 'nacl'}), code)\n")
    r = subprocess.run([sys.executable, "-c", probe, "-i", str(inv), "status", "-H", testbed.nodes[0].name],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "HEAVY [] 0" in r.stdout, r.stdout + r.stderr


def test_without_an_openssh_client_ssh_means_paramiko_and_says_so(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"defaults: {{known_hosts: {tmp_path / 'kh'}, connect_timeout: 1}}\n"
                   "hosts:\n  a: {host: 127.0.0.1, port: 1}\n")
    r = dfo(inv, "-v", "status", "-H", "a", PATH=str(tmp_path), DFO_SSH_TRANSPORT=None)
    assert r.returncode == 4, r.stderr
    assert "no OpenSSH client" in r.stderr and "paramiko" in r.stderr, r.stderr
    assert "dfo: a: transport paramiko" in r.stderr, r.stderr
    r = dfo(inv, "status", "-H", "a", PATH=str(tmp_path), DFO_SSH_TRANSPORT=None)
    assert "no OpenSSH client" not in r.stderr and "transport paramiko" not in r.stderr
    inv.write_text(inv.read_text().replace("port: 1}", "port: 1, transport: openssh}"))
    r = dfo(inv, "status", "-H", "a", PATH=str(tmp_path), DFO_SSH_TRANSPORT=None)
    assert r.returncode == 2 and "OpenSSH client" in r.stderr, r.stderr


@on_testbed
def test_a_users_own_control_path_is_used_as_it_is(testbed: Any, tmp_path: Path, runtime_dir: Path) -> None:
    """ssh_config sets ControlMaster/ControlPath/ControlPersist for the host: dfo passes none of its own, the
    user's master is made and reused (before: paramiko ignored them)."""
    import tempfile

    node = testbed.nodes[0]
    mine = Path(tempfile.mkdtemp(prefix="cm-", dir="/tmp"))
    try:
        cfg = tmp_path / "ssh_config"
        cfg.write_text(f"Host {node.address}\n  ControlMaster auto\n  ControlPath {mine}/%C\n  ControlPersist 30\n"
                       f"Host *\n  UserKnownHostsFile {tmp_path}/user_kh\n")
        inv = inventory(testbed, tmp_path, defaults={"ssh_config": str(cfg), "transport": "openssh"})
        assert dfo(inv, "status", "-H", node.name).returncode == 0
        sockets = list(mine.iterdir())
        assert len(sockets) == 1 and _masters(runtime_dir) == set(), (sockets, _masters(runtime_dir))
        pid = _master_pid(sockets[0])
        assert dfo(inv, "status", "-H", node.name).returncode == 0
        assert _master_pid(sockets[0]) == pid  # the same master served the second command
        os.kill(pid, signal.SIGTERM)
    finally:
        import shutil

        shutil.rmtree(mine, ignore_errors=True)


def test_the_paramiko_transport_names_the_ssh_config_keywords_it_does_not_apply(tmp_path: Path) -> None:
    """Before: IdentitiesOnly, IdentityAgent, CertificateFile and Include were ignored without a word."""
    (tmp_path / "more.conf").write_text("Host other\n  User x\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Include {tmp_path}/more.conf\nHost gpu\n  HostName 127.0.0.1\n  Port 1\n  IdentitiesOnly yes\n"
                   f"  IdentityAgent {tmp_path}/sock\n  CertificateFile {tmp_path}/c.pub\n"
                   f"  UserKnownHostsFile {tmp_path}/u\n")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"defaults: {{known_hosts: {tmp_path / 'kh'}, connect_timeout: 1, ssh_config: {cfg}}}\n"
                   "hosts:\n  a: {host: gpu, transport: paramiko}\n  b: {host: gpu, transport: openssh}\n")
    r = dfo(inv, "status", "-H", "a")
    assert r.returncode == 4, r.stderr
    # an OpenSSH client is on PATH: paramiko's settings come from `ssh -G`, which applied the Include
    assert ("dfo: a: the paramiko transport does not apply IdentitiesOnly, IdentityAgent, CertificateFile "
            "from ssh_config (transport: openssh does)") in r.stderr, r.stderr
    r = dfo(inv, "status", "-H", "b")
    assert r.returncode == 4 and "does not apply" not in r.stderr, r.stderr
    # no OpenSSH client: paramiko reads the files itself, and the Include is one more keyword it names
    r = dfo(inv, "status", "-H", "a", PATH=str(tmp_path))
    assert r.returncode == 4, r.stderr
    assert ("dfo: a: the paramiko transport does not apply Include, IdentitiesOnly, IdentityAgent, CertificateFile "
            "from ssh_config (transport: openssh does)") in r.stderr, r.stderr


def test_the_paramiko_transport_names_keywords_set_only_in_an_included_file(tmp_path: Path) -> None:
    """`ssh -G` sees what an included file sets for the host; paramiko cannot apply IdentitiesOnly: said."""
    (tmp_path / "more.conf").write_text("Host gpu\n  IdentitiesOnly yes\n  ForwardAgent yes\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Include {tmp_path}/more.conf\nHost gpu\n  HostName 127.0.0.1\n  Port 1\n")
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"defaults: {{known_hosts: {tmp_path / 'kh'}, connect_timeout: 1, ssh_config: {cfg}}}\n"
                   "hosts:\n  a: {host: gpu, transport: paramiko}\n")
    r = dfo(inv, "status", "-H", "a")
    assert r.returncode == 4, r.stderr
    assert ("dfo: a: the paramiko transport does not apply IdentitiesOnly, ForwardAgent from ssh_config "
            "(transport: openssh does)") in r.stderr, r.stderr


def test_a_commands_help_is_printed_from_its_rendered_text_without_importing_the_command(tmp_path: Path) -> None:
    """`dfo CMD --help` (issue 18, speed: 3.25x `import click` before): the second time, from the cache of its
    text, with neither pydantic nor the command's module imported; the text is click's own."""
    probe = ("import sys\nfrom orchestrator.cli import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
             "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic' "
             "or m.startswith('orchestrator.commands')))\n")
    env = _cli.cli_env(XDG_CACHE_HOME=str(tmp_path))
    runs = [subprocess.run([sys.executable, "-c", probe, "status", "--help"], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=60) for _ in range(2)]
    first, second = (r.stdout.rsplit("HEAVY", 1) for r in runs)
    assert first[0] == second[0] and first[0].startswith("Usage: dfo status"), runs
    assert first[1].strip() != "[]" and second[1].strip() == "[]", (first[1], second[1])
    assert len(list((tmp_path / "dfo" / "help").iterdir())) == 1


def test_ssh_g_proxy_jump_is_rewritten_as_fabric_parses_a_hop() -> None:
    """`ssh -G` writes IPv4 hops in brackets (root@[10.0.0.2]:22); fabric would take the brackets for the name."""
    from orchestrator.transport.resolve import _fabric_jump

    assert _fabric_jump("root@1.1.1.1,root@[2.2.2.2]:2222") == "root@1.1.1.1,root@2.2.2.2:2222"
    assert _fabric_jump("[gpu-a]:22,u@gpu-b") == "gpu-a:22,u@gpu-b"
    assert _fabric_jump("u@[fe80::1]") == "u@fe80::1"


def _sshd_log(tb: Any, node: Any) -> str:
    return (Path(tb.workdir) / node.name / "sshd.log").read_text(errors="replace")


def _ssh_of(folder: Path) -> list[int]:
    """Pids of the ssh processes whose command line names ``folder`` (a connection's config, a master)."""
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # a master names itself "ssh: SOCKET [mux]" once it runs in the background
        if argv and (argv[0].endswith(b"ssh") or argv[0].startswith(b"ssh:")) and \
                any(str(folder).encode() in a for a in argv):
            out.append(int(p.name))
    return out


@on_testbed
def test_ssh_persist_zero_one_connection_per_command_and_warm(testbed: Any, tmp_path: Path,
                                                              runtime_dir: Path) -> None:
    """ssh_persist 0 (no connection outlives a command): a command's calls still share ONE connection,
    which ends with the command; warm() makes that connection in the background and the calls made
    meanwhile wait for it and go over it."""
    from orchestrator.config.models import load_inventory
    from orchestrator.transport import open_connection
    from orchestrator.transport.resolve import resolve_host

    node = testbed.nodes[0]
    inv_path = inventory(testbed, tmp_path, defaults={"transport": "openssh", "ssh_persist": 0})
    inv, p = load_inventory(inv_path)
    conn = open_connection(resolve_host(inv, node.name, p))
    before = _sshd_log(testbed, node).count("Accepted publickey")
    try:
        conn.warm()
        warming = getattr(conn, "_warming", None)
        assert warming is not None, "warm() started no connection"
        warming.thread.join(30)
        assert warming.error is None, warming.error
        log = _sshd_log(testbed, node)
        assert log.count("Accepted publickey") - before == 1, log[-2000:]  # warm()'s own, before any call
        results = [conn.run(f"echo call-{i}") for i in range(3)]
        assert [r.stdout.strip() for r in results] == ["call-0", "call-1", "call-2"]
        log = _sshd_log(testbed, node)
        assert log.count("Accepted publickey") - before == 1, log[-2000:]  # ... which the calls went over
        assert _ssh_of(runtime_dir), "no master kept the connection while the command ran"
    finally:
        conn.close()
    deadline = time.monotonic() + 5
    while _ssh_of(runtime_dir) and time.monotonic() < deadline:  # close() asked the master to end
        time.sleep(0.05)
    assert _ssh_of(runtime_dir) == [], "the command's own master outlived it"
    assert not list(runtime_dir.glob("c-*")), list(runtime_dir.iterdir())
    # a whole command over the CLI: its status call and the next command's, one connection each
    before = _sshd_log(testbed, node).count("Accepted publickey")
    for _ in range(2):
        assert dfo(inv_path, "status", "-H", node.name).returncode == 0
    assert _sshd_log(testbed, node).count("Accepted publickey") - before == 2


def test_a_warm_call_that_failed_is_raised_by_the_call_that_waited_not_tried_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """warm()'s call could not connect: the first call raises that error (exit 4) without a second
    attempt, so an unreachable host costs one connect timeout, not two; later calls try again."""
    from orchestrator.config.models import load_inventory
    from orchestrator.errors import HostError
    from orchestrator.transport import open_connection
    from orchestrator.transport import openssh as mod
    from orchestrator.transport.resolve import resolve_host

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("DFO_SSH_CONFIG", str(tmp_path / "ssh_config"))
    (tmp_path / "ssh_config").write_text("")
    inv_path = tmp_path / "inventory.yaml"
    inv_path.write_text(f"defaults: {{known_hosts: {tmp_path / 'kh'}, connect_timeout: 2, transport: openssh}}\n"
                        "hosts:\n  a: {host: 127.0.0.1, port: 1}\n")
    inv, p = load_inventory(inv_path)
    conn = open_connection(resolve_host(inv, "a", p))
    assert isinstance(conn, mod.OpenSSH)
    spawned: list[list[str]] = []
    real = subprocess.Popen

    def counted(argv: Any, *a: Any, **kw: Any) -> Any:
        spawned.append(list(argv))
        return real(argv, *a, **kw)

    monkeypatch.setattr(mod.subprocess, "Popen", counted)
    try:
        conn.warm()
        with pytest.raises(HostError) as ei:
            conn.run("true")
        assert ei.value.exit_code == 4
        assert len(spawned) == 1, spawned  # warm()'s ssh only: the waiting call raised its error
        with pytest.raises(HostError):
            conn.run("true")  # the next call tries again on its own
        assert len(spawned) == 2, spawned
    finally:
        conn.close()
