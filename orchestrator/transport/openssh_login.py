"""dfo login and dfo logout: a shared connection made once with the user's own terminal, for nodes that ask for
a password or one-time code after the key (sshd AuthenticationMethods), or keys whose passphrase no agent holds.

dfo's commands never prompt (BatchMode: no terminal of theirs, no askpass). ``login`` runs the user's ssh once
per host with BatchMode off, on their terminal (or, with none, through SSH_ASKPASS, with SSH_ASKPASS_REQUIRE=force
unless they set it), as a ControlMaster at the very ControlPath dfo's commands use for that host
(openssh_keys.control_of: dfo's own, or the user's ssh_config's), persisting ControlPersist seconds
(``ssh_persist``, or ``--persist``): every later command goes over it with no prompt, until it has been idle
that long. The password, code or passphrase goes from the terminal (or askpass) to ssh; dfo never sees it.

* Host keys: checked as on every connection (dfo's known_hosts, first use recorded, the user's strict settings).
  dfo's socket name holds what its known_hosts says of the host, so a key recorded by the login itself renames
  the socket to the name the next command computes.
* ``check``: whether a master answers there, its pid (the mux protocol's alive check), and what dfo's login
  record (a 0600 file in dfo's ssh folder: path, persist, time, pid; no secret) says of it.
* ``logout``: the master is told to end (``ssh -O exit``), its record removed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..config.inventory import ResolvedHost
from ..errors import ConfigError, HostError
from . import openssh_early as early_mod
from . import openssh_keys as keys
from . import openssh_setup as setup
from .openssh_auth import recv_exact
from .openssh_errors import classify

MUX_C_ALIVE_CHECK = 0x10000004
MUX_S_ALIVE = 0x80000005


@dataclass
class Shared:
    """What is known of a host's shared connection."""

    host: str
    control: str
    own: bool  # dfo's ControlPath (False: the user's ssh_config's)
    open: bool  # a master answers there
    pid: int | None = None
    since: float | None = None  # when dfo login made it (None: a command made it, or the user's ssh)
    persist: float | None = None  # its ControlPersist, as dfo login gave it

    @property
    def by(self) -> str:
        return "login" if self.since is not None else ("command" if self.own else "ssh_config")

    def to_json(self) -> dict[str, object]:
        return {"logged_in": self.open, "control": self.control, "pid": self.pid, "by": self.by if self.open else None,
                "since": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.since)) if self.since else None,
                "persist": self.persist}


def _needs_openssh(host: ResolvedHost) -> None:
    if host.transport != "openssh":
        raise ConfigError(f"dfo login works over OpenSSH's ssh; {host.name} uses transport: {host.transport}",
                          host=host.name, hint="set transport: openssh (or ssh, with OpenSSH 8.0 or newer on PATH) "
                                               "for this host")


def _record(path: Path) -> Path:
    import hashlib

    return early_mod.state_dir() / f"login-{hashlib.sha256(str(path).encode()).hexdigest()[:16]}.json"


