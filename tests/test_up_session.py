"""Issue 11, boundaries: typed errors, `up` as one session (one SSH connection per host) with --json,
job validation in the models (file:line), and --json as the models' own serialisation."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator import agent
from orchestrator.config.models import ResolvedHost, load_job
from orchestrator.errors import AgentMissing, ConfigError, HostError, NoResult, VerifyError
from orchestrator.steps import transfer
from orchestrator.transport.ssh import Result

# ------------------------------------------------------------------------- typed errors (pure logic)


class FakeConn:
    """A stand-in for Connection.run: answers each call with the next scripted Result (or raises it)."""

    def __init__(self, *answers: Result | Exception) -> None:
        self.host = ResolvedHost(name="n1")
        self.name = "n1"
        self.answers = list(answers)

    def run(self, command: str, **kw: Any) -> Result:
        a = self.answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a


def _res(stdout: str = "", stderr: str = "", code: int = 0) -> Result:
    return Result("n1", "cmd", stdout, stderr, code, 0.1)


def _frame(doc: dict[str, Any]) -> str:
    return agent.RESULT_PREFIX + json.dumps(doc) + "\n"


def test_no_frame_is_a_typed_no_result() -> None:
    with pytest.raises(NoResult) as ei:
        agent.run_module(FakeConn(_res("banner\n", "Killed", 137)), "remote.x")  # type: ignore[arg-type]
    assert ei.value.details is None and "Killed" in ei.value.message


def test_a_failed_upload_is_agent_missing() -> None:
    err = {"kind": "agent", "message": "could not install dfo's node code (core) in D: No space left on device"}
    conn = FakeConn(_res(code=agent.NEED_UPLOAD), _res(_frame({"ok": False, "error": err})))
    with pytest.raises(AgentMissing) as ei:
        agent.run_module(conn, "remote.x")  # type: ignore[arg-type]
    assert "No space left on device" in ei.value.message


def test_the_nodes_error_document_is_a_declared_field() -> None:
    err = {"kind": "verify", "message": "no room", "hint": "free some", "need": 5}
    with pytest.raises(VerifyError) as ei:
        agent.run_module(FakeConn(_res(_frame({"ok": False, "error": err}))), "remote.x")  # type: ignore[arg-type]
    assert ei.value.details == err and ei.value.hint == "free some"


def _xfer(tmp_path: Path, *answers: Result | Exception) -> transfer.TransferReport:
    job = tmp_path / "j.yaml"
    job.write_text(yaml.safe_dump({"name": "j", "data": {"source": "s3://b/p/", "dest": "/workspace/d"}}))
    loaded = load_job(job)
    req = {"source": "s3://b/p/", "dest": "/workspace/d"}
    return transfer.transfer(FakeConn(*answers), loaded, "data", req)  # type: ignore[arg-type]


def test_transfer_tells_errors_apart_by_class_not_by_words(tmp_path: Path) -> None:
    # the node's own "unreachable" (the S3 endpoint) is passed on as it is, even when its text says "lost"
    err = {"kind": "unreachable", "message": "S3 endpoint lost: connection refused"}
    with pytest.raises(HostError) as ei:
        _xfer(tmp_path, _res(_frame({"ok": False, "error": err})))
    assert ei.value.message == err["message"] and ei.value.details == err
    # the link died under the call, whatever its words: the transfer stopped, run it again
    with pytest.raises(HostError) as ei:
        _xfer(tmp_path, HostError("channel closed by peer", host="n1"))
    assert "stopped without a result" in ei.value.message and "run the same command again" in (ei.value.hint or "")
    # no frame at all (a killed process), whatever the node printed
    with pytest.raises(HostError) as ei:
        _xfer(tmp_path, _res("", "something else entirely", 137))
    assert "stopped without a result" in ei.value.message




def test_an_unresolved_name_is_found_under_any_wrapping_not_by_its_words(tmp_path: Path) -> None:
    import socket

    from orchestrator.config.models import Inventory, load_inventory
    from orchestrator.hosts import HostSession

    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  me: {transport: local}\n")
    s = HostSession.from_inventory(*load_inventory(inv), ["me"])
    assert isinstance(s.inventory, Inventory)

    def wrapped(_conn: Any) -> None:  # the resolver's error two levels down, its words gone
        try:
            try:
                raise socket.gaierror(-2, "Name or service not known")
            except socket.gaierror as exc:
                raise OSError("could not open the gateway") from exc
        except OSError:
            raise HostError("cannot connect to gpu-1", host="me") from None

    def words(_conn: Any) -> None:  # words that look like the resolver's, no resolver error
        raise HostError("cannot connect to gpu-1: [Errno -2] quoted from a remote log", host="me")

    err = s.each(wrapped)[0].error
    assert err is not None and "does not resolve" in err.message and "DNS" in (err.hint or "")
    err = s.each(words)[0].error
    assert err is not None and "does not resolve" not in err.message and err.hint is None


# ------------------------------------------------------------------------- job rules in the models: FILE:LINE

_JOB_ERRORS = [  # (the job's text, the line at fault, the field, words of the message)
    ("name: j\npackages:\n  - torch==2.1\n  - faketriton>=3.*\n", 4, "packages.1", "not a valid package spec"),
    ("name: j\noverrides:\n  - {package: triton, reason: fixes}\n", 3, "overrides.0.package", "names no version"),
    ("name: j\nindex:\n  extra_urls: ['https://u:IDXSECRET@h/simple  x']\n", 3, "index.extra_urls.0",
     "'https://***@h/simple  x' contains whitespace"),
    ("name: j\ndata:\n  source: gs://b/x\n  dest: /d\n", 3, "data.source", "is not s3://bucket/prefix/"),
    ("name: j\ndata:\n  source: s3:///x\n  dest: /d\n", 3, "data.source", "names no bucket"),
    ("name: j\nmodel:\n  source: /m\n  dest: rel/dir\n", 4, "model.dest", "must be an absolute path"),
    ("name: j\nmodel:\n  source: hf://just-a-name\n  dest: /d\n", 3, "model.source", "expected hf://org/name"),
    ("name: j\nrun:\n  command: python3 t.py {nope}\n", 3, "run.command", "unknown placeholder {nope}"),
    ("name: j\nrun:\n  command: python3 t.py {data.dest}\n", 2, "run", "no 'data:' section"),
    ("name: j\nrun:\n  upload: [a/t.py, b/t.py]\n  command: x\n", 3, "run.upload", "would both land as t.py"),
]


@pytest.mark.parametrize("text,line,field,words", _JOB_ERRORS)
def test_job_rules_are_model_errors_with_file_and_line(tmp_path: Path, text: str, line: int, field: str,
                                                       words: str) -> None:
    job = tmp_path / "j.yaml"
    job.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_job(job)
    assert ei.value.message.startswith(f"{job}:{line}: {field}: "), ei.value.message
    assert words in ei.value.message and "SECRET" not in ei.value.render()


def test_a_missing_upload_names_its_line(tmp_path: Path) -> None:
    from orchestrator.commands.preflight import check_run

    (tmp_path / "here.py").write_text("")
    job = tmp_path / "j.yaml"
    job.write_text("name: j\nrun:\n  command: x\n  upload:\n    - here.py\n    - gone.py\n")
    with pytest.raises(ConfigError) as ei:
        check_run(load_job(job))
    assert ei.value.message.startswith(f"{job.resolve()}:6: run.upload.1: 'gone.py' does not exist")


# ------------------------------------------------------------------------- up: one session, --json (testbed)

from orchestrator.testbed import Testbed  # noqa: E402
from tests._runs_fixtures import COUNTER  # noqa: E402
from tests._s3_fixtures import Xfer, random_files, upload  # noqa: E402


@pytest.fixture
def upx(testbed: Testbed, tmp_path: Path) -> Any:
    x = Xfer(testbed, tmp_path)
    yield x
    x.sh(f"rm -rf {x.base} {x.shm}", check=False)


def _accepted(tb: Testbed, node: str) -> int:
    """SSH logins the node's sshd accepted so far (its own log, LogLevel VERBOSE)."""
    return (tb.workdir / node / "sshd.log").read_text(errors="replace").count("Accepted publickey")


