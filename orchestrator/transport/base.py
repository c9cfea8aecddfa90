"""The small interface every way of reaching a node implements, and what a call returns.

Three transports: ``openssh.OpenSSH`` (the OpenSSH client, ``ssh``), ``ssh.Connection`` (SSH through
fabric and paramiko) and ``local.LocalConnection`` (bash on this machine, for running dfo on the GPU box
itself). Callers use only what is here: ``run``, ``run_stream``, ``close``, ``reconnect``, ``name`` and ``host``;
``orchestrator.transport.open_connection`` picks the transport the inventory names (``transport: ssh``:
OpenSSH when a usable client is on PATH, see ``resolve.ssh_transport``). This module imports neither
paramiko nor fabric.

Every remote command runs under ``sh``, whatever the node user's login shell is (sshd hands the command
to ``$SHELL -c``: fish, tcsh and nushell parse shell text differently): ``sh_command`` wraps it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import VerifyError

if TYPE_CHECKING:
    from ..config.models import ResolvedHost

STREAM_PIECE = 1 << 20  # run_stream: the most stdout handed to on_data at once
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
        line goes to it as it arrives and only the line it returns True for, the result frame, is kept
        (one: a second is a VerifyError naming the host); stdout is bounded either way (_Collector)."""

    @abstractmethod
    def run_stream(self, command: str, *, on_data: Callable[[bytes], object], timeout: float | None = None,
                   stdin: bytes | str | None = None) -> Result:
        """``run`` for a command whose stdout is binary (dfo pull's file bytes): each piece of stdout goes
        to ``on_data`` as it arrives (at most STREAM_PIECE bytes, in order) and none of it is kept
        (``Result.stdout`` is empty; stderr is kept as by ``run``). What ``run`` promises holds here too:
        the timeout, liveness, close() ending the call (ConnectionLost). What ``on_data`` raises ends
        the command and is raised as it is, never taken for a lost connection."""

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds; a later run() opens it again."""

    def reconnect(self) -> None:
        self.close()

    def warm(self) -> None:
        """Start connecting now, in the background, for a caller that has work of its own to do here
        before its first call (sync-code lists and hashes the code first). The first call then waits for
        that connection instead of making its own, and raises its failure (a host that cannot be reached
        is tried once). The default: nothing (the first call connects)."""
        return None

    def establish(self) -> None:
        """Connect now and wait for it (the handshake, the host key, the login), raising what the first call
        would. HostSession.each bounds this, the connection set-up, and nothing after it: a host's call that
        then runs for hours (a tail, a launch's watch window) holds no slot another host waits for. The
        default: nothing (the first call connects)."""
        return None


_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./:=,+-")
_ESC = [chr(b) if b in _SAFE else f"\\{b:03o}" for b in range(256)]


def sh_command(command: str, exit_marker: str | None = None) -> str:
    r"""``command`` as a string that any login shell (sh, bash, zsh, fish, tcsh, nushell) hands to ``sh``
    unchanged: ``sh -c 'eval "$(printf "\ooo...")"'``. Every byte but ``[A-Za-z0-9_./:=,+-]`` is written
    as an octal escape, so the single-quoted text holds no quote, blank, ``$``, ``!`` or two backslashes
    in a row, which one of those shells would read its own way; printf is sh's builtin (nothing else is
    needed on the node).

    ``exit_marker``: the command runs in a subshell, then sh writes ``\036dfo-exit:MARKER:CODE\036`` on
    stderr: the OpenSSH transport tells the command's own exit 255 from ssh's, and sees the end of a
    command whose leftover child holds the output open."""
    script = command
    if exit_marker is not None:
        script = f"(\n{command}\n)\ns=$?\nprintf '\\036dfo-exit:{exit_marker}:%d\\036' \"$s\" >&2\nexit \"$s\"\n"
    enc = "".join(_ESC[b] for b in script.encode())
    return f"sh -c 'eval \"$(printf \"{enc}\")\"'"


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
    """Collects a command's stdout, in bounded memory whatever the node sends.

    Without ``on_line`` (a plain command: ``agent.upload_agent``, ``steps.outputs.look``) all of it is
    kept (``text()``), up to ``ALL_MAX`` bytes (256 MiB, far above what any such command prints): one
    byte more is a VerifyError (exit 3) naming the host, and the command is ended.

    With ``on_line`` (streaming mode: framed remote modules) each complete line goes to the callback as
    it arrives. The callback returns True for the module's result frame, the one line kept: the protocol
    (remote/_proto.py) has exactly one, and ``agent.parse_output`` reads one. A second is a VerifyError
    naming the host ("the node sent more than one result"), raised at once, which ends the command: a
    node that prints result frames without end cannot grow this process. Of the other lines only the
    last ``TAIL_BYTES`` are kept, for error messages. A line without a newline longer than ``LINE_MAX``
    (noise; frames are far shorter) goes to the callback in pieces.
    """

    TAIL_BYTES = 8192
    LINE_MAX = 32 << 20
    ALL_MAX = 256 << 20
    KEPT_MAX = 1

    def __init__(self, on_line: Callable[[str], object] | None, host: str | None = None) -> None:
        self.buf = bytearray()  # everything; in streaming mode the tail of what was not kept
        self.kept: list[bytes] = []
        self.pending = bytearray()
        self.scanned = 0  # pending[:scanned] holds no newline
        self.on_line = on_line
        self.raised: BaseException | None = None  # what on_line raised, if it did
        self.host = host

    def feed(self, data: bytes) -> None:
        if self.on_line is None:
            if len(self.buf) + len(data) > self.ALL_MAX:
                raise VerifyError(f"the node sent more than {_mib(self.ALL_MAX)} of output to one command; "
                                  "dfo stopped reading it and ended the command", host=self.host,
                                  hint="something on the node (a login file such as ~/.bashrc, or its python3) "
                                       "prints without end; `ssh HOST true` should print nothing")
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
            if len(self.kept) >= self.KEPT_MAX:
                raise VerifyError("the node sent more than one result for one command (dfo's remote modules "
                                  "print exactly one); dfo stopped reading and ended the command", host=self.host,
                                  hint="the node's copy of dfo's code, or its python3, does not behave as dfo's "
                                       "does; remove ~/.cache/dfo on the node and run the command again")
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


class _Stream:
    """run_stream's stdout: every piece to ``on_data`` as it arrives, nothing kept (the _Collector's
    interface: feed, flush, text, raised)."""

    def __init__(self, on_data: Callable[[bytes], object]) -> None:
        self.on_data = on_data
        self.raised: BaseException | None = None  # what on_data raised, if it did

    def feed(self, data: bytes) -> None:
        try:
            for i in range(0, len(data), STREAM_PIECE):
                self.on_data(data[i:i + STREAM_PIECE] if len(data) > STREAM_PIECE else data)
        except BaseException as exc:
            self.raised = exc  # the caller's own failure: the transport raises it as it is
            raise

    def flush(self) -> None:
        pass

    def text(self) -> str:
        return ""


def _mib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"
