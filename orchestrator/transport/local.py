"""The local transport: the same calls, run on this machine with bash (dfo on the GPU box itself).

Each command runs in its own process group with an allow-listed environment (orchestrator.localenv).
If the call ends early (its timeout, an on_line callback that raises, Ctrl-C), the whole group is
killed before the error goes on: nothing the call started outlives it, as with a closed SSH channel.
There is no start phase to bound here (bash starts on this machine); the timeout is the command's, and the
output is waited on with poll(2), never select(2), which fails past descriptor 1023.
"""

from __future__ import annotations

import io
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import cast

from ..config.inventory import ResolvedHost
from ..localenv import local_env
from .base import (
    CALLS,
    STREAM_PIECE,
    CallTimeout,
    Result,
    Selector,
    Transport,
    _Collector,
    _Stream,
    _Tail,
    raise_if_resource,
)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the command's process group (it leads its own session), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


class LocalConnection(Transport):
    """bash on this machine, behind the Transport interface."""

    def __init__(self, host: ResolvedHost) -> None:
        self.host = host
        self.name = host.name

    def close(self) -> None:
        pass

    def run(self, command: str, *, timeout: float | None = None, stdin: bytes | str | None = None,
            on_line: Callable[[str], object] | None = None) -> Result:
        return self._run(command, timeout, stdin, _Collector(on_line, host=self.name))

    def run_stream(self, command: str, *, on_data: Callable[[bytes], object], timeout: float | None = None,
                   stdin: bytes | str | None = None) -> Result:
        """``run`` with stdout in pieces to ``on_data`` (Transport.run_stream)."""
        return self._run(command, timeout, stdin, _Stream(on_data), bufsize=STREAM_PIECE)

    def _run(self, command: str, timeout: float | None, stdin: bytes | str | None, out: _Collector | _Stream,
             bufsize: int = 65536) -> Result:
        with CALLS.slot():  # a turn, where the open-file limit cannot hold every host's call at once
            return self._call(command, timeout, stdin, out, bufsize)

    def _call(self, command: str, timeout: float | None, stdin: bytes | str | None, out: _Collector | _Stream,
              bufsize: int) -> Result:
        limit = timeout if timeout is not None else self.host.command_timeout
        start = time.monotonic()
        try:
            proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True, env=local_env())
        except OSError as exc:  # out of descriptors, processes or memory here: said as such
            raise_if_resource(exc, self.name)
            raise
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        pin, pout = proc.stdin, proc.stdout
        perr = cast(io.BufferedReader, proc.stderr)  # what Popen makes (bufsize -1); typeshed says IO[bytes]
        err = _Tail()

        def feed_stdin() -> None:
            try:
                if stdin is not None:
                    pin.write(stdin.encode() if isinstance(stdin, str) else stdin)
            except (BrokenPipeError, ValueError):
                pass
            try:
                pin.close()
            except (BrokenPipeError, ValueError):
                pass

        def read_err() -> None:
            try:
                for chunk in iter(lambda: perr.read1(65536), b""):
                    err.feed(chunk)
            except (OSError, ValueError):
                pass

        threads = [threading.Thread(target=feed_stdin, daemon=True), threading.Thread(target=read_err, daemon=True)]
        for t in threads:
            t.start()
        fd = pout.fileno()
        sel = Selector()  # poll(2): a descriptor past 1023 is no trouble (select(2) fails there)
        sel.register(fd, selectors.EVENT_READ)
        try:
            while True:
                remaining = limit - (time.monotonic() - start)
                if remaining <= 0:
                    raise CallTimeout(f"local command did not finish within {limit:g}s", limit=limit, host=self.name)
                if sel.select(min(remaining, 0.25)):
                    chunk = os.read(fd, bufsize)
                    if not chunk:
                        break
                    out.feed(chunk)
            try:  # stdout is closed; the command may still run
                code = proc.wait(max(limit - (time.monotonic() - start), 0.01))
            except subprocess.TimeoutExpired:
                raise CallTimeout(f"local command did not finish within {limit:g}s", limit=limit,
                                  host=self.name) from None
        except BaseException:  # a timeout, on_line raising, Ctrl-C: nothing the call started outlives it
            _kill_group(proc)
            raise
        finally:
            sel.close()
        for t in threads:
            t.join(5)
        pout.close()
        out.flush()
        return Result(self.name, command, out.text(), err.text(), code, time.monotonic() - start)
