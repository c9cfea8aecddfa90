"""Liveness of an SSH connection: is the node still there while a call waits on it?

paramiko's own keepalive (Transport.set_keepalive) wants no reply, so it cannot tell a dead link
from a quiet one: a cut link or a hung node left a call waiting until TCP gave up (~15 min). dfo
does what OpenSSH's ServerAliveInterval does: every ALIVE_INTERVAL_S it sends the global request
"keepalive@openssh.com" with want_reply. Any answer (sshd answers "request failed") proves the
node's sshd is there, however long the command itself stays silent (a quiet pip install,
`sleep 600`). No answer for ALIVE_DEAD_S: the link is cut, or the node or its sshd hung;
connection.Connection then closes the connection (every hop of its path), and the call in flight
raises ConnectionLost (a HostError, exit 4).
From the cut to the error: at most ALIVE_DEAD_S + ALIVE_CHECK_S, under the 30 s dfo promises.

The environment may lower (or raise) both bounds, for tests that cut links (or a slow satellite link):
DFO_ALIVE_INTERVAL_S (default 5) and DFO_ALIVE_DEAD_S (default 20), seconds, DEAD > INTERVAL > 0.
A value that is not such a number is a ConfigError (exit 2) before any connection opens: bounds().

The watch needs only a transport with is_active() and global_request(kind, wait=True): paramiko's
Transport, which fabric's Connection exposes as .transport. No paramiko import here.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ..errors import ConfigError

# The one place for these numbers (the whole SSH setup is described in connection.py).
ALIVE_REQUEST = "keepalive@openssh.com"  # OpenSSH's own name; any sshd answers it (with a failure)
ALIVE_INTERVAL_S = 5.0  # a request every this many seconds, on every open connection
ALIVE_DEAD_S = 20.0  # no answer for this long: the link is dead (a loaded node answers in well under 1 s)
ALIVE_CHECK_S = 0.5  # how often the watch looks at the time since the last answer
ENV_INTERVAL = "DFO_ALIVE_INTERVAL_S"  # these two override the bounds above (tests set a few seconds)
ENV_DEAD = "DFO_ALIVE_DEAD_S"


class Bounds(NamedTuple):
    interval: float = ALIVE_INTERVAL_S
    dead: float = ALIVE_DEAD_S


def _seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds above 0",
                          hint=f"unset it for the default ({default:g}), or give e.g. {name}={default:g}")
    return value


def bounds() -> Bounds:
    """The liveness bounds for connections opened now: the defaults, or the environment's
    (DFO_ALIVE_INTERVAL_S, DFO_ALIVE_DEAD_S). ConfigError (exit 2) for a value that is not seconds
    above 0, or a dead bound not above the interval (every quiet link would read as dead)."""
    b = Bounds(_seconds(ENV_INTERVAL, ALIVE_INTERVAL_S), _seconds(ENV_DEAD, ALIVE_DEAD_S))
    if b.dead <= b.interval:
        raise ConfigError(f"{ENV_DEAD}={b.dead:g} must be above {ENV_INTERVAL}={b.interval:g}",
                          hint="the link counts as dead after DEAD seconds without an answer to a keepalive "
                               "sent every INTERVAL seconds")
    return b


class Liveness:
    """Watches one SSH transport: a thread asks the node for an answer every ``bounds.interval``
    (ALIVE_INTERVAL_S), another calls ``on_dead(why)`` once, when no answer came for ``bounds.dead``
    (ALIVE_DEAD_S). Both end with the transport, or at stop()."""

    def __init__(self, transport: Any, on_dead: Callable[[str], None], label: str,
                 bounds: Bounds | None = None) -> None:
        self.transport = transport
        self.bounds = bounds or Bounds()
        self.last_answer = time.monotonic()
        self.dead: str | None = None
        self._on_dead = on_dead
        self._stop = threading.Event()
        for what, target in (("ask", self._ask), ("watch", self._watch)):
            threading.Thread(target=target, name=f"dfo-alive-{what}-{label}", daemon=True).start()

    def _ask(self) -> None:
        t = self.transport
        while not self._stop.wait(self.bounds.interval) and t.is_active():
            try:
                t.global_request(ALIVE_REQUEST, wait=True)  # returns on any answer, or once t is closed
            except Exception:  # noqa: BLE001 - a transport closing under us; _watch decides
                return
            if t.is_active():
                self.last_answer = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(ALIVE_CHECK_S) and self.transport.is_active():
            silent = time.monotonic() - self.last_answer
            if silent > self.bounds.dead:
                self.dead = (f"the node has not answered for {silent:.0f}s "
                             "(the link is down, or the node or its sshd hung)")
                self._on_dead(self.dead)
                return

    def stop(self) -> None:
        self._stop.set()
