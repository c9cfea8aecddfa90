"""The node side of ``dfo pull`` (python3 3.8+, stdlib only): list files under a folder, then send some.

* ``list``: every regular file under ``root`` (or under the given relative ``paths`` in it), with
  its size and mtime. Symlinks are not followed (and not sent: they are listed under
  ``links``); names starting with ``.dfo`` are dfo's bookkeeping and never listed, nor is a
  ``.git`` folder (the controller refuses such names anyway: it never writes into .git).
* ``send``: for each requested file, opened with O_NOFOLLOW and still of the size and mtime the
  controller saw, the bytes from ``offset`` on, RAW on stdout (no base64, no JSON): see "The raw
  stream" below. The sha256 sent at a file's end is of the WHOLE file, read as it is sent, so the
  controller checks what it holds (an earlier part included) on arrival. A file that changed since
  it was listed is reported (a ``C`` record) and skipped.

The raw stream (``send``'s stdout). Whatever a login shell prints comes first; then the line
``@@DFO-RAW@@ NONCE`` (NONCE: the request's ``nonce``, so that no banner can start the stream), then
records, each a 16-byte header ``struct.pack(">cxxxIQ", KIND, INDEX, LENGTH)`` and LENGTH bytes:

* ``D``: LENGTH bytes (at least 1; this module sends at most CHUNK) of file INDEX (its position in
  the request's ``files``), the next ones after those already sent (the first: at its ``offset``);
* ``E``: file INDEX is whole; LENGTH is 32, the raw sha256 of the whole file;
* ``C``: file INDEX changed since it was listed (or is gone): not sent; LENGTH 0;
* ``Z``: the end of the records (INDEX and LENGTH 0). The result frame follows as a line, as for
  every op (remote/_proto.py); an error after the stream began also ends it with ``Z`` first.

Files go in the order asked, each whole before the next. The controller reads a header, checks it
(a known file, not past its listed size) and only then the bytes it announces.
"""
from __future__ import annotations

import hashlib
import os
import stat
import struct
import sys
from typing import Dict, List, TypedDict

from remote._proto import RemoteError, serve
from remote.lib.fsutil import FILE_FLAGS, node_path

CHUNK = 1 << 20  # the most bytes in one D record
RAW_MARK = b"@@DFO-RAW@@ "
HEADER = struct.Struct(">cxxxIQ")  # kind, file index, length


# --------------------------------------------------------------------------- requests and replies


class ListRequest(TypedDict, total=False):
    """``list`` -> ListReply."""
    op: str
    root: str  # ~ expanded on the node
    paths: List[str]  # relative to root; default: all of it


class ListReply(TypedDict):
    root: str  # its real path
    files: Dict[str, List[int]]  # path -> [size, mtime_ns]
    links: List[str]  # symlinks (never followed, never sent): the first 20
    n_links: int
    missing: List[str]  # paths asked for that are not there


class Wanted(TypedDict):
    path: str
    size: int
    mtime_ns: int
    offset: int  # send from here (an earlier part is on the controller already)


class SendRequest(TypedDict, total=False):
    """``send`` -> ``{"sent": int}``, after the raw stream of the files (module docstring)."""
    op: str
    root: str
    nonce: str  # hex, repeated in the line that starts the raw stream
    files: List[Wanted]


def _rel_ok(rel):
    parts = rel.split("/")
    return rel and not rel.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _skip(name):
    return name.startswith(".dfo") or name.lower() == ".git"


