"""dfo's node code on the node: two parts (core, vendor), each sent only to the commands that need it,
in the same command as the first call (remote/_boot.py), checked against its sha256 before it is
installed, and sent again when the node lost it."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from orchestrator import agent
from orchestrator.config.models import ResolvedHost
from orchestrator.errors import AgentMissing
from orchestrator.testbed import Testbed
from orchestrator.transport.base import Result
from remote import _proto

ROOT = Path(__file__).resolve().parent.parent


def _names(part: str | None) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(agent.bundle(part)[1]), mode="r:gz") as tar:
        return set(tar.getnames())


def test_the_parts_add_up_to_every_node_file_and_core_holds_no_packaging() -> None:
    core, vendor = _names("core"), _names("vendor")
    assert core & vendor == set()
    assert core | vendor == _names(None)
    want = {p.relative_to(ROOT).as_posix() for p in (ROOT / "remote").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".json")}
    assert want - (core | vendor) == set()
    assert not any(n.startswith("remote/_vendor/packaging/") for n in core)
    assert {"remote/_boot.py", "remote/_proto.py", "remote/files/push.py", "remote/env/known_bad.json"} <= core
    assert {"remote/_vendor/packaging/version.py", "remote/_vendor/packaging/LICENSE"} <= vendor
    assert all(n.startswith("remote/_vendor/packaging/") for n in vendor)
    sizes = agent.bundle_sizes()
    assert sizes["core"] < len(agent.bundle(None)[1]) and sizes["core"] == len(agent.bundle("core")[1])


def _imports(path: Path, every: bool = False) -> set[str]:
    """remote.* modules (``every``: all modules) a file imports (anywhere in it) or starts with ``-m`` (a list
    [.., "-m", "remote.X"])."""
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if every or a.name.startswith("remote")}
        elif isinstance(n, ast.ImportFrom) and n.module and (every or n.module.startswith("remote")) and not n.level:
            out.add(n.module)
            out |= {f"{n.module}.{a.name}" for a in n.names}
        elif isinstance(n, (ast.List, ast.Tuple)):
            vals = [e.value if isinstance(e, ast.Constant) else None for e in n.elts]
            out |= {v for a, v in zip(vals, vals[1:], strict=False)
                    if a == "-m" and isinstance(v, str) and v.startswith("remote.")}
    return out


def _file_of(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _reached(entry: str, every: bool = False) -> set[str]:
    """Every module name an entry module's code imports, or starts with -m, transitively (from its source)."""
    seen: set[str] = set()
    todo = [entry, entry + ".__main__"]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # a package's __init__ runs first
        f = _file_of(m)
        if f is not None:
            todo += sorted(_imports(f, every))
    return seen


def _reaches_vendor(entry: str) -> bool:
    return any(m.startswith("remote._vendor") for m in _reached(entry))


def test_the_modules_run_without_site_need_only_the_standard_library() -> None:
    """agent.SITE_FREE runs with python -S (no site-packages): nothing they reach may live there."""
    def outside(entry: str) -> list[str]:
        tops = {m.split(".")[0] for m in _reached(entry, every=True)}
        return sorted(tops - set(sys.stdlib_module_names) - {"remote"})

    for entry in agent.SITE_FREE:
        assert outside(entry) == [], f"{entry} reaches {outside(entry)}: not a module for python -S"
    assert outside(agent.NODE.stage) == ["huggingface_hub"], "the check sees stage-model's import of site-packages"


def test_vendor_users_are_exactly_the_entry_modules_that_reach_packaging() -> None:
    entries = set(dataclasses.asdict(agent.NODE).values())
    reach = {m for m in entries if _reaches_vendor(m)}
    assert reach == set(agent.VENDOR_USERS), "update agent.VENDOR_USERS: these entry modules reach packaging"
    assert {agent.NODE.provision, agent.NODE.pkgcheck} <= reach  # the check itself sees imports
    assert agent.parts_for(agent.NODE.push) == ("core",) and agent.parts_for(agent.NODE.provision) == agent.PARTS


# --------------------------------------------------------------------------- remote/_boot.py, run here


def _boot(home: Path, module: str, request: dict[str, Any], parts: list[str], *, tamper: bytes | None = None,
          cut: int = 0, python: str = "python3") -> subprocess.CompletedProcess[bytes]:
    specs, blobs = agent._carried(parts)
    if tamper is not None:
        blobs = blobs[:-len(tamper)] + tamper
    if cut:
        blobs = blobs[:-cut]
    cmd = agent.module_command(module, python, flags="-S", carry=specs)
    env = dict(os.environ, HOME=str(home))
    env.pop("PYTHONPATH", None)
    return subprocess.run(["sh", "-c", cmd], input=blobs + json.dumps(request).encode() + b"\n", env=env,
                          capture_output=True, timeout=60, cwd="/")


