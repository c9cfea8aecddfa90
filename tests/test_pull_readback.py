"""Issue 23 (with issue 16's promise): dfo pull reads each file back from disk while it arrives, on a
thread behind the writer, and still catches bytes spoiled on disk after that thread has read them.

The Sink (steps.pullsink) is driven here with the records a node sends, for real files in tmp_path; the
whole path, over SSH from a lying node, is tests/test_trust_pull.py."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.steps.pullsink import PullDir, Sink


def sink_for(tmp_path: Path, size: int, offset: int = 0) -> tuple[PullDir, Sink]:
    d = PullDir(tmp_path / "dest", [], "node-1")
    sink = Sink(d, [{"path": "ckpt.bin", "size": size, "mtime_ns": 1, "offset": offset}], {}, False, lambda: None)
    return d, sink


def part_of(tmp_path: Path) -> Path:
    (p,) = (tmp_path / "dest" / ".dfo" / "partial").glob("*.part")
    return p


def wait_read_back(sink: Sink, upto: int) -> None:
    deadline = time.monotonic() + 30
    assert sink.rb is not None
    while sink.rb.read < upto:
        assert time.monotonic() < deadline, "the read-back never caught up with the writer"
        time.sleep(0.01)


def send(sink: Sink, data: bytes, piece: int = 1 << 16) -> None:
    for at in range(0, len(data), piece):
        sink.announce(0, len(data[at:at + piece]))
        sink.on_event({"kind": "data", "i": 0, "b": data[at:at + piece]})


def end(sink: Sink, data: bytes) -> None:
    sink.on_event({"kind": "end", "i": 0, "sha256": hashlib.sha256(data).hexdigest()})


def test_a_clean_file_is_placed_with_todays_mtime(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    d, sink = sink_for(tmp_path, len(data))
    try:
        send(sink, data)
        end(sink, data)
    finally:
        sink.close()
        d.close()
    assert sink.done == 1 and sink.bad == []
    got = tmp_path / "dest" / "ckpt.bin"
    assert got.read_bytes() == data
    assert abs(got.stat().st_mtime - time.time()) < 3600  # not the mark the partial file carried


@pytest.mark.parametrize("fs", ["keeps the mark", "stores another mtime"])
@pytest.mark.parametrize("when", ["after the whole file was read back", "half-way, behind the read-back"])
def test_bytes_spoiled_after_the_read_back_passed_them_are_caught(tmp_path: Path, when: str, fs: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the file system does not keep the mtime mark as set (simulated: the mark is not set), the
    whole file is read again after its last byte, and the spoiled bytes are caught that way."""
    if fs == "stores another mtime":
        monkeypatch.setattr(Sink, "_set_mark", lambda self: os.fstat(self.fd).st_mtime_ns)
    data = os.urandom(3 << 20)
    d, sink = sink_for(tmp_path, len(data))
    try:
        half = len(data) // 2
        send(sink, data[:half])
        if when.startswith("half"):
            wait_read_back(sink, half)
            with open(part_of(tmp_path), "r+b") as f:
                f.seek(1000)
                f.write(b"spoiled here")
        send(sink, data[half:])
        if when.startswith("after"):
            wait_read_back(sink, len(data))
            with open(part_of(tmp_path), "r+b") as f:
                f.seek(1000)
                f.write(b"spoiled here")
        end(sink, data)
    finally:
        sink.close()
        d.close()
    assert sink.done == 0 and len(sink.bad) == 1 and sink.bad[0].startswith("ckpt.bin"), sink.bad
    assert not (tmp_path / "dest" / "ckpt.bin").exists()
    assert list((tmp_path / "dest" / ".dfo" / "partial").glob("*.part")) == []


def test_an_earlier_part_spoiled_before_the_resume_is_caught(tmp_path: Path) -> None:
    data = os.urandom(2 << 20)
    d, sink = sink_for(tmp_path, len(data))
    send(sink, data[:1 << 20])
    sink.close()
    d.close()
    part = part_of(tmp_path)
    with open(part, "r+b") as f:
        f.write(b"spoiled!")
    d, sink = sink_for(tmp_path, len(data))
    sink.wanted[0]["offset"] = sink.resumable("ckpt.bin", len(data), 1)
    try:
        assert sink.wanted[0]["offset"] == 1 << 20
        send(sink, data[1 << 20:])
        end(sink, data)
    finally:
        sink.close()
        d.close()
    assert sink.done == 0 and sink.bad == ["ckpt.bin"], sink.bad


def test_a_file_cut_short_here_is_caught_by_its_size(tmp_path: Path) -> None:
    data = os.urandom(2 << 20)
    d, sink = sink_for(tmp_path, len(data))
    try:
        send(sink, data)
        wait_read_back(sink, len(data))
        os.truncate(part_of(tmp_path), 1000)
        end(sink, data)
    finally:
        sink.close()
        d.close()
    assert sink.done == 0 and len(sink.bad) == 1 and "1000 B, listed" in sink.bad[0], sink.bad


def test_an_aborted_file_stops_its_read_back(tmp_path: Path) -> None:
    data = os.urandom(1 << 20)
    d, sink = sink_for(tmp_path, len(data))
    try:
        send(sink, data[:1 << 19])
        rb: Any = sink.rb
        sink.abort()
        assert rb is not None and not rb.thread.is_alive()
    finally:
        sink.close()
        d.close()
    assert list((tmp_path / "dest" / ".dfo" / "partial").glob("*.part")) == []
