"""Issue 11, boundaries: typed errors, `up` as one session (one SSH connection per host) with --json,
job validation in the models (file:line), and --json as the models' own serialisation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator import agent
from orchestrator.config import ResolvedHost, load_job
from orchestrator.connection import Result
from orchestrator.errors import AgentMissing, HostError, NoResult, VerifyError
from orchestrator.steps import transfer

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
    conn = FakeConn(_res(code=agent.NEED_UPLOAD), _res(stderr="tar: not found", code=127))
    with pytest.raises(AgentMissing) as ei:
        agent.run_module(conn, "remote.x")  # type: ignore[arg-type]
    assert "tar: not found" in ei.value.message


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