def _result(out: bytes) -> dict[str, Any]:
    for line in out.decode().splitlines()[::-1]:
        fr = _proto.split_frame(line)
        if fr and fr[0] == "result":
            return json.loads(fr[1])  # type: ignore[no-any-return]
    raise AssertionError(out)


def test_boot_installs_core_only_then_runs_the_module(tmp_path: Path) -> None:
    d = tmp_path / ".cache" / "dfo" / "agent" / agent.bundle_digest()
    r = _boot(tmp_path, agent.NODE.push, {"op": "state", "dest": str(tmp_path / "code")}, ["core"])
    doc = _result(r.stdout)
    assert doc["ok"] is True and doc["data"]["digest"] is None, (doc, r.stderr)
    assert (d / ".complete").is_file() and (d / "remote" / "files" / "push.py").is_file()
    assert not (d / ".vendor").exists() and not (d / "remote" / "_vendor" / "packaging").exists()
    assert [p.name for p in d.parent.iterdir()] == [d.name]  # no temporary folder left
    # the plain command (no parts carried) now finds it; a vendor user does not (exit 97: send it)
    plain = agent.module_command(agent.NODE.push, "python3", flags="-S")
    env = dict(os.environ, HOME=str(tmp_path))
    req = json.dumps({"op": "state", "dest": str(tmp_path / "code")}).encode()
    assert _result(subprocess.run(["sh", "-c", plain], input=req, env=env, capture_output=True).stdout)["ok"]
    needs = agent.module_command(agent.NODE.pkgcheck, "python3")
    assert subprocess.run(["sh", "-c", needs], input=b"{}", env=env, capture_output=True).returncode == \
        agent.NEED_UPLOAD


def test_dfo_node_code_keeps_its_bytecode_and_a_venv_python_writes_none(tmp_path: Path) -> None:
    """The host's python writes the bytecode of dfo's node code beside it (read by every later call);
    a call with bytecode=False (an interpreter that imports the job's packages) writes none, and the
    switch never reaches a child: PYTHONDONTWRITEBYTECODE stays set, DFO_NODE_PYC is gone."""
    d = tmp_path / ".cache" / "dfo" / "agent" / agent.bundle_digest()
    req = {"op": "state", "dest": str(tmp_path / "code")}
    assert _result(_boot(tmp_path, agent.NODE.push, req, ["core"]).stdout)["ok"]
    assert list((d / "remote" / "files" / "__pycache__").glob("push.*.pyc")), "the boot call wrote no bytecode"
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("PYTHONPATH", None)
    for bytecode in (True, False):
        shutil.rmtree(d / "remote" / "files" / "__pycache__")
        cmd = agent.module_command(agent.NODE.push, "python3", flags="-S", bytecode=bytecode)
        r = subprocess.run(["sh", "-c", cmd], input=json.dumps(req).encode(), env=env, capture_output=True)
        assert _result(r.stdout)["ok"], r.stderr
        assert bool(list((d / "remote" / "files").glob("__pycache__/push.*.pyc"))) is bytecode
    probe = "import os, sys, remote; print(sys.dont_write_bytecode, 'DFO_NODE_PYC' in os.environ, " \
            "os.environ.get('PYTHONDONTWRITEBYTECODE'))"
    out = subprocess.run([sys.executable, "-S", "-c", probe], cwd=d, capture_output=True, text=True,
                         env=dict(env, PYTHONPATH=str(d), DFO_NODE_PYC="1", PYTHONDONTWRITEBYTECODE="1"))
    assert out.stdout.split() == ["False", "False", "1"], (out.stdout, out.stderr)


def test_boot_runs_on_python_3_8(tmp_path: Path) -> None:
    from tests.test_hardening_packaging import _python38

    py38 = _python38()
    if py38 is None:
        pytest.skip("no python3.8 here (bash .ci/setup installs uv's)")
    doc = _result(_boot(tmp_path, agent.NODE.pkgcheck, {"pins": ["pip>=1"]}, ["core", "vendor"], python=py38).stdout)
    assert doc["ok"] is True and doc["data"]["python"].startswith("3.8"), doc


