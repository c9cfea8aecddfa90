"""The download engine: many objects at once, and ranged parts of big objects at once (stdlib only).

Every object is written under DEST/.dfo/tmp/ (a temp name on the destination's filesystem), its
size and content checked (``remote.s3.verify``), then renamed to its final name (its folder opened
without following symlinks, ``remote.lib.destsafety.Tree``) and recorded in the manifest's journal, with
the inode, ctime and owner it has there, at once; a reader never sees a half-written file under its final name and
an interrupted run never loses a finished object. One worker thread = one keep-alive connection.
A retryable failure (HTTP 408/429/5xx such as SlowDown, a connection reset or cut short) is asked
again through ``remote.lib.retry`` (5 attempts, full-jitter backoff, Retry-After honoured, a stop ends the
wait); the error that ends a run says how many attempts it took.
"""
from __future__ import annotations

import collections
import errno
import hashlib
import os
import threading
from typing import Any, Deque, Tuple

from remote._proto import RemoteError
from remote.lib.destsafety import identity
from remote.lib.fsutil import human_bytes as human  # the one byte-size formatter (s3sync imports it here)
from remote.lib.retry import retry
from remote.s3 import verify as s3verify
from remote.s3.client import RangeIgnored, S3Error, Stopped

READ_CHUNK = 4 << 20
TMP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class VerifyFailed(Exception):
    pass


class Obj:
    def __init__(self, key, rel, size, etag):
        self.key, self.rel, self.size, self.etag = key, rel, size, etag
        self.lock = threading.Lock()
        self.wlock = threading.Lock()  # one writer per file at a time: concurrent pwrite()s into one
        # file contend on its inode lock in the kernel (spinning), measured 2-10x slower on ext4
        self.tmp = None
        self.fd = None
        self.parts = 0
        self.part_size = 0
        self.done = set()
        self.got = 0
        self.hash_next = 0
        self.hashing = False
        self.finished = False
        self.verifier = None
        self.whole = False  # the server ignored Range: the object is fetched in one GET instead
        self.inflight = 0  # part tasks running now
        self.refetching = False


class Tasks:
    """Work for the workers. A big object starts as one "prepare" task (HEAD, plan its parts), which
    then puts its part tasks at the front; workers wait while a prepare task may still add work."""

    def __init__(self):
        self.cv = threading.Condition()
        self.items: Deque[Tuple[Any, Any]] = collections.deque()  # (object, "prepare" | part | None)
        self.producers = 0

    def put(self, item, producer=False):
        with self.cv:
            self.items.append(item)
            self.producers += 1 if producer else 0
            self.cv.notify()

    def produced(self, items):
        with self.cv:
            self.items.extendleft(reversed(items))
            self.producers -= 1
            self.cv.notify_all()

    def get(self, stop):
        with self.cv:
            while True:
                if stop.is_set():
                    return None
                if self.items:
                    return self.items.popleft()
                if self.producers <= 0:
                    return None
                self.cv.wait(0.1)


