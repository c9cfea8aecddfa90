"""The event envelope (issue 21, item 2): every event a node module prints is ``{"kind": NAME, ...}``
with NAME from the one vocabulary, ``remote._proto.EVENTS``; an event without a kind can neither be
written on the node nor reach a step on the controller. No testbed: node modules run here."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator import agent
from orchestrator.config.models import ResolvedHost
from orchestrator.transport.base import Result
from remote import _proto

ROOT = Path(__file__).resolve().parents[1]
REMOTE = ROOT / "remote"


def _remote_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of remote/ but the vendored packaging."""
    out = {}
    for p in sorted(REMOTE.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if "_vendor" in rel.parts:
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


class _Calls(ast.NodeVisitor):
    """Every call in a module, with the class and function it sits in."""

    def __init__(self) -> None:
        self.scope: list[ast.AST] = []
        self.calls: list[tuple[ast.Call, ast.ClassDef | None, ast.FunctionDef | None]] = []

    def _enter(self, node: ast.AST) -> None:
        self.scope.append(node)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        cls = next((s for s in reversed(self.scope) if isinstance(s, ast.ClassDef)), None)
        fn = next((s for s in reversed(self.scope) if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef)), None)
        self.calls.append((node, cls, fn))  # type: ignore[arg-type]
        self.generic_visit(node)


def _imports(tree: ast.Module, module: str) -> set[str]:
    """The names this module binds from ``module`` (``from module import name``)."""
    return {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == module
            for a in n.names}


def _kinds_of(expr: ast.expr) -> list[str] | None:
    """The kinds a call's first argument can be: a string literal, or a choice between literals."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return [expr.value]
    if isinstance(expr, ast.IfExp):
        a, b = _kinds_of(expr.body), _kinds_of(expr.orelse)
        return a + b if a is not None and b is not None else None
    return None


def _sends() -> tuple[dict[str, list[str]], list[str]]:
    """Every kind sent from remote/ (kind -> where), and the call sites that send no known kind.

    Starts from ``emit_event``; a function that passes its own first parameter on as the kind (exec's
    ``send``, sync's ``Progress.emit``) is a forwarder, and its callers are checked the same way."""
    files = _remote_files()
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in files.items()}
    visits = {}
    for m, tree in trees.items():
        v = _Calls()
        v.visit(tree)
        visits[m] = v
    todo: list[tuple[str, str | None, str]] = [("remote._proto", None, "emit_event")]  # (module, class, name)
    seen: set[tuple[str, str | None, str]] = set()
    sent: dict[str, list[str]] = {}
    bad: list[str] = []
    while todo:
        spec = todo.pop()
        if spec in seen:
            continue
        seen.add(spec)
        home, cls_name, name = spec
        for m, v in visits.items():
            bound = _imports(trees[m], home)
            if m != home and (cls_name or name) not in bound:
                continue  # neither defines nor imports it
            for call, cls, fn in v.calls:
                f = call.func
                hit = (isinstance(f, ast.Attribute) and f.attr == name) if cls_name else \
                    (isinstance(f, ast.Name) and f.id == name)
                if not hit or (fn is not None and fn.name == name and (cls.name if cls else None) == cls_name):
                    continue  # not a call of it, or the forwarder's own body (checked through its callers)
                where = f"{files[m].relative_to(ROOT)}:{call.lineno}"
                if not call.args or isinstance(call.args[0], ast.Starred) \
                        or any(k.arg == "kind" for k in call.keywords):
                    bad.append(f"{where}: no kind as the first argument")
                    continue
                kinds = _kinds_of(call.args[0])
                if kinds is not None:
                    for k in kinds:
                        sent.setdefault(k, []).append(where)
                    continue
                first = call.args[0]
                params = [a.arg for a in fn.args.args] if fn is not None else []
                params = params[1:] if cls is not None and params[:1] == ["self"] else params
                if isinstance(first, ast.Name) and params[:1] == [first.id]:
                    todo.append((m, cls.name if cls else None, fn.name))  # type: ignore[union-attr]
                    continue
                bad.append(f"{where}: the kind is not a literal from EVENTS ({ast.unparse(first)})")
    return sent, bad


