"""Issue 19, findings 1-4: `dfo pull` does not trust the node.

What a node reports (its run id, the names and sizes it lists, the bytes and hashes it sends) is
checked before anything is written on this machine. Each test plays a hostile node on a private
testbed (real sshd nodes in their own namespaces): a run record written by hand on the node, or a
remote module in the node's agent cache replaced by a lying one that wraps the honest one. Every
local path a test touches lies under its tmp_path; the CLI runs with its cwd inside tmp_path.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import resource
import secrets
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.testbed import Node, Testbed
from tests._cli import dfo_argv
from tests._runs_fixtures import inventory_copy

pytestmark = pytest.mark.testbed

AGENTS = "/root/.cache/dfo/agent"
LIE = "/root/.dfo-lie"  # what the lying module does (read on the node at each call)

# remote/files/pull.py, lying: wraps the honest module (saved beside it as pull_honest.py) and writes
# its lies in the raw stream's own records (remote/files/pull.py, "The raw stream"), with h._Raw
LYING_PULLFILES = r'''
import hashlib, os, time
from . import pull_honest as h  # the honest module, saved beside this one
from remote._proto import serve

EVIL = b"[core]\n\tfsmonitor = touch /tmp/pwned\n"


def mode():
    try:
        with open("/root/.dfo-lie") as f:
            return f.read().strip()
    except OSError:
        return ""


def op_list(req):
    out = h.op_list(req)
    if mode() == "git":
        for rel in (".git/config", "sub/.git/hooks/post-checkout", ".GIT/config"):
            out["files"][rel] = [len(EVIL), 1]
    return out


def send_bytes(raw, i, chunks):
    hs = hashlib.sha256()
    n = 0
    for buf in chunks:
        hs.update(buf)
        raw.record(b"D", i, buf)
        raw.out.flush()
        n += 1
        with open("/tmp/dfo-lie-sent", "w") as f:
            f.write(str(n))
    raw.record(b"E", i, hs.digest())


def op_send(req):
    m = mode()
    files = req.get("files") or []
    if m not in ("oversize", "grow", "huge", "short", "git", "hold-end"):
        return h.op_send(req)
    raw = h._Raw(req["nonce"])
    try:
        if m == "oversize":  # every file: 60 MiB in records of 1 MiB, whatever its listed size
            for i, _ in enumerate(files):
                send_bytes(raw, i, (os.urandom(1 << 20) for _ in range(60)))
        if m == "grow":  # every file: 100 B (within its size), then 59 records of 1 MiB
            for i, _ in enumerate(files):
                send_bytes(raw, i, (os.urandom(100 if k == 0 else 1 << 20) for k in range(60)))
        if m == "huge":  # one record that announces 1 TiB, then 60 MiB of it
            for i, _ in enumerate(files):
                raw.out.write(h.HEADER.pack(b"D", i, 1 << 40))
                for n in range(60):
                    raw.out.write(os.urandom(1 << 20))
                    raw.out.flush()
                    with open("/tmp/dfo-lie-sent", "w") as f:
                        f.write(str(n + 1))
        if m == "short":  # every file: half of it, with the sha256 of that half
            for i, f in enumerate(files):
                with open(os.path.join(req["root"], f["path"]), "rb") as fh:
                    data = fh.read()
                send_bytes(raw, i, [data[: len(data) // 2]])
        if m == "git":
            rest = []
            for i, f in enumerate(files):
                if ".git" in f["path"].lower().split("/"):
                    send_bytes(raw, i, [EVIL])
                else:
                    rest.append((i, f))
            for i, f in rest:  # the honest ones, under their own index
                with open(os.path.join(req["root"], f["path"]), "rb") as fh:
                    send_bytes(raw, i, [fh.read()])
        if m == "hold-end":  # all the bytes, then the end record only once /tmp/dfo-go exists
            for i, f in enumerate(files):
                with open(os.path.join(req["root"], f["path"]), "rb") as fh:
                    data = fh.read()
                for k in range(0, len(data), 1 << 20):
                    raw.record(b"D", i, data[k:k + (1 << 20)])
                raw.out.flush()
                deadline = time.time() + 60
                while not os.path.exists("/tmp/dfo-go") and time.time() < deadline:
                    time.sleep(0.05)
                raw.record(b"E", i, hashlib.sha256(data).digest())
    finally:
        raw.end()
    return {"sent": len(files)}


OPS = dict(h.OPS, list=op_list, send=op_send)


def entry():  # how the controller starts the module (orchestrator/agent.py launch)
    serve(OPS)


if __name__ == "__main__":
    entry()
'''

# remote/runs/ops.py, lying: every run it describes carries the id written in /root/.dfo-lie
LYING_RUNS = r'''
from . import ops_honest as h  # the honest module, saved beside this one

_describe = h.describe


def describe(run_id, run_dir, tail=0, state=None):
    info = _describe(run_id, run_dir, tail, state)
    try:
        with open("/root/.dfo-lie") as f:
            info["id"] = f.read().rstrip("\n")
    except OSError:
        pass
    return info


h.describe = describe  # the ops look describe up in h's globals
OPS = h.OPS  # remote/runs/__main__.py serves remote.runs.ops.OPS
'''

LIARS = {"pullfiles": LYING_PULLFILES, "runs": LYING_RUNS}
WHERE = {"pullfiles": "files/pull", "runs": "runs/ops"}  # the module each replaces, under remote/


@pytest.fixture(scope="module")
def frozen_remote(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of remote/ that the CLI imports (PYTHONPATH): its agent hash, and so the agent folder on
    the node a lying module is put in, holds for the whole module while remote/ is being edited."""
    import shutil

    import remote

    top = tmp_path_factory.mktemp("frozen")
    shutil.copytree(Path(remote.__file__).parent, top / "remote", ignore=shutil.ignore_patterns("__pycache__"))
    return top


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    """Two private nodes (no S3): a lying module in their agent cache touches no other test's node."""
    from tests.conftest import start_testbed

    tb = start_testbed(tmp_path_factory.mktemp("hostile"), nodes=2, s3=False)
    try:
        if not tb.isolated:
            pytest.skip("needs nodes with their own /root and /workspace (network namespaces, as root)")
        yield tb
    finally:
        tb.stop()


