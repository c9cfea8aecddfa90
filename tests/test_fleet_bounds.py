"""Every hang bounded, and descriptors (issue 35, items 3 and 4).

* A host that takes the SSH connection and then hangs (its ~/.ssh/rc sleeps: sshd runs it before any
  command, whatever the login shell) is a host that does not answer: exit 4, named, within its
  start_timeout (3 s in these inventories), for exec, status and verify-env, while the healthy host beside
  it reports; exec's --timeout does not change that.
* `exec --timeout S` bounds the command once the node's side started, and says S (exit 124), even where the
  node never reports the kill (its python hangs).
* `exec` on 256 hosts under a soft open-file limit of 256 exits 0: dfo raises its own soft limit, and where
  the hard limit is low too, calls take turns.
* No select(): a call works with descriptors past 1023.
* Out of descriptors is a clear per-host error naming the limit (exit 4), never "please report it".
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.errors import EXIT_HOST
from orchestrator.transport.base import CallClock, CallTimeout, Marks, NotStarted, sh_command
from tests._cli import cli_env, dfo_argv
from tests.test_fleet_scale import _local_session

START = 3.0  # the start_timeout of the test inventories
SLACK = 6.0  # what a 2-core machine under other tests may add: dfo's start-up, the connection, the report
HUNG = "node-2"


# --------------------------------------------------------------------------- helpers


def _inventory(tb: Any, tmp_path: Path, hosts: dict[str, Any] | None = None, **defaults: Any) -> Path:
    inv = yaml.safe_load(Path(tb.inventory_path).read_text())
    inv["defaults"]["known_hosts"] = str(tmp_path / "known_hosts")
    inv["defaults"].update(defaults)
    if hosts is not None:
        inv["hosts"] = hosts
        inv["groups"] = {"all-of-them": list(hosts)}
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(inv, sort_keys=False))
    return p


def _run(inv: Path, *args: str, timeout: float, prlimit: str | None = None,
         env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """The real CLI; the seconds it took. A run past ``timeout`` fails the test (the hang this file is about)."""
    argv = dfo_argv(inv, *args)
    if prlimit is not None:
        argv = ["prlimit", f"--nofile={prlimit}", "--", *argv]
    t0 = time.monotonic()
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env or cli_env(),
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"dfo {' '.join(args)} still ran after {timeout:g}s: {str(exc.stderr)[-2000:]}")
    return r, time.monotonic() - t0


@pytest.fixture(scope="module")
def hung_bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """node-1 healthy; node-2 takes every SSH connection, then its ~/.ssh/rc sleeps (sshd's session never runs
    the command)."""
    from tests.conftest import start_testbed

    tb = start_testbed(tmp_path_factory.mktemp("hung"), nodes=2, s3=False)
    try:
        r = tb.node_exec(HUNG, "mkdir -p /root/.ssh && printf 'sleep 600\\n' > /root/.ssh/rc")
        assert r.returncode == 0, r.stderr
        yield tb
    finally:
        tb.stop()


def _assert_hung_named(text: str) -> None:
    line = next((ln for ln in text.splitlines() if HUNG in ln and "did not start within" in ln), None)
    assert line is not None, text[-3000:]
    assert f"within {START:g}s" in line, line


# --------------------------------------------------------------------------- unit: the pieces


def test_the_start_and_exit_markers_are_read_and_taken_out_whatever_the_pieces() -> None:
    cmd = sh_command("echo hi >&2", "m1", start_marker="m1")
    r = subprocess.run(["sh", "-c", cmd], capture_output=True, stdin=subprocess.DEVNULL)
    assert r.stderr == b"\x1edfo-start:m1\x1ehi\n\x1edfo-exit:m1:0\x1e"
    for size in (1, 2, 3, 7, len(r.stderr)):
        m = Marks("m1")
        pieces = [r.stderr[i:i + size] for i in range(0, len(r.stderr), size)]
        seen_start = []
        for p in pieces:
            m.feed(p)
            seen_start.append(m.started)
        assert m.started and m.code == 0 and m.text() == "hi\n", size
        assert seen_start.index(True) < len(pieces) - 1 or size == len(r.stderr)
    other = Marks("m2")  # another call's marker is the command's own output
    other.feed(r.stderr)
    assert not other.started and other.code is None and "dfo-start:m1" in other.text()
    # without a start marker the command line is the same as before (the early ssh's, paramiko's old one)
    assert "dfo-start" not in subprocess.run(["sh", "-c", sh_command("true", "m3")], capture_output=True,
                                             stdin=subprocess.DEVNULL).stderr.decode()


def test_the_call_clock_bounds_the_start_then_the_command() -> None:
    c = CallClock("h", start_limit=3, limit=10, t0=100.0)
    c.check(False, 102.9)
    with pytest.raises(NotStarted) as ns:
        c.check(False, 103.1)
    assert ns.value.exit_code == EXIT_HOST and "did not start within 3s" in ns.value.message
    c = CallClock("h", start_limit=3, limit=10, t0=100.0)
    c.check(True, 102.0)  # started at 102: the command's 10 s count from there
    c.check(False, 111.9)
    assert c.left(111.0) == pytest.approx(1.0)
    with pytest.raises(CallTimeout) as ct:
        c.check(False, 112.1)
    assert ct.value.limit == 10 and "did not finish within 10s" in ct.value.message


def test_a_call_works_with_descriptors_past_1023(tmp_path: Path) -> None:
    """select() fails on a descriptor past 1023 (ValueError: filedescriptor out of range); poll does not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"the hard open-file limit here ({hard}) cannot hold 1,100 descriptors")
    if soft != resource.RLIM_INFINITY and soft < 1300:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1300, hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        assert max(held) > 1024
        s = _local_session(tmp_path, 2)
        outs = s.each(lambda c: c.run("echo hi; echo there >&2"))
        assert [o.error for o in outs] == [None, None], [o.error.render() for o in outs if o.error]
        assert [(o.value.stdout, o.value.stderr) for o in outs if o.value] == [("hi\n", "there\n")] * 2
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