def test_every_event_sent_from_remote_has_a_documented_kind() -> None:
    sent, bad = _sends()
    assert bad == []
    unknown = {k: w for k, w in sent.items() if k not in _proto.EVENTS}
    assert unknown == {}, "kinds not in remote/_proto.py EVENTS"
    assert set(_proto.EVENTS) - set(sent) == set(), "documented kinds that nothing sends (stale)"
    # the forwarders were found, so their callers were checked: exec's ticks and sync's progress
    assert {"tick", "stdout", "stderr", "plan", "progress"} <= set(sent)


def test_no_module_writes_an_event_frame_but_emit_event() -> None:
    for m, p in _remote_files().items():
        if m == "remote._proto":
            continue
        text = p.read_text()
        assert "@@DFO-EVENT@@" not in text and "EVENT_PREFIX" not in text and "_write(" not in text, p


def test_a_frame_without_a_known_kind_cannot_be_written(capsys: pytest.CaptureFixture[str]) -> None:
    emit: Any = _proto.emit_event
    with pytest.raises(TypeError):
        emit()  # no kind at all
    with pytest.raises(TypeError, match="unknown event kind 'nope'"):
        emit("nope", x=1)
    with pytest.raises(TypeError):
        emit("hb", kind="chunk")  # a field cannot overwrite the kind
    with pytest.raises(TypeError):
        emit({"hb": 3})  # the old style, a bare dict
    assert capsys.readouterr().out == ""  # nothing half-written
    _proto.emit_event("hb", offset=3)
    assert capsys.readouterr().out == '@@DFO-EVENT@@ {"kind":"hb","offset":3}\n'


class _Conn:
    """Answers run_module's call with the given lines, fed to its on_line as a transport would."""

    def __init__(self, lines: list[str]) -> None:
        self.host = ResolvedHost(name="n1")
        self.name = "n1"
        self.lines = lines

    def run(self, command: str, **kw: Any) -> Result:
        kept = [ln for ln in self.lines if kw["on_line"](ln)]
        return Result("n1", command, "".join(ln + "\n" for ln in kept), "", 0, 0.01)


def test_the_controller_passes_on_only_events_with_a_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "known_parts", lambda conn: set(agent.PARTS))
    monkeypatch.setattr(agent, "_remember", lambda conn, parts: None)
    ev = _proto.EVENT_PREFIX
    conn = _Conn([ev + '{"hb":3}', ev + '{"kind":7}', ev + "[1]", ev + '{"kind":"hb","offset":3}', "banner",
                  ev + "not json", _proto.RESULT_PREFIX + '{"ok":true,"data":1}'])
    got: list[dict[str, Any]] = []
    assert agent.run_module(conn, agent.NODE.runs, {"op": "x"}, on_event=got.append) == 1  # type: ignore[arg-type]
    assert got == [{"kind": "hb", "offset": 3}]


def test_exec_streams_its_output_in_the_envelope(tmp_path: Path) -> None:
    """remote.exec run here as the controller runs it: every event carries a kind from EVENTS."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(ROOT)
    req = {"command": "echo out-line; echo err-line >&2", "timeout": 30}
    r = subprocess.run([sys.executable, "-m", "remote.exec"], input=json.dumps(req).encode(), capture_output=True,
                       timeout=60, env=env, cwd=tmp_path)
    events, result = [], None
    for line in r.stdout.decode().splitlines():
        fr = _proto.split_frame(line)
        if fr and fr[0] == "event":
            events.append(json.loads(fr[1]))
        elif fr:
            result = json.loads(fr[1])
    assert result is not None and result["ok"] and result["data"]["exit"] == 0, r.stdout + r.stderr
    assert events and all(e["kind"] in _proto.EVENTS for e in events)
    assert [ln for e in events if e["kind"] == "stdout" for ln in e["lines"]][-1] == "out-line"
    assert [ln for e in events if e["kind"] == "stderr" for ln in e["lines"]][-1] == "err-line"