class Env:
    def __init__(self, tb: Testbed, tmp: Path, frozen: Path) -> None:
        self.tb, self.tmp, self.frozen = tb, tmp, frozen
        self.inv = inventory_copy(tb, tmp)
        self.cwd = tmp / "cwd"
        self.cwd.mkdir()
        self.cache = tmp / "cache"

    def sh(self, node: Node, cmd: str) -> str:
        r = self.tb.node_exec(node, cmd, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def argv(self, *args: str) -> list[str]:
        return dfo_argv(self.inv, *args)

    def environ(self) -> dict[str, str]:
        return dict(os.environ, COLUMNS="200", XDG_CACHE_HOME=str(self.cache), PYTHONPATH=str(self.frozen))

    def dfo(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), cwd=self.cwd, capture_output=True, text=True, timeout=300,
                              env=self.environ(), **kw)

    def pull(self, *args: str, expect: int = 0, **kw: Any) -> dict[str, Any]:
        r = self.dfo("pull", *args, "--json", **kw)
        assert r.returncode == expect, r.stdout + r.stderr
        return json.loads(r.stdout)["hosts"]

    def fake_run(self, node: Node, run: str, files: dict[str, bytes | int]) -> str:
        """A run record on the node, by hand (a lost run: no processes), whose workdir holds ``files``
        (bytes, or a size in bytes of random data). Returns the workdir."""
        workdir = f"/root/w-{secrets.token_hex(4)}"
        meta = {"id": run, "job": run.rsplit("-", 3)[0], "started": "2026-01-01T00:00:00Z",
                "started_ts": time.time(), "workdir": workdir, "command": "true"}
        cmds = [f"mkdir -p /workspace/.dfo/runs/{run}",
                f"printf %s {shlex.quote(json.dumps(meta))} > /workspace/.dfo/runs/{run}/meta.json"]
        for rel, data in files.items():
            path = shlex.quote(f"{workdir}/{rel}")
            cmds.append(f"mkdir -p $(dirname {path})")
            if isinstance(data, int):
                cmds.append(f"head -c {data} /dev/urandom > {path}")
            else:
                cmds.append(f"printf %s {shlex.quote(base64.b64encode(data).decode())} | base64 -d > {path}")
        self.sh(node, " && ".join(cmds))
        return workdir

    def node_sha(self, node: Node, path: str) -> str:
        return self.sh(node, f"sha256sum {shlex.quote(path)}").split()[0]

    @contextlib.contextmanager
    def lie(self, node: Node, module: str, what: str) -> Iterator[None]:
        """remote/<module>.py replaced by its lying wrapper in every agent copy on the node, which
        does ``what`` (written to /root/.dfo-lie); the honest module is put back after."""
        r = self.dfo("status", "-H", node.name, "--json")  # the agent is on the node
        assert r.returncode == 0, r.stdout + r.stderr
        src = base64.b64encode(LIARS[module].encode()).decode()
        module = WHERE[module]
        self.sh(node, f"for d in {AGENTS}/*/remote; do [ -f $d/{module}_honest.py ] || cp $d/{module}.py "
                      f"$d/{module}_honest.py; printf %s {src} | base64 -d > $d/{module}.py; done; "
                      f"printf '%s\\n' {shlex.quote(what)} > {LIE}; rm -f /tmp/dfo-go /tmp/dfo-lie-sent")
        try:
            yield
        finally:
            self.sh(node, f"for d in {AGENTS}/*/remote; do [ -f $d/{module}_honest.py ] && "
                          f"mv $d/{module}_honest.py $d/{module}.py; done; rm -f {LIE}; true")


