"""Hardening of the command line (issue 10, items 11, 18, 19, 20, 21), through the real CLI.

11: strings from the node are text, never rich markup, and carry no terminal control codes
    (only the raw log stream of `tail` / `launch` passes the trainer's bytes through).
18: a host name that does not resolve, a YAML syntax error's line, `up` without S3 credentials,
    exit codes in every --help, piped status output without padding.
19: the follow/status/stop hints work when pasted; which run `tail -H` follows is said.
20: `up` checks the whole job before its first step; a folder in run.upload is named as such.
21: output that is not a terminal never wraps.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from orchestrator.cli import cli
from orchestrator.config.models import load_job
from orchestrator.errors import ConfigError
from tests._cli import dfo, dfo_popen
from tests._runs_fixtures import RunsEnv, inventory_copy

on_testbed = pytest.mark.testbed

# a screen clear, a window-title setter, an OSC 8 hyperlink, a bell: what a hostile node could send
EVIL = "\x1b[2J\x1b]0;pwned\x07\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\"
EVIL_ID = "evil-[bold]\x1b]0;t\x07x"  # a run id: a directory name, so no "/"
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")  # any control character but the newline


def no_control(text: str) -> bool:
    return CONTROL.search(text) is None


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell, without COLUMNS (a pipe: rich would guess 80)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env.update(extra)
    return env


def run_dfo(inv: Path | None, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real CLI with stdout and stderr to pipes, as `dfo ... | grep` or `> file` runs it."""
    return dfo(inv, *args, env=env or cli_env(), cwd=cwd, timeout=timeout)


def pasted(cmd: str) -> list[str]:
    """A printed `dfo ...` command, as the shell would run it."""
    argv = shlex.split(cmd)
    assert argv[0] == "dfo", cmd
    return argv[1:]


