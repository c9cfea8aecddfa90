"""Issue 32, item 5: no inventory value can write ssh_config directives or reach ssh as something else.

A careless (or hostile) inventory: a newline in ``proxy_jump`` went into the ssh_config dfo writes unquoted,
and the ``ProxyCommand`` after it ran. Every field of the inventory's defaults and hosts that reaches the
generated ssh_config or ssh's argv is checked where the inventory is read (orchestrator/config/sshvalues.py
through orchestrator/config/models.py): exit 2 with FILE:LINE and the field, before any ssh starts. The
config writer checks again (orchestrator/transport/openssh_setup.py ``bare`` and ``q``).

The CLI runs with an ``ssh`` first on PATH that notes each call and then runs the real one, so "no ssh
started" is seen, not assumed; each hostile ProxyCommand would create a marker file.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.transport import openssh_setup
from tests._cli import cli_env, dfo

REAL_SSH = shutil.which("ssh")


def _payload(marker: Path) -> str:
    """A ProxyCommand that leaves ``marker`` behind when ssh runs it."""
    return f"sh -c 'touch {marker}; exit 1'"


# (field as dfo names it, the YAML of the inventory with {evil} where the hostile value goes); the hostile
# field is on the line that holds {evil}
CASES: dict[str, str] = {
    "defaults.proxy_jump": "defaults:\n  proxy_jump: {evil}\nhosts:\n  h1: {{host: 127.0.0.1, port: 1}}\n",
    "hosts.h1.proxy_jump": "hosts:\n  h1:\n    host: 127.0.0.1\n    port: 1\n    proxy_jump: {evil}\n",
    "defaults.user": "defaults:\n  user: {evil}\nhosts:\n  h1: {{host: 127.0.0.1, port: 1}}\n",
    "hosts.h1.user": "hosts:\n  h1:\n    host: 127.0.0.1\n    user: {evil}\n",
    "hosts.h1.host": "hosts:\n  h1:\n    host: {evil}\n",
    "defaults.identity": "defaults:\n  identity: {evil}\nhosts:\n  h1: {{host: 127.0.0.1, port: 1}}\n",
    "hosts.h1.identity": "hosts:\n  h1:\n    host: 127.0.0.1\n    identity: {evil}\n",
    "defaults.known_hosts": "defaults:\n  known_hosts: {evil}\nhosts:\n  h1: {{host: 127.0.0.1, port: 1}}\n",
    "defaults.ssh_config": "defaults:\n  ssh_config: {evil}\nhosts:\n  h1: {{host: 127.0.0.1, port: 1}}\n",
    "hosts.h1.private_address": "hosts:\n  h1:\n    host: 127.0.0.1\n    private_address: {evil}\n",
}


def _evil(field: str, marker: Path) -> str:
    """A YAML double-quoted scalar: a value, a newline, then ssh_config directives of the value's own."""
    head = {"defaults.proxy_jump": "none", "hosts.h1.proxy_jump": "none", "hosts.h1.host": "127.0.0.1"}.get(
        field, "x")
    cmd = _payload(marker).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{head}\\nHost *\\n  ProxyCommand {cmd}\\n  Port 1"'


