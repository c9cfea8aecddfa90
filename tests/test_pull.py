"""dfo pull against a real testbed node: verified, only what changed, resumable."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.testbed import Testbed
from tests import _cli
from tests._runs_fixtures import dfo, inventory_copy

WRITER = """\
import os
os.makedirs("out/sub", exist_ok=True)
open("out/ckpt.bin", "wb").write(os.urandom(3 << 20))
open("out/sub/with space 'q' $(x).txt", "w").write("odd\\n")
open("out/.dfo-private", "w").write("never pulled\\n")
os.symlink("ckpt.bin", "out/latest")
print("wrote", flush=True)
"""


class PullEnv:
    def __init__(self, tb: Testbed, tmp: Path) -> None:
        self.tb, self.tmp, self.node = tb, tmp, tb.nodes[0]
        self.inv = inventory_copy(tb, tmp)
        self.workdir = f"/root/pull-{secrets.token_hex(3)}"
        src = tmp / "src"
        src.mkdir()
        (src / "writer.py").write_text(WRITER)
        self.job = tmp / "job.yaml"
        self.job.write_text(yaml.safe_dump({
            "name": f"p-{secrets.token_hex(3)}", "venv": "/usr", "code": {"source": "src"},
            "run": {"workdir": self.workdir, "command": "python3 writer.py", "wait": 0}}))
        r = dfo(self.inv, "launch", "-H", self.node.name, "-j", str(self.job), "--json",
                env={"XDG_CACHE_HOME": str(tmp / "cache")})
        assert r.returncode == 0, r.stderr
        self.run = json.loads(r.stdout)["hosts"][self.node.name]["run"]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = dfo(self.inv, "status", "-H", self.node.name, self.run, "--json")
            if json.loads(st.stdout)["hosts"][self.node.name]["runs"][0]["state"] != "running":
                break
            time.sleep(0.3)

    def pull(self, *args: str, expect: int = 0) -> dict[str, Any]:
        r = dfo(self.inv, "pull", "-H", self.node.name, *args, "--json", timeout=300)
        assert r.returncode == expect, r.stdout + r.stderr
        return json.loads(r.stdout)["hosts"][self.node.name]

    def node_sha(self, rel: str) -> str:
        r = self.tb.node_exec(self.node, f"sha256sum {self.workdir}/{rel}")
        assert r.returncode == 0, r.stderr
        return r.stdout.split()[0]


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture
def penv(testbed: Testbed, tmp_path: Path) -> PullEnv:
    return PullEnv(testbed, tmp_path)


def test_pull_verified_only_changes(penv: PullEnv, tmp_path: Path) -> None:
    to = tmp_path / "got"
    r = penv.pull(penv.run, "--to", str(to))
    assert r["status"] == "done" and r["run"] == penv.run and r["links_skipped"] == 1
    got = sorted(str(p.relative_to(to)) for p in to.rglob("*") if p.is_file() and ".dfo" not in p.parts)
    assert got == ["out/ckpt.bin", "out/sub/with space 'q' $(x).txt", "writer.py"]
    assert sha(to / "out/ckpt.bin") == penv.node_sha("out/ckpt.bin")
    again = penv.pull(penv.run, "--to", str(to))
    assert (again["status"], again["fetched"], again["bytes"], again["skipped"]) == ("no change", 0, 0, 3)
    penv.tb.node_exec(penv.node, f"echo more >> {penv.workdir}/writer.py")
    one = penv.pull(penv.run, "--to", str(to))
    assert (one["fetched"], one["skipped"]) == (1, 2)
    assert sha(to / "writer.py") == penv.node_sha("writer.py")
    narrow = penv.pull(penv.run, "out/sub", "--to", str(tmp_path / "narrow"))
    assert narrow["fetched"] == 1 and (tmp_path / "narrow/out/sub/with space 'q' $(x).txt").read_text() == "odd\n"
    # the default DIR is ./runs/RUN/ under the current folder
    r = _cli.dfo(penv.inv, "pull", "-H", penv.node.name, penv.run, "out/ckpt.bin", cwd=tmp_path, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert sha(tmp_path / "runs" / penv.run / "out/ckpt.bin") == penv.node_sha("out/ckpt.bin")
    bad = penv.pull(penv.run, "../etc", "--to", str(tmp_path / "x"), expect=2)
    assert "without '..'" in bad["error"]["message"]


def test_pull_resumes_and_checks_the_whole_file(penv: PullEnv, tmp_path: Path) -> None:
    big = f"{penv.workdir}/out/big.bin"
    assert penv.tb.node_exec(penv.node, f"head -c 4M /dev/urandom > {big} && truncate -s 400M {big}").returncode == 0
    to = tmp_path / "got"
    argv = _cli.dfo_argv(penv.inv, "pull", "-H", penv.node.name, penv.run, "out/big.bin", "--to", str(to), "--json")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    parts = to / ".dfo" / "partial"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        held = [p for p in parts.glob("*.part")] if parts.exists() else []
        if held and held[0].stat().st_size >= 20 << 20:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the pull finished before it could be interrupted"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    held = list(parts.glob("*.part"))
    assert len(held) == 1 and 0 < held[0].stat().st_size < 400 << 20
    # a partial file spoiled here is caught by the whole-file sha256 on arrival: exit 3, then a clean retry
    with open(held[0], "r+b") as f:
        f.write(b"spoiled!")
    bad = penv.pull(penv.run, "out/big.bin", "--to", str(to), expect=3)
    assert "sha256" in bad["error"]["message"] and not (to / "out/big.bin").exists()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        held = list(parts.glob("*.part")) if parts.exists() else []
        if held and held[0].stat().st_size >= 20 << 20:
            break
        time.sleep(0.02)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    have = list(parts.glob("*.part"))[0].stat().st_size
    r = penv.pull(penv.run, "out/big.bin", "--to", str(to))
    assert r["resumed"] == 1 and r["bytes"] == (400 << 20) - have
    assert sha(to / "out/big.bin") == penv.node_sha("out/big.bin")
    assert list(parts.glob("*.part")) == []


@pytest.mark.usefixtures("each_ssh_transport")
def test_pull_streams_raw_bytes_on_each_ssh_transport(penv: PullEnv, tmp_path: Path) -> None:
    """The raw stream on the OpenSSH and the paramiko transport: an empty file, a file of an odd size
    (not a whole number of records) and the rest arrive as the node has them, each checked."""
    wd = penv.workdir
    r = penv.tb.node_exec(penv.node, f": > {wd}/out/empty.bin && head -c 5000001 /dev/urandom > {wd}/out/odd.bin")
    assert r.returncode == 0, r.stderr
    to = tmp_path / "got"
    got = penv.pull(penv.run, "out", "--to", str(to))
    rels = ["out/ckpt.bin", "out/empty.bin", "out/odd.bin", "out/sub/with space 'q' $(x).txt"]
    assert got["fetched"] == 4 and got["bytes"] == (3 << 20) + 5000001 + 4, got
    for rel in rels:
        r = penv.tb.node_exec(penv.node, f"sha256sum {shlex.quote(f'{wd}/{rel}')}")
        assert r.returncode == 0 and sha(to / rel) == r.stdout.split()[0], rel
    assert (to / "out/empty.bin").stat().st_size == 0


OUT_WRITER = """\
import os, sys
os.makedirs(os.path.join(sys.argv[1], "sub"), exist_ok=True)
open(os.path.join(sys.argv[1], "ckpt-1.bin"), "wb").write(os.urandom(200000))
open(os.path.join(sys.argv[1], "sub", "opt.txt"), "w").write("opt\\n")
open("in-workdir.txt", "w").write("not an output\\n")
print("wrote", flush=True)
"""


def test_pull_without_job_defaults_to_the_runs_outputs_path(testbed: Testbed, tmp_path: Path) -> None:
    """A run with outputs: pull -H HOST RUN (no -j) fetches outputs.path, as the run's record on the node says."""
    if testbed.s3 is None or not testbed.isolated:
        pytest.skip("needs the testbed's S3 server and nodes with their own /workspace")
    node, s3 = testbed.nodes[0], testbed.s3
    inv = inventory_copy(testbed, tmp_path)
    tag = secrets.token_hex(3)
    bucket, base, workdir = f"pull-{tag}", f"/workspace/pullout-{tag}", f"/root/pullout-{tag}"
    s3.create_bucket(bucket)
    src = tmp_path / "src"
    src.mkdir()
    (src / "writer.py").write_text(OUT_WRITER)
    name = f"po-{tag}"
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "name": name, "venv": "/usr", "code": {"source": "src"},
        "s3": {"endpoint_url": s3.url, "region": s3.region},
        "outputs": {"path": f"{base}/{{name}}", "dest": f"s3://{bucket}/runs/{{name}}/", "every": 1, "settle": 0},
        "run": {"workdir": workdir, "command": f"python3 writer.py {base}/{name}", "wait": 0}}))
    env = {"AWS_ACCESS_KEY_ID": s3.access_key, "AWS_SECRET_ACCESS_KEY": s3.secret_key,
           "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    try:
        r = dfo(inv, "launch", "-H", node.name, "-j", str(job), "--json", env=env)
        assert r.returncode == 0, r.stderr
        run = json.loads(r.stdout)["hosts"][node.name]["run"]
        r = dfo(inv, "tail", "-H", node.name, run, timeout=120, env=env)  # until the run and its last pass end
        assert r.returncode == 0, r.stdout + r.stderr
        to = tmp_path / "got"
        r = dfo(inv, "pull", "-H", node.name, run, "--to", str(to), "--json", timeout=300)  # no -j
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)["hosts"][node.name]
        assert doc["source"] == f"{base}/{name}" and doc["fetched"] == 2, doc
        got = sorted(str(p.relative_to(to)) for p in to.rglob("*") if p.is_file() and ".dfo" not in p.parts)
        assert got == ["ckpt-1.bin", "sub/opt.txt"]
        on_node = testbed.node_exec(node, f"sha256sum {base}/{name}/ckpt-1.bin")
        assert on_node.returncode == 0 and sha(to / "ckpt-1.bin") == on_node.stdout.split()[0]
        # the newest run (no RUN, no -j) into ./runs/RUN/: the same files
        r = _cli.dfo(inv, "pull", "-H", node.name, cwd=tmp_path, env=dict(os.environ))
        assert r.returncode == 0, r.stderr
        assert sha(tmp_path / "runs" / run / "ckpt-1.bin") == on_node.stdout.split()[0]
        assert not (tmp_path / "runs" / run / "in-workdir.txt").exists()
    finally:
        testbed.node_exec(node, f"rm -rf {base} {workdir}")


