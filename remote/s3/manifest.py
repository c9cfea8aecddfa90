"""The manifest beside the data: what dfo put under a destination, so a re-run fetches only what changed.

Layout under the destination directory (hidden, so globs like ``*.bin`` do not see it)::

    DEST/.dfo/manifest.json   {"version": 1, "source": "s3://b/p/",
                               "files": {REL: {size, etag, mtime_ns, ino, ctime_ns, uid}},
                               "other": {REL: {...}}}   files dfo wrote from an earlier source
    DEST/.dfo/journal.jsonl   one line per file finished (or deleted) since manifest.json was written
    DEST/.dfo/tmp/            files being written (temp names); removed at the start of every run
    DEST/.dfo/lock            flock'ed by the one transfer that may write DEST; holds its pid

A file counts as present when its manifest entry has the source's size and ETag AND the file on
disk is still the one dfo wrote: a regular file (not a symlink) with the recorded size, mtime,
inode, ctime and owner (so a file edited, truncated or swapped on the node, even keeping its size
and mtime, is fetched again, and reported in ``changed``). Entries written before inode/ctime/owner
were recorded (same version, fewer fields) count when size and mtime match and the file is this
user's and not writable by others; their identity is recorded then. An entry, with or without
those fields, is what "written by dfo" means: ``--delete`` removes only such files, and only while
they are still what dfo wrote.

Each finished file is appended to the journal at once (one ``write`` of one line, which a killed
process cannot tear); the journal is fsync'ed with every progress tick and folded into
manifest.json (temp name, fsync, rename, fsync of the folder) at the end of a run, failed or not.
Everything under ``.dfo/`` is opened relative to its folder fd, never through a symlink
(``remote.lib.destsafety``). Older dfo versions read this manifest too (they ignore the extra fields).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import time
from typing import List

from remote.lib import fsutil
from remote.lib.destsafety import META_DIR, Tree, _open_child, identity, open_dest

VERSION = 1
FILE_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
IDENTITY = ("ino", "ctime_ns", "uid")


def write_atomic(dir_fd, name, data):
    """Write bytes to ``name`` under folder ``dir_fd`` through a temp name there, durably."""
    fsutil.write_atomic(name, data, mode=0o600, dir_fd=dir_fd)


def _read(dir_fd, name):
    try:
        fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        chunks: List[bytes] = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


class Manifest:
    def __init__(self, dest, source, tree=None, field="dest"):
        self.dest = dest
        self.source = source
        self.tree = tree
        self.field = field
        self.meta = os.path.join(dest, META_DIR)
        self.tmp_dir = os.path.join(self.meta, "tmp")
        self.path = os.path.join(self.meta, "manifest.json")
        self.journal_path = os.path.join(self.meta, "journal.jsonl")
        self.files = {}
        self.other = {}  # files dfo wrote from an earlier source: still dfo's, for --delete
        self.changed = []  # files whose entry matched the source but which changed on the node
        self.meta_fd = None
        self.tmp_fd = None
        self._jfd = None
        self._lock_fd = None
        self._dirty = False
        self._uid = os.geteuid()

    # ------------------------------------------------------------------ lifecycle
    def open(self, lock_wait=15.0):
        """Open dest and .dfo/ (no symlinks), take the lock, load manifest + journal, clear stale temps."""
        if self.tree is None:
            self.tree = Tree(self.dest, open_dest(self.dest, self.field), self.field)
        try:
            self.meta_fd = _open_child(self.tree.fd, META_DIR, self.dest, self.field, 0o700, True, "the manifest")
            self.tmp_fd = _open_child(self.meta_fd, "tmp", self.meta, self.field, 0o700, True, "the manifest")
            self._lock_fd = os.open("lock", os.O_RDWR | os.O_CREAT | FILE_FLAGS, 0o644, dir_fd=self.meta_fd)
            deadline = time.monotonic() + lock_wait
            while True:
                try:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                        holder = os.pread(self._lock_fd, 32, 0).decode("ascii", "replace").strip()
                        raise BlockingIOError(errno.EAGAIN, "another dfo transfer (pid %s) is writing to %s" % (
                            holder or "?", self.dest)) from None
                    time.sleep(0.1)
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, ("%d\n" % os.getpid()).encode("ascii"), 0)  # who holds it (tests, humans)
            self._load()
            self.clear_tmp()
            self._jfd = os.open("journal.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND | FILE_FLAGS, 0o644,
                                dir_fd=self.meta_fd)
        except BaseException:
            self._close_fds()
            raise
        return self

    def clear_tmp(self):
        for name in os.listdir(self.tmp_fd):
            try:
                os.unlink(name, dir_fd=self.tmp_fd)
            except OSError:
                pass

    def _load(self):
        doc = None
        try:
            doc = json.loads((_read(self.meta_fd, "manifest.json") or b"").decode("utf-8"))
        except ValueError:
            doc = None
        if isinstance(doc, dict) and doc.get("version") == VERSION:
            self.other = dict(doc.get("other") or {})
            if doc.get("source") == self.source:
                self.files = dict(doc.get("files") or {})
            else:
                self.other.update(doc.get("files") or {})
                self._dirty = bool(doc.get("files"))
        for rel in self.files:
            self.other.pop(rel, None)
        lines = (_read(self.meta_fd, "journal.jsonl") or b"").split(b"\n")
        for line in lines:
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError:
                continue  # a torn last line, or garbage: ignore it (the file is fetched again)
            if not isinstance(rec, dict) or "k" not in rec:
                continue
            rel = rec["k"]
            if rec.get("deleted"):
                self.files.pop(rel, None)
                self.other.pop(rel, None)
            else:
                ent = {k: rec[k] for k in ("size", "etag", "mtime_ns") + IDENTITY if k in rec}
                if rec.get("source") == self.source:
                    self.files[rel] = ent
                    self.other.pop(rel, None)
                else:
                    self.other[rel] = ent
            self._dirty = True

    def _close_fds(self):
        for name in ("_jfd", "tmp_fd", "meta_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, None)
        if self.tree is not None:
            self.tree.close()

    def close(self):
        """Fold the journal into manifest.json and release the lock (safe to call twice)."""
        if self._lock_fd is None:
            return
        try:
            if self._dirty or _read(self.meta_fd, "manifest.json") is None:
                self.compact()
        finally:
            self._close_fds()

    # ------------------------------------------------------------------ records
    def _same(self, ent, st):
        """True when ``st`` (an lstat) is the file ``ent`` recorded; legacy entries: size + mtime only."""
        if not stat.S_ISREG(st.st_mode) or st.st_size != ent.get("size") or st.st_mtime_ns != ent.get("mtime_ns"):
            return False
        if "ino" not in ent:
            return st.st_uid == self._uid and not st.st_mode & 0o022
        return all(getattr(st, "st_" + k) == ent.get(k) for k in IDENTITY)

    def present(self, rel, size, etag):
        """True when ``rel`` was fetched from an object of this size and ETag and is unchanged on disk."""
        ent = self.files.get(rel)
        if not ent or ent.get("size") != size or ent.get("etag") != etag:
            return False
        st = self.tree.lstat(rel)
        if st is None:
            return False
        if not self._same(ent, st):
            self.changed.append(rel)
            return False
        if "ino" not in ent:  # written before identities were recorded: record it now
            self.record(rel, size, etag, st.st_mtime_ns, identity(st))
        return True

    def written(self):
        """Every file this dest's manifest says dfo wrote (this source's and earlier ones')."""
        return set(self.files) | set(self.other)

    def still_ours(self, rel, st):
        """For --delete: ``st`` is still the file dfo wrote at ``rel``."""
        ent = self.files.get(rel) or self.other.get(rel)
        return ent is not None and self._same(ent, st)

    def record(self, rel, size, etag, mtime_ns, ident=None):
        ent = {"size": size, "etag": etag, "mtime_ns": mtime_ns}
        ent.update(ident or {})
        self.files[rel] = ent
        self.other.pop(rel, None)
        rec = {"source": self.source, "k": rel}
        rec.update(ent)
        self._append(rec)

    def forget(self, rel):
        if self.files.pop(rel, None) is not None or self.other.pop(rel, None) is not None:
            self._append({"source": self.source, "k": rel, "deleted": True})

    def _append(self, rec):
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode("utf-8")
        assert self._jfd is not None, "Manifest.open() first"
        os.write(self._jfd, line)  # O_APPEND: one write per record, never interleaved
        self._dirty = True

    def sync(self):
        if self._jfd is not None:
            try:
                os.fsync(self._jfd)
            except OSError:
                pass

    def compact(self):
        doc = {"version": VERSION, "source": self.source, "files": self.files}
        if self.other:
            doc["other"] = self.other
        write_atomic(self.meta_fd, "manifest.json",
                     json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8"))
        if self._jfd is not None:
            os.ftruncate(self._jfd, 0)
        self._dirty = False
