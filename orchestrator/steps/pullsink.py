"""Where dfo pull writes on this machine, and how: nothing the node says is trusted for it.

* ``PullDir``: the destination DIR, opened once; every folder inside it is opened without
  following symlinks (``O_NOFOLLOW`` from DIR's own descriptor), so a symlinked folder planted in
  DIR is never written through. DIR/.dfo/ holds the lock (one pull at a time per DIR, flock, not
  waited for), the pull manifest and partial/.
* ``Sink``: the node's stream (its records, read by steps.pullwire) into partial files. A file whose
  bytes would pass its listed size stops the transfer at once, before they are read. Each file is
  READ BACK from disk, not hashed from memory: a thread of its own (``ReadBack``) reads the partial
  file through a descriptor of its own, behind the writer (only bytes already written), while the
  transfer goes on, so the read-back no longer starts after the last byte. At the file's end it is
  fsync'ed and the read-back finishes (to the end of the file as it is on disk); its size must be
  the listed size and its sha256 the node's, before it is renamed into place, and only over a file
  this pull may replace (see ``PullDir.may_replace``).
* "As written" (issue 16): what is checked is the file on disk, so bytes spoiled there after they
  arrived are caught, also those the trailing read-back has already passed. The partial file's mtime
  is set to a mark (``MARK_NS``) after each write of dfo's; a write by anything else sets it to the
  time of day. Before each write of dfo's, and after the read-back has ended, the mtime must still be
  the mark, else the file is not kept (exit 3, as a wrong sha256). The placed file's mtime is the time
  it was placed. On a file system that does not keep the mark as set (it stores another mtime), the
  whole file is read again after its last byte instead, as before the read-back thread. (Not caught:
  a write in the microseconds between one of dfo's writes and its mark, a writer that sets the mtime
  back itself, writes through a shared mmap that the kernel has not yet stamped.)
* An OSError here (disk full, permission, a file size limit) is a ``LocalError`` naming the path
  (exit 3), never taken for the connection's failure.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from remote.lib.fsutil import FILE_FLAGS, write_atomic

from ..errors import VerifyError

MANIFEST = "pull-manifest.json"
READ_BACK = 4 << 20  # the read-back's buffer
SYNC_EVERY = 64 << 20  # the read-back thread flushes the file to disk every this many bytes read
MARK_NS = 0  # a partial file's mtime after each write of dfo's: no clock shows it, any other write changes it
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_SHA = re.compile(r"^[0-9a-f]{64}$")


class LocalError(VerifyError):
    """This machine could not write what the pull needs (disk full, permission): exit 3, naming the path."""

    kind = "local"


def local_error(exc: OSError, what: str, host: str) -> LocalError:
    return LocalError(f"pull: could not write {what} on this machine: {exc.strerror or exc}", host=host,
                      hint="free space or fix the permissions there, then run the same pull again (it resumes)")


class InTheWay(Exception):
    """A name along a file's path here that is a symlink or not a folder: dfo pull does not write through it."""


# code points HFS+ ignores in names (git's is_hfs_dotgit): ".g\u200cit" is .git on a Mac's disk
_IGNORED = re.compile("[\u200c-\u200f\u202a-\u202e\u206a-\u206f\ufeff]")


def is_git(rel: str) -> bool:
    """A name with a .git component, as any disk this runs on may spell it: any case, HFS+'s ignored
    code points, NTFS's trailing dots and spaces and its short name GIT~1."""
    for p in rel.split("/"):
        p = _IGNORED.sub("", p).lower().rstrip(". ")
        if p in (".git", "git~1"):
            return True
    return False