@pytest.fixture
def env(hostile: Testbed, tmp_path: Path, frozen_remote: Path) -> Env:
    return Env(hostile, tmp_path, frozen_remote)


def run_id() -> str:
    return f"tp-20260101-000000-{secrets.token_hex(2)}"


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".dfo" not in p.relative_to(root).parts)


# --------------------------------------------------------------------------- 1: the run id


def test_a_run_id_from_the_node_never_leads_outside_runs(env: Env, tmp_path: Path) -> None:
    """A node that reports the id '/…/victim_home' or '../../victim_home' (with or without RUN given), or
    an id other than the RUN asked for: exit 3 naming the host and the id (escaped), nothing written."""
    node = env.tb.nodes[0]
    victim = tmp_path / "victim_home" / ".ssh" / "authorized_keys"
    victim.parent.mkdir(parents=True)
    victim.write_text("my key\n")
    run = run_id()
    env.fake_run(node, run, {".ssh/authorized_keys": b"the node's key\n", "ok.txt": b"ok\n"})
    cases = [(str(tmp_path / "victim_home"), []), (str(tmp_path / "victim_home"), [run]),
             ("../../victim_home", []), ("../../victim_home", [run]), ("x\x1b[2J/../../victim_home", [run]),
             ("tp-20260101-000000-ffff", [run])]  # a well-formed id, but not the run asked for
    for evil, args in cases:
        with env.lie(node, "runs", evil):
            got = env.pull("-H", node.name, *args, expect=3)[node.name]
        err = got["error"]
        assert err["host"] == node.name and repr(evil) in err["message"], (evil, err)
        assert victim.read_text() == "my key\n"
        assert not (env.cwd / "runs").exists() and sorted(os.listdir(tmp_path / "victim_home")) == [".ssh"]
    # the same run, its id honest: into ./runs/RUN/
    got = env.pull("-H", node.name, run)[node.name]
    assert got["run"] == run and tree(env.cwd / "runs" / run) == [".ssh", ".ssh/authorized_keys", "ok.txt"]


