"""Runs on the node: one ad-hoc command for `dfo exec` (python3 3.8+, stdlib only).

Request (stdin): {"command": str, "timeout": float|null}. The command is shell text the controller
built with shlex.join from the user's argv; it runs as ssh would run it, by the user's login shell
(the passwd entry's shell when it is a POSIX one, else /bin/sh) as ``SHELL -lc COMMAND`` (so the
profile's PATH holds),
from $HOME, with stdin from /dev/null, in a new session (setsid): the command and everything it
starts form one process group that can be killed as a whole.

Its stdout and stderr go out as events as they come: {"kind": "stdout", "lines": [line, ...]} and
{"kind": "stderr", "lines": [...]}. A quiet command still sends {"kind": "tick"} every TICK_S
seconds, so that when the controller is gone (Ctrl-C, a lost link: sshd closes the pipe) a write
fails and the group is killed: nothing the call started outlives it. At the timeout the group gets
SIGTERM, then SIGKILL GRACE_S later, and the status is 124 (as with timeout(1)). A command killed
by signal N has status 128+N. Result: {"exit": int, "timed_out": bool, "signal": int|null, "seconds": float}.
"""
import os
import pwd
import select
import signal
import subprocess
import time
from typing import Optional, TypedDict

from remote._proto import RemoteError, emit_event, main


class ExecRequest(TypedDict):
    command: str  # shell text (shlex.join of the user's argv)
    timeout: Optional[float]


class ExecReply(TypedDict):
    exit: int
    timed_out: bool
    signal: Optional[int]
    seconds: float


CHUNK = 65536
LINE_MAX = 1 << 20  # a longer line without a newline goes out in pieces
TICK_S = 2.0
GRACE_S = 2.0
DRAIN_S = 2.0  # after the shell exits: read on to EOF, or this long without a byte (a background
#                process it left holds the pipes open)
TIMED_OUT = 124
_DROP_ENV = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")


POSIX_SHELLS = ("sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox")


def login_shell():
    """The user's login shell when it reads sh text (the command was quoted for sh), else /bin/sh: fish,
    tcsh or nushell would read the controller's quoting their own way (issue 18)."""
    try:
        sh = pwd.getpwuid(os.getuid()).pw_shell
    except KeyError:
        sh = ""
    if not sh or not os.access(sh, os.X_OK) or os.path.basename(sh) not in POSIX_SHELLS:
        sh = "/bin/sh"
    return sh


def kill_group(pgid, sig):
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Lines(object):
    """Splits one stream into lines; complete lines are taken with take()."""

    def __init__(self):
        self.buf = b""
        self.out = []

    def feed(self, data):
        self.buf += data
        parts = self.buf.split(b"\n")
        self.buf = parts.pop()
        self.out.extend(parts)
        if len(self.buf) > LINE_MAX:
            self.out.append(self.buf)
            self.buf = b""

    def close(self):
        if self.buf:
            self.out.append(self.buf)
            self.buf = b""

    def take(self):
        got, self.out = self.out, []
        return [b.decode("utf-8", "replace") for b in got]


class Gone(Exception):
    """The controller is gone: stdout is closed."""


def _leave(signum, frame):
    raise SystemExit(128 + signum)  # SIGTERM/SIGHUP to this module: the command's group goes too (below)


def send(kind, **fields):
    try:
        emit_event(kind, **fields)
    except (OSError, ValueError):
        raise Gone() from None


def run(command, timeout):
    signal.signal(signal.SIGTERM, _leave)
    signal.signal(signal.SIGHUP, _leave)
    env = dict((k, v) for k, v in os.environ.items() if k not in _DROP_ENV)
    home = os.path.expanduser("~")
    start = time.monotonic()
    proc = subprocess.Popen([login_shell(), "-lc", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, env=env,
                            cwd=home if os.path.isdir(home) else "/")
    assert proc.stdout is not None and proc.stderr is not None  # both PIPE
    out_fd = proc.stdout.fileno()
    streams = {out_fd: Lines(), proc.stderr.fileno(): Lines()}
    open_fds = set(streams)
    deadline = start + timeout if timeout else None
    timed_out = False
    term_at = None  # when SIGTERM went to the group (SIGKILL follows GRACE_S later)
    exited_at = None
    last_byte = last_sent = start
    try:
        while True:
            now = time.monotonic()
            if deadline is not None and not timed_out and now >= deadline:
                timed_out, term_at = True, now
                kill_group(proc.pid, signal.SIGTERM)
            if term_at is not None and now - term_at >= GRACE_S:
                kill_group(proc.pid, signal.SIGKILL)
                term_at = None
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and (not open_fds or (now - exited_at > DRAIN_S and now - last_byte > DRAIN_S)):
                break
            if open_fds:
                ready = select.select(list(open_fds), [], [], 0.25)[0]
            else:
                time.sleep(0.05)
                ready = []
            for fd in ready:
                data = os.read(fd, CHUNK)
                lines = streams[fd]
                if data:
                    lines.feed(data)
                    last_byte = time.monotonic()
                else:
                    lines.close()
                    open_fds.discard(fd)
                got = lines.take()
                if got:
                    send("stdout" if fd == out_fd else "stderr", lines=got)
                    last_sent = time.monotonic()
            if time.monotonic() - last_sent >= TICK_S:
                send("tick")
                last_sent = time.monotonic()
    except BaseException:
        # the controller is gone (or this module was interrupted): the command's group goes too
        kill_group(proc.pid, signal.SIGTERM)
        end = time.monotonic() + GRACE_S
        while proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)
        kill_group(proc.pid, signal.SIGKILL)
        raise
    for fd, lines in streams.items():
        lines.close()
        got = lines.take()
        if got:
            send("stdout" if fd == out_fd else "stderr", lines=got)
    code = proc.wait()
    sig = -code if code < 0 else None
    status = TIMED_OUT if timed_out else (128 + sig if sig else code)
    return {"exit": status, "timed_out": timed_out, "signal": sig, "seconds": round(time.monotonic() - start, 3)}


def handle(req: ExecRequest):
    command = req.get("command")
    timeout = req.get("timeout")
    if not isinstance(command, str) or not command.strip():
        raise RemoteError("usage", "no command given")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise RemoteError("usage", "timeout must be a positive number of seconds")
    try:
        return run(command, timeout)
    except Gone:
        os._exit(1)  # nobody to tell


def entry():
    """``python3 -m remote.exec``, or the controller's ``-S -c`` launch (agent.SITE_FREE): stdlib alone."""
    main(handle)


if __name__ == "__main__":
    entry()