class PullDir:
    """DIR (``base`` joined with ``parts``, each part a single checked name), its .dfo/ and lock."""

    def __init__(self, base: Path, parts: list[str], host: str) -> None:
        self.path = base.joinpath(*parts)
        self.host = host
        self.fd = self.meta_fd = self.part_fd = self.lock_fd = -1
        try:
            try:
                base.mkdir(parents=True, exist_ok=True)  # the folder the user chose (--to DIR, or ./runs)
                self.fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
                for p in parts:
                    fd, self.fd = self.fd, -1
                    self.fd = self._child(fd, p, self.path, close=True)
                self.meta_fd = self._child(self.fd, ".dfo", self.path)
                self.lock_fd = os.open("lock", os.O_RDWR | os.O_CREAT | FILE_FLAGS, 0o644, dir_fd=self.meta_fd)
            except OSError as exc:
                raise local_error(exc, f"{self.path}/.dfo", host) from None
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise local_error(exc, f"{self.path}/.dfo/lock", host) from None
                holder = os.pread(self.lock_fd, 32, 0).decode("ascii", "replace").strip()
                raise VerifyError(f"pull: another dfo pull (pid {holder or '?'}) is writing into {self.path}",
                                  host=host, hint="wait for it to end (one pull at a time per folder), "
                                                  "or pull into another folder with --to") from None
            try:
                os.ftruncate(self.lock_fd, 0)
                os.pwrite(self.lock_fd, f"{os.getpid()}\n".encode("ascii"), 0)
                self.part_fd = self._child(self.meta_fd, "partial", self.path / ".dfo")
            except OSError as exc:
                raise local_error(exc, f"{self.path}/.dfo/partial", host) from None
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _child(fd: int, name: str, where: Path, close: bool = False) -> int:
        """The folder ``name`` in ``fd`` (made when missing), never through a symlink; ``close``: ``fd`` too."""
        try:
            try:
                os.mkdir(name, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                return os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(exc.errno, f"{where / name} is a symlink or not a folder; "
                                             "dfo pull writes through neither") from None
                raise
        finally:
            if close:
                os.close(fd)

    def close(self) -> None:
        for fd in (self.part_fd, self.lock_fd, self.meta_fd, self.fd):  # the lock ends with its descriptor
            if fd >= 0:
                os.close(fd)
        self.fd = self.meta_fd = self.part_fd = self.lock_fd = -1

    # ------------------------------------------------------------------ the manifest
    def read_manifest(self) -> dict[str, Any]:
        try:
            fd = os.open(MANIFEST, os.O_RDONLY | FILE_FLAGS, dir_fd=self.meta_fd)
            with os.fdopen(fd, "rb") as f:
                files = json.loads(f.read()).get("files", {})
        except (OSError, ValueError, AttributeError):
            return {}
        return files if isinstance(files, dict) else {}

    def save_manifest(self, doc: dict[str, Any]) -> None:
        try:
            write_atomic(MANIFEST, json.dumps(doc).encode("utf-8", "surrogateescape"), mode=0o644,
                         dir_fd=self.meta_fd)
        except OSError as exc:
            raise local_error(exc, f"{self.path}/.dfo/{MANIFEST}", self.host) from None

    # ------------------------------------------------------------------ files in DIR
    def parent(self, rel: str, create: bool) -> int | None:
        """A new descriptor of rel's folder in DIR, each step without following a link (None: missing,
        with ``create`` False). InTheWay when a step is a symlink or not a folder."""
        fd = os.dup(self.fd)
        parts = rel.split("/")[:-1]
        try:
            for i, p in enumerate(parts):
                if create:
                    try:
                        os.mkdir(p, 0o755, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    nfd = os.open(p, DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if create:
                        raise
                    os.close(fd)
                    return None
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise InTheWay(f"{'/'.join(parts[:i + 1])} here is a symlink or not a folder") from None
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def lstat(self, rel: str) -> os.stat_result | None:
        """The file here as it is (a link not followed), None when absent; InTheWay as ``parent``."""
        fd = self.parent(rel, create=False)
        if fd is None:
            return None
        try:
            return os.stat(rel.rsplit("/", 1)[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    @staticmethod
    def ours(st: os.stat_result, m: Any) -> bool:
        """The local file is as this pull's manifest says dfo wrote it (same size, mtime_ns and inode)."""
        return isinstance(m, dict) and stat.S_ISREG(st.st_mode) and \
            m.get("local") == [st.st_size, st.st_mtime_ns, st.st_ino]

    def may_replace(self, rel: str, m: Any, overwrite: bool) -> str | None:
        """None when the node's file may be written at rel, else why not (the local file is kept)."""
        try:
            st = self.lstat(rel)
        except InTheWay as exc:
            return str(exc)
        if st is None or self.ours(st, m):
            return None
        if stat.S_ISDIR(st.st_mode):
            return "a folder here"
        return None if overwrite else "not written by dfo pull, or changed since"


class ReadBack:
    """The sha256 of a partial file as it is on disk, read by a thread of its own behind the writer.

    ``fd`` is a descriptor of its own (read-only). ``wrote(n)``: the writer has written the file up to
    ``n`` bytes (those may be read now). ``finish()``: the writer is done; the thread reads on to the
    end of the file as it is, then (size read, hex sha256). The bytes hashed are read from the file,
    never taken from the writer's buffers; ``hashlib`` and the reads release the GIL, so the hashing
    runs beside the transfer. It also starts the disk writes early (an fsync every ``SYNC_EVERY`` bytes)
    so the writer's fsync at the end has little left to do."""

    def __init__(self, fd: int, available: int) -> None:
        self.fd = fd
        self.cond = threading.Condition()
        self.avail = available  # the bytes the writer has written (an earlier pull's part included)
        self.final = self.cancelled = False
        self.size = 0
        self.read = 0  # bytes read back so far
        self.digest = ""
        self.error: OSError | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="dfo-pull-readback")
        self.thread.start()

    def wrote(self, upto: int) -> None:
        with self.cond:
            self.avail = upto
            self.cond.notify()

    def _run(self) -> None:
        h = hashlib.sha256()
        pos = synced = 0
        buf = memoryview(bytearray(READ_BACK))  # one buffer for the whole file: no allocation per read
        try:
            while True:
                with self.cond:
                    while pos >= self.avail and not self.final and not self.cancelled:
                        self.cond.wait()
                    if self.cancelled:
                        return
                    want = READ_BACK if self.final else min(READ_BACK, self.avail - pos)
                got = os.preadv(self.fd, [buf[:want]], pos) if hasattr(os, "preadv") else \
                    _pread_into(self.fd, buf[:want], pos)
                if not got:
                    if self.final:  # the end of the file as it is on disk
                        self.size, self.digest = pos, h.hexdigest()
                        return
                    with self.cond:  # shorter than written: truncated here; the end will say its size
                        while not self.final and not self.cancelled:
                            self.cond.wait()
                    continue
                h.update(buf[:got])
                pos += got
                self.read = pos
                if pos - synced >= SYNC_EVERY:
                    os.fsync(self.fd)
                    synced = pos
        except OSError as exc:
            self.error = exc

    def finish(self) -> tuple[int, str]:
        """(the file's size as read, its sha256) once the thread has read it to its end; OSError if a read failed."""
        with self.cond:
            self.final = True
            self.cond.notify()
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.size, self.digest

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify()
        self.thread.join()


def _read_whole(fd: int) -> tuple[int, str]:
    """(size, sha256) of the file at ``fd``, read from its start to its end now."""
    h = hashlib.sha256()
    pos = 0
    buf = memoryview(bytearray(READ_BACK))
    while True:
        got = _pread_into(fd, buf, pos)
        if not got:
            return pos, h.hexdigest()
        h.update(buf[:got])
        pos += got


def _pread_into(fd: int, view: memoryview, pos: int) -> int:
    data = os.pread(fd, len(view), pos)
    view[:len(data)] = data
    return len(data)


class Sink:
    """Writes the node's events for ``wanted`` into DIR/.dfo/partial/, checks each file on disk, places it."""

    def __init__(self, d: PullDir, wanted: list[dict[str, Any]], manifest: dict[str, Any], overwrite: bool,
                 save: Callable[[], None]) -> None:
        self.d, self.wanted, self.manifest, self.overwrite, self.save = d, wanted, manifest, overwrite, save
        self.host = d.host
        self.cur: int | None = None
        self.last = -1  # the highest index the node has sent: it sends the files in the order asked
        self.fd = -1
        self.rb: ReadBack | None = None  # the current file's read-back
        self.rb_fd = -1
        self.spoiled = False  # the current file was written to here by something other than this pull
        self.mark = MARK_NS  # the mark's mtime as the file system keeps it (_set_mark)
        self.marking = True
        self.got = 0  # bytes of the current file received in this pull
        self.state: dict[int, str] = {}  # index -> "open" | "done" | "changed" | "bad" | "kept"
        self.bytes = 0
        self.done = 0
        self.changed: list[str] = []
        self.bad: list[str] = []
        self.kept: list[str] = []
        self.last_save = time.monotonic()

    @staticmethod
    def part(rel: str) -> str:
        return hashlib.sha256(rel.encode("utf-8", "surrogateescape")).hexdigest()[:32] + ".part"

    def resumable(self, rel: str, size: int, mtime_ns: int) -> int:
        """Bytes of rel already in its partial file from an interrupted pull of the same node file (0: none)."""
        name = self.part(rel)
        try:
            fd = os.open(name + ".json", os.O_RDONLY | FILE_FLAGS, dir_fd=self.d.part_fd)
            with os.fdopen(fd, "rb") as f:
                pm = json.loads(f.read())
            have = os.stat(name, dir_fd=self.d.part_fd, follow_symlinks=False).st_size
        except (OSError, ValueError):
            return 0
        ok = isinstance(pm, dict) and pm.get("path") == rel and pm.get("size") == size \
            and pm.get("mtime_ns") == mtime_ns
        return have if ok and 0 < have <= size else 0

    def _where(self, rel: str) -> str:
        return f"{self.d.path}/{rel} (partial: {self.d.path}/.dfo/partial/{self.part(rel)})"

    def _drop(self, rel: str) -> None:
        for name in (self.part(rel), self.part(rel) + ".json"):
            try:
                os.unlink(name, dir_fd=self.d.part_fd)
            except FileNotFoundError:
                pass

    def _open(self, i: int) -> None:
        f = self.wanted[i]
        name = self.part(f["path"])
        self.cur, self.got, self.state[i] = i, 0, "open"
        if f["offset"]:
            self.fd = os.open(name, os.O_WRONLY | FILE_FLAGS, dir_fd=self.d.part_fd)
            os.ftruncate(self.fd, f["offset"])
            os.lseek(self.fd, f["offset"], os.SEEK_SET)
        else:
            self.fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | FILE_FLAGS, 0o644, dir_fd=self.d.part_fd)
        self.spoiled = False
        self.mark = self._set_mark()
        self.marking = self.mark == MARK_NS  # a file system that keeps the mark as set (else: a full read at the end)
        self.rb_fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=self.d.part_fd)
        self.rb = ReadBack(self.rb_fd, f["offset"])
        write_atomic(name + ".json", json.dumps({"path": f["path"], "size": f["size"], "mtime_ns": f["mtime_ns"]}
                                                ).encode("utf-8", "surrogateescape"), dir_fd=self.d.part_fd)

    def _set_mark(self) -> int:
        """The partial file's mtime set to the mark; the mtime as the file system stored it."""
        os.utime(self.fd, ns=(MARK_NS, MARK_NS))
        return os.fstat(self.fd).st_mtime_ns

    def _marked(self) -> bool:
        """Nothing but this pull has written to the partial file since its last write (the mark is there)."""
        return os.fstat(self.fd).st_mtime_ns == self.mark

    def close(self) -> None:
        if self.rb is not None:
            self.rb.cancel()
            self.rb = None
        if self.rb_fd >= 0:
            os.close(self.rb_fd)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = self.rb_fd = -1
        self.cur = None

    def _check(self, kind: object, i: object) -> str:
        """The path of file ``i``, if the node may send a record of it now (asked for, in order, not ended)."""
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(self.wanted):
            self.abort()
            raise VerifyError(f"pull: the node sent a record for a file it was not asked for ({i!r})",
                              host=self.host, hint="the node's dfo code is not dfo's: check the node")
        rel: str = self.wanted[i]["path"]
        if self.state.get(i, "open") != "open" or i < self.last:
            self.abort()
            raise VerifyError(f"pull: the node sent {rel!r} again, after its end; the transfer was stopped",
                              host=self.host, hint="the node's dfo code is not dfo's: check the node")
        self.last = i
        return rel

    def announce(self, i: int, n: int) -> None:
        """The node is about to send ``n`` bytes of file ``i``: refused (the transfer stopped, nothing of
        the file kept) before they are read when they would pass the file's listed size."""
        rel = self._check("data", i)
        try:
            self._switch(i)
        except OSError as exc:
            self.close()
            raise local_error(exc, self._where(rel), self.host) from None
        f = self.wanted[i]
        if f["offset"] + self.got + n > f["size"]:
            self.abort()
            raise VerifyError(f"pull: the node sent more than the {f['size']} B it listed for {f['path']!r}; "
                              "the transfer was stopped and nothing of that file kept", host=self.host,
                              hint="the node's file grew while it was sent, or the node is not to be trusted")

    def on_event(self, ev: dict[str, Any]) -> None:
        """One record of the node's stream (steps.pullwire), in the events' envelope (remote/_proto.py):
        ``{"kind": "data", "i": N, "b": bytes}`` (file bytes, announced first; a ``D`` record),
        ``{"kind": "end", "i": N, "sha256": hex}`` (``E``) or ``{"kind": "changed", "i": N}`` (``C``)."""
        kind, i = ev.get("kind"), ev.get("i")
        if kind not in ("data", "end", "changed"):
            return
        rel = self._check(kind, i)
        assert isinstance(i, int)
        try:
            if kind == "data":
                self._data(i, ev)
            elif kind == "end":
                self._end(i, ev)
            else:
                if self.cur == i:
                    self.close()
                    self._drop(rel)
                self.state[i] = "changed"
                self.changed.append(rel)
        except OSError as exc:
            self.close()
            raise local_error(exc, self._where(rel), self.host) from None

    def _switch(self, i: int) -> None:
        if self.cur != i:
            if self.cur is not None:  # the node moved on without ending the file it was sending
                prev = self.wanted[self.cur]["path"]
                self.abort()
                raise VerifyError(f"pull: the node left {prev!r} unfinished; the transfer was stopped",
                                  host=self.host, hint="run the same pull again")
            self._open(i)

    def _data(self, i: int, ev: dict[str, Any]) -> None:
        f = self.wanted[i]
        self._switch(i)
        data = ev.get("b")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            self.abort()
            raise VerifyError(f"pull: the node sent malformed data for {f['path']!r}", host=self.host)
        view = memoryview(data)
        n = len(view)
        if f["offset"] + self.got + n > f["size"]:
            self.abort()
            raise VerifyError(f"pull: the node sent more than the {f['size']} B it listed for {f['path']!r}; "
                              "the transfer was stopped and nothing of that file kept", host=self.host,
                              hint="the node's file grew while it was sent, or the node is not to be trusted")
        if self.marking and not self.spoiled and not self._marked():
            self.spoiled = True  # written to here by another writer: not kept at its end (this pull goes on)
        while view:
            view = view[os.write(self.fd, view):]
        if self.marking and not self.spoiled:
            os.utime(self.fd, ns=(MARK_NS, MARK_NS))
        self.got += n
        self.bytes += n
        assert self.rb is not None
        self.rb.wrote(f["offset"] + self.got)

    def _end(self, i: int, ev: dict[str, Any]) -> None:
        f = self.wanted[i]
        rel = f["path"]
        self._switch(i)  # nothing after the offset (an empty file, or all of it was here)
        os.fsync(self.fd)
        assert self.rb is not None
        rb, self.rb = self.rb, None
        size, digest = rb.finish()  # the file as it is on disk, read behind the writer, not the bytes as they passed
        if not self.marking:  # the mark cannot tell another writer here: read the whole file again, as it is now
            size, digest = _read_whole(self.rb_fd)
        spoiled = self.marking and (self.spoiled or not self._marked())  # written to after a part was read back
        size = os.fstat(self.fd).st_size if spoiled else size  # cut short or grown since it was read
        if not spoiled:
            os.utime(self.fd)  # the placed file's mtime: now, not the mark
        self.close()
        self.state[i] = "bad"
        want = ev.get("sha256")
        if spoiled or size != f["size"] or not isinstance(want, str) or not _SHA.match(want) or digest != want:
            self._drop(rel)
            self.bad.append(rel + (f" ({size} B, listed {f['size']} B)" if size != f["size"] else
                                   " (written to here by something else while it was pulled)" if spoiled else ""))
            return
        why = self.d.may_replace(rel, self.manifest.get(rel), self.overwrite)  # again: DIR may have changed
        if why is not None:
            self._drop(rel)
            self.state[i] = "kept"
            self.kept.append(rel)
            return
        name = rel.rsplit("/", 1)[-1]
        try:
            pfd = self.d.parent(rel, create=True)
        except InTheWay:
            self._drop(rel)
            self.state[i] = "kept"
            self.kept.append(rel)
            return
        assert pfd is not None
        try:
            os.replace(self.part(rel), name, src_dir_fd=self.d.part_fd, dst_dir_fd=pfd)
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(pfd)
        self._drop(rel)  # the .json beside the partial file
        self.state[i] = "done"
        self.manifest[rel] = {"size": f["size"], "mtime_ns": f["mtime_ns"], "sha256": want,
                              "local": [st.st_size, st.st_mtime_ns, st.st_ino]}
        self.done += 1
        if time.monotonic() - self.last_save > 2:
            self.save()
            self.last_save = time.monotonic()

    def abort(self) -> None:
        """The current file's partial is not kept (the node broke the rules sending it)."""
        if self.cur is not None:
            rel = self.wanted[self.cur]["path"]
            self.state[self.cur] = "bad"
            self.close()
            self._drop(rel)

    def unfinished(self) -> list[str]:
        """Files the node neither ended nor reported changed."""
        return [w["path"] for i, w in enumerate(self.wanted) if self.state.get(i) in (None, "open")]