def test_the_run_id_pattern_is_the_one_launch_uses() -> None:
    from orchestrator.steps.pull import RUN_ID
    from remote.runs.ops import RUN_ID_PATTERN

    assert RUN_ID.pattern == RUN_ID_PATTERN


# --------------------------------------------------------------------------- 2: gangs, the lock, the disk


def test_a_gang_pulls_each_host_into_its_own_folder(env: Env) -> None:
    """Every rank has the same run id: -H n1 -H n2 writes runs/ID/n1/ and runs/ID/n2/, each its node's bytes."""
    run = run_id()
    workdirs = {n.name: env.fake_run(n, run, {"ckpt.bin": 12 << 20, "same.txt": b"rank\n"}) for n in env.tb.nodes}
    got = env.pull(*[a for n in env.tb.nodes for a in ("-H", n.name)], run)
    for n in env.tb.nodes:
        assert got[n.name]["status"] == "done" and got[n.name]["fetched"] == 2, got
        d = env.cwd / "runs" / run / n.name
        assert got[n.name]["dest"] == str(Path("runs") / run / n.name)
        assert sha(d / "ckpt.bin") == env.node_sha(n, f"{workdirs[n.name]}/ckpt.bin")
    assert sorted(os.listdir(env.cwd / "runs" / run)) == sorted(n.name for n in env.tb.nodes)


def test_one_pull_at_a_time_per_folder(env: Env, tmp_path: Path) -> None:
    node = env.tb.nodes[0]
    run = run_id()
    env.fake_run(node, run, {"a.bin": 1 << 20})
    to = tmp_path / "got"
    (to / ".dfo").mkdir(parents=True)
    with open(to / ".dfo" / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another pull writing into the same folder
        err = env.pull("-H", node.name, run, "--to", str(to), expect=3)[node.name]["error"]
        assert "another dfo pull" in err["message"] and str(to) in err["message"], err
        assert tree(to) == []
    got = env.pull("-H", node.name, run, "--to", str(to))[node.name]
    assert got["fetched"] == 1 and tree(to) == ["a.bin"]


def test_the_sha256_is_checked_on_the_file_as_written_to_disk(env: Env, tmp_path: Path) -> None:
    """Bytes spoiled on disk after they arrived (another writer) are caught: the hash is not of memory."""
    node = env.tb.nodes[0]
    run = run_id()
    env.fake_run(node, run, {"ckpt.bin": 3 << 20})
    to = tmp_path / "got"
    with env.lie(node, "pullfiles", "hold-end"):
        proc = subprocess.Popen(env.argv("pull", "-H", node.name, run, "--to", str(to), "--json"), cwd=env.cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env.environ())
        try:
            part: Path | None = None
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and proc.poll() is None:
                parts = list((to / ".dfo" / "partial").glob("*.part")) if (to / ".dfo" / "partial").is_dir() else []
                if parts and parts[0].stat().st_size == 3 << 20:
                    part = parts[0]
                    break
                time.sleep(0.05)
            assert part is not None, "the whole file never arrived in its partial file"
            with open(part, "r+b") as f:
                f.seek(1000)
                f.write(b"spoiled here after it arrived")
            env.sh(node, "touch /tmp/dfo-go")
            out, errtext = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 3, out + errtext
    err = json.loads(out)["hosts"][node.name]["error"]
    assert "sha256" in err["message"] and "ckpt.bin" in err["message"], err
    assert tree(to) == [] and list((to / ".dfo" / "partial").glob("*.part")) == []


def _small_fsize() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))  # python ignores SIGXFSZ: writes fail EFBIG


