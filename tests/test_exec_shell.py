"""dfo exec without --timeout runs in the node's sh alone (issue 35, item 5: "a warm call that needs no
node-side Python does not start one"): no python3 on the node, cold or warm; a node without setsid gets
the node module instead, and the command still runs once; a signal is 128+N; with ``ssh_persist: 0`` the
one call is a plain ssh (no master started and ended for it).

Real sshd nodes (the testbed); the node's python3 is a spy script (inventory ``python:``) that logs each
start; dfo's ssh is a spy on PATH that logs each argv and runs the real client.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import _cli

pytestmark = pytest.mark.testbed

SSH = shutil.which("ssh")


def _inventory(tb: Any, tmp_path: Path, **defaults: Any) -> Path:
    inv = yaml.safe_load(Path(tb.inventory_path).read_text())
    inv["defaults"]["known_hosts"] = str(tmp_path / "known_hosts")
    inv["defaults"]["python"] = "/root/pyspy"
    inv["defaults"].update(defaults)
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(inv))
    return p


def _spy_python(tb: Any) -> None:
    for n in tb.nodes:
        tb.node_exec(n, "rm -f /root/py.log; printf '%s\\n' '#!/bin/sh' 'echo \"$*\" >> /root/py.log' "
                        "'exec python3 \"$@\"' > /root/pyspy && chmod +x /root/pyspy")


def _python_starts(tb: Any, node: Any) -> int:
    r = tb.node_exec(node, "cat /root/py.log 2>/dev/null || true")
    return len(r.stdout.splitlines())


def test_exec_without_timeout_starts_no_python_on_the_node_cold_or_warm(testbed2: Any, tmp_path: Path) -> None:
    tb = testbed2
    _spy_python(tb)
    inv = _inventory(tb, tmp_path)
    names = [n.name for n in tb.nodes]
    # first contact (no dfo code on the nodes), then warm (the shared connections up): no node Python either time
    for _ in range(2):
        r = _cli.dfo(inv, "exec", "-H", ",".join(names), "--", "sh", "-c", 'echo out-$(hostname); echo err >&2')
        assert r.returncode == 0, r.stdout + r.stderr
        for n in tb.nodes:
            assert f"[{n.name}] out-{n.name}" in r.stdout and f"[{n.name}] err" in r.stderr
            assert _python_starts(tb, n) == 0, tb.node_exec(n, "cat /root/py.log").stdout
    # the login shell's profile holds (-l) and the command runs from $HOME, as the node module runs it
    r = _cli.dfo(inv, "exec", "-H", names[0], "--json", "--", "sh", "-c", 'pwd; echo "$0"; exit 3')
    doc = json.loads(r.stdout)["hosts"][names[0]]
    assert r.returncode == 3 and doc["exit"] == 3 and doc["stdout"].splitlines()[0] == "/root", r.stdout
    assert _python_starts(tb, tb.nodes[0]) == 0
    # with --timeout the node module runs (its clock kills the group): the spy sees it, so the check above can fail
    r = _cli.dfo(inv, "exec", "-H", names[0], "--timeout", "60", "--", "true")
    assert r.returncode == 0, r.stderr
    assert _python_starts(tb, tb.nodes[0]) >= 1


def test_a_command_killed_by_a_signal_is_128_plus_n(testbed2: Any, tmp_path: Path) -> None:
    tb = testbed2
    inv = _inventory(tb, tmp_path, python="python3")
    n1 = tb.nodes[0].name
    r = _cli.dfo(inv, "exec", "-H", n1, "--", "sh", "-c", "kill -9 $$")
    assert r.returncode == 137, r.stderr
    assert f"dfo: {n1}: killed by signal 9 (exit 137)" in r.stderr and "Killed" not in r.stderr, r.stderr
    r = _cli.dfo(inv, "exec", "-H", n1, "--json", "--", "sh", "-c", "kill -TERM $$")
    doc = json.loads(r.stdout)["hosts"][n1]
    assert r.returncode == 143 and doc["signal"] == 15 and doc["stderr"] == "", r.stdout


def test_a_node_without_setsid_gets_the_node_module_and_the_command_runs_once(make_testbed: Any,
                                                                               tmp_path: Path) -> None:
    tb = make_testbed(nodes=1, s3=False)
    node = tb.nodes[0]
    _spy_python(tb)
    # the node's PATH (sshd's SetEnv) holds every program of /usr/bin and /bin but setsid
    tb.node_exec(node, "mkdir -p /root/nosetsid && for f in /usr/bin/* /bin/*; do b=${f##*/}; "
                       '[ "$b" = setsid ] || [ -e "/root/nosetsid/$b" ] || ln -s "$f" "/root/nosetsid/$b"; done')
    tb.sshd_options(node, SetEnv="PATH=/root/nosetsid")
    assert "setsid" not in tb.ssh(node, "command -v setsid || echo none").stdout  # the premise
    inv = _inventory(tb, tmp_path)
    r = _cli.dfo(inv, "exec", "-H", node.name, "--", "sh", "-c", "echo ran >> /root/count; echo hello")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == f"[{node.name}] hello\n" and "no-setsid" not in r.stderr, r.stdout + r.stderr
    assert tb.node_exec(node, "cat /root/count").stdout == "ran\n"  # once: the shell path ran nothing
    assert _python_starts(tb, node) >= 1  # the node module ran it


@pytest.mark.skipif(SSH is None, reason="no OpenSSH client here")
def test_with_ssh_persist_0_the_one_call_is_a_plain_ssh(testbed2: Any, tmp_path: Path) -> None:
    tb = testbed2
    log = tmp_path / "ssh.log"
    spy = tmp_path / "bin" / "ssh"
    spy.parent.mkdir()
    # one write a call (two ssh at once must not mix their lines)
    spy.write_text(f"#!/bin/sh\nline=$(printf '%s ' \"$@\" | tr '\\n' ' ')\nprintf '%s\\n' \"$line\" >> {log}\n"
                   f"exec {SSH} \"$@\"\n")
    spy.chmod(0o755)
    env = _cli.cli_env(PATH=f"{spy.parent}:{os.environ['PATH']}", DFO_SSH_TRANSPORT="openssh")
    names = ",".join(n.name for n in tb.nodes)
    calls = lambda: [ln for ln in log.read_text().splitlines() if not ln.startswith(("-G ", "-V "))]  # noqa: E731
    for persist in (0, 60):
        log.write_text("")
        inv = _inventory(tb, tmp_path, python="python3", ssh_persist=persist)
        r = _cli.dfo(inv, "exec", "-H", names, "--", "true", env=env)
        assert r.returncode == 0, r.stderr
        made = calls()
        assert len(made) == len(tb.nodes), made  # one ssh a host, nothing else (no master ended after it)
        if persist == 0:
            assert all("ControlMaster=no" in ln and "ControlPath=none" in ln for ln in made), made
        else:
            assert all("ControlMaster=auto" in ln and "ControlPersist=60s" in ln for ln in made), made


def test_ctrl_c_kills_a_child_that_ignores_sigterm_after_its_leader_died(testbed2: Any, tmp_path: Path) -> None:
    """The command's leader dies of the SIGTERM, a child of it ignores SIGTERM: SIGKILL still follows 2 s later
    (the node's watcher no longer stops when the wrapper, seeing the leader gone, ends it)."""
    import secrets
    import signal
    import time

    tb = testbed2
    n1 = tb.nodes[0]
    inv = _inventory(tb, tmp_path, python="python3")
    marker = f"shellterm{secrets.token_hex(3)}"
    script = f'echo started; (trap "" TERM; exec -a {marker} sleep 300) & wait'
    proc = _cli.dfo_popen(inv, "exec", "-H", n1.name, "--", "bash", "-c", script)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == f"[{n1.name}] started"

    def alive() -> list[str]:
        return tb.node_exec(n1, f"pgrep -f '^{marker}' || true").stdout.split()

    deadline = time.monotonic() + 30
    while not alive():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 130
    deadline = time.monotonic() + 20
    while alive():
        assert time.monotonic() < deadline, "the child that ignores SIGTERM outlived dfo exec"
        time.sleep(0.5)


def test_the_keepalive_never_reaches_the_output(testbed2: Any, tmp_path: Path) -> None:
    """A quiet command gets the node's keepalive every DFO_EXEC_KEEP_S (here 0.5 s): taken out wherever it falls,
    between lines or in the middle of one."""
    tb = testbed2
    n1 = tb.nodes[0]
    inv = _inventory(tb, tmp_path, python="python3")
    script = "printf 'half-'; printf 'err-' >&2; sleep 2; echo line; echo rest >&2"
    r = _cli.dfo(inv, "exec", "-H", n1.name, "--json", "--", "sh", "-c", script,
                 env=_cli.cli_env(DFO_EXEC_KEEP_S="0.5"))
    doc = json.loads(r.stdout)["hosts"][n1.name]
    assert r.returncode == 0, r.stdout + r.stderr
    assert doc["stdout"] == "half-line\n" and doc["stderr"] == "err-rest\n", doc


def test_a_login_that_does_not_run_the_command_is_a_host_error_with_its_words(make_testbed: Any,
                                                                             tmp_path: Path) -> None:
    """sshd's ForceCommand (or a nologin shell) answers instead of the command: exit 4 naming what it said, not
    a silent exit status."""
    tb = make_testbed(nodes=1, s3=False)
    node = tb.nodes[0]
    tb.sshd_options(node, ForceCommand='echo denied-by-site-policy >&2; exit 3')
    inv = _inventory(tb, tmp_path, python="python3")
    r = _cli.dfo(inv, "exec", "-H", node.name, "--", "true")
    assert r.returncode == 4, r.stdout + r.stderr
    assert "did not run the command (exit 3)" in r.stderr and "denied-by-site-policy" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_command_too_long_for_one_argument_goes_through_the_node_module(testbed2: Any, tmp_path: Path) -> None:
    """sshd hands the command to the login shell as one argument (Linux: at most 128 KiB): a longer one runs
    through the node module, whose request travels on stdin."""
    tb = testbed2
    _spy_python(tb)
    inv = _inventory(tb, tmp_path)
    n1 = tb.nodes[0]
    long = " " * 40_000  # 4 bytes a blank once escaped for the shell (\\040): 160 KB, past the limit
    r = _cli.dfo(inv, "exec", "-H", n1.name, "--", "sh", "-c", 'printf %s "$1" | wc -c', "sh", long)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"[{n1.name}] 40000"
    assert _python_starts(tb, n1) >= 1