def _up_job(x: Xfer, code: int = 0) -> Path:
    (x.tmp / "counter.py").write_text(COUNTER)
    ds = upload(x.tb, "up-" + x.id, "d/", random_files(3, 2048, "f{i}.bin"))
    job = x.job(data={"source": ds.source, "dest": f"{x.base}/data"},
                model={"source": ds.source, "dest": f"{x.shm}/model"}, name=f"up{code}")
    doc = yaml.safe_load(job.read_text())
    doc.update({"venv": f"{x.base}/venv", "workspace": x.base,
                "run": {"workdir": f"{x.base}/w", "upload": ["counter.py"], "wait": 0,
                        "command": f"{{python}} counter.py 3 0.05 {code}"}})
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    return job


@pytest.mark.testbed
def test_up_json_is_one_document_over_one_connection_per_host(upx: Xfer) -> None:
    x, node = upx, upx.node.name
    job = _up_job(x)
    # a control folder of its own (short, for the socket's 107 bytes): no shared connection an earlier test
    # of this process left open may stand in for the one it counts
    run_dir = Path(tempfile.mkdtemp(prefix="dfo-rt-"))
    before = _accepted(x.tb, node)
    try:
        r = x.dfo("up", "-H", node, "-j", str(job), "--json", timeout=300,
                  env={**x.env(), "XDG_RUNTIME_DIR": str(run_dir)})
    finally:
        for sock in (p for p in run_dir.rglob("*") if p.is_socket()):  # the shared connection it left: ended
            subprocess.run(["ssh", "-S", str(sock), "-O", "exit", "node"], capture_output=True, timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)
    assert _accepted(x.tb, node) - before == 1, r.stderr  # provision, agent upload, transfers, launch, tail: one
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # stdout is the document and nothing else
    assert doc["exit_code"] == 0 and doc["stopped_at"] is None and list(doc["hosts"]) == [node]
    h = doc["hosts"][node]
    assert h["provision"]["ok"] is True and {s["name"] for s in h["provision"]["steps"]} >= {"workspace", "venv"}
    for step in ("stage_model", "sync_data"):
        assert h[step]["ok"] is True and h[step]["fetched"] == 3 and h[step]["status"] == "done", h[step]
    assert h["launch"]["run"] == h["run"]["id"] and h["launch"]["pid"] > 0
    assert h["run"]["state"] == "succeeded" and h["run"]["exit_code"] == 0
    assert h["run"]["last_lines"] == ["line 000000", "line 000001", "line 000002"]
    assert "line 000000" not in r.stderr  # the log is in the document, not printed
    for banner in ("==> provision", "==> stage-model", "==> sync-data", "==> launch", "==> tail"):
        assert banner in r.stderr
    # the same documents as each command's own --json for that host
    for command, step in (("sync-data", "sync_data"), ("stage-model", "stage_model")):
        own = json.loads(x.dfo(command, "-H", node, "-j", str(job), "--json").stdout)["hosts"][node]
        assert set(own) == set(h[step]) and own["status"] == "no change"
    prov = json.loads(x.dfo("provision", "-H", node, "-j", str(job), "--json").stdout)["hosts"][node]
    assert set(prov) == set(h["provision"])

    # again, human output: every step has nothing to do; still one connection (or none: the OpenSSH transport's
    # shared connection from the commands just before, defaults.ssh_persist)
    before = _accepted(x.tb, node)
    r = x.dfo("up", "-H", node, "-j", str(job), timeout=300)
    assert _accepted(x.tb, node) - before in (0, 1), r.stderr
    assert r.returncode == 0, r.stderr
    assert f"{node}: sync-data: no change: 3 files" in r.stdout and f"{node}: stage-model: no change" in r.stdout
    assert r.stdout.endswith("line 000000\nline 000001\nline 000002\n"), r.stdout
    assert "succeeded" in r.stderr and "up: finished in" in r.stderr


