"""SSH to a node, through fabric (on paramiko), with dfo's host-key policy on every hop.

All SSH options live here, in one commented place:

* one connection per host per dfo command, reused for every remote call (``Connection``);
* the connection is a ``fabric.Connection``; ssh_config is fabric's loading
  (resolve.ssh_configuration: $DFO_SSH_CONFIG, else ~/.ssh/config and /etc/ssh/ssh_config). The
  target's HostName/Port/User/IdentityFile are resolved by resolve.resolve_host (the inventory's
  own values win over ssh_config, which wins over the inventory's defaults);
* ProxyJump ``a,b`` (inventory or ssh_config) goes through a, then b, as OpenSSH does: a chain of
  fabric gateway Connections (``_Hop``), each hop resolved through ssh_config (its HostName, Port,
  User, IdentityFile, and its own ProxyJump/ProxyCommand for the first hop). fabric's own
  ProxyJump chain is not used: it builds the hops in reverse order (a 2-hop path fails) and gives
  them AutoAddPolicy. ProxyCommand (ssh_config) runs through ``sh -c``, as OpenSSH runs it;
* host keys: EVERY hop's client is made by hostkeys.new_client (dfo's own known_hosts,
  accept-new under a lock, a changed or @revoked key refused before any command runs:
  ``HostKeyError``, exit 4, naming the hop). Never ``AutoAddPolicy``;
* connect timeout (inventory ``defaults.connect_timeout``) for TCP, banner, auth and each hop's
  forwarding channel;
* liveness on every call (orchestrator.transport.liveness): a keepalive that wants an answer every 5 s; none
  for 20 s and the link counts as dead: the call in flight raises ConnectionLost (exit 4), a long
  silent command on a live link runs on. A dead hop shows as a dead target link. The environment's
  DFO_ALIVE_INTERVAL_S and DFO_ALIVE_DEAD_S change the 5 and the 20 (the tests use a few seconds);
* an explicit timeout on every call (``run(..., timeout=)``), and before it the host's start_timeout: sh's
  start marker on stderr must come within it (a node that takes the channel and hangs in its login:
  NotStarted, exit 4; base.CallClock); Ctrl-C leaves at once (the loop waits in 0.25 s slices, with
  poll(2) on the channel, never select(2), which fails past descriptor 1023);
* commands run on a paramiko channel of fabric's transport, with dfo's own loop (streaming
  on_line, bounded stdout and stderr; ``run_stream``: binary stdout to the caller's on_data), not
  invoke's runners. Output is read to the channel's EOF
  (sshd sends the exit status first; the output's tail may follow it), or AFTER_EXIT_S without a
  byte after the exit status when a process the command left behind holds its output open;
* remote environment is never passed with ``setenv`` (sshd's AcceptEnv would drop it);
  secrets travel on stdin only.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import selectors
import shlex
import threading
import time
from collections.abc import Callable
from typing import Any

import fabric
import paramiko

from ..config.inventory import ResolvedHost
from ..errors import AuthFailed, ConnectionLost, DfoError, HostError
from .base import (
    CALLS,
    STREAM_PIECE,
    CallClock,
    Marks,
    Result,
    Selector,
    Transport,
    _Collector,
    _Stream,
    raise_if_resource,
    sh_command,
)
from .hostkeys import fingerprint, host_key_error, label, new_client
from .liveness import Liveness
from .liveness import bounds as liveness_bounds
from .resolve import ssh_configuration

__all__ = ["LOST_HINT", "Connection", "Result", "Transport", "_Collector", "fingerprint"]

LOST_HINT = ("once the node answers again, run the same command again "
             "(provision, stage-model and sync-data resume where they stopped)")
AFTER_EXIT_S = 2.0  # after the exit status, output is read to EOF, or until this long without a byte
MAX_HOPS = 8  # a longer ProxyJump chain is a loop in ssh_config (Host * ProxyJump ...)
SEND_AFTER_START = 1 << 20  # stdin past this (under sshd's 2 MiB channel window) is sent once the node's side started

# paramiko logs its own tracebacks (banner errors, refused channels) to stderr; dfo reports those
# failures itself, in one or two lines. DFO_DEBUG=1 shows paramiko's log again.
if not os.environ.get("DFO_DEBUG"):
    _plog = logging.getLogger("paramiko")
    _plog.addHandler(logging.NullHandler())
    _plog.propagate = False


def _close_quietly(chan: paramiko.Channel) -> None:
    """Close a channel whose transport may be dying under it (paramiko raises EOFError then)."""
    try:
        chan.close()
    except (paramiko.SSHException, OSError, EOFError):
        pass


def _jump_chain(spec: str, config: Any, host: ResolvedHost, depth: int) -> _Hop | None:
    """The gateway for ``ProxyJump spec``: the LAST hop, whose gateway is the one before, and so on
    (``a,b``: the controller reaches a, a reaches b, b reaches the target)."""
    hops = [h.strip() for h in spec.split(",") if h.strip()]
    if depth + len(hops) > MAX_HOPS:
        raise HostError(f"ProxyJump path longer than {MAX_HOPS} hops ({spec})", host=host.name,
                        hint="is there a loop in ~/.ssh/config (a Host * with ProxyJump that matches the jump host)?")
    prev: _Hop | None = None
    for n, hop in enumerate(hops):
        prev = _Hop(hop, host=host, config=config, gateway=prev, depth=depth + n + 1)
    return prev


class _Hop(fabric.Connection):
    """A fabric Connection (the target, or one hop of its ProxyJump path) whose client is dfo's
    (hostkeys.new_client, made for its own known_hosts name), with dfo's timeouts, and errors that
    name the hop."""

    # real attributes, not config keys (fabric's DataProxy): set before fabric's __init__ runs
    _dfo_host: ResolvedHost | None = None
    _dfo_depth = 0

    def __init__(self, spec: str, *, host: ResolvedHost, config: Any, gateway: Any = None,
                 user: str | None = None, port: int | None = None, depth: int = 0) -> None:
        object.__setattr__(self, "_dfo_host", host)
        object.__setattr__(self, "_dfo_depth", depth)
        t = host.connect_timeout
        if user is None and depth:  # a hop without a user of its own: the target's user, as dfo always did
            short = self.derive_shorthand(spec)
            if short["user"] is None and "user" not in config.base_ssh_config.lookup(short["host"]):
                user = host.user
        super().__init__(spec, user=user, port=port, config=config, gateway=gateway, connect_kwargs={
            "key_filename": list(host.identities), "look_for_keys": not host.identities, "allow_agent": True,
            "banner_timeout": t, "auth_timeout": t, "channel_timeout": t})
        self.connect_timeout = t  # fabric rounds its own down to whole seconds
        self.client = new_client(host, self.label)

    @property
    def label(self) -> str:
        return label(self.host, self.port)

    def get_gateway(self) -> Any:
        """This host's own ProxyJump/ProxyCommand from ssh_config (only asked for the first hop, or a
        target without an inventory proxy): OpenSSH's order, dfo's hops."""
        own = self.ssh_config.get("proxyjump")
        if own and own.strip().lower() != "none":
            names = {self.derive_shorthand(h.strip())["host"] for h in own.split(",")}
            if names & {self.host, self.original_host}:
                return False  # Host * ProxyJump x, matched by x itself
            return _jump_chain(own, self.config, self._dfo_host, self._dfo_depth)  # type: ignore[arg-type]
        command = self.ssh_config.get("proxycommand")
        if command and command.strip().lower() != "none":
            return command
        return False

    def open_gateway(self) -> Any:
        h = self._dfo_host
        assert h is not None
        if isinstance(self.gateway, str):  # ProxyCommand, its %h/%p/%r already expanded by ssh_config
            try:
                return paramiko.ProxyCommand(f"/bin/sh -c {shlex.quote('exec ' + self.gateway)}")
            except (paramiko.SSHException, OSError) as exc:
                raise HostError(f"ProxyCommand for {self.label} did not start: {exc}", host=h.name,
                                hint="check ProxyCommand in ~/.ssh/config") from None
        self.gateway.open()
        try:
            return self.gateway.transport.open_channel(
                "direct-tcpip", (self.host, int(self.port)), ("", 0), timeout=h.connect_timeout)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise HostError(f"jump host {self.gateway.label} could not reach {self.host}:{self.port}: {exc}",
                            host=h.name,
                            hint="is the target up, and does the jump host allow TCP forwarding "
                                 "(AllowTcpForwarding)?") from None

    def open(self) -> Any:
        """Connect (through the gateway first); every failure is a one-line HostError naming this hop."""
        h, name = self._dfo_host, self.label
        assert h is not None
        try:
            return super().open()
        except DfoError:
            raise
        except paramiko.BadHostKeyException as exc:
            raise host_key_error(h, exc, name) from None
        except paramiko.AuthenticationException as exc:
            raise _auth_failed(h, f"{self.user or '(default user)'}@{name}", exc) from None
        except TimeoutError:
            raise HostError(f"{name} did not answer within {h.connect_timeout:g}s", host=h.name,
                            hint="is the node up and the port right? "
                                 "(defaults.connect_timeout sets the limit)") from None
        except paramiko.ssh_exception.NoValidConnectionsError as exc:
            if any(getattr(e, "errno", None) == errno.EHOSTUNREACH for e in exc.errors.values()):
                raise HostError(f"{name} is unreachable (no route to host)", host=h.name,
                                hint="is the node up and its address right? (a link that just came back can "
                                     "take a few seconds)") from None
            raise HostError(f"{name} refused the connection", host=h.name,
                            hint="is sshd running there, and is the port right "
                                 "(inventory port / ~/.ssh/config Port)?") from None
        except paramiko.SSHException as exc:
            if str(exc) in ("No authentication methods available", "No existing session"):
                raise _auth_failed(h, f"{self.user or '(default user)'}@{name}", exc) from None
            raise HostError(f"cannot connect to {name}: {exc}", host=h.name) from None
        except (OSError, EOFError) as exc:
            raise_if_resource(exc, h.name)  # out of descriptors or memory here, not the node's doing
            raise HostError(f"cannot connect to {name}: {exc}", host=h.name) from None

    def close_path(self) -> None:
        """Close this client and every hop's behind it (a gateway's ProxyCommand ends with its transport)."""
        c: Any = self
        while isinstance(c, fabric.Connection):
            try:
                c.client.close()
            except Exception:  # noqa: BLE001 - closing a dead link
                pass
            c = c.gateway


def _encrypted_key(paths: list[str]) -> str | None:
    """The first of ``paths`` that is a private key encrypted with a passphrase, else None."""
    for path in paths:
        try:
            paramiko.PKey.from_path(path)
        except paramiko.PasswordRequiredException:
            return path
        except TypeError as exc:  # cryptography's word for an OpenSSH-format key with a passphrase
            if "password" in str(exc).lower():
                return path
        except Exception:  # noqa: BLE001 - unreadable, not a key, a type paramiko lacks: not this case
            continue
    return None


def _agent_keys() -> int:
    try:
        return len(paramiko.Agent().get_keys())
    except Exception:  # noqa: BLE001 - no agent, or one that does not answer
        return 0


def _auth_failed(h: ResolvedHost, who: str, exc: Exception) -> AuthFailed:
    """The login was refused: why, in errors.AUTH_HINTS' terms (the same table as the OpenSSH transport's).
    paramiko says "No authentication methods available" when it had no key to offer, and "No existing
    session" when sshd hung up in the middle (MaxAuthTries: too many keys offered)."""
    text = str(exc) or type(exc).__name__
    encrypted = isinstance(exc, paramiko.PasswordRequiredException)
    key = _encrypted_key(h.identities) if encrypted or text == "No authentication methods available" else None
    if encrypted or key:
        reason = "encrypted_key"
    elif text == "No authentication methods available":
        reason = "no_key"
    elif text == "No existing session" and len(h.identities) + _agent_keys() > 1:
        reason, text = "too_many_keys", "the node closed the session after too many keys were offered"
    else:
        reason = "refused"
    return AuthFailed(f"authentication failed for {who}: {text}", reason=reason, host=h.name, key=key)


