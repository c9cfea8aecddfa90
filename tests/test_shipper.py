"""The outputs shipper (remote/ship/shipper.py): the process protocol, the settle rule, what is skipped, the
bookkeeping, against the testbed's real S3 server. The shipper is stdlib node code: it runs here, as a
process (spec on stdin) or in-process (run_pass), talking to the testbed's S3 over the network."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.testbed import S3Endpoint, Testbed
from remote.ship import shipper
from remote.ship.scan import Includer, renamed, settled

pytestmark = pytest.mark.testbed
REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


@pytest.fixture
def s3(testbed: Testbed) -> S3Endpoint:
    assert testbed.s3 is not None
    return testbed.s3


@pytest.fixture
def bucket(s3: S3Endpoint) -> str:
    name = "ship-" + secrets.token_hex(4)
    s3.create_bucket(name)
    return name


def make_spec(s3: S3Endpoint, root: Path, dest: str, **over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "path": str(root), "dest": dest, "every": 300, "settle": 10, "include": ["**"], "cpu": 2.0,
        "endpoint_url": s3.url, "region": s3.region, "credentials_mode": "controller",
        "credentials": {"access_key": s3.access_key, "secret_key": s3.secret_key, "session_token": None},
        "profile": None, "concurrency": 4, "part_size_mb": 5, "multipart_threshold_mb": 8}
    spec.update(over)
    return spec


def objects(s3: S3Endpoint, bucket: str, prefix: str = "") -> dict[str, bytes]:
    c = s3.client()
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = c.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def age(path: Path, seconds: float) -> None:
    """Make a file look written ``seconds`` ago (mtime; its ctime stays now, later than mtime: touch's
    utimes is a metadata change, which the settle rule treats like a rename, so also older on purpose)."""
    t = time.time() - seconds
    os.utime(path, (t, t))


def outputs_json(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "outputs.json").read_text())


def node_python() -> str:
    """A python3.8 when this machine has one (the oldest a node may have), else this Python."""
    import glob

    for exe in sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8"))):
        r = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == "(3, 8)":
            return exe
    return sys.executable


class ShipperProc:
    python = None

    def __init__(self, run_dir: Path, spec: dict[str, Any]) -> None:
        self.run_dir = run_dir
        if ShipperProc.python is None:
            ShipperProc.python = node_python()
        self.proc = subprocess.Popen([ShipperProc.python, "-m", "remote.ship.shipper", str(run_dir)], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()

    def say(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((word + "\n").encode())
        self.proc.stdin.flush()

    def passes(self) -> int:
        try:
            return int(outputs_json(self.run_dir).get("passes") or 0)
        except (OSError, ValueError):
            return 0

    def wait_passes(self, n: int, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.passes() >= n and outputs_json(self.run_dir)["state"] != "shipping":
                return outputs_json(self.run_dir)
            assert self.proc.poll() is None, self.proc.communicate()
            time.sleep(0.05)
        raise AssertionError(f"fewer than {n} passes in {timeout}s: {outputs_json(self.run_dir)}")

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out.decode(), err.decode()


@pytest.fixture
def procs() -> Iterator[list[ShipperProc]]:
    made: list[ShipperProc] = []
    yield made
    for p in made:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


def test_the_process_protocol(s3: S3Endpoint, bucket: str, tmp_path: Path, procs: list[ShipperProc]) -> None:
    root, run_dir = tmp_path / "ckpt", tmp_path / "run"
    root.mkdir()
    run_dir.mkdir()
    (root / "step-1").mkdir()
    (root / "step-1" / "model.pt").write_bytes(os.urandom(300_000))
    age(root / "step-1" / "model.pt", 60)
    (root / ".dfo-private").write_bytes(b"never ships")
    spec = make_spec(s3, root, f"s3://{bucket}/runs/j1")  # no trailing slash: one is added
    sp = ShipperProc(run_dir, spec)
    procs.append(sp)
    doc = sp.wait_passes(1)
    assert doc["pid"] == sp.proc.pid and doc["state"] == "idle" and doc["dest"] == spec["dest"]
    for what in ("cmdline", "environ"):  # the credentials came on stdin: not in argv, not in the environment
        assert s3.secret_key.encode() not in Path(f"/proc/{sp.proc.pid}/{what}").read_bytes()
    assert doc["last_pass"]["status"] == "shipped" and doc["last_pass"]["files"] == 1
    assert doc["shipped"] == {"files": 1, "bytes": 300_000} and doc["lag_s"] == 0.0 and doc["errors"] == []
    got = objects(s3, bucket)
    assert set(got) == {"runs/j1/step-1/model.pt"}
    assert got["runs/j1/step-1/model.pt"] == (root / "step-1" / "model.pt").read_bytes()
    head = s3.client().head_object(Bucket=bucket, Key="runs/j1/step-1/model.pt")
    assert head["Metadata"]["sha256"] == hashlib.sha256(got["runs/j1/step-1/model.pt"]).hexdigest()

    # a pass on request ("ship"): nothing new -> no change; a new file written just now waits to settle
    (root / "step-2.pt").write_bytes(b"x" * 1000)
    sp.say("ship")
    doc = sp.wait_passes(2)
    assert doc["last_pass"]["status"] == "no change" and doc["last_pass"]["pending"] == 1
    assert doc["pending"] == 1 and "runs/j1/step-2.pt" not in objects(s3, bucket)
    # SIGUSR1 asks for a pass too
    os.kill(sp.proc.pid, signal.SIGUSR1)
    sp.wait_passes(3)
    # "final": the last pass ships what waits to settle (nothing holds it open), then exit 0
    sp.say("final")
    rc, out, err = sp.finish()
    assert rc == 0, (out, err)
    doc = outputs_json(run_dir)
    assert doc["state"] == "done" and doc["final"]["final"] is True and doc["final"]["files"] == 1
    assert doc["passes"] == 4 and doc["failed_passes"] == 0
    assert objects(s3, bucket)["runs/j1/step-2.pt"] == b"x" * 1000
    assert "pass 1: shipped 1 file (" in out and "pass 4: shipped 1 file (" in out
    # bookkeeping: shipped.json under PATH/.dfo, never shipped itself; no secret anywhere on disk
    rec = json.loads((root / ".dfo" / "shipped.json").read_text())["files"]
    assert set(rec) == {"step-1/model.pt", "step-2.pt"}
    assert all(not k.split("/")[-1].startswith(".dfo") and "/.dfo/" not in k for k in objects(s3, bucket))
    for f in list(run_dir.rglob("*")) + list((root / ".dfo").rglob("*")):
        if f.is_file():
            assert s3.secret_key not in f.read_text(errors="replace"), f
    # a pass made later in another process (dfo outputs --ship, no live shipper) does not undo "done",
    # nor take the shipper's pid
    (root / "late.bin").write_bytes(b"late")
    age(root / "late.bin", 60)
    p = shipper.run_pass(spec, str(run_dir))
    assert (p["ok"], p["files"], p["n"]) == (True, 1, 5)
    doc = outputs_json(run_dir)
    assert (doc["state"], doc["pid"], doc["passes"], doc["final"]["n"]) == ("done", sp.proc.pid, 5, 4)


def test_eof_on_stdin_is_the_last_pass_and_a_failed_one_exits_1(s3: S3Endpoint, tmp_path: Path,
                                                                 procs: list[ShipperProc]) -> None:
    root, run_dir = tmp_path / "ckpt", tmp_path / "run"
    root.mkdir()
    run_dir.mkdir()
    (root / "a.bin").write_bytes(b"a" * 10)
    age(root / "a.bin", 60)
    wrong = "wrong-" + secrets.token_hex(8)
    spec = make_spec(s3, root, "s3://ship-" + secrets.token_hex(3) + "/x/",
                     credentials={"access_key": s3.access_key, "secret_key": wrong})
    sp = ShipperProc(run_dir, spec)
    procs.append(sp)
    doc = sp.wait_passes(1)
    assert doc["state"] == "idle" and doc["last_pass"]["ok"] is False and doc["failed_passes"] == 1
    assert "SignatureDoesNotMatch" in doc["errors"][-1]["error"] and "HTTP 403" in doc["errors"][-1]["error"]
    assert wrong not in (run_dir / "outputs.json").read_text()
    assert 59 <= doc["lag_s"] < 120  # the settled file not shipped was written 60 s ago
    assert sp.proc.stdin is not None
    sp.proc.stdin.close()
    rc, out, _ = sp.proc.wait(timeout=60), (sp.proc.stdout.read().decode() if sp.proc.stdout else ""), None
    assert rc == 1
    doc = outputs_json(run_dir)
    assert doc["state"] == "failed" and doc["final"]["ok"] is False and doc["passes"] == 2
    assert "FAILED" in out and wrong not in out


def test_run_pass_in_process_then_no_change(s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    root, run_dir = tmp_path / "ckpt", tmp_path / "run"
    root.mkdir()
    run_dir.mkdir()
    for i in range(5):
        (root / f"f{i}.bin").write_bytes(os.urandom(1000 + i))
        age(root / f"f{i}.bin", 60)
    spec = make_spec(s3, root, f"s3://{bucket}/p/")
    p = shipper.run_pass(spec, str(run_dir))
    assert (p["ok"], p["status"], p["files"], p["bytes"]) == (True, "shipped", 5, sum(1000 + i for i in range(5)))
    assert set(p) >= {"n", "started", "ended", "seconds", "final", "skipped", "pending", "changed_during",
                      "mb_per_s", "error"}
    p2 = shipper.run_pass(spec, str(run_dir))
    assert (p2["ok"], p2["status"], p2["files"], p2["n"]) == (True, "no change", 0, 2)
    doc = outputs_json(run_dir)
    assert doc["passes"] == 2 and doc["shipped"]["files"] == 5


def test_a_missing_path_or_no_dest_is_no_change(s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    p = shipper.run_pass(make_spec(s3, tmp_path / "absent", f"s3://{bucket}/p/"), str(run_dir))
    assert (p["ok"], p["status"]) == (True, "no change")
    p = shipper.run_pass(make_spec(s3, tmp_path, None), str(run_dir))
    assert (p["ok"], p["status"]) == (True, "no change")


# --------------------------------------------------------------------------- pure logic


class _St:
    def __init__(self, mtime: float, ctime: float) -> None:
        self.st_mtime_ns, self.st_ctime_ns = int(mtime * 1e9), int(ctime * 1e9)
        self.st_dev, self.st_ino = 1, 42


def test_the_settle_rule() -> None:
    now = 1000 * 10**9
    never = lambda: set()  # noqa: E731
    held = lambda: {(1, 42)}  # noqa: E731
    assert settled(_St(980, 980), now, 10, never)  # unchanged for 20 s
    assert not settled(_St(995, 995), now, 10, never)  # written 5 s ago
    assert settled(_St(995, 998), now, 10, never)  # renamed into place after its last write
    assert not settled(_St(995, 998), now, 10, held)  # ... but still open for writing somewhere
    assert not settled(_St(980, 995), now, 10, held)  # its ctime counts for "unchanged" too
    assert not settled(_St(980, 999.5), now, 10, held)
    assert settled(_St(995, 995), now, 10, never, moved=True)  # renamed within the write's clock tick
    assert not settled(_St(995, 995), now, 10, held, moved=True)


def test_renamed_tells_a_rename_by_the_inode() -> None:
    st = _St(995, 995)  # inode (1, 42)
    assert not renamed("a", st, None, set())  # no scan before this one
    assert renamed("a", st, {(1, 42): "a.tmp"}, {"a.tmp"})  # the inode had another name
    assert renamed("a", st, {(1, 7): "a"}, {"a"})  # the name had another inode
    assert not renamed("a", st, {(1, 42): "a"}, {"a"})  # the same file as before
    assert not renamed("a", st, {(1, 7): "b"}, {"b"})  # a new name, a new inode: written in place


def test_include_patterns() -> None:
    inc = Includer(["**"])
    assert inc.included("a/b/c.pt") and inc.included("x")
    inc = Includer(["*.pt", "!tmp/", "logs/"])
    assert inc.included("a/b/c.pt") and inc.included("c.pt") and not inc.included("c.txt")
    assert not inc.included("tmp/c.pt") and inc.included("logs/x.txt")
    inc = Includer(["/top.bin"])
    assert inc.included("top.bin") and not inc.included("a/top.bin")


# --------------------------------------------------------------------------- what is skipped, what never ships


@pytest.mark.parametrize("lookup", ["head", "list"])
def test_a_fresh_node_skips_what_dest_already_holds(s3: S3Endpoint, bucket: str, tmp_path: Path, lookup: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if lookup == "list":  # a restore put many files back: one listing, not a HEAD each
        monkeypatch.setattr(shipper, "HEAD_AT_MOST", 0)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "sub").mkdir()
    files = {"small.bin": os.urandom(1000), "sub/big.bin": os.urandom(13 * MIB), "c.bin": os.urandom(500)}
    for rel, data in files.items():
        (a / rel).write_bytes(data)
        age(a / rel, 60)
    dest = f"s3://{bucket}/r/"
    p = shipper.run_pass(make_spec(s3, a, dest), str(tmp_path))
    assert (p["ok"], p["files"]) == (True, 3), p
    # node B after a restore: the same bytes, new inodes, no .dfo/shipped.json; c.bin differs (same size)
    (b / "sub").mkdir(parents=True)
    for rel, data in files.items():
        (b / rel).write_bytes(os.urandom(500) if rel == "c.bin" else data)
        age(b / rel, 60)
    run_b = tmp_path / "run-b"
    run_b.mkdir()
    p = shipper.run_pass(make_spec(s3, b, dest), str(run_b))
    assert (p["ok"], p["files"], p["skipped"]) == (True, 1, 2), p  # only c.bin travelled
    assert objects(s3, bucket, "r/c.bin")["r/c.bin"] == (b / "c.bin").read_bytes()
    rec = json.loads((b / ".dfo" / "shipped.json").read_text())["files"]
    assert set(rec) == set(files) and rec["sub/big.bin"]["etag"].endswith("-3")
    p = shipper.run_pass(make_spec(s3, b, dest), str(run_b))
    assert (p["files"], p["skipped"], p["status"]) == (0, 0, "no change"), p
    # a file deleted on the node is forgotten (nothing is deleted on S3)
    (b / "small.bin").unlink()
    shipper.run_pass(make_spec(s3, b, dest), str(run_b))
    assert "small.bin" not in json.loads((b / ".dfo" / "shipped.json").read_text())["files"]
    assert "r/small.bin" in objects(s3, bucket, "r/small.bin")


@pytest.mark.parametrize("with_sha", [True, False])
def test_an_object_another_tool_uploaded(s3: S3Endpoint, bucket: str, tmp_path: Path, with_sha: bool) -> None:
    """Uploaded in 5 MiB parts by boto3 (as aws s3 cp would): its ETag cannot be computed with the shipper's
    6 MiB parts. With x-amz-meta-sha256 equal to the file's, it is recorded and not sent; without, it is sent."""
    import io

    from boto3.s3.transfer import TransferConfig

    root = tmp_path / "ckpt"
    root.mkdir()
    data = os.urandom(12 * MIB)
    (root / "m.bin").write_bytes(data)
    age(root / "m.bin", 60)
    extra = {"Metadata": {"sha256": hashlib.sha256(data).hexdigest()}} if with_sha else {}
    s3.client().upload_fileobj(io.BytesIO(data), bucket, "o/m.bin", ExtraArgs=extra,
                               Config=TransferConfig(multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB))
    p = shipper.run_pass(make_spec(s3, root, f"s3://{bucket}/o/", part_size_mb=6), str(tmp_path))
    assert p["ok"] is True, p
    assert (p["files"], p["skipped"]) == ((0, 1) if with_sha else (1, 0)), p
    assert objects(s3, bucket, "o/")["o/m.bin"] == data


