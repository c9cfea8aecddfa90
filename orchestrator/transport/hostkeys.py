"""dfo's host-key policy on a paramiko client: its own known_hosts, accept-new, a changed key refused.

Every client dfo opens (the target and each ProxyJump hop, see connection.py) is made by
``new_client``: it knows the host's recorded keys from dfo's known_hosts (read strictly, see
orchestrator.transport.known_hosts) and records a new one on first contact (OpenSSH's
``StrictHostKeyChecking=accept-new``) under a lock. A changed key is refused before any command
runs (``HostKeyError``, exit 4) with both fingerprints and the command that forgets the old key.
Never ``AutoAddPolicy`` for known hosts, never ``StrictHostKeyChecking=no``.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import paramiko

from ..config.inventory import ResolvedHost
from ..errors import HostKeyError
from . import known_hosts
from .known_hosts import Entry, KnownHosts

_KH_LOCK = known_hosts.KH_LOCK  # shared with the OpenSSH transport (openssh_keys.py)


def fingerprint(key: paramiko.PKey) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def label(hostname: str, port: int) -> str:
    """The host's name in known_hosts: ``host``, or ``[host]:port`` off port 22."""
    return hostname if int(port) == 22 else f"[{hostname}]:{port}"


class _AcceptNew(paramiko.MissingHostKeyPolicy):
    """Called for a key of a type paramiko has no recorded key of for this host name (see
    new_client, which feeds paramiko the host's plain, unrevoked keys from dfo's known_hosts).
    Under a lock (a thread lock, and flock on a lock file beside known_hosts for other dfo
    processes) it re-reads the file: a @revoked key is refused; a key recorded meanwhile by another
    connection or process must be this one; a new key is appended (accept-new), never rewriting
    the file."""

    def __init__(self, host: ResolvedHost) -> None:
        self.host = host

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        import fcntl

        if self.host.strict_host_keys:  # the user's StrictHostKeyChecking yes: their own files decide, never first use
            raise strict_error(self.host, hostname)
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
            ca = next((e for e in kh.entries if e.marker == "@cert-authority" and e.matches(hostname)), None)
            if not same and ca is not None:
                raise HostKeyError(
                    f"host key for {hostname}: a @cert-authority line covers it ({p}:{ca.lineno}), and the paramiko "
                    "transport does not verify host certificates; a plain key is never trusted on first use "
                    "there; nothing was run", host=self.host.name,
                    hint="use transport: openssh (OpenSSH verifies host certificates), or, if you trust the "
                         f"node's key, record it in {p} yourself")
            if not same:
                known_hosts.append(str(p), hostname, key.get_name(), blob)
                import sys

                sys.stderr.write(f"dfo: {self.host.name}: recorded host key {_kind(key.get_name())} "
                                 f"{fingerprint(key)} for {hostname} (in {p})\n")
            elif all(e.blob != blob for e in same):
                raise paramiko.BadHostKeyException(hostname, key, _pkey(same[0]) or key)
        client.get_host_keys().add(hostname, key.get_name(), key)


def strict_error(host: ResolvedHost, name: str) -> HostKeyError:
    """A host whose key is not in the user's known_hosts, where their ssh_config says StrictHostKeyChecking yes."""
    theirs = host.user_known_hosts[0] if host.user_known_hosts else "~/.ssh/known_hosts"
    return HostKeyError(
        f"host key for {name} is not in your known_hosts ({theirs}), and your ssh_config says StrictHostKeyChecking "
        "yes for it: dfo is never less strict than your ssh; nothing was run", host=host.name,
        hint=f"check the node's key out of band, then add it to {theirs} (`ssh-keyscan` prints it: compare its "
             "fingerprint first), or let dfo record it on first use: StrictHostKeyChecking accept-new for this host")


def _kind(key_type: str) -> str:
    from .openssh_keys import key_kind  # ssh-keygen's names (ED25519, RSA, ECDSA), as OpenSSH's transport says them

    return key_kind(key_type)


