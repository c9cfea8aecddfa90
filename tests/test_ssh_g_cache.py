"""`ssh -G` is not run again for a host whose inputs have not changed (issue 35): its answer is kept in dfo's
ssh folder, keyed on everything ssh reads to give it (orchestrator/transport/openssh_setup.py ``ssh_g``).

The real ssh client, behind a spy that logs each `ssh -G` and runs the real one; the user's own
~/.ssh/config in a fake HOME."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from orchestrator.transport import openssh_setup as setup

SSH = shutil.which("ssh")
pytestmark = pytest.mark.skipif(SSH is None, reason="no OpenSSH client here")


@pytest.fixture
def spy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path, Path]:
    home = tmp_path / "home"
    (home / ".ssh" / "conf.d").mkdir(parents=True)
    (home / ".ssh" / "config").write_text("Include conf.d/*.conf\nHost web\n  HostName 10.1.2.3\n")
    log = tmp_path / "g.log"
    exe = tmp_path / "bin" / "ssh"
    exe.parent.mkdir()
    exe.write_text(f"#!/bin/sh\necho \"$*\" >> {log}\nexec {SSH} \"$@\"\n")
    exe.chmod(0o755)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.delenv("DFO_SSH_G_CACHE", raising=False)
    # each lookup below stands for a later command (a new process): nothing kept in this one
    monkeypatch.setattr(setup, "G_INPUTS_S", 0.0)
    config = tmp_path / "resolve.conf"
    config.write_text("Host *\n  BatchMode yes\nInclude ~/.ssh/config\n")
    return str(exe), config, log


def _calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_a_warm_lookup_runs_no_ssh_g_and_any_change_of_its_inputs_runs_it_again(
        spy: tuple[str, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ssh, config, log = spy
    home = Path(os.environ["HOME"])

    def g(alias: str = "web", options: tuple[str, ...] = ()) -> dict[str, list[str]]:
        return setup.ssh_g(ssh, config, alias, list(options), "test")

    assert g()["hostname"] == ["10.1.2.3"] and _calls(log) == 1
    assert g()["hostname"] == ["10.1.2.3"] and _calls(log) == 1  # warm: no ssh -G
    assert g(options=("Port=2222",))["port"] == ["2222"] and _calls(log) == 2  # other options: asked
    # the user's file changes (same size, new content): asked again, and the new answer is used
    time.sleep(0.01)
    (home / ".ssh" / "config").write_text("Include conf.d/*.conf\nHost web\n  HostName 10.1.2.4\n")
    assert g()["hostname"] == ["10.1.2.4"] and _calls(log) == 3
    # a file appears in a folder the config includes with a glob: asked again
    (home / ".ssh" / "conf.d" / "a.conf").write_text("Host web\n  User alice\n")
    assert g()["user"] == ["alice"] and _calls(log) == 4
    assert g()["user"] == ["alice"] and _calls(log) == 4
    # a variable the files name changes: asked again
    (home / ".ssh" / "conf.d" / "a.conf").write_text("Host web\n  User alice\n  ControlPath ${KEYDIR}/cp\n")
    monkeypatch.setenv("KEYDIR", "/k1")
    assert g()["controlpath"] == ["/k1/cp"] and _calls(log) == 5
    monkeypatch.setenv("KEYDIR", "/k2")
    assert g()["controlpath"] == ["/k2/cp"] and _calls(log) == 6
    # DFO_SSH_G_CACHE=0: always asked
    monkeypatch.setenv("DFO_SSH_G_CACHE", "0")
    g()
    assert _calls(log) == 7


def test_a_match_exec_is_never_cached(spy: tuple[str, Path, Path]) -> None:
    ssh, config, log = spy
    home = Path(os.environ["HOME"])
    (home / ".ssh" / "conf.d" / "m.conf").write_text("Match exec \"true\"\n  User bob\n")
    for n in (1, 2, 3):
        assert setup.ssh_g(ssh, config, "web", [], "test")["user"] == ["bob"]
        assert _calls(log) == n


def test_a_host_resolved_again_by_a_later_command_runs_no_ssh_g(spy: tuple[str, Path, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path a command takes (its resolution config written, then `ssh -G`): the second command's
    lookup is served from the cache. (Writing the config again used to set its time to now, one of the
    cache's inputs: every command missed.)"""
    ssh, _, log = spy
    monkeypatch.setenv("PATH", f"{Path(ssh).parent}:{os.environ['PATH']}")

    def lookup() -> dict[str, list[str]]:
        return setup.resolve("web", ["Port=22"], {}, None, 10.0)[1]

    assert lookup()["hostname"] == ["10.1.2.3"]
    first = _calls(log)
    time.sleep(0.01)  # a later command: the clock has moved
    assert lookup()["hostname"] == ["10.1.2.3"] and _calls(log) == first
