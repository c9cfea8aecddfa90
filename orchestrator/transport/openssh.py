"""The OpenSSH transport: every remote call is one run of the ``ssh`` client (OpenSSH >= 8.0).

What ssh is told, and why, is in openssh_setup.py (the one commented place for its options). Here:

* one ``ssh`` process per call, over a shared connection (ControlMaster) that outlives the call and dfo
  itself for ``defaults.ssh_persist`` seconds; a master that does not answer is passed over
  (openssh_setup.master_answers) and a call whose master failed before its session opened is made
  again over a fresh connection, once;
* the command runs under ``sh`` whatever the login shell (transport.sh_command), in a subshell after
  which sh writes an exit marker on stderr: ssh's own exit 255 (it could not connect, or the
  connection died) is never taken for the command's, and a command whose leftover child holds the
  output open ends AFTER_EXIT_S after its shell did (as the paramiko transport does);
* two bounds on every call (base.CallClock): sh writes a start marker on stderr before the command, which
  must come within the host's start_timeout (a node that takes the connection and then hangs in its
  login: NotStarted, exit 4), then the command has its timeout (CallTimeout);
* a call holds its descriptors only while it has a turn (base.CALLS: what the open-file limit holds at
  once) and waits on them with poll(2), never select(2), which fails past descriptor 1023;
* stdout goes through transport._Collector (streaming on_line, bounded), or with ``run_stream`` (binary
  stdout: dfo pull's bytes) to the caller's on_data in pieces, nothing kept; stderr through _Tail;
  stdin bytes are written by a thread and closed (secrets travel there, never in argv);
* ssh's failures become dfo's errors (openssh_errors.py): a changed, revoked or unverifiable host key
  is HostKeyError naming the hop, a dead link ConnectionLost, the rest HostError (all exit 4);
* host keys: ssh records a new host's key in this connection's own file first; after each call dfo
  moves it into its known_hosts under the same locks as the paramiko transport, once per key, and
  says so on stderr (``dfo: HOST: recorded host key ED25519 SHA256:... for LABEL``).
"""

from __future__ import annotations

import os
import secrets
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ..config.inventory import ResolvedHost
from ..errors import ConnectionLost, DfoError, HostKeyError
from . import openssh_early, openssh_mux
from . import openssh_keys as keys
from . import openssh_setup as setup
from .base import (
    CALLS,
    CallClock,
    Marks,
    Result,
    Selector,
    Transport,
    _Collector,
    _Lines,
    _Stream,
    raise_if_resource,
    sh_command,
)
from .openssh_early import stop
from .openssh_errors import LOST_HINT, classify, mux_failed_before_session

PERSIST_OFF_S = 10  # ssh_persist 0: the command's own master ends at close() (mux terminate); this long after
#                     its last call when dfo was killed, or when calls are further apart than this
AFTER_EXIT_S = 2.0  # after the command's shell ended: read output to EOF, or until this long without a byte
SLICE_S = 0.25  # the loop's wait: Ctrl-C and timeouts act within this
PIPE_BIG = 1 << 20  # run_stream: ssh's stdout pipe is grown to this (fewer wake-ups per byte), when Linux lets it


