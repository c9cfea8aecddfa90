"""dfo pull's raw stream on the controller: the node's ``send`` output, read as it arrives.

The wire is written down in remote/files/pull.py ("The raw stream"): a marker line with this call's
nonce, then records (a 16-byte header, then the bytes it announces), a ``Z`` record, then the result
frame as a line. ``RawReader.feed`` takes stdout in pieces of any size (Transport.run_stream) and

* before the marker, and after ``Z``: reads lines as every remote module's output is read (a login
  shell's banner is passed over; the one result frame is kept; a second is a VerifyError), each line
  bounded (LINE_MAX: the rest of a longer one is dropped);
* in between: reads each header whole, has the Sink check it (a file asked for, in order, and a
  length that does not pass the file's listed size) BEFORE reading the bytes it announces, then hands
  those bytes to the Sink as they arrive. Nothing of a file is held in memory here but the piece of
  stdout being read: a node that announces more than it listed is stopped at its header.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

from remote._proto import split_frame
from remote.files.pull import HEADER, RAW_MARK

from ..agent import NEED_UPLOAD, NODE, SITE_FREE, carried_parts, module_command, parse_output
from ..errors import VerifyError
from ..transport.base import Result, Transport
from .pullsink import Sink

LINE_MAX = 1 << 20  # the most of one line (before the stream, after it) kept while looking for its end
SHA_LEN = 32


class RawReader:
    """One ``send`` call's stdout into ``sink``; ``result`` holds the result frame's line once it came."""

    def __init__(self, nonce: str, sink: Sink, host: str, on_progress: Callable[[], None] | None = None) -> None:
        self.mark = RAW_MARK + nonce.encode("ascii") + b"\n"
        self.sink, self.host, self.on_progress = sink, host, on_progress
        self.phase = "before"  # "before" the marker, "head" (reading a header), "body", "after" the Z record
        self.lines = bytearray()  # before / after: the line being read
        self.head = bytearray()  # head: the header being read
        self.kind = b""
        self.index = 0
        self.need = 0  # body: bytes of this record still to come
        self.digest = bytearray()  # an E record's body
        self.result: str | None = None
        self.started = False

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.phase in ("before", "after"):
                view = self._lines(view)
            elif self.phase == "head":
                take = min(HEADER.size - len(self.head), len(view))
                self.head += view[:take]
                view = view[take:]
                if len(self.head) == HEADER.size:
                    self._header()
            else:
                take = min(self.need, len(view))
                self._body(view[:take])
                view = view[take:]
                self.need -= take
                if self.need == 0:
                    self._record_end()

    # ------------------------------------------------------------------ lines (before and after the records)
    def _lines(self, view: memoryview) -> memoryview:
        if self.phase == "before":
            self.lines += view
            at = self.lines.find(self.mark)
            if at >= 0:  # the stream starts: the lines before it are a login shell's, or an early result
                rest = memoryview(bytes(self.lines[at + len(self.mark):]))
                self._complete_lines(bytearray(self.lines[:at]) + b"\n")
                self.lines.clear()
                self.phase, self.started = "head", True
                return rest
            self._complete_lines(self.lines)
            if len(self.lines) > LINE_MAX:  # a line without end: keep only what could begin the marker
                del self.lines[:len(self.lines) - len(self.mark)]
            return view[len(view):]
        self.lines += view
        self._complete_lines(self.lines)
        if len(self.lines) > LINE_MAX:
            del self.lines[:len(self.lines) - LINE_MAX]
        return view[len(view):]

    def _complete_lines(self, buf: bytearray) -> None:
        """Each complete line of ``buf`` read (and taken out of it)."""
        end = buf.rfind(b"\n")
        if end < 0:
            return
        for raw in bytes(buf[:end]).split(b"\n"):
            frame = split_frame(raw.decode("utf-8", "replace"))
            if frame is not None and frame[0] == "result":
                if self.result is not None:
                    raise VerifyError("pull: the node sent more than one result for one command; dfo stopped "
                                      "reading and ended the command", host=self.host,
                                      hint="the node's dfo code is not dfo's: check the node")
                self.result = raw.decode("utf-8", "replace")
        del buf[:end + 1]

    # ------------------------------------------------------------------ records
    def _header(self) -> None:
        kind, index, length = HEADER.unpack(bytes(self.head))
        self.head.clear()
        self.kind, self.index = kind, index
        if kind == b"Z" and length == 0:
            self.phase = "after"
            return
        if kind == b"D" and length > 0:  # its bytes go to the sink as they come: none is held here
            self.sink.announce(index, length)  # raises before a byte past the listed size is read
        elif not ((kind == b"E" and length == SHA_LEN) or (kind == b"C" and length == 0)):
            self.sink.abort()
            raise VerifyError(f"pull: the node's stream is malformed (a record {kind!r} of {length} B); "
                              "the transfer was stopped", host=self.host,
                              hint="the node's dfo code is not dfo's: check the node")
        self.need = length
        self.phase = "body"
        if length == 0:
            self._record_end()

    def _body(self, piece: memoryview) -> None:
        if self.kind == b"D":
            self.sink.on_event({"kind": "data", "i": self.index, "b": piece})
        else:
            self.digest += piece

    def _record_end(self) -> None:
        self.phase = "head"
        if self.kind == b"E":
            digest, self.digest = bytes(self.digest).hex(), bytearray()
            self.sink.on_event({"kind": "end", "i": self.index, "sha256": digest})
        elif self.kind == b"C":
            self.sink.on_event({"kind": "changed", "i": self.index})
        if self.on_progress is not None:
            self.on_progress()

    def finished(self) -> bool:
        """The records ended with their Z (the node's send did not stop half-way)."""
        return self.phase == "after"


def send(conn: Transport, python: str | None, request: dict[str, Any], sink: Sink, *, timeout: float,
         on_progress: Callable[[], None] | None = None) -> Any:
    """Run remote.files.pull's ``send`` for ``request`` (its files: ``sink.wanted``) over a binary stdout
    (Transport.run_stream), the bytes into ``sink``; the result's data (or its error, raised)."""
    module = NODE.pull
    py = python or conn.host.python
    specs: list[tuple[str, str, int]] = []
    blobs = b""
    res: Result | None = None
    for _ in range(2):
        nonce = secrets.token_hex(16)
        reader = RawReader(nonce, sink, conn.name, on_progress)
        cmd = module_command(module, py, carry=specs or None, flags="-S" if module in SITE_FREE else "",
                             bytecode=python is None)
        stdin = blobs + json.dumps(dict(request, op="send", nonce=nonce)).encode()
        res = conn.run_stream(cmd, on_data=reader.feed, stdin=stdin, timeout=timeout)
        if res.exit_code == NEED_UPLOAD and not reader.started:
            specs, blobs = carried_parts(module)  # a node that lost dfo's code since the list call: once more
            continue
        break
    assert res is not None  # a stream cut short keeps its partial file: the next pull resumes it
    out = Result(res.host, res.command, reader.result or "", res.stderr, res.exit_code, res.seconds)
    return parse_output(conn, out, module)