def test_a_local_write_error_is_not_a_lost_connection(env: Env, tmp_path: Path) -> None:
    """A file this machine cannot write (here: a file size limit, EFBIG, as a full disk gives ENOSPC)
    is a local error naming the path, exit 3; never 'connection lost' (exit 4)."""
    node = env.tb.nodes[0]
    run = run_id()
    env.fake_run(node, run, {"big.bin": 8 << 20})
    to = tmp_path / "got"
    r = env.dfo("pull", "-H", node.name, run, "--to", str(to), "--json", preexec_fn=_small_fsize)
    assert r.returncode == 3, r.stdout + r.stderr
    err = json.loads(r.stdout)["hosts"][node.name]["error"]
    assert "connection lost" not in err["message"] and err["kind"] == "local", err
    assert str(to) in err["message"] and "big.bin" in err["message"] and "File too large" in err["message"], err
    assert not (to / "big.bin").exists()


def test_an_error_in_the_callers_event_handler_is_not_a_lost_connection(env: Env) -> None:
    """The transport itself: an OSError raised here by the caller's on_data (a local disk error) while the
    node's raw stream comes in comes out as itself, never as ConnectionLost (it was: the SSH read loop took
    every OSError for the link's)."""
    from orchestrator.agent import module_command, run_module
    from orchestrator.hosts import HostSession

    node = env.tb.nodes[0]
    wd = env.fake_run(node, run_id(), {"f.bin": 3 << 20})
    seen: list[int] = []

    def full(data: bytes) -> None:
        seen.append(len(data))
        raise OSError(errno.ENOSPC, "No space left on device")

    with HostSession(env.inv, [node.name]) as s:
        conn = s.conn(node.name)
        listed = run_module(conn, "remote.files.pull", {"op": "list", "root": wd, "paths": []}, timeout=60)
        size, mtime_ns = listed["files"]["f.bin"]
        req = {"op": "send", "root": wd, "nonce": "ab" * 16,
               "files": [{"path": "f.bin", "size": size, "mtime_ns": mtime_ns, "offset": 0}]}
        with pytest.raises(OSError) as got:
            conn.run_stream(module_command("remote.files.pull", conn.host.python), stdin=json.dumps(req),
                            on_data=full, timeout=60)
    assert got.value.errno == errno.ENOSPC and seen


# --------------------------------------------------------------------------- 3: sizes


@pytest.mark.parametrize("attack", ["oversize", "grow", "huge"])
def test_pull_stops_when_a_file_passes_its_listed_size(env: Env, tmp_path: Path, attack: str) -> None:
    """A node that lists 114 B and sends 60 MiB (records of 1 MiB; or 100 B first, within the size, then
    1 MiB records; or one record that announces 1 TiB): stopped at the first record header that would
    pass 114 B, before its bytes are read, exit 3 naming the host and the file, no partial file kept."""
    node = env.tb.nodes[0]
    run = run_id()
    env.fake_run(node, run, {"small.txt": b"x" * 114})
    to = tmp_path / "got"
    with env.lie(node, "pullfiles", attack):
        got = env.pull("-H", node.name, run, "--to", str(to), expect=3)[node.name]
        sent = int(env.sh(node, "cat /tmp/dfo-lie-sent 2>/dev/null || echo 0").strip() or 0)
    err = got["error"]
    assert err["host"] == node.name and "small.txt" in err["message"] and "114" in err["message"], err
    assert sent < 60, f"the node sent all {sent} MiB: the transfer was not stopped"
    assert tree(to) == [] and list((to / ".dfo" / "partial").iterdir()) == []


def test_pull_requires_the_exact_size(env: Env, tmp_path: Path) -> None:
    """Fewer bytes than listed, with a sha256 that matches them: still refused (exit 3), nothing kept."""
    node = env.tb.nodes[0]
    run = run_id()
    env.fake_run(node, run, {"half.bin": 1 << 20})
    to = tmp_path / "got"
    with env.lie(node, "pullfiles", "short"):
        got = env.pull("-H", node.name, run, "--to", str(to), expect=3)[node.name]
    assert "half.bin" in got["error"]["message"], got
    assert tree(to) == [] and list((to / ".dfo" / "partial").iterdir()) == []


# --------------------------------------------------------------------------- 4: local files


