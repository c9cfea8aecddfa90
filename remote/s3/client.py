"""A small S3 client on the standard library (python3 3.8+): just what a download engine needs.

* one keep-alive HTTP(S) connection per worker thread (``http.client``), reopened after an error;
* requests signed with SigV4 (``remote.s3.sig``), or unsigned when there are no credentials;
* ListObjectsV2, paginated, parsed with ElementTree; HEAD; GET of a whole object or a byte range
  streamed with ``readinto`` into a reused buffer and written with ``os.pwrite`` at its offset;
* errors become ``S3Error`` (``remote.s3.errors``: kind, message naming the object and the endpoint,
  whether a retry may help, the server's Retry-After); a keep-alive connection found closed is reopened
  once at once, every other retry is the caller's, through ``remote.lib.retry`` (listing pages here);
* a ranged GET is accepted as 206, or as 200 when its Content-Range is the range asked for (rclone's
  S3 server answers so); a Content-Range for other bytes is refused (they would land at the wrong
  offset); a 200 with the whole object (a server may ignore Range, RFC 7233) raises ``RangeIgnored``
  before any byte is written, for the caller to fetch the object in one GET instead.

Path-style addressing for a custom endpoint (SeaweedFS, MinIO, Ceph, R2 ...), virtual-hosted
style on AWS itself.
"""
from __future__ import annotations

import hashlib
import http.client
import os
import socket
import threading
import xml.etree.ElementTree as ET
from urllib.parse import urlsplit

from remote.lib.retry import Stopped, parse_retry_after, retry
from remote.s3.errors import (  # S3Error, RangeIgnored, parse_content_range are imported from here too
    ERR_READ_MAX,
    RETRYABLE_STATUS,
    RangeIgnored,
    S3Error,
    as_int,
    error_fields,
    parse_content_range,
    short_text,
    strip_ns,
)
from remote.s3.sig import EMPTY_SHA256, sign, uri_encode

# Receive buffer of get_into(): small enough to stay in a core's L2 cache between recv_into() and the
# pwrite()/hash that read it back (1 MiB spilled to L3/DRAM: the page-cache copy then took half the
# engine's CPU; docs/benchmarks.md, ## sync-data).
BUF_SIZE = 256 << 10
def split_s3_url(url):
    """``s3://bucket/some/prefix`` -> ("bucket", "some/prefix")."""
    if not url.startswith("s3://"):
        raise ValueError("not an s3:// URL: %s" % url)
    rest = url[5:]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError("no bucket in %s" % url)
    return bucket, prefix


def _lost(exc):
    """A request that found its keep-alive connection closed by the server (worth one quiet reopen)."""
    return isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError))


