"""The connection started before dfo's start-up is done, so that ssh's handshake overlaps Python's.

A command that names its hosts (``dfo sync-code -H gpu1``) spends its first ~0.1 s importing its modules
and reading the inventory and the job before it knows what ssh to start, and only then waits ~0.15 s for
the handshake; ``ssh HOST`` starts its handshake at once. So for each host that dfo reached before over
the OpenSSH transport, it keeps a record of how that connection was started: the ssh argv and the
connection's config file, as openssh_keys.prepare made them (``remember``). At start-up (entry.py, before
click and the command's module are imported) ``start`` reads the record of each host named with -H and,
when the inventory file, the environment, the ssh binary and every known_hosts file are as they were,
starts that ssh now: a connection folder and config made as prepare makes them, and ``true`` run as
warm()'s call runs it, which makes the master that the command's calls then share.

Nothing is taken on trust from a record. A record is read only if it is a regular 0600 file of this
user's, in dfo's 0700 folder. When the command's transport makes its set-up (OpenSSH._prepared) it
computes the config, the control path and the argv from the validated inventory as it always does, and
takes the early ssh over only when all three are the same, byte for byte. Otherwise the early ssh is
stopped and the master it made takes no command: with ssh_persist 0 it ends, a shared one stops
listening (``ssh -O stop``), and the command connects as before. The early ssh checks host keys with the
same config, files and policy as the command's own ssh would (a known_hosts file changed since the
record, say a @cert-authority line added, and nothing starts early), and its failure (a changed key, a
refused login) is raised by the command's first call, as warm()'s would be. A command that ends without
connecting stops its early ssh (a shared master it made stays for ssh_persist, as any command's does).
Records hold paths and options, never a secret. ``DFO_EARLY_CONNECT=0`` turns this off.
"""

from __future__ import annotations

import _thread
import atexit
import os
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import cache_dir
from ..errors import ConfigError

if TYPE_CHECKING:
    import subprocess

    from .openssh_mux import MuxSession

VERSION = 1
# the commands that connect to the hosts they name with -H
COMMANDS = frozenset({"verify-env", "provision", "stage-model", "sync-data", "sync-code", "pull", "launch", "tail",
                      "status", "stop", "top", "exec", "up", "watch"})
# what else decides the config and argv dfo makes (besides the inventory file, whose size, time and inode count)
_FOLDER, _CONTROL = "\x00", "\x01"  # in a record: the connection's folder, and its own socket (ssh_persist 0)
ENV_KEYS = ("HOME", "PATH", "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "DFO_SSH_CONFIG", "DFO_SSH_TRANSPORT",
            "DFO_ALIVE_INTERVAL_S", "DFO_ALIVE_DEAD_S", "DFO_DEBUG")


_STATE_DIRS: set[Path] = set()  # made and checked in this process (a fleet command asks several times a host)


def state_dir() -> Path:
    """dfo's own folder for ssh: 0700, created on first use (control sockets, config files, records)."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(run) / "dfo-ssh" if run and os.path.isdir(run) else cache_dir() / "ssh"
    if base in _STATE_DIRS and os.path.isdir(base):
        return base
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
    _STATE_DIRS.add(base)
    return base


def _socket_in(folder: Path, name: str) -> Path:
    """``folder/name`` for a control socket; a socket's path holds at most 107 bytes and ssh adds 17 while
    it makes one: a folder too deep for that gives way to /tmp/dfo-ssh-UID (0700, ours)."""
    if len(str(folder)) + len(name) + 1 + 17 > 100:
        folder = Path(f"/tmp/dfo-ssh-{os.geteuid()}")
        try:
            folder.mkdir(mode=0o700, exist_ok=True)
            st = folder.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise ConfigError(f"{folder} is not a 0700 folder of this user's: dfo will not put ssh's "
                                  "control sockets there", hint="remove it, or set XDG_RUNTIME_DIR to a short path")
        except OSError as exc:
            raise ConfigError(f"{folder}: {exc.strerror or exc}", hint="set XDG_RUNTIME_DIR to a short path") from None
    return folder / name


def control_path(folder: Path, *parts: object) -> Path:
    """A shared master's socket, named by what the connection is (a digest of ``parts``)."""
    import hashlib

    return _socket_in(folder, "cm-" + hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:16])


def own_control(folder: Path) -> Path:
    """The socket of a command's own master (ssh_persist 0), in its connection's folder ``c-PID-TOKEN``
    (or, that too deep, named after it in /tmp/dfo-ssh-UID)."""
    return _socket_in(folder, "cm") if len(str(folder)) + 3 + 17 <= 100 else _socket_in(folder, "cm-" + folder.name)


