"""The connection started before dfo's start-up is done, so that ssh's handshake overlaps Python's.

A command that names its hosts (``dfo sync-code -H gpu1``) spends its first ~0.1 s importing its modules
and reading the inventory and the job before it knows what ssh to start, and only then waits ~0.15 s for
the handshake; ``ssh HOST`` starts its handshake at once. So for each host that dfo reached before over
the OpenSSH transport, it keeps a record of how that connection was started: the ssh argv and the
connection's config file, as openssh_keys.prepare made them (``remember``). At start-up (cli.main,
before the command's module is imported) ``start`` reads the record of each host named with -H and,
when the inventory file and the environment are as they were, starts that ssh now: a connection folder
and config made as prepare makes them, and ``true`` run as warm()'s call runs it, which makes the
master that the command's calls then share.

Nothing is taken on trust from a record. When the command's transport makes its set-up
(OpenSSH._prepared) it computes the config, the control path and the argv from the validated inventory
as it always does, and takes the early ssh over only when all three are the same, byte for byte;
otherwise the early ssh is stopped (its master ended where it is the command's own) and the command
connects as before. Host keys are checked as on any connection (the same config, known_hosts files and
policy), and an early ssh's failure (a changed key, a refused login) is raised by the command's first
call, as warm()'s would be. A command that never connects (bad usage, an invalid job) stops its early
ssh when it ends. Records hold paths and options, never a secret, in dfo's 0700 ssh folder.
``DFO_EARLY_CONNECT=0`` turns this off.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cache_dir
from ..errors import ConfigError

if TYPE_CHECKING:
    import subprocess

VERSION = 1
# the commands that connect to the hosts they name with -H
COMMANDS = frozenset({"verify-env", "provision", "stage-model", "sync-data", "sync-code", "pull", "launch", "tail",
                      "status", "stop", "top", "exec", "up", "watch"})
# what else decides the config and argv dfo makes (besides the inventory file, whose size, time and inode count)
_FOLDER, _CONTROL = "\x00", "\x01"  # in a record: the connection's folder, and its own socket (ssh_persist 0)
ENV_KEYS = ("HOME", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "DFO_SSH_CONFIG", "DFO_SSH_TRANSPORT", "DFO_ALIVE_INTERVAL_S",
            "DFO_ALIVE_DEAD_S", "DFO_DEBUG")


def state_dir() -> Path:
    """dfo's own folder for ssh: 0700, created on first use (control sockets, config files, records)."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(run) / "dfo-ssh" if run and os.path.isdir(run) else cache_dir() / "ssh"
    try:
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = base.stat()
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{base}: dfo's ssh folder belongs to another user",
                              hint="remove it, or set XDG_RUNTIME_DIR to a folder of yours")
        if st.st_mode & 0o077:
            os.chmod(base, 0o700)
    except OSError as exc:
        raise ConfigError(f"{base}: cannot make dfo's ssh folder: {exc.strerror or exc}",
                          hint="check that your home (or $XDG_RUNTIME_DIR) is writable") from None
    return base


def control_path(folder: Path, *parts: object) -> Path:
    """A socket path named by what the connection is. A socket's path holds at most 107 bytes and ssh
    adds 17 while it makes one: a folder too deep for that gives way to /tmp/dfo-ssh-UID (0700, ours)."""
    digest = hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:16]
    if len(str(folder)) + len(digest) + 4 + 17 > 100:
        folder = Path(f"/tmp/dfo-ssh-{os.geteuid()}")
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            st = folder.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ConfigError(f"{folder} is not a 0700 folder of this user's: dfo will not put ssh's "
                                  "control sockets there", hint="remove it, or set XDG_RUNTIME_DIR to a short path")
        except OSError as exc:
            raise ConfigError(f"{folder}: {exc.strerror or exc}", hint="set XDG_RUNTIME_DIR to a short path") from None
    return folder / f"cm-{digest}"


@dataclass
class Early:
    """One early ssh: what it was started with, and the process (running ``true`` under sh, marker ``marker``)."""

    name: str
    folder: Path  # the connection's own folder (config, new_keys), as openssh_keys.prepare makes one
    config_text: str
    control: str
    argv: list[str]  # without the remote command
    persist: float
    proc: subprocess.Popen[bytes]
    marker: str
    started: float  # time.monotonic() at its start

    def discard(self) -> None:
        """Stop the early ssh; with ssh_persist 0 end the master it made (its socket is in its own folder)
        and remove the folder. A shared master (ssh_persist > 0) is left to end on its own, as any."""
        if self.proc.poll() is None:
            stop(self.proc)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        if self.persist <= 0:
            end_master(self.control)
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class _Session:
    inventory: str  # its real path
    check: list[Any]  # the inventory's stat and the environment, as a record must hold them
    names: list[str]
    early: dict[str, Early] = field(default_factory=dict)
    loaded: bool = False  # the command loaded that inventory (hosts.HostSession): its hosts may be recorded


_session: _Session | None = None
_atexit = False


def _parse(args: list[str]) -> tuple[str, list[Any], list[str]] | None:
    """(inventory real path, check, host names) of ``dfo [-i INV] [-v] CMD ... -H NAME[,NAME] ...``, or None."""
    inv: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-i", "--inventory") and i + 1 < len(args):
            inv, i = args[i + 1], i + 2
        elif a.startswith("--inventory="):
            inv, i = a.split("=", 1)[1], i + 1
        elif a in ("-v", "--verbose"):
            i += 1
        else:
            break
    if i >= len(args) or args[i] not in COMMANDS:
        return None
    names: list[str] = []
    rest = args[i + 1:]
    j = 0
    while j < len(rest) and rest[j] != "--":
        a = rest[j]
        if a in ("-h", "--help", "--dry-run"):
            return None
        if a in ("-H", "--host") and j + 1 < len(rest):
            names += rest[j + 1].split(",")
            j += 1
        elif a.startswith("--host="):
            names += a.split("=", 1)[1].split(",")
        j += 1
    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    if not names:
        return None
    try:
        real = os.path.realpath(inv or os.environ.get("DFO_INVENTORY") or "inventory.yaml")
        st = os.stat(real)
    except OSError:
        return None
    check = [VERSION, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, *(os.environ.get(k) for k in ENV_KEYS)]
    return real, check, names


