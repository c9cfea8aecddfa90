"""Issue 18, speed: the ssh of a host named with -H starts at dfo's start-up (transport/openssh_early.py),
so its handshake overlaps Python's imports and the inventory's validation.

Against real testbed sshd nodes: the second command that names a host goes over the ssh started early
(one connection per command, as before); a record that no longer matches what the inventory makes is
never taken over; a changed host key met by the early ssh is refused (exit 4); a command that fails
before it connects leaves no ssh and no connection folder behind; the inventory file changed, or
DFO_EARLY_CONNECT=0, start nothing early.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.transport import openssh_early
from tests.test_openssh import _masters, _ssh_of, _sshd_log, dfo, inventory

ADOPTED = "over the ssh started at dfo's start-up"
REFUSED = "is not the one the inventory makes now"


def test_the_hosts_named_on_the_command_line_are_found_without_click(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts: {}\n")
    monkeypatch.chdir(tmp_path)
    parse = openssh_early._parse
    got = parse(["-i", str(inv), "sync-code", "-H", "a,b", "-j", "job", "--host", "c", "--host=d", "-H", "a"])
    assert got is not None and got[0] == str(inv.resolve()) and got[2] == ["a", "b", "c", "d"]
    assert parse(["-v", f"--inventory={inv}", "status", "-H", "a"]) is not None
    assert parse(["status", "-H", "a"]) is None  # no ./inventory.yaml here
    (tmp_path / "inventory.yaml").write_text("hosts: {}\n")
    assert parse(["status", "-H", "a"]) is not None
    monkeypatch.setenv("DFO_INVENTORY", str(inv))
    assert parse(["status", "-H", "a"])[0] == str(inv.resolve())  # type: ignore[index]
    for args in (["status", "-H", "a", "--help"], ["plot", "-H", "a"], ["status"], ["-i", str(inv)],
                 ["launch", "-H", "a", "--dry-run"], ["exec", "--", "-H", "a"], ["-i", str(tmp_path / "no"), "status",
                                                                                 "-H", "a"]):
        assert parse(args) is None, args
    # the inventory's stat and the environment are part of what a record must match
    before = parse(["status", "-H", "a"])
    monkeypatch.setenv("DFO_SSH_TRANSPORT", "paramiko")
    assert parse(["status", "-H", "a"])[1] != before[1]  # type: ignore[index]


def _record(runtime_dir: Path) -> Path:
    got = list(runtime_dir.glob("early-*.json"))
    assert len(got) == 1, got
    return got[0]


def _accepted(tb: Any, node: Any) -> int:
    return _sshd_log(tb, node).count("Accepted publickey")


def _gone(runtime_dir: Path) -> None:
    """No ssh naming dfo's folder runs, and no connection folder is left (a command with ssh_persist 0)."""
    deadline = time.monotonic() + 5
    while (_ssh_of(runtime_dir) or list(runtime_dir.glob("c-*"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ssh_of(runtime_dir) == [], "an ssh outlived the command"
    assert not list(runtime_dir.glob("c-*")), list(runtime_dir.iterdir())


@pytest.mark.testbed
def test_the_next_command_goes_over_the_ssh_started_at_its_start_up(testbed: Any, tmp_path: Path,
                                                                    runtime_dir: Path) -> None:
    node = testbed.nodes[0]
    inv = inventory(testbed, tmp_path, defaults={"transport": "openssh", "ssh_persist": 0})
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 0, r.stderr
    assert ADOPTED not in r.stderr  # no record yet: nothing started early
    rec = _record(runtime_dir)
    assert rec.stat().st_mode & 0o777 == 0o600
    doc = json.loads(rec.read_text())
    assert doc["name"] == node.name and doc["argv"][0].endswith("ssh") and "IdentityFile" in doc["config"]
    assert str(tmp_path) not in json.dumps(doc["argv"]).replace(str(inv), "")  # no connection's folder: a template
    for _ in range(2):
        before = _accepted(testbed, node)
        r = dfo(inv, "-v", "status", "-H", node.name)
        assert r.returncode == 0, r.stderr
        assert ADOPTED in r.stderr and REFUSED not in r.stderr, r.stderr
        assert _accepted(testbed, node) - before == 1  # the early ssh's connection, and no second one
        _gone(runtime_dir)
    # the inventory file changed since the record: nothing starts early; the record is made anew
    inv.write_text(inv.read_text() + "\n")
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 0 and ADOPTED not in r.stderr, r.stderr
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 0 and ADOPTED in r.stderr, r.stderr
    r = dfo(inv, "-v", "status", "-H", node.name, DFO_EARLY_CONNECT="0")
    assert r.returncode == 0 and ADOPTED not in r.stderr, r.stderr


@pytest.mark.testbed
def test_a_shared_master_is_started_early_only_when_none_is_there(testbed: Any, tmp_path: Path,
                                                                  runtime_dir: Path) -> None:
    import subprocess

    node = testbed.nodes[0]
    inv = inventory(testbed, tmp_path, defaults={"transport": "openssh", "ssh_persist": 60})
    assert dfo(inv, "status", "-H", node.name).returncode == 0
    # the master's name holds what dfo's known_hosts says of the host: the key the first command recorded
    # gives the next command's master another name, so the steady state begins with the second command
    assert dfo(inv, "status", "-H", node.name).returncode == 0
    masters = {m for m in _masters(runtime_dir) if json.loads(_record(runtime_dir).read_text())["control"] == str(m)}
    assert len(masters) == 1, (_masters(runtime_dir), _record(runtime_dir).read_text())
    before = _accepted(testbed, node)
    r = dfo(inv, "-v", "status", "-H", node.name)  # within the persist window: the master is used, nothing early
    assert r.returncode == 0 and ADOPTED not in r.stderr, r.stderr
    assert _accepted(testbed, node) == before, (r.stderr, _sshd_log(testbed, node)[-3000:])
    control = masters.pop()
    subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={control}", "x"], capture_output=True, timeout=10)
    deadline = time.monotonic() + 5
    while control.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 0 and ADOPTED in r.stderr, r.stderr
    assert _accepted(testbed, node) - before == 1
    assert control in _masters(runtime_dir)  # the early ssh made the shared master, at dfo's own path


@pytest.mark.testbed
def test_a_record_that_differs_from_what_the_inventory_makes_is_never_taken_over(testbed: Any, tmp_path: Path,
                                                                                 runtime_dir: Path) -> None:
    node = testbed.nodes[0]
    inv = inventory(testbed, tmp_path, defaults={"transport": "openssh", "ssh_persist": 0})
    assert dfo(inv, "status", "-H", node.name).returncode == 0
    rec = _record(runtime_dir)
    doc = json.loads(rec.read_text())
    for field, change in (("config", lambda d: d["config"] + "# changed\n"),
                          ("argv", lambda d: [*d["argv"][:-2], "-o", "ServerAliveInterval=7", *d["argv"][-2:]])):
        bad = dict(doc, **{field: change(doc)})
        rec.write_text(json.dumps(bad))
        r = dfo(inv, "-v", "status", "-H", node.name)
        assert r.returncode == 0, r.stderr
        assert REFUSED in r.stderr and ADOPTED not in r.stderr, (field, r.stderr)
        _gone(runtime_dir)
        assert json.loads(rec.read_text()) == doc  # the record is what the inventory makes again


@pytest.mark.testbed
def test_a_changed_host_key_met_by_the_early_ssh_is_refused(make_testbed: Any, tmp_path: Path,
                                                            runtime_dir: Path) -> None:
    tb = make_testbed(nodes=1, s3=False)
    node = tb.nodes[0]
    inv = inventory(tb, tmp_path, defaults={"transport": "openssh", "ssh_persist": 0})
    assert dfo(inv, "status", "-H", node.name).returncode == 0
    _record(runtime_dir)
    tb.rotate_host_key(node)
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 4, r.stdout + r.stderr
    assert ADOPTED in r.stderr and "CHANGED" in r.stderr and "SHA256:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    _gone(runtime_dir)


@pytest.mark.testbed
def test_a_command_that_fails_before_it_connects_leaves_no_ssh_behind(testbed: Any, tmp_path: Path,
                                                                      runtime_dir: Path) -> None:
    node = testbed.nodes[0]
    inv = inventory(testbed, tmp_path, defaults={"transport": "openssh", "ssh_persist": 0})
    assert dfo(inv, "status", "-H", node.name).returncode == 0
    _record(runtime_dir)
    r = dfo(inv, "sync-code", "-H", node.name, "-j", str(tmp_path / "no-such-job.yaml"))
    assert r.returncode == 2, r.stderr
    _gone(runtime_dir)
