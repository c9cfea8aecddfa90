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
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.transport import openssh_early
from tests.test_openssh import _label, _master_pid, _masters, _ssh_of, _sshd_log, dfo, inventory, keygen

ADOPTED = "over the ssh started at dfo's start-up"
REFUSED = "is not the one the inventory makes now"
STARTED = "ssh started at dfo's start-up"


def test_the_hosts_named_on_the_command_line_are_found_without_click(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFO_INVENTORY", raising=False)
    monkeypatch.delenv("DFO_VERBOSE", raising=False)
    parse = openssh_early._parse
    got = parse(["-i", str(inv), "sync-code", "-H", "a,b", "-j", "job", "--host", "c", "--host=d", "-H", "a"])
    assert got is not None and got[0] == str(inv.resolve()) and got[2] == ["a", "b", "c", "d"] and not got[3]
    assert parse(["-v", f"--inventory={inv}", "status", "-H", "a"])[3] is True  # type: ignore[index]
    assert parse(["status", "-H", "a"]) is None  # no ./inventory.yaml here
    (tmp_path / "inventory.yaml").write_text("hosts: {}\n")
    assert parse(["status", "-H", "a"]) is not None
    monkeypatch.setenv("DFO_INVENTORY", str(inv))
    assert parse(["status", "-H", "a"])[0] == str(inv.resolve())  # type: ignore[index]
    for args in (["status", "-H", "a", "--help"], ["plot", "-H", "a"], ["status"], ["-i", str(inv)],
                 ["launch", "-H", "a", "--dry-run"], ["exec", "--", "-H", "a"], ["tail", "-H", "a", "--from-s3"],
                 ["-i", str(tmp_path / "no"), "status", "-H", "a"]):
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


def _end(control: Path) -> None:
    """End the master at ``control`` (ssh -O exit) and wait until its socket is gone."""
    subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={control}", "x"], capture_output=True, timeout=10)
    deadline = time.monotonic() + 5
    while control.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


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
    # a template: no connection's folder (c-PID-TOKEN) in it, filled in anew by each command
    assert not re.search(r"/c-\d+-[0-9a-f]{8}", json.dumps(doc["argv"]) + doc["config"]), doc
    assert doc["config"].count("\x00/new_keys") == 1 and doc["argv"][2] == "\x00/config", doc
    assert str(doc["watch"]).count("known_hosts") >= 2 and doc["argv"][0] in doc["watch"]
    for _ in range(2):
        before = _accepted(testbed, node)
        r = dfo(inv, "-v", "status", "-H", node.name)
        assert r.returncode == 0, r.stderr
        assert STARTED in r.stderr and ADOPTED in r.stderr and REFUSED not in r.stderr, r.stderr
        assert _accepted(testbed, node) - before == 1  # the early ssh's connection, and no second one
        _gone(runtime_dir)
    # the inventory file changed since the record: nothing starts early; the record is made anew
    inv.write_text(inv.read_text() + "\n")
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 0 and ADOPTED not in r.stderr, r.stderr
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 0 and ADOPTED in r.stderr, r.stderr
    r = dfo(inv, "-v", "status", "-H", node.name, DFO_EARLY_CONNECT="0")
    assert r.returncode == 0 and STARTED not in r.stderr, r.stderr
    # dfo's known_hosts changed (any of the known_hosts files): nothing starts early
    khf = next(Path(f) for f in json.loads(rec.read_text())["watch"] if f.startswith(str(tmp_path)))
    khf.write_text(khf.read_text() + "# a comment\n")
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 0 and STARTED not in r.stderr, r.stderr
    # a record that another user could have written is never used
    rec.chmod(0o622)
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 0 and STARTED not in r.stderr, r.stderr


@pytest.mark.testbed
def test_a_shared_master_is_started_early_only_when_none_is_there(testbed: Any, tmp_path: Path,
                                                                  runtime_dir: Path) -> None:
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
    _end(control)
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
    r = dfo(inv, "-v", "sync-code", "-H", node.name, "-j", str(tmp_path / "no-such-job.yaml"))
    assert r.returncode == 2, r.stderr
    assert STARTED in r.stderr, r.stderr
    _gone(runtime_dir)


@pytest.mark.testbed
def test_a_host_a_ca_line_now_covers_gets_no_early_ssh_under_the_old_policy(make_testbed: Any, tmp_path: Path,
                                                                             runtime_dir: Path) -> None:
    """The record was made while the host's plain key was trusted; then known_hosts came to hold only a
    @cert-authority line for it. No early ssh may connect under the old policy (accept-new, which takes
    the plain key): the command is refused (exit 4) and the node saw no login at all."""
    tb = make_testbed(nodes=1, s3=False)
    node = tb.nodes[0]
    kh = tmp_path / "known_hosts"
    inv = inventory(tb, tmp_path, kh=kh, defaults={"transport": "openssh", "ssh_persist": 0})
    assert dfo(inv, "status", "-H", node.name).returncode == 0
    _record(runtime_dir)
    ca = keygen(tmp_path / "host_ca").with_suffix(".pub").read_text().split()
    kh.write_text(f"@cert-authority {node.address},{_label(node)} {ca[0]} {ca[1]}\n")
    before = _accepted(tb, node)
    r = dfo(inv, "-v", "status", "-H", node.name)
    assert r.returncode == 4, r.stdout + r.stderr
    assert STARTED not in r.stderr and "Traceback" not in r.stderr, r.stderr
    time.sleep(0.5)
    assert _accepted(tb, node) == before, _sshd_log(tb, node)[-1500:]


@pytest.mark.testbed
def test_a_shared_master_made_by_a_refused_early_ssh_takes_no_command(testbed: Any, tmp_path: Path,
                                                                      runtime_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """ssh_persist > 0, and the record's config differs from what the inventory makes while its control
    path is the very one: the early ssh has already made the shared master there when the command
    compares. The command refuses it and its calls go over a connection of their own; the refused master
    stops taking sessions (ssh -O stop). In-process, so that the early ssh is known to have connected
    before the comparison."""
    from orchestrator.hosts import HostSession
    from orchestrator.transport.openssh_setup import master_answers

    node = testbed.nodes[0]
    inv = inventory(testbed, tmp_path, defaults={"transport": "openssh", "ssh_persist": 60})
    for _ in range(2):  # (the first recorded the host key: the second's master has the steady name)
        assert dfo(inv, "status", "-H", node.name).returncode == 0
    rec = _record(runtime_dir)
    doc = json.loads(rec.read_text())
    control = Path(doc["control"])
    _end(control)
    rec.write_text(json.dumps(dict(doc, config=doc["config"] + "# not what the inventory makes\n")))
    monkeypatch.setenv("DFO_VERBOSE", "1")
    before = _accepted(testbed, node)
    try:
        openssh_early.start(["-i", str(inv), "status", "-H", node.name])
        early = openssh_early._session.early[node.name]  # type: ignore[union-attr]
        assert early.proc.wait(30) == 0  # its `true` ran: the master it made listens at the control path
        assert master_answers(str(control)) is True
        refused = _master_pid(control)
        session = HostSession(str(inv), [node.name])
        try:
            assert session.conn(node.name).run("echo over-mine").stdout.strip() == "over-mine"
        finally:
            session.close()
    finally:
        openssh_early.finish()
    assert _accepted(testbed, node) - before == 2  # the early ssh's connection, and the command's own
    assert _master_pid(control) != refused  # the socket is the command's own master's now
    doc2 = json.loads(rec.read_text())
    assert doc2["config"] == doc["config"]  # the record is what the inventory makes again


def test_records_and_configs_unused_for_a_week_are_removed_once_a_process(runtime_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """openssh_keys._clean_stale: early-ssh records and resolution configs untouched for 7 days go, fresh
    ones stay; a record still in use gets its time renewed once a day (write_private), so it never ages
    out; the folder is gone through once per process, not once per host."""
    import os

    from orchestrator.transport import openssh_keys

    monkeypatch.setattr(openssh_keys, "_CLEANED", set())
    base = openssh_early.state_dir()
    week = 7 * 86400
    old, fresh, used = base / "early-00000000000000aa.json", base / "resolve-00aa.conf", base / "early-bb.json"
    gone_cfg = base / "resolve-11bb.conf"
    for p in (old, fresh, used, gone_cfg):
        p.write_text("{}")
    for p in (old, used, gone_cfg):
        os.utime(p, (time.time() - week - 60, time.time() - week - 60))
    assert openssh_early.write_private(used, "{}") is False  # unchanged: not written, but its time renewed
    assert time.time() - used.stat().st_mtime < 60
    openssh_keys._clean_stale(base)
    assert not old.exists() and not gone_cfg.exists() and fresh.exists() and used.exists()
    os.utime(fresh, (time.time() - week - 60, time.time() - week - 60))
    openssh_keys._clean_stale(base)  # the same process: not gone through again
    assert fresh.exists()
