"""Transport.run_stream (a command's binary stdout, in pieces, to a callback: dfo pull's raw stream) on the
OpenSSH and paramiko transports against a real testbed node, and on the local transport; and the reader
of pull's raw records (steps.pullwire) fed the way a transport feeds it, into a real PullDir."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.errors import ConnectionLost, HostError, VerifyError
from orchestrator.hosts import HostSession
from orchestrator.testbed import Testbed
from orchestrator.transport.base import STREAM_PIECE, Transport
from tests._runs_fixtures import inventory_copy


class Boom(Exception):
    pass


@pytest.fixture
def conn(testbed: Testbed, tmp_path: Path, each_ssh_transport: str) -> Iterator[Transport]:
    inv = inventory_copy(testbed, tmp_path)
    with HostSession(inv, [testbed.nodes[0].name]) as s:
        yield s.conn(testbed.nodes[0].name)


@pytest.fixture
def local(tmp_path: Path) -> Transport:
    from orchestrator.config.models import load_inventory
    from orchestrator.transport.local import LocalConnection
    from orchestrator.transport.resolve import resolve_host

    p = tmp_path / "inventory.yaml"
    p.write_text("hosts:\n  me: {transport: local}\n")
    inv, path = load_inventory(p)
    return LocalConnection(resolve_host(inv, "me", path))


def _node_file(tb: Testbed, size: int) -> tuple[str, str]:
    path = f"/root/stream-{secrets.token_hex(4)}.bin"
    r = tb.node_exec(tb.nodes[0], f"head -c {size} /dev/urandom > {path} && sha256sum {path}")
    assert r.returncode == 0, r.stderr
    return path, r.stdout.split()[0]


def _collect(conn: Transport, command: str, **kw: object) -> tuple[bytes, list[int], object]:
    pieces: list[bytes] = []
    res = conn.run_stream(command, on_data=pieces.append, **kw)  # type: ignore[arg-type]
    return b"".join(pieces), [len(p) for p in pieces], res


# --------------------------------------------------------------------------- over SSH, both transports


def test_run_stream_passes_every_byte_as_it_is(conn: Transport, testbed: Testbed) -> None:
    """5 MiB of random bytes (every byte value, newlines and NULs included) arrive whole and in order, in
    pieces of at most STREAM_PIECE; nothing is kept in stdout; stderr and the exit code are the command's."""
    path, want = _node_file(testbed, 5 << 20)
    data, sizes, res = _collect(conn, f"cat {path}; echo on-stderr >&2; exit 7", timeout=120)
    assert hashlib.sha256(data).hexdigest() == want and len(data) == 5 << 20
    assert sizes and max(sizes) <= STREAM_PIECE
    assert res.stdout == "" and res.exit_code == 7 and "on-stderr" in res.stderr  # type: ignore[attr-defined]
    # stdin goes in, as with run()
    data, _, res = _collect(conn, "cat", stdin=b"\x00\x01\n\xff" * 1000, timeout=60)
    assert data == b"\x00\x01\n\xff" * 1000 and res.exit_code == 0  # type: ignore[attr-defined]


def test_what_on_data_raises_ends_the_command_and_comes_out_as_itself(conn: Transport, testbed: Testbed) -> None:
    """The caller's failure (a full disk here) is raised as it is, never as a lost connection; the node's
    command is ended (not left streaming); the connection serves the next call."""
    size = (100 << 30) + secrets.randbelow(1 << 20)  # a size no other process on the node uses
    got: list[int] = []

    def full(data: bytes) -> None:
        got.append(len(data))
        if sum(got) > 1 << 20:
            raise Boom("no space left here")

    with pytest.raises(Boom):
        conn.run_stream(f"head -c {size} /dev/zero", on_data=full, timeout=120)
    assert conn.run("echo ok", timeout=30).stdout == "ok\n"
    deadline = time.monotonic() + 20
    while True:  # the node's end of the command: gone once its channel closed (SIGPIPE)
        r = testbed.node_exec(testbed.nodes[0], f"pgrep -f '^head -c {size}' || true")
        if not r.stdout.strip() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not r.stdout.strip(), "the node's command still runs after the call ended"


def test_run_stream_keeps_the_calls_timeout(conn: Transport) -> None:
    with pytest.raises(HostError) as e:
        conn.run_stream("sleep 30", on_data=lambda b: None, timeout=2)
    assert "within 2s" in str(e.value) and not isinstance(e.value, ConnectionLost)


def test_close_ends_a_run_stream_in_flight(conn: Transport) -> None:
    """close() from another thread (dfo's Ctrl-C path, a gang's failed rank) ends a stream in flight:
    ConnectionLost, as for run()."""
    started = threading.Event()
    out: list[BaseException] = []

    def call() -> None:
        try:
            conn.run_stream("head -c 50G /dev/zero", on_data=lambda b: started.set(), timeout=120)
        except BaseException as exc:  # noqa: BLE001 - what the call raised is the test's subject
            out.append(exc)

    t = threading.Thread(target=call)
    t.start()
    assert started.wait(60)
    conn.close()
    t.join(60)
    assert not t.is_alive() and len(out) == 1 and isinstance(out[0], ConnectionLost), out


# --------------------------------------------------------------------------- the local transport