class Engine:
    def __init__(self, client, bucket, manifest, concurrency, part_size, threshold, progress, stop):
        self.client = client
        self.bucket = bucket
        self.manifest = manifest
        self.concurrency = concurrency
        self.part_size = part_size
        self.threshold = threshold
        self.progress = progress
        self.stop = stop
        self.tasks = Tasks()
        self.error = None
        self._err_lock = threading.Lock()
        self.open_objs = []

    # ------------------------------------------------------------------ driving
    def run(self, objs):
        """Fetch ``objs``; big ones first (they are split into parts), then the rest, largest first."""
        n_tasks = 0
        for o in sorted(objs, key=lambda x: -x.size):
            o.tmp = hashlib.sha1(o.rel.encode("utf-8")).hexdigest()[:20]  # a name under manifest.tmp_fd
            if o.size >= self.threshold:
                self.open_objs.append(o)
                self.tasks.put((o, "prepare"), producer=True)
                n_tasks += max(1, -(-o.size // self.part_size))
            else:
                self.tasks.put((o, None))
                n_tasks += 1
        n = max(1, min(self.concurrency, n_tasks))
        threads = [threading.Thread(target=self._worker, name="dfo-s3-%d" % i, daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # short waits keep the main thread responsive to signals
        self._cleanup()
        return self.error

    def _worker(self):
        try:
            while True:
                task = self.tasks.get(self.stop)
                if task is None:
                    return
                obj, part = task
                try:
                    if part is None:
                        self._fetch_whole(obj)
                    elif part == "prepare":
                        self._prepare(obj)
                    else:
                        self._fetch_part(obj, part)
                except Stopped:
                    return
                except BaseException as exc:  # noqa: BLE001 - the first failure stops every worker
                    if part == "prepare":
                        self.tasks.produced([])
                    self._fail(exc, obj)
                    return
        finally:
            self.client.close()

    def _fail(self, exc, obj):
        with self._err_lock:
            if self.error is None:
                self.error = (exc, obj)
        self.stop.set()

    def _cleanup(self):
        for o in self.open_objs:
            if o.fd is not None and not o.finished:
                try:
                    os.close(o.fd)
                except OSError:
                    pass
                o.fd = None
        self.manifest.clear_tmp()

    # ------------------------------------------------------------------ one object, one GET
    def _fetch_whole(self, obj, verify_as=None):
        """One GET of the whole object. ``verify_as() -> (verifier, hasher)`` replaces the verifier chosen
        from the response headers (a ranged object fetched whole: the check its HEAD chose)."""

        def once():  # a fresh temp file and a fresh count for every attempt
            fd = os.open(obj.tmp, TMP_FLAGS, 0o644, dir_fd=self.manifest.tmp_fd)
            counted = [0]
            chosen = []

            def on_headers(headers):
                if verify_as is not None:
                    v, hasher = verify_as()
                    chosen.append(v)
                    return hasher
                v = s3verify.for_whole_get(obj.etag, headers)
                chosen.append(v)
                return v

            def prog(n):
                counted[0] += n
                self.progress.add(n)

            try:
                self.client.get_into(self.bucket, obj.key, fd, 0, obj.size, False, on_headers, prog, self.stop,
                                     if_match=obj.etag, checksums=not s3verify.PLAIN_ETAG.match(obj.etag))
            except BaseException:
                os.close(fd)
                self.progress.add(-counted[0])
                raise
            return fd, chosen[-1] if chosen else None

        fd, verifier = self._retry(once)
        obj.got = obj.size
        self._finalize(obj, fd, verifier)

    # ------------------------------------------------------------------ ranged parts
    def _prepare(self, obj):
        """HEAD the object (checksums, encryption, and part 1's size for a multipart ETag), choose its
        verifier, align its download parts to its upload parts when they are known, queue the parts."""
        head = self._retry(lambda: self.client.head(self.bucket, obj.key))
        part1 = None
        if s3verify.MULTI_ETAG.match(obj.etag):
            try:
                part1 = int(self._retry(lambda: self.client.head(self.bucket, obj.key, 1)).get("content-length") or 0)
            except S3Error as exc:
                if exc.kind == "unreachable" or exc.status in (403,):
                    raise
                part1 = None  # a server without ?partNumber: no part-wise check
        obj.verifier = s3verify.for_ranged(obj.etag, obj.size, head, part1)
        size = self.part_size
        if isinstance(obj.verifier, s3verify.PartsVerifier):
            up = obj.verifier.part_size
            size = up * max(1, self.part_size // up)
        obj.part_size = size
        obj.parts = max(1, -(-obj.size // size))
        obj.fd = os.open(obj.tmp, TMP_FLAGS, 0o644, dir_fd=self.manifest.tmp_fd)
        self.tasks.produced([(obj, i) for i in range(obj.parts)])

    def _fetch_part(self, obj, i):
        """Part ``i``. When a server answers a ranged GET with the whole object (RFC 7233 lets it ignore
        Range), nothing of that answer is written: the object is marked ``whole``, parts not yet started
        are skipped, and the last part still running, once the others are out, fetches the object in
        one GET (its temp file truncated first, checked as its HEAD chose)."""
        with obj.lock:
            if obj.whole:
                return
            obj.inflight += 1
        refetch = False
        try:
            self._fetch_range(obj, i)
        except RangeIgnored:
            with obj.lock:
                obj.whole = True
        finally:
            with obj.lock:
                obj.inflight -= 1
                if obj.whole and obj.inflight == 0 and not obj.refetching:
                    obj.refetching = refetch = True
        if refetch:
            os.close(obj.fd)
            obj.fd = None
            self.progress.add(-obj.got)  # the parts finished before count again in the whole GET
            obj.got = 0
            self._fetch_whole(obj, self._whole_verifier(obj))

    def _whole_verifier(self, obj):
        v = obj.verifier
        if isinstance(v, s3verify.PartsVerifier):
            def fresh_parts():
                pv = s3verify.PartsVerifier(v.kind, v.expected, v.part_size, obj.size)
                return pv, pv.segment(0, obj.size)
            return fresh_parts
        if v is not None:
            def fresh():
                w = s3verify.Verifier(v.kind, v.expected)
                return w, w
            return fresh
        return None

    def _fetch_range(self, obj, i):
        start = i * obj.part_size
        length = min(obj.part_size, obj.size - start)
        parts = obj.verifier if isinstance(obj.verifier, s3verify.PartsVerifier) else None
        counted = [0]
        if length > 0:

            def prog(n):
                counted[0] += n
                self.progress.add(n)

            def once():
                seg = parts.segment(start, length) if parts is not None else None
                try:
                    self.client.get_into(self.bucket, obj.key, obj.fd, start, length, True,
                                         (lambda _h: seg), prog, self.stop, if_match=obj.etag,
                                         write_lock=obj.wlock, checksums=False, size=obj.size)
                except BaseException:
                    self.progress.add(-counted[0])
                    counted[0] = 0
                    raise

            self._retry(once)
        with obj.lock:
            if obj.whole:  # another part found the server ignoring Range: this object is fetched whole
                self.progress.add(-counted[0])
                return
            obj.done.add(i)
            obj.got += max(length, 0)
        if parts is None:
            self._advance_hash(obj)
        with obj.lock:
            if obj.finished or len(obj.done) < obj.parts:
                return
            if obj.verifier is not None and parts is None and obj.hash_next < obj.parts:
                return
            obj.finished = True
        self._finalize(obj, obj.fd, obj.verifier)

    def _advance_hash(self, obj):
        """Feed the verifier the parts that are complete and contiguous from the start (read back
        from the temp file, which the page cache still holds), in whichever worker gets there."""
        if obj.verifier is None:
            return
        psize = obj.part_size
        while True:
            with obj.lock:
                if obj.hashing or obj.hash_next not in obj.done:
                    return
                obj.hashing = True
                i = obj.hash_next
            try:
                off = i * psize
                end = min(off + psize, obj.size)
                while off < end:
                    data = os.pread(obj.fd, min(READ_CHUNK, end - off), off)
                    if not data:
                        raise VerifyFailed("%s: short read of the temp file at %d" % (obj.key, off))
                    obj.verifier.update(data)
                    off += len(data)
            except BaseException:
                with obj.lock:
                    obj.hashing = False
                raise
            with obj.lock:  # both at once: another worker must never see part i as not yet hashed
                obj.hash_next = i + 1
                obj.hashing = False

    # ------------------------------------------------------------------ finishing
    def _finalize(self, obj, fd, verifier):
        try:
            st = os.fstat(fd)
            if st.st_size != obj.size or obj.got != obj.size:
                raise VerifyFailed("%s: wrote %d bytes, the object has %d" % (self.client.where(self.bucket, obj.key),
                                                                               st.st_size, obj.size))
            if verifier is not None and not verifier.ok():
                raise VerifyFailed("%s: %s mismatch: expected %s, got %s; the file was not kept" % (
                    self.client.where(self.bucket, obj.key), verifier.kind, verifier.expected, verifier.actual()))
        finally:
            os.close(fd)
            obj.fd = None
        tree = self.manifest.tree
        reldir, name = tree.split(obj.rel)
        dfd = tree.dir(reldir, create=True)  # refuses a symlinked or foreign folder on the way
        os.rename(obj.tmp, name, src_dir_fd=self.manifest.tmp_fd, dst_dir_fd=dfd)  # replaces a symlink, never follows
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)  # after the rename: its ctime is what stays
        self.manifest.record(obj.rel, obj.size, obj.etag, st.st_mtime_ns, identity(st))
        self.progress.file_done(verifier.kind if verifier is not None else "size")

    def _retry(self, fn):
        """``fn()``, again after a retryable S3Error (remote.lib.retry: full jitter, Retry-After, ends on stop)."""
        return retry(fn, retry_on=_retryable, stop=self.stop)


def _retryable(exc):
    return isinstance(exc, S3Error) and exc.retryable


def describe_failure(exc, obj, dest, bucket, endpoint):
    """(kind, message, hint) for the first failure of a run."""
    where = "s3://%s/%s" % (bucket, obj.key) if obj is not None else "s3://%s" % bucket
    if isinstance(exc, S3Error):
        return exc.kind, exc.described(), exc.hint
    if isinstance(exc, RemoteError):  # the destination refused a folder (remote.lib.destsafety)
        return exc.kind, exc.message, exc.extra.get("hint")
    if isinstance(exc, VerifyFailed):
        return "verify", str(exc), "run the command again; if it repeats, the object on S3 is damaged"
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            free, inodes = free_bytes(dest), free_inodes(dest)
            left = ("%s and %s inodes free now" % (human(free), inodes) if inodes is not None
                    else human(free) + " free now")
            return ("verify", "no space left on the filesystem of %s while writing %s from %s (%s)"
                    % (dest, where, endpoint, left),
                    "free space (or inodes) there; finished files are kept, the next run fetches only the rest")
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return "verify", "%s is not writable (%s) while writing %s" % (dest, exc.strerror, where), \
                "choose a destination the SSH user may write, or fix its permissions"
        return "verify", "disk error writing %s under %s: %s" % (where, dest, exc.strerror or exc), None
    return "internal", "%s: %s (while fetching %s)" % (type(exc).__name__, exc, where), None


def free_bytes(path):
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def free_inodes(path):
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_favail if st.f_files else None  # some filesystems have no inode limit (f_files == 0)