def test_boot_refuses_a_damaged_or_short_part_and_installs_nothing(tmp_path: Path) -> None:
    d = tmp_path / ".cache" / "dfo" / "agent" / agent.bundle_digest()
    req = {"op": "state", "dest": str(tmp_path / "code")}
    for kw in ({"tamper": b"\x00\x01"}, {"cut": 100}):
        r = _boot(tmp_path, agent.NODE.push, req, ["core"], **kw)  # type: ignore[arg-type]
        err = _result(r.stdout)["error"]
        assert err["kind"] == "agent" and ("damaged" in err["message"] or "short" in err["message"]), err
        assert not d.exists() and (not d.parent.exists() or list(d.parent.iterdir()) == [])


def test_boot_adds_vendor_to_an_installed_core_when_a_vendor_user_needs_it(tmp_path: Path) -> None:
    d = tmp_path / ".cache" / "dfo" / "agent" / agent.bundle_digest()
    assert _result(_boot(tmp_path, agent.NODE.push, {"op": "state", "dest": str(tmp_path / "c")},
                         ["core"]).stdout)["ok"]
    # core already there: its bytes are read and dropped, vendor is installed, pkgcheck (packaging) runs
    r = _boot(tmp_path, agent.NODE.pkgcheck, {"pins": ["pip>=1"]}, ["core", "vendor"])
    doc = _result(r.stdout)
    assert doc["ok"] is True and doc["data"]["problems"][0]["message"] == "asked pip>=1; pip is not installed", doc
    assert (d / ".vendor").is_file() and (d / "remote" / "_vendor" / "packaging" / "version.py").is_file()
    # vendor carried alone while core is gone: exit 97, so the controller sends both
    import shutil
    shutil.rmtree(d)
    assert _boot(tmp_path, agent.NODE.pkgcheck, {}, ["vendor"]).returncode == agent.NEED_UPLOAD


# --------------------------------------------------------------------------- the controller's choice, recorded


def _carries(command: str) -> bool:
    """Whether a module command installs dfo's node code from its stdin (remote/_boot.py) first."""
    return shlex.quote(agent._boot_text()) in command


class _Conn:
    """Answers like a node: 97 while the call checks markers the node lacks; records commands and stdin."""

    def __init__(self, has: set[str]) -> None:
        self.host = ResolvedHost(name="n1", hostname="10.0.0.9", user="u", port=2222)
        self.name = "n1"
        self.has = has
        self.calls: list[tuple[str, bytes]] = []

    def run(self, command: str, **kw: Any) -> Result:
        stdin = kw.get("stdin")
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin or b"")
        self.calls.append((command, data))
        if _carries(command):  # the boot: it installs what it carries
            self.has |= {s.split(":")[0] for s in command.rsplit(" -- ", 1)[1].split(" ")[0].split(",")}
        elif any(f'"$D/{agent.MARKERS[p]}"' in command and p not in self.has for p in agent.PARTS):
            return Result("n1", command, "", "", agent.NEED_UPLOAD, 0.01)
        out = _proto.RESULT_PREFIX + json.dumps({"ok": True, "data": {"n": 1}}) + "\n"
        return Result("n1", command, out, "", 0, 0.01)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    agent._KNOWN.clear()
    yield tmp_path
    agent._KNOWN.clear()


def test_a_new_node_gets_what_each_command_needs_in_the_call_itself(cache: Path) -> None:
    conn = _Conn(set())
    agent.run_module(conn, agent.NODE.push, {"op": "state"})  # type: ignore[arg-type]
    core = agent.bundle("core")[1]
    assert len(conn.calls) == 1 and conn.calls[0][1] == core + b'{"op": "state"}'  # one command, core first
    agent.run_module(conn, agent.NODE.probe, {})  # type: ignore[arg-type]
    assert len(conn.calls) == 2 and not _carries(conn.calls[1][0])  # known now: nothing carried
    agent.run_module(conn, agent.NODE.provision, {})  # type: ignore[arg-type]
    assert len(conn.calls) == 3 and conn.calls[2][1].startswith(agent.bundle("vendor")[1])  # vendor alone
    agent._KNOWN.clear()  # a new dfo process reads the record
    agent.run_module(conn, agent.NODE.pkgcheck, {})  # type: ignore[arg-type]
    assert len(conn.calls) == 4 and not _carries(conn.calls[3][0])


