"""The first push's own paths: the node renames each file into place (a folder in its way: removed when
empty, refused when it holds files), records the inode, size and mtime the file keeps, and the
controller's read-ahead (Prefetch) sends what the listing saw, re-hashing only a file changed since."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from orchestrator.config.models import load_job
from orchestrator.steps import code
from remote._proto import split_frame

ROOT = Path(__file__).resolve().parent.parent


def _push(dest: Path, files: dict[str, bytes]) -> dict[str, Any]:
    entries = [{"path": rel, "sha256": hashlib.sha256(b).hexdigest(), "mode": 0o644, "size": len(b), "link": None}
               for rel, b in files.items()]
    req = {"op": "sync", "dest": str(dest), "want": "x", "delete": [], "files": entries}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-S", "-m", "remote.files.push"], env=env, capture_output=True, timeout=60,
                       input=json.dumps(req).encode() + b"\n" + b"".join(files.values()))
    for line in r.stdout.decode().splitlines():
        fr = split_frame(line)
        if fr and fr[0] == "result":
            return json.loads(fr[1])  # type: ignore[no-any-return]
    raise AssertionError(r.stdout + r.stderr)


def test_a_folder_in_the_way_is_removed_when_empty_and_refused_when_it_holds_files(tmp_path: Path) -> None:
    dest = tmp_path / "code"
    (dest / "a.py").mkdir(parents=True)  # empty: it goes
    doc = _push(dest, {"a.py": b"x = 1\n", "b/c.py": b"y = 2\n"})
    assert doc["ok"] is True, doc
    assert (dest / "a.py").read_bytes() == b"x = 1\n" and (dest / "b" / "c.py").read_bytes() == b"y = 2\n"
    manifest = json.loads((dest / ".dfo" / "code-manifest.json").read_text())
    fields = manifest["fields"]
    for rel in ("a.py", "b/c.py"):
        row = dict(zip(fields, manifest["files"][rel], strict=True))
        st = os.lstat(dest / rel)
        assert (row["ino"], row["size"], row["mtime_ns"]) == (st.st_ino, st.st_size, st.st_mtime_ns)
    (dest / "d.py" / "inner").mkdir(parents=True)
    (dest / "d.py" / "inner" / "keep.txt").write_text("mine")
    doc = _push(dest, {"d.py": b"z = 3\n"})
    assert doc["ok"] is False and doc["error"]["kind"] == "config", doc
    assert "is a folder with files dfo did not push" in doc["error"]["message"]
    assert (dest / "d.py" / "inner" / "keep.txt").read_text() == "mine"
    assert os.listdir(dest / ".dfo" / "code-tmp") == []  # its temp file went too
    assert _push(dest, {"e.py": b"ok\n"})["ok"] is True
    assert os.listdir(dest / ".dfo" / "code-tmp") == []


def _local(tmp_path: Path, monkeypatch: Any) -> code.Local:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir(parents=True)
    for i in range(30):
        (src / f"m{i}.py").write_text(f"x = {i}\n")
    os.symlink("m1.py", src / "link.py")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "j", "code": {"source": str(src), "dest": "/root/code"}}))
    return code.start_local(load_job(job)).result()


def test_prefetch_gives_what_stream_gives_and_rehashes_a_file_changed_since_listing(tmp_path: Path,
                                                                                  monkeypatch: Any) -> None:
    local = _local(tmp_path, monkeypatch)
    every = sorted(local.view())
    ahead = code.Prefetch(local)
    assert ahead.take(local, every) == code._stream(local, every)
    local = _local(tmp_path / "again", monkeypatch)
    local.view()
    (local.source / "m2.py").write_text("changed = True\n")  # after the listing: its stat key no longer holds
    ahead = code.Prefetch(local)
    entries, chunks = ahead.take(local, sorted(local.files))
    row = next(e for e in entries if e["path"] == "m2.py")
    assert row["sha256"] == hashlib.sha256(b"changed = True\n").hexdigest() != local.files["m2.py"].sha256
    assert row["size"] == len(b"changed = True\n") and b"changed = True\n" in chunks
    assert next(e for e in entries if e["path"] == "link.py")["link"] == "m1.py"
    assert len(chunks) == len(entries) - 1  # a symlink carries no bytes


def test_prefetch_reads_only_what_is_missing_when_the_node_holds_most(tmp_path: Path, monkeypatch: Any) -> None:
    local = _local(tmp_path, monkeypatch)
    local.view()
    ahead = code.Prefetch(local)
    few = ["m3.py", "m4.py"]
    assert ahead.take(local, few) == code._stream(local, few)
