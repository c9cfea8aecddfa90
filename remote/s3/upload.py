"""The upload engine (python3 3.8+, stdlib only): files from this node to S3, never a partial object.

``Uploader(client, bucket, ...).upload(items)`` sends ``[{"path", "key", "size"}]``, many files at once:

* a file up to ``threshold`` bytes: read whole into memory, checked unchanged (same size, mtime, ctime
  and inode as before the read), then ONE PUT with Content-MD5 and its sha256 signed as the payload
  hash (the server refuses other bytes) and ``x-amz-meta-sha256``; the answer's ETag, when it is a
  plain MD5, must be the file's;
* a bigger file: its sha256 first (for ``x-amz-meta-sha256``), CreateMultipartUpload, then parts of
  ``part_size`` in parallel (each read once into a pooled buffer, the MD5 of those very bytes sent as
  Content-MD5, a signed header every S3 server checks, the payload sent as UNSIGNED-PAYLOAD: SeaweedFS
  and rclone do not check a signed payload hash, docs/data.md; the part's ETag checked against the
  MD5), and CompleteMultipartUpload only when every part is in,
  checked, and the file is still the one that was hashed. Anything else (a part that fails after its
  retries, a stop, a file that changed meanwhile) -> AbortMultipartUpload: no orphan parts, no object.

Every request is retried through ``remote.lib.retry`` (5 attempts, full jitter, Retry-After), as sync-data's.
The result per item: ``{"key", "size", "etag", "sha256", "ok", "error", "changed"}`` (``changed``: the
file changed while it was read or sent; nothing was completed, the next pass tries again), and
``refused`` (the exception) when the guard refused the write.

``guard`` (optional; ``remote.runs.generation.WriteGuard`` for a run that recovers): ``headers()`` go on
every object created, and ``condition(key, stop)``, asked right before each commit (the PUT, or
CompleteMultipartUpload), gives the conditional headers of that commit (If-Match / If-None-Match) or
raises an exception marked ``ends_pass`` (nothing committed). A commit refused by its condition (HTTP 412,
or 409 for a conflicting concurrent write) is tried again with a fresh condition, ``GUARD_TRIES`` times.

``remote.s3.limits``: ``CpuGovernor`` keeps the process's CPU time (hashing, Python, syscalls) at most ``cpu`` cores on
average over a few seconds: a worker that finds the budget spent sleeps before its next chunk.
"""
from __future__ import annotations

import base64
import hashlib
import http.client
import os
import re
import threading
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from remote.lib.retry import Stopped, retry
from remote.s3.errors import S3Error, strip_ns
from remote.s3.limits import CpuGovernor, MemBudget  # noqa: F401 - CpuGovernor: imported from here too
from remote.s3.sig import UNSIGNED_PAYLOAD

MIB = 1 << 20
CHUNK = 4 * MIB  # hashing granularity (the governor is asked between chunks)
READ_BUF = 1 * MIB  # the whole-file sha256's reads: one buffer, used again, small enough for a core's cache
MAX_PARTS = 10000  # S3's limit per multipart upload
MEMORY = 256 * MIB  # file content held in memory at once, at most (or threshold + one part, if more)
PLAIN_ETAG = re.compile(r"^[0-9a-fA-F]{32}$")
MULTI_ETAG = re.compile(r"^[0-9a-fA-F]{32}-(\d+)$")
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
GUARD_TRIES = 3  # commits refused by their condition (another writer came first) before the file fails


class Changed(Exception):
    """The file changed while it was read or sent."""


