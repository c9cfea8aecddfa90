"""Issue 33, items 1-3, 5 and 6: every SSH refusal names the right fix, on a real sshd, with the user's own
~/.ssh/config in a fake HOME (dfo reads ~/.ssh/config then /etc/ssh/ssh_config, as ssh does: DFO_SSH_CONFIG is
unset here). Nothing here touches the real ~/.ssh: every file the user's ssh_config names lies under tmp_path.

1. A second factor after the key (sshd AuthenticationMethods publickey,password or publickey,keyboard-interactive):
   the refusal names `dfo login -H HOST` (before: "the node refused every key ... authorized_keys"); `dfo login`
   takes the password through SSH_ASKPASS once, later commands go over that connection with no prompt,
   `dfo login --check` says so and `dfo logout` ends it.
2. An encrypted key that no ssh-agent holds: "KEY is encrypted and no ssh-agent holds it: run ssh-add KEY", in
   seconds, no prompt (before: the authorized_keys hint).
3. `StrictHostKeyChecking yes` in the user's config holds: a key not in the user's known_hosts is refused (exit 4,
   naming the setting and the file), even when dfo's own known_hosts holds it (before: recorded, exit 0);
   accept-new, ask and no setting keep dfo's first-use rule.
5. A changed host key held by dfo's known_hosts and the user's: one message naming both files and lines, one
   `ssh-keygen -R` per file (before: the first file only).
6. A ControlPath of the user's too long for a unix socket: said once what it is, dfo uses its own (before: "the
   shared ssh connection ... does not answer", every command).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import _cli

PASSWORD = "Tr0ub4dor-sesame-7731"  # the node user's password (second factor) and the test key's passphrase


@dataclass
class User:
    """A user on this machine: a fake HOME with ~/.ssh/config, known_hosts, dfo's folders; an inventory."""

    home: Path
    tmp: Path
    runtime: Path

    @property
    def config(self) -> Path:
        return self.home / ".ssh" / "config"

    @property
    def known_hosts(self) -> Path:  # the user's own (their ssh_config's UserKnownHostsFile)
        return self.home / ".ssh" / "known_hosts"

    @property
    def dfo_kh(self) -> Path:
        return self.tmp / "dfo_known_hosts"

    def ssh_config(self, text: str) -> None:
        self.config.write_text(text + f"Host *\n  UserKnownHostsFile {self.known_hosts}\n")

    def inventory(self, defaults: dict[str, Any] | None = None, **hosts: dict[str, Any]) -> Path:
        doc = {"defaults": {"known_hosts": str(self.dfo_kh), "connect_timeout": 5, "transport": "openssh",
                            **(defaults or {})}, "hosts": hosts}
        p = self.tmp / f"inventory-{time.monotonic_ns()}.yaml"
        p.write_text(yaml.safe_dump(doc))
        return p

    def env(self, **over: str | None) -> dict[str, str]:
        base = {"HOME": str(self.home), "DFO_SSH_CONFIG": None, "SSH_AUTH_SOCK": None, "SSH_ASKPASS": None,
                "SSH_ASKPASS_REQUIRE": None, "DISPLAY": None, "XDG_RUNTIME_DIR": str(self.runtime),
                "XDG_CACHE_HOME": str(self.tmp / "cache"), "XDG_CONFIG_HOME": str(self.tmp / "config"),
                "DFO_SSH_TRANSPORT": None}
        base.update(over)
        return _cli.cli_env(**base)

    def dfo(self, inv: Path, *args: str, timeout: float = 60, **env: str | None) -> subprocess.CompletedProcess[str]:
        return _cli.dfo(inv, *args, timeout=timeout, env=self.env(**env))

    def askpass(self, answer: str) -> dict[str, str]:
        """SSH_ASKPASS set to a script that answers ``answer`` (read from a 0600 file, never in argv) and logs
        each prompt in ``askpass.log``; SSH_ASKPASS_REQUIRE=force, so ssh asks it even with a terminal."""
        secret = self.tmp / "askpass.secret"
        secret.write_text(answer)
        secret.chmod(0o600)
        script = self.tmp / "askpass.sh"
        script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$1\" >> {shlex.quote(str(self.tmp / 'askpass.log'))}\n"
                          f"cat {shlex.quote(str(secret))}\n")
        script.chmod(0o700)
        return {"SSH_ASKPASS": str(script), "SSH_ASKPASS_REQUIRE": "force"}

    def prompts(self) -> list[str]:
        log = self.tmp / "askpass.log"
        return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def user(tmp_path: Path) -> Iterator[User]:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    runtime = Path(tempfile.mkdtemp(prefix="dfo-rt-"))  # a short path: control sockets live under it
    try:
        yield User(home, tmp_path, runtime)
    finally:
        for sock in runtime.glob("dfo-ssh/cm-*"):  # end the masters this test made
            subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={sock}", "x"], capture_output=True, timeout=10)
        shutil.rmtree(runtime, ignore_errors=True)