_OUT_OF_FILES = textwrap.dedent("""
    import json, os, resource, sys
    from orchestrator.config.models import load_inventory
    from orchestrator.hosts import HostSession
    inv, path = load_inventory(sys.argv[1])
    s = HostSession.from_inventory(inv, path, ["h000", "h001"])
    s.each(lambda c: c.run("true"))  # the transport's modules are loaded (a fleet runs out later than that)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    outs = s.each(lambda c: c.run("true"))
    print(json.dumps([{"host": o.host, "exit": o.exit_code, "error": o.error.render() if o.error else None,
                       "kind": o.error.kind if o.error else None} for o in outs]))
""")


def test_out_of_descriptors_is_a_clear_error_naming_the_limit(tmp_path: Path) -> None:
    """Every descriptor taken (as a fleet past the limit takes them): each host's call is an error that names
    the open-file limit and what to do, exit 4; never "unexpected error ... please report it" (exit 1)."""
    _local_session(tmp_path, 2)  # writes the inventory
    r = subprocess.run([sys.executable, "-c", _OUT_OF_FILES, str(tmp_path / "inventory.yaml")], capture_output=True,
                       text=True, timeout=60, env=cli_env(), stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = json.loads(r.stdout)
    assert [o["host"] for o in outs] == ["h000", "h001"]
    for o in outs:
        assert o["exit"] == EXIT_HOST and o["kind"] == "local_resource", o
        assert "please report" not in o["error"] and "unexpected" not in o["error"], o
        assert "open files" in o["error"] and "128" in o["error"] and "ulimit -n" in o["error"], o


@pytest.mark.timeout(240)
def test_exec_under_a_hard_limit_it_cannot_raise_takes_turns_and_exits_0(tmp_path: Path) -> None:
    """Soft and hard limits both 96 (64 hosts need 130 to 260 descriptors at once): dfo cannot raise it, so its
    calls take turns (said once) and all 64 hosts run; nothing fails for want of a descriptor."""
    n = 64
    _local_session(tmp_path, n)
    env = cli_env(HOME=str(tmp_path))  # the local hosts' node code goes under this HOME, not the real one
    r, took = _run(tmp_path / "inventory.yaml", "exec", "-H", "all", "--", "echo", "ok", prlimit="96:96", env=env,
                   timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(r.stdout.splitlines()) == sorted(f"[h{i:03d}] ok" for i in range(n))
    assert f"dfo: {n} hosts: exit 0 on" in r.stderr
    assert "open-file limit here (96)" in r.stderr and "wait for a turn" in r.stderr, r.stderr[-2000:]
    assert "please report" not in r.stderr and "Too many open files" not in r.stderr
    print(f"{n} local hosts under 96:96 in {took:.1f}s")


# --------------------------------------------------------------------------- a hung host on the testbed


@pytest.mark.usefixtures("each_ssh_transport")
def test_exec_names_a_hung_host_within_its_start_timeout_whatever_the_timeout(hung_bed: Any, tmp_path: Path) -> None:
    """-H node-1 -H node-2 (hung): node-1's output and exit 0 are printed, node-2 is exit 4, named as not
    started within 3 s; without --timeout (the old code waited 30 days) and with a --timeout far longer."""
    inv = _inventory(hung_bed, tmp_path, start_timeout=START)
    for extra in ([], ["--timeout", "600"]):
        r, took = _run(inv, "exec", "-H", "node-1", "-H", HUNG, *extra, "--", "echo", "hello", timeout=40)
        assert r.returncode == EXIT_HOST, r.stdout + r.stderr
        assert "[node-1] hello" in r.stdout.splitlines(), r.stdout
        assert "dfo: node-1: exit 0" in r.stderr, r.stderr
        _assert_hung_named(r.stderr)
        assert "exit 4 on node-2" in r.stderr and "exit 0 on node-1" in r.stderr, r.stderr
        assert took < START + SLACK, took


def test_status_and_verify_env_name_a_hung_host_within_its_start_timeout(hung_bed: Any, tmp_path: Path) -> None:
    """status (a 120 s call before) and verify-env (600 s): the healthy host's result is there, the hung one
    is exit 4 and named, within the start bound."""
    inv = _inventory(hung_bed, tmp_path, start_timeout=START)
    r, took = _run(inv, "status", "-H", "node-1", "-H", HUNG, "--json", timeout=60)
    assert r.returncode == EXIT_HOST, r.stdout + r.stderr
    doc = json.loads(r.stdout)["hosts"]
    assert doc["node-1"]["runs"] == [], doc
    assert "did not start within 3s" in json.dumps(doc[HUNG]), doc
    assert took < START + SLACK, took
    r, took = _run(inv, "verify-env", "-H", "node-1", "-H", HUNG, "--json", timeout=60)
    assert r.returncode == EXIT_HOST, r.stdout + r.stderr
    doc = json.loads(r.stdout)["hosts"]
    assert doc["node-1"]["ok"] is True and doc["node-1"]["python"], doc["node-1"]
    assert "did not start within 3s" in json.dumps(doc[HUNG]), doc
    assert took < START + SLACK, took
    r, _ = _run(inv, "status", "-H", "node-1", "-H", HUNG, timeout=60)  # the terminal's view names it too
    assert r.returncode == EXIT_HOST
    _assert_hung_named(r.stderr)


def test_a_start_timeout_of_the_hosts_own_wins_over_the_defaults(hung_bed: Any, tmp_path: Path) -> None:
    tb = hung_bed
    hosts = {n.name: {"host": n.address, "port": n.port} for n in tb.nodes}
    hosts[HUNG]["start_timeout"] = 2
    inv = _inventory(tb, tmp_path, hosts=hosts, start_timeout=120)
    r, took = _run(inv, "exec", "-H", HUNG, "--", "true", timeout=40)
    assert r.returncode == EXIT_HOST and "did not start within 2s" in r.stderr, r.stderr
    assert took < 2 + SLACK, took


def test_exec_timeout_says_the_time_given_when_the_node_never_reports(hung_bed: Any, tmp_path: Path) -> None:
    """The node's side starts but its python hangs (a python: that sleeps): the node never kills the command
    nor says so. At --timeout 3 plus the controller's margin dfo ends the call itself: exit 124, "after 3s"
    (before: exit 4, "did not finish within 33s", 33 s later)."""
    from orchestrator.steps.exec import CONTROLLER_MARGIN_S

    tb = hung_bed
    r = tb.node_exec("node-1", "printf '#!/bin/sh\\nsleep 600\\n' > /root/slowpy && chmod +x /root/slowpy")
    assert r.returncode == 0, r.stderr
    n1 = tb.node("node-1")
    hosts = {"node-1": {"host": n1.address, "port": n1.port},
             "slowpy": {"host": n1.address, "port": n1.port, "python": "/root/slowpy"}}
    inv = _inventory(tb, tmp_path, hosts=hosts, start_timeout=START)
    as_json = subprocess.Popen(dfo_argv(inv, "exec", "-H", "slowpy", "--timeout", "3", "--json", "--", "true"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                               stdin=subprocess.DEVNULL)  # beside the run below: the margin is waited for once
    try:
        r, took = _run(inv, "exec", "-H", "node-1", "-H", "slowpy", "--timeout", "3", "--", "echo", "hi", timeout=90)
        out, err = as_json.communicate(timeout=90)
    finally:
        as_json.kill()
    assert r.returncode == 124, r.stdout + r.stderr
    assert "[node-1] hi" in r.stdout.splitlines()
    line = next((ln for ln in r.stderr.splitlines() if ln.startswith("dfo: slowpy: ")), "")
    assert "timed out after 3s (--timeout)" in line and "exit 124" in line, r.stderr
    assert "did not finish within" not in r.stderr
    assert took < 3 + CONTROLLER_MARGIN_S + SLACK, took
    doc = json.loads(out)
    assert as_json.returncode == 124 and doc["exit"] == 124, out + err
    assert doc["hosts"]["slowpy"]["timed_out"] is True and doc["hosts"]["slowpy"]["exit"] == 124


# --------------------------------------------------------------------------- 256 hosts, soft limit 256


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_exec_on_256_hosts_under_a_soft_limit_of_256_exits_0(make_testbed: Any, tmp_path: Path) -> None:
    """256 inventory hosts (32 names for each of 8 real sshd nodes), `dfo exec -- sh -c 'sleep 3; echo ok'` under
    `prlimit --nofile=256:4096`. Before: 2 to 4 descriptors per host in flight, and hosts failed with
    "unexpected error: OSError: Too many open files ... please report it" (exit 1)."""
    nodes, per = 8, 32
    tb = make_testbed(nodes=nodes, s3=False)
    hosts = {f"{n.name}-{i:02d}": {"host": n.address, "port": n.port} for n in tb.nodes for i in range(per)}
    inv = _inventory(tb, tmp_path, hosts=hosts)
    # each command lasts 3 s: every host's call is in flight at once, as a real fleet command's are
    r, took = _run(inv, "exec", "-H", "all", "--", "sh", "-c", "sleep 3; echo ok", prlimit="256:4096", timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert sorted(r.stdout.splitlines()) == sorted(f"[{h}] ok" for h in hosts)
    assert f"dfo: {len(hosts)} hosts: exit 0 on" in r.stderr
    assert "please report" not in r.stderr and "Too many open files" not in r.stderr
    print(f"256 hosts on {nodes} nodes under 256:4096 in {took:.1f}s")