@pytest.fixture
def spy(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """(the CLI's environment, the file where every ssh it starts is noted)."""
    if REAL_SSH is None:
        pytest.skip("no ssh on PATH")
    bin_dir, calls = tmp_path / "bin", tmp_path / "ssh-calls"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {REAL_SSH} "$@"\n')
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    env = cli_env(PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", HOME=str(tmp_path / "home"),
                  XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_CACHE_HOME=str(tmp_path / "cache"),
                  XDG_RUNTIME_DIR=None, DFO_SSH_CONFIG=None, DFO_INVENTORY=None)
    (tmp_path / "home").mkdir()
    return env, calls


@pytest.mark.parametrize("field", list(CASES))
def test_a_control_character_in_any_ssh_field_is_refused_before_ssh_starts(
        field: str, tmp_path: Path, spy: tuple[dict[str, str], Path]) -> None:
    env, calls = spy
    marker = tmp_path / "proxy-command-ran"
    text = CASES[field].format(evil=_evil(field, marker))
    inv = tmp_path / "inventory.yaml"
    inv.write_text(text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "ProxyCommand" in ln)
    r = dfo(inv, "status", "-H", "h1", env=env, timeout=60)
    out = r.stdout + r.stderr
    assert not marker.exists(), f"the inventory's ProxyCommand ran: {out}"
    assert r.returncode == 2, out
    assert f"{inv}:{line}: {field}: " in r.stderr and "control character (\\n)" in r.stderr, out
    assert "Traceback" not in out and len(r.stderr.strip().splitlines()) <= 2, out
    assert not calls.exists(), f"ssh was started: {calls.read_text()}"


# values with no control character that ssh still cannot take where they go, each with what dfo says
WORDS = [
    ("hosts.h1.proxy_jump", "hosts:\n  h1:\n    host: 127.0.0.1\n    proxy_jump: \"jump -oProxyCommand=x\"\n",
     "holds ' ', which ssh cannot take in a ProxyJump hop"),
    ("defaults.proxy_jump", "defaults:\n  proxy_jump: 'a,\"b'\nhosts:\n  h1: {host: 127.0.0.1}\n",
     "holds '\"', which ssh cannot take in a ProxyJump hop"),
    ("hosts.h1.host", "hosts:\n  h1:\n    host: -oProxyCommand=x\n", "starts with '-'"),
    ("hosts.h1.host", "hosts:\n  h1:\n    host: '*'\n", "holds '*', which ssh cannot take in a host name"),
    ("hosts.h1.user", "hosts:\n  h1:\n    host: 127.0.0.1\n    user: root x\n", "holds ' '"),
    ("defaults.identity", "defaults:\n  identity: '/k\"ey'\nhosts:\n  h1: {host: 127.0.0.1}\n",
     "holds '\"': ssh_config has no way to quote it"),
    ("defaults.connect_timeout", "defaults:\n  connect_timeout: .inf\nhosts:\n  h1: {host: 127.0.0.1}\n",
     "finite number"),
    ("defaults.ssh_persist", "defaults:\n  ssh_persist: .inf\nhosts:\n  h1: {host: 127.0.0.1}\n", "finite number"),
]


@pytest.mark.parametrize(("field", "text", "said"), WORDS, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(WORDS)])
def test_a_value_ssh_cannot_take_where_it_goes_is_refused_with_its_line(
        field: str, text: str, said: str, tmp_path: Path, spy: tuple[dict[str, str], Path]) -> None:
    env, calls = spy
    inv = tmp_path / "inventory.yaml"
    inv.write_text(text)
    key = field.rsplit(".", 1)[1]
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.strip().startswith(key + ":"))
    r = dfo(inv, "status", "-H", "h1", env=env, timeout=60)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert f"{inv}:{line}: {field}: " in r.stderr and said in r.stderr, out
    assert "Traceback" not in out and "unexpected" not in out, out
    assert not calls.exists(), f"ssh was started: {calls.read_text()}"


def test_the_values_users_write_still_load(tmp_path: Path) -> None:
    """What inventories hold (IPv6 literals, ssh:// jump paths, a key path with a blank, none) still loads."""
    from orchestrator.config.models import load_inventory

    inv = tmp_path / "inventory.yaml"
    inv.write_text("defaults:\n  user: ubuntu\n  identity: ~/keys/my key\n  proxy_jump: none\n"
                   "hosts:\n  a: {host: 'fe80::1%eth0', proxy_jump: 'ssh://jump@[2001:db8::1]:2200,root@b:22'}\n"
                   "  b: {host: gpu-1.example.com, user: svc.train-1, private_address: 10.0.0.2}\n")
    got, _ = load_inventory(inv)
    assert got.hosts["a"].proxy_jump == "ssh://jump@[2001:db8::1]:2200,root@b:22"
    assert got.defaults.identity == "~/keys/my key"


def test_the_config_writer_checks_again() -> None:
    """Whatever reaches the writer without the model (a caller of its own): a newline in an unquoted value
    (Port, ProxyJump) or a quoted one (User, IdentityFile, the alias) is a ConfigError, never a line."""
    policy = openssh_setup.policy_lines(10, 5, 20)
    for defaults in ({"ProxyJump": "none\nHost *\n  ProxyCommand touch /tmp/x"}, {"Port": "22\nHost *"},
                     {"ProxyJump": "a b"}, {"User": "root\rx"}, {"IdentityFile": "/k\n"}):
        with pytest.raises(ConfigError):
            openssh_setup.resolution_config("h1", None, policy, defaults)
    with pytest.raises(ConfigError):
        openssh_setup.resolution_config("h1\nHost *", None, policy, {"Port": "22"})
    with pytest.raises(ConfigError):
        openssh_setup.bare("ProxyJump", "x\n  ProxyCommand y")
    assert openssh_setup.bare("ProxyJump", " root@j:22,k ") == "root@j:22,k"