def _label(node: Any) -> str:
    return node.address if node.port == 22 else f"[{node.address}]:{node.port}"


def _host_block(name: str, node: Any, key: Path, extra: str = "") -> str:
    return (f"Host {name}\n  HostName {node.address}\n  Port {node.port}\n  User {node.user}\n"
            f"  IdentityFile {key}\n  IdentitiesOnly yes\n{extra}")


def _accepted(tb: Any, node: Any, how: str) -> int:
    return (Path(tb.workdir) / node.name / "sshd.log").read_text(errors="replace").count(f"Accepted {how}")


def _namespace_nodes(tb: Any) -> None:
    if not tb.isolated:
        pytest.skip("needs the testbed's namespace nodes (root) to give the node user a password")


# ------------------------------------------------------------------------------------------ 1. a second factor


SECOND_FACTOR = {
    "password": {"AuthenticationMethods": "publickey,password", "PasswordAuthentication": "yes"},
    "keyboard-interactive": {"AuthenticationMethods": "publickey,keyboard-interactive", "UsePAM": "yes",
                             "KbdInteractiveAuthentication": "yes"},
}


@pytest.mark.parametrize("method", list(SECOND_FACTOR))
def test_a_second_factor_names_dfo_login_which_makes_the_connection_later_commands_use(
        make_testbed: Any, user: User, method: str) -> None:
    tb = make_testbed(s3=False)
    _namespace_nodes(tb)
    node = tb.nodes[0]
    tb.set_password(node, PASSWORD)
    tb.sshd_options(node, PermitRootLogin="yes", **SECOND_FACTOR[method])
    user.ssh_config(_host_block("gpu", node, Path(tb.identity)))
    inv = user.inventory(gpu={"host": "gpu"})

    r = user.dfo(inv, "status", "-H", "gpu")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "dfo login -H gpu" in r.stderr and "authorized_keys" not in r.stderr, r.stderr
    assert method in r.stderr, r.stderr  # what the node asks for

    before = _accepted(tb, node, method)
    r = user.dfo(inv, "login", "-H", "gpu", **user.askpass(PASSWORD))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(user.prompts()) == 1, user.prompts()  # asked once, through SSH_ASKPASS
    assert "gpu: logged in" in r.stdout, r.stdout
    assert _accepted(tb, node, method) == before + 1
    for out in (r.stdout, r.stderr):
        assert PASSWORD not in out

    for _ in range(2):  # no prompt, no new login: over the connection dfo login made
        r = user.dfo(inv, "status", "-H", "gpu", **user.askpass("wrong"))
        assert r.returncode == 0, r.stdout + r.stderr
    r = user.dfo(inv, "exec", "-H", "gpu", "--", "echo", "over-the-login")
    assert r.returncode == 0 and "over-the-login" in r.stdout, r.stdout + r.stderr
    assert len(user.prompts()) == 1 and _accepted(tb, node, method) == before + 1, user.prompts()

    r = user.dfo(inv, "login", "--check", "-H", "gpu")
    assert r.returncode == 0 and "gpu: logged in" in r.stdout and "idle" in r.stdout, r.stdout + r.stderr
    r = user.dfo(inv, "logout", "-H", "gpu")
    assert r.returncode == 0 and "gpu: logged out" in r.stdout, r.stdout + r.stderr
    r = user.dfo(inv, "login", "--check", "-H", "gpu")
    assert r.returncode == 4 and "gpu: not logged in" in r.stdout, r.stdout + r.stderr
    r = user.dfo(inv, "status", "-H", "gpu")
    assert r.returncode == 4 and "dfo login -H gpu" in r.stderr, r.stderr
    if method != "password":
        return
    # ssh_persist 0 (no connection outlives a command): a login lives for --persist, and commands use it
    inv = user.inventory(gpu={"host": "gpu"}, defaults={"ssh_persist": 0})
    r = user.dfo(inv, "login", "-H", "gpu", **user.askpass(PASSWORD))
    assert r.returncode == 2 and "--persist" in r.stderr, r.stderr
    r = user.dfo(inv, "login", "-H", "gpu", "--persist", "600", **user.askpass(PASSWORD))
    assert r.returncode == 0 and "idle for 10m" in r.stdout, r.stdout + r.stderr
    for env in ({}, {"DFO_MUX_CLIENT": "0"}):  # over dfo's own session on the socket, or an ssh client
        r = user.dfo(inv, "status", "-H", "gpu", **env)
        assert r.returncode == 0, r.stderr
    assert _accepted(tb, node, method) == before + 2
    assert user.dfo(inv, "logout", "-H", "gpu").returncode == 0


