"""Host keys on the OpenSSH transport: the same promises as the paramiko transport's (hostkeys.py).

* dfo's known_hosts is read strictly before ssh runs (known_hosts.KnownHosts: a damaged line is exit
  2, never skipped), and ssh looks keys up in, in order: this connection's own new-keys file, dfo's
  known_hosts, then the user's own files (ssh -G's UserKnownHostsFile), so a key the user's ssh
  already trusts is trusted, and a key found in none of them is new.
* A new key (accept-new) is written by ssh to the new-keys file, on every hop; ``merge_new_keys`` then
  appends it to dfo's known_hosts under the paramiko transport's locks (a thread lock and flock on
  known_hosts.lock): each key once however many dfo processes meet the host at the same time, a
  key that another process recorded differently meanwhile is a changed key (HostKeyError). Each
  recorded key is said on stderr.
* ``@cert-authority``: OpenSSH checks host certificates. Where a CA line (in dfo's file or the
  user's) covers a host, that host must show a certificate from it or a key recorded by hand:
  StrictHostKeyChecking yes for the target (-o) and for each hop so covered (a ``Host`` block of
  this connection's config). ``@revoked`` lines are honoured by ssh in every file.
* The user's ``StrictHostKeyChecking yes`` (read with ``ssh -G``, for the target and each ProxyJump hop)
  holds: that host's key must be in the user's own known_hosts files, as their ssh wants it (dfo's file
  and first use do not count there). Every other value (accept-new, ask, no, none set) keeps dfo's rule.
* A ControlPath of the user's that is too long for a unix socket (ssh adds 17 bytes while it makes one;
  104 bytes on macOS, 108 on Linux) is said once and passed over for dfo's own.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..config.inventory import ResolvedHost
from ..errors import ConfigError, HostKeyError
from . import known_hosts
from . import openssh_early as early_mod
from . import openssh_setup as setup
from .known_hosts import KH_LOCK as _KH_LOCK
from .known_hosts import Entry, KnownHosts, parse_line
from .openssh_early import Early

_TYPES = {"ssh-ed25519": "ED25519", "ssh-rsa": "RSA", "ssh-dss": "DSA", "sk-ssh-ed25519@openssh.com": "ED25519-SK",
          "sk-ecdsa-sha2-nistp256@openssh.com": "ECDSA-SK"}


def key_kind(key_type: str) -> str:
    """ssh-keygen's name for a key type: ED25519, RSA, ECDSA..."""
    return _TYPES.get(key_type) or ("ECDSA" if key_type.startswith("ecdsa-") else key_type.upper())


def fingerprint(blob: bytes) -> str:
    return known_hosts.fingerprint(blob)


@dataclass
class Prepared:
    """One OpenSSH connection's set-up (made once per transport, at its first call)."""

    ssh: str
    folder: Path  # this connection's own 0700 folder: its config and new-keys file
    config: Path
    new_keys: Path
    control: Path | None  # the ControlPath in use (dfo's or the user's), None: no sharing
    own_control: bool  # dfo's ControlPath (True) or the user's ssh_config's (False)
    target_strict: bool  # a @cert-authority line covers the target
    ca: list[tuple[str, Entry]] = field(default_factory=list)  # (file, line) of every CA line
    strict_hops: list[str] = field(default_factory=list)
    text: str = ""  # the config's text
    # (the name ssh gets, its known_hosts label, the user's files) of each hop, and the target, whose user's
    # ssh_config says StrictHostKeyChecking yes: its key must be in those files
    user_strict: list[tuple[str, str, list[str]]] = field(default_factory=list)
    made: bool = True  # the folder and its files are there (False: made by ready(), before an ssh client runs)

    def ready(self) -> Path:
        """The config's path, the folder made first where it is not yet: a call over a master (openssh_mux)
        starts no ssh client and needs no file of its own, so a warm command on a fleet writes none."""
        if not self.made:
            with _READY_LOCK:
                if not self.made:
                    early_mod.make_conn_folder(self.folder, self.text)
                    self.made = True
        return self.config


def _lenient(path: str) -> list[Entry]:
    """The lines of a known_hosts file that is not dfo's (the user's): unreadable lines skipped, as ssh does."""
    return known_hosts.lenient(path)


def _files(host: ResolvedHost, key: str) -> list[str]:
    return [f for v in host.ssh_resolved.get(key, []) for f in v.split() if f.lower() != "none"]


def watched(host: ResolvedHost, prep: Prepared) -> list[str]:
    """The files whose change must stop an early ssh (openssh_early): the ssh binary and every known_hosts
    file the connection's host-key policy is made from (dfo's, the user's, the system's)."""
    return [prep.ssh, host.known_hosts, *_files(host, "userknownhostsfile"), *_files(host, "globalknownhostsfile")]