def op_list(req: ListRequest):
    root = node_path(req["root"])
    if not os.path.isdir(root):
        raise RemoteError("usage", "pull: %s is not a folder on the node" % root)
    starts = []
    for p in req.get("paths") or [""]:
        p = p.strip("/")
        if p and not _rel_ok(p):
            raise RemoteError("usage", "pull: %r: give paths relative to %s, without '..'" % (p, root))
        if p and any(_skip(c) for c in p.split("/")):
            raise RemoteError("usage", "pull: %r: .dfo and .git names are never pulled" % p)
        starts.append(p)
    files, links, missing = {}, [], []
    for start in starts:
        top = os.path.join(root, start) if start else root
        try:
            st = os.lstat(top)
        except FileNotFoundError:
            missing.append(start)
            continue
        if stat.S_ISREG(st.st_mode):
            files[start] = [st.st_size, st.st_mtime_ns]
            continue
        if not stat.S_ISDIR(st.st_mode):
            links.append(start)
            continue
        for dirpath, dirnames, filenames in os.walk(top):  # followlinks=False: a link to a folder is a name
            dirnames[:] = [d for d in dirnames if not _skip(d)]
            rel_dir = os.path.relpath(dirpath, root)
            for name in filenames + [d for d in list(dirnames) if os.path.islink(os.path.join(dirpath, d))]:
                if _skip(name):
                    continue
                rel = name if rel_dir == "." else rel_dir + "/" + name
                try:
                    est = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(est.st_mode):
                    files[rel] = [est.st_size, est.st_mtime_ns]
                else:
                    links.append(rel)
    return {"root": os.path.realpath(root), "files": files, "links": sorted(links)[:20], "n_links": len(links),
            "missing": missing}


def _grow_pipe(fd):
    """A bigger pipe to sshd, where stdout is one (Linux: F_SETPIPE_SZ, capped by
    /proc/sys/fs/pipe-max-size): a D record goes in with fewer wake-ups of this process and of sshd.
    Elsewhere, or refused, the pipe stays as it is."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import fcntl
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), CHUNK)
    except (OSError, ValueError):
        pass


class _Raw:
    """The raw stream on stdout (fd 1), started with its marker line, ended with a Z record."""

    def __init__(self, nonce):
        sys.stdout.flush()  # anything printed before goes first
        _grow_pipe(1)
        self.out = sys.stdout.buffer
        self.out.write(RAW_MARK + nonce.encode("ascii") + b"\n")

    def record(self, kind, i, body=b""):
        self.out.write(HEADER.pack(kind, i, len(body)))
        if body:
            self.out.write(body)

    def end(self):
        self.out.write(HEADER.pack(b"Z", 0, 0))
        self.out.flush()


def op_send(req: SendRequest):
    root = node_path(req["root"])
    nonce = req.get("nonce") or ""
    if not nonce or not all(c in "0123456789abcdef" for c in nonce) or len(nonce) > 64:
        raise RemoteError("usage", "pull: send needs a nonce (hex)")
    files = req.get("files") or []
    for f in files:
        rel = f["path"]
        if not _rel_ok(rel) or any(_skip(c) for c in rel.split("/")):
            raise RemoteError("usage", "pull: refused path %r" % rel)
    raw = _Raw(nonce)
    try:
        return {"sent": sum(_send_one(raw, root, i, f) for i, f in enumerate(files))}
    finally:
        raw.end()


def _send_one(raw, root, i, f):
    """File i as D records and its E record (1), or a C record (0)."""
    try:
        fd = os.open(os.path.join(root, f["path"]), os.O_RDONLY | FILE_FLAGS)
    except OSError:
        raw.record(b"C", i)
        return 0
    with os.fdopen(fd, "rb", buffering=0) as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != f["size"] or st.st_mtime_ns != f["mtime_ns"]:
            raw.record(b"C", i)
            return 0
        h = hashlib.sha256()
        offset = int(f.get("offset") or 0)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        done = 0
        while done < offset:  # the part the controller holds: hashed, not sent
            n = fh.readinto(view[:min(CHUNK, offset - done)])
            if not n:
                break
            h.update(view[:n])
            done += n
        left = f["size"] - done  # never more than listed: a file that grew is not sent past its size
        while left > 0:
            n = fh.readinto(view[:min(CHUNK, left)])
            if not n:
                break
            h.update(view[:n])
            raw.record(b"D", i, view[:n])
            left -= n
        raw.record(b"E", i, h.digest())
        return 1


OPS = {"list": op_list, "send": op_send}


def entry():
    """The module's run: ``python3 -m remote.files.pull``, or the controller's ``-c`` launch (agent.module_command)."""
    serve(OPS)


if __name__ == "__main__":
    entry()