def test_dfo_login_without_a_terminal_or_askpass_says_how_and_never_waits(make_testbed: Any, user: User) -> None:
    tb = make_testbed(s3=False)
    node = tb.nodes[0]
    user.ssh_config(_host_block("gpu", node, Path(tb.identity)))
    inv = user.inventory(gpu={"host": "gpu"}, lost={"host": "gpu", "transport": "paramiko"})
    t0 = time.monotonic()
    r = subprocess.run(["setsid", *_cli.dfo_argv(inv, "login", "-H", "gpu")], capture_output=True, text=True,
                       timeout=60, env=user.env(), stdin=subprocess.DEVNULL)  # setsid: no controlling terminal
    assert r.returncode == 2 and "SSH_ASKPASS" in r.stderr and "terminal" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 20
    assert "Traceback" not in r.stderr
    r = user.dfo(inv, "login", "-H", "lost")
    assert r.returncode == 2 and "transport: openssh" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ 2. an encrypted key


def test_an_encrypted_key_that_no_agent_holds_is_named_with_ssh_add(make_testbed: Any, user: User) -> None:
    tb = make_testbed(s3=False)
    node = tb.nodes[0]
    key = user.home / ".ssh" / "id_locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", PASSWORD, "-C", "locked", "-f", str(key)], check=True)
    with open(Path(tb.workdir) / node.name / "etc" / "authorized_keys", "a") as f:
        f.write(key.with_suffix(".pub").read_text())
    user.ssh_config(_host_block("gpu", node, key))
    inv = user.inventory(gpu={"host": "gpu"})
    t0 = time.monotonic()
    r = user.dfo(inv, "status", "-H", "gpu")
    assert r.returncode == 4, r.stdout + r.stderr
    assert time.monotonic() - t0 < 15
    assert f"{key} is encrypted and no ssh-agent holds it: run ssh-add {key}" in r.stderr, r.stderr
    assert "dfo login -H gpu" in r.stderr and "authorized_keys" not in r.stderr, r.stderr

    # an agent that holds another key: still named; once it holds this one, dfo gets in
    sock = str(user.tmp / "agent.sock")
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", sock], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        other = user.tmp / "other"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
        subprocess.run(["ssh-add", "-q", str(other)], env=dict(os.environ, SSH_AUTH_SOCK=sock), check=True,
                       capture_output=True)
        r = user.dfo(inv, "status", "-H", "gpu", SSH_AUTH_SOCK=sock)
        assert r.returncode == 4 and f"run ssh-add {key}" in r.stderr, r.stderr
        add_env = dict(user.env(SSH_AUTH_SOCK=sock, **user.askpass(PASSWORD)))
        subprocess.run(["setsid", "ssh-add", str(key)], env=add_env, check=True, capture_output=True,
                       stdin=subprocess.DEVNULL, timeout=30)
        r = user.dfo(inv, "status", "-H", "gpu", SSH_AUTH_SOCK=sock)
        assert r.returncode == 0, r.stderr
    finally:
        agent.kill()
        agent.wait()

    # or the passphrase typed once, at dfo login's prompt
    (user.tmp / "askpass.log").unlink()
    r = user.dfo(inv, "login", "-H", "gpu", **user.askpass(PASSWORD))
    assert r.returncode == 0 and len(user.prompts()) == 1, r.stdout + r.stderr
    r = user.dfo(inv, "status", "-H", "gpu")
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------------ 3. StrictHostKeyChecking