def test_reports_say_1_file_not_1_files(capsys: pytest.CaptureFixture[str]) -> None:
    """The shared report printer (sync-data, stage-model, sync-code), pull's and the shipper's pass line."""
    from orchestrator.commands.code import render_pull
    from orchestrator.commands.report_view import print_moved
    from orchestrator.steps.pull import PullReport
    from orchestrator.steps.report import MoveReport
    from remote.ship.shipper import describe

    def text(fn: Any) -> str:
        capsys.readouterr()
        fn()
        return " ".join(capsys.readouterr().out.split())

    one = dict(host="n1", status="done", fetched=1, skipped=0, bytes=10, seconds=1.0, mb_per_s=0.0, dest="d",
               source="s", files_total=1, bytes_total=10)
    out = text(lambda: print_moved("n1", "sync-data", MoveReport(**one)))
    assert "fetched 1 file (10 B)," in out, out
    out = text(lambda: print_moved("n1", "sync-data", MoveReport(**{**one, "status": "no change", "fetched": 0})))
    assert "no change: 1 file (10 B) in d" in out, out
    out = text(lambda: print_moved("n1", "sync-data", MoveReport(**{**one, "fetched": 2, "files_total": 2})))
    assert "fetched 2 files (10 B)," in out, out
    out = text(lambda: render_pull("n1", PullReport(**one, run="r1")))
    assert "fetched 1 file (10 B)," in out, out
    out = text(lambda: render_pull("n1", PullReport(**{**one, "status": "no change", "fetched": 0}, run="r1")))
    assert "no change: 1 file (10 B) in d" in out, out
    p = {"ok": True, "n": 3, "files": 1, "bytes": 10, "seconds": 0.5, "pending": 0}
    assert describe(p, "s3://b/") == "pass 3: shipped 1 file (10 B) to s3://b/ in 0.5 s"
    assert describe({**p, "files": 2}, "s3://b/").startswith("pass 3: shipped 2 files (10 B)")


