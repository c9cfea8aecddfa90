"""The manifest beside the data: what dfo put under a destination, so a re-run fetches only what changed.

Layout under the destination directory (hidden, so globs like ``*.bin`` do not see it)::

    DEST/.dfo/manifest.json   {"version": 1, "source": "s3://b/p/", "files": {REL: {size, etag, mtime_ns}}}
    DEST/.dfo/journal.jsonl   one line per file finished (or deleted) since manifest.json was written
    DEST/.dfo/tmp/            files being written (temp names); removed at the start of every run
    DEST/.dfo/lock            flock'ed by the one transfer that may write DEST; holds its pid

A file counts as present when its manifest entry has the source's size and ETag AND the file on
disk still has the recorded size and mtime (so a file edited or truncated on the node is fetched
again). Each finished file is appended to the journal at once (one ``write`` of one line, which
a killed process cannot tear); the journal is fsync'ed with every progress tick and folded into
manifest.json (temp name, fsync, rename, fsync of the directory) at the end of a run, failed or not.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import time

META_DIR = ".dfo"
VERSION = 1


def write_atomic(path, data):
    """Write bytes to ``path`` through a temp name in the same directory, durably."""
    d = os.path.dirname(path) or "."
    tmp = os.path.join(d, ".%s.%d.tmp" % (os.path.basename(path), os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(d)


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Manifest:
    def __init__(self, dest, source):
        self.dest = dest
        self.source = source
        self.meta = os.path.join(dest, META_DIR)
        self.tmp_dir = os.path.join(self.meta, "tmp")
        self.path = os.path.join(self.meta, "manifest.json")
        self.journal_path = os.path.join(self.meta, "journal.jsonl")
        self.files = {}
        self._jfd = None
        self._lock_fd = None
        self._dirty = False

    # ------------------------------------------------------------------ lifecycle
    def open(self, lock_wait=15.0):
        """Create the hidden directory, take the lock, load manifest + journal, clear stale temps."""
        os.makedirs(self.tmp_dir, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.meta, "lock"), os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + lock_wait
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    holder = os.pread(self._lock_fd, 32, 0).decode("ascii", "replace").strip()
                    os.close(self._lock_fd)
                    self._lock_fd = None
                    raise BlockingIOError(errno.EAGAIN, "another dfo transfer (pid %s) is writing to %s" % (
                        holder or "?", self.dest)) from None
                time.sleep(0.1)
        os.ftruncate(self._lock_fd, 0)
        os.pwrite(self._lock_fd, ("%d\n" % os.getpid()).encode("ascii"), 0)  # who holds it (tests, humans)
        self._load()
        for name in os.listdir(self.tmp_dir):
            try:
                os.unlink(os.path.join(self.tmp_dir, name))
            except OSError:
                pass
        self._jfd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        return self

    def _load(self):
        doc = None
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError):
            doc = None
        if isinstance(doc, dict) and doc.get("version") == VERSION and doc.get("source") == self.source:
            self.files = dict(doc.get("files") or {})
        try:
            with open(self.journal_path, "rb") as f:
                lines = f.read().split(b"\n")
        except OSError:
            lines = []
        for line in lines:
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError:
                continue  # a torn last line, or garbage: ignore it (the file is fetched again)
            if not isinstance(rec, dict) or rec.get("source") != self.source:
                continue
            if rec.get("deleted"):
                self.files.pop(rec.get("k"), None)
            elif "k" in rec:
                self.files[rec["k"]] = {"size": rec["size"], "etag": rec["etag"], "mtime_ns": rec["mtime_ns"]}
            self._dirty = True

    def close(self):
        """Fold the journal into manifest.json and release the lock (safe to call twice)."""
        if self._lock_fd is None:
            return
        try:
            if self._dirty or not os.path.exists(self.path):
                self.compact()
        finally:
            if self._jfd is not None:
                os.close(self._jfd)
                self._jfd = None
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------ records
    def present(self, rel, size, etag):
        """True when ``rel`` was fetched from an object of this size and ETag and is unchanged on disk."""
        ent = self.files.get(rel)
        if not ent or ent.get("size") != size or ent.get("etag") != etag:
            return False
        try:
            st = os.stat(os.path.join(self.dest, rel))
        except OSError:
            return False
        return st.st_size == size and st.st_mtime_ns == ent.get("mtime_ns")

    def record(self, rel, size, etag, mtime_ns):
        self.files[rel] = {"size": size, "etag": etag, "mtime_ns": mtime_ns}
        self._append({"source": self.source, "k": rel, "size": size, "etag": etag, "mtime_ns": mtime_ns})

    def forget(self, rel):
        if self.files.pop(rel, None) is not None:
            self._append({"source": self.source, "k": rel, "deleted": True})

    def _append(self, rec):
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode("utf-8")
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
        write_atomic(self.path, json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8"))
        if self._jfd is not None:
            os.ftruncate(self._jfd, 0)
        else:
            try:
                os.truncate(self.journal_path, 0)
            except OSError:
                pass
        self._dirty = False