class OpenSSH(Transport):
    """One host through the ``ssh`` client; calls share one connection (ControlMaster)."""

    def __init__(self, host: ResolvedHost) -> None:
        self.host = host
        self.name = host.name
        self._lock = threading.Lock()
        self._prep: keys.Prepared | None = None
        self._said_dead_master = False
        self._pass_over = False  # the user's own master does not answer: this transport no longer uses it
        self._running: set[subprocess.Popen[bytes] | openssh_mux.MuxSession] = set()  # each call in flight
        self._closed: set[subprocess.Popen[bytes] | openssh_mux.MuxSession] = set()  # ... those close() ended
        self._warming: _Warm | None = None  # warm()'s call, which the calls made meanwhile wait for
        self._remembered = False  # openssh_early has the record of this connection (one per transport)

    # ---------------------------------------------------------------- set-up
    def _prepared(self) -> keys.Prepared:
        refused: openssh_early.Early | None = None
        try:
            with self._lock:
                if self._prep is None:
                    early = openssh_early.take(self.name)
                    try:
                        prep = keys.prepare(self.host, early)
                    except BaseException:
                        refused = early
                        raise
                    same = early is not None and prep.folder == early.folder \
                        and self._argv(prep, "", False, make=False)[:-1] == early.argv  # the same ssh, byte for byte
                    if early is not None and same:
                        self._running.add(early.proc)  # its call is this transport's first (close() stops it)
                        self._warming = _Warm(self.name, lambda warm: self._early_call(prep, early, warm))
                        _verbose(f"dfo: {self.name}: over the ssh started at dfo's start-up\n")
                    elif early is not None:
                        _verbose(f"dfo: {self.name}: the ssh started at dfo's start-up is not the one the inventory "
                                 "makes now: stopped, connecting anew\n")
                        refused = early
                        if prep.folder == early.folder:  # its config and socket, but another argv: a set-up of its own
                            prep = keys.prepare(self.host)
                    self._prep = prep
                return self._prep
        finally:
            if refused is not None:  # stopped out of the lock (it can take a second or two); no call uses its master
                refused.discard(keep_master=False)

    def close(self) -> None:
        """End the calls in flight (their ssh: they raise ConnectionLost, as on a closed paramiko
        transport), forget this connection's set-up, and with ``ssh_persist: 0`` end the command's own master."""
        with self._lock:
            prep, self._prep = self._prep, None
            self._warming = None
            running = list(self._running)
            self._closed.update(running)
        for proc in running:
            stop(proc)
        if prep is None:
            return
        try:
            keys.merge_new_keys(self.host, prep)
        finally:
            if self.host.ssh_persist <= 0 and prep.own_control and prep.control is not None:
                openssh_early.end_master(str(prep.control))  # no connection outlives the command
            openssh_early.remove_conn_folder(prep.folder)

    def reconnect(self) -> None:
        """The connection is suspect (a stream went silent, a call lost it): the next calls go over a new
        one. dfo's own master is let go (its socket removed: it ends on its own), a user's is passed over;
        then a connection is made now, so that a host still unreachable raises here."""
        with self._lock:
            prep = self._prep
        if prep is not None and prep.control is not None:
            if prep.own_control:
                try:
                    os.unlink(prep.control)
                except OSError:
                    pass
            else:
                self._pass_over = True
        self.close()
        self.run("true", timeout=self.host.connect_timeout + 10)

    def warm(self) -> None:
        """Make dfo's shared connection now, in a thread (Transport.warm); a call made meanwhile waits for
        it and goes over it. Nothing is done where a master of dfo's already answers, nor for a ControlPath
        of the user's (their ssh_config decides whether it is shared). Raises only what the first call
        would raise before it connects (ConfigError: no usable ssh, a damaged known_hosts)."""
        prep = self._prepared()
        if not prep.own_control or prep.control is None:
            return
        with self._lock:
            if self._warming is not None or self._pass_over or self._prep is not prep:
                return
            self._warming = _Warm(self.name, lambda warm: self._warm_call(prep, warm))  # started here

    def establish(self) -> None:
        """warm(), then wait for its call (a master of dfo's that answers already: nothing to wait for)."""
        self.warm()
        self._wait_warm()

    def _warm_call(self, prep: keys.Prepared, warm: _Warm) -> None:
        assert prep.control is not None
        answers = setup.master_answers(str(prep.control))  # here, not under the lock: a hung master takes a while
        if answers is True:
            return
        try:
            self._run("true", self.host.connect_timeout + 10, None, lambda: _Collector(None, host=self.name),
                      prep=prep, probed=answers)
        except DfoError as exc:  # the calls waiting for this one raise it (they would meet it again)
            warm.error = exc

    def _early_call(self, prep: keys.Prepared, early: openssh_early.Early, warm: _Warm) -> None:
        """The call of the ssh started at dfo's start-up (openssh_early), read as warm()'s call is run."""
        limit = self.host.connect_timeout + 10
        try:
            with CALLS.slot():
                done = self._collect(prep, early.proc, "true", early.marker, early.started, limit, None,
                                     _Collector(None, host=self.name), False, False)
            if done is None:  # the master failed before the session opened: as _run does, on a fresh connection
                self._run("true", limit, None, lambda: _Collector(None, host=self.name), prep=prep, probed=None)
        except DfoError as exc:
            warm.error = exc

    def _wait_warm(self) -> None:
        """A call made while warm()'s is under way waits for it (in slices: Ctrl-C acts at once), so that
        it goes over the connection that call made instead of making a second one. If that call failed,
        the first call to wait raises its error: a host that cannot be reached is not tried twice, and a
        host key found changed while it was recorded is never passed over (dfo's socket is removed, so no
        later call uses the master that call made)."""
        warm = self._warming
        if warm is None or warm.thread is threading.current_thread():
            return
        while warm.thread.is_alive():
            warm.thread.join(SLICE_S)
        with self._lock:
            if self._warming is not warm or warm.error is None:
                return
            err, warm.error = warm.error, None
            prep = self._prep
        if isinstance(err, HostKeyError) and prep is not None and prep.own_control and prep.control is not None:
            try:
                os.unlink(prep.control)
            except OSError:
                pass
        raise err

    def _argv(self, prep: keys.Prepared, remote: str, fresh: bool, make: bool = True) -> list[str]:
        """The ssh client's argv for ``remote``; ``make``: its folder made now (False: only its text)."""
        argv = [prep.ssh, "-F", str(prep.ready() if make else prep.config), "-T"]
        for o in self.host.ssh_options:
            argv += ["-o", o]
        if prep.target_strict:
            argv += ["-o", "StrictHostKeyChecking=yes"]
        if fresh:
            argv += ["-o", "ControlMaster=no", "-o", "ControlPath=none"]
        elif prep.own_control and prep.control is not None:
            # ssh_persist 0: shared while dfo runs (close() ends it), PERSIST_OFF_S at most after a killed dfo
            persist = max(1, round(self.host.ssh_persist)) if self.host.ssh_persist > 0 else PERSIST_OFF_S
            argv += ["-o", "ControlMaster=auto", "-o", f"ControlPath={setup.q(setup.pct(str(prep.control)))}",
                     "-o", f"ControlPersist={persist}s"]
        return [*argv, "--", self.host.alias or self.host.hostname, remote]

    def _fresh(self, prep: keys.Prepared, probed: bool | None | str = "") -> bool:
        """Whether this call must pass the shared connection over: a master sits on the control path
        but does not answer (stopped, hung). dfo's own socket is removed instead (this call then makes a
        new master); a user's master is left alone and this transport stops using it. ``probed``: what
        master_answers said a moment ago (warm()'s call), not asked again."""
        if self._pass_over:
            return True
        if prep.control is None:
            return False
        if (setup.master_answers(str(prep.control)) if probed == "" else probed) is not False:
            return False
        if not self._said_dead_master:
            self._said_dead_master = True
            sys.stderr.write(f"dfo: {self.name}: the shared ssh connection at {prep.control} does not answer; "
                             "using a fresh connection\n")
        if prep.own_control:
            try:
                os.unlink(prep.control)
            except OSError:
                pass
            return False
        self._pass_over = True
        return True

    # ---------------------------------------------------------------- run
    def run(self, command: str, *, timeout: float | None = None, stdin: bytes | str | None = None,
            on_line: Callable[[str], object] | None = None) -> Result:
        """Run ``command`` (a shell string, built with shlex.quote) and wait, at most ``timeout`` s."""
        return self._run(command, timeout, stdin, lambda: _Collector(on_line, host=self.name))

    def run_stream(self, command: str, *, on_data: Callable[[bytes], object], timeout: float | None = None,
                   stdin: bytes | str | None = None) -> Result:
        """``run`` with stdout in pieces to ``on_data`` (Transport.run_stream)."""
        return self._run(command, timeout, stdin, lambda: _Stream(on_data), big_pipe=True)

    def run_lines(self, command: str, *, on_out: Callable[[list[str]], object],
                  on_err: Callable[[list[str]], object], timeout: float | None = None,
                  alone: bool = False) -> Result | None:
        """``run`` with both streams to the caller line by line and stdin held open (Transport.run_lines).
        ``alone`` with ``ssh_persist: 0``: no master is started for this one call (a plain ssh, as pdsh runs)."""
        return self._run(command, timeout, None, lambda: _Lines(on_out), err_lines=lambda: _Lines(on_err),
                         hold=True, alone=alone)

    def _run(self, command: str, timeout: float | None, stdin: bytes | str | None,
             sink: Callable[[], _Collector | _Stream | _Lines], big_pipe: bool = False,
             prep: keys.Prepared | None = None, probed: bool | None | str = "",
             err_lines: Callable[[], _Lines] | None = None, hold: bool = False, alone: bool = False) -> Result:
        """One call: the node's side must start within the host's start_timeout, the command then ends within
        ``timeout`` (default: command_timeout); both counted once the call has its descriptors (CALLS).
        ``hold``: stdin is a pipe held open, nothing written, until the call ends (run_lines)."""
        limit = timeout if timeout is not None else self.host.command_timeout
        if prep is None:  # (warm()'s call passes the set-up it was started for: never one made after a close())
            self._prepared()  # first: it may take over an early ssh, which this call then waits for
            self._wait_warm()
        with CALLS.slot():  # a turn, where the open-file limit cannot hold every host's call at once
            start = time.monotonic()
            prep = prep or self._prepared()
            payload = stdin.encode() if isinstance(stdin, str) else stdin
            # over the shared connection without an ssh client of its own (openssh_mux), whose hello is the probe
            # of the master; the ssh client (DFO_MUX_CLIENT=0) is sent to a master only once it answered
            mux = prep.control is not None and os.environ.get("DFO_MUX_CLIENT") != "0"
            if probed == "" and prep.control is not None and not self._pass_over and not mux:
                probed = setup.master_answers(str(prep.control))
            fresh = self._fresh(prep, probed) if probed != "" else self._pass_over
            own_only = alone and prep.own_control and self.host.ssh_persist <= 0
            if own_only and probed is None:
                fresh = True  # the command's own master would serve this one call and end: not worth its start
            while True:
                marker = secrets.token_hex(8)
                remote = sh_command(command, marker, start_marker=marker)
                proc: subprocess.Popen[bytes] | openssh_mux.MuxSession | None = None
                if not fresh and mux:
                    # None: no master there, a hung one, or one that would not open the session: the ssh client
                    # below makes a master or says why
                    assert prep.control is not None
                    left = self.host.start_timeout - (time.monotonic() - start)
                    why: list[str] = []
                    proc = openssh_mux.open_session(str(prep.control), remote, stdin=payload is not None or hold,
                                                    env=openssh_mux.send_env(self.host.ssh_resolved.get("sendenv", [])),
                                                    timeout=max(1.0, left), why=why, hello_s=setup.MUX_PROBE_S)
                    if why == ["hung"]:
                        fresh = self._fresh(prep, False)  # said once; dfo's socket removed, a user's passed over
                    elif why == ["none"] and own_only:
                        fresh = True
                if proc is None:
                    argv = self._argv(prep, remote, fresh)
                    feed = subprocess.PIPE if payload is not None or hold else subprocess.DEVNULL
                    try:
                        proc = subprocess.Popen(argv, stdin=feed, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                start_new_session=True)
                    except OSError as exc:  # out of descriptors, processes or memory here: said as such
                        raise_if_resource(exc, self.name)
                        raise
                result = self._collect(prep, proc, command, marker, start, limit, payload, sink(), fresh, big_pipe,
                                       err_lines() if err_lines is not None else None)
                if result is not None:
                    return result
                fresh = True  # the master failed before the session opened: once more, on a connection of its own

    def _collect(self, prep: keys.Prepared, proc: subprocess.Popen[bytes] | openssh_mux.MuxSession, command: str,
                 marker: str, start: float,
                 limit: float, payload: bytes | None, out: _Collector | _Stream | _Lines, fresh: bool,
                 big_pipe: bool, err_lines: _Lines | None = None) -> Result | None:
        """Feed and read one ssh (started by _run, or at dfo's start-up) until it ends: its Result; None when
        the shared master failed before the session opened (the caller makes the call again, fresh). A stdin
        pipe with no ``payload`` is held open until the call ends (run_lines), then closed."""
        assert proc.stdout is not None and proc.stderr is not None
        with self._lock:
            self._running.add(proc)
        if payload is not None:
            assert proc.stdin is not None
            threading.Thread(target=_feed, args=(proc.stdin, payload), daemon=True,
                             name=f"dfo-stdin-{self.name}").start()
        held = proc.stdin if payload is None else None
        err = Marks(marker, err_lines)
        clock = CallClock(self.name, self.host.start_timeout, limit, start)
        ofd, efd = proc.stdout.fileno(), proc.stderr.fileno()
        if big_pipe:
            _grow_pipe(ofd)
        bufsize = PIPE_BIG if big_pipe else 65536
        open_fds = {ofd, efd}
        sel = Selector()  # poll(2): a descriptor past 1023 is no trouble (select(2) fails there)
        for fd in open_fds:
            sel.register(fd, selectors.EVENT_READ)
        got_output = False
        ended: float | None = None  # when the command's shell ended (marker) or ssh exited
        try:
            while True:
                now = time.monotonic()
                clock.check(err.started, now)  # NotStarted before the node's side began, CallTimeout after
                wait = min(SLICE_S, max(0.01, clock.left(now)))
                ready = [key.fd for key, _ in sel.select(wait)] if open_fds else []
                if not open_fds:  # ssh closed both pipes: it exits a moment later (no fixed sleep here)
                    _wait_exit(proc, wait)
                got = False
                for fd in ready:
                    chunk = os.read(fd, bufsize)
                    if not chunk:
                        open_fds.discard(fd)
                        sel.unregister(fd)
                    elif fd == ofd:
                        out.feed(chunk)
                        got = got_output = True
                    else:
                        err.feed(chunk)
                        got = True
                exited = proc.poll() is not None
                if ended is None and (err.code is not None or exited):
                    ended = time.monotonic()
                if ended is None:
                    continue
                if ofd not in open_fds and exited:
                    break  # everything ssh wrote is read (stderr is drained below)
                if got:
                    ended = time.monotonic()
                elif time.monotonic() - ended > AFTER_EXIT_S:
                    break  # a process the command left behind holds the output open
        except BaseException:
            stop(proc)
            raise
        finally:
            sel.close()
            if proc.poll() is None:
                stop(proc)
            try:
                _drain(efd, open_fds, err)  # (what run_lines' on_err raises here still leaves nothing open)
            finally:
                for f in (proc.stdout, proc.stderr, held):
                    if f is not None:
                        try:
                            f.close()
                        except OSError:
                            pass
                with self._lock:
                    self._running.discard(proc)
                    closed = proc in self._closed
                    self._closed.discard(proc)
        out.flush()
        keys.merge_new_keys(self.host, prep)
        code = proc.returncode if proc.returncode is not None else 255
        if closed and err.code is None:
            raise ConnectionLost("connection lost: the connection was closed while a command ran", host=self.name,
                                 hint=LOST_HINT)
        if err.code is not None:
            if not self._remembered and not fresh and prep.own_control and prep.control is not None:
                self._remembered = True  # the connection works: how it was started, for the next command
                openssh_early.remember(self.name, prep.folder, prep.text, str(prep.control), self.host.ssh_persist,
                                       self._argv(prep, "", False, make=False)[:-1], keys.watched(self.host, prep))
            return Result(self.name, command, out.text(), err.text(), err.code, time.monotonic() - start)
        text = err.text()
        if code != 255:
            return Result(self.name, command, out.text(), text, code, time.monotonic() - start, started=err.started)
        if not fresh and not got_output and (mux_failed_before_session(text) or self._hop_unseen(text)):
            return None
        raise classify(self.host, prep, text)


    def _hop_unseen(self, text: str) -> bool:
        """The path through a jump host failed before the target's ssh session began, and ssh said no
        more: with ControlPersist, ssh sends its ProxyCommand's stderr (the jump's own ssh, which says
        why: a changed key, a refused login) to /dev/null. Made again without sharing, it says why."""
        return bool(self.host.proxy_jump or self.host.proxy_command) and (
            "kex_exchange_identification" in text or "Connection closed by UNKNOWN" in text)


