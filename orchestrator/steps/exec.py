"""exec: one ad-hoc command on a node, its output streamed line by line (remote/exec.py).

The user's argv is joined with shlex.join (each word arrives as it was given: no re-splitting, no
expansion by dfo), and the node's login shell runs that text, as ssh runs a command. For pipes or
variables, give the shell yourself: ``dfo exec -H all -- bash -c 'nvidia-smi | head -5'``.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..agent import NODE, run_module
from ..transport.base import CallTimeout, Transport

NO_LIMIT_S = 30 * 86400.0  # without --timeout the command may run as long as it likes (liveness
#                            still ends a call whose link died; the host's start_timeout bounds its start)
CONTROLLER_MARGIN_S = 10.0  # with --timeout S, the node kills the group at S (SIGKILL 2 s later) and says so;
#                             the controller, counting from the node's start, ends the call at S + this itself
TIMED_OUT = 124  # as timeout(1)
KEEP_BYTES = 16 << 20  # per stream, what --json keeps (the end of it)


class _Kept:
    """A stream's lines kept for --json, at most KEEP_BYTES (the end), with how much was dropped."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.size = 0
        self.dropped = 0

    def add(self, lines: list[str]) -> None:
        for ln in lines:
            self.lines.append(ln)
            self.size += len(ln) + 1
        while self.size > KEEP_BYTES and len(self.lines) > 1:
            gone = self.lines.pop(0)
            self.size -= len(gone) + 1
            self.dropped += len(gone) + 1

    def text(self) -> str:
        head = f"[dfo: the first {self.dropped} bytes were dropped]\n" if self.dropped else ""
        return head + "".join(ln + "\n" for ln in self.lines)


@dataclass
class ExecResult:
    host: str
    exit: int
    seconds: float
    timed_out: bool = False
    signal: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    given: float | None = None  # --timeout, the seconds the command was given
    unconfirmed: bool = False  # timed out, and the node did not say so within CONTROLLER_MARGIN_S: dfo ended it

    @property
    def exit_code(self) -> int:
        return self.exit

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"host": self.host, "exit": self.exit, "seconds": round(self.seconds, 3),
                               "timed_out": self.timed_out, "signal": self.signal}
        if self.stdout is not None:
            doc["stdout"] = self.stdout
        if self.stderr is not None:
            doc["stderr"] = self.stderr
        return doc


def command_text(argv: Sequence[str]) -> str:
    """The shell text the node runs for ``argv``: every word quoted as given."""
    return shlex.join(list(argv))


def exec_on(conn: Transport, argv: Sequence[str], *, timeout: float | None = None,
            on_out: Callable[[list[str]], None] | None = None,
            on_err: Callable[[list[str]], None] | None = None, keep: bool = False) -> ExecResult:
    """Run ``argv`` on the node in its own process group; each batch of stdout/stderr lines goes to
    ``on_out``/``on_err`` as it arrives; ``keep`` collects them into the result (for --json). At
    ``timeout`` seconds the node kills the group: exit 124, timed_out. A node that has not said so
    CONTROLLER_MARGIN_S later (its python hung, say) has its call ended here: exit 124 too, ``unconfirmed``.
    A node whose side never starts is the host's start_timeout (transport.base.NotStarted, exit 4)."""
    out, err = _Kept(), _Kept()

    def on_event(ev: dict[str, Any]) -> None:
        kind, got = ev["kind"], ev.get("lines")  # "stdout", "stderr" or "tick" (remote/_proto.py EVENTS)
        if kind not in ("stdout", "stderr") or not isinstance(got, list):
            return
        lines = [str(x) for x in got]
        if keep:
            (out if kind == "stdout" else err).add(lines)
        show = on_out if kind == "stdout" else on_err
        if show is not None:
            show(lines)

    start = time.monotonic()
    limit = timeout + CONTROLLER_MARGIN_S if timeout else NO_LIMIT_S
    try:
        data = run_module(conn, NODE.exec, {"command": command_text(argv), "timeout": timeout},
                          timeout=limit, on_event=on_event)
    except CallTimeout:
        if not timeout:
            raise
        return ExecResult(conn.name, TIMED_OUT, time.monotonic() - start, timed_out=True, given=timeout,
                          unconfirmed=True, stdout=out.text() if keep else None, stderr=err.text() if keep else None)
    data = data if isinstance(data, dict) else {}
    return ExecResult(conn.name, int(data.get("exit", 1)), float(data.get("seconds") or time.monotonic() - start),
                      timed_out=bool(data.get("timed_out")), signal=data.get("signal"),
                      stdout=out.text() if keep else None, stderr=err.text() if keep else None, given=timeout)