def test_a_node_that_lost_its_copy_gets_it_again_in_one_more_command(cache: Path) -> None:
    conn = _Conn(set())
    agent.run_module(conn, agent.NODE.provision, {})  # type: ignore[arg-type]
    conn.has.clear()  # the node's cache was removed
    agent.run_module(conn, agent.NODE.push, {"op": "state"})  # type: ignore[arg-type]
    assert len(conn.calls) == 3 and conn.calls[1][1] == b'{"op": "state"}' and _carries(conn.calls[2][0])


def test_a_refused_install_is_agent_missing_and_not_recorded(cache: Path) -> None:
    class Broken(_Conn):
        def run(self, command: str, **kw: Any) -> Result:
            self.calls.append((command, b""))
            doc = {"ok": False, "error": {"kind": "agent", "message": "dfo's node code (core) arrived damaged"}}
            return Result("n1", command, _proto.RESULT_PREFIX + json.dumps(doc) + "\n", "", 0, 0.01)

    conn = Broken(set())
    with pytest.raises(AgentMissing) as ei:
        agent.run_module(conn, agent.NODE.push, {})  # type: ignore[arg-type]
    assert "damaged" in ei.value.message and agent.known_parts(conn) == set()  # type: ignore[arg-type]


# --------------------------------------------------------------------------- a real node


def test_a_fresh_node_gets_core_then_vendor_when_provision_needs_it(testbed: Testbed, tmp_path: Path,
                                                                     cache: Path) -> None:
    from orchestrator.config.models import load_inventory
    from orchestrator.transport import open_connection
    from orchestrator.transport.resolve import resolve_host
    from tests._runs_fixtures import inventory_copy

    if not testbed.isolated:  # the node's /root would be this machine's: its agent cache is not ours to remove
        pytest.skip("needs the testbed's network namespaces (the node's /root is its own)")
    inv, p = load_inventory(inventory_copy(testbed, tmp_path))
    conn = open_connection(resolve_host(inv, testbed.nodes[0].name, p))
    node = testbed.nodes[0]
    d = f"/root/.cache/dfo/agent/{agent.bundle_digest()}"
    testbed.node_exec(node, "rm -rf /root/.cache/dfo/agent")
    calls: list[str] = []
    real = conn.run

    def counted(command: str, **kw: Any) -> Result:
        calls.append(command)
        return real(command, **kw)

    conn.run = counted  # type: ignore[method-assign]
    try:
        assert agent.run_module(conn, agent.NODE.push, {"op": "state", "dest": "/root/code"})["digest"] is None
        assert len(calls) == 1
        ls = testbed.node_exec(node, f"ls -a {d} {d}/remote/_vendor").stdout.split()
        assert ".complete" in ls and ".vendor" not in ls and "packaging" not in ls
        rep = agent.run_module(conn, agent.NODE.pkgcheck, {"pins": []}, python="python3")
        assert isinstance(rep, dict) and len(calls) == 2
        ls = testbed.node_exec(node, f"ls -a {d} {d}/remote/_vendor").stdout.split()
        assert ".vendor" in ls and "packaging" in ls
        testbed.node_exec(node, "rm -rf /root/.cache/dfo/agent")  # the node lost it: sent again, one more command
        assert agent.run_module(conn, agent.NODE.push, {"op": "state", "dest": "/root/code"})["digest"] is None
        assert len(calls) == 4
    finally:
        conn.close()


def test_the_bundle_digest_is_kept_with_its_files_sizes_and_mtimes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bundle_digest reads no file while every one keeps its size and mtime (dfo's cache), and hashes them
    again when one changes or the cache is unreadable; the value is the one the files give."""
    root = tmp_path / "tree" / "remote"
    shutil.copytree(agent.REMOTE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__"))
    real = agent.bundle_digest()
    monkeypatch.setattr(agent, "REMOTE_ROOT", root)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    compute = agent.bundle_digest.__wrapped__  # past the per-process lru_cache
    assert compute() == real  # the same files (paths and bytes) as this checkout's
    cache = tmp_path / "cache" / "dfo" / "bundle-digest.json"
    assert json.loads(cache.read_text())["digest"] == real

    def no_read(self: Path) -> bytes:
        raise AssertionError(f"read {self}")

    with monkeypatch.context() as m:
        m.setattr(Path, "read_bytes", no_read)
        assert compute() == real  # answered from the cache: no file read
    proto = root / "_proto.py"
    proto.write_text(proto.read_text() + "\n# changed\n")
    changed = compute()
    assert changed != real and json.loads(cache.read_text())["digest"] == changed
    cache.write_text("{not json")
    assert compute() == changed