class S3Client:
    def __init__(self, endpoint_url, region, creds, timeout=60.0):
        self.region = region or "us-east-1"
        self.creds = creds if creds and creds.get("access_key") else None
        if endpoint_url:
            parts = urlsplit(endpoint_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("endpoint_url must look like http(s)://host[:port], got %r" % endpoint_url)
            self.scheme, self.netloc = parts.scheme, parts.netloc
            self.base_path = parts.path.rstrip("/")
            self.virtual = False
        else:
            self.scheme, self.netloc, self.base_path = "https", "s3.%s.amazonaws.com" % self.region, ""
            self.virtual = True
        self.endpoint = "%s://%s" % (self.scheme, self.netloc)
        self.timeout = timeout
        self._local = threading.local()
        self._ssl = None
        if self.scheme == "https":
            import ssl  # only for https endpoints: saves its import time on every plain-http run

            self._ssl = ssl.create_default_context()

    # ------------------------------------------------------------------ connections
    def _conn(self, netloc):
        conns = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        c = conns.get(netloc)
        if c is None:
            if self.scheme == "https":
                c = http.client.HTTPSConnection(netloc, timeout=self.timeout, context=self._ssl)
            else:
                c = http.client.HTTPConnection(netloc, timeout=self.timeout)
            conns[netloc] = c
        return c

    def _drop(self, netloc):
        conns = getattr(self._local, "conns", {})
        c = conns.pop(netloc, None)
        if c is not None:
            c.close()

    def close(self):
        for netloc in list(getattr(self._local, "conns", {})):
            self._drop(netloc)

    def _target(self, bucket, key):
        if self.virtual and "." not in bucket:
            return "%s.%s" % (bucket, self.netloc), "/" + uri_encode(key, True)
        path = "%s/%s" % (self.base_path, bucket)
        if key:
            path += "/" + uri_encode(key, True)
        return self.netloc, path

    def where(self, bucket, key=""):
        return "s3://%s/%s (%s)" % (bucket, key, self.endpoint)

    # ------------------------------------------------------------------ requests
    def request(self, method, bucket, key="", query=(), headers=None, label=None, body=None, payload_hash=None):
        """Send one request and return the response with its body unread (status not checked).
        ``label`` names what is asked for in error messages (default: the key). ``body`` (bytes or a
        memoryview) goes out with its Content-Length; its sha256 (``payload_hash``, hex, computed here
        when not given) is signed, so the server refuses bytes that differ from the ones hashed."""
        netloc, path = self._target(bucket, key)
        hdrs = {"host": netloc}
        hdrs.update(headers or {})
        if body is not None:
            hdrs["content-length"] = str(memoryview(body).nbytes)
            if payload_hash is None and self.creds:
                payload_hash = hashlib.sha256(body).hexdigest()
        if self.creds:
            sign(method, path, list(query), hdrs, self.creds, self.region, payload_hash=payload_hash or EMPTY_SHA256)
        url = path
        if query:
            url += "?" + "&".join("%s=%s" % (uri_encode(k, False), uri_encode(v, False)) for k, v in query)

        def send():
            conn = self._conn(netloc)
            try:
                conn.request(method, url, body=body, headers=hdrs)
                return conn.getresponse()
            except BaseException:
                self._drop(netloc)
                raise

        try:  # a keep-alive connection the server closed while idle: reopen once, at once and quietly
            return retry(send, attempts=2, base=0.0, cap=0.0, retry_on=_lost)
        except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
            raise S3Error("unreachable", "%s: connection lost: %s" % (self.where(bucket, label or key), exc),
                          retryable=True) from None
        except (OSError, http.client.HTTPException) as exc:
            raise self._net_error(exc, bucket, label or key) from None

    def _net_error(self, exc, bucket, key):
        if isinstance(exc, socket.gaierror):
            what = "cannot resolve the endpoint's host name"
        elif isinstance(exc, ConnectionRefusedError):
            what = "connection refused"
        elif isinstance(exc, (socket.timeout, TimeoutError)):
            what = "no answer within %gs" % self.timeout
        elif type(exc).__name__.startswith("SSL"):
            what = "TLS error: %s" % exc
        else:
            what = "%s: %s" % (type(exc).__name__, exc)
        return S3Error("unreachable", "%s: %s" % (self.where(bucket, key), what), retryable=True,
                       hint="check s3.endpoint_url in the job file and that the node can reach it")

    def _http_error(self, resp, bucket, key, method):
        length = as_int(resp.getheader("content-length"))
        body = b""
        if method != "HEAD" and (length is None or length <= ERR_READ_MAX):
            body = resp.read(ERR_READ_MAX + 1)
        complete = method == "HEAD" or resp.isclosed()
        code, message, region = error_fields(body, resp.getheader("content-type"), length, complete)
        status = resp.status
        if code is None:
            code = {403: "AccessDenied", 404: "NotFound", 301: "PermanentRedirect"}.get(status, "HTTP%d" % status)
        region = region or resp.getheader("x-amz-bucket-region")
        hint = None
        if code in ("NoSuchBucket",):
            hint = "check the bucket name in the job file (and s3.endpoint_url)"
        elif code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
            hint = "check the credentials (s3.profile / AWS_* variables, or s3.credentials: node) and the bucket policy"
        elif code in ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"):
            hint = "the bucket lives in another region%s; set s3.region in the job file" % (
                " (%s)" % region if region else "")
        elif code == "PreconditionFailed" or status == 412:
            code = "PreconditionFailed"
            hint = "the object changed on S3 while dfo read it; run the command again"
        elif status == 416:
            hint = "the object shrank on S3 while dfo read it; run the command again"
        elif status in (429, 503) or code in ("SlowDown", "RequestLimitExceeded", "TooManyRequests"):
            hint = "the S3 server asks for fewer requests; lower s3.concurrency in the job file, or try again later"
        text = "%s: %s (HTTP %d)%s" % (self.where(bucket, key), code, status, ": " + message if message else "")
        return S3Error("verify", text, status=status, code=code, retryable=status in RETRYABLE_STATUS, hint=hint,
                       retry_after=parse_retry_after(resp.getheader("retry-after")))

    def check(self, resp, bucket, key, method, ok=(200,)):
        if resp.status not in ok:
            err = self._http_error(resp, bucket, key, method)
            unread = method != "HEAD" and not resp.isclosed()
            if resp.will_close or method != "HEAD":
                resp.close()
            if unread:  # the rest of the body is still on the wire: this connection cannot be reused
                self._drop(self._target(bucket, key)[0])
            raise err
        return resp

    def _check_range(self, resp, bucket, key, start, length, size):
        """A ranged GET's answer must be the range asked for (206, or 200 with that Content-Range)."""
        value = resp.getheader("content-range")
        if value is None and resp.status == 206:
            return  # no Content-Range to compare: Content-Length and the object's checksum still are
        if value is None:
            got = as_int(resp.getheader("content-length"))
            if start == 0 and got == length and size in (None, length):
                return  # the range asked for was the whole object
            raise RangeIgnored("%s: the server ignored Range (HTTP 200, %s bytes, no Content-Range)"
                               % (self.where(bucket, key), got if got is not None else "unknown"))
        rng = parse_content_range(value)
        if rng is not None and rng[:2] == (start, start + length - 1):
            if size is None or rng[2] in (None, size):
                return
            raise S3Error("verify", "%s: the object has %d bytes now, %d when listed (it changed while it was "
                          "read?)" % (self.where(bucket, key), rng[2], size), retryable=True)
        raise S3Error("verify", "%s: asked for bytes=%d-%d, the server sent Content-Range %s (HTTP %d); "
                      "those bytes were not written" % (self.where(bucket, key), start, start + length - 1,
                                                         short_text(value, 80) or "(unreadable)", resp.status),
                      hint="this S3 server answers ranged GETs wrongly; set s3.multipart_threshold_mb above "
                      "the largest object so that each is fetched in one GET")

    # ------------------------------------------------------------------ operations
    def list_objects(self, bucket, prefix, stop=None):
        """Yield dicts {key, size, etag, checksum_algorithm} under ``prefix``, every page (each page
        asked again after a retryable failure, ``remote.lib.retry``)."""
        token = None
        while True:
            query = [("list-type", "2"), ("prefix", prefix), ("max-keys", "1000")]
            if token:
                query.append(("continuation-token", token))

            def page(query=query):
                try:
                    resp = self.check(self.request("GET", bucket, "", query, label=prefix), bucket, prefix, "GET")
                    return resp.read()
                except (OSError, http.client.HTTPException) as exc:
                    self._drop(self._target(bucket, "")[0])
                    raise S3Error("unreachable", "%s: listing broke: %s" % (self.where(bucket, prefix), exc),
                                  retryable=True) from None
                except S3Error:
                    self._drop(self._target(bucket, "")[0])
                    raise

            body = retry(page, stop=stop)
            try:
                root = ET.fromstring(body)
            except ET.ParseError as exc:
                raise S3Error("verify", "%s: unreadable listing (%s)" % (self.where(bucket, prefix), exc)) from None
            token, truncated = None, False
            for child in root:
                tag = strip_ns(child.tag)
                if tag == "Contents":
                    item = {strip_ns(c.tag): (c.text or "") for c in child}
                    yield {"key": item.get("Key", ""), "size": int(item.get("Size") or 0),
                           "etag": item.get("ETag", "").strip('"'),
                           "checksum_algorithm": item.get("ChecksumAlgorithm") or None}
                elif tag == "NextContinuationToken":
                    token = child.text
                elif tag == "IsTruncated":
                    truncated = (child.text or "").strip() == "true"
            if not truncated or not token:
                return

    def head(self, bucket, key, part_number=None):
        query = [("partNumber", str(part_number))] if part_number else []
        resp = self.request("HEAD", bucket, key, query, headers={"x-amz-checksum-mode": "ENABLED"})
        resp.read()
        self.check(resp, bucket, key, "HEAD", ok=(200, 206))
        return {k.lower(): v for k, v in resp.getheaders()}

    def get_into(self, bucket, key, fd, start, length, ranged, on_headers=None, progress=None, stop=None,
                 if_match=None, write_lock=None, checksums=True, size=None):
        """GET ``length`` bytes of the object from ``start`` (a Range request when ``ranged``) and
        write them into ``fd`` at offset ``start``.

        ``on_headers(headers) -> hasher|None`` sees the response headers (lower-case names) before
        the body and may return an object whose ``update`` gets every byte in order. ``if_match``
        (the listed ETag) makes S3 refuse (412) an object that changed since it was listed.
        ``checksums`` asks S3 for the object's checksums (x-amz-checksum-mode); ``write_lock`` is held
        around each write into ``fd``. ``size`` (the whole object's, when known) is compared with a
        ranged answer's Content-Range. A ranged GET answered with the whole object raises
        ``RangeIgnored`` before any byte is written.
        Return the response headers.
        """
        headers = {"x-amz-checksum-mode": "ENABLED"} if checksums else {}
        if ranged:
            headers["range"] = "bytes=%d-%d" % (start, start + length - 1)
        if if_match:
            headers["if-match"] = '"%s"' % if_match
        netloc = self._target(bucket, key)[0]
        resp = self.check(self.request("GET", bucket, key, headers=headers), bucket, key, "GET",
                          ok=(200, 206) if ranged else (200,))
        if ranged:
            try:
                self._check_range(resp, bucket, key, start, length, size)
            except (S3Error, RangeIgnored):
                resp.close()  # its body is not read: neither is this connection reused
                self._drop(netloc)
                raise
        got = resp.getheader("content-length")
        if got is not None and int(got) != length:
            resp.close()
            self._drop(netloc)
            raise S3Error("verify", "%s: the server sent %s bytes where %d were expected (the object changed "
                          "while it was read?)" % (self.where(bucket, key), got, length), retryable=True)
        resp_headers = {k.lower(): v for k, v in resp.getheaders()}
        hasher = on_headers(resp_headers) if on_headers is not None else None
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = memoryview(bytearray(BUF_SIZE))
        off, end = start, start + length
        try:
            while off < end:
                if stop is not None and stop.is_set():
                    raise Stopped()
                try:
                    n = resp.readinto(buf[:min(BUF_SIZE, end - off)])
                except (OSError, http.client.HTTPException) as exc:
                    raise S3Error("unreachable", "%s: transfer broke after %d of %d bytes: %s"
                                  % (self.where(bucket, key), off - start, length, exc), retryable=True) from None
                if not n:
                    raise S3Error("unreachable", "%s: connection closed after %d of %d bytes"
                                  % (self.where(bucket, key), off - start, length), retryable=True)
                chunk = buf[:n]
                w = 0
                if write_lock is not None:
                    write_lock.acquire()
                try:
                    while w < n:  # an OSError here is the disk's (ENOSPC, EIO ...): the caller's to report
                        w += os.pwrite(fd, chunk[w:], off + w)
                finally:
                    if write_lock is not None:
                        write_lock.release()
                if hasher is not None:
                    hasher.update(chunk)
                off += n
                if progress is not None:
                    progress(n)
        except BaseException:
            resp.close()
            self._drop(netloc)
            raise
        return resp_headers