@pytest.mark.usefixtures("each_ssh_transport")
def test_the_users_strict_host_key_checking_yes_holds(testbed: Any, user: User) -> None:
    node = testbed.nodes[0]
    user.ssh_config(_host_block("gpu", node, Path(testbed.identity), "  StrictHostKeyChecking yes\n"))
    inv = user.inventory(gpu={"host": "gpu"}, defaults={"transport": "ssh"})
    transport = os.environ["DFO_SSH_TRANSPORT"]
    r = user.dfo(inv, "status", "-H", "gpu", DFO_SSH_TRANSPORT=transport)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "StrictHostKeyChecking yes" in r.stderr and str(user.known_hosts) in r.stderr, r.stderr
    assert "recorded host key" not in r.stderr and (not user.dfo_kh.exists() or user.dfo_kh.read_text() == "")
    # dfo's own file holding the key does not make dfo less strict than the user's ssh
    user.dfo_kh.write_text(f"{_label(node)} {testbed.host_public_key(node)}\n")
    r = user.dfo(inv, "status", "-H", "gpu", DFO_SSH_TRANSPORT=transport)
    assert r.returncode == 4 and "StrictHostKeyChecking yes" in r.stderr, r.stderr
    # the key where the user's ssh looks for it: in
    user.known_hosts.write_text(f"{_label(node)} {testbed.host_public_key(node)}\n")
    r = user.dfo(inv, "status", "-H", "gpu", DFO_SSH_TRANSPORT=transport)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("setting", ["accept-new", "ask", "no", None])
def test_other_strict_host_key_checking_settings_keep_the_first_use_rule(testbed: Any, user: User,
                                                                        setting: str | None) -> None:
    node = testbed.nodes[0]
    extra = f"  StrictHostKeyChecking {setting}\n" if setting else ""
    user.ssh_config(_host_block("gpu", node, Path(testbed.identity), extra))
    inv = user.inventory(gpu={"host": "gpu"})
    r = user.dfo(inv, "status", "-H", "gpu")
    assert r.returncode == 0, r.stderr
    assert "recorded host key" in r.stderr and user.dfo_kh.read_text().split()[1:3] == \
        testbed.host_public_key(node).split(), r.stderr
    if setting == "no":  # dfo is stricter than the user's "no": a changed key is still refused
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(user.tmp / "x")], check=True)
        user.dfo_kh.write_text(f"{_label(node)} {' '.join((user.tmp / 'x.pub').read_text().split()[:2])}\n")
        r = user.dfo(inv, "status", "-H", "gpu")
        assert r.returncode == 4 and "CHANGED" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ 5. a changed key


@pytest.mark.usefixtures("each_ssh_transport")
def test_a_changed_host_key_names_every_file_that_holds_the_old_one(testbed: Any, user: User,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    node = testbed.nodes[0]
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(user.tmp / "old")], check=True)
    old = " ".join((user.tmp / "old.pub").read_text().split()[:2])
    label = _label(node)
    user.ssh_config(_host_block("gpu", node, Path(testbed.identity)))
    user.known_hosts.write_text(f"# mine\nother.example {old}\n{label} {old}\n")
    user.dfo_kh.write_text(f"{label} {old}\n")
    inv = user.inventory(gpu={"host": "gpu"}, defaults={"transport": "ssh"})
    r = user.dfo(inv, "status", "-H", "gpu", DFO_SSH_TRANSPORT=os.environ["DFO_SSH_TRANSPORT"])
    assert r.returncode == 4 and "CHANGED" in r.stderr, r.stderr
    assert f"{user.dfo_kh}:1" in r.stderr and f"{user.known_hosts}:3" in r.stderr, r.stderr
    for f in (user.dfo_kh, user.known_hosts):
        assert f"ssh-keygen -R {shlex.quote(label)} -f {f}" in r.stderr, r.stderr
    assert r.stderr.count("ssh-keygen -R") == 2, r.stderr
    for f in (user.dfo_kh, user.known_hosts):  # what the message says to do, done: the next command connects
        subprocess.run(["ssh-keygen", "-q", "-R", label, "-f", str(f)], check=True, capture_output=True)
    r = user.dfo(inv, "status", "-H", "gpu", DFO_SSH_TRANSPORT=os.environ["DFO_SSH_TRANSPORT"])
    assert r.returncode == 0, r.stderr
    assert "other.example" in user.known_hosts.read_text()


