"""A session over an OpenSSH ControlMaster without starting an ``ssh`` client for it.

Within the persist window every call dfo makes goes over the shared connection; ``ssh -S PATH HOST CMD``
would start one more ssh process per call (about 3.4 ms of CPU and 5-6 ms of wall here) only to pass its
stdin, stdout and stderr to the master. ``open_session`` speaks the master's control protocol (OpenSSH's
PROTOCOL.mux, version 4) itself: the hello, MUX_C_NEW_SESSION with the command and no tty, this process's
three pipe ends passed with SCM_RIGHTS, then MUX_S_SESSION_OPENED, and, when the command ends,
MUX_S_EXIT_MESSAGE with its exit status. The master runs the session exactly as for its own ssh client
(its config, keepalives, SetEnv; SendEnv as ssh sends it: the variables of this process its patterns name).

``MuxSession`` stands where ``OpenSSH._collect`` has the ssh client's Popen: stdin, stdout, stderr, poll(),
wait(), returncode, terminate(), kill(). Ending it (terminate) closes the control connection, and the
master closes the session, as it does when its ssh client is killed. A master that goes away while the
command runs gives exit 255 with nothing said, as the ssh client does. Whatever fails before the session
opened gives None: the caller starts the ssh client, which says why (or connects anew).
"""

from __future__ import annotations

import array
import errno
import os
import socket
import struct
import time
from fnmatch import fnmatchcase
from typing import IO, Any

MUX_MSG_HELLO = 0x00000001
MUX_C_NEW_SESSION = 0x10000002
MUX_S_EXIT_MESSAGE = 0x80000004
MUX_S_SESSION_OPENED = 0x80000006
MUX_S_TTY_ALLOC_FAIL = 0x80000008
MUX_VERSION = 4
NO_ESCAPE = 0xFFFFFFFF


def _string(b: bytes) -> bytes:
    return struct.pack(">I", len(b)) + b


