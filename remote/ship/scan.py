"""What the outputs shipper looks at (python3 3.8+, stdlib only): which files, settled or not, shipped or not.

* ``Includer``: gitignore-style include patterns (``*``, ``?``, ``[..]``, ``**``; a ``/`` inside or at
  the start anchors at outputs.path, else a pattern matches a name at any depth; a trailing ``/``
  matches folders, so everything under them; ``!`` excludes again; the last matching pattern decides).
* ``scan(root, includer)``: the regular files under ``root`` (symlinks are not followed, nor shipped),
  without any name that starts with ``.dfo`` at any level (dfo's bookkeeping).
* ``settled(st, now, settle, open_w)``: the settle rule (docs/outputs.md).
* ``open_for_writing()``: (st_dev, st_ino) of every file a process this user can see holds open for
  writing (/proc/PID/fd + fdinfo flags).
* ``Shipped``: PATH/.dfo/shipped.json, rel -> {size, mtime_ns, ino, etag, sha256, key}.
"""
from __future__ import annotations

import json
import os
import stat
import threading
from typing import Set, Tuple

from remote.lib.fsutil import FILE_FLAGS, write_atomic
from remote.lib.globpat import compile_rules

META = ".dfo"
SHIPPED = "shipped.json"
UPLOADS = "uploads.json"


class Includer:
    def __init__(self, patterns):
        self.rules = compile_rules(patterns if patterns is not None else ["**"])

    def included(self, rel):
        parts = rel.split("/")
        dirs = ["/".join(parts[:i]) for i in range(1, len(parts))]
        out = False
        for rx, neg, dir_only in self.rules:
            cands = dirs if dir_only else dirs + [rel]
            if any(rx.fullmatch(c) for c in cands):
                out = not neg
        return out


def never_shipped(rel):
    return any(p.startswith(META) for p in rel.split("/"))


def scan(root, includer, inodes=None):
    """[(rel, stat)] of the regular files under ``root`` that ship (sorted by rel); [] when root is missing.
    ``inodes``, a dict, gets {(st_dev, st_ino): rel} of EVERY regular file seen, shipped or not (a
    trainer's temporary name too), so that the next scan can tell a rename into place."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(META))
        base = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.startswith(META):
                continue
            rel = name if base == "." else base.replace(os.sep, "/") + "/" + name
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue  # gone meanwhile
            if not stat.S_ISREG(st.st_mode):
                continue
            if inodes is not None:
                inodes[(st.st_dev, st.st_ino)] = rel
            if includer.included(rel):
                found.append((rel, st))
    found.sort(key=lambda x: x[0])
    return found


def renamed(rel, st, before, before_names):
    """Whether the file at ``rel`` came by a rename (or a replacement) since the scan that gave ``before``
    ({(st_dev, st_ino): rel} of every file then; ``before_names``: its values as a set): its inode was
    there under another name (the trainer's temporary file), or ``rel`` was there as another inode."""
    if before is None:
        return False
    was = before.get((st.st_dev, st.st_ino))
    if was is not None:
        return was != rel
    return rel in before_names


def settled(st, now_ns, settle_s, open_w, moved=False):
    """Whether a file may ship now.

    * unchanged (neither content nor metadata) for ``settle_s`` seconds: yes;
    * it came into place by a rename: ``moved`` (see ``renamed``: the inode had another name at the
      last scan, or the name had another inode), or its ctime is later than its mtime (its metadata
      changed after its last write; the kernel's coarse clock often gives a rename the same tick, so
      this alone misses most renames) -- and no process holds it open for writing: yes, at once;
    * else: not yet. ``open_w()`` is called only when needed (it reads /proc)."""
    last = max(st.st_mtime_ns, st.st_ctime_ns)
    if now_ns - last >= int(settle_s * 1e9):
        return True
    if moved or st.st_ctime_ns > st.st_mtime_ns:
        return (st.st_dev, st.st_ino) not in open_w()
    return False


def open_for_writing(proc="/proc"):
    """{(st_dev, st_ino)} of the files open for writing (O_WRONLY or O_RDWR) by the processes this user
    may look at. Processes of other users are not visible, and so count as not writing."""
    held: Set[Tuple[int, int]] = set()
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return held
    for pid in pids:
        fddir = "%s/%s/fd" % (proc, pid)
        try:
            fds = os.listdir(fddir)
        except OSError:
            continue
        for fd in fds:
            try:
                with open("%s/%s/fdinfo/%s" % (proc, pid, fd)) as f:
                    info = f.read(256)
                flags = 0
                for line in info.splitlines():
                    if line.startswith("flags:"):
                        flags = int(line.split()[1], 8)
                        break
                if flags & 3 == 0:  # O_RDONLY
                    continue
                st = os.stat("%s/%s" % (fddir, fd))
            except (OSError, ValueError):
                continue
            if stat.S_ISREG(st.st_mode):
                held.add((st.st_dev, st.st_ino))
    return held


def _load_json(meta_fd, name):
    """The JSON document in file ``name`` of folder ``meta_fd`` (a symlink there is not followed)."""
    fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=meta_fd)
    with os.fdopen(fd, "rb") as f:
        return json.loads(f.read().decode("utf-8"))