def master_pid(path: str, timeout: float = setup.MUX_PROBE_S) -> int | None:
    """The pid of the master at ``path`` (MUX_C_ALIVE_CHECK, as ``ssh -O check`` asks), None when none answers."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(struct.pack(">III", 8, 1, 4))  # MUX_MSG_HELLO, version 4
        head = recv_exact(s, 4)
        recv_exact(s, struct.unpack(">I", head)[0])  # its hello (extensions unread)
        s.sendall(struct.pack(">III", 8, MUX_C_ALIVE_CHECK, 1))
        body = recv_exact(s, struct.unpack(">I", recv_exact(s, 4))[0])
        kind, _rid, pid = struct.unpack(">III", body[:12])
        return pid if kind == MUX_S_ALIVE else None
    except (OSError, struct.error, ValueError):
        return None
    finally:
        s.close()


def check(host: ResolvedHost) -> Shared:
    """The host's shared connection: open or not, its pid, and dfo login's record of it."""
    _needs_openssh(host)
    path, own = keys.control_of(host)
    pid = master_pid(str(path))
    got = Shared(host.name, str(path), own, pid is not None, pid)
    try:
        rec = json.loads(_record(path).read_text())
    except (OSError, ValueError):
        rec = None
    if pid is not None and isinstance(rec, dict) and rec.get("pid") == pid:
        got.since, got.persist = float(rec["since"]), float(rec["persist"])
    return got


def _terminal() -> bool:
    """Whether this process has a controlling terminal ssh can prompt on (/dev/tty opens)."""
    try:
        os.close(os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY))
        return True
    except OSError:
        return False


def _prompt_env() -> dict[str, str]:
    """ssh's environment: the user's own, with SSH_ASKPASS_REQUIRE=force where there is no terminal but an
    askpass (ssh would otherwise want DISPLAY too); neither: a ConfigError that says how."""
    env = dict(os.environ)
    if env.get("SSH_ASKPASS_REQUIRE") == "force" and env.get("SSH_ASKPASS"):
        return env
    if _terminal():
        return env
    if env.get("SSH_ASKPASS"):
        env.setdefault("SSH_ASKPASS_REQUIRE", "force")
        return env
    raise ConfigError("dfo login asks for a password, code or passphrase on a terminal, and there is none here "
                      "(nor SSH_ASKPASS)", hint="run it in a terminal, or set SSH_ASKPASS to a program that prints "
                                               "the answer (ssh's own way; dfo sets SSH_ASKPASS_REQUIRE=force)")


def login(host: ResolvedHost, persist: float | None = None) -> Shared:
    """Make the host's shared connection with the user's terminal (or askpass); its state once made."""
    _needs_openssh(host)
    seconds = persist if persist is not None else host.ssh_persist
    if seconds <= 0:
        raise ConfigError("ssh_persist is 0 for this host: a connection made now would end at once",
                          host=host.name, hint="give it a life: dfo login --persist SECONDS")
    env = _prompt_env()
    path, own = keys.control_of(host)
    alive = setup.master_answers(str(path))
    if not own and alive:
        return check(host)  # the user's own master: theirs to end (dfo logout does)
    if alive:
        early_mod.end_master(str(path), stop_listening=True)  # its sessions go on; the new one takes the name
    elif path.exists() or path.is_symlink():
        path.unlink()  # a stale socket (or a hung master's): ssh would not make a master over it
    prep = keys.prepare(host)
    try:
        argv = [prep.ssh, "-F", str(prep.ready()), "-T"]
        for o in host.ssh_options:
            argv += ["-o", o]
        if prep.target_strict:
            argv += ["-o", "StrictHostKeyChecking=yes"]
        argv += ["-o", "BatchMode=no", "-o", "LogLevel=INFO", "-o", "ControlMaster=yes",
                 "-o", f"ControlPath={setup.q(setup.pct(str(path)))}",
                 "-o", f"ControlPersist={max(1, round(seconds))}s", "--", host.alias or host.hostname, "true"]
        code, said = _run(argv, env)
        keys.merge_new_keys(host, prep)
        if code != 0:
            raise classify(host, prep, said)
        pid = master_pid(str(path))
        if pid is None:
            raise HostError(f"ssh logged in but left no shared connection at {path}", host=host.name,
                            hint="does your ssh_config set ControlMaster no or ControlPersist no for it?")
        if own:  # a key recorded just now is part of the name the next command computes
            now, _ = keys.control_of(host)
            if now != path:
                os.replace(path, now)
                path = now
        from .openssh_early import write_private

        write_private(_record(path), json.dumps({"host": host.name, "control": str(path), "pid": pid,
                                                 "since": time.time(), "persist": seconds}))
        return check(host)
    finally:
        shutil.rmtree(prep.folder, ignore_errors=True)


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    """ssh on this terminal (stdin as dfo's), its stderr passed on as it comes and kept for the error."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    said: list[bytes] = []

    def relay() -> None:
        assert proc.stderr is not None
        for line in iter(proc.stderr.readline, b""):
            said.append(line)
            sys.stderr.write(line.decode("utf-8", "replace"))
            sys.stderr.flush()

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    try:
        code = proc.wait()
    except BaseException:
        proc.terminate()
        proc.wait()
        raise
    t.join(5)
    return code, b"".join(said).decode("utf-8", "replace")


def logout(host: ResolvedHost) -> bool:
    """End the host's shared connection (``ssh -O exit``); whether one was open."""
    _needs_openssh(host)
    path, own = keys.control_of(host)
    was = master_pid(str(path)) is not None
    if was:
        early_mod.end_master(str(path))
        deadline = time.monotonic() + 5
        while setup.master_answers(str(path)) and time.monotonic() < deadline:
            time.sleep(0.05)
    elif own and (path.exists() or path.is_symlink()) and setup.master_answers(str(path)) is None:
        path.unlink()  # a stale socket of dfo's
    try:
        _record(path).unlink()
    except OSError:
        pass
    return was