def new_client(host: ResolvedHost, name: str) -> paramiko.SSHClient:
    """A client for the host known as ``name`` in known_hosts (the target or a hop of its path) that
    knows its recorded keys (a line dfo cannot read is exit 2, never skipped) and records a new one
    on first contact (_AcceptNew)."""
    client = paramiko.SSHClient()
    keys = client.get_host_keys()
    types: set[str] = set()
    dfo = KnownHosts.load(host.known_hosts)
    mine = [] if host.strict_host_keys else dfo.recorded(name)  # strict: the user's files alone, as their ssh
    for e in mine + [e for _, e in _users(host, name, dfo)]:
        key = _pkey(e)
        if key is not None and e.key_type not in types:  # the first line per key type counts (dfo's first)
            types.add(e.key_type)
            keys.add(name, e.key_type, key)
    client.set_missing_host_key_policy(_AcceptNew(host))
    return client


def _users(host: ResolvedHost, name: str, dfo: KnownHosts) -> list[tuple[str, Entry]]:
    """(file, line) of the user's own known_hosts lines for ``name`` (ssh_config's UserKnownHostsFile):
    keys the user's ssh trusts are trusted, as on the OpenSSH transport; unreadable lines skipped, as ssh
    does; a key @revoked anywhere left out."""
    from .openssh_keys import _lenient

    out = [(f, e) for f in host.user_known_hosts for e in _lenient(f)]
    revoked = {e.blob for e in [*dfo.entries, *(e for _, e in out)] if e.marker == "@revoked"}
    return [(f, e) for f, e in out if e.marker is None and e.blob not in revoked and e.matches(name)]


def _pkey(e: Entry) -> paramiko.PKey | None:
    """The paramiko key of a known_hosts line, or None for a type paramiko does not know (sk-*, ...)."""
    try:
        return paramiko.PKey.from_type_string(e.key_type, e.blob)
    except (paramiko.pkey.UnknownKeyType, paramiko.SSHException, ValueError, TypeError):
        return None


def _revoked_error(host: ResolvedHost, name: str, key: paramiko.PKey, line: Entry) -> HostKeyError:
    return HostKeyError(
        f"host key for {name} is REVOKED ({host.known_hosts}:{line.lineno}): {fingerprint(key)} "
        f"({key.get_name()}); nothing was run",
        host=host.name,
        hint="a @revoked key is never accepted; check the node's real key out of band (is it compromised, "
             "or was it rebuilt?)",
    )


def host_key_error(host: ResolvedHost, exc: paramiko.BadHostKeyException, name: str) -> HostKeyError:
    """The error for a key that differs from the one recorded for ``name`` (a hop or the target)."""
    kh = KnownHosts.load(host.known_hosts)
    offered = exc.key.asbytes()
    revoked = kh.revoked(offered)
    if revoked is not None:
        return _revoked_error(host, name, exc.key, revoked)
    same = [e for e in kh.recorded(name) if e.key_type == exc.key.get_name()]
    where = f" ({host.known_hosts}:{same[0].lineno})" if same else ""
    if any(e.blob == offered for e in same[1:]):
        return HostKeyError(
            f"host key for {name}: {len(same)} {exc.key.get_name()} keys are recorded for it and the first"
            f"{where} is not the one offered; nothing was run",
            host=host.name, hint="dfo checks one key per host and key type: delete the stale line")
    # every file and line that holds an old key for it (dfo's file, then the user's), one ssh-keygen -R each
    old = [(f, e) for f, e in known_hosts.holding([host.known_hosts, *host.user_known_hosts], name)
           if e.key_type == exc.key.get_name() and e.blob != offered]
    if not old:
        old = [(host.known_hosts, e) for e in same[:1]]
    message, hint = known_hosts.changed(name, fingerprint(exc.key), exc.key.get_name(), old)
    return HostKeyError(message, host=host.name, hint=hint)
