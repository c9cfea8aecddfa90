"""The testbed's fault proxy: a real HTTP server in front of its S3 endpoint that misbehaves on purpose.

Tests put it between the node and SeaweedFS (or rclone) to check what dfo does with answers a real
S3 server gives rarely: a server that ignores Range, sends the wrong range or a binary error body
(tests/test_hardening_s3compat.py), throttles (503, 429, SlowDown) or drops connections
(tests/test_retry.py).
"""

from __future__ import annotations

import random
import socket
import struct
import sys
import threading
import time
from typing import Any

from orchestrator.testbed.s3 import S3Endpoint

# ignore-range, shift-range, binary-403: a server that gets Range or errors wrong (every such request);
# the rest: throttling and dropped connections (every matching request, or the first ``count``, or a fraction)
PROXY_MODES = ("ignore-range", "shift-range", "binary-403",
               "status-503", "status-429", "slowdown", "reset", "reset-body")
FAULT_MODES = PROXY_MODES[3:]
TARGETS = ("any", "list", "object", "head")

SLOWDOWN_XML = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                b"<Message>Please reduce your request rate.</Message><RequestId>dfo-fault-proxy</RequestId></Error>")
BUSY_XML = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>%s</Code>'
            b"<Message>fault proxy: %s</Message><RequestId>dfo-fault-proxy</RequestId></Error>")