class Early:
    """One early ssh: what it was started with, and the process (running ``true`` under sh, marker ``marker``)."""

    def __init__(self, name: str, folder: Path, config_text: str, control: str, argv: list[str], persist: float,
                 proc: subprocess.Popen[bytes], marker: str, started: float) -> None:
        self.name = name
        self.folder = folder  # the connection's own folder (config, new_keys), as openssh_keys.prepare makes one
        self.config_text = config_text
        self.control = control
        self.argv = argv  # without the remote command
        self.persist = persist
        self.proc = proc
        self.marker = marker
        self.started = started  # time.monotonic() at its start

    def discard(self, keep_master: bool) -> None:
        """Stop the early ssh and remove its folder. With ssh_persist 0 the master it made ends (its socket
        is the connection's own). A shared master at the control path (ssh_persist > 0) stops taking new
        sessions (``ssh -O stop``: no later command goes over it; a session in flight ends as it would)
        unless ``keep_master``: the early ssh was the command's own, only never used (the command ended
        before it connected), and the master stays for ssh_persist as any command's does."""
        if self.proc.poll() is None:
            stop(self.proc)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        if self.persist <= 0:
            end_master(self.control)
        elif not keep_master:
            end_master(self.control, stop_listening=True)
        remove_conn_folder(self.folder)


class _Session:
    def __init__(self, inventory: str, check: list[Any], names: list[str], verbose: bool) -> None:
        self.inventory = inventory  # its real path
        self.check = check  # the inventory's stat and the environment, as a record must hold them
        self.names = names
        self.verbose = verbose
        self.early: dict[str, Early] = {}
        self.loaded = False  # the command loaded that inventory (hosts.HostSession): its hosts may be recorded


_session: _Session | None = None
_started: list[str] | None = None  # the command line start() last saw
_atexit = False


def _parse(args: list[str]) -> tuple[str, list[Any], list[str], bool] | None:
    """(inventory real path, check, host names, -v) of ``dfo [-i INV] [-v] CMD ... -H NAME[,NAME] ...``, or
    None: no command that connects, no host named, help asked, or nothing to connect to (--from-s3)."""
    inv: str | None = None
    verbose = bool(os.environ.get("DFO_VERBOSE"))
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-i", "--inventory") and i + 1 < len(args):
            inv, i = args[i + 1], i + 2
        elif a.startswith("--inventory="):
            inv, i = a.split("=", 1)[1], i + 1
        elif a in ("-v", "--verbose"):
            verbose, i = True, i + 1
        else:
            break
    if i >= len(args) or args[i] not in COMMANDS:
        return None
    names: list[str] = []
    rest = args[i + 1:]
    j = 0
    while j < len(rest) and rest[j] != "--":
        a = rest[j]
        if a in ("-h", "--help", "--dry-run", "--from-s3"):
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
    return real, check, names, verbose


def _stats(paths: list[str]) -> dict[str, list[int] | None]:
    """Each file's (size, mtime_ns, inode), None for one that is not there."""
    out: dict[str, list[int] | None] = {}
    for p in paths:
        try:
            st = os.stat(p)
            out[p] = [st.st_size, st.st_mtime_ns, st.st_ino]
        except OSError:
            out[p] = None
    return out


def _record_path(base: Path, inventory: str, name: str) -> Path:
    """One file per inventory and host. Named by two CRCs (binascii: no OpenSSL to load at start-up); a
    record names its inventory and host, so one that lands on another's name is only never used."""
    import binascii

    key = f"{inventory}\0{name}".encode("utf-8", "surrogateescape")
    return base / f"early-{binascii.crc32(key):08x}{binascii.crc32(key[::-1]):08x}.json"


def start(args: list[str]) -> None:
    """Start the early ssh of each host that ``args`` (dfo's command line) names and has a valid record."""
    global _session, _atexit, _started
    if _started == args:
        return  # the console script (orchestrator/entry.py) did, before click was imported
    finish()
    _started = list(args)
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
        except Exception:  # noqa: BLE001 - a record that cannot be used: the command connects as without one
            early = None
        if early is not None:
            _session.early[name] = early
            if _session.verbose:
                sys.stderr.write(f"dfo: {name}: ssh started at dfo's start-up, as it last was (pid {early.proc.pid})\n")