def part_size_for(size, part_size):
    """The part size for a file of ``size`` bytes: ``part_size``, or bigger (whole MiB) when S3's limit of
    10,000 parts would be passed (a 16 MiB part size reaches it at 156 GiB)."""
    need = -(-size // MAX_PARTS)
    return max(part_size, -(-need // MIB) * MIB)


def content_md5(digest):
    return base64.b64encode(digest).decode("ascii")


def multipart_etag(md5_digests):
    return "%s-%d" % (hashlib.md5(b"".join(md5_digests)).hexdigest(), len(md5_digests))


def _stat_id(st):
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _read_at(fd, off, n, buf=None):
    """``n`` bytes of ``fd`` at ``off``, read into ``buf`` (a bytearray of at least ``n`` bytes) when given;
    returns a memoryview of exactly those bytes."""
    if buf is None:
        buf = bytearray(n)
    view, got = memoryview(buf)[:n], 0
    while got < n:
        k = os.preadv(fd, [view[got:]], off + got)
        if not k:
            raise Changed("the file shrank while it was read")
        got += k
    return view


class BufferPool:
    """Part buffers used again instead of a fresh bytearray per part: glibc gives a buffer that big back
    to the kernel when it is freed, and the next one costs page faults and zeroing of every page
    (about 9% of the shipper's CPU on big files, docs/benchmarks.md). At most ``keep`` bytes stay pooled."""

    def __init__(self, keep):
        self.keep = keep
        self.free = []
        self.lock = threading.Lock()

    def take(self, n):
        with self.lock:
            for i, b in enumerate(self.free):
                if len(b) >= n:
                    return self.free.pop(i)
        return bytearray(n)

    def give(self, buf):
        with self.lock:
            if (len(self.free) + 1) * len(buf) <= self.keep:
                self.free.append(buf)


def local_etag(path, size, part_size, multipart, governor=None):
    """The ETag an upload of ``path`` gets: its MD5 for a single PUT, ``md5(part md5s)-N`` for a multipart
    one in ``part_size`` parts."""
    fd = os.open(path, OPEN_FLAGS)
    try:
        if not multipart:
            h = hashlib.md5()
            off = 0
            while off < size:
                if governor is not None:
                    governor.throttle()
                data = os.pread(fd, min(CHUNK, size - off), off)
                if not data:
                    break
                h.update(data)
                off += len(data)
            return h.hexdigest()
        digests = []
        for off in range(0, size, part_size):
            if governor is not None:
                governor.throttle()
            digests.append(hashlib.md5(_read_at(fd, off, min(part_size, size - off))).digest())
        return multipart_etag(digests)
    finally:
        os.close(fd)


class Uploader:
    def __init__(self, client, bucket, concurrency=8, part_size=16 * MIB, threshold=64 * MIB, cpu=2.0,
                 progress=None, stop=None, governor=None, journal=None, guard=None):
        self.client, self.bucket = client, bucket
        self.concurrency = max(1, int(concurrency))
        self.part_size = max(5 * MIB, int(part_size))
        self.threshold = max(int(threshold), 0)
        self.progress = progress
        self.stop = stop or threading.Event()
        self.governor = governor or CpuGovernor(cpu, stop=self.stop)
        self.parts_pool: Optional[ThreadPoolExecutor] = None  # while upload() runs
        self.journal = journal  # .opened(bucket, key, upload_id) / .closed(...): open uploads, kept on disk
        self.guard = guard  # conditional commits (module docstring)
        self.memory = MemBudget(max(self.threshold + self.part_size, min(self.concurrency * self.part_size, MEMORY)),
                                self.stop)
        self.buffers = BufferPool(self.memory.limit)

    # ------------------------------------------------------------------ driver
    def upload(self, items):
        """Upload every item; returns one result dict per item, in order. Never raises for an item."""
        if not items:
            return []
        self.parts_pool = parts_pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="dfo-part")
        try:
            with ThreadPoolExecutor(min(self.concurrency, len(items)), thread_name_prefix="dfo-put") as pool:
                return list(pool.map(self._one, items))
        finally:
            parts_pool.shutdown(wait=True)
            self.parts_pool = None
            self.buffers.free.clear()  # nothing held between passes (the shipper lives beside the trainer)

    def _one(self, item):
        res = {"key": item["key"], "size": item.get("size"), "etag": None, "sha256": None, "ok": False,
               "error": None, "changed": False}
        try:
            if self.stop.is_set():
                raise Stopped()
            fd = os.open(item["path"], OPEN_FLAGS)
            try:
                st = os.fstat(fd)
                res["size"] = st.st_size
                if st.st_size > self.threshold:
                    etag, sha = self._multipart(fd, item, st)
                else:
                    etag, sha = self._single(fd, item, st)
            finally:
                os.close(fd)
            res.update(etag=etag, sha256=sha, ok=True)
        except Exception as exc:  # noqa: BLE001 - one file's failure never ends the others
            res["error"] = self._describe(exc, item)
            if isinstance(exc, Changed):
                res["changed"] = True
            if getattr(exc, "ends_pass", False):
                res["refused"] = exc
            note = getattr(exc, "abort_failed", None)
            if note:
                res["error"] += "; " + note
        return res

    def _describe(self, exc, item):
        if isinstance(exc, Changed):
            return "%s: %s; not completed, the next pass sends it again" % (item["path"], exc)
        if isinstance(exc, Stopped):
            return "stopped before %s was complete" % self.client.where(self.bucket, item["key"])
        if isinstance(exc, S3Error):
            return exc.described()
        if isinstance(exc, OSError):
            return "%s: %s" % (item["path"], exc.strerror or exc)
        return "%s: %s: %s" % (item["path"], type(exc).__name__, exc)

    def _check_same(self, fd, path, st):
        now = os.fstat(fd)
        try:
            named = os.stat(path, follow_symlinks=False)
        except OSError:
            raise Changed("it was removed or renamed") from None
        if _stat_id(now) != _stat_id(st) or (named.st_ino, named.st_dev) != (st.st_ino, st.st_dev):
            raise Changed("it changed while it was read")

    def _retry(self, fn):
        return retry(fn, stop=self.stop)

    def _commit(self, key, send):
        """``send(headers)`` commits the object (retried); with a guard, under the condition it gives."""
        if self.guard is None:
            return self._retry(lambda: send({}))
        for _ in range(GUARD_TRIES - 1):  # no sleep: each look sees the newer object, or commits
            cond = self.guard.condition(key, self.stop)
            try:
                return self._retry(lambda cond=cond: send(cond))
            except S3Error as exc:
                if exc.status not in (409, 412):
                    raise
        cond = self.guard.condition(key, self.stop)
        return self._retry(lambda: send(cond))

    def _read(self, resp, key):
        """The answer's body; a connection that breaks while it is read is a retryable failure."""
        try:
            return resp.read()
        except (OSError, http.client.HTTPException) as exc:
            self.client._drop(self.client._target(self.bucket, key)[0])
            raise S3Error("unreachable", "%s: the answer broke off: %s" % (self.client.where(self.bucket, key), exc),
                          retryable=True) from None

    # ------------------------------------------------------------------ single PUT
    def _single(self, fd, item, st):
        held = self.memory.take(st.st_size)
        try:
            return self._single_held(fd, item, st)
        finally:
            self.memory.give(held)

    def _single_held(self, fd, item, st):
        key, size = item["key"], st.st_size
        data = bytearray(size)
        view = memoryview(data)
        off = 0
        while off < size:
            self.governor.throttle()
            n = os.preadv(fd, [view[off:min(off + CHUNK, size)]], off)
            if not n:
                raise Changed("it shrank while it was read")
            off += n
        self._check_same(fd, item["path"], st)
        md5 = hashlib.md5(data).digest()
        sha = hashlib.sha256(data).hexdigest()
        headers = {"content-md5": content_md5(md5), "x-amz-meta-sha256": sha,
                   "content-type": "application/octet-stream"}
        if self.guard is not None:
            headers.update(self.guard.headers())
        body = memoryview(data)

        def put(cond):
            resp = self.client.request("PUT", self.bucket, key, headers=dict(headers, **cond), body=body,
                                       payload_hash=sha)
            self._read(self.client.check(resp, self.bucket, key, "PUT"), key)
            return (resp.getheader("etag") or "").strip('"')

        etag = self._commit(key, put)
        if PLAIN_ETAG.match(etag) and etag.lower() != md5.hex():
            raise S3Error("verify", "%s: the server's ETag %s is not the MD5 of the bytes sent (%s)"
                          % (self.client.where(self.bucket, key), etag, md5.hex()))
        if self.progress is not None:
            self.progress(size)
        return etag or md5.hex(), sha

    # ------------------------------------------------------------------ multipart
    def _multipart(self, fd, item, st):
        key, size = item["key"], st.st_size
        psize = part_size_for(size, self.part_size)
        whole = hashlib.sha256()
        buf = memoryview(bytearray(READ_BUF))
        off = 0
        while off < size:  # sha256 of the whole file first: it goes in the object's metadata
            if self.stop.is_set():
                raise Stopped()
            if not off % CHUNK:
                self.governor.throttle()
            n = os.preadv(fd, [buf[:min(READ_BUF, size - off)]], off)
            if not n:
                raise Changed("it shrank while it was read")
            whole.update(buf[:n])
            off += n
        sha = whole.hexdigest()
        self._check_same(fd, item["path"], st)
        if self.journal is not None:  # before the upload exists: a SIGKILL right after it is created leaves a trace
            self.journal.opened(self.bucket, key, "")
        upload_id = self._create(key, sha)
        if self.journal is not None:
            self.journal.opened(self.bucket, key, upload_id)
            self.journal.closed(self.bucket, key, "")
        try:
            nparts = (size + psize - 1) // psize
            halt = threading.Event()  # a part failed: the others not yet started are not sent
            assert self.parts_pool is not None, "multipart uploads run inside upload()"
            futures = [self.parts_pool.submit(self._part, fd, key, upload_id, i * psize, i,
                                              min(psize, size - i * psize), halt) for i in range(nparts)]
            results, first = [], None
            for fut in futures:
                try:
                    results.append(fut.result())
                except BaseException as exc:  # noqa: BLE001 - every part is waited for, the first error raised
                    halt.set()
                    if first is None or isinstance(first, Stopped):
                        first = exc
            if first is not None:
                raise first
            self._check_same(fd, item["path"], st)
            etag = self._complete(key, upload_id, results)
        except BaseException as exc:
            note = self._abort(key, upload_id)
            if note:
                try:
                    setattr(exc, "abort_failed", note)  # noqa: B010 - any exception type
                except AttributeError:
                    pass
            raise
        if self.journal is not None:
            self.journal.closed(self.bucket, key, upload_id)
        return etag, sha

    def _create(self, key, sha):
        headers = {"x-amz-meta-sha256": sha, "content-type": "application/octet-stream"}
        if self.guard is not None:
            headers.update(self.guard.headers())

        def create():
            resp = self.client.request("POST", self.bucket, key, [("uploads", "")], headers=headers)
            return self._read(self.client.check(resp, self.bucket, key, "POST"), key)

        body = self._retry(create)
        try:
            root = ET.fromstring(body)
        except ET.ParseError:
            root = None
        upload_id = None
        if root is not None:
            for child in root:
                if strip_ns(child.tag) == "UploadId":
                    upload_id = (child.text or "").strip()
        if not upload_id:
            raise S3Error("verify", "%s: CreateMultipartUpload gave no UploadId" % self.client.where(self.bucket, key))
        return upload_id

    def _part(self, fd, key, upload_id, off, i, length, halt):
        if self.stop.is_set() or halt.is_set():
            raise Stopped()
        held = self.memory.take(length)
        try:
            return self._part_held(fd, key, upload_id, off, i, length, halt)
        finally:
            self.memory.give(held)

    def _part_held(self, fd, key, upload_id, off, i, length, halt):
        self.governor.throttle()
        buf = self.buffers.take(length)
        try:
            body = _read_at(fd, off, length, buf)
            md5 = hashlib.md5(body).digest()
            query = [("partNumber", str(i + 1)), ("uploadId", upload_id)]
            headers = {"content-md5": content_md5(md5)}
            label = "%s part %d" % (key, i + 1)

            def put():
                if self.stop.is_set():
                    raise Stopped()
                # Content-MD5 is signed and every S3 server checks it (the payload's sha256 is not checked
                # by SeaweedFS nor rclone: docs/data.md): the part goes as UNSIGNED-PAYLOAD, one hash less
                resp = self.client.request("PUT", self.bucket, key, query, headers=headers, label=label, body=body,
                                           payload_hash=UNSIGNED_PAYLOAD)
                self._read(self.client.check(resp, self.bucket, label, "PUT"), key)
                return (resp.getheader("etag") or "").strip('"')

            etag = self._retry(put)
        finally:
            self.buffers.give(buf)
        if PLAIN_ETAG.match(etag) and etag.lower() != md5.hex():
            raise S3Error("verify", "%s: part %d's ETag %s is not the MD5 of the bytes sent (%s)"
                          % (self.client.where(self.bucket, key), i + 1, etag, md5.hex()))
        if self.progress is not None:
            self.progress(length)
        return i + 1, etag or md5.hex(), md5

    def _complete(self, key, upload_id, parts):
        xml = "<CompleteMultipartUpload>%s</CompleteMultipartUpload>" % "".join(
            "<Part><PartNumber>%d</PartNumber><ETag>\"%s\"</ETag></Part>" % (n, etag) for n, etag, _ in parts)
        body = xml.encode("ascii")
        expected = multipart_etag([md5 for _, _, md5 in parts])
        if self.stop.is_set():
            raise Stopped()

        def complete(cond):
            resp = self.client.request("POST", self.bucket, key, [("uploadId", upload_id)], body=body,
                                       headers=dict({"content-type": "application/xml"}, **cond))
            text = self._read(self.client.check(resp, self.bucket, key, "POST"), key)
            try:
                root = ET.fromstring(text)
            except ET.ParseError:
                raise S3Error("unreachable", "%s: CompleteMultipartUpload: unreadable answer"
                              % self.client.where(self.bucket, key), retryable=True) from None
            if strip_ns(root.tag) == "Error":  # S3 may answer 200 and then an error in the body
                fields = {strip_ns(c.tag): (c.text or "") for c in root}
                code = fields.get("Code") or "Error"
                raise S3Error("verify", "%s: CompleteMultipartUpload: %s: %s" % (
                    self.client.where(self.bucket, key), code, fields.get("Message", "")), code=code,
                    retryable=code in ("InternalError", "SlowDown", "ServiceUnavailable"),
                    status=412 if code == "PreconditionFailed" else None)
            fields = {strip_ns(c.tag): (c.text or "") for c in root}
            return (fields.get("ETag") or "").strip().strip('"')

        etag = self._commit(key, complete)
        if MULTI_ETAG.match(etag) and etag.lower() != expected:
            raise S3Error("verify", "%s: the completed object's ETag %s is not the one of the parts sent (%s)"
                          % (self.client.where(self.bucket, key), etag, expected))
        return etag or expected

    def _abort(self, key, upload_id):
        note = abort_upload(self.client, self.bucket, key, upload_id)
        if note is None and self.journal is not None:
            self.journal.closed(self.bucket, key, upload_id)
        return note


def open_uploads(client, bucket, key):
    """The ids of the multipart uploads open for exactly ``key`` (ListMultipartUploads, first page)."""
    def ask():
        resp = client.request("GET", bucket, "", [("uploads", ""), ("prefix", key)], label=key)
        return client.check(resp, bucket, key, "GET").read()

    root = ET.fromstring(retry(ask))
    ids = []
    for up in root:
        if strip_ns(up.tag) != "Upload":
            continue
        fields = {strip_ns(c.tag): (c.text or "") for c in up}
        if fields.get("Key") == key and fields.get("UploadId"):
            ids.append(fields["UploadId"])
    return ids


def abort_upload(client, bucket, key, upload_id):
    """AbortMultipartUpload, retried (even after a stop): the parts must not stay behind. None when done
    (or the upload is gone already), else what went wrong."""
    def abort():
        resp = client.request("DELETE", bucket, key, [("uploadId", upload_id)])
        client.check(resp, bucket, key, "DELETE", ok=(200, 204, 404))
        try:
            resp.read()
        except (OSError, http.client.HTTPException):
            client._drop(client._target(bucket, key)[0])

    try:
        retry(abort)
    except (S3Error, OSError) as exc:
        return "and its multipart upload %s could not be aborted (%s): parts may be left behind" % (
            upload_id, exc.described() if isinstance(exc, S3Error) else exc)
    return None