def ca_lines(host: ResolvedHost, dfo: KnownHosts) -> list[tuple[str, Entry]]:
    out = [(host.known_hosts, e) for e in dfo.entries if e.marker == "@cert-authority"]
    for f in _files(host, "userknownhostsfile") + _files(host, "globalknownhostsfile"):
        out += [(f, e) for e in _lenient(f) if e.marker == "@cert-authority"]
    return out


def covering(ca: list[tuple[str, Entry]], hostname: str, port: int) -> tuple[str, Entry] | None:
    """The first CA line that covers this host (by name, or [name]:port), if any."""
    names = {hostname, setup.label(hostname, port)}
    return next(((f, e) for f, e in ca if any(e.matches(n) for n in names)), None)


def _hops(host: ResolvedHost, ssh: str, ca: list[tuple[str, Entry]]
          ) -> tuple[list[str], list[tuple[str, str, list[str]]]]:
    """Of the ProxyJump hops (each resolved with ssh -G): the names (as ssh gets them) that a CA line covers,
    and (name, label, the user's known_hosts files) of those whose user's StrictHostKeyChecking is yes."""
    out: list[str] = []
    strict: list[tuple[str, str, list[str]]] = []
    spec, seen = host.proxy_jump, 0
    while spec and seen < setup.MAX_HOPS:
        hops = setup.jump_hops(spec)
        spec = None
        for i, (user, name, port) in enumerate(hops):
            seen += 1
            opts = ([f"User={setup.q(user)}"] if user else []) + ([f"Port={port}"] if port else [])
            got = setup.ssh_g(ssh, Path(host.ssh_resolve or ""), name, opts, host.ssh_config or "ssh_config")
            hostname = (got.get("hostname") or [name])[0]
            hport = int((got.get("port") or ["22"])[0])
            if covering(ca, hostname, hport):
                out.append(name)
            if _user_strict(got):
                strict.append((name, _key_label(got, hostname, hport), _user_files(got)))
            if i == 0:  # the first hop's own ProxyJump (ssh follows it)
                own = (got.get("proxyjump") or [""])[0]
                spec = own if own and own.lower() != "none" else None
    return out, strict


def _user_strict(got: dict[str, list[str]]) -> bool:
    """Whether the user's ssh_config says StrictHostKeyChecking yes (ssh -G: "true") for this host."""
    return (got.get("stricthostkeychecking") or [""])[0].lower() in ("true", "yes")


def _user_files(got: dict[str, list[str]]) -> list[str]:
    return [f for v in got.get("userknownhostsfile", []) for f in v.split() if f.lower() != "none"]


def _key_label(got: dict[str, list[str]], hostname: str, port: int) -> str:
    """The name ssh looks a host's key up under: HostKeyAlias, else host or [host]:port."""
    alias = (got.get("hostkeyalias") or ["none"])[0]
    return alias if alias.lower() != "none" else setup.label(hostname, port)


SUN_PATH = 104 if sys.platform == "darwin" else 108  # a unix socket's path, its NUL included
_SAID_LONG: set[str] = set()


def _too_long(host: ResolvedHost, path: str, base: Path) -> bool:
    """Whether the user's ControlPath is too long for the socket ssh makes (its path plus the 17 bytes of
    the temporary name ssh binds first): said once (a marker in dfo's folder; ``dfo -v`` says it each time)."""
    n = len(path.encode("utf-8", "surrogateescape"))
    if n + 17 < SUN_PATH:
        return False
    import hashlib

    marker = base / f"said-controlpath-{hashlib.sha256(path.encode('utf-8', 'surrogateescape')).hexdigest()[:16]}"
    with _CLEAN_LOCK:
        first = path not in _SAID_LONG and not marker.exists()
        _SAID_LONG.add(path)
    if first or os.environ.get("DFO_VERBOSE"):
        sys.stderr.write(
            f"dfo: {host.name}: the ControlPath your ssh_config gives ({path}) is {n} bytes, too long for a unix "
            f"socket (its path holds {SUN_PATH - 1} bytes here, 103 on macOS, and ssh adds 17 while it makes one): "
            f"ssh cannot share connections there (`ssh {host.alias or host.hostname}` fails too), so dfo uses its "
            "own. A shorter one mends it: ControlPath ~/.ssh/cm-%C\n")
        try:
            marker.touch()
        except OSError:
            pass
    return True


_CLEANED: set[str] = set()  # the folders _clean_stale went through in this process
_READY_LOCK = threading.Lock()
_CLEAN_LOCK = threading.Lock()


