"""Reading a run's log as it grows, on the node (python3 3.8+, stdlib only); used by remote.runs.

``LogReader`` reads the log from a byte offset and notices when the file under the offset changed:

* truncated (``: > log``, logrotate's copytruncate): the file is shorter than the offset;
* replaced (``mv log log.1`` and a new ``log``): the path names another file (device:inode) than
  the one being read. The old file is read to its end first, then the new one from its start.

Either way reading goes on from the new start, and ``remote.runs.ops.follow`` tells the controller
with a ``reset`` event (``{"kind": "reset", "offset": 0, "why": ..., "log": PATH, "ino": ...}``). The
controller sends back the identity (``ino``) of the file its offset belongs to when it resumes after
a dropped connection, so a file replaced while nobody was watching is caught too. (A file truncated
and then grown past the offset between two looks cannot be told from one that only grew; ``tail -F``
has the same limit.)
"""
import errno
import os
import select
import time

from remote.runs import record as rec


def ident(st):
    return "%d:%d" % (st.st_dev, st.st_ino)


def chunk_fields(offset, data):
    """A ``chunk`` event's fields (and ``read``'s reply): ``o``, and ``t`` (UTF-8 text) or ``d`` (base64)."""
    try:
        return {"o": offset, "t": data.decode("utf-8")}
    except UnicodeDecodeError:
        import base64  # bytes that are not UTF-8 only

        return {"o": offset, "d": base64.b64encode(data).decode()}


def start_offset(log, req):
    if req.get("offset") is not None:
        return int(req["offset"])
    if not os.path.exists(log):
        return 0
    lines = req.get("lines")
    if lines is None:
        return 0
    if isinstance(lines, str) and lines.startswith("+"):
        return rec.offset_of_line(log, int(lines[1:]))
    return rec.offset_of_last_lines(log, int(lines))


class LogReader:
    """The log at ``path`` from ``offset``; ``ino``: the file that offset belongs to, if known."""

    def __init__(self, path, offset, ino=None):
        self.path, self.offset, self.ino, self.f = path, offset, ino, None

    def open(self):
        """Open the log if it is there; "replaced"/"truncated" when the offset no longer fits it."""
        try:
            f = open(self.path, "rb")
        except OSError:
            return None
        st = os.fstat(f.fileno())
        why = None
        if self.ino is not None and ident(st) != self.ino:
            why = "replaced"
        elif st.st_size < self.offset:
            why = "truncated"
        if why:
            self.offset = 0
        f.seek(self.offset)
        self.f, self.ino = f, ident(st)
        return why

    def size(self):
        return os.fstat(self.f.fileno()).st_size if self.f is not None else 0

    def read(self, n):
        """(offset, bytes) of the next at most ``n`` bytes; empty bytes at the end of the file."""
        at = self.offset
        data = self.f.read(n) if self.f is not None else b""
        self.offset += len(data)
        return at, data

    def changed(self):
        """Call at the end of the file: "truncated" or "replaced" (and reading restarts at the new
        start), or None. A path with no file (moved away, no new one yet) is waited for."""
        if self.f is None:
            return None
        if os.fstat(self.f.fileno()).st_size < self.offset:
            self.offset = 0
            self.f.seek(0)
            return "truncated"
        try:
            now = ident(os.stat(self.path))
        except OSError:
            return None
        if now == self.ino:
            return None
        self.f.close()
        self.f, self.ino, self.offset = None, None, 0
        self.open()  # if the new file vanished meanwhile, the caller's next open() finds the next one
        return "replaced"

    def reset_fields(self, why):
        """A ``reset`` event's fields: reading goes on from ``offset`` (the new file's start)."""
        return {"offset": self.offset, "why": why, "log": self.path, "ino": self.ino}

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None


class Watch:
    """Wake on writes to the log or files appearing in the run dir (inotify via ctypes), else poll."""

    IN_MODIFY, IN_MOVED_TO, IN_CREATE = 0x2, 0x80, 0x100

    def __init__(self, run_dir, log):
        self.fd, self.libc, self.wd = None, None, -1
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0:
                self.wd = libc.inotify_add_watch(fd, log.encode(), self.IN_MODIFY)
                ok = libc.inotify_add_watch(fd, run_dir.encode(), self.IN_MOVED_TO | self.IN_CREATE) >= 0
                if ok and self.wd >= 0:
                    self.fd, self.libc = fd, libc
                else:
                    os.close(fd)
        except (OSError, AttributeError, ImportError):
            self.fd = None

    def watch_file(self, path):
        """Wake on writes to ``path`` (a log that replaced the one watched so far) instead: the old
        file may still be written to by the trainer, which must not keep waking the reader."""
        libc = self.libc
        if self.fd is None or libc is None:
            return
        libc.inotify_rm_watch(self.fd, self.wd)  # fails harmlessly if the inode is gone
        self.wd = libc.inotify_add_watch(self.fd, path.encode(), self.IN_MODIFY)
        if self.wd < 0:
            os.close(self.fd)
            self.fd = None  # poll from now on

    def wait(self, timeout):
        if self.fd is None:
            time.sleep(min(timeout, 0.05))
            return
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                while os.read(self.fd, 65536):
                    pass
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    raise