# ------------------------------------------------------------------------------------------ 6. a long ControlPath


def test_a_control_path_too_long_for_a_unix_socket_is_said_once_and_dfo_uses_its_own(testbed: Any,
                                                                                    user: User) -> None:
    node = testbed.nodes[0]
    deep = user.tmp / ("d" * 60)  # with %C (40 characters) past the 108 bytes of a socket's path
    deep.mkdir()
    user.ssh_config(_host_block("gpu", node, Path(testbed.identity),
                                f"  ControlMaster auto\n  ControlPath {deep}/%C\n  ControlPersist 30\n"))
    inv = user.inventory(gpu={"host": "gpu"})
    ssh = subprocess.run(["ssh", "-F", str(user.config), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                          "gpu", "true"], capture_output=True, text=True, timeout=30, env=user.env(),
                         stdin=subprocess.DEVNULL)
    assert ssh.returncode == 255 and "too long" in ssh.stderr, ssh.stderr  # the user's own ssh fails
    said = []
    for _ in range(3):
        r = user.dfo(inv, "status", "-H", "gpu")
        assert r.returncode == 0, r.stderr
        assert "does not answer" not in r.stderr, r.stderr
        said.append("ControlPath" in r.stderr and "too long for a unix socket" in r.stderr
                    and "dfo uses its own" in r.stderr)
    assert said == [True, False, False], said
    assert list(user.runtime.glob("dfo-ssh/cm-*")), "dfo's own master"
    r = user.dfo(inv, "-v", "status", "-H", "gpu")
    assert r.returncode == 0 and "ControlPath" in r.stderr, r.stderr  # -v says it each time


# ------------------------------------------------------------------------------------------ unit: what is refused


def test_keys_are_read_for_their_state_without_a_passphrase(tmp_path: Path) -> None:
    """openssh_auth.key_state: an OpenSSH-format or PEM key, encrypted or not, and its public half (from the
    file itself for the OpenSSH format, KEY.pub for PEM); never a prompt, never the private part."""
    import base64

    from orchestrator.config.models import ResolvedHost
    from orchestrator.transport.openssh_auth import key_state, refused

    cases = {"plain": ("ed25519", "", []), "locked": ("ed25519", PASSWORD, []),
             "pem": ("rsa", "", ["-m", "PEM"]), "pem_locked": ("rsa", PASSWORD, ["-m", "PEM"])}
    for name, (kind, phrase, fmt) in cases.items():
        subprocess.run(["ssh-keygen", "-q", "-t", kind, *(["-b", "2048"] if kind == "rsa" else []), *fmt,
                        "-N", phrase, "-f", str(tmp_path / name)], check=True, stdin=subprocess.DEVNULL)
        got = key_state(str(tmp_path / name))
        assert got is not None and got[0] is bool(phrase), (name, got)
        blob = base64.b64decode((tmp_path / f"{name}.pub").read_text().split()[1])
        assert got[1] == blob, name
    locked = base64.b64decode((tmp_path / "locked.pub").read_text().split()[1])
    (tmp_path / "locked.pub").unlink()  # the OpenSSH format carries its public half in the clear
    assert key_state(str(tmp_path / "locked")) == (True, locked)
    assert key_state(str(tmp_path / "locked.pub")) is None and key_state(str(tmp_path / "nothing")) is None

    host = ResolvedHost(name="gpu", hostname="10.0.0.9", user="u", transport="openssh",
                        ssh_resolved={"identityfile": [str(tmp_path / "locked")], "identityagent": ["none"]})
    assert refused(host, "u@10.0.0.9", "password").reason == "second_factor"
    assert refused(host, "u@10.0.0.9", "keyboard-interactive").reason == "second_factor"
    err = refused(host, "u@10.0.0.9", "publickey")
    assert err.reason == "encrypted_key" and f"run ssh-add {tmp_path / 'locked'}" in (err.hint or "")
    host.ssh_resolved["identityfile"] = [str(tmp_path / "plain")]
    err = refused(host, "u@10.0.0.9", "publickey,password")
    assert err.reason == "refused" and "dfo login -H gpu" in (err.hint or "") and "authorized_keys" in (err.hint or "")
    assert "dfo login" not in (refused(host, "u@10.0.0.9", "publickey").hint or "")
