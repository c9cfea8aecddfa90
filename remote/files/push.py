"""The node side of ``dfo sync-code`` (python3 3.8+, stdlib only).

Three operations, each one SSH command; the request is the first line of stdin (JSON):

* ``state``: the node's code manifest (DEST/.dfo/code-manifest.json), its digest, and which of
  its files are no longer as dfo left them (size, mtime or inode changed, gone, a symlink
  retargeted). The controller asks while it lists and hashes its own files.
* ``push``: deletions first, then the changed files, whose bytes follow the request line on stdin
  as one stream, in request order, ``size`` bytes each: no round trip per file. Each file is
  written under DEST/.dfo/code-tmp/, its sha256 checked against the request, given its mode, then
  renamed into place; a symlink is made under a temp name and renamed too. The manifest is written
  last, atomically (remote.lib.fsutil.write_atomic).
* ``sync``: ``push`` of what the controller believes changed since its last push, then ``state``'s
  check against ``want`` (the digest of the controller's tree), in the same command: a push with
  nothing changed, or one file changed, is one command. Only on a mismatch (the node is not as the
  controller last left it) does the answer carry the manifest, and the controller sends the rest.

Ownership: the manifest names the job whose pushes wrote it (``owner``: job and workspace). A push
from another job (``job`` in the request) is refused (exit 2, naming both jobs, the folder and the
owner's live run) while the owner has a live run in its workspace. With no live run it may take the
folder over, only when the controller asks (``takeover``: it then sends its whole tree): every file
of the old owner is released (left in place, no longer dfo's: never deleted), the new job's files
are written over any of the same name, and the manifest then lists only what the new job wrote.
A manifest written before owners were recorded names none: it is taken over the same way (nothing
deleted), refused while a live run of another job has DEST as its workdir.

Safety: every folder under DEST is opened relative to its parent with O_NOFOLLOW (remote.lib.destsafety.Tree),
so a symlink inside DEST is never followed. A path with an empty, ``.`` or ``..`` component, or a
component starting with ``.dfo``, is refused. A file is deleted only if dfo pushed it (it is in the
manifest) and it is still exactly as dfo left it; others are kept and reported.
DEST may be $HOME (run.workdir is often /root): code lands beside what is there, and only what dfo
pushed is ever deleted. Refused: ``/``, a path with a ``.dfo`` component, ~/.ssh and ~/.cache/dfo.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

from remote._proto import RemoteError, payload, serve
from remote.lib import fastjson as json
from remote.lib.destsafety import Tree, _check_ancestors, _open_child, _real, open_dest, refuse
from remote.lib.fsutil import FILE_FLAGS, node_path, room_problem, write_atomic
from remote.lib.fsutil import workspace as fsutil_workspace

# --------------------------------------------------------------------------- requests and replies
# The request is the first line of stdin; push's and sync's file bytes follow it (the payload).


TYPE_CHECKING = False  # (typing is not imported at run time: ~1.5 ms of every call's start on the node)
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, TypedDict

    class StateRequest(TypedDict, total=False):
        """``state`` -> StateReply. ``job``, ``workspace`` and ``host`` name who pushes (the folder's owner)."""
        op: str
        dest: str
        job: str
        workspace: str
        host: str


    class StateReply(TypedDict):
        dest: str  # its real path
        digest: Optional[str]  # of the manifest (digest_of); None: nothing pushed yet
        dirty: List[str]  # files no longer as dfo left them
        owner: Optional[str]  # the job whose pushes wrote the manifest
        foreign: bool  # another job's folder (or one from before owners were recorded)
        files: Dict[str, List[Any]]  # path -> [sha256, mode, link]


    class FileEntry(TypedDict):
        path: str
        sha256: Optional[str]
        mode: Optional[int]  # 0o755 or 0o644 (None for a link)
        size: int  # bytes of the payload that are this file's, in request order
        link: Optional[str]  # a symlink's target (no bytes)


    class PushRequest(StateRequest, total=False):
        """``push`` and ``sync`` -> PushReply; ``sync`` checks the result against ``want``, and on a mismatch
        adds StateReply's ``files`` and ``dirty``."""
        files: List[FileEntry]
        delete: List[str]
        want: str  # sync: the digest of the controller's whole tree
        takeover: bool  # take a foreign folder over (its files released, never deleted); the whole tree is sent


    class PushReply(TypedDict, total=False):
        match: bool
        dest: str
        sent: int
        bytes: int
        deleted: int
        kept: int  # files not deleted because they changed since dfo pushed them
        kept_files: List[str]
        digest: str
        count: int
        seconds: float
        files: Dict[str, List[Any]]
        dirty: List[str]
        owner: Optional[str]
        foreign: bool
        took_over: str  # the job whose folder this was
        released: int


MANIFEST = "code-manifest.json"
TMP_DIR = "code-tmp"
CHUNK = 1 << 20
FIELD = "code.dest"


def digest_of(files):
    """One sha256 over the sorted (path, sha256, mode, link) of every file: equal digests, equal trees."""
    return _digest((rel, e.get("sha256"), e.get("mode"), e.get("link")) for rel, e in files.items())


def _digest(entries):
    """digest_of over (path, sha256, mode, link) tuples, in any order (the node's manifest rows as stored)."""
    import hashlib  # here, not at the top: a push with nothing to write hashes nothing (~2 ms to import)

    h = hashlib.sha256()
    for rel, sha, mode, link in sorted(entries):
        h.update(("%s\0%s\0%s\0%s\n" % (rel, sha or "", mode or 0, link or "")).encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def check_rel(rel):
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") or p.startswith(".dfo") for p in parts):
        raise RemoteError("usage", "code: refused path %r (empty, absolute, '..' or a .dfo name)" % rel)


def check_code_dest(dest):
    """The real path of DEST, or a RemoteError "config" naming why it is refused."""
    path = node_path(dest)  # ~ and $HOME: this user's home
    if not path.startswith("/"):
        refuse(FIELD, "%s is not an absolute path on the node" % dest, "for example /root/code or /workspace/code")
    if any(p.startswith(".dfo") for p in path.split("/") if p):
        refuse(FIELD, "%s lies inside a .dfo folder, where dfo keeps its own records" % dest)
    real = os.path.realpath(path)
    if real == "/":
        refuse(FIELD, "%s is the root of the node's filesystem; pick a folder of its own" % dest)
    home = _real("~")
    if home and home != "/":
        for sub in (".ssh", ".cache/dfo"):
            guarded = os.path.join(home, sub)
            if real == guarded or real.startswith(guarded + "/"):
                refuse(FIELD, "%s is inside %s; pick a folder of its own" % (dest, guarded))
    _check_ancestors(FIELD, real, os.geteuid())
    return real


def _lstat_at(tree, rel):
    try:
        return tree.lstat(rel)
    except (RemoteError, OSError):
        return None


def _matches(st, row, read_link):
    """Whether ``st`` (an lstat, None: nothing there) is still the file of manifest ``row`` (FIELDS order) as
    dfo wrote it: inode, mtime and size, or for a link its target (``read_link()``)."""
    if st is None or st.st_ino != row[5] or st.st_mtime_ns != row[4]:
        return False
    if row[2] is not None:
        try:
            return stat.S_ISLNK(st.st_mode) and read_link() == row[2]
        except (OSError, RemoteError):
            return False
    return stat.S_ISREG(st.st_mode) and st.st_size == row[3]


def _intact(tree, rel, row):
    """``_matches`` through the dest's open folders (a folder swapped for a symlink is never followed)."""
    d, name = Tree.split(rel)
    return _matches(_lstat_at(tree, rel), row, lambda: os.readlink(name, dir_fd=tree.dir(d)))


def _row_intact(real, rel, row):
    """``_matches`` by path, for the state report and the check after a push: it reads metadata and
    changes nothing (a folder swapped for a symlink shows another inode, so its files count as changed
    and are sent again, through the O_NOFOLLOW walk). On a manifest row as stored: a damaged one is not."""
    return _rows_intact(real, ((rel, row),))


FIELDS = ("sha256", "mode", "link", "size", "mtime_ns", "ino")  # one file in the manifest, as a list


def _row(row):
    """A stored row as FIELDS' six values: a damaged one (short, long, not a list) cut or filled with None,
    so that its file counts as no longer what dfo wrote (kept and reported, never deleted)."""
    if isinstance(row, list) and len(row) == len(FIELDS):
        return row
    got = list(row[:len(FIELDS)]) if isinstance(row, list) else []
    return got + [None] * (len(FIELDS) - len(got))


def _load_rows(meta_fd):
    """(path -> [sha256, mode, link, size, mtime_ns, ino] as stored, the digest recorded with them,
    the owner {job, workspace} or None)."""
    if meta_fd is None:
        return {}, None, None
    try:
        fd = os.open(MANIFEST, os.O_RDONLY | FILE_FLAGS, dir_fd=meta_fd)
    except FileNotFoundError:
        return {}, None, None
    with os.fdopen(fd, "rb") as f:
        try:
            doc = json.loads(f.read().decode("utf-8", "surrogateescape"))
        except ValueError:
            return {}, None, None  # unreadable: as if dfo had pushed nothing (nothing is deleted, all is sent)
    files = doc.get("files") if isinstance(doc, dict) and doc.get("version") == 2 else None
    if not isinstance(files, dict):
        return {}, None, None
    owner = doc.get("owner")
    if not (isinstance(owner, dict) and isinstance(owner.get("job"), str) and owner["job"]):
        owner = None
    return files, doc.get("digest"), owner


def _save_manifest(meta_fd, rows, owner=None):
    """Write the manifest (path -> row, FIELDS order); its digest."""
    digest = _digest((rel, r[0], r[1], r[2]) for rel, r in rows.items())
    doc = {"version": 2, "fields": FIELDS, "digest": digest, "files": rows}
    if owner is not None:
        doc["owner"] = owner
    write_atomic(MANIFEST, json.dumps(doc, separators=(",", ":")).encode("utf-8", "surrogateescape"),
                 dir_fd=meta_fd)
    return digest


def _runs_root(workspace):
    return os.path.join(fsutil_workspace(workspace), ".dfo", "runs")  # as remote.runs.ops.runs_root


def _foreign(owner, rows, req):
    """True when DEST's manifest belongs to another job than the request's: another owner, or files
    pushed before owners were recorded. A request that names no job (none does now) is not checked."""
    job = req.get("job")
    if not job:
        return False
    return owner["job"] != job if owner is not None else bool(rows)


def _refuse_if_live(real, owner, req):
    """RemoteError "usage" (exit 2) when the folder's owner has a live run; for a manifest that names
    no owner: when a live run of another job has DEST as its workdir."""
    from remote.runs import record as rec  # only on this path: the common push imports nothing more

    job = req.get("job")
    if owner is not None:
        live = [(rid, d) for _, rid, d in rec.list_runs(_runs_root(owner.get("workspace")), owner["job"])
                if rec.run_state(d)[0] == "running"]
        other = owner["job"]
    else:
        live, other = [], None
        for _, rid, d in rec.list_runs(_runs_root(req.get("workspace"))):
            state, meta, _end = rec.run_state(d)
            if state == "running" and (meta or {}).get("job") != job \
                    and os.path.realpath(node_path(str((meta or {}).get("workdir") or ""))) == real:
                live, other = [(rid, d)], (meta or {}).get("job")
                break
    if not live:
        return
    rid, d = live[0]
    meta = rec.read_json(os.path.join(d, rec.META)) or {}
    host = req.get("host") or "HOST"
    held = ("holds the code of job %s, which has a live run here" % other if owner is not None
            else "is the workdir of a live run of job %s" % other)
    raise RemoteError(
        "usage", "code: %s %s (%s, pid %s); job %s's push is refused, so that %s's code stays as it runs"
        % (real, held, rid, meta.get("pid"), job, other),
        hint="wait for it to end or stop it (dfo stop -H %s %s), or give job %s its own code.dest (or run.workdir)"
        % (host, rid, job), owner_run=rid, owner=other)  # not "running": launch reads that as the job's own run


def _owner_of(req):
    return {"job": req["job"], "workspace": req.get("workspace")} if req.get("job") else None


class Dest:
    def __init__(self, dest, create):
        self.real = check_code_dest(dest)
        self.tree = None
        self.meta_fd = None
        if not create and not os.path.isdir(self.real):
            return
        self.tree = Tree(self.real, open_dest(self.real, FIELD), FIELD)
        self.meta_fd = _open_child(self.tree.fd, ".dfo", self.real, FIELD, 0o700, create, "the manifest")

    def close(self):
        if self.meta_fd is not None:
            os.close(self.meta_fd)
        if self.tree is not None:
            self.tree.close()


def op_state(req: StateRequest):
    """The manifest (path -> [sha256, mode, link]), its digest, and the files no longer as dfo left them."""
    d = Dest(req["dest"], create=False)
    try:
        rows, digest, owner = _load_rows(d.meta_fd)
        dirty = [rel for rel, r in rows.items() if d.tree is None or not _row_intact(d.real, rel, r)]
        return {"dest": d.real, "digest": digest if rows else None, "dirty": dirty,
                "owner": owner["job"] if owner else None, "foreign": _foreign(owner, rows, req),
                "files": {rel: _row(r)[:3] for rel, r in rows.items()}}
    finally:
        d.close()


def _read_exact(stream, n, h, fd):
    left = n
    while left:
        buf = stream.read(min(CHUNK, left))
        if not buf:
            raise RemoteError("usage", "code: the stream ended early (%d bytes missing)" % left)
        h.update(buf)
        view = memoryview(buf)
        while view:
            view = view[os.write(fd, view):]
        left -= len(buf)


def _clear_way(tree, rel, fd, name):
    """After a rename refused because a folder is where file ``rel`` must go: an empty folder is
    removed (the caller renames again); one that holds files is an error."""
    try:
        os.rmdir(name, dir_fd=fd)
        tree.drop(rel)
    except OSError:
        raise RemoteError("config", "code: %s on the node is a folder with files dfo did not push; "
                                    "it cannot become a file" % os.path.join(tree.dest, rel),
                          hint="move that folder away on the node, or rename the file") from None


def _dir_of(tree, rel):
    """(the fd of ``rel``'s folder, made when missing, never through a symlink; ``rel``'s name)."""
    d, name = Tree.split(rel)
    return tree.dir(d, create=True), name


def _into_place(tree, rel, tmp, tmp_fd, fd, name):
    """Rename ``tmp`` over ``rel``; a folder in the way is removed when empty (``_clear_way``)."""
    for attempt in (0, 1):
        try:
            os.replace(tmp, name, src_dir_fd=tmp_fd, dst_dir_fd=fd)
            return
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                raise RemoteError("config", "code: %s is on another filesystem than %s/.dfo; dfo renames "
                                  "files into place" % (os.path.join(tree.dest, rel), tree.dest)) from None
            st = None if attempt else os.stat(name, dir_fd=fd, follow_symlinks=False)
            try:
                if st is None or not stat.S_ISDIR(st.st_mode):
                    raise
                _clear_way(tree, rel, fd, name)
            except BaseException:
                os.unlink(tmp, dir_fd=tmp_fd)  # nothing half-done left behind
                raise


def _delete(tree, files, rels):
    deleted, kept = [], []
    for rel in rels:
        entry = files.get(rel)
        if entry is None:
            continue
        st = _lstat_at(tree, rel)
        if st is None:
            del files[rel]
            continue
        if not _intact(tree, rel, entry):
            kept.append(rel)
            del files[rel]  # no longer what dfo pushed: no longer dfo's
            continue
        d, name = Tree.split(rel)
        os.unlink(name, dir_fd=tree.dir(d))
        del files[rel]
        deleted.append(rel)
        while d:  # folders left empty by the deletion go too (a folder that holds anything stays)
            parent, base = Tree.split(d)
            try:
                os.rmdir(base, dir_fd=tree.dir(parent))
            except OSError:
                break
            tree.drop(d)
            d = parent
    return deleted, kept


def op_push(req: PushRequest):
    """Deletions, then the files whose bytes follow the request line (the payload), then the manifest."""
    return _push(req, payload())


def _push(req, stream, want=None):
    started = time.time()
    d = Dest(req["dest"], create=True)
    tree = d.tree
    try:
        lock = os.open("code.lock", os.O_WRONLY | os.O_CREAT | FILE_FLAGS, 0o600, dir_fd=d.meta_fd)
        fcntl.flock(lock, fcntl.LOCK_EX)  # one push into a dest at a time (it is released when the process ends)
        files, _old_digest, owner = _load_rows(d.meta_fd)  # path -> row (FIELDS order), as stored
        files = {rel: _row(r) for rel, r in files.items()}
        for rel in [f["path"] for f in req.get("files", [])] + list(req.get("delete", [])):
            check_rel(rel)
        took_over, released = None, []
        if _foreign(owner, files, req):
            _refuse_if_live(d.real, owner, req)
            if not req.get("takeover"):  # the controller's guess was of its own folder: nothing written
                return {"match": False, "foreign": True, "owner": owner["job"] if owner else None, "dest": d.real,
                        "sent": 0, "bytes": 0, "deleted": 0, "kept": 0, "kept_files": [], "digest": None,
                        "count": len(files), "seconds": round(time.time() - started, 3)}
            took_over, released, files = (owner["job"] if owner else ""), sorted(files), {}  # released, none deleted
        deleted, kept = _delete(tree, files, req.get("delete", []))
        need = sum(int(f.get("size") or 0) + 4096 for f in req.get("files", []))
        short = room_problem(d.real, need) if need else None  # before a byte is written: never fill the disk
        if short:
            raise RemoteError("verify", "cannot push the code to %s: %s" % (d.real, short),
                              hint="make room there, or set code.dest (or run.workdir) to a folder on a disk with room")
        tmp_fd = _open_child(d.meta_fd, TMP_DIR, os.path.join(d.real, ".dfo"), FIELD, 0o700, True, "the manifest")
        try:
            for stale in os.listdir(tmp_fd):
                os.unlink(stale, dir_fd=tmp_fd)
            sent = nbytes = 0
            for i, f in enumerate(req.get("files", [])):
                rel = f["path"]
                fd, name = _dir_of(tree, rel)
                tmp = "p%d.%d" % (os.getpid(), i)
                st = None
                if f.get("link") is not None:
                    os.symlink(f["link"], tmp, dir_fd=tmp_fd)
                else:
                    mode = 0o755 if f.get("mode") == 0o755 else 0o644
                    wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS, 0o600, dir_fd=tmp_fd)
                    import hashlib

                    h = hashlib.sha256()
                    try:
                        _read_exact(stream, int(f["size"]), h, wfd)
                        os.fchmod(wfd, mode)
                        st = os.fstat(wfd)  # the inode, size and mtime it keeps when renamed into place
                    finally:
                        os.close(wfd)
                    if h.hexdigest() != f["sha256"]:
                        os.unlink(tmp, dir_fd=tmp_fd)
                        raise RemoteError("verify", "code: %s arrived with sha256 %s, expected %s"
                                          % (rel, h.hexdigest()[:16], f["sha256"][:16]))
                    nbytes += int(f["size"])
                _into_place(tree, rel, tmp, tmp_fd, fd, name)
                if st is None:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                files[rel] = [f.get("sha256"), f.get("mode"), f.get("link"), st.st_size, st.st_mtime_ns, st.st_ino]
                sent += 1
        finally:
            os.close(tmp_fd)
        digest = _save_manifest(d.meta_fd, files, _owner_of(req) or owner)
        written = set(f["path"] for f in req.get("files", []))  # stat'ed just now, as they were renamed into place
        match = bool(files) and digest == want and _all_intact(d, files, skip=written)
        out = {"match": match, "dest": d.real, "sent": sent, "bytes": nbytes, "deleted": len(deleted),
               "kept": len(kept), "kept_files": sorted(kept)[:10], "digest": digest, "count": len(files),
               "seconds": round(time.time() - started, 3)}
        if took_over is not None:
            out["took_over"] = took_over
            out["released"] = len([rel for rel in released if rel not in files])
        return out
    finally:
        d.close()


def _all_intact(d, rows, skip=()):
    return d.tree is not None and _rows_intact(d.real, ((rel, r) for rel, r in rows.items() if rel not in skip))


def _rows_intact(real, rows):
    """``all(_row_intact(real, rel, row) for rel, row in rows)`` in one loop: a push's check of every file
    (5,000 in a no-change sync-code) spends its time in lstat, not in Python calls."""
    lstat, is_reg, n = os.lstat, stat.S_ISREG, len(FIELDS)
    prefix = real + "/"
    for rel, row in rows:
        if type(row) is not list or len(row) != n:
            return False
        try:
            st = lstat(prefix + rel)
        except OSError:
            return False
        if st.st_ino != row[5] or st.st_mtime_ns != row[4]:
            return False
        if row[2] is None:
            if not (is_reg(st.st_mode) and st.st_size == row[3]):
                return False
        elif not _matches(st, row, lambda: os.readlink(prefix + rel)):  # noqa: B023 - called at once
            return False
    return True


def op_sync(req: PushRequest):
    """``push`` (when the request carries files or deletions), then the check of ``state``, in one
    command: the controller sends what it believes changed since its last push, with ``want``, the
    digest of its whole tree. ``match`` is true when the node's manifest then has digest ``want``
    and every file is still as dfo left it; otherwise the answer carries ``state``'s files and
    dirty list, and the controller sends the rest. Nothing is written when nothing was sent."""
    want = req.get("want")
    if req.get("files") or req.get("delete") or req.get("takeover"):
        out = _push(req, payload(), want)
    else:
        d = Dest(req["dest"], create=False)
        try:  # the common case, nothing changed: the stored rows checked as they are
            rows, digest, owner = _load_rows(d.meta_fd)
            foreign = _foreign(owner, rows, req)
            if foreign:  # another job's folder, even with the same files: its owner's live run keeps it
                _refuse_if_live(d.real, owner, req)
            match = (not foreign and bool(rows) and digest == want and d.tree is not None
                     and _rows_intact(d.real, rows.items()))
            out = {"dest": d.real, "sent": 0, "bytes": 0, "deleted": 0, "kept": 0, "kept_files": [],
                   "digest": digest, "count": len(rows), "match": match}
        finally:
            d.close()
    if not out["match"]:
        st = op_state(req)
        out["files"], out["dirty"], out["owner"], out["foreign"] = st["files"], st["dirty"], st["owner"], st["foreign"]
    return out


def _code_errors(op):
    """An OSError while pushing (a full disk, a permission) is a verification failure naming code:."""
    def run(req):
        try:
            return op(req)
        except OSError as exc:
            raise RemoteError("verify", "code: %s" % exc) from None
    return run


OPS = {"state": _code_errors(op_state), "push": _code_errors(op_push), "sync": _code_errors(op_sync)}


def entry():
    """The module's run: ``python3 -m remote.files.push``, or the controller's ``-c`` launch (agent.module_command)."""
    serve(OPS)


if __name__ == "__main__":
    entry()