class _Warm:
    """warm()'s call, started at once: its thread, and the error it met (raised by the first call that
    waited for it)."""

    def __init__(self, name: str, target: Callable[[_Warm], None]) -> None:
        self.error: DfoError | None = None
        self.thread = threading.Thread(target=target, args=(self,), daemon=True, name=f"dfo-warm-{name}")
        self.thread.start()


def _verbose(text: str) -> None:
    if os.environ.get("DFO_VERBOSE"):
        sys.stderr.write(text)


def _grow_pipe(fd: int) -> None:
    """A bigger pipe for ssh's stdout (Linux: F_SETPIPE_SZ; /proc/sys/fs/pipe-max-size caps it): run_stream
    reads it in larger pieces. Elsewhere, or refused, the pipe stays as it is."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import fcntl
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BIG)
    except OSError:
        pass


def _feed(pipe: object, data: bytes) -> None:
    try:
        view = memoryview(data)
        for i in range(0, len(view), 1 << 20):
            pipe.write(view[i:i + (1 << 20)])  # type: ignore[attr-defined]
    except (BrokenPipeError, ValueError, OSError):
        pass
    try:
        pipe.close()  # type: ignore[attr-defined]
    except (BrokenPipeError, ValueError, OSError):
        pass


def _wait_exit(proc: subprocess.Popen[bytes] | openssh_mux.MuxSession, seconds: float) -> None:
    """Wait until ``proc`` exits, at most ``seconds`` (Popen.wait polls from 0.5 ms up)."""
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass


def _drain(fd: int, open_fds: set[int], err: Marks) -> None:
    """What ssh wrote on stderr before it ended (a child of ssh, a ProxyCommand, may hold the pipe open)."""
    if fd not in open_fds:
        return
    with Selector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while sel.select(0.05):
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            err.feed(chunk)


__all__ = ["LOST_HINT", "OpenSSH"]