def test_a_node_that_loses_dfos_code_between_list_and_send_gets_it_on_the_stream_call(
        penv: PullEnv, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw stream runs its command itself: a node whose agent folder went away after the list call
    answers NEED_UPLOAD, and the send is made again with dfo's code carried on its stdin, once."""
    from orchestrator.config.models import load_inventory
    from orchestrator.steps import pull as steps_pull
    from orchestrator.transport import open_connection
    from orchestrator.transport.resolve import resolve_host

    if not penv.tb.isolated:
        pytest.skip("needs the testbed's network namespaces (the node's /root is its own)")
    inv, path = load_inventory(penv.inv)
    conn = open_connection(resolve_host(inv, penv.node.name, path))
    real_send, calls = steps_pull.send, []

    def send_after_losing_the_code(*a: Any, **kw: Any) -> Any:
        r = conn.run("rm -rf ~/.cache/dfo/agent && echo gone", timeout=60)  # the node's own home
        assert r.stdout.strip() == "gone", r.stderr
        calls.append(1)
        return real_send(*a, **kw)

    monkeypatch.setattr(steps_pull, "send", send_after_losing_the_code)
    try:
        to = tmp_path / "got"
        rep = steps_pull.pull(conn, run=penv.run, paths=[], to=str(to), loaded=None)
    finally:
        conn.close()
    assert calls == [1]
    assert rep.fetched >= 2, rep
    assert sha(to / "out" / "ckpt.bin") == penv.node_sha("out/ckpt.bin")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="F_SETPIPE_SZ is Linux's")