@pytest.mark.testbed
def test_up_json_of_a_failing_run_and_a_stopped_chain(upx: Xfer) -> None:
    x, node = upx, upx.node.name
    job = _up_job(x, code=3)
    r = x.dfo("up", "-H", node, "-j", str(job), "--json", timeout=300)
    assert r.returncode == 5, r.stderr
    doc = json.loads(r.stdout)
    run = doc["hosts"][node]["run"]
    assert doc["exit_code"] == 5 and run["state"] == "failed" and run["exit_code"] == 3 and len(run["last_lines"]) == 3
    # no S3 bucket: the chain stops at the transfer; later steps are null
    bad = yaml.safe_load(job.read_text())
    bad["model"]["source"] = "s3://no-such-bucket-dfo-up/x/"
    job.write_text(yaml.safe_dump(bad))
    r = x.dfo("up", "-H", node, "-j", str(job), "--json", timeout=300)
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)
    h = doc["hosts"][node]
    assert doc["stopped_at"] == "stage-model" and doc["exit_code"] == 3
    assert h["provision"]["ok"] is True and h["stage_model"]["ok"] is False
    assert h["stage_model"]["error"]["kind"] == "verify"
    assert h["sync_data"] is None and h["launch"] is None and h["run"] is None


@pytest.mark.testbed
def test_up_on_two_hosts_opens_one_connection_each(testbed2: Testbed, tmp_path: Path) -> None:
    from tests._runs_fixtures import dfo, inventory_copy

    inv = inventory_copy(testbed2, tmp_path)
    (tmp_path / "counter.py").write_text(COUNTER)
    ws = f"/workspace/up2-{tmp_path.name[-8:]}"
    job = tmp_path / "two.yaml"
    job.write_text(yaml.safe_dump({"name": "two", "venv": f"{ws}/venv", "workspace": ws, "run": {
        "workdir": f"{ws}/w", "upload": ["counter.py"], "wait": 0, "command": "{python} counter.py 2 0.05"}}))
    names = [n.name for n in testbed2.nodes]
    before = {n: _accepted(testbed2, n) for n in names}
    r = dfo(inv, "up", "-H", "testbed", "-j", str(job), timeout=300)
    assert {n: _accepted(testbed2, n) - before[n] for n in names} == {n: 1 for n in names}, r.stderr
    assert r.returncode == 0, r.stderr
    for n in names:  # several hosts: each log line with its host
        assert f"[{n}] line 000001" in r.stdout and f"{n}: provisioned" in r.stdout
    for n in testbed2.nodes:
        testbed2.node_exec(n, f"rm -rf {ws}")
