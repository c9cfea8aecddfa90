"""The small interface every way of reaching a node implements, and what a call returns.

Two transports: ``connection.Connection`` (SSH, through fabric) and ``localconn.LocalConnection``
(bash on this machine, for running dfo on the GPU box itself). Callers use only what is here:
``run``, ``close``, ``reconnect``, ``name`` and ``host``; ``open_connection`` picks the transport
the inventory names. This module imports neither paramiko nor fabric.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ResolvedHost

STDERR_KEEP = 64 << 10  # a command's stderr: only its last 64 KiB are kept (error messages need the end)


@dataclass
class Result:
    """What a remote command did (Fabric-style: command, stdout, stderr, exit code)."""

    host: str
    command: str
    stdout: str
    stderr: str
    exit_code: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Transport(ABC):
    """One host's way of running commands; one per host per dfo command, reused for every call."""

    host: ResolvedHost
    name: str

    @abstractmethod
    def run(self, command: str, *, timeout: float | None = None, stdin: bytes | str | None = None,
            on_line: Callable[[str], object] | None = None) -> Result:
        """Run ``command`` (a shell string built with shlex.quote), at most ``timeout`` s (default:
        the inventory's command_timeout). ``stdin`` is sent and closed. With ``on_line`` each stdout
        line goes to it as it arrives and only the lines it returns True for are kept (_Collector)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds; a later run() opens it again."""

    def reconnect(self) -> None:
        self.close()


def open_connection(host: ResolvedHost) -> Transport:
    """The transport the inventory names for this host (imported only when used)."""
    if host.transport == "local":
        from .localconn import LocalConnection

        return LocalConnection(host)
    from .connection import Connection

    return Connection(host)


class _Tail:
    """The last ``keep`` bytes of a stream (a command's stderr), with a note of how much was dropped."""

    def __init__(self, keep: int = STDERR_KEEP) -> None:
        self.keep = keep
        self.buf = bytearray()
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > 2 * self.keep:
            cut = len(self.buf) - self.keep
            del self.buf[:cut]
            self.dropped += cut

    def text(self) -> str:
        data = bytes(self.buf)
        if len(data) > self.keep:
            self.dropped += len(data) - self.keep
            data = data[-self.keep:]
            self.buf = bytearray(data)
        head = f"[dfo: the first {self.dropped} bytes of stderr were dropped]\n" if self.dropped else ""
        return head + data.decode("utf-8", "replace")


class _Collector:
    """Collects a command's stdout.

    Without ``on_line`` all of it is kept (``text()``). With ``on_line`` (streaming mode: framed
    remote modules) each complete line goes to the callback as it arrives, and memory stays bounded
    however long the stream: only the lines the callback returns True for are kept (the module's
    result frame), plus the last ``TAIL_BYTES`` of the rest, for error messages. A line without a
    newline longer than ``LINE_MAX`` (noise; frames are far shorter) goes to the callback in pieces.
    """

    TAIL_BYTES = 8192
    LINE_MAX = 32 << 20

    def __init__(self, on_line: Callable[[str], object] | None) -> None:
        self.buf = bytearray()  # everything; in streaming mode the tail of what was not kept
        self.kept: list[bytes] = []
        self.pending = bytearray()
        self.scanned = 0  # pending[:scanned] holds no newline
        self.on_line = on_line
        self.raised: BaseException | None = None  # what on_line raised, if it did

    def feed(self, data: bytes) -> None:
        if self.on_line is None:
            self.buf += data
            return
        self.pending += data
        start = 0
        while True:
            i = self.pending.find(b"\n", max(start, self.scanned))
            if i < 0:
                break
            self._line(bytes(self.pending[start:i]))
            start = i + 1
        del self.pending[:start]
        self.scanned = len(self.pending)
        if self.scanned > self.LINE_MAX:
            self.flush()

    def _line(self, raw: bytes) -> None:
        assert self.on_line is not None
        try:
            keep = self.on_line(raw.decode("utf-8", "replace"))
        except BaseException as exc:
            # the caller's own failure (a local disk error, say): the transport re-raises it as it is,
            # never as a lost connection (connection.Connection.run checks ``raised``)
            self.raised = exc
            raise
        if keep:
            self.kept.append(raw)
            return
        self.buf += raw[-self.TAIL_BYTES:] + b"\n"
        if len(self.buf) > 2 * self.TAIL_BYTES:
            del self.buf[: len(self.buf) - self.TAIL_BYTES]

    def flush(self) -> None:
        if self.on_line is not None and self.pending:
            raw = bytes(self.pending)
            self.pending.clear()
            self.scanned = 0
            self._line(raw)

    def text(self) -> str:
        if self.on_line is None:
            return self.buf.decode("utf-8", "replace")
        return (bytes(self.buf) + b"".join(k + b"\n" for k in self.kept)).decode("utf-8", "replace")