class Connection(Transport):
    """One SSH connection to one host, opened lazily and reused for every call."""

    def __init__(self, host: ResolvedHost) -> None:
        self.host = host
        self.name = host.name
        self._fab: _Hop | None = None
        self._alive: Liveness | None = None
        self._lost_why: str | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- connect
    def _target(self) -> _Hop:
        """The fabric Connection to the target: its address, port and user as resolved (the inventory
        wins), its gateway from the inventory's proxy_jump or ssh_config's ProxyJump/ProxyCommand."""
        h = self.host
        config = ssh_configuration(h.ssh_config)  # shared, read-only (fabric's clone() would re-read the files)
        gateway: Any = False
        if h.proxy_jump:
            gateway = _jump_chain(h.proxy_jump, config, h, 0) or False
        elif h.proxy_command:
            gateway = h.proxy_command
        # the target itself is not looked up in ssh_config again (resolve.resolve_host did that)
        bare = fabric.Config(ssh_config=paramiko.SSHConfig(), lazy=True)
        return _Hop(h.hostname, host=h, config=bare, gateway=gateway, user=h.user, port=h.port)

    def establish(self) -> None:
        self.connect()

    def connect(self) -> paramiko.SSHClient:
        with self._lock:
            if self._fab is not None:
                if self._fab.is_connected:
                    return self._fab.client
                self._close_locked()
            alive = liveness_bounds()  # a bad DFO_ALIVE_* is exit 2 before any connection opens
            fab = self._target()
            try:
                fab.open()
            except BaseException:
                fab.close_path()
                raise
            self._fab = fab
            self._lost_why = None
            self._alive = Liveness(fab.transport, self._dead_link(fab), self.name, alive)
            return fab.client

    def _dead_link(self, fab: _Hop) -> Callable[[str], None]:
        """What the liveness watch does on a dead link: close this connection's path (not under
        self._lock: a connect() elsewhere may hold it), which ends the call in flight at once."""

        def on_dead(why: str) -> None:
            self._lost_why = why
            fab.close_path()

        return on_dead

    def _lost(self, detail: str) -> ConnectionLost:
        """The error for a connection that died under a call (exit 4), closing what is left of it."""
        why = self._lost_why or detail
        self.close()
        return ConnectionLost(f"connection lost: {why}", host=self.name, hint=LOST_HINT)

    def _close_locked(self) -> None:
        if self._alive is not None:
            self._alive.stop()
            self._alive = None
        if self._fab is not None:
            self._fab.close_path()
        self._fab = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def reconnect(self) -> None:
        self.close()
        self.connect()

    # ---------------------------------------------------------------- run
    def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        on_line: Callable[[str], object] | None = None,
    ) -> Result:
        """Run ``command`` (a shell string, built with shlex.quote) and wait, at most ``timeout`` s."""
        return self._run(command, timeout, stdin, _Collector(on_line, host=self.name))

    def run_stream(self, command: str, *, on_data: Callable[[bytes], object], timeout: float | None = None,
                   stdin: bytes | str | None = None) -> Result:
        """``run`` with stdout in pieces to ``on_data`` (Transport.run_stream)."""
        return self._run(command, timeout, stdin, _Stream(on_data), bufsize=STREAM_PIECE)

    def _run(self, command: str, timeout: float | None, stdin: bytes | str | None, out: _Collector | _Stream,
             bufsize: int = 65536) -> Result:
        limit = timeout if timeout is not None else self.host.command_timeout
        client = self.connect()
        transport = client.get_transport()
        if transport is None:
            raise self._lost("the connection closed before the command started")
        with CALLS.slot():  # a turn, where the open-file limit cannot hold every host's call at once
            return self._call(transport, command, limit, stdin, out, bufsize)

    def _call(self, transport: paramiko.Transport, command: str, limit: float, stdin: bytes | str | None,
              out: _Collector | _Stream, bufsize: int) -> Result:
        """One command on a new channel: its node side starts within the host's start_timeout (sh's start marker
        on stderr, base.CallClock), then it ends within ``limit`` s."""
        start = time.monotonic()
        marker = secrets.token_hex(8)
        try:
            chan = transport.open_session(timeout=self.host.connect_timeout)
            chan.exec_command(sh_command(command, start_marker=marker))  # under sh, whatever the login shell is
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise_if_resource(exc, self.name)
            raise self._lost(str(exc)) from None
        err = Marks(marker)
        clock = CallClock(self.name, self.host.start_timeout, limit, start)
        sel = Selector()  # poll(2) on the channel's pipe: a descriptor past 1023 is no trouble
        try:
            sel.register(chan, selectors.EVENT_READ)
            payload = stdin.encode() if isinstance(stdin, str) else stdin
            if payload is not None and len(payload) > SEND_AFTER_START:
                # more than the node's window takes unread: sendall would wait on a node whose side never
                # started past start_timeout, so that start is waited for first
                while not err.started and not chan.closed and transport.is_active():
                    clock.check(False, time.monotonic())
                    sel.select(min(0.25, max(0.01, clock.left(time.monotonic()))))
                    while chan.recv_ready():
                        out.feed(chan.recv(bufsize))
                    while chan.recv_stderr_ready():
                        err.feed(chan.recv_stderr(65536))
            self._send(chan, transport, payload, limit)
            code = self._collect(chan, transport, clock, out, err, bufsize, sel)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if exc is out.raised:  # the caller's on_line failed here (an OSError on this machine): not the link
                raise
            raise self._lost(str(exc)) from None
        finally:
            sel.close()
            _close_quietly(chan)
        out.flush()
        return Result(self.name, command, out.text(), err.text(), code, time.monotonic() - start)

    def _send(self, chan: paramiko.Channel, transport: paramiko.Transport, payload: bytes | None, limit: float) -> None:
        try:
            chan.settimeout(max(limit, 1.0))  # a command that never reads its stdin cannot hold sendall past limit
            if payload is not None:
                # a memoryview: paramiko's sendall slices what is left after every packet, which
                # copies a bytes payload again each time (quadratic: 43 MB took 25 s, now 0.9 s)
                chan.sendall(memoryview(payload))  # type: ignore[arg-type]  # paramiko takes any buffer; its stubs say bytes
            chan.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if not transport.is_active():
                _close_quietly(chan)
                raise self._lost(str(exc)) from None
            # the command ended (its channel closed) before it read all of its stdin: no lost link;
            # its output and exit code, collected below, say what happened

    def _collect(self, chan: paramiko.Channel, transport: paramiko.Transport, clock: CallClock,
                 out: _Collector | _Stream, err: Marks, bufsize: int, sel: selectors.BaseSelector) -> int:
        """Read the channel to its end (``sel`` waits on it): the command's exit status."""
        exited: float | None = None  # when the exit status was seen (then again at each byte after it)
        while True:
            now = time.monotonic()
            clock.check(err.started, now)  # NotStarted before the node's side began, CallTimeout after
            sel.select(min(0.25, max(0.01, clock.left(now))))
            got = False
            while chan.recv_ready():
                out.feed(chan.recv(bufsize))
                got = True
            while chan.recv_stderr_ready():
                err.feed(chan.recv_stderr(65536))
                got = True
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                # sshd sends the exit status when the shell exits; output still in flight follows
                # it, up to the channel's EOF. Read on to that EOF, or AFTER_EXIT_S without a byte
                # (a process the command left behind holds the output open)
                now = time.monotonic()
                if chan.eof_received or chan.closed:
                    break
                if got or exited is None:
                    exited = now
                elif now - exited > AFTER_EXIT_S:
                    break
            if not got and (chan.closed or not transport.is_active()):
                if not transport.is_active():
                    raise self._lost("the connection closed while a command ran")
                break
        code = chan.recv_exit_status()
        if code == -1 and not transport.is_active():
            # a channel closed by a dead link reports "exit status ready" with no status
            raise self._lost("the connection closed while a command ran")
        return code
