"""Following a run's log over SSH: exact resume, bounded memory, truncation and rotation.

The node side is ``remote/runs/ops.py`` ``follow``: ONE long-lived remote command per connection that
streams the log's new bytes as framed events (``agent.run_module``'s ``on_event``; their kinds:
remote/_proto.py EVENTS), in order:

* ``{"kind": "start", "offset": OFFSET, "run": ID, "job": ..., "pid": ..., "ino": "DEV:INO"|null}``,
  always first;
* ``{"kind": "chunk", "o": OFFSET, "t": TEXT}`` (or ``"d": BASE64`` for bytes that are not UTF-8):
  log bytes at OFFSET;
* ``{"kind": "hb", "offset": OFFSET}``: a heartbeat every ``HEARTBEAT_S`` while the log is quiet;
* ``{"kind": "reset", "offset": 0, "why": "truncated"|"replaced", "log": PATH, "ino": ...}``: the log
  got shorter than the offset, or its path names another file (rotation); reading goes on from its start;
* ``{"kind": "opened", "ino": ...}``: the log file appeared after the start;
* ``{"kind": "outputs", ...}``: after the run's end, while its outputs' last pass goes on (not shown here).

The controller holds the offset of the next byte it needs and the identity of the file it belongs
to. After a dropped connection (or ``STALL_S`` with nothing heard, which is how a dead link shows)
it reconnects with backoff and asks again from that offset of that file, so every line is shown
once, in order; a file that changed meanwhile is reported and followed from its new start.

Memory is bounded whatever the log: the connection keeps only the result frame, and
``LineSplitter`` holds at most one partial line of ``LINE_MAX`` bytes; a longer line is passed on
in pieces, each but the last ending in ``SPLIT_MARK``.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from ..agent import NODE, run_module
from ..errors import ConnectionLost, DfoError, HostError, HostKeyError, NoResult, RemoteCommandError
from ..transport.base import Transport

HEARTBEAT_S = 2.0
STALL_S = 8.0
RECONNECT_BUDGET_S = 300.0
COALESCE_MS = 5.0  # a log faster than 50 lines/s is sent in batches at most this far apart
LINE_MAX = 256 << 10  # a longer line is shown in pieces of at most this many bytes
SPLIT_MARK = " [dfo: line split, continues]"
_NEVER_STARTED_HINT = ("is something on the node (~/.bashrc, /etc/bash.bashrc) swallowing or rewriting what "
                       "commands print? `ssh {host} true` should print nothing")


def _chunk(ev: dict[str, Any]) -> bytes:
    if "t" in ev:
        return str(ev["t"]).encode("utf-8")
    return base64.b64decode(ev.get("d") or "")


class LineSplitter:
    """Bytes in, complete lines out (without the newline); a partial line waits for its end.

    At most ``line_max`` bytes wait: a longer line is passed on in pieces of at most that size
    (cut between UTF-8 characters), each but the last ending in ``SPLIT_MARK``. No byte is dropped.
    """

    def __init__(self, on_line: Callable[[str], None], line_max: int = LINE_MAX) -> None:
        self.on_line, self.line_max = on_line, max(16, line_max)
        self.pending = bytearray()

    def feed(self, data: bytes) -> None:
        nl = data.rfind(b"\n")
        if nl < 0:
            self.pending += data
        else:
            whole, self.pending = self.pending + data[:nl], bytearray(data[nl + 1:])
            for line in whole.split(b"\n"):
                if len(line) > self.line_max:
                    line = self._pieces(line)
                self.on_line(line.decode("utf-8", "replace"))
        if len(self.pending) > self.line_max:
            self.pending = self._pieces(self.pending)

    def _pieces(self, line: bytearray) -> bytearray:
        """Pass on all of ``line`` but its last ``line_max`` bytes or fewer (returned), in marked pieces."""
        start, cap = 0, self.line_max
        while len(line) - start > cap:
            cut = start + cap
            for back in range(4):  # never inside a UTF-8 character (at most 3 continuation bytes)
                if line[cut - back] & 0xC0 != 0x80:
                    cut -= back
                    break
            self.on_line(line[start:cut].decode("utf-8", "replace") + SPLIT_MARK)
            start = cut
        return line[start:]

    def flush(self) -> None:
        if self.pending:
            line, self.pending = self.pending, bytearray()
            self.on_line(line.decode("utf-8", "replace"))


class _Watchdog:
    """Closes the connection when nothing (not even a heartbeat) arrived for ``stall_s``: a dead
    link looks like silence, and closing is what makes the blocked call return."""

    def __init__(self, conn: Transport, stall_s: float) -> None:
        self.conn, self.stall_s = conn, stall_s
        self.last = time.monotonic()
        self.armed = self.fired = False
        self._done = threading.Event()
        threading.Thread(target=self._run, daemon=True, name=f"dfo-watchdog-{conn.name}").start()

    def arm(self) -> None:
        self.last, self.fired, self.armed = time.monotonic(), False, True

    def _run(self) -> None:
        while not self._done.wait(0.5):
            if self.armed and time.monotonic() - self.last > self.stall_s:
                self.armed, self.fired = False, True
                self.conn.close()

    def close(self) -> None:
        self._done.set()


def _never_started(host: str, why: str) -> RemoteCommandError:
    return RemoteCommandError(f"the log stream never started: {why}", host=host,
                              hint=_NEVER_STARTED_HINT.format(host=host))


class _Stream:
    """What the controller knows of the log it follows: the next offset, the file it belongs to,
    and the partial line."""

    def __init__(self, host: str, run: str | None, on_line: Callable[[str], None],
                 note: Callable[[str], None]) -> None:
        self.host, self.run, self.note = host, run, note
        self.split = LineSplitter(on_line)
        self.offset: int | None = None
        self.ino: str | None = None
        self.started = False  # this call's start event came

    def on_event(self, ev: dict[str, Any]) -> None:
        kind = ev["kind"]
        if kind == "start":
            self.started = True
            self.run = ev.get("run") or self.run
            if self.offset is None:
                self.offset = int(ev["offset"])
            self.ino = ev.get("ino") or self.ino
            return
        if not self.started or self.offset is None:
            raise _never_started(self.host, "the node sent log data without its start frame")
        if kind == "reset":
            self.split.flush()  # the part of a line written before the cut: shown, never held back
            self.offset, self.ino = int(ev["offset"]), ev.get("ino")
            self.note(f"{self.host}: log {ev.get('log')} was {ev.get('why')}; following from its new start")
            return
        if kind == "opened":
            self.ino = ev.get("ino") or self.ino
            return
        if kind != "chunk":  # hb (the watchdog already saw it), outputs
            return
        data, at = _chunk(ev), int(ev["o"])
        if at > self.offset:
            self.note(f"{at - self.offset} bytes of the log were skipped (was the log truncated?)")
        if at < self.offset:
            data = data[self.offset - at:]
        self.split.feed(data)
        self.offset = max(self.offset, at) + len(data)


def stream(
    conn: Transport,
    request: dict[str, Any],
    *,
    run: str | None,
    lines: int | str | None,
    max_seconds: float | None,
    on_line: Callable[[str], None],
    on_note: Callable[[str], None] | None,
    stall_s: float | None,
    reconnect_budget_s: float,
    to_end: bool,
    give_up: Callable[[], str | None] | None = None,
) -> dict[str, Any]:
    """Stream the run's log to ``on_line`` until the node's ``follow`` returns; its data (the run).

    ``request`` holds workspace, job and tail. ``to_end``: stop at the log's end as it is now
    (``tail --no-follow``) instead of following until the run ends. ``reconnect_budget_s`` 0: a
    lost connection is an error at once. ``give_up()``, asked while the connection is lost (before each
    attempt to reconnect), may end the wait early with a reason: ConnectionLost at once (a run that a
    newer generation replaced elsewhere: its node may never come back).
    """
    stall_s = stall_s if stall_s is not None else float(os.environ.get("DFO_TAIL_STALL_S") or STALL_S)
    heartbeat = min(HEARTBEAT_S, stall_s / 4)
    st = _Stream(conn.name, run, on_line, on_note or (lambda _: None))
    t_end = time.monotonic() + max_seconds if max_seconds is not None else None
    dog = _Watchdog(conn, stall_s)
    attempt, lost_since = 0, None

    def on_event(ev: dict[str, Any]) -> None:
        nonlocal attempt, lost_since
        dog.last = time.monotonic()
        attempt, lost_since = 0, None
        st.on_event(ev)

    try:
        while True:
            remaining = None if t_end is None else max(0.0, t_end - time.monotonic())
            req = {**request, "op": "follow", "run": st.run, "offset": st.offset, "ino": st.ino, "lines": lines,
                   "max_seconds": remaining, "heartbeat": heartbeat, "to_end": to_end,
                   "coalesce": float(os.environ.get("DFO_TAIL_COALESCE_MS") or COALESCE_MS) / 1000}
            st.started = False
            dog.arm()
            try:
                data = run_module(conn, NODE.runs, req, timeout=1e9 if remaining is None else remaining + 120,
                                  on_event=on_event)
            except HostKeyError:
                raise  # a changed key is no dropped link: never retried
            except NoResult as exc:
                if st.started:
                    raise
                raise _never_started(conn.name, exc.message) from None
            except HostError as exc:
                if reconnect_budget_s <= 0:
                    raise
                lost_since = lost_since or time.monotonic()
                why = f"nothing heard for {stall_s:g}s" if dog.fired else exc.message
                resume = f"dfo tail -H {conn.name} {st.run or ''}".rstrip()
                if time.monotonic() - lost_since > reconnect_budget_s:
                    raise ConnectionLost(f"lost the connection for over {reconnect_budget_s:g}s: {why}", host=conn.name,
                                    hint=f"the run is not affected; resume with: {resume}") from None
                _give_up(conn, give_up, why, resume)
                if on_note:
                    on_note(f"connection to {conn.name} lost ({why}); reconnecting")
                attempt = _reconnect(conn, attempt, lost_since, reconnect_budget_s, resume, give_up)
                if on_note:
                    on_note(f"reconnected to {conn.name}; resuming {st.run or 'the run'} at byte {st.offset or 0}")
                continue
            finally:
                dog.armed = False
            if not st.started:
                raise _never_started(conn.name, f"{NODE.runs} answered without streaming the log")
            if to_end or data.get("state") != "running":
                st.split.flush()
            return data
    finally:
        dog.close()


def _give_up(conn: Transport, give_up: Callable[[], str | None] | None, why: str, resume: str) -> None:
    reason = give_up() if give_up is not None else None
    if reason:
        raise ConnectionLost(f"lost the connection ({why}) and {reason}: not reconnecting", host=conn.name,
                             hint=f"resume with: {resume}")


def _reconnect(conn: Transport, attempt: int, lost_since: float, budget: float, resume: str,
               give_up: Callable[[], str | None] | None = None) -> int:
    """Reconnect with exponential backoff (0.5 s doubling to 8 s) until ``budget`` s after the loss, or
    until ``give_up()`` gives a reason."""
    while True:
        time.sleep(min(0.5 * 2 ** attempt, 8.0))
        attempt += 1
        _give_up(conn, give_up, "no answer", resume)
        try:
            conn.reconnect()
        except HostKeyError:
            raise
        except DfoError as exc:
            if time.monotonic() - lost_since > budget:
                raise ConnectionLost(f"lost the connection and could not reconnect for {budget:g}s: {exc.message}",
                                host=conn.name, hint=f"the run is not affected; resume with: {resume}") from None
            continue
        return attempt
