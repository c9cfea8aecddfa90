"""The tree's layout (issue 21): the import graph has no circle and no arrow up a layer, nothing names
a module by its old place, one table names the node's entry modules, and the agent bundle carries
every file the node needs."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _importgraph():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("importgraph", ROOT / "scripts" / "importgraph.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["importgraph"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_import_graph_has_no_circle_and_no_arrow_up_a_layer() -> None:
    ig = _importgraph()
    s = ig.summary(ig.build(ROOT))
    assert s["modules"] > 90, s["modules"]  # it did find the tree
    assert s["circles"] == [], ig.text(ig.build(ROOT))
    assert s["upward"] == [], s["upward"]  # steps/ never imports commands/ or the CLI; remote/ never orchestrator/
    assert s["unplaced"] == [], "give each new module a layer in scripts/importgraph.py LAYERS"


def test_importgraph_finds_a_circle_and_an_upward_arrow(tmp_path: Path) -> None:
    """The check can fail: a tree with both."""
    ig = _importgraph()
    for pkg in ("orchestrator", "orchestrator/steps", "orchestrator/commands", "remote"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "orchestrator/steps/a.py").write_text("from . import b\nfrom ..commands import c\n")
    (tmp_path / "orchestrator/steps/b.py").write_text("def f():\n    from .a import x\n")
    (tmp_path / "orchestrator/commands/c.py").write_text("")
    s = ig.summary(ig.build(tmp_path))
    assert s["circles"] == [["orchestrator.steps.a", "orchestrator.steps.b"]]
    assert [u.split(" (")[0] for u in s["upward"]] == ["orchestrator.steps.a -> orchestrator.commands.c"]
    dot = ig.dot(ig.build(tmp_path), packages=False)
    assert dot.startswith("digraph") and '"orchestrator.steps.a" -> "orchestrator.commands.c" [color=red' in dot


def test_nothing_names_a_module_by_its_old_place() -> None:
    """scripts/relayout.py --check: every module moved, no import, module name or path left in old terms."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "relayout.py"), "--check"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_agent_bundle_carries_every_node_file() -> None:
    from orchestrator.agent import bundle

    with tarfile.open(fileobj=io.BytesIO(bundle()[1]), mode="r:gz") as tar:
        names = set(tar.getnames())
    want = {p.relative_to(ROOT).as_posix() for p in (ROOT / "remote").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".json")}
    assert want - names == set()
    assert {"remote/env/known_bad.json", "remote/runs/__main__.py", "remote/gang/__main__.py",
            "remote/_vendor/packaging/version.py"} <= names


def _runnable(module: str) -> bool:
    """``python3 -m module`` runs something: a module with a __main__ guard, or a package's __main__.py."""
    path = ROOT.joinpath(*module.split("."))
    if (path / "__main__.py").is_file():
        return True
    f = path.with_suffix(".py")
    return f.is_file() and 'if __name__ == "__main__":' in f.read_text()


def test_one_table_names_the_node_entry_modules() -> None:
    """agent.NODE lists what the controller runs on the node; orchestrator/ names no remote module in a
    string anywhere else, and every entry runs with python3 -m."""
    import ast
    import dataclasses

    from orchestrator.agent import NODE

    entries = dataclasses.asdict(NODE)
    assert len(set(entries.values())) == len(entries)
    assert [m for m in entries.values() if not _runnable(m)] == []
    named = []
    for p in sorted((ROOT / "orchestrator").rglob("*.py")):
        if p.name == "agent.py" or "demo" in p.relative_to(ROOT).parts[1:2]:
            continue
        tree = ast.parse(p.read_text())
        docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        named += [f"{p.relative_to(ROOT)}:{n.lineno}: {n.value}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
                  and n.value.startswith("remote.") and n.value.replace(".", "").replace("_", "").isalnum()]
    assert named == [], "name node modules through agent.NODE"


def test_every_module_the_node_starts_itself_runs() -> None:
    """remote/ starts some modules itself (the supervisor, the shipper, pkgcheck in a venv): each
    ``[python, "-m", "remote.X", ...]`` there names a runnable module."""
    import ast

    started = []
    for p in sorted((ROOT / "remote").rglob("*.py")):
        if "_vendor" in p.parts:
            continue
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, (ast.List, ast.Tuple)):
                vals = [e.value if isinstance(e, ast.Constant) else None for e in n.elts]
                started += [(p.name, v) for a, v in zip(vals, vals[1:], strict=False)
                            if a == "-m" and isinstance(v, str) and v.startswith("remote.")]
    assert {m for _, m in started} >= {"remote.runs.supervisor", "remote.ship.shipper", "remote.env.pkgcheck"}
    assert [s for s in started if not _runnable(s[1])] == []