def test_a_git_name_from_the_node_is_refused(env: Env, tmp_path: Path) -> None:
    """Pulling into a git work tree: a node listing .git/config (any .git component, any case) has
    those names refused and said; .git/config stays ours; the honest files arrive."""
    node = env.tb.nodes[0]
    run = run_id()
    env.fake_run(node, run, {"model.bin": b"weights\n"})
    to = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(to)], check=True)
    before = (to / ".git" / "config").read_bytes()
    with env.lie(node, "pullfiles", "git"):
        got = env.pull("-H", node.name, run, "--to", str(to))[node.name]
        human = env.dfo("pull", "-H", node.name, run, "--to", str(to))
    assert (to / ".git" / "config").read_bytes() == before
    assert not (to / "sub").exists() and not (to / ".GIT").exists()
    assert (to / "model.bin").read_bytes() == b"weights\n"
    assert got["refused"] == 3, got
    assert got["refused_files"] == [".GIT/config", ".git/config", "sub/.git/hooks/post-checkout"]
    assert human.returncode == 0 and "3 names with a .git component refused" in " ".join(human.stdout.split())


def test_every_spelling_of_git_is_refused() -> None:
    from orchestrator.steps.pullsink import is_git

    for rel in (".git/config", "a/.GIT/HEAD", ".g\u200cit/config", ".git./config", ".git /config", "GIT~1/config"):
        assert is_git(rel), rel
    for rel in ("git/x", ".github/workflows/ci.yml", ".gitignore", "x.git", "a/b.git/c"):
        assert not is_git(rel), rel


def test_pull_never_replaces_a_local_file_it_did_not_write(env: Env, tmp_path: Path) -> None:
    """A file here that the pull manifest does not list, or that changed since dfo wrote it, is kept
    (and said) unless --overwrite; a symlinked folder inside DIR is never written through."""
    node = env.tb.nodes[0]
    run = run_id()
    wd = env.fake_run(node, run, {"notes.txt": b"node notes\n", "b.txt": b"node b\n", "sub/c.txt": b"node c\n"})
    to = tmp_path / "got"
    to.mkdir()
    (to / "notes.txt").write_text("my notes\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (to / "sub").symlink_to(elsewhere)
    got = env.pull("-H", node.name, run, "--to", str(to))[node.name]
    assert (to / "notes.txt").read_text() == "my notes\n" and (to / "b.txt").read_text() == "node b\n"
    assert os.listdir(elsewhere) == []
    assert (got["fetched"], got["kept"], got["kept_files"]) == (1, 2, ["notes.txt", "sub/c.txt"]), got
    # b.txt changed here since dfo wrote it, and on the node: kept
    (to / "b.txt").write_text("my edit\n")
    env.sh(node, f"echo more >> {wd}/b.txt")
    got = env.pull("-H", node.name, run, "--to", str(to))[node.name]
    assert (to / "b.txt").read_text() == "my edit\n" and got["kept_files"] == ["b.txt", "notes.txt", "sub/c.txt"]
    human = env.dfo("pull", "-H", node.name, run, "--to", str(to))
    text = " ".join(human.stdout.split())
    assert human.returncode == 0 and "3 files kept here" in text and "b.txt, notes.txt, sub/c.txt" in text, text
    # --overwrite: the node's files replace them; still nothing through the symlinked folder
    got = env.pull("-H", node.name, run, "--to", str(to), "--overwrite")[node.name]
    assert (to / "notes.txt").read_text() == "node notes\n" and (to / "b.txt").read_text() == "node b\nmore\n"
    assert os.listdir(elsewhere) == [] and got["kept_files"] == ["sub/c.txt"], got
    # and a file dfo wrote, unchanged here, is replaced when the node's changes (no --overwrite needed)
    env.sh(node, f"echo again >> {wd}/b.txt")
    got = env.pull("-H", node.name, run, "--to", str(to))[node.name]
    assert (to / "b.txt").read_text() == "node b\nmore\nagain\n" and got["fetched"] == 1, got