def _packet(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


class _Reader:
    """Length-prefixed packets off the control socket, whole or none."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.eof = False

    def packet(self, block: bool, deadline: float | None = None) -> bytes | None:
        """The next packet's body; None when there is none yet (``block`` False, or past ``deadline``) or
        the master closed the connection (``eof`` then set)."""
        while True:
            if len(self.buf) >= 4:
                n = struct.unpack(">I", self.buf[:4])[0]
                if len(self.buf) >= 4 + n:
                    body, self.buf = self.buf[4:4 + n], self.buf[4 + n:]
                    return body
            if self.eof:
                return None
            if block:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.sock.settimeout(left)
                try:
                    chunk = self.sock.recv(65536)
                except TimeoutError:
                    return None
                except OSError:
                    chunk = b""
            else:
                try:
                    chunk = self.sock.recv(65536, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return None
                except OSError:
                    chunk = b""
            if not chunk:
                self.eof = True
                return None
            self.buf += chunk


class MuxSession:
    """An open session: the pipes' other ends, and its exit status once the master sends it."""

    def __init__(self, sock: socket.socket, reader: _Reader, stdin: IO[bytes] | None, stdout: IO[bytes],
                 stderr: IO[bytes]) -> None:
        self._sock: socket.socket | None = sock
        self._reader = reader
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._exit: int | None = None  # the exit message's status, the session's once the master closes
        self.pid = 0  # no process of ours

    def _take(self, block: bool, deadline: float | None = None) -> None:
        """Read what the master sent. The session has ended when the master closes the control connection,
        which it does once the session's channel is closed and its output written to our pipes; the exit
        message comes before that and is kept till then. (Closing our end at the exit message would make
        the master drop what it had not yet written to stdout: ssh's own client reads on to the end too.)"""
        while self.returncode is None and self._sock is not None:
            body = self._reader.packet(block, deadline)
            if body is None:
                if self._reader.eof:  # closed: the exit status it sent, or 255 (the master went away)
                    self.returncode = 255 if self._exit is None else self._exit
                    self._close()
                return
            if len(body) >= 12 and struct.unpack(">I", body[:4])[0] == MUX_S_EXIT_MESSAGE:
                self._exit = struct.unpack(">I", body[8:12])[0] & 0xFF
            # anything else (MUX_S_TTY_ALLOC_FAIL: no tty was asked for) is read and passed over

    def poll(self) -> int | None:
        self._take(block=False)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._take(block=True, deadline=deadline)
        if self.returncode is None:
            import subprocess

            raise subprocess.TimeoutExpired("ssh (mux session)", timeout or 0)
        return self.returncode

    def terminate(self) -> None:
        """End the session: the master closes it once its control connection is gone."""
        if self.returncode is None:
            self.returncode = -15
        self._close()

    def kill(self) -> None:
        self.terminate()

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def send_env(patterns: list[str], environ: Any = None) -> list[str]:
    """``NAME=VALUE`` of each variable here that ssh_config's SendEnv names (ssh -G's ``sendenv``), as the ssh
    client passes them to its master (which filters them again by its own SendEnv)."""
    env = os.environ if environ is None else environ
    want = [p for p in patterns if p and not p.startswith("-")]
    return [f"{k}={v}" for k, v in env.items() if any(fnmatchcase(k, p) for p in want)]


def open_session(path: str, command: str, *, stdin: bool, env: list[str], timeout: float,
                 why: list[str] | None = None, hello_s: float = 10.0) -> MuxSession | None:
    """The session of ``command`` over the master listening at ``path``; None when it could not be opened
    (no master, one that refuses, an unexpected answer): nothing ran, the ssh client is the way. ``why``
    gets the reason of a None: "none" (nobody listens there), "hung" (a master that did not answer the hello
    within ``hello_s``: stopped or hung, as openssh_setup.master_answers says False) or "refused"."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mine: list[int] = []  # our ends of the pipes (kept), theirs (closed once sent)
    theirs: list[int] = []
    ok = False
    reason = "refused"
    try:
        wait = min(timeout, hello_s)
        sock.settimeout(wait)
        try:
            sock.connect(path)
        except OSError as exc:
            reason = "none" if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK) else "hung"
            raise
        reader = _Reader(sock)
        sock.sendall(_packet(struct.pack(">II", MUX_MSG_HELLO, MUX_VERSION)))
        hello = reader.packet(block=True, deadline=time.monotonic() + wait)
        if hello is None or len(hello) < 8 or struct.unpack(">II", hello[:8]) != (MUX_MSG_HELLO, MUX_VERSION):
            reason = "hung" if hello is None else "refused"
            return None
        if stdin:
            r_in, w_in = os.pipe()
            theirs.append(r_in)
            mine.append(w_in)
        else:
            theirs.append(os.open(os.devnull, os.O_RDONLY))
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        mine += [r_out, r_err]
        theirs += [w_out, w_err]
        for fd in mine:
            os.set_inheritable(fd, False)
        body = (struct.pack(">II", MUX_C_NEW_SESSION, 1) + _string(b"")
                + struct.pack(">IIIII", 0, 0, 0, 0, NO_ESCAPE) + _string(b"")
                + _string(command.encode("utf-8", "surrogateescape"))
                + b"".join(_string(e.encode("utf-8", "surrogateescape")) for e in env))
        sock.sendall(_packet(body))
        for fd in theirs:  # one byte with each descriptor, stdin, stdout, stderr (the master reads them so)
            sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        for fd in theirs:
            os.close(fd)
        theirs = []
        reply = reader.packet(block=True, deadline=time.monotonic() + timeout)
        if reply is None or len(reply) < 12 or struct.unpack(">I", reply[:4])[0] != MUX_S_SESSION_OPENED:
            return None  # MUX_S_FAILURE / PERMISSION_DENIED (with a reason), or no answer: the ssh client says
        sock.settimeout(None)
        out = os.fdopen(mine[-2], "rb", buffering=0)
        err = os.fdopen(mine[-1], "rb", buffering=0)
        feed = os.fdopen(mine[0], "wb") if stdin else None
        ok = True
        return MuxSession(sock, reader, feed, out, err)
    except OSError:
        return None
    finally:
        if not ok and why is not None:
            why.append(reason)
        if not ok:
            for fd in theirs + mine:
                try:
                    os.close(fd)
                except OSError:
                    pass
            sock.close()


__all__ = ["MuxSession", "open_session", "send_env"]