def _spawn(base: Path, name: str) -> Early | None:
    import json
    import subprocess

    assert _session is not None
    try:  # the record is used only if it is a file of this user's that nobody else can write
        fd = os.open(_record_path(base, _session.inventory, name), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        try:
            rec = json.loads(f.read())
        except ValueError:
            return None
    if not isinstance(rec, dict) or rec.get("check") != _session.check or rec.get("inventory") != _session.inventory \
            or rec.get("name") != name:
        return None
    watch = rec["watch"]  # the ssh binary and every known_hosts file: any change, and nothing starts early
    if not isinstance(watch, dict) or _stats(list(watch)) != watch:
        return None
    persist = float(rec["persist"])
    if persist > 0 and os.path.exists(rec["control"]):
        return None  # a shared master may be there: the command's transport asks it, as always
    folder = conn_folder(base)
    # ssh_persist 0: the master's socket is the connection's own, named from its folder's name
    control = str(own_control(folder)) if persist <= 0 else str(rec["control"])

    def fill(text: str) -> str:
        return text.replace(_CONTROL, control).replace(_FOLDER, str(folder))

    text = fill(str(rec["config"]))
    argv = [fill(str(a)) for a in rec["argv"]]
    if not os.access(argv[0], os.X_OK):
        return None
    try:
        make_conn_folder(folder, text)
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


def stop(proc: subprocess.Popen[bytes] | MuxSession) -> None:
    """End an ssh client: SIGTERM (a mux client closes its session on the master), then SIGKILL; a session
    opened without a client (openssh_mux) is closed."""
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


def end_master(path: str, timeout: float = 0.5, stop_listening: bool = False) -> None:
    """Ask the master at ``path`` to end now, over its mux socket (hello, then MUX_C_TERMINATE: what
    ``ssh -O exit`` sends, without starting a process); ``stop_listening``: MUX_C_STOP_LISTENING instead
    (``ssh -O stop``: its socket goes, its sessions go on). Best effort: a master that does not answer
    ends on its own (ControlPersist)."""
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
        # MUX_C_STOP_LISTENING or MUX_C_TERMINATE, request id 1
        s.sendall(struct.pack(">III", 8, 0x10000009 if stop_listening else 0x10000005, 1))
        s.recv(16)  # MUX_S_OK (or a refusal), then the master ends
    except OSError:
        pass
    finally:
        s.close()


def conn_folder(base: Path) -> Path:
    """The path of a new connection's own folder, ``c-PID-TOKEN`` (openssh_keys._clean_stale reads the pid)."""
    return base / f"c-{os.getpid()}-{os.urandom(4).hex()}"


def remove_conn_folder(folder: Path) -> None:
    """Remove a connection's folder: its few files, then itself (rmtree's descriptor walk costs several
    times more, paid once per host per command); rmtree where something else is there."""
    try:
        for name in os.listdir(folder):
            try:
                os.unlink(folder / name)
            except FileNotFoundError:
                pass  # a master that ended meanwhile removed its socket
        os.rmdir(folder)
    except FileNotFoundError:
        pass
    except OSError:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def make_conn_folder(folder: Path, config_text: str) -> None:
    """Make ``folder`` (0700) with the connection's empty new-keys file and its config (0600, new files)."""
    folder.mkdir(mode=0o700)
    os.close(os.open(folder / "new_keys", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    fd = os.open(folder / "config", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(config_text)


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


def remember(name: str, folder: Path, config_text: str, control: str, persist: float, argv: list[str],
             watch: list[str]) -> None:
    """Keep how the connection to ``name`` was started (its first call went through), for the next command
    that names it, while the files in ``watch`` (the ssh binary, the known_hosts files) stay as they are
    now. Written only when it changed (to a temporary name, then renamed), 0600."""
    if _session is None or not _session.loaded or name not in _session.names:
        return
    import json


    def hollow(text: str) -> str:  # the same record whatever the connection's folder (filled by _spawn)
        return (text.replace(control, _CONTROL) if persist <= 0 else text).replace(str(folder), _FOLDER)

    rec = {"check": _session.check, "inventory": _session.inventory, "name": name, "config": hollow(config_text),
           "control": control if persist > 0 else _CONTROL, "persist": persist, "argv": [hollow(a) for a in argv],
           "watch": _stats(watch)}
    try:
        write_private(_record_path(state_dir(), _session.inventory, name), json.dumps(rec, indent=1))
    except (OSError, ConfigError):
        pass  # no record: the next command connects after its start-up, as without one


def write_private(path: Path, text: str) -> bool:
    """``text`` into ``path``, 0600, through a temporary name renamed over it, unless the file holds it
    already (then its time is set to now once a day: a file in use is never a week old for
    openssh_keys._clean_stale); whether it wrote."""
    try:
        if path.read_text() == text:
            if time.time() - path.stat().st_mtime > 86400:
                os.utime(path)
            return False
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{_thread.get_ident()}")  # hosts resolve in threads
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


def finish() -> None:
    """Stop every early ssh no transport took (the command ended without connecting to that host)."""
    global _session, _started
    session, _session, _started = _session, None, None
    if session is not None:
        for early in session.early.values():
            early.discard(keep_master=True)