def test_include_patterns_and_dfo_names(s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for rel in ("a.pt", "b.txt", "old/c.pt", "sub/.dfo/x.pt", "sub/.dfo-y.pt", ".dfo/z.pt", "sub/d.pt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rel.encode())
        age(root / rel, 60)
    os.symlink(root / "a.pt", root / "link.pt")  # a symlink is not a regular file: not shipped
    p = shipper.run_pass(make_spec(s3, root, f"s3://{bucket}/i/", include=["*.pt", "!old/"]), str(tmp_path))
    assert p["ok"] is True, p
    assert set(objects(s3, bucket)) == {"i/a.pt", "i/sub/d.pt"}


def test_settle_rename_into_place_ships_at_once(s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    spec = make_spec(s3, root, f"s3://{bucket}/s/", settle=60)
    (root / "writing.bin").write_bytes(b"w" * 100)  # written just now: waits 60 s
    for name in ("renamed.bin", "held.bin"):
        (root / (name + ".tmp")).write_bytes(b"r" * 100)
    time.sleep(0.05)  # past the kernel's timestamp tick: the rename's ctime is later than the last write
    os.rename(root / "renamed.bin.tmp", root / "renamed.bin")
    held = open(root / "held.bin.tmp", "r+b")  # noqa: SIM115 - held open for writing during the pass
    try:
        os.rename(root / "held.bin.tmp", root / "held.bin")
        p = shipper.run_pass(spec, str(tmp_path))
    finally:
        held.close()
    assert (p["ok"], p["files"], p["pending"]) == (True, 1, 2), p
    assert set(objects(s3, bucket)) == {"s/renamed.bin"}
    assert outputs_json(tmp_path)["lag_s"] == 0.0


def test_a_checkpoint_replaced_by_a_rename_in_the_same_clock_tick_ships_at_once(
        s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    """The trainer's usual save: write ckpt.tmp, rename it over ckpt. The kernel's coarse clock gives the
    rename the same ctime as the last write most of the time, so "ctime > mtime" cannot see it; the
    inode can: the name now holds another inode, or the inode had another name at the last scan."""
    root = tmp_path / "ckpt"
    root.mkdir()
    spec = make_spec(s3, root, f"s3://{bucket}/t/", settle=60)
    sh = shipper.Shipper(spec, str(tmp_path), None)  # one shipper over several passes, as the process runs
    (root / "ckpt-last.pt").write_bytes(b"1" * 100)
    age(root / "ckpt-last.pt", 120)
    assert sh.run_pass()["files"] == 1
    for i in (2, 3):
        body = str(i).encode() * 100
        tmp = root / f"ckpt-last.pt.tmp.{i}"
        if i == 3:  # the temporary file was seen by a scan before its rename
            tmp.write_bytes(body)
            assert sh.run_pass()["pending"] == 1  # written just now: it waits
        else:
            tmp.write_bytes(body)
        os.replace(tmp, root / "ckpt-last.pt")  # at once: most often within the write's clock tick
        p = sh.run_pass()
        assert (p["ok"], p["files"], p["pending"]) == (True, 1, 0), p
        assert objects(s3, bucket, "t/ckpt-last.pt") == {"t/ckpt-last.pt": body}
    held = open(root / "ckpt-last.pt.tmp.4", "wb")  # noqa: SIM115 - renamed while still open for writing
    try:
        held.write(b"4" * 100)
        held.flush()
        os.replace(root / "ckpt-last.pt.tmp.4", root / "ckpt-last.pt")
        p = sh.run_pass()
        assert (p["files"], p["pending"]) == (0, 1), p
    finally:
        held.close()


# --------------------------------------------------------------------------- signals, kills


def _slow_shipper(s3: S3Endpoint, bucket: str, tmp_path: Path, procs: list[ShipperProc]) -> tuple[ShipperProc, Path]:
    """A shipper with a 40 MiB file to send at 1 part at a time under a tiny CPU budget (slow on purpose),
    once its multipart upload is open."""
    root, run_dir = tmp_path / "ckpt", tmp_path / "run"
    root.mkdir()
    run_dir.mkdir()
    (root / "big.bin").write_bytes(os.urandom(40 * MIB))
    age(root / "big.bin", 60)
    sp = ShipperProc(run_dir, make_spec(s3, root, f"s3://{bucket}/k/", cpu=0.01, concurrency=1))
    procs.append(sp)
    c = s3.client()
    deadline = time.monotonic() + 60
    while not c.list_multipart_uploads(Bucket=bucket).get("Uploads"):
        assert time.monotonic() < deadline, "no multipart upload opened in 60 s"
        assert sp.proc.poll() is None, sp.finish()
        time.sleep(0.05)
    return sp, root


def test_sigterm_aborts_the_upload_records_and_exits(s3: S3Endpoint, bucket: str, tmp_path: Path,
                                                     procs: list[ShipperProc]) -> None:
    sp, root = _slow_shipper(s3, bucket, tmp_path, procs)
    t0 = time.monotonic()
    sp.proc.send_signal(signal.SIGTERM)
    rc, out, err = sp.finish(timeout=60)
    assert rc == 1, (out, err)
    assert time.monotonic() - t0 < 30
    c = s3.client()
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []  # aborted: no upload left behind
    # the object being sent is aborted (the usual case: its parts go slowly) or finished whole, never half
    # (on a loaded machine the signal can come after its last part)
    assert objects(s3, bucket) in ({}, {"k/big.bin": (root / "big.bin").read_bytes()})
    doc = outputs_json(sp.run_dir)
    assert doc["state"] == "failed" and "SIGTERM" in doc["errors"][-1]["error"]
    assert doc["last_pass"]["ok"] is False
    assert json.loads((tmp_path / "ckpt" / ".dfo" / "uploads.json").read_text())["uploads"] == []


def test_a_killed_shippers_upload_is_aborted_by_the_next_pass(s3: S3Endpoint, bucket: str, tmp_path: Path,
                                                               procs: list[ShipperProc]) -> None:
    sp, root = _slow_shipper(s3, bucket, tmp_path, procs)
    sp.proc.kill()
    sp.proc.wait()
    c = s3.client()
    assert len(c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1  # SIGKILL: nothing could abort it
    p = shipper.run_pass(make_spec(s3, root, f"s3://{bucket}/k/"), str(sp.run_dir))
    assert (p["ok"], p["files"]) == (True, 1), p
    assert c.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    assert objects(s3, bucket)["k/big.bin"] == (root / "big.bin").read_bytes()


def test_odd_names_ship_under_their_own_keys(s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    names = ["a b/sp ace.pt", "quo'te\"s.pt", "$(x)/`y`.pt", "ünï/cødé+=&?.pt", "pct%20.pt"]
    for rel in names:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(rel.encode())
        age(root / rel, 60)
    p = shipper.run_pass(make_spec(s3, root, f"s3://{bucket}/odd/"), str(tmp_path))
    assert (p["ok"], p["files"]) == (True, len(names)), p
    assert objects(s3, bucket) == {"odd/" + rel: rel.encode() for rel in names}


def test_the_last_pass_ships_fresh_files_but_waits_for_one_held_open(s3: S3Endpoint, bucket: str,
                                                                      tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "fresh.pt").write_bytes(b"f" * 10)  # written just now, closed: the run is over, it ships
    held = open(root / "held.pt", "wb")  # noqa: SIM115 - something still writes it after the run ended
    done = threading.Event()

    def writer() -> None:
        while not done.wait(0.1):
            held.write(b"h")
            held.flush()

    t = threading.Thread(target=writer)
    t.start()
    try:
        t0 = time.monotonic()
        p = shipper.run_pass(make_spec(s3, root, f"s3://{bucket}/f/", settle=1.5), str(tmp_path), final=True)
        waited = time.monotonic() - t0
    finally:
        done.set()
        t.join()
        held.close()
    assert (p["ok"], p["final"], p["files"], p["pending"]) == (True, True, 1, 1), p
    assert waited >= 1.5  # it gave the held file `settle` seconds
    assert set(objects(s3, bucket)) == {"f/fresh.pt"}
    assert outputs_json(tmp_path)["state"] == "done"


def test_a_missing_bucket_fails_the_pass(s3: S3Endpoint, tmp_path: Path) -> None:
    """SeaweedFS creates a missing bucket on PUT: a typo in outputs.dest must fail, not ship elsewhere."""
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "a.pt").write_bytes(b"a")
    age(root / "a.pt", 60)
    missing = "nosuch-" + secrets.token_hex(4)
    p = shipper.run_pass(make_spec(s3, root, f"s3://{missing}/x/"), str(tmp_path))
    assert p["ok"] is False and "NoSuchBucket" in p["error"] and missing in p["error"], p
    names = [b["Name"] for b in s3.client().list_buckets()["Buckets"]]
    assert missing not in names


def test_an_upload_being_created_when_the_shipper_died_is_found_and_aborted(s3: S3Endpoint, bucket: str,
                                                                             tmp_path: Path) -> None:
    """SIGKILL between CreateMultipartUpload's answer and the journal's update: uploads.json names the key
    with no id; the next pass asks S3 for that key's open uploads and aborts them."""
    root = tmp_path / "ckpt"
    (root / ".dfo").mkdir(parents=True)
    c = s3.client()
    c.create_multipart_upload(Bucket=bucket, Key="k/big.bin")
    c.create_multipart_upload(Bucket=bucket, Key="k/big.bin.other")  # another key: not ours to abort
    (root / ".dfo" / "uploads.json").write_text(json.dumps({"uploads": [{"bucket": bucket, "key": "k/big.bin",
                                                                          "id": ""}]}))
    p = shipper.run_pass(make_spec(s3, root, f"s3://{bucket}/k/"), str(tmp_path))
    assert p["ok"] is True, p
    assert [u["Key"] for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])] == ["k/big.bin.other"]
    assert json.loads((root / ".dfo" / "uploads.json").read_text())["uploads"] == []