def _record_path(base: Path, inventory: str, name: str) -> Path:
    key = hashlib.sha256(f"{inventory}\0{name}".encode("utf-8", "surrogateescape")).hexdigest()[:24]
    return base / f"early-{key}.json"


def start(args: list[str]) -> None:
    """Start the early ssh of each host that ``args`` (dfo's command line) names and has a valid record."""
    global _session, _atexit
    finish()
    if os.environ.get("DFO_EARLY_CONNECT", "1") == "0":
        return
    parsed = _parse(args)
    if parsed is None:
        return
    _session = _Session(*parsed)
    try:
        base = state_dir()
    except ConfigError:
        return  # said again, with its hint, when the transport makes its set-up
    if not _atexit:
        _atexit = True
        atexit.register(finish)
    for name in _session.names:
        try:
            early = _spawn(base, name)
        except (OSError, ValueError, KeyError, TypeError):
            early = None
        if early is not None:
            _session.early[name] = early


def _spawn(base: Path, name: str) -> Early | None:
    import json
    import subprocess

    assert _session is not None
    try:
        rec = json.loads(_record_path(base, _session.inventory, name).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("check") != _session.check or rec.get("inventory") != _session.inventory \
            or rec.get("name") != name:
        return None
    persist = float(rec["persist"])
    if persist > 0 and os.path.exists(rec["control"]):
        return None  # a shared master may be there: the command's transport asks it, as always
    folder = base / f"c-{os.getpid()}-{os.urandom(4).hex()}"
    # ssh_persist 0: the master's socket is the connection's own, named from its folder's name
    control = str(control_path(folder, folder.name)) if persist <= 0 else str(rec["control"])

    def fill(text: str) -> str:
        return text.replace(_CONTROL, control).replace(_FOLDER, str(folder))

    text = fill(str(rec["config"]))
    argv = [fill(str(a)) for a in rec["argv"]]
    if not os.access(argv[0], os.X_OK):
        return None
    folder.mkdir(mode=0o700)
    try:
        os.close(os.open(folder / "new_keys", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        fd = os.open(folder / "config", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        from .base import sh_command

        marker = os.urandom(8).hex()
        started = time.monotonic()
        proc = subprocess.Popen([*argv, sh_command("true", marker)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except BaseException:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        raise
    return Early(name, folder, text, control, argv, persist, proc, marker, started)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End an ssh client: SIGTERM (a mux client closes its session on the master), then SIGKILL."""
    import subprocess

    try:
        proc.terminate()
        proc.wait(2)
    except subprocess.TimeoutExpired:
        proc.kill()
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            pass
    except OSError:
        pass


def end_master(path: str, timeout: float = 0.5) -> None:
    """Ask the master at ``path`` to end now, over its mux socket (hello, then MUX_C_TERMINATE: what
    ``ssh -O exit`` sends, without starting a process). Best effort: a master that does not answer ends
    on its own (ControlPersist)."""
    import socket
    import struct

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(struct.pack(">III", 8, 1, 4))  # MUX_MSG_HELLO, protocol version 4
        got = b""
        while len(got) < 12:  # its hello (extensions, if any, are not read: the request goes next)
            chunk = s.recv(12 - len(got))
            if not chunk:
                return
            got += chunk
        s.sendall(struct.pack(">III", 8, 0x10000005, 1))  # MUX_C_TERMINATE, request id 1
        s.recv(16)  # MUX_S_OK (or a refusal), then the master ends
    except OSError:
        pass
    finally:
        s.close()


def take(name: str) -> Early | None:
    """The early ssh started for host ``name``, handed to its transport once (None: there is none)."""
    if _session is None:
        return None
    return _session.early.pop(name, None)


def loaded(inventory: Path) -> None:
    """The command loaded this inventory: when it is the one start() read, its hosts' connections may be
    recorded for the next command."""
    if _session is not None and os.path.realpath(inventory) == _session.inventory:
        _session.loaded = True


def remember(name: str, folder: Path, config_text: str, control: str, persist: float, argv: list[str]) -> None:
    """Keep how the connection to ``name`` was started (its first call went through), for the next command
    that names it. Written only when it changed (to a temporary name, then renamed)."""
    if _session is None or not _session.loaded or name not in _session.names:
        return
    import json


    def hollow(text: str) -> str:  # the same record whatever the connection's folder (filled by _spawn)
        return (text.replace(control, _CONTROL) if persist <= 0 else text).replace(str(folder), _FOLDER)

    rec = {"check": _session.check, "inventory": _session.inventory, "name": name, "config": hollow(config_text),
           "control": control if persist > 0 else _CONTROL, "persist": persist, "argv": [hollow(a) for a in argv]}
    text = json.dumps(rec, indent=1)
    try:
        path = _record_path(state_dir(), _session.inventory, name)
        try:
            if path.read_text() == text:
                return
        except OSError:
            pass
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except (OSError, ConfigError):
        pass  # no record: the next command connects after its start-up, as without one


def finish() -> None:
    """Stop every early ssh no transport took (the command ended without connecting to that host)."""
    global _session
    session, _session = _session, None
    if session is not None:
        for early in session.early.values():
            early.discard()