class FaultProxy:
    """A real HTTP server in front of an S3 endpoint, forwarding every request unchanged (the client's
    SigV4 signature covers the Host header, which is the proxy's, so the upstream server accepts it),
    except, by ``mode``:

    * ``ignore-range``: a GET with a Range header is answered 200 with the whole object and no
      Content-Range, as a server that ignores Range may (RFC 7233 3.1). The Range header is signed,
      so the proxy cannot just drop it: it signs a fresh GET without it (same path, If-Match kept)
      with the endpoint's credentials.
    * ``shift-range``: a ranged GET is answered 206 with as many bytes from the object's start, and
      a Content-Range saying so (the wrong bytes for any part but the first).
    * ``binary-403``: a GET of an object (not a listing) is answered 403 with 4 KiB of binary bytes,
      application/octet-stream.
    * ``status-503`` / ``status-429``: answered 503 ServiceUnavailable / 429 TooManyRequests (S3 XML
      error body), with ``Retry-After: retry_after`` when given; ``slowdown``: 503 with Code SlowDown,
      as AWS throttles.
    * ``reset``: the connection is reset (RST) before any byte of the answer; ``reset-body``: the
      answer's headers and half its body are sent, then the connection is reset.

    The last five hit only the requests of ``target`` ("list": ListObjects, "object": an object's GET,
    "head": HEAD, "any") whose path contains ``path`` (when given): the first ``count`` of them (None:
    every one), or each with probability ``fraction`` (seeded, repeatable). The rest pass through.

    It listens only on ``address``, which must be a loopback or private address, port chosen free.
    ``log`` holds (method, path, had a Range header, status) for every request answered (status 0:
    the connection was reset), ``times`` the monotonic time of each, ``faults`` how many were hit.
    """

    def __init__(self, upstream: S3Endpoint, address: str, mode: str, *, target: str = "object",
                 count: int | None = None, fraction: float | None = None, path: str | None = None,
                 retry_after: str | None = None, seed: int = 7) -> None:
        import ipaddress

        if mode not in PROXY_MODES:
            raise ValueError(f"proxy mode {mode!r}: expected one of {', '.join(PROXY_MODES)}")
        if target not in TARGETS:
            raise ValueError(f"proxy target {target!r}: expected one of {', '.join(TARGETS)}")
        ip = ipaddress.ip_address(address)
        if not (ip.is_loopback or ip.is_private):
            raise ValueError(f"the fault proxy listens only on a loopback or private address, not {address}")
        self.upstream, self.address, self.mode = upstream, address, mode
        self.target, self.count, self.fraction, self.path = target, count, fraction, path
        self.retry_after = retry_after
        self.log: list[tuple[str, str, bool, int]] = []
        self.times: list[float] = []
        self.faults = 0
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        self._server: Any = None
        self._thread: Any = None

    @property
    def endpoint(self) -> S3Endpoint:
        assert self._server is not None, "start() first"
        port = self._server.server_address[1]
        up = self.upstream
        return S3Endpoint(url=f"http://{self.address}:{port}", access_key=up.access_key, secret_key=up.secret_key,
                          region=up.region, server=f"{up.server}+{self.mode}")

    def start(self) -> S3Endpoint:
        from http.server import ThreadingHTTPServer

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], OSError):  # a client that hung up, a reset of ours
                    super().handle_error(request, client_address)

        self._server = Server((self.address, 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="dfo-s3-proxy", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def hit(self, method: str, path: str, query: str) -> bool:
        """Whether this request gets the fault (one of FAULT_MODES), counting it when it does."""
        if self.mode not in FAULT_MODES:
            return False
        is_list = method == "GET" and (path.count("/") < 2 or path.split("/", 2)[2] == "")
        kind = "head" if method == "HEAD" else "list" if is_list else "object" if method == "GET" else "other"
        if self.target != "any" and kind != self.target:
            return False
        if self.path is not None and self.path not in path:
            return False
        with self._lock:
            if self.count is not None and self.faults >= self.count:
                return False
            if self.fraction is not None and self._random.random() >= self.fraction:
                return False
            self.faults += 1
            return True

    def _record(self, method: str, path: str, ranged: bool, status: int) -> None:
        with self._lock:
            self.log.append((method, path, ranged, status))
            self.times.append(time.monotonic())

    def _handler(self) -> Any:
        import http.client
        from http.server import BaseHTTPRequestHandler
        from urllib.parse import parse_qsl, urlsplit

        from remote.s3.sig import sign

        proxy = self
        up = urlsplit(self.upstream.url)
        creds = {"access_key": self.upstream.access_key, "secret_key": self.upstream.secret_key}
        drop = {"connection", "keep-alive", "transfer-encoding", "content-length"}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                pass

            def _upstream(self, headers: dict[str, str], body: bytes | None) -> tuple[int, list[tuple[str, str]],
                                                                                      bytes]:
                conn = http.client.HTTPConnection(up.hostname or "127.0.0.1", up.port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    return resp.status, resp.getheaders(), resp.read()
                finally:
                    conn.close()

            def _send(self, status: int, headers: list[tuple[str, str]], body: bytes, cut: bool = False) -> None:
                proxy._record(self.command, self.path.partition("?")[0], "range" in self.headers, 0 if cut else status)
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in drop:
                        self.send_header(k, v)
                if self.command == "HEAD":
                    length = next((v for k, v in headers if k.lower() == "content-length"), "0")
                    self.send_header("Content-Length", length)
                else:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if cut:  # headers and half the body (none for a HEAD), then a reset
                    if self.command != "HEAD":
                        self.wfile.write(body[:len(body) // 2])
                    self.wfile.flush()
                    self._reset()
                elif self.command != "HEAD":
                    self.wfile.write(body)

            def _reset(self) -> None:
                """Close with SO_LINGER 0: the client sees ECONNRESET, not a clean end."""
                self.close_connection = True
                try:
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                except OSError:
                    pass

            def _fault(self, headers: dict[str, str], body: bytes | None) -> None:
                mode = proxy.mode
                if mode == "reset":
                    proxy._record(self.command, self.path.partition("?")[0], "range" in self.headers, 0)
                    self._reset()
                    return
                if mode == "reset-body":
                    status, hdrs, data = self._upstream(headers, body)
                    self._send(status, hdrs, data, cut=True)
                    return
                status, code = {"status-503": (503, b"ServiceUnavailable"), "status-429": (429, b"TooManyRequests"),
                                "slowdown": (503, b"SlowDown")}[mode]
                xml = SLOWDOWN_XML if mode == "slowdown" else BUSY_XML % (code, code)
                hdrs = [("Content-Type", "application/xml")]
                if proxy.retry_after is not None:
                    hdrs.append(("Retry-After", proxy.retry_after))
                if self.command == "HEAD":
                    hdrs.append(("Content-Length", "0"))
                self._send(status, hdrs, xml)

            def _handle(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else None
                headers = {k: v for k, v in self.headers.items()}
                path, _, query = self.path.partition("?")
                if proxy.hit(self.command, path, query):
                    self._fault(headers, body)
                    return
                is_object = self.command == "GET" and path.count("/") >= 2 and path.split("/", 2)[2] != ""
                rng = self.headers.get("range")
                if proxy.mode == "binary-403" and is_object:
                    self._send(403, [("Content-Type", "application/octet-stream")], bytes(range(256)) * 16)
                    return
                if rng and self.command == "GET":
                    if proxy.mode == "ignore-range":
                        plain = {k.lower(): v for k, v in headers.items()
                                 if k.lower() not in ("authorization", "x-amz-date", "x-amz-content-sha256", "range")}
                        plain["host"] = up.netloc
                        q = parse_qsl(query, keep_blank_values=True)
                        sign("GET", path, q, plain, creds, proxy.upstream.region)
                        status, hdrs, data = self._upstream(plain, None)
                        self._send(status, [(k, v) for k, v in hdrs if k.lower() != "content-range"], data)
                        return
                    if proxy.mode == "shift-range":
                        status, hdrs, data = self._upstream(headers, body)
                        cr = dict((k.lower(), v) for k, v in hdrs).get("content-range", "")
                        if status == 206 and cr.startswith("bytes "):
                            total = cr.rsplit("/", 1)[1]
                            hdrs = [(k, v) for k, v in hdrs if k.lower() != "content-range"]
                            hdrs.append(("Content-Range", f"bytes 0-{len(data) - 1}/{total}"))
                            whole = self._whole(path, headers)
                            data = whole[:len(data)]
                        self._send(status, hdrs, data)
                        return
                status, hdrs, data = self._upstream(headers, body)
                self._send(status, hdrs, data)

            def _whole(self, path: str, headers: dict[str, str]) -> bytes:
                plain = {"host": up.netloc}
                sign("GET", path, [], plain, creds, proxy.upstream.region)
                conn = http.client.HTTPConnection(up.hostname or "127.0.0.1", up.port, timeout=60)
                try:
                    conn.request("GET", path, headers=plain)
                    return conn.getresponse().read()
                finally:
                    conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle

        return Handler
