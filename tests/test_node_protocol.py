"""The node protocol (issue 21, item 2): one dispatcher (``_proto.serve``) for every node module with
operations, the request as the first line of stdin with an op's payload after it, ``run_module``
carrying that payload (code push has no transport path of its own), and ``look`` as an op of
remote.runs instead of a ``python -c`` snippet. No testbed: node modules run here as subprocesses."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator import agent
from orchestrator.config.models import ResolvedHost
from orchestrator.transport.base import Result
from remote import _proto
from remote._proto import split_frame

ROOT = Path(__file__).resolve().parents[1]
OP_MODULES = {"remote.runs": "remote/runs/ops.py", "remote.gang": "remote/gang/ops.py",
              "remote.files.push": "remote/files/push.py", "remote.files.pull": "remote/files/pull.py"}


def _node(module: str, stdin: bytes | str, cwd: Path = ROOT) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``python3 -m module`` here with ``stdin``: (the result document, the events)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-m", module], input=stdin if isinstance(stdin, bytes) else stdin.encode(),
                       capture_output=True, timeout=60, env=env, cwd=cwd)
    events, result = [], None
    for line in r.stdout.decode().splitlines():
        fr = split_frame(line)
        if fr and fr[0] == "result":
            result = json.loads(fr[1])
        elif fr:
            events.append(json.loads(fr[1]))
    assert result is not None, r.stdout.decode() + r.stderr.decode()
    return result, events


@pytest.mark.parametrize("module", sorted(OP_MODULES))
def test_every_op_module_answers_an_unknown_op_the_same_way(module: str) -> None:
    doc, _ = _node(module, json.dumps({"op": "no-such-op"}))
    assert doc["ok"] is False and doc["error"]["kind"] == "usage"
    assert doc["error"]["message"].startswith("unknown op 'no-such-op' (this module knows: ")


def test_one_dispatcher_serves_every_op_module() -> None:
    """Each module with ops hands an OPS table to _proto.serve; none reads req["op"] itself."""
    for module, path in OP_MODULES.items():
        text = (ROOT / path).read_text()
        assert "serve(OPS)" in text, module
        tree = ast.parse(text)
        own = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Compare) and isinstance(n.left, ast.Name)
               and n.left.id == "op"]
        assert own == [], f"{path}: a hand-written op dispatcher at lines {own}"
    runs = (ROOT / "remote/runs/__init__.py").read_text()  # its entry(): python3 -m remote.runs, or the -c launch
    assert "serve(OPS)" in runs and "entry()" in (ROOT / "remote/runs/__main__.py").read_text()
    assert "serve(OPS)" in (ROOT / "remote/gang/__main__.py").read_text()


def test_dispatch_runs_the_named_op_and_names_the_known_ones() -> None:
    ops = {"b": lambda req: req["x"] + 1, "a": lambda req: 0}
    assert _proto.dispatch(ops, {"op": "b", "x": 41}) == 42
    with pytest.raises(_proto.RemoteError) as ei:
        _proto.dispatch(ops, {})
    assert ei.value.kind == "usage" and ei.value.message == "unknown op None (this module knows: a, b)"


def test_the_request_is_the_first_line_and_the_payload_follows_it(tmp_path: Path) -> None:
    """Code push through the one protocol: the request line, then the files' bytes."""
    data = b"print('hi')\n\x00\xff binary too\n"
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    dest = tmp_path / "code"
    req = {"op": "sync", "dest": str(dest), "want": "x", "delete": [],
           "files": [{"path": "a/b.py", "sha256": sha, "mode": 0o644, "size": len(data), "link": None}]}
    doc, _ = _node("remote.files.push", json.dumps(req).encode() + b"\n" + data)
    assert doc["ok"] is True, doc
    assert doc["data"]["sent"] == 1 and doc["data"]["bytes"] == len(data)
    assert (dest / "a" / "b.py").read_bytes() == data


class _Conn:
    """Records what run_module sends; answers with one result frame."""

    def __init__(self, *codes: int) -> None:
        self.host = ResolvedHost(name="n1")
        self.name = "n1"
        self.calls: list[tuple[str, Any]] = []
        self.codes = list(codes)

    def run(self, command: str, **kw: Any) -> Result:
        self.calls.append((command, kw.get("stdin")))
        code = self.codes.pop(0) if self.codes else 0
        out = "" if code else _proto.RESULT_PREFIX + json.dumps({"ok": True, "data": {"n": 1}}) + "\n"
        return Result("n1", command, out, "", code, 0.01)


def test_run_module_sends_the_payload_after_the_request_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "known_parts", lambda conn: set(agent.PARTS))  # believed to hold dfo's node code
    monkeypatch.setattr(agent, "_remember", lambda conn, parts: None)
    conn = _Conn(agent.NEED_UPLOAD)  # ...but it lacks it: the call again, the code first on stdin
    got = agent.run_module(conn, agent.NODE.push, {"op": "sync", "dest": "/x"}, payload=b"\x00bytes",
                           flags="-S")  # type: ignore[arg-type]
    assert got == {"n": 1} and len(conn.calls) == 2
    req = json.dumps({"op": "sync", "dest": "/x"}).encode() + b"\n\x00bytes"
    (first, sent1), (again, sent2) = conn.calls
    assert " -S " + agent.launch(agent.NODE.push) in first and bytes(sent1) == req
    assert " -S -c " + shlex.quote(agent._boot_text()) in again and " remote.files.push" in again
    assert bytes(sent2) == agent.bundle("core")[1] + req
    conn = _Conn()
    agent.run_module(conn, agent.NODE.runs, {"op": "status"})  # type: ignore[arg-type]
    assert conn.calls[0][1] == json.dumps({"op": "status"})  # no payload: the request alone, as before


def test_look_is_an_op_of_remote_runs(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "ckpt").write_text("x")
    (tmp_path / "only-dfo" / ".dfo-restore").mkdir(parents=True)
    (tmp_path / "file").write_text("x")
    kinds = {}
    for name in ("missing", "full", "only-dfo", "file"):
        doc, _ = _node("remote.runs", json.dumps({"op": "look", "path": str(tmp_path / name)}))
        assert doc["ok"] is True, doc
        kinds[name] = (doc["data"]["kind"], doc["data"]["path"], doc["data"].get("count"))
    assert kinds == {"missing": ("missing", str(tmp_path / "missing"), None),
                     "full": ("full", str(tmp_path / "full"), 1),
                     "only-dfo": ("empty", str(tmp_path / "only-dfo"), 0),
                     "file": ("notdir", str(tmp_path / "file"), None)}


def test_the_controller_builds_no_python_source_for_the_node() -> None:
    """DESIGN: never build Python source strings to run with ``python -c``; node code is a module."""
    found = []
    for p in sorted((ROOT / "orchestrator").rglob("*.py")):
        if "demo" in p.relative_to(ROOT).parts:
            continue
        if re.search(r"python[^\n]{0,40}[\s\"',]-c[\s\"',]", p.read_text()):
            found.append(p.relative_to(ROOT).as_posix())
    assert found == []
