"""sync-code's promises against a node and a work tree that are not as the user thinks (issue 19, 6 and 7).

6. Two jobs sharing one code folder on the node: the folder's manifest names the job that owns it;
   another job's push is refused while the owner has a live run, and never deletes the owner's files.
7. A tracked file whose folder became a symlink: refused unless its real path stays under the source;
   the read itself opens every folder on the path without following symlinks.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.errors import ConfigError
from orchestrator.testbed import Testbed
from tests._runs_fixtures import dfo
from tests.test_code import Env, git

# Job A's trainer: imports its pushed modules afresh from disk, again and again, until stopped;
# a deleted module ends it with ModuleNotFoundError, a changed one with an AssertionError.
LOOP = """\
import importlib, sys, time
sys.path.insert(0, ".")
n = 0
while True:
    for m in ("helper_a", "pkg_a", "pkg_a.util", "common"):
        sys.modules.pop(m, None)
    importlib.invalidate_caches()
    import helper_a, pkg_a.util, common
    assert common.OWNER == "a", common.OWNER
    n += 1
    if n % 20 == 1:
        print("imports", n, flush=True)
    time.sleep(0.05)
"""


class Shared:
    """Two job files, A and B, whose code goes to one folder on the node (run.workdir, code.dest unset)."""

    def __init__(self, tb: Testbed, tmp: Path) -> None:
        self.env = Env(tb, tmp)
        self.dest = f"/root/shared-{secrets.token_hex(3)}"
        self.cache = {"XDG_CACHE_HOME": str(tmp / "cache")}  # one laptop pushes both: its guess is per node+dest
        tag = secrets.token_hex(3)
        self.names = {"a": f"joba-{tag}", "b": f"jobb-{tag}"}
        self.jobs: dict[str, Path] = {}
        for key in ("a", "b"):
            src = tmp / f"src-{key}"
            src.mkdir()
            doc = {"name": self.names[key], "venv": "/usr", "code": {"source": src.name},
                   "run": {"workdir": self.dest, "command": "python3 loop.py" if key == "a" else "python3 b_main.py",
                           "wait": 1, "stop_grace": 1, "env": {"PYTHONDONTWRITEBYTECODE": "1"}}}
            self.jobs[key] = tmp / f"job-{key}.yaml"
            self.jobs[key].write_text(yaml.safe_dump(doc))
        a, b = tmp / "src-a", tmp / "src-b"
        (a / "loop.py").write_text(LOOP)
        (a / "helper_a.py").write_text("A = 1\n")
        (a / "pkg_a").mkdir()
        (a / "pkg_a/__init__.py").write_text("")
        (a / "pkg_a/util.py").write_text("U = 1\n")
        (a / "common.py").write_text('OWNER = "a"\n')
        (b / "b_main.py").write_text("import common\nprint('b runs with', common.OWNER, flush=True)\n")
        (b / "b_only.py").write_text("B = 1\n")
        (b / "common.py").write_text('OWNER = "b"\n')
        self.a_files = ["common.py", "helper_a.py", "loop.py", "pkg_a/__init__.py", "pkg_a/util.py"]

    def dfo(self, *args: str) -> Any:
        return dfo(self.env.inv, *args, env=self.cache)

    def files(self) -> list[str]:
        self.env.dest = self.dest
        return self.env.node_files()

    def cat(self, rel: str) -> str:
        return self.env.sh(f"cat {self.dest}/{rel}")

    def state(self, run: str) -> str:
        r = self.dfo("status", "-H", self.env.node.name, run, "--json")
        assert r.returncode in (0, 5), r.stdout + r.stderr
        return str(json.loads(r.stdout)["hosts"][self.env.node.name]["runs"][0]["state"])

    def push(self, key: str, expect: int) -> dict[str, Any]:
        r = self.dfo("sync-code", "-H", self.env.node.name, "-j", str(self.jobs[key]), "--json")
        assert r.returncode == expect, r.stdout + r.stderr
        return dict(json.loads(r.stdout)["hosts"][self.env.node.name])


@pytest.fixture
def shared(testbed: Testbed, tmp_path: Path) -> Shared:
    return Shared(testbed, tmp_path)


@pytest.fixture
def env(testbed: Testbed, tmp_path: Path) -> Env:
    return Env(testbed, tmp_path)


@pytest.mark.testbed
def test_another_jobs_push_is_refused_while_the_owner_runs_and_never_deletes_its_files(shared: Shared) -> None:
    s, host = shared, shared.env.node.name
    a, b = s.names["a"], s.names["b"]
    r = s.dfo("launch", "-H", host, "-j", str(s.jobs["a"]), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)["hosts"][host]["run"]
    try:
        assert s.files() == s.a_files
        # B's push (this laptop remembers A's push there, so B's guess deletes A's files) and B's launch
        refused = s.push("b", expect=2)
        msg = refused["error"]["message"]
        assert a in msg and b in msg and s.dest in msg and run in msg, msg
        launched = s.dfo("launch", "-H", host, "-j", str(s.jobs["b"]))
        assert launched.returncode == 2, launched.stdout + launched.stderr
        assert a in launched.stderr and b in launched.stderr and s.dest in launched.stderr, launched.stderr
        time.sleep(1.0)  # A keeps importing its modules from the folder
        assert s.files() == s.a_files and s.cat("common.py") == 'OWNER = "a"\n'
        assert s.state(run) == "running"
        log = s.dfo("tail", "-H", host, run, "--no-follow").stdout
        assert "imports" in log and "Error" not in log, log
    finally:
        s.dfo("stop", "-H", host, run)
    assert s.state(run) == "stopped"
    # A has no live run: B takes the folder over. A's files that B does not push stay (released, not
    # deleted); the one both push (common.py) is B's now; the manifest names B.
    took = s.push("b", expect=0)
    assert took["took_over"] == a and took["deleted"] == 0 and took["released"] == 4, took
    assert s.files() == sorted([*s.a_files, "b_main.py", "b_only.py"])
    assert s.cat("common.py") == 'OWNER = "b"\n'
    manifest = json.loads(s.cat(".dfo/code-manifest.json"))
    assert manifest["owner"]["job"] == b and sorted(manifest["files"]) == ["b_main.py", "b_only.py", "common.py"]
    # B's own file deleted here is deleted there; A's files never are
    (s.env.tmp / "src-b/b_only.py").unlink()
    again = s.push("b", expect=0)
    assert again["deleted"] == 1 and again.get("took_over") is None, again
    assert s.files() == sorted([*s.a_files, "b_main.py"])
    # and back: A's push takes the folder again (B has no live run), B's file stays
    back = s.push("a", expect=0)
    assert back["took_over"] == b and back["deleted"] == 0, back
    assert s.files() == sorted([*s.a_files, "b_main.py"]) and s.cat("common.py") == 'OWNER = "a"\n'


@pytest.mark.testbed
def test_the_owners_own_push_goes_on_and_a_live_b_keeps_a_out(shared: Shared) -> None:
    """The owner's own pushes go on as before (no takeover); once B owns the folder and runs, A's push
    is refused in turn, naming both jobs and the folder."""
    s, host = shared, shared.env.node.name
    first = s.push("a", expect=0)
    assert first.get("took_over") is None and first["sent"] == 5
    (s.env.tmp / "src-a/helper_a.py").write_text("A = 2\n")
    assert s.push("a", expect=0)["sent"] == 1
    (s.env.tmp / "src-b/b_main.py").write_text("import time\ntime.sleep(600)\n")
    assert s.push("b", expect=0)["took_over"] == s.names["a"]
    r = s.dfo("launch", "-H", host, "-j", str(s.jobs["b"]), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)["hosts"][host]["run"]
    try:
        refused = s.push("a", expect=2)
        msg = refused["error"]["message"]
        assert s.names["a"] in msg and s.names["b"] in msg and s.dest in msg, msg
        assert s.cat("common.py") == 'OWNER = "b"\n'
    finally:
        s.dfo("stop", "-H", host, run)


@pytest.mark.testbed
def test_a_manifest_that_names_no_owner_is_taken_over_without_deleting(shared: Shared) -> None:
    """A manifest written before owners were recorded: refused while another job's live run works in
    the folder; after it, taken over with nothing deleted (took_over is "")."""
    s, host = shared, shared.env.node.name
    r = s.dfo("launch", "-H", host, "-j", str(s.jobs["a"]), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)["hosts"][host]["run"]
    strip = (f"import json; p = '{s.dest}/.dfo/code-manifest.json'; d = json.load(open(p)); d.pop('owner'); "
             "json.dump(d, open(p, 'w'))")
    s.env.sh(f"python3 -c {_q(strip)}")
    try:
        msg = s.push("b", expect=2)["error"]["message"]
        assert s.names["a"] in msg and s.names["b"] in msg and s.dest in msg and "workdir" in msg, msg
        assert s.files() == s.a_files
    finally:
        s.dfo("stop", "-H", host, run)
    took = s.push("b", expect=0)
    assert took["took_over"] == "" and took["deleted"] == 0 and took["released"] == 4, took
    assert s.files() == sorted([*s.a_files, "b_main.py", "b_only.py"])


def _q(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


# --------------------------------------------------------------------------- 7: a symlinked folder on the path


def _tracked_cfg(env: Env) -> Path:
    """A git work tree with a tracked cfg/settings.py; returns a folder outside it with another settings.py."""
    git(env.src, "init", "-q")
    (env.src / "cfg").mkdir()
    (env.src / "cfg/settings.py").write_text("TOKEN = 'the tree'\n")
    (env.src / "main.py").write_text("import cfg.settings\n")
    git(env.src, "add", ".")
    git(env.src, "commit", "-qm", "c")
    outside = env.tmp / "outside"
    outside.mkdir()
    (outside / "settings.py").write_text("TOKEN = 'outside secret'\n")
    return outside


@pytest.mark.testbed
@pytest.mark.parametrize("hide", ["gitignore", "info-exclude"])
def test_a_tracked_file_behind_a_symlinked_folder_outside_is_refused(env: Env, hide: str) -> None:
    """cfg/ became a symlink to a folder outside the tree, and the link itself is ignored (so git lists
    only the tracked cfg/settings.py): refused, exit 2, naming the path; the outside bytes never travel."""
    outside = _tracked_cfg(env)
    env.sync()  # the tree as committed
    assert env.sh(f"cat {env.dest}/cfg/settings.py") == "TOKEN = 'the tree'\n"
    (env.src / "cfg/settings.py").unlink()
    (env.src / "cfg").rmdir()
    os.symlink(str(outside), env.src / "cfg")
    if hide == "gitignore":
        (env.src / ".gitignore").write_text("cfg\n")
    else:
        (env.src / ".git/info/exclude").write_text("cfg\n")
    r = env.sync(expect=2)
    msg = r["error"]["message"]
    assert "cfg/settings.py" in msg and "outside" in msg, msg
    assert env.sh(f"cat {env.dest}/cfg/settings.py") == "TOKEN = 'the tree'\n"
    assert "outside secret" not in env.sh(f"cat {env.dest}/cfg/settings.py {env.dest}/.dfo/code-manifest.json")


@pytest.mark.testbed
def test_a_symlinked_folder_inside_the_tree_keeps_working(env: Env) -> None:
    """cfg -> real (inside): the link travels as a link (git would commit the tracked cfg/settings.py as
    gone: it lies beyond a symlink); ignored, the file is pushed from its real path as a plain file."""
    _tracked_cfg(env)
    (env.src / "real").mkdir()
    (env.src / "real/settings.py").write_text("TOKEN = 'real'\n")
    git(env.src, "add", "real")
    git(env.src, "commit", "-qm", "r")
    (env.src / "cfg/settings.py").unlink()
    (env.src / "cfg").rmdir()
    os.symlink("real", env.src / "cfg")
    r = env.sync()
    assert r["status"] == "done"
    assert env.sh(f"readlink {env.dest}/cfg; cat {env.dest}/cfg/settings.py") == "real\nTOKEN = 'real'\n"
    assert env.node_files() == ["cfg", "main.py", "real/settings.py"]
    env.dest = f"/root/code-{secrets.token_hex(3)}"
    (env.src / ".gitignore").write_text("cfg\n")
    r = env.sync()
    assert r["status"] == "done"
    assert env.sh(f"test -L {env.dest}/cfg || cat {env.dest}/cfg/settings.py") == "TOKEN = 'real'\n"
    assert env.node_files() == [".gitignore", "cfg/settings.py", "main.py", "real/settings.py"]


@pytest.mark.testbed
def test_a_plain_folder_with_a_symlinked_folder_outside_is_refused(env: Env) -> None:
    """Outside git: the walk lists the folder link itself (never enters it) and refuses it, exit 2."""
    outside = env.tmp / "outside"
    outside.mkdir()
    (outside / "settings.py").write_text("TOKEN = 'outside secret'\n")
    (env.src / "main.py").write_text("x")
    os.symlink(str(outside), env.src / "cfg")
    r = env.sync(expect=2)
    assert "cfg" in r["error"]["message"] and "outside" in r["error"]["message"]
    assert env.tb.node_exec(env.node, f"test -e {env.dest}").returncode != 0  # nothing travelled


def test_a_folder_swapped_for_a_symlink_after_listing_is_not_read(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The read itself: listed as a plain folder, swapped for a symlink to outside before the bytes are
    read (hashed, then streamed): every folder on the path is opened without following links, so the
    outside file is never read; refused (exit 2) naming the path."""
    from orchestrator.config.models import load_job
    from orchestrator.steps.code import Local, _stream

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    (src / "cfg").mkdir(parents=True)
    (src / "cfg/settings.py").write_text("TOKEN = 'the tree'\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "settings.py").write_text("TOKEN = 'outside secret'\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "t", "venv": "/usr", "code": {"source": "src", "dest": "/root/c"}}))
    loaded = load_job(job)

    def swap() -> None:
        os.rename(src / "cfg", tmp_path / "cfg-moved")
        os.symlink(str(outside), src / "cfg")

    listed = Local(loaded).result()  # listed and hashed
    swap()
    with pytest.raises(ConfigError, match="cfg/settings.py"):
        _stream(listed, ["cfg/settings.py"])
    os.unlink(src / "cfg")
    os.rename(tmp_path / "cfg-moved", src / "cfg")
    from orchestrator.steps import codetree

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache2"))  # no cached hash: the file must be read
    files, _ = codetree.list_code(src, [])
    swap()
    with pytest.raises(ConfigError, match="cfg/settings.py"):
        codetree.fill_hashes(src, files)

