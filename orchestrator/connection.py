"""The only module that imports paramiko: SSH (and a local transport) with checked host keys.

All SSH options live here, in one commented place:

* one connection per host per dfo command, reused for every remote call (``Connection``);
* connect timeout (inventory ``defaults.connect_timeout``) for TCP, banner and auth;
* liveness on every call (orchestrator.liveness): a keepalive that wants an answer every 5 s; none
  for 20 s and the link counts as dead: the call in flight raises HostError (exit 4), a long
  silent command on a live link runs on;
* an explicit timeout on every call (``run(..., timeout=)``);
* host keys: dfo keeps its own known_hosts. An unknown key is recorded on first contact
  (OpenSSH's ``StrictHostKeyChecking=accept-new``); a changed key is refused before any
  command runs (``HostKeyError``, exit 4) with both fingerprints and the command that forgets
  the old key. Never ``AutoAddPolicy`` for known hosts, never ``StrictHostKeyChecking=no``.
  The file is read strictly and only ever appended to (orchestrator.known_hosts): a line dfo
  cannot read is exit 2 naming FILE:LINE; ``@revoked`` keys are refused (exit 4);
  ``@cert-authority`` lines, comments and other key types are kept and play no part.
* ProxyJump (one hop, from the inventory or ~/.ssh/config) through a direct-tcpip channel;
  the jump host's key is checked against the same known_hosts.
* Remote environment is never passed with ``setenv`` (sshd's AcceptEnv would drop it);
  secrets travel on stdin only.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import logging
import os
import select
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import paramiko

from . import known_hosts
from .config import ResolvedHost
from .errors import DfoError, HostError, HostKeyError
from .known_hosts import Entry, KnownHosts
from .liveness import Liveness
from .localenv import local_env

_KH_LOCK = threading.Lock()

LOST_HINT = ("once the node answers again, run the same command again "
             "(provision, stage-model and sync-data resume where they stopped)")

# paramiko logs its own tracebacks (banner errors, refused channels) to stderr; dfo reports those
# failures itself, in one or two lines. DFO_DEBUG=1 shows paramiko's log again.
if not os.environ.get("DFO_DEBUG"):
    _plog = logging.getLogger("paramiko")
    _plog.addHandler(logging.NullHandler())
    _plog.propagate = False


@dataclass
class Result:
    """What a remote command did (Fabric-style: command, stdout, stderr, exit code)."""

    host: str
    command: str
    stdout: str
    stderr: str
    exit_code: int
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Called for a key of a type paramiko has no recorded key of for this host name (see
    Connection._open, which feeds paramiko the host's plain, unrevoked keys from dfo's known_hosts).
    Under a lock (a thread lock, and flock on a lock file beside known_hosts for other dfo
    processes) it re-reads the file: a @revoked key is refused; a key recorded meanwhile by another
    connection or process must be this one; a new key is appended (accept-new), never rewriting
    the file."""

    def __init__(self, host: ResolvedHost) -> None:
        self.host = host

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        import fcntl

        p = Path(self.host.known_hosts)
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        blob = key.asbytes()
        with _KH_LOCK, open(p.with_name(p.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            kh = KnownHosts.load(str(p))
            revoked = kh.revoked(blob)
            if revoked is not None:
                raise _revoked_error(self.host, hostname, key, revoked)
            same = [e for e in kh.recorded(hostname) if e.key_type == key.get_name()]
            if not same:
                known_hosts.append(str(p), hostname, key.get_name(), blob)
            elif all(e.blob != blob for e in same):
                raise paramiko.BadHostKeyException(hostname, key, _pkey(same[0]) or key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def _pkey(e: Entry) -> paramiko.PKey | None:
    """The paramiko key of a known_hosts line, or None for a type paramiko does not know (sk-*, ...)."""
    try:
        return paramiko.PKey.from_type_string(e.key_type, e.blob)
    except (paramiko.pkey.UnknownKeyType, paramiko.SSHException, ValueError, TypeError):
        return None


def _revoked_error(host: ResolvedHost, label: str, key: paramiko.PKey, line: Entry) -> HostKeyError:
    return HostKeyError(
        f"host key for {label} is REVOKED ({host.known_hosts}:{line.lineno}): {fingerprint(key)} "
        f"({key.get_name()}); nothing was run",
        host=host.name,
        hint="a @revoked key is never accepted; check the node's real key out of band (is it compromised, "
             "or was it rebuilt?)",
    )


def _host_key_error(host: ResolvedHost, exc: paramiko.BadHostKeyException, label: str) -> HostKeyError:
    kh = KnownHosts.load(host.known_hosts)
    offered = exc.key.asbytes()
    revoked = kh.revoked(offered)
    if revoked is not None:
        return _revoked_error(host, label, exc.key, revoked)
    same = [e for e in kh.recorded(label) if e.key_type == exc.key.get_name()]
    where = f" ({host.known_hosts}:{same[0].lineno})" if same else ""
    if any(e.blob == offered for e in same[1:]):
        return HostKeyError(
            f"host key for {label}: {len(same)} {exc.key.get_name()} keys are recorded for it and the first"
            f"{where} is not the one offered; nothing was run",
            host=host.name, hint="dfo checks one key per host and key type: delete the stale line")
    forget = f"ssh-keygen -R {shlex.quote(label)} -f {shlex.quote(host.known_hosts)}"
    return HostKeyError(
        f"host key for {label} CHANGED: recorded {fingerprint(exc.expected_key)}{where}, "
        f"offered {fingerprint(exc.key)} ({exc.key.get_name()}); nothing was run",
        host=host.name,
        hint=f"if the node was really rebuilt, forget the old key with: {forget}",
    )


def _close_quietly(chan: paramiko.Channel) -> None:
    """Close a channel whose transport may be dying under it (paramiko raises EOFError then)."""
    try:
        chan.close()
    except (paramiko.SSHException, OSError, EOFError):
        pass


class Connection:
    """One SSH connection to one host, opened lazily and reused for every call."""

    def __init__(self, host: ResolvedHost) -> None:
        self.host = host
        self.name = host.name
        self._client: paramiko.SSHClient | None = None
        self._jump: paramiko.SSHClient | None = None
        self._alive: Liveness | None = None
        self._lost_why: str | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- connect
    def _new_client(self, label: str) -> paramiko.SSHClient:
        """A client that knows this host's recorded keys (read strictly from dfo's known_hosts: a line it
        cannot read is exit 2, never skipped) and records a new one on first contact (_AcceptNew)."""
        client = paramiko.SSHClient()
        keys = client.get_host_keys()
        types: set[str] = set()
        for e in KnownHosts.load(self.host.known_hosts).recorded(label):
            key = _pkey(e)
            if key is not None and e.key_type not in types:  # the first line per key type counts
                types.add(e.key_type)
                keys.add(label, e.key_type, key)
        client.set_missing_host_key_policy(_AcceptNew(self.host))
        return client

    def _open(self, hostname: str, port: int, user: str | None, sock: object | None) -> paramiko.SSHClient:
        h = self.host
        label = hostname if port == 22 else f"[{hostname}]:{port}"
        client = self._new_client(label)
        try:
            client.connect(
                hostname,
                port=port,
                username=user,
                key_filename=h.identities or None,
                look_for_keys=not h.identities,
                allow_agent=True,
                timeout=h.connect_timeout,
                banner_timeout=h.connect_timeout,
                auth_timeout=h.connect_timeout,
                channel_timeout=h.connect_timeout,
                sock=sock,  # type: ignore[arg-type]
            )
        except DfoError:
            client.close()
            raise
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise _host_key_error(h, exc, label) from None
        except paramiko.AuthenticationException as exc:
            client.close()
            raise HostError(
                f"authentication failed for {user or '(default user)'}@{label}: {exc}",
                host=h.name,
                hint="check user and identity in the inventory (or ~/.ssh/config)",
            ) from None
        except TimeoutError:
            client.close()
            raise HostError(
                f"{label} did not answer within {h.connect_timeout:g}s",
                host=h.name,
                hint="is the node up and the port right? (defaults.connect_timeout sets the limit)",
            ) from None
        except paramiko.ssh_exception.NoValidConnectionsError as exc:
            client.close()
            if any(getattr(e, "errno", None) == errno.EHOSTUNREACH for e in exc.errors.values()):
                raise HostError(f"{label} is unreachable (no route to host)", host=h.name,
                                hint="is the node up and its address right? (a link that just came back can "
                                     "take a few seconds)") from None
            raise HostError(f"{label} refused the connection", host=h.name,
                            hint="is sshd running there, and is the port right (inventory port / ~/.ssh/config Port)?") from None
        except (OSError, paramiko.SSHException, EOFError) as exc:
            client.close()
            raise HostError(f"cannot connect to {label}: {exc}", host=h.name) from None
        return client

    def _jump_sock(self) -> paramiko.Channel | None:
        spec = self.host.proxy_jump
        if not spec or spec.lower() == "none":
            return None
        spec = spec.split(",")[0]
        user, _, rest = spec.rpartition("@")
        jhost, _, jport = rest.partition(":")
        from .config import _ssh_config_lookup

        sshc = _ssh_config_lookup(jhost)
        jhostname = str(sshc.get("hostname", jhost))
        port = int(jport or sshc.get("port", 22))  # type: ignore[arg-type]
        self._jump = self._open(jhostname, port, user or str(sshc.get("user", "")) or self.host.user, None)
        transport = self._jump.get_transport()
        assert transport is not None
        try:
            return transport.open_channel("direct-tcpip", (self.host.hostname, self.host.port), ("127.0.0.1", 0),
                                          timeout=self.host.connect_timeout)
        except (paramiko.SSHException, OSError) as exc:
            self._close_locked()
            raise HostError(f"jump host {jhostname}:{port} could not reach {self.host.hostname}:{self.host.port}: {exc}",
                            host=self.host.name,
                            hint="is the target up, and does the jump host allow TCP forwarding (AllowTcpForwarding)?") from None

    def connect(self) -> paramiko.SSHClient:
        with self._lock:
            if self._client is not None:
                t = self._client.get_transport()
                if t is not None and t.is_active():
                    return self._client
                self._close_locked()
            sock = self._jump_sock()
            try:
                self._client = self._open(self.host.hostname, self.host.port, self.host.user, sock)
            except BaseException:
                self._close_locked()
                raise
            transport = self._client.get_transport()
            assert transport is not None
            self._lost_why = None
            self._alive = Liveness(transport, self._dead_link(self._client, self._jump), self.name)
            return self._client

    def _dead_link(self, *clients: paramiko.SSHClient | None) -> Callable[[str], None]:
        """What the liveness watch does on a dead link: close this connection's clients (not under
        self._lock: a connect() elsewhere may hold it), which ends the call in flight at once."""

        def on_dead(why: str) -> None:
            self._lost_why = why
            for c in clients:
                if c is not None:
                    try:
                        c.close()
                    except Exception:  # noqa: BLE001 - closing a dead link
                        pass

        return on_dead

    def _lost(self, detail: str) -> HostError:
        """The error for a connection that died under a call (exit 4), closing what is left of it."""
        why = self._lost_why or detail
        self.close()
        return HostError(f"connection lost: {why}", host=self.name, hint=LOST_HINT)

    def _close_locked(self) -> None:
        if self._alive is not None:
            self._alive.stop()
            self._alive = None
        for c in (self._client, self._jump):
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - closing a dead link
                    pass
        self._client = self._jump = None

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
        on_line: Callable[[str], None] | None = None,
    ) -> Result:
        """Run ``command`` (a shell string, built with shlex.quote) and wait, at most ``timeout`` s."""
        limit = timeout if timeout is not None else self.host.command_timeout
        client = self.connect()
        transport = client.get_transport()
        assert transport is not None
        start = time.monotonic()
        try:
            chan = transport.open_session(timeout=self.host.connect_timeout)
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._lost(str(exc)) from None
        try:
            chan.settimeout(max(limit, 1.0))  # a command that never reads its stdin cannot hold sendall past limit
            if stdin is not None:
                chan.sendall(stdin.encode() if isinstance(stdin, str) else stdin)
            chan.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            if not transport.is_active():
                _close_quietly(chan)
                raise self._lost(str(exc)) from None
            # the command ended (its channel closed) before it read all of its stdin: no lost link;
            # its output and exit code, collected below, say what happened
        out, err = _Collector(on_line), bytearray()
        try:
            while True:
                if time.monotonic() - start > limit:
                    _close_quietly(chan)
                    raise HostError(
                        f"remote command did not finish within {limit:g}s",
                        host=self.name,
                        hint="the node may be overloaded or the link dead; retry, or raise the timeout",
                    )
                select.select([chan], [], [], 0.25)
                got = False
                while chan.recv_ready():
                    out.feed(chan.recv(65536))
                    got = True
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                    got = True
                if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if not got and (chan.closed or not transport.is_active()):
                    if not transport.is_active():
                        raise self._lost("the connection closed while a command ran")
                    break
            code = chan.recv_exit_status()
            if code == -1 and not transport.is_active():
                # a channel closed by a dead link reports "exit status ready" with no status
                raise self._lost("the connection closed while a command ran")
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._lost(str(exc)) from None
        finally:
            _close_quietly(chan)
        out.flush()
        return Result(self.name, command, out.text(), err.decode("utf-8", "replace"), code, time.monotonic() - start)


class _Collector:
    """Collects a command's stdout.

    Without ``on_line`` all of it is kept (``text()``). With ``on_line`` (streaming mode: framed
    remote modules) each complete line goes to the callback as it arrives, and memory stays bounded
    however long the stream: only the lines the callback returns True for are kept (the module's
    result frame), plus the last ``TAIL_BYTES`` of the rest, for error messages. A line without a
    newline longer than ``LINE_MAX`` (noise; frames are far shorter) goes to the callback in pieces.
    """

    TAIL_BYTES = 8192
    LINE_MAX = 32 << 20

    def __init__(self, on_line: Callable[[str], object] | None) -> None:
        self.buf = bytearray()  # everything; in streaming mode the tail of what was not kept
        self.kept: list[bytes] = []
        self.pending = bytearray()
        self.scanned = 0  # pending[:scanned] holds no newline
        self.on_line = on_line

    def feed(self, data: bytes) -> None:
        if self.on_line is None:
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
        if self.on_line(raw.decode("utf-8", "replace")):
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


class LocalConnection(Connection):
    """The same calls, run on this machine with bash (for running dfo on the GPU box itself)."""

    def connect(self) -> paramiko.SSHClient:  # type: ignore[override]
        raise RuntimeError("local transport has no SSH client")

    def close(self) -> None:
        pass

    def reconnect(self) -> None:
        pass

    def run(self, command: str, *, timeout: float | None = None, stdin: bytes | str | None = None,
            on_line: Callable[[str], None] | None = None) -> Result:
        limit = timeout if timeout is not None else self.host.command_timeout
        start = time.monotonic()
        proc = subprocess.Popen(["bash", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, env=local_env())
        out = _Collector(on_line)
        err = bytearray()

        def feed_stdin() -> None:
            try:
                if stdin is not None:
                    proc.stdin.write(stdin.encode() if isinstance(stdin, str) else stdin)  # type: ignore[union-attr]
            except BrokenPipeError:
                pass
            try:
                proc.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:
                pass

        def read_err() -> None:
            err.extend(proc.stderr.read())  # type: ignore[union-attr]

        threads = [threading.Thread(target=feed_stdin, daemon=True), threading.Thread(target=read_err, daemon=True)]
        for t in threads:
            t.start()
        fd = proc.stdout.fileno()  # type: ignore[union-attr]
        while True:
            remaining = limit - (time.monotonic() - start)
            if remaining <= 0:
                proc.kill()
                raise HostError(f"local command did not finish within {limit:g}s", host=self.name)
            r, _, _ = select.select([fd], [], [], min(remaining, 0.25))
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                out.feed(chunk)
        code = proc.wait()
        for t in threads:
            t.join(5)
        out.flush()
        return Result(self.name, command, out.text(), err.decode("utf-8", "replace"), code, time.monotonic() - start)


def open_connection(host: ResolvedHost) -> Connection:
    return LocalConnection(host) if host.transport == "local" else Connection(host)