def test_the_local_transport_streams_too(local: Transport, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3 << 20))
    data, sizes, res = _collect(local, f"cat {src}", timeout=60)
    assert data == src.read_bytes() and max(sizes) <= STREAM_PIECE and res.stdout == ""  # type: ignore[attr-defined]

    def boom(data: bytes) -> None:
        raise Boom("no space left here")

    with pytest.raises(Boom):
        local.run_stream("head -c 10G /dev/zero", on_data=boom, timeout=60)
    assert local.run("echo ok", timeout=30).stdout == "ok\n"


# --------------------------------------------------------------------------- pull's raw records


def _stream(nonce: str, records: list[tuple[bytes, int, bytes]], result: dict[str, object]) -> bytes:
    from remote.files.pull import HEADER, RAW_MARK

    out = b"\x1b]0;gpu-node\x07Welcome banner, no newline" + RAW_MARK + nonce.encode() + b"\n"
    for kind, i, body in records:
        out += HEADER.pack(kind, i, len(body)) + body
    out += HEADER.pack(b"Z", 0, 0)
    return out + b"@@DFO-RESULT@@ " + json.dumps(result).encode() + b"\n"


def _sink(tmp_path: Path, files: dict[str, int]):  # type: ignore[no-untyped-def]
    from orchestrator.steps.pullsink import PullDir, Sink

    d = PullDir(tmp_path, ["got"], "node-x")
    wanted = [{"path": rel, "size": size, "mtime_ns": 1, "offset": 0} for rel, size in files.items()]
    return d, Sink(d, wanted, {}, False, lambda: None)


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 20])
def test_the_raw_reader_takes_the_stream_in_pieces_of_any_size(tmp_path: Path, piece: int) -> None:
    """Noise glued before the marker, headers and bodies split anywhere: the files arrive whole, checked."""
    from orchestrator.steps.pullwire import RawReader

    a, b = os.urandom(300_000), b"x\n" * 10
    d, sink = _sink(tmp_path, {"a.bin": len(a), "sub/b.txt": len(b), "gone.txt": 5})
    nonce = secrets.token_hex(16)
    raw = _stream(nonce, [(b"D", 0, a[:200_000]), (b"D", 0, a[200_000:]), (b"E", 0, hashlib.sha256(a).digest()),
                          (b"D", 1, b), (b"E", 1, hashlib.sha256(b).digest()), (b"C", 2, b"")],
                  {"ok": True, "data": {"sent": 2}})
    reader = RawReader(nonce, sink, "node-x")
    for k in range(0, len(raw), piece):
        reader.feed(raw[k:k + piece])
    d.close()
    assert reader.finished() and reader.result is not None and '"sent": 2' in reader.result
    assert (tmp_path / "got" / "a.bin").read_bytes() == a and (tmp_path / "got" / "sub" / "b.txt").read_bytes() == b
    assert sink.done == 2 and sink.changed == ["gone.txt"] and sink.bytes == len(a) + len(b)


def test_the_raw_reader_refuses_a_record_past_the_listed_size_before_its_bytes(tmp_path: Path) -> None:
    """A header announcing more than the file's listed size is refused as it is read: its body is never
    asked for (the reader raises on the header's last byte), and the partial file is dropped."""
    from orchestrator.steps.pullwire import RawReader
    from remote.files.pull import HEADER, RAW_MARK

    d, sink = _sink(tmp_path, {"small.txt": 114})
    nonce = secrets.token_hex(16)
    reader = RawReader(nonce, sink, "node-x")
    reader.feed(RAW_MARK + nonce.encode() + b"\n" + HEADER.pack(b"D", 0, 100) + b"y" * 100)
    with pytest.raises(VerifyError) as e:
        reader.feed(HEADER.pack(b"D", 0, 15))
    d.close()
    assert "small.txt" in str(e.value) and "114" in str(e.value)
    assert list((tmp_path / "got" / ".dfo" / "partial").iterdir()) == []
    # a record of a kind the wire does not have, or for a file not asked for: refused too
    for bad in (HEADER.pack(b"Q", 0, 0), HEADER.pack(b"D", 5, 1), HEADER.pack(b"E", 0, 31)):
        d, sink = _sink(tmp_path / secrets.token_hex(2), {"f": 10})
        reader = RawReader(nonce, sink, "node-x")
        with pytest.raises(VerifyError):
            reader.feed(RAW_MARK + nonce.encode() + b"\n" + bad)
        d.close()


def test_the_raw_reader_waits_for_its_own_nonce(tmp_path: Path) -> None:
    """A banner that prints a marker with another nonce starts nothing: its bytes are read as lines."""
    from orchestrator.steps.pullwire import RawReader
    from remote.files.pull import HEADER, RAW_MARK

    d, sink = _sink(tmp_path, {"f": 3})
    reader = RawReader("ab" * 16, sink, "node-x")
    reader.feed(RAW_MARK + b"cd" * 16 + b"\n" + HEADER.pack(b"D", 0, 1 << 40))
    assert not reader.started and sink.bytes == 0
    d.close()


def test_the_header_is_what_the_node_writes() -> None:
    from remote.files.pull import HEADER

    assert HEADER.size == 16 and HEADER.pack(b"D", 1, 2) == struct.pack(">cxxxIQ", b"D", 1, 2)
