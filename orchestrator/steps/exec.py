"""exec: one ad-hoc command on a node, its output streamed line by line (remote/exec.py).

The user's argv is joined with shlex.join (each word arrives as it was given: no re-splitting, no
expansion by dfo), and the node's login shell runs that text, as ssh runs a command. For pipes or
variables, give the shell yourself: ``dfo exec -H all -- bash -c 'nvidia-smi | head -5'``.
"""

from __future__ import annotations

import os
import secrets
import shlex
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import HostError
from ..transport.base import CallTimeout, Transport, sh_command

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


# The node's side of a call without --timeout, in sh alone (no node Python: what pdsh's call costs, plus a few
# builtins, one setsid and two watchers). The user's login shell (when it reads sh text, else /bin/sh) runs the
# command with -lc from $HOME, stdin /dev/null, as the leader of a new session (setsid), so its whole group can be
# killed. One watcher reads the call's stdin, which dfo holds open and never writes: at EOF (dfo gone: Ctrl-C, or a
# link that sshd dropped) it kills the group. The other writes the transport's keepalive marker ($dfo_keep, taken
# out of the stream by dfo) on stderr every KEEP_S: a link that died while the command is quiet is then found
# by the node's TCP (its retransmissions time out, sshd closes the session), the write fails, and the group
# is killed, as the node module's ticks did. Killing is SIGTERM, then SIGKILL GRACE_S later, whatever the
# command's leader does with the TERM (the watcher ignores the wrapper's own TERM once it has begun).
# A node without setsid says so (NO_SETSID with the caller's nonce) and runs nothing: dfo then runs the node
# module instead; so does a command whose text would pass Linux's limit on one argument (sshd hands the
# command to the login shell as one: 128 KiB).
GRACE_S = 2
KEEP_S = 10
NO_SETSID = "dfo-exec-no-setsid:"
ARG_SAFE = 100_000  # bytes of the command's text as sshd passes it (octal escapes included): under 128 KiB
_SHELLS = "sh|bash|dash|zsh|ksh|mksh|ash|busybox"  # as remote/exec.py's POSIX_SHELLS


def keep_interval() -> float:
    """KEEP_S, or $DFO_EXEC_KEEP_S (seconds above 0; tests make it short)."""
    try:
        v = float(os.environ.get("DFO_EXEC_KEEP_S", "") or KEEP_S)
    except ValueError:
        return KEEP_S
    return v if 0 < v < 86400 else KEEP_S


def shell_script(argv: Sequence[str], nonce: str) -> str:
    """The sh text of exec's shell path for ``argv`` (see above); ``nonce``: the caller's, for NO_SETSID."""
    kill = f'trap "" TERM; kill -TERM -"$p"; sleep {GRACE_S}; kill -KILL -"$p"'
    keep_s = keep_interval()
    return "\n".join([
        f"command -v setsid >/dev/null 2>&1 || {{ printf '%s\\n' {shlex.quote(NO_SETSID + nonce)} >&2; exit 0; }}",
        's=${SHELL:-/bin/sh}',
        f'case ${{s##*/}} in {_SHELLS}) ;; *) s=/bin/sh ;; esac',
        '[ -x "$s" ] || s=/bin/sh',
        'cd "$HOME" 2>/dev/null || cd /',
        'exec 3<&0',
        f'setsid "$s" -lc {shlex.quote(command_text(argv))} </dev/null 3<&- &',
        'p=$!',
        f'(read -r _; {kill}) <&3 3<&- >/dev/null 2>&1 &',
        'w=$!',
        f'(trap "" PIPE; while sleep {keep_s:g} </dev/null >/dev/null 2>&1; do printf %s "$dfo_keep" >&2 || break; '
        f'done; {kill}) </dev/null 3<&- >/dev/null &',
        'k=$!',
        'exec 3<&-',
        'wait "$p" 2>/dev/null; c=$?',
        'kill "$w" "$k" 2>/dev/null',
        'exit "$c"',
    ])


def _shell_exec(conn: Transport, argv: Sequence[str], on_out: Callable[[list[str]], None] | None,
                on_err: Callable[[list[str]], None] | None, keep: bool) -> ExecResult | None:
    """exec without --timeout, over the transport's run_lines: None where there is none (paramiko, local), the
    node has no setsid, or the command is too long for one argument (the caller runs the node module)."""
    out, err = _Kept(), _Kept()
    nonce = secrets.token_hex(8)
    script = shell_script(argv, nonce)
    if len(sh_command(script, nonce, start_marker=nonce)) > ARG_SAFE:
        return None
    missing: list[bool] = []

    def outs(lines: list[str]) -> None:
        if keep:
            out.add(lines)
        if on_out is not None:
            on_out(lines)

    def errs(lines: list[str]) -> None:
        if not missing and NO_SETSID + nonce in lines:
            missing.append(True)
            lines = [ln for ln in lines if ln != NO_SETSID + nonce]
        if keep:
            err.add(lines)
        if on_err is not None and lines:
            on_err(lines)

    res = conn.run_lines(script, on_out=outs, on_err=errs, timeout=NO_LIMIT_S, alone=True)
    if res is None or missing:
        return None
    if not res.started:  # sshd or the login failed before the wrapper ran (a nologin shell, a ForceCommand)
        from ..agent import plain_tail

        tail = plain_tail(res.stderr.strip())
        said = f": {tail}" if tail else ""
        raise HostError(f"the node's shell did not run the command (exit {res.exit_code}){said}", host=conn.name,
                        hint="`ssh HOST true` shows what the login does; the user's shell must run commands "
                             "(not nologin), with no ForceCommand in the way")
    code = res.exit_code
    sig = code - 128 if 128 < code < 128 + 65 else None  # as the shell reports a command killed by signal N
    return ExecResult(conn.name, code, res.seconds, signal=sig, stdout=out.text() if keep else None,
                      stderr=err.text() if keep else None)


def exec_on(conn: Transport, argv: Sequence[str], *, timeout: float | None = None,
            on_out: Callable[[list[str]], None] | None = None,
            on_err: Callable[[list[str]], None] | None = None, keep: bool = False) -> ExecResult:
    """Run ``argv`` on the node in its own process group; each batch of stdout/stderr lines goes to
    ``on_out``/``on_err`` as it arrives; ``keep`` collects them into the result (for --json). At
    ``timeout`` seconds the node kills the group: exit 124, timed_out. A node that has not said so
    CONTROLLER_MARGIN_S later (its python hung, say) has its call ended here: exit 124 too, ``unconfirmed``.
    A node whose side never starts is the host's start_timeout (transport.base.NotStarted, exit 4)."""
    if not timeout:
        done = _shell_exec(conn, argv, on_out, on_err, keep)
        if done is not None:
            return done
    from ..agent import NODE, run_module  # the node module's path only (the shell path needs none of it)

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