def _clean_stale(base: Path) -> None:
    """Once per process and folder: remove the connection folders of dfo processes that are gone (killed
    before close()), and the resolution configs and early-ssh records no dfo has used for a week (both are
    touched on use: openssh_setup.write_config, openssh_early.write_private)."""
    import time

    with _CLEAN_LOCK:
        if str(base) in _CLEANED:
            return
        _CLEANED.add(str(base))
    week_ago = time.time() - 7 * 86400
    for pattern in ("resolve-*.conf", "early-*.json"):
        for p in base.glob(pattern):
            try:
                if p.stat().st_mtime < week_ago:
                    p.unlink()
            except OSError:
                pass
    for p in base.glob("c-*-*"):
        try:
            pid = int(p.name.split("-")[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except (ValueError, PermissionError, IndexError):
            pass


@dataclass
class _Policy:
    """What dfo's host-key rules make of a host: its known_hosts lines, CA lines, strict hops and targets."""

    dfo: KnownHosts
    ca: list[tuple[str, Entry]]
    target_strict: bool  # a @cert-authority line covers the target
    strict_hops: list[str]  # ... or these hops
    user_strict: list[tuple[str, str, list[str]]]  # see Prepared.user_strict


def _policy(host: ResolvedHost, ssh: str) -> _Policy:
    dfo = KnownHosts.cached(host.known_hosts)  # a damaged line: exit 2 before anything connects
    ca = ca_lines(host, dfo)
    strict_hops, user_strict = _hops(host, ssh, ca) if host.proxy_jump else ([], [])
    if _user_strict(host.ssh_resolved):
        user_strict.insert(0, (host.alias or host.hostname, _key_label(host.ssh_resolved, host.hostname, host.port),
                               _user_files(host.ssh_resolved)))
    return _Policy(dfo, ca, covering(ca, host.hostname, host.port) is not None, strict_hops, user_strict)


def _shared(host: ResolvedHost, base: Path, pol: _Policy) -> Path:
    """dfo's own ControlPath for this host when connections outlive a command (ssh_persist > 0, and dfo login's
    whatever ssh_persist says). What dfo's known_hosts says of the host is part of the name: a master that
    verified the host under other lines (a key since changed, revoked, a new CA) is never reused; so are the
    user's strict settings."""
    names = [setup.label(host.hostname, host.port)] + [
        setup.label(h, p or 22) for _, h, p in setup.jump_hops(host.proxy_jump or "")]
    mine = sorted((e.marker or "", e.hosts, e.key_type, e.blob.hex()) for e in pol.dfo.entries
                  if e.marker is not None or any(e.matches(n) for n in names))
    extra: list[object] = [pol.user_strict] if pol.user_strict else []
    return early_mod.control_path(base, host.user, host.hostname, host.port, host.proxy_jump, host.proxy_command,
                                  host.ssh_resolve, host.known_hosts, pol.target_strict, pol.strict_hops,
                                  host.ssh_options, mine, *extra)


def control_of(host: ResolvedHost) -> tuple[Path, bool]:
    """The ControlPath a master for this host lives at, and whether it is dfo's own (False: the user's
    ssh_config's): where dfo login makes one and dfo logout ends it. Nothing is made."""
    ssh = setup.usable_ssh()
    if ssh is None or host.ssh_resolve is None:
        raise ConfigError("dfo login needs an OpenSSH client (ssh 8.0 or newer) on PATH and transport: openssh",
                          host=host.name, hint="install one (openssh-client)")
    base = early_mod.state_dir()
    user_path = (host.ssh_resolved.get("controlpath") or ["none"])[0]
    if user_path.lower() != "none" and not _too_long(host, user_path, base):
        return Path(user_path), False
    return _shared(host, base, _policy(host, ssh)), True


def prepare(host: ResolvedHost, early: Early | None = None) -> Prepared:
    """This connection's set-up: its own 0700 folder with its config and new-keys file, and its ControlPath.
    ``early``: the ssh started at dfo's start-up for this host (openssh_early); its folder is taken over
    (the result's folder is ``early.folder``) when the config and control path made here are the very ones
    it was started with; else the set-up is a new one, and the caller stops the early ssh."""
    ssh = setup.usable_ssh()
    if ssh is None or host.ssh_resolve is None:
        raise ConfigError("transport: openssh needs an OpenSSH client (ssh 8.0 or newer) on PATH",
                          host=host.name, hint="install one (openssh-client), or set transport: paramiko")
    pol = _policy(host, ssh)
    base = early_mod.state_dir()
    _clean_stale(base)
    Path(host.known_hosts).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    resolved = Path(host.ssh_resolve).read_text().splitlines()
    user_path = (host.ssh_resolved.get("controlpath") or ["none"])[0]
    if user_path.lower() != "none" and _too_long(host, user_path, base):
        user_path = "none"
    # ssh_persist 0, but a master dfo login made is there: this command goes over it (never ends it)
    login = None
    if user_path.lower() == "none" and host.ssh_persist <= 0:
        shared = _shared(host, base, pol)
        login = shared if setup.master_answers(str(shared)) is True else None

    def made(folder: Path) -> tuple[str, Path | None, bool]:
        """The config text and (control path, dfo's own?) of a connection whose folder is ``folder``."""
        files = [str(folder / "new_keys"), host.known_hosts, *_files(host, "userknownhostsfile")]
        lines = ["# dfo: the settings of one connection to " + host.name.replace("\n", " ")
                 + " (orchestrator/transport/openssh_keys.py); removed when it closes"]
        if pol.strict_hops:
            lines += ["Host " + " ".join(pol.strict_hops), "  StrictHostKeyChecking yes"]
        for name, _, theirs in pol.user_strict:  # the user's StrictHostKeyChecking yes: their files alone
            lines += [f"Host {setup.q(name)}", "  StrictHostKeyChecking yes",
                      f"  UserKnownHostsFile {setup.known_hosts_value(theirs) if theirs else '/dev/null'}"]
        # dfo's rule for the rest (the user's ask or no as well): a new key recorded, a changed one refused
        lines += ["Host *", "  StrictHostKeyChecking accept-new"]
        if login is not None:
            lines += [f"  ControlPath {setup.q(setup.pct(str(login)))}", "  ControlMaster no"]
        # the resolution config is copied in, not included: this connection never depends on a shared file
        lines += [f"  UserKnownHostsFile {setup.known_hosts_value(files)}", *resolved]
        text = "\n".join(lines) + "\n"
        if user_path.lower() != "none":
            return text, Path(user_path), False
        if login is not None:
            return text, login, False
        if host.ssh_persist > 0:
            return text, _shared(host, base, pol), True
        # ssh_persist 0: a master of this command's own, in this connection's folder: the command's calls
        # share one connection; close() ends it and removes its socket with the folder
        return text, early_mod.own_control(folder), True

    if early is not None:
        text, control, own = made(early.folder)
        if own and text == early.config_text and str(control) == early.control:
            return Prepared(ssh, early.folder, early.folder / "config", early.folder / "new_keys", control, own,
                            pol.target_strict, pol.ca, pol.strict_hops, text, pol.user_strict)
    folder = early_mod.conn_folder(base)
    text, control, own = made(folder)
    # the folder, where ssh reads this config and records a new host's key, is made when an ssh client is to run
    return Prepared(ssh, folder, folder / "config", folder / "new_keys", control, own, pol.target_strict, pol.ca,
                    pol.strict_hops, text, pol.user_strict, made=False)


def merge_new_keys(host: ResolvedHost, prep: Prepared) -> None:
    """Move the keys ssh recorded in this connection's new-keys file into dfo's known_hosts (once each)."""
    try:
        if prep.new_keys.stat().st_size == 0:
            return
    except OSError:
        return
    path = Path(host.known_hosts)
    lock_path = path.with_name(path.name + ".lock")
    with _KH_LOCK, open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            fresh = prep.new_keys.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:  # close() from another thread merged this file's keys, then removed it
            return
        try:
            with open(prep.new_keys, "w"):
                pass
        except FileNotFoundError:  # removed since: nothing left to empty (the keys read are merged below)
            pass
        kh = KnownHosts.load(host.known_hosts)
        for line in fresh.splitlines():
            got = parse_line(line)
            if got is None or isinstance(got, str) or got[0] is not None:
                continue
            _, name, key_type, blob = got
            same = [e for e in kh.recorded(name) if e.key_type == key_type]
            if any(e.blob == blob for e in same):
                continue
            if same:
                raise HostKeyError(
                    f"host key for {name} CHANGED while dfo connected: {host.known_hosts}:{same[0].lineno} "
                    f"records {fingerprint(same[0].blob)}, the node offered {fingerprint(blob)} ({key_type})",
                    host=host.name, hint="another dfo recorded a different key for it at the same time; check "
                                         "the node's real key out of band")
            known_hosts.append(host.known_hosts, name, key_type, blob)
            kh = KnownHosts.load(host.known_hosts)
            sys.stderr.write(f"dfo: {host.name}: recorded host key {key_kind(key_type)} {fingerprint(blob)} "
                             f"for {name} (in {host.known_hosts})\n")
