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

import errno
import re
import selectors
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import HostError, VerifyError

if TYPE_CHECKING:
    from ..config.inventory import ResolvedHost

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
    started: bool = True  # the node's side started (the start marker came): False, sshd or the login failed first

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
        """Run ``command`` (a shell string built with shlex.quote). Two bounds: the node's side must start
        within the host's ``start_timeout`` (counted from the call's start, the connection included; past it,
        NotStarted, exit 4), and the command then runs at most ``timeout`` s (default: the inventory's
        command_timeout; past it, CallTimeout, exit 4). ``stdin`` is sent and closed. With ``on_line`` each
        stdout line goes to it as it arrives and only the line it returns True for, the result frame, is kept
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

    def run_lines(self, command: str, *, on_out: Callable[[list[str]], object],
                  on_err: Callable[[list[str]], object], timeout: float | None = None,
                  alone: bool = False) -> Result | None:
        """``run`` for a plain command whose stdout and stderr both go, line by line, to the caller (dfo exec's
        shell path): each batch of complete lines of a stream to ``on_out`` / ``on_err`` as it arrives (a
        line longer than LINE_PIECE in pieces; nothing kept: ``Result.stdout`` and ``stderr`` are empty).
        The command's stdin stays open, with nothing written, until the call ends: the node's side reads
        EOF there once the caller is gone (Ctrl-C, a lost link), and can end what it started. ``alone``:
        this is the connection's only call, so a connection made only for this command is not shared
        (no master to start and end). What ``on_out``/``on_err`` raise ends the call and is raised as it is.
        None: this transport has no such call (the caller runs a node module instead)."""
        return None


_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_./:=,+-")
_ESC = [chr(b) if b in _SAFE else f"\\{b:03o}" for b in range(256)]


def sh_command(command: str, exit_marker: str | None = None, start_marker: str | None = None) -> str:
    r"""``command`` as a string that any login shell (sh, bash, zsh, fish, tcsh, nushell) hands to ``sh``
    unchanged: ``sh -c 'eval "$(printf "\ooo...")"'``. Every byte but ``[A-Za-z0-9_./:=,+-]`` is written
    as an octal escape, so the single-quoted text holds no quote, blank, ``$``, ``!`` or two backslashes
    in a row, which one of those shells would read its own way; printf is sh's builtin (nothing else is
    needed on the node).

    ``start_marker``: before the command, sh writes ``\036dfo-start:MARKER\036`` on stderr: the node's
    side has started (sshd, the login, the shell are past), which the transports bound by the host's
    start_timeout. The command finds that marker in ``$dfo_keep``: written to stderr again at any time it is
    taken out of the stream wherever it falls (a keepalive for a quiet command: dfo exec's shell path).
    ``exit_marker``: the command runs in a subshell, then sh writes
    ``\036dfo-exit:MARKER:CODE\036`` on stderr: the OpenSSH transport tells the command's own exit 255
    from ssh's, and sees the end of a command whose leftover child holds the output open. ``Marks`` reads
    both off stderr."""
    script = command
    if exit_marker is not None:
        script = f"(\n{command}\n)\ns=$?\nprintf '\\036dfo-exit:{exit_marker}:%d\\036' \"$s\" >&2\nexit \"$s\"\n"
    if start_marker is not None:
        script = f"dfo_keep='\x1edfo-start:{start_marker}\x1e'\nprintf %s \"$dfo_keep\" >&2\n{script}"
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


LINE_PIECE = 1 << 20  # run_lines: a longer line without a newline goes to the caller in pieces


class _Lines:
    """A stream's complete lines, in batches, to ``on_lines`` as they arrive (run_lines); nothing kept. The
    _Collector's interface: feed, flush, text, raised."""

    def __init__(self, on_lines: Callable[[list[str]], object]) -> None:
        self.on_lines = on_lines
        self.pending = b""
        self.raised: BaseException | None = None  # what on_lines raised, if it did

    def feed(self, data: bytes) -> None:
        buf = self.pending + data
        parts = buf.split(b"\n")
        self.pending = parts.pop()
        while len(self.pending) > LINE_PIECE:
            parts.append(self.pending[:LINE_PIECE])
            self.pending = self.pending[LINE_PIECE:]
        self._give(parts)

    def _give(self, parts: list[bytes]) -> None:
        if not parts:
            return
        try:
            self.on_lines([b.decode("utf-8", "replace") for b in parts])
        except BaseException as exc:
            self.raised = exc  # the caller's own failure: the transport raises it as it is
            raise

    def flush(self) -> None:
        if self.pending:
            rest, self.pending = self.pending, b""
            self._give([rest])

    def text(self) -> str:
        return ""


def _mib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


# --------------------------------------------------------------------------- the bounds of a call

class NotStarted(HostError):
    """The node's side of a call did not start within the host's start_timeout: sshd took the connection (or
    is still being reached) but the login never ran dfo's command. A host that does not answer (exit 4)."""


class CallTimeout(HostError):
    """A call's command started but did not end within its timeout (exit 4; ``dfo exec --timeout`` makes it
    its 124). ``limit``: the seconds it was given."""

    def __init__(self, message: str, *, limit: float, host: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, host=host, hint=hint)
        self.limit = limit


START_HINT = ("sshd took the connection but the login never ran dfo's command: a login file (~/.bashrc, ~/.profile, "
              "~/.ssh/rc) or a ForceCommand that waits, PAM, a hung home directory; `ssh HOST true` shows it "
              "(the bound: start_timeout, in the inventory's defaults or the host's entry)")


class CallClock:
    """The two bounds of one call, from ``t0``: its node side starts within ``start_limit`` s (NotStarted), then
    its command ends within ``limit`` s of that start (CallTimeout). ``check(started)`` raises the one passed."""

    def __init__(self, host: str, start_limit: float, limit: float, t0: float) -> None:
        self.host, self.start_limit, self.limit, self.t0 = host, start_limit, limit, t0
        self.started_at: float | None = None

    def check(self, started: bool, now: float) -> None:
        if started and self.started_at is None:
            self.started_at = now
        if self.started_at is None:
            if now - self.t0 > self.start_limit:
                raise NotStarted(f"no answer: the node's side of the call did not start within {self.start_limit:g}s",
                                 host=self.host, hint=START_HINT)
        elif now - self.started_at > self.limit:
            raise CallTimeout(f"remote command did not finish within {self.limit:g}s", limit=self.limit,
                              host=self.host,
                              hint="the node may be overloaded or the link dead; retry, or raise the timeout")

    def left(self, now: float) -> float:
        """Seconds until the bound that applies now passes (never below 0)."""
        end = self.t0 + self.start_limit if self.started_at is None else self.started_at + self.limit
        return max(0.0, end - now)


class Marks:
    """A command's stderr into a _Tail, with dfo's markers (sh_command) taken out: ``started`` once the start
    marker came (or the exit marker: a command that ended had started), ``code`` the exit marker's status."""

    def __init__(self, marker: str, lines: _Lines | None = None) -> None:
        m = re.escape(marker.encode())
        self.rx = re.compile(rb"\x1edfo-(?:start:" + m + rb"|exit:" + m + rb":(\d+))\x1e")
        self.longest = len(marker) + 24
        self.tail = _Tail()
        self.lines = lines  # run_lines: stderr, markers taken out, to the caller too (line by line)
        self.carry = b""
        self.started = False
        self.code: int | None = None

    def feed(self, data: bytes) -> None:
        buf = self.carry + data
        shown = 0 if self.started else -1  # where the command's own stderr begins in buf (-1: not yet)
        while (m := self.rx.search(buf)) is not None:
            if not self.started:
                shown = m.start()  # before it: ssh's and the login's words, kept for errors, never shown
            self.started = True
            if m.group(1) is not None:
                self.code = int(m.group(1))
            buf = buf[:m.start()] + buf[m.end():]
        cut = buf.rfind(b"\x1e", max(0, len(buf) - self.longest)) if self.code is None else -1
        if cut >= 0:
            self.carry, buf = buf[cut:], buf[:cut]
        else:
            self.carry = b""
        self.tail.feed(buf)
        if self.lines is not None and 0 <= shown < len(buf):
            self.lines.feed(buf[shown:])

    def text(self) -> str:
        if self.carry:
            self.tail.feed(self.carry)
            if self.lines is not None and self.started:
                self.lines.feed(self.carry)
            self.carry = b""
        if self.lines is not None:
            self.lines.flush()
        return self.tail.text()


# poll(2) (epoll/kqueue where there is no poll): select(2) fails on a descriptor past 1023, which a command over
# some hundreds of hosts reaches
Selector: type[selectors.BaseSelector] = getattr(selectors, "PollSelector", selectors.DefaultSelector)


# --------------------------------------------------------------------------- descriptors

NOFILE_WANT = 16384  # the soft open-file limit dfo raises itself to at start (at most the hard limit): 2,040 calls
PER_CALL_FDS = 8  # descriptors one call in flight holds here at most: 3 or 4 once it runs (ssh's stdin, stdout and
#                   stderr pipes; a mux session: its socket and three pipe ends), up to 8 while it starts (both ends
#                   of each pipe, and subprocess's own pipe for exec's error)
NOFILE_RESERVE = 64  # kept for the rest: stdio, the inventory, known_hosts, logs, S3's sockets, paramiko's own


def raise_nofile(want: int = NOFILE_WANT) -> int | None:
    """Raise this process's soft RLIMIT_NOFILE towards ``want``, at most to the hard limit (where the system
    refuses a value, as macOS does past kern.maxfilesperproc, half of it, and so on): the soft limit now, or
    None where there is none to read. Never lowers it."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ValueError, OSError):
        return None
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    target = want if hard == resource.RLIM_INFINITY else min(hard, want)
    while target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            target //= 2
    return soft


def nofile() -> tuple[int, int]:
    """(soft, hard) RLIMIT_NOFILE of this process; a large number for 'no limit'."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        inf = resource.RLIM_INFINITY
    except (ImportError, ValueError, OSError):
        return 1 << 20, 1 << 20
    return (1 << 20 if soft == inf else soft), (1 << 20 if hard == inf else hard)


class _Budget:
    """How many calls may hold their descriptors here at once: what the soft open-file limit leaves past
    NOFILE_RESERVE, PER_CALL_FDS each. A call past that waits for one to end (said once on stderr), so a
    limit that cannot hold every host's call at once makes hosts take turns instead of failing. A thread
    that holds a slot takes no second one (a call made from inside another's callback)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0
        self._said = False
        self._mine = threading.local()

    @staticmethod
    def size() -> int:
        return max(1, (nofile()[0] - NOFILE_RESERVE) // PER_CALL_FDS)

    @contextmanager
    def slot(self) -> Iterator[None]:
        if getattr(self._mine, "held", False):
            yield
            return
        with self._cond:
            if self._busy >= self.size() and not self._said:
                self._said = True
                soft, hard = nofile()
                sys.stderr.write(f"dfo: the open-file limit here ({soft}) lets {self.size()} calls run at once; "
                                 f"the other hosts wait for a turn (for all at once: `ulimit -n {NOFILE_WANT}` "
                                 f"before dfo, the hard limit being {hard})\n")
            while self._busy >= self.size():
                self._cond.wait(0.25)  # in slices: Ctrl-C reaches the main thread
            self._busy += 1
        self._mine.held = True
        try:
            yield
        finally:
            self._mine.held = False
            with self._cond:
                self._busy -= 1
                self._cond.notify()


CALLS = _Budget()  # the process's one budget: every transport's call takes a slot of it while it runs


# --------------------------------------------------------------------------- resource errors

class LocalResourceError(HostError):
    """This machine ran out of something a host's call needs (open files, processes, memory): exit 4, the
    host was not reached, and the message names the limit and what to do. Never "please report it"."""

    kind = "local_resource"


def _nproc() -> str:
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        return "no limit" if soft == resource.RLIM_INFINITY else str(soft)
    except (ImportError, ValueError, OSError, AttributeError):
        return "unknown"


def _from_fork(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a process or thread was being started (subprocess, threading)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in ("_execute_child", "_fork_exec", "_posix_spawn"):
            return True
        tb = tb.tb_next
    return False


def resource_error(exc: BaseException, host: str | None = None) -> LocalResourceError | None:
    """The clear error for ``exc`` (or an error under it) when it says this machine ran out of open files
    (EMFILE, ENFILE), memory (ENOMEM, MemoryError) or processes (EAGAIN from fork, a thread that cannot
    start); None for any other error."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        code = e.errno if isinstance(e, OSError) else None
        if code == errno.EMFILE:
            soft, hard = nofile()
            return LocalResourceError(
                f"this machine ran out of open files for the call (EMFILE: dfo's limit is {soft}, hard {hard})",
                host=host, hint=f"raise it before dfo starts (`ulimit -n {NOFILE_WANT}`; past the hard limit: "
                                "/etc/security/limits.conf, or LimitNOFILE= for a service), or name fewer hosts")
        if code == errno.ENFILE:
            return LocalResourceError(
                "this machine's table of open files is full (ENFILE: the system-wide limit, fs.file-max)",
                host=host, hint="close what holds many files, raise fs.file-max (sysctl), or name fewer hosts")
        if code == errno.ENOMEM or isinstance(e, MemoryError):
            return LocalResourceError("this machine is out of memory for the call (ENOMEM)", host=host,
                                      hint="free memory here, or name fewer hosts at once")
        if (code == errno.EAGAIN and _from_fork(e)) or (
                isinstance(e, RuntimeError) and "can't start new thread" in str(e)):
            return LocalResourceError(
                f"this machine could not start a process or thread for the call (the process limit is {_nproc()})",
                host=host, hint="raise `ulimit -u` (or the pids limit of your container or cgroup), "
                                "or name fewer hosts at once")
        e = e.__cause__ or e.__context__
    return None


def raise_if_resource(exc: BaseException, host: str | None) -> None:
    """Raise resource_error(exc) (from ``exc``) when ``exc`` is this machine running out of something."""
    err = resource_error(exc, host)
    if err is not None:
        raise err from exc