class Env(RunsEnv):
    """A RunsEnv whose host workspace is private to the test, so listing every run sees only ours."""

    ws: str = ""

    def write_job(self, doc: dict[str, Any], name: str | None = None) -> tuple[Path, str]:
        name = name or f"hz-{secrets.token_hex(3)}"
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"name": name, "venv": "/usr", **doc}, sort_keys=False))
        return path, name

    def cli(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return run_dfo(self.inv, *args, **kw)


@pytest.fixture
def henv(testbed, tmp_path: Path) -> Any:  # type: ignore[no-untyped-def]
    node = testbed.nodes[0]
    inv = inventory_copy(testbed, tmp_path)
    doc = yaml.safe_load(inv.read_text())
    ws = f"/workspace/hz-{secrets.token_hex(4)}"
    doc["hosts"][node.name]["workspace"] = ws
    inv.write_text(yaml.safe_dump(doc))
    e = Env(testbed, node, inv, tmp_path)
    e.ws = ws
    try:
        yield e
    finally:
        testbed.node_exec(node, f"rm -rf {shlex.quote(ws)}")


def _wait_ended(e: Env, run: str, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        r = e.cli("status", "-H", e.node.name, run, "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)["hosts"][e.node.name]["runs"][0]
        if st["state"] != "running" or time.monotonic() > deadline:
            return st
        time.sleep(0.3)


def _launch(e: Env, job: Path, *extra: str) -> dict[str, Any]:
    r = e.cli("launch", "-H", e.node.name, "-j", str(job), "--json", *extra)
    assert r.returncode in (0, 5), r.stderr
    return json.loads(r.stdout)["hosts"][e.node.name]


# ------------------------------------------------------------------------- 11: node strings


@on_testbed
def test_node_strings_are_text_without_terminal_codes(henv: Env) -> None:
    e, node = henv, henv.node.name
    job, _ = e.write_job({"run": {"workdir": "/root/runs-test", "command": "echo hello", "wait": 0}})
    run = _launch(e, job)["run"]
    assert _wait_ended(e, run)["state"] == "succeeded"
    # the node's files say what a hostile node could: a job named [/x], control codes in the log,
    # and a run whose id holds markup and a title setter
    script = (
        "import json, shutil\n"
        f"d = {e.ws!r} + '/.dfo/runs/' + {run!r}\n"
        "m = json.load(open(d + '/meta.json'))\n"
        "m['job'] = '[/x]'\n"
        "json.dump(m, open(d + '/meta.json', 'w'))\n"
        f"open(d + '/log', 'a').write({EVIL!r} + '\\n')\n"
        f"x = {e.ws!r} + '/.dfo/runs/' + {EVIL_ID!r}\n"
        "shutil.copytree(d, x)\n"
        f"m['job'] = {EVIL!r}; m['started_ts'] += 1; m['started'] = '[red]' + {EVIL!r}\n"
        "json.dump(m, open(x + '/meta.json', 'w'))\n"
    )
    e.node_sh("python3 -c " + shlex.quote(script))

    listing = e.cli("status", "-H", node)
    out = listing.stdout + listing.stderr
    assert listing.returncode == 0, out
    assert no_control(out), repr(out)
    assert run in listing.stdout and "[/x]" in listing.stdout  # both runs are listed, as text
    assert "evil-[bold]\\x1b]0;t\\x07x" in listing.stdout  # markup and control codes shown, not obeyed

    detail = e.cli("status", "-H", node, run)
    out = detail.stdout + detail.stderr
    assert detail.returncode == 0, out
    assert no_control(out), repr(out)
    assert "[/x]" in detail.stdout and "\\x1b]8;;http://evil" in detail.stdout

    detail = e.cli("status", "-H", node, "evil-")
    assert detail.returncode == 0 and no_control(detail.stdout + detail.stderr), repr(detail.stdout + detail.stderr)

    # --json carries the true values (JSON escapes them by nature)
    doc = json.loads(e.cli("status", "-H", node, "--json").stdout)["hosts"][node]["runs"]
    by_id = {r["id"]: r for r in doc}
    assert by_id[run]["job"] == "[/x]" and by_id[run]["last_line"] == EVIL
    assert by_id[EVIL_ID]["job"] == EVIL

    stop = e.cli("stop", "-H", node, "evil-")
    assert stop.returncode == 0 and "nothing to stop" in stop.stdout
    assert no_control(stop.stdout + stop.stderr), repr(stop.stdout + stop.stderr)

    # the log stream itself stays the trainer's bytes; dfo's own words about it are clean
    tail = e.cli("tail", "-H", node, "evil-", "--no-follow")
    assert tail.returncode == 0 and EVIL in tail.stdout
    assert no_control(tail.stderr) and "evil-[bold]" in tail.stderr, repr(tail.stderr)


@on_testbed
def test_diagnosis_of_a_hostile_last_line_is_clean(henv: Env) -> None:
    e, node = henv, henv.node.name
    line = "torch.OutOfMemoryError: CUDA out of memory [/x]" + EVIL
    crash = f"import sys\nprint({line!r}, flush=True)\nsys.exit(1)\n"
    (e.tmp / "crash.py").write_text(crash)
    job, _ = e.write_job({"run": {"workdir": "/root/runs-test", "upload": ["crash.py"],
                                  "command": "python3 crash.py", "wait": 0}})
    run = _launch(e, job)["run"]
    assert _wait_ended(e, run)["state"] == "failed"
    tail = e.cli("tail", "-H", node, run, "-n", "+1")
    assert tail.returncode == 5, tail.stderr
    assert tail.stdout == line + "\n"  # the raw stream
    assert "CUDA out of memory" in tail.stderr and "[/x]" in tail.stderr
    assert no_control(tail.stderr), repr(tail.stderr)
    launch = e.cli("launch", "-H", node, "-j", str(job), "--wait", "20")
    assert launch.returncode == 5, launch.stderr
    recap = launch.stdout.split(line + "\n", 1)[1]  # what dfo says after the streamed line
    assert "diagnosis:" in recap and no_control(recap + launch.stderr), repr(recap)


@on_testbed
def test_package_versions_from_the_node_are_text(henv: Env) -> None:
    e, node = henv, henv.node.name
    venv = f"{e.ws}/venv"
    version = "1.0[/x]\x1b]0;t\x07"
    e.node_sh(f"python3 -m venv --without-pip {venv} && sp=$({venv}/bin/python -c "
              "'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])') && mkdir -p $sp/evil_pkg-1.0.dist-info "
              f"&& printf 'Metadata-Version: 2.1\\nName: evil-pkg\\nVersion: %s\\n' {shlex.quote(version)} "
              "> $sp/evil_pkg-1.0.dist-info/METADATA")
    job, _ = e.write_job({"venv": venv, "packages": ["evil-pkg"]})
    r = e.cli("verify-env", "-H", node, "-j", str(job))
    out = r.stdout + r.stderr
    assert r.returncode in (0, 3), out
    assert "evil-pkg" in r.stdout and "1.0[/x]\\x1b]0;t\\x07" in r.stdout
    assert no_control(out), repr(out)


def test_error_text_is_cleaned(capfd: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli_common import clean, report_error, safe
    from orchestrator.errors import DfoError

    report_error(DfoError(f"node said [/x] {EVIL}", host="n1", hint="do [bold]this[/]\x07"))
    err = capfd.readouterr().err
    assert no_control(err) and "[/x]" in err and "do [bold]this[/]\\x07" in err, repr(err)
    assert err.splitlines()[1].startswith("  do ")  # the hint keeps its own line
    assert clean("a\tb\r\x9b\u202e") == "a\\tb\\r\\x9b\\u202e"
    assert safe("[/x]\\") == "\\[/x]\\\\"


# ------------------------------------------------------------------------- 18: smaller things


def test_unresolvable_host_name_gets_a_hint(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text("defaults: {user: root, connect_timeout: 3}\nhosts:\n  gpu: {host: no-such-node.invalid}\n")
    r = run_dfo(inv, "status", "-H", "gpu")
    assert r.returncode == 4, r.stderr
    assert "no-such-node.invalid" in r.stderr and "does not resolve" in r.stderr
    assert "~/.ssh/config" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(("text", "line"), [
    ('name: x\nrun:\n  command: "echo hi\n  wait: 3\n\n', 3),   # a quote never closed
    ("name: x\nrun:\n  command: echo\n  upload: [a.py\n  wait: 3\n\n\n", 4),  # a [ never closed
    ("name: x\nrun: {command: x\n\n  wait: 3\n", 2),  # a { never closed
    ("name: x\n  bad: 1\nrun: {}\n", 2),  # the fault is where the parser stopped
    ("name: x\nrun:\n\tcommand: x\n", 3),
])
def test_yaml_syntax_error_names_the_line_of_the_fault(tmp_path: Path, text: str, line: int) -> None:
    p = tmp_path / "job.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_job(p)
    assert ei.value.message.startswith(f"{p}:{line}: not valid YAML"), ei.value.message
    assert ei.value.exit_code == 2


def _no_aws(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in cli_env().items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp / "none"), AWS_CONFIG_FILE=str(tmp / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    return env


@on_testbed
def test_up_without_s3_credentials_says_so_before_any_step(henv: Env) -> None:
    e, node = henv, henv.node.name
    job, _ = e.write_job({"s3": {"endpoint_url": e.tb.s3.url},
                          "data": {"source": "s3://dfo-none/x/", "dest": f"{e.ws}/data"},
                          "run": {"command": "true"}})
    for cmd in (["up"], ["sync-data"]):
        r = e.cli(*cmd, "-H", node, "-j", str(job), env=_no_aws(e.tmp))
        assert r.returncode == 2, r.stderr
        assert "no S3 credentials found" in r.stderr and "AWS_ACCESS_KEY_ID" in r.stderr, r.stderr
        assert "s3.credentials: anonymous" in r.stderr
        assert "==> provision" not in r.stderr  # no step ran
    # a public bucket: asked for explicitly, the requests go unsigned (this server refuses them)
    job, _ = e.write_job({"s3": {"endpoint_url": e.tb.s3.url, "credentials": "anonymous"},
                          "data": {"source": "s3://dfo-none/x/", "dest": f"{e.ws}/data"}})
    r = e.cli("sync-data", "-H", node, "-j", str(job), env=_no_aws(e.tmp))
    assert r.returncode == 3 and "no S3 credentials" not in r.stderr, r.stderr


def test_every_command_help_lists_exit_codes() -> None:
    for name in ["verify-env", "stage-model", "sync-data", "launch", "tail", "status", "stop", "up"]:
        res = CliRunner().invoke(cli, [name, "--help"])
        assert res.exit_code == 0
        assert "Exit codes:" in res.output, name


# ------------------------------------------------------------------------- 21 + 18: pipes


@on_testbed
def test_piped_output_neither_wraps_nor_pads(henv: Env) -> None:
    e, node = henv, henv.node.name
    name = "hz-long-" + "n" * 90 + "-" + secrets.token_hex(2)  # a run id of about 120 characters
    # the sleep: the first run is still alive when launch looks (wait 0), so it prints the hints checked below;
    # a bare echo could end first (launch then says "succeeded" and gives none)
    job, _ = e.write_job({"run": {"workdir": "/root/runs-test", "command": "echo " + "w" * 150 + "; sleep 3",
                                  "wait": 0}}, name=name)
    launch = e.cli("launch", "-H", node, "-j", str(job))
    assert launch.returncode == 0, launch.stderr
    run = _launch(e, job, "--force")["run"]
    assert len(run) > 110
    _wait_ended(e, run)
    outs = {"launch": launch, "status": e.cli("status", "-H", node), "detail": e.cli("status", "-H", node, run),
            "stop": e.cli("stop", "-H", node, run)}
    for what, r in outs.items():
        assert r.returncode == 0, (what, r.stderr)
        for ln in (r.stdout + r.stderr).splitlines():
            assert ln == ln.rstrip(), (what, repr(ln))  # no padding
    assert any(run in ln for ln in outs["status"].stdout.splitlines())
    detail = outs["detail"].stdout.splitlines()
    assert any(ln.startswith("run dir") and ln.endswith(f"{e.ws}/.dfo/runs/{run}") for ln in detail), detail
    assert any(ln.endswith("w" * 150) for ln in detail)  # the last line, whole
    assert any(run in ln for ln in outs["stop"].stdout.splitlines())
    first = _launched_run(launch.stdout)  # the first run's id, on the launch line, whole
    assert first.startswith(name) and len(first) == len(run), launch.stdout
    assert any(f"-j {job} {first}" in ln for ln in launch.stdout.splitlines()), launch.stdout  # hints, whole


# ------------------------------------------------------------------------- 19: hints that work


@on_testbed
def test_printed_commands_work_when_pasted(henv: Env) -> None:
    e, node = henv, henv.node.name
    # a job-level workspace: its runs are not where the host's workspace says
    job, name = e.write_job({"workspace": f"{e.ws}/jobws", "venv": f"{e.ws}/venv",  # up provisions it
                             "run": {"workdir": "/root/runs-test", "command": "sleep 60", "wait": 1}})
    r = e.cli("launch", "-H", node, "-j", str(job))
    assert r.returncode == 0, r.stderr
    hints = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in r.stdout.splitlines()
             if ln.strip().startswith(("follow:", "status:", "stop:"))}
    assert set(hints) == {"follow", "status", "stop"}, r.stdout
    for cmd in hints.values():
        assert f"-i {e.inv}" in cmd and f"-j {job}" in cmd, cmd
    again = e.cli("launch", "-H", node, "-j", str(job))  # refused: the job runs; the hint reaches that run
    assert again.returncode == 2 and f"-i {e.inv} tail -H {node} -j {job}" in again.stderr, again.stderr
    st = e.cli(*pasted(hints["status"]))
    assert st.returncode == 0 and "running" in st.stdout, st.stdout + st.stderr
    follow = dfo_popen(None, *pasted(hints["follow"]), env=cli_env())
    time.sleep(3)
    assert follow.poll() is None  # it found the run and follows it
    sp = e.cli(*pasted(hints["stop"]))
    assert sp.returncode == 0 and "stopped" in sp.stdout, sp.stdout + sp.stderr
    _, ferr = follow.communicate(timeout=60)
    assert follow.returncode == 5 and "stopped" in ferr, ferr
    # up prints the same
    up = e.cli("up", "-H", node, "-j", str(job), "--no-tail")
    assert up.returncode == 0, up.stderr
    assert f"-i {e.inv} tail -H {node}" in up.stdout and f"-j {job}" in up.stdout, up.stdout
    e.cli("stop", "-H", node, "-j", str(job), _launched_run(up.stdout), "--grace", "0")


def _launched_run(out: str) -> str:
    m = re.search(r"started run (\S+)", out)
    assert m, out
    return m.group(1)


@on_testbed
def test_tail_without_a_run_says_which_run_it_follows(henv: Env) -> None:
    e, node = henv, henv.node.name
    first, name1 = e.write_job({"run": {"workdir": "/root/runs-test", "command": "echo one", "wait": 0}})
    second, name2 = e.write_job({"run": {"workdir": "/root/runs-test", "command": "echo two", "wait": 0}})
    run1 = _launch(e, first)["run"]
    _wait_ended(e, run1)
    time.sleep(1.1)  # run ids and start times are per second
    run2 = _launch(e, second)["run"]
    _wait_ended(e, run2)
    r = e.cli("tail", "-H", node)  # no RUN, no -j: the newest run of any job, and it says which
    assert r.returncode == 0 and r.stdout == "two\n", r.stdout + r.stderr
    assert f"run {run2}" in r.stderr and f"job {name2}" in r.stderr and "newest" in r.stderr, r.stderr
    r = e.cli("tail", "-H", node, "-j", str(first), "--no-follow")  # with -j: that job's newest
    assert r.returncode == 0 and r.stdout == "one\n", r.stdout + r.stderr
    assert f"run {run1}" in r.stderr, r.stderr


@on_testbed
def test_verify_env_hint_names_the_job_file_given(henv: Env) -> None:
    e, node = henv, henv.node.name
    job, name = e.write_job({"venv": f"{e.ws}/no-venv"})
    r = e.cli("verify-env", "-H", node, "-j", str(job))
    assert r.returncode == 3, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "does not exist" in ln)
    cmd = line.split("run: ", 1)[1]
    assert pasted(cmd) == ["-i", str(e.inv), "provision", "-H", node, "-j", str(job)], cmd


# ------------------------------------------------------------------------- 20: up checks first


@on_testbed
def test_up_checks_the_whole_job_before_its_first_step(henv: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    e, node = henv, henv.node.name
    (e.tmp / "pkg").mkdir()
    (e.tmp / "pkg" / "a.py").write_text("")
    (e.tmp / "train.py").write_text("")
    cases = [
        ({"upload": ["train.py", "pkg"]}, ["is a folder", "code:", "pkg"]),
        ({"upload": ["missing.py"]}, ["missing.py", "does not exist", "relative to the job file"]),
        ({"command": "python3 train.py {nope}"}, ["unknown placeholder {nope}"]),
        ({"secret_env": ["HZ_UNSET_SECRET"]}, ["HZ_UNSET_SECRET is not set"]),
    ]
    for run, words in cases:
        job, _ = e.write_job({"run": {"workdir": "/root/runs-test", "command": "python3 train.py", **run}})
        r = e.cli("up", "-H", node, "-j", str(job))
        assert r.returncode == 2, (run, r.stderr)
        for w in words:
            assert w in r.stderr, (w, r.stderr)
        assert "==> provision" not in r.stderr, r.stderr
    job, _ = e.write_job({"run": {"workdir": "/root/runs-test", "command": "true", "upload": ["pkg"]}})
    r = e.cli("launch", "-H", node, "-j", str(job))
    assert r.returncode == 2 and "is a folder" in r.stderr, r.stderr
