"""Dest safety (issue 10, items 5-7), through the real CLI on a testbed node against the testbed's S3.

5. --delete removes only files this dest's manifest recorded as written by dfo; dangerous dests
   (/, $HOME, the workspace root, a dest holding the venv or another dest's .dfo) are refused, exit 2.
6. A dest, its .dfo/ or a folder above it that another user owns or may write is refused (exit 2);
   a file swapped on the node keeping its size and mtime is fetched again, and the report says so.
7. Symlinks inside dest are never followed: a symlinked sub-folder or .dfo is refused (exit 2),
   nothing lands or is deleted through it.

Every destructive path stays inside the node's private /workspace, /dev/shm and /root.
"""

from __future__ import annotations

import ast
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from remote.s3.manifest import Manifest
from tests._s3_fixtures import Xfer, random_files, upload, xfer  # noqa: F401

pytestmark = pytest.mark.testbed

OTHER_UID = 12345  # no passwd entry needed: chown takes a number


def _isolated(x: Xfer) -> None:
    if not x.tb.isolated:
        pytest.skip("needs a node with its own /root, /workspace and /dev/shm (root + namespaces)")


def _job(x: Xfer, data: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
         **top: Any) -> Path:
    path = x.job(data=data, model=model)
    doc = yaml.safe_load(path.read_text())
    doc.update(top)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _run(x: Xfer, command: str, job: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    r = x.dfo(command, "-H", x.node.name, "-j", str(job), *extra)
    assert "Traceback" not in r.stderr, r.stderr
    return r


def _exists(x: Xfer, path: str) -> bool:
    return x.sh(f"test -e {shlex.quote(path)} || test -L {shlex.quote(path)}", check=False).returncode == 0


def _py(x: Xfer, code: str) -> str:
    """Python on the node, as root (a local user meddling with the files)."""
    return x.sh(f"python3 -c {shlex.quote(code)}").stdout


# ------------------------------------------------------------------------------------------ item 5


def test_delete_removes_only_files_dfo_wrote(xfer: Xfer) -> None:  # noqa: F811
    _isolated(xfer)
    files = random_files(5, 4096, "f{i}.bin")
    files["sub/g.bin"] = os.urandom(2048)
    ds = upload(xfer.tb, "del-" + xfer.id, "d/", files)
    dest = f"{xfer.base}/del"
    job = _job(xfer, data={"source": ds.source, "dest": dest, "delete": True})
    r, doc = xfer.run_json("sync-data", job)
    assert r.returncode == 0 and doc["fetched"] == 6, r.stderr
    # things dfo never wrote: a stray file, someone's keys, a venv, a file beside dfo's in a folder dfo made
    xfer.sh(f"cd {dest} && echo stray > local-only.txt && mkdir -p .ssh venv/bin sub && "
            "echo ssh-ed25519 AAAA > .ssh/authorized_keys && : > venv/bin/python && echo mine > sub/notes.txt")
    # f4: written by dfo, then replaced on the node by the user's own file: no longer dfo's to delete
    xfer.sh(f"cd {dest} && echo users-own-f4 > f4.new && mv f4.new f4.bin")
    client = xfer.s3.client()
    for key in ("d/f2.bin", "d/f4.bin", "d/sub/g.bin"):
        client.delete_object(Bucket=ds.bucket, Key=key)
    r, doc = xfer.run_json("sync-data", job)
    assert r.returncode == 0, r.stderr
    assert doc["deleted"] == 2, doc  # f2.bin and sub/g.bin: nothing else
    assert (doc["kept"], doc["kept_files"]) == (1, ["f4.bin"]), doc
    left = set(xfer.digests(dest))
    assert left == {"f0.bin", "f1.bin", "f3.bin", "f4.bin", "local-only.txt", ".ssh/authorized_keys",
                    "venv/bin/python", "sub/notes.txt"}, left
    assert xfer.sh(f"cat {dest}/f4.bin").stdout == "users-own-f4\n"
    human = _run(xfer, "sync-data", job)  # the record of f4 is gone: it stays, quietly
    assert human.returncode == 0 and "no change" in human.stdout, human.stdout + human.stderr
    assert set(xfer.digests(dest)) == left


def _refused(x: Xfer, job: Path, *needles: str, command: str = "sync-data") -> str:
    r = _run(x, command, job, "--json")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = json.loads(r.stdout)["hosts"][x.node.name]["error"]
    assert err["kind"] == "config", err
    for n in needles:
        assert n in err["message"], (n, err["message"])
    human = _run(x, command, job)
    assert human.returncode == 2 and f"{x.node.name}:" in human.stderr, human.stderr
    return err["message"]


def test_dangerous_dests_are_refused(xfer: Xfer) -> None:  # noqa: F811
    _isolated(xfer)
    ds = upload(xfer.tb, "dng-" + xfer.id, "d/", random_files(2, 1024, "dng-{i}.bin"))
    # "/" is checked with a bucket that does not exist: on the code before this fix nothing is written there
    msg = _refused(xfer, _job(xfer, data={"source": f"s3://no-such-bucket-{xfer.id}/x/", "dest": "/",
                                          "delete": True}), "data.dest: /", "the root")
    assert "\n" not in msg
    try:
        # without delete first: the code before this fix must not get to wipe the node's /root in this test
        for home, delete in (("/root", False), ("~", True), ("/root/", True)):
            _refused(xfer, _job(xfer, data={"source": ds.source, "dest": home, "delete": delete}),
                     "data.dest", "$HOME of root", "/root/data")
        assert not _exists(xfer, "/root/.dfo") and not _exists(xfer, "/root/dng-0.bin")
        _refused(xfer, _job(xfer, model={"source": ds.source, "dest": "/root/.ssh"}), "model.dest",
                 command="stage-model")
        _refused(xfer, _job(xfer, data={"source": ds.source, "dest": "/workspace"}), "data.dest: /workspace",
                 "workspace root")
        assert not _exists(xfer, "/workspace/.dfo/manifest.json")
    finally:
        xfer.sh("rm -rf /root/.dfo /root/dng-0.bin /root/dng-1.bin /root/.ssh/.dfo /root/.ssh/dng-*.bin "
                "/workspace/.dfo/manifest.json /workspace/.dfo/journal.jsonl /workspace/.dfo/lock "
                "/workspace/.dfo/tmp /workspace/dng-0.bin /workspace/dng-1.bin", check=False)
    # a job-level workspace, and a dest that holds it
    ws = f"{xfer.base}/ws"
    _refused(xfer, _job(xfer, data={"source": ds.source, "dest": ws}, workspace=ws), "workspace root")
    _refused(xfer, _job(xfer, data={"source": ds.source, "dest": xfer.base}, workspace=ws), "holds", ws)
    # a dest that holds the job's venv
    venv = f"{xfer.base}/env/venv"
    xfer.sh(f"mkdir -p {venv}/bin && : > {venv}/bin/python")
    for dest in (f"{xfer.base}/env", venv):
        _refused(xfer, _job(xfer, data={"source": ds.source, "dest": dest, "delete": True}, venv=venv),
                 "venv", venv)
    assert not _exists(xfer, f"{xfer.base}/env/.dfo") and _exists(xfer, f"{venv}/bin/python")
    # a dest that holds another dfo destination
    inner = f"{xfer.base}/outer/inner"
    assert xfer.run_json("sync-data", _job(xfer, data={"source": ds.source, "dest": inner}))[0].returncode == 0
    _refused(xfer, _job(xfer, data={"source": ds.source, "dest": f"{xfer.base}/outer", "delete": True}),
             f"{inner}/.dfo")
    assert not _exists(xfer, f"{xfer.base}/outer/.dfo") and len(xfer.digests(inner)) == 2


# ------------------------------------------------------------------------------------------ item 6


def test_dest_owned_or_writable_by_others_is_refused(xfer: Xfer) -> None:  # noqa: F811
    _isolated(xfer)
    ds = upload(xfer.tb, "own-" + xfer.id, "m/", random_files(2, 4096, "w{i}.bin"))
    shm = xfer.shm
    xfer.sh(f"mkdir -p {shm}/target && cd {shm} && mkdir a b b2 c d g && chown {OTHER_UID} a g && "
            f"chmod 0777 b && chmod 1777 b2 && mkdir c/.dfo d/.dfo && chown {OTHER_UID} c/.dfo && chmod 0777 d/.dfo "
            f"&& ln -s {shm}/target e && chown -h {OTHER_UID} e")
    cases = [("a", "owned by uid 12345"), ("b", "writable by others"), ("b2", "writable by others"),
             ("c/.dfo", "owned by uid 12345"), ("d/.dfo", "writable by others"),
             ("e", "symlink owned by uid 12345"), ("g", "owned by uid 12345")]
    for sub, why in cases:
        dest = f"{shm}/{sub.split('/')[0]}" + ("/data" if sub == "g" else "")
        msg = _refused(xfer, _job(xfer, model={"source": ds.source, "dest": dest}), "model.dest",
                       f"{shm}/{sub}", why, command="stage-model")
        assert "\n" not in msg
    for sub in ("a", "b", "b2", "target", "g"):
        assert xfer.sh(f"ls -A {shm}/{sub}").stdout == "", sub
    # a fresh dest: created 0755, its .dfo 0700, and usable
    dest = f"{shm}/new/model"
    r, doc = xfer.run_json("stage-model", _job(xfer, model={"source": ds.source, "dest": dest}))
    assert r.returncode == 0 and doc["fetched"] == 2, r.stderr
    assert xfer.sh(f"stat -c %a {shm}/new {dest} {dest}/.dfo").stdout.split() == ["755", "755", "700"]


def test_swapped_file_is_fetched_again_and_reported(xfer: Xfer) -> None:  # noqa: F811
    _isolated(xfer)
    ds = upload(xfer.tb, "swp-" + xfer.id, "m/", random_files(4, 65536, "w{i}.bin"))
    dest = f"{xfer.shm}/model"
    job = _job(xfer, model={"source": ds.source, "dest": dest})
    r, doc = xfer.run_json("stage-model", job)
    assert r.returncode == 0 and doc["fetched"] == 4, r.stderr
    assert xfer.run_json("stage-model", job)[1]["status"] == "no change"
    # as another local user could (root here): same size, same mtime, other bytes
    _py(xfer, f"""
import os
d = {dest!r}
def same_times(path, st):
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
st = os.stat(d + "/w0.bin")                      # w0: rewritten in place (same inode)
with open(d + "/w0.bin", "r+b") as f:
    f.write(b"EVIL" * 16384)
same_times(d + "/w0.bin", st)
st = os.stat(d + "/w1.bin")                      # w1: a new file renamed over it (new inode)
with open(d + "/.w1.swap", "wb") as f:
    f.write(b"PWND" * 16384)
same_times(d + "/.w1.swap", st)
os.rename(d + "/.w1.swap", d + "/w1.bin")
os.chown(d + "/w2.bin", {OTHER_UID}, -1)         # w2: handed to another user (who may rewrite it)
""")
    assert xfer.sh(f"stat -c %s {dest}/w0.bin {dest}/w1.bin").stdout.split() == ["65536", "65536"]
    r, doc = xfer.run_json("stage-model", job)
    assert r.returncode == 0, r.stderr
    assert (doc["status"], doc["fetched"], doc["skipped"]) == ("done", 3, 1), doc
    assert (doc["changed"], doc["changed_files"]) == (3, ["w0.bin", "w1.bin", "w2.bin"]), doc
    assert xfer.digests(dest) == ds.digests()
    assert xfer.sh(f"stat -c %u {dest}/w2.bin").stdout.strip() == "0"
    # the human report says so too
    _py(xfer, f"""
import os
p = {dest!r} + "/w3.bin"
st = os.stat(p)
with open(p, "r+b") as f:
    f.write(b"X")
os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
""")
    human = _run(xfer, "stage-model", job)
    assert human.returncode == 0, human.stderr
    assert "1 file changed on the node since dfo wrote it, fetched again: w3.bin" in human.stdout, human.stdout
    assert xfer.digests(dest) == ds.digests()
    # a model copied from a path on the node: the same check
    src, dest2 = f"{xfer.base}/hub/m", f"{xfer.shm}/m2"
    xfer.sh(f"mkdir -p {src} && head -c 100000 /dev/urandom > {src}/a.bin && head -c 5000 /dev/urandom > {src}/b.bin")
    job2 = _job(xfer, model={"source": src, "dest": dest2})
    assert xfer.run_json("stage-model", job2)[1]["fetched"] == 2
    _py(xfer, f"""
import os
p = {dest2!r} + "/a.bin"
st = os.stat(p)
with open(p, "r+b") as f:
    f.write(b"EVIL")
os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
""")
    r, doc = xfer.run_json("stage-model", job2)
    assert (doc["fetched"], doc["changed_files"]) == (1, ["a.bin"]), doc
    assert xfer.digests(dest2) == xfer.digests(src)


# ------------------------------------------------------------------------------------------ item 7


def test_symlinks_inside_dest_are_never_followed(xfer: Xfer) -> None:  # noqa: F811
    _isolated(xfer)
    files = {"top.bin": os.urandom(3000), "sub/a.bin": os.urandom(3000), "gone/x.bin": os.urandom(3000)}
    ds = upload(xfer.tb, "lnk-" + xfer.id, "d/", files)
    base = xfer.base
    # a symlinked sub-folder: the key must not land outside dest
    dest = f"{base}/d1"
    job = _job(xfer, data={"source": ds.source, "dest": dest})
    assert xfer.run_json("sync-data", job)[0].returncode == 0
    xfer.sh(f"mkdir -p {base}/outside && rm -rf {dest}/sub && ln -s {base}/outside {dest}/sub")
    _refused(xfer, job, f"{dest}/sub", "symlink")
    assert xfer.sh(f"ls -A {base}/outside").stdout == ""
    assert xfer.sh(f"readlink {dest}/sub").stdout.strip() == f"{base}/outside"
    # a symlinked .dfo: nothing under its target is read, cleared or written
    dest2 = f"{base}/d2"
    job2 = _job(xfer, data={"source": ds.source, "dest": dest2, "delete": True})
    assert xfer.run_json("sync-data", job2)[0].returncode == 0
    xfer.sh(f"mkdir -p {base}/victim/tmp && echo precious > {base}/victim/tmp/precious.txt && "
            f"rm -rf {dest2}/.dfo && ln -s {base}/victim {dest2}/.dfo")
    _refused(xfer, job2, f"{dest2}/.dfo", "symlink")
    assert xfer.sh(f"cd {base}/victim && find . | sort").stdout.split() == [".", "./tmp", "./tmp/precious.txt"]
    # --delete never deletes through a symlinked folder
    dest3 = f"{base}/d3"
    job3 = _job(xfer, data={"source": ds.source, "dest": dest3, "delete": True})
    assert xfer.run_json("sync-data", job3)[0].returncode == 0
    xfer.s3.client().delete_object(Bucket=ds.bucket, Key="d/gone/x.bin")
    xfer.sh(f"mkdir -p {base}/outside2 && mv {dest3}/gone/x.bin {base}/outside2/x.bin && rmdir {dest3}/gone && "
            f"ln -s {base}/outside2 {dest3}/gone")
    _refused(xfer, job3, f"{dest3}/gone", "symlink")
    assert _exists(xfer, f"{base}/outside2/x.bin")
    # a symlink in place of a file dfo wrote is replaced, never written through
    xfer.sh(f"echo target > {base}/t.txt && rm {dest}/top.bin && ln -s {base}/t.txt {dest}/top.bin && "
            f"rm {dest}/sub && mkdir {dest}/sub")
    r, doc = xfer.run_json("sync-data", job)
    assert r.returncode == 0 and doc["fetched"] == 2, r.stderr
    assert xfer.sh(f"cat {base}/t.txt").stdout == "target\n"
    assert xfer.digests(dest) == ds.digests()


# ------------------------------------------------------------------------------------------ unit: migration


def test_manifest_entries_from_before_identity_records_are_trusted_then_upgraded(tmp_path: Path) -> None:
    """A manifest written before inode/ctime/uid were recorded: its entries mean "dfo wrote this" (kept for
    --delete); a file still owned by this user with the recorded size and mtime counts as present once, and
    its identity is recorded from then on."""
    dest = tmp_path / "d"
    (dest / ".dfo").mkdir(parents=True, mode=0o700)
    (dest / "a").write_bytes(b"x" * 10)
    st = os.stat(dest / "a")
    legacy = {"version": 1, "source": "s3://b/p/", "files": {"a": {"size": 10, "etag": "e",
                                                                   "mtime_ns": st.st_mtime_ns}}}
    (dest / ".dfo" / "manifest.json").write_text(json.dumps(legacy))
    m = Manifest(str(dest), "s3://b/p/").open()
    assert m.present("a", 10, "e")
    m.close()
    ent = json.loads((dest / ".dfo" / "manifest.json").read_text())["files"]["a"]
    assert (ent["ino"], ent["uid"], ent["ctime_ns"]) == (st.st_ino, os.getuid(), st.st_ctime_ns)


def test_dest_module_parses_as_python_3_8() -> None:
    root = Path(__file__).resolve().parent.parent / "remote"
    ast.parse((root / "lib" / "destsafety.py").read_text(), feature_version=(3, 8))
