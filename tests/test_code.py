"""dfo sync-code (and launch's push) against a real testbed node."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.steps.codetree import Excluder
from orchestrator.testbed import Testbed
from tests._runs_fixtures import dfo, inventory_copy


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo, check=True,
                   capture_output=True)


class Env:
    def __init__(self, tb: Testbed, tmp: Path) -> None:
        self.tb, self.tmp = tb, tmp
        self.node = tb.nodes[0]
        self.inv = inventory_copy(tb, tmp)
        self.dest = f"/root/code-{secrets.token_hex(3)}"
        self.src = tmp / "src"
        self.src.mkdir()
        self.name = f"c-{secrets.token_hex(3)}"  # one job: another job's push would take the folder over

    def job(self, **code: Any) -> Path:
        doc: dict[str, Any] = {"name": self.name, "venv": "/usr",
                               "code": {"source": "src", "dest": self.dest, **code}}
        p = self.tmp / "job.yaml"
        p.write_text(yaml.safe_dump(doc))
        return p

    def sync(self, job: Path | None = None, expect: int = 0) -> dict[str, Any]:
        r = dfo(self.inv, "sync-code", "-H", self.node.name, "-j", str(job or self.job()), "--json",
                env={"XDG_CACHE_HOME": str(self.tmp / "cache")})
        assert r.returncode == expect, r.stdout + r.stderr
        doc = json.loads(r.stdout)["hosts"][self.node.name]
        doc["_stderr"] = r.stderr
        return doc

    def sh(self, cmd: str) -> str:
        r = self.tb.node_exec(self.node, cmd)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def node_files(self) -> list[str]:
        out = self.sh(f"cd {self.dest} && find . -path ./.dfo -prune -o \\( -type f -o -type l \\) -print0")
        return sorted(p[2:] for p in out.split("\0") if p)


@pytest.fixture
def env(testbed: Testbed, tmp_path: Path) -> Env:
    return Env(testbed, tmp_path)


def test_first_push_no_change_one_change(env: Env) -> None:
    for i in range(30):
        (env.src / f"pkg/m{i}.py" if i % 2 else env.src / f"f{i}.txt").parent.mkdir(exist_ok=True)
        (env.src / (f"pkg/m{i}.py" if i % 2 else f"f{i}.txt")).write_text(f"x = {i}\n")
    first = env.sync()
    assert (first["status"], first["sent"], first["files_total"]) == ("done", 30, 30)
    assert env.sh(f"cat {env.dest}/pkg/m3.py") == "x = 3\n"
    again = env.sync()
    assert (again["status"], again["sent"], again["bytes"], again["files_total"]) == ("no change", 0, 0, 30)
    (env.src / "pkg/m5.py").write_text("x = 'changed'\n")
    one = env.sync()
    assert (one["status"], one["sent"], one["skipped"], one["bytes"]) == ("done", 1, 29, len("x = 'changed'\n"))
    assert env.sh(f"cat {env.dest}/pkg/m5.py") == "x = 'changed'\n"
    # a file changed on the node by hand is put back (the code folder is the truth for its own files)
    env.sh(f"echo tampered > {env.dest}/f0.txt")
    fixed = env.sync()
    assert fixed["sent"] == 1 and env.sh(f"cat {env.dest}/f0.txt") == "x = 0\n"


def test_deletion_only_of_what_dfo_pushed(env: Env) -> None:
    for n in ("a.py", "b.py", "sub/c.py", "sub/d.py"):
        (env.src / n).parent.mkdir(exist_ok=True)
        (env.src / n).write_text(n)
    env.sync()
    env.sh(f"echo mine > {env.dest}/by-hand.txt && echo edited > {env.dest}/b.py")
    for n in ("a.py", "b.py", "sub/c.py", "sub/d.py"):
        (env.src / n).unlink()
    r = env.sync()
    assert r["deleted"] == 3 and r["kept"] == 1 and r["kept_files"] == ["b.py"]
    assert env.node_files() == ["b.py", "by-hand.txt"]
    assert env.sh(f"test -d {env.dest}/sub || echo gone") == "gone\n"  # emptied folder removed


def test_exec_bit_symlinks_odd_names(env: Env) -> None:
    odd = ["with space.py", "quo'te\".py", "$(touch PWNED).py", "ünïcode-日本.py", "new\nline.py", "-dash.py"]
    for n in odd:
        (env.src / n).write_text(repr(n))
    run = env.src / "run.sh"
    run.write_text("#!/bin/sh\necho ok\n")
    run.chmod(0o755)
    (env.src / "lib").mkdir()
    (env.src / "lib/real.py").write_text("R = 1\n")
    os.symlink("lib/real.py", env.src / "alias.py")
    os.symlink("lib", env.src / "libdir")
    r = env.sync()
    assert r["sent"] == len(odd) + 4
    assert env.sh(f"{env.dest}/run.sh") == "ok\n"
    assert env.sh(f"stat -c %a {env.dest}/run.sh {env.dest}/lib/real.py") == "755\n644\n"
    assert env.sh(f"readlink {env.dest}/alias.py; readlink {env.dest}/libdir") == "lib/real.py\nlib\n"
    assert env.sh(f"cat {env.dest}/libdir/real.py") == "R = 1\n"
    for n in odd:
        got = env.tb.node_exec(env.node, f"cat {env.dest}/{_q(n)}")
        assert got.returncode == 0 and got.stdout == repr(n), n
    assert env.sh(f"ls -d {env.dest}/PWNED /root/PWNED /root/.cache/dfo/agent/*/PWNED 2>/dev/null || true") == ""
    run.chmod(0o644)  # only the mode changed: it travels again
    r2 = env.sync()
    assert r2["sent"] == 1 and env.sh(f"stat -c %a {env.dest}/run.sh") == "644\n"


def _q(name: str) -> str:
    return "'" + name.replace("'", "'\\''") + "'"


def test_symlink_outside_refused_with_its_name(env: Env) -> None:
    (env.src / "ok.py").write_text("1")
    os.symlink("../../etc/passwd", env.src / "leak")
    r = env.sync(expect=2)
    assert r["ok"] is False and "leak" in r["error"]["message"] and "outside" in r["error"]["message"]
    os.unlink(env.src / "leak")
    os.symlink("/etc/passwd", env.src / "abs-leak")
    r = env.sync(expect=2)
    assert "abs-leak" in r["error"]["message"]
    assert env.tb.node_exec(env.node, f"test -e {env.dest}").returncode != 0  # nothing travelled


def test_git_work_tree_and_dfo_names(env: Env) -> None:
    src = env.src
    git(src, "init", "-q")
    (src / ".gitignore").write_text("*.log\nbuild/\n")
    (src / "tracked.py").write_text("t")
    (src / "gone.py").write_text("g")
    (src / "ignored.log").write_text("no")
    (src / "build").mkdir()
    (src / "build/out.bin").write_text("no")
    (src / ".dfo-local").write_text("never")
    (src / "sub").mkdir()
    (src / "sub/.dfo").mkdir()
    (src / "sub/.dfo/x").write_text("never")
    (src / "skip.tmp").write_text("excluded")
    git(src, "add", "tracked.py", "gone.py", ".gitignore")
    git(src, "commit", "-qm", "c")
    (src / "untracked.py").write_text("u")
    r = env.sync(env.job(exclude=["*.tmp"]))
    assert r["in_git"] is True
    assert env.node_files() == [".gitignore", "gone.py", "tracked.py", "untracked.py"]
    (src / "gone.py").unlink()  # plain rm of a tracked file: gone, so deleted on the node
    r = env.sync(env.job(exclude=["*.tmp"]))
    assert r["deleted"] == 1 and env.node_files() == [".gitignore", "tracked.py", "untracked.py"]


def test_big_tree_warned_before_it_travels(env: Env) -> None:
    big = env.src / "dataset"
    big.mkdir()
    for i in range(10_001):
        (big / f"{i}.txt").write_bytes(b"")
    (env.src / "train.py").write_text("print(1)\n")
    r = env.sync(env.job(exclude=["dataset/[1-9]*"]))  # excluded: under the limit, no warning
    assert r["warnings"] == [] and r["sent"] == 2
    r = env.sync()
    assert r["sent"] == 10_000 and "did you mean to exclude" in r["_stderr"]
    assert "dataset/ (10001 files)" in r["_stderr"]
    assert len(r["warnings"]) == 1


def test_launch_pushes_code_first(env: Env) -> None:
    (env.src / "helpers").mkdir()
    (env.src / "helpers/__init__.py").write_text("")
    (env.src / "helpers/msg.py").write_text("TEXT = 'hello from the code folder'\n")
    (env.src / "train.py").write_text("from helpers.msg import TEXT\nprint(TEXT, flush=True)\n")
    doc = {"name": f"c-{secrets.token_hex(3)}", "venv": "/usr", "code": {"source": "src"},
           "run": {"workdir": env.dest, "command": "python3 train.py", "wait": 0}}
    job = env.tmp / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    r = dfo(env.inv, "launch", "-H", env.node.name, "-j", str(job), "--json", env={"XDG_CACHE_HOME": str(env.tmp)})
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["hosts"][env.node.name]["run"]
    t = dfo(env.inv, "tail", "-H", env.node.name, run, "--no-follow")
    assert "hello from the code folder" in t.stdout, t.stdout + t.stderr


def test_excluder_patterns() -> None:
    ex = Excluder(["*.log", "/top.txt", "build/", "docs/**/*.png", "!keep.log", "data/big?.bin"])
    assert ex.excluded("a/b/x.log") and not ex.excluded("a/keep.log")
    assert ex.excluded("top.txt") and not ex.excluded("sub/top.txt")
    assert ex.excluded("build/x.py") and ex.excluded("a/build/y") and not ex.excluded("build")
    assert ex.excluded("docs/a/b/c.png") and ex.excluded("docs/c.png") and not ex.excluded("docs/c.jpg")
    assert ex.excluded("data/big1.bin") and not ex.excluded("data/big10.bin")


def test_big_file_warning_names_it() -> None:
    from orchestrator.steps.codetree import LocalFile, warnings

    files = {"ckpt/model.pt": LocalFile(150_000_000, 0o644, None), "train.py": LocalFile(100, 0o644, None)}
    notes = warnings(Path("/src"), files, ["ckpt/model.pt", "train.py"])
    assert len(notes) == 1 and "ckpt/model.pt (143.1 MiB)" in notes[0] and "did you mean to exclude it" in notes[0]
    assert warnings(Path("/src"), files, ["train.py"]) == []  # not travelling: nothing to say


def test_refused_dests(env: Env) -> None:
    (env.src / "a.py").write_text("a")
    for dest in ("/", "/root/.ssh/code", "/root/x/.dfo/y"):
        env.dest = dest
        r = env.sync(expect=2)
        assert r["error"]["message"].startswith("code.dest"), r
    env.dest = "/root"  # $HOME is fine for code: only what dfo pushed is ever deleted
    r = env.sync()
    assert r["sent"] == 1
    (env.src / "a.py").unlink()
    assert env.sync()["deleted"] == 1
    assert env.sh("test -e /root/a.py || echo gone") == "gone\n"
    env.sh("rm -rf /root/.dfo/code-manifest.json /root/.dfo/code-tmp /root/.dfo/code.lock; rmdir /root/.dfo || true")


def test_launch_leaves_a_live_runs_code_alone(env: Env) -> None:
    (env.src / "train.py").write_text("import time\ntime.sleep(60)\n")
    doc = {"name": f"c-{secrets.token_hex(3)}", "venv": "/usr", "code": {"source": "src"},
           "run": {"workdir": env.dest, "command": "python3 train.py", "wait": 0, "stop_grace": 1}}
    job = env.tmp / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    cache = {"XDG_CACHE_HOME": str(env.tmp / "cache")}
    r = dfo(env.inv, "launch", "-H", env.node.name, "-j", str(job), "--json", env=cache)
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["hosts"][env.node.name]["run"]
    try:
        (env.src / "train.py").write_text("print('new code')\n")
        again = dfo(env.inv, "launch", "-H", env.node.name, "-j", str(job), env=cache)
        assert again.returncode == 2 and "already" in again.stderr, again.stderr
        assert env.sh(f"cat {env.dest}/train.py") == "import time\ntime.sleep(60)\n"  # the live run's code, untouched
    finally:
        dfo(env.inv, "stop", "-H", env.node.name, run)


# --------------------------------------------------------------------------- speed: commands per push (issue 12)


class Counted:
    """A real connection to the testbed node whose commands are recorded."""

    def __init__(self, env: Env) -> None:
        from orchestrator.hosts import HostSession

        self.session = HostSession(env.inv, (env.node.name,))
        self.conn = self.session.conn(env.node.name)
        self.commands: list[str] = []
        real = self.conn.run

        def run(cmd: str, **kw: Any) -> Any:
            self.commands.append(cmd)
            return real(cmd, **kw)

        self.conn.run = run  # type: ignore[method-assign]

    def push(self, job: Path) -> Any:
        from orchestrator.config.models import load_job
        from orchestrator.steps.code import push_code

        self.commands.clear()
        return push_code(self.conn, load_job(job), warn=lambda _t: None, note=lambda _t: None)


def test_a_push_from_here_again_is_one_command(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator import agent

    monkeypatch.setenv("XDG_CACHE_HOME", str(env.tmp / "cache"))
    monkeypatch.setattr(agent, "_KNOWN", {})  # this process's memory of the node too: an earlier test here used it
    for i in range(20):
        (env.src / f"m{i}.py").write_text(f"x = {i}\n")
    job = env.job()
    c = Counted(env)
    try:
        first = c.push(job)
        # the node's manifest (dfo's node code carried in the same command: this machine never saw the
        # node), then the files: two commands
        assert (first.status, first.fetched, len(c.commands)) == ("done", 20, 2)
        ran = [cmd for cmd in c.commands if "remote.files.push" in cmd]
        boot = " -S -c " + shlex.quote(agent._boot_text())
        assert boot in ran[0] and " remote.files.push " in ran[0]  # the node code first, then the module
        assert boot not in ran[1] and " -S " + agent.launch(agent.NODE.push) + " " in ran[1], ran  # no site-packages
        none = c.push(job)
        assert (none.status, none.fetched, len(c.commands)) == ("no change", 0, 1)
        (env.src / "m3.py").write_text("x = 'three'\n")
        (env.src / "m4.py").unlink()
        one = c.push(job)
        assert (one.status, one.fetched, one.deleted, len(c.commands)) == ("done", 1, 1, 1)
        assert env.sh(f"cat {env.dest}/m3.py") == "x = 'three'\n" and "m4.py" not in env.node_files()
        # changed on the node by hand: the one command finds it, a second sends it back
        env.sh(f"echo tampered > {env.dest}/m5.py")
        fixed = c.push(job)
        assert (fixed.status, fixed.fetched, len(c.commands)) == ("done", 1, 2)
        assert env.sh(f"cat {env.dest}/m5.py") == "x = 5\n"
    finally:
        c.session.close()


def test_what_this_machine_remembers_is_only_a_guess(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node lost its code (a fresh node under the same name, a wiped dest) after a push from here:
    the next push sends what it believes changed, the node says it does not match, and the rest follows."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(env.tmp / "cache"))
    for i in range(12):
        (env.src / f"pkg/m{i}.py").parent.mkdir(exist_ok=True)
        (env.src / f"pkg/m{i}.py").write_text(f"x = {i}\n")
    (env.src / "run.sh").write_text("#!/bin/sh\n")
    (env.src / "run.sh").chmod(0o755)
    job = env.job()
    c = Counted(env)
    try:
        c.push(job)
        env.sh(f"rm -rf {env.dest}")
        none = c.push(job)  # nothing changed here: the check alone finds the node empty
        assert (none.status, none.fetched, len(c.commands)) == ("done", 13, 2)
        env.sh(f"rm -rf {env.dest}")
        (env.src / "pkg/m1.py").write_text("x = 'one'\n")
        one = c.push(job)
        assert (one.status, one.fetched, len(c.commands)) == ("done", 13, 2)
        assert env.node_files() == sorted([*(f"pkg/m{i}.py" for i in range(12)), "run.sh"])
        assert env.sh(f"cat {env.dest}/pkg/m1.py; stat -c %a {env.dest}/run.sh") == "x = 'one'\n755\n"
        again = c.push(job)
        assert (again.status, len(c.commands)) == ("no change", 1)
    finally:
        c.session.close()


def test_sync_code_imports_the_ssh_layer_only_when_it_connects() -> None:
    """The command's module loads without paramiko/fabric, so the files here are listed (a thread)
    while they are imported; and naming the agent's bundle does not build its tar.gz (~50 ms)."""
    probe = ("import sys, orchestrator.commands.code; print(sorted({'paramiko', 'fabric'} & set(sys.modules))); "
             "import orchestrator.agent as a; a.module_command('m', 'python3'); print(a.bundle.cache_info().currsize)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["[]", "0"], r.stdout + r.stderr


def test_the_pushed_cache_is_per_node_and_read_in_halves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.steps.codetree import LocalFile, Pushed

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    p = Pushed("root@a:22\0a\0/root/code")
    assert p.digest is None and p.files() is None
    p.save("d1", {"x.py": LocalFile(1, 0o644, None, "s1")})
    again = Pushed("root@a:22\0a\0/root/code")
    assert again.digest == "d1" and again.files() == {"x.py": ["s1", 0o644, None]}
    assert Pushed("root@a:22\0a\0/root/other").digest is None  # another dest, another node: nothing known
    lines = again.path.read_bytes().split(b"\n")
    again.path.write_bytes(lines[0] + b"\n{broken\n")  # the second half unreadable: not a guess of 'nothing'
    assert Pushed("root@a:22\0a\0/root/code").files() is None


def test_the_tree_digest_is_reused_only_while_every_file_keeps_its_key(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing changed here: the tree's digest comes from one small record, the per-file hash cache
    is not read; one file touched (same bytes, same size, a new mtime): hashed again, same digest;
    one byte changed: another digest."""
    from orchestrator.steps import codetree
    from orchestrator.steps.code import Local
    from remote.files.push import digest_of

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    for i in range(5):
        (src / f"pkg/m{i}.py").write_text(f"x = {i}\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "t", "venv": "/usr", "code": {"source": "src", "dest": "/root/c"}}))
    from orchestrator.config.models import load_job

    loaded = load_job(job)
    first = Local(loaded).result()
    full = digest_of(first.view())
    assert first.digest == full
    reads: list[Path] = []
    real_fill = codetree.fill_hashes
    monkeypatch.setattr("orchestrator.steps.code.fill_hashes", lambda s, f: (reads.append(s), real_fill(s, f)))
    again = Local(loaded).result()
    assert again.digest == full and reads == []  # the hash cache was not read
    st = os.stat(src / "pkg/m2.py")
    os.utime(src / "pkg/m2.py", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    touched = Local(loaded).result()
    assert touched.digest == full and len(reads) == 1
    (src / "pkg/m2.py").write_text("x = 9\n")
    changed = Local(loaded).result()
    assert changed.digest != full and changed.digest == digest_of(changed.view()) and len(reads) == 2


def test_a_damaged_manifest_row_counts_as_changed_never_as_gone(tmp_path: Path) -> None:
    """The node's manifest holds rows that are short, too long or not lists (a damaged file): state
    reports them dirty without failing, a push told to delete them keeps them (they are not what dfo
    wrote, so not dfo's to delete) and says so, and a folder whose manifest names no owner still counts
    as another job's for a push that names one (takeover refused, nothing written)."""
    import io
    import json as _json

    from remote._proto import split_frame
    from remote.files import push

    dest = tmp_path / "code"
    (dest / ".dfo").mkdir(parents=True)
    for name in ("a.py", "b.py", "c.py", "d.py"):
        (dest / name).write_text(name)
    st = os.lstat(dest / "a.py")
    good = ["0" * 64, 0o644, None, st.st_size, st.st_mtime_ns, st.st_ino]
    rows = {"a.py": good, "b.py": good[:3], "c.py": {"sha256": "x"}, "d.py": [*good, "extra"]}
    manifest = dest / ".dfo" / push.MANIFEST
    manifest.write_text(_json.dumps({"version": 2, "fields": push.FIELDS, "digest": "d", "files": rows}))
    state = push.op_state({"dest": str(dest)})
    assert sorted(state["dirty"]) == ["b.py", "c.py", "d.py"], state
    assert state["files"]["c.py"] == [None, None, None] and state["files"]["b.py"] == good[:3]
    # as the node runs it (its own process: a push holds the dest's lock until its process ends)
    r = subprocess.run([sys.executable, "-S", "-m", "remote.files.push"], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True,
                       input=_json.dumps({"op": "push", "dest": str(dest), "job": "j", "delete": ["b.py"]}) + "\n",
                       timeout=60)
    frames = [split_frame(line) for line in r.stdout.splitlines()]
    refused = next(_json.loads(f[1]) for f in frames if f and f[0] == "result")["data"]
    assert refused["foreign"] and not refused["match"] and (dest / "b.py").exists(), r.stdout + r.stderr
    done = push._push({"dest": str(dest), "files": [], "delete": ["b.py", "c.py", "a.py"]}, io.BytesIO(b""))
    assert sorted(done["kept_files"]) == ["b.py", "c.py"] and done["deleted"] == 1, done
    assert (dest / "b.py").exists() and (dest / "c.py").exists() and not (dest / "a.py").exists()
