"""The node side of ``dfo pull`` (python3 3.8+, stdlib only): list files under a folder, then send some.

* ``list``: every regular file under ``root`` (or under the given relative ``paths`` in it), with
  its size and mtime. Symlinks are not followed (and not sent: they are listed under
  ``links``); names starting with ``.dfo`` are dfo's bookkeeping and never listed, nor is a
  ``.git`` folder (the controller refuses such names anyway: it never writes into .git).
* ``send``: for each requested file, opened with O_NOFOLLOW and still of the size and mtime the
  controller saw, the bytes from ``offset`` on, as events ``{"t": "d", "i": N, "b": base64}``
  (1 MiB each), then ``{"t": "end", "i": N, "sha256": ...}``: the sha256 of the WHOLE file, read
  as it is sent, so the controller checks what it holds (an earlier part included) on arrival.
  A file that changed since it was listed is reported (``{"t": "changed"}``) and skipped.
"""
from __future__ import annotations

import base64
import hashlib
import os
import stat
from typing import Dict, List, TypedDict

from remote._proto import RemoteError, emit_event, serve
from remote.lib.fsutil import FILE_FLAGS, node_path

CHUNK = 1 << 20


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
    """``send`` -> ``{"sent": int}``, after events per file: ``{"t": "d", "i": N, "b": base64}`` (1 MiB
    each), ``{"t": "end", "i": N, "sha256": whole file}``, or ``{"t": "changed", "i": N}``."""
    op: str
    root: str
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


def op_send(req: SendRequest):
    root = node_path(req["root"])
    sent = 0
    for i, f in enumerate(req.get("files") or []):
        rel = f["path"]
        if not _rel_ok(rel) or any(_skip(c) for c in rel.split("/")):
            raise RemoteError("usage", "pull: refused path %r" % rel)
        try:
            fd = os.open(os.path.join(root, rel), os.O_RDONLY | FILE_FLAGS)
        except OSError:
            emit_event({"t": "changed", "i": i})
            continue
        with os.fdopen(fd, "rb", buffering=0) as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != f["size"] or st.st_mtime_ns != f["mtime_ns"]:
                emit_event({"t": "changed", "i": i})
                continue
            h = hashlib.sha256()
            offset = int(f.get("offset") or 0)
            done = 0
            while done < offset:  # the part the controller holds: hashed, not sent
                buf = fh.read(min(CHUNK * 8, offset - done))
                if not buf:
                    break
                h.update(buf)
                done += len(buf)
            while True:
                buf = fh.read(CHUNK)
                if not buf:
                    break
                h.update(buf)
                emit_event({"t": "d", "i": i, "b": base64.b64encode(buf).decode("ascii")})
            emit_event({"t": "end", "i": i, "sha256": h.hexdigest()})
            sent += 1
    return {"sent": sent}


OPS = {"list": op_list, "send": op_send}


if __name__ == "__main__":
    serve(OPS)