def test_the_nodes_send_grows_its_stdout_pipe(tmp_path: Path) -> None:
    """The node's send writes 1 MiB records into the pipe to sshd: it grows that pipe to a record's size
    first (64 KiB by default), which cut a 1 GiB pull's CPU here by about a sixth (docs/benchmarks.md, pull)."""
    import fcntl

    from remote.files.pull import CHUNK

    with open("/proc/sys/fs/pipe-max-size") as f:
        if int(f.read()) < CHUNK and os.geteuid() != 0:
            pytest.skip("pipe-max-size is below a record's size here")
    src = tmp_path / "f.bin"
    src.write_bytes(os.urandom(3 << 20))
    st = src.stat()
    req = {"op": "send", "root": str(tmp_path), "nonce": "ab" * 8,
           "files": [{"path": "f.bin", "size": st.st_size, "mtime_ns": st.st_mtime_ns, "offset": 0}]}
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, "-S", "-m", "remote.files.pull"], cwd=root, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(req).encode())
    proc.stdin.close()
    out = proc.stdout.read()
    size = fcntl.fcntl(proc.stdout.fileno(), getattr(fcntl, "F_GETPIPE_SZ", 1032))
    proc.wait(30)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    assert size >= CHUNK, size  # a new pipe holds 64 KiB
    assert out.count(b"@@DFO-RAW@@ " + b"ab" * 8) == 1 and len(out) > 3 << 20