class Shipped:
    """PATH/.dfo/shipped.json: what this path's files were shipped as (rel -> entry). ``meta_fd``: PATH/.dfo
    opened by ``remote.lib.destsafety.open_meta`` (no symlink followed, its owner and mode checked)."""

    def __init__(self, meta_fd):
        self.meta_fd = meta_fd
        self.files = {}

    def load(self):
        try:
            doc = _load_json(self.meta_fd, SHIPPED)
            files = doc.get("files") if isinstance(doc, dict) else None
            self.files = files if isinstance(files, dict) else {}
        except (OSError, ValueError):
            self.files = {}
        return self

    def current(self, rel, st, key):
        e = self.files.get(rel)
        if not e:
            return False
        return e.get("key") == key and e.get("size") == st.st_size and \
            e.get("mtime_ns") == st.st_mtime_ns and e.get("ino") == st.st_ino

    def record(self, rel, st, key, etag, sha256):
        self.files[rel] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino, "etag": etag,
                           "sha256": sha256, "key": key}

    def save(self):
        data = json.dumps({"version": 1, "files": self.files}, sort_keys=True, separators=(",", ":"))
        write_atomic(SHIPPED, data.encode("utf-8"), 0o600, dir_fd=self.meta_fd)


class OpenUploads:
    """PATH/.dfo/uploads.json: the multipart uploads this path's shipper has open. One left there by a
    shipper that was killed (SIGKILL, the node rebooted) is aborted by the next pass, so that no
    orphan parts stay behind (they cost storage and are invisible in a listing). ``meta_fd`` as Shipped's."""

    def __init__(self, meta_fd):
        self.meta_fd = meta_fd
        self.lock = threading.Lock()
        self.open = {}
        try:
            doc = _load_json(meta_fd, UPLOADS)
            for u in doc.get("uploads") or []:
                self.open[(u["bucket"], u["key"], u["id"])] = True
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            self.open = {}

    def _save(self):
        doc = {"uploads": [{"bucket": b, "key": k, "id": i} for b, k, i in sorted(self.open)]}
        write_atomic(UPLOADS, json.dumps(doc).encode("utf-8"), 0o600, dir_fd=self.meta_fd)

    def opened(self, bucket, key, upload_id):
        with self.lock:
            self.open[(bucket, key, upload_id)] = True
            self._save()

    def closed(self, bucket, key, upload_id):
        with self.lock:
            if self.open.pop((bucket, key, upload_id), None) is not None:
                self._save()

    def left(self):
        with self.lock:
            return sorted(self.open)
