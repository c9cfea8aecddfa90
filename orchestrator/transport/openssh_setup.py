"""How dfo drives OpenSSH's client: the ssh_config files it writes, `ssh -G`, host keys, shared masters.

All of the OpenSSH transport's options live here, in one commented place (the run loop is openssh.py):

* ssh_config holds, because ssh applies it: Include, Match, IdentityAgent, CertificateFile,
  IdentitiesOnly, ProxyJump chains, FIDO keys... dfo hands ssh ONE file with ``-F`` (so every hop of a
  ProxyJump path gets it too: ssh passes -F, never -o, to the ssh it starts for a jump) that reads, in
  this order (the first value obtained wins in ssh_config):
    1. dfo's policy for every hop (``POLICY``): BatchMode, dfo's known_hosts first,
       HashKnownHosts no, UpdateHostKeys no, no CheckHostIP, keepalives, connect timeout, no tty,
       no forwardings, no RemoteCommand;
    2. the user's files: ``$DFO_SSH_CONFIG`` or the inventory's ``defaults.ssh_config`` alone (as
       ``ssh -F``), else ~/.ssh/config then /etc/ssh/ssh_config (as ssh reads them);
    3. the inventory's defaults: port and proxy_jump for this host's alias only (``Match originalhost``),
       user and identity for it and its ProxyJump hops: they fill what ssh_config leaves unset;
    4. dfo's cipher preference (``CIPHERS_FIRST``, ssh 8.1+): AES-GCM first, ssh's own default list after
       it, only where nothing above set Ciphers (a user's or the system's Ciphers line is used as it is);
       then StrictHostKeyChecking accept-new, so that `ssh -G` says the user's own setting where they made
       one (a connection's config then sets dfo's rule first: yes where theirs is yes, else accept-new).
  The host's own inventory fields (port, user, identity, proxy_jump) go on the command line as ``-o``,
  so they win over everything (and apply to the target only, as ``ssh -o`` does).
* The files live in dfo's own 0700 folder (``state_dir``): $XDG_RUNTIME_DIR/dfo-ssh, else
  $XDG_CACHE_HOME/dfo/ssh (~/.cache/dfo/ssh). The resolution config (1-3) is named by its content's
  hash and written once; a connection's own config (``conn_config``) adds, for every hop,
  UserKnownHostsFile = a fresh file of this connection's (new keys land there first), dfo's known_hosts,
  then the user's own known_hosts files (so keys the user's ssh already trusts are trusted), and
  StrictHostKeyChecking yes for the hops a @cert-authority line covers (a certificate, or a key recorded
  by hand; never first use), and for the hops whose user's setting is yes (their own known_hosts only:
  dfo is never less strict than the user's ssh).
* Connection sharing: ControlMaster auto, ControlPersist ``defaults.ssh_persist`` (60 s),
  ControlPath in dfo's folder (``cm-`` + a hash of user, host, port, path and config). With 0, no
  connection outlives the command: its calls share a master of its own, whose socket lives in the
  connection's own folder (removed at close) and which ends a second after its last call. A user whose
  ssh_config sets a ControlPath for the host keeps theirs (dfo passes none of its own). A master
  that does not answer the mux hello within MUX_PROBE_S is treated as dead: its socket is removed
  (dfo's own) or passed over (the user's), and the command goes over a fresh connection.
"""

from __future__ import annotations

import _thread
import errno
import hashlib
import math
import os
import re
import shlex
import shutil
import socket
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import cache_dir
from ..config.sshvalues import control_char, jump_problem, word_problem
from ..errors import ConfigError, HostError
from .openssh_early import state_dir, write_private

MIN_VERSION = (8, 0)
MUX_PROBE_S = 2.0  # a live master answers the mux hello at once; a hung one never does
G_TIMEOUT_S = 15.0  # `ssh -G` reads files only (Match exec may run a command)
MAX_HOPS = 8
# The ciphers dfo's own connections prefer where the user's ssh_config (and the system's) set no Ciphers:
# '^' puts them at the head of ssh's default list (OpenSSH 8.1 and newer: its release notes; an older ssh
# gets no preference), so every cipher the user's ssh allows
# stays allowed and a server without them still agrees on another. On a CPU with AES instructions
# (AES-NI, VAES; ARMv8 AES) AES-GCM costs both ends less CPU per byte than ssh's default,
# chacha20-poly1305: dfo pull of 1 GiB measured it (docs/benchmarks.md, "## pull").
CIPHERS_FIRST = "^aes128-gcm@openssh.com,aes256-gcm@openssh.com"
CIPHERS_FIRST_SINCE = (8, 1)


# ------------------------------------------------------------------------------------------ the binary

_WHICH: dict[str, str | None] = {}  # PATH -> its ssh: every host of a command asks, several times each


def ssh_binary() -> str | None:
    """The ``ssh`` on PATH (looked up once per PATH in a process; None when there is none)."""
    path = os.environ.get("PATH", "")
    if path not in _WHICH:
        _WHICH[path] = shutil.which("ssh")
    return _WHICH[path]


def ssh_version(path: str) -> tuple[int, int] | None:
    """OpenSSH's (major, minor) for the ssh at ``path`` (``ssh -V``, cached by the binary's stat), or None
    for a client that is not OpenSSH."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = f"{path}\0{st.st_size}\0{st.st_mtime_ns}"
    if key in _VERSIONS:
        return _VERSIONS[key]
    _VERSIONS[key] = got = _ssh_version(path, key)
    return got


_VERSIONS: dict[str, tuple[int, int] | None] = {}  # ssh_version's answers in this process, by the binary's stat


def _ssh_version(path: str, key: str) -> tuple[int, int] | None:
    cache = cache_dir() / "ssh-version"
    try:
        k, _, v = cache.read_text().partition("\n")
        if k == key:
            return _version(v)
    except (OSError, UnicodeDecodeError):
        pass
    try:
        r = subprocess.run([path, "-V"], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (r.stderr + r.stdout).strip().splitlines()[:1]
    got = text[0] if text else ""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = cache.with_name(f".ssh-version.{os.getpid()}.{_thread.get_ident()}")
        tmp.write_text(f"{key}\n{got}")
        os.replace(tmp, cache)
    except OSError:
        pass
    return _version(got)


def _version(text: str) -> tuple[int, int] | None:
    m = re.match(r"OpenSSH_(\d+)\.(\d+)", text.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def usable_ssh() -> str | None:
    """The path of an OpenSSH client >= 8.0 on PATH, or None."""
    path = ssh_binary()
    if path is None:
        return None
    v = ssh_version(path)
    return path if v is not None and v >= MIN_VERSION else None


# ------------------------------------------------------------------------------------------ config files

def q(value: str) -> str:
    """A value for an ssh_config line: double-quoted (ssh_config's own quoting; no '"' allowed in it, nor a
    control character: a newline would end the line and start directives of the value's own)."""
    if '"' in value or control_char(value) is not None:
        raise ConfigError(f"{value!r}: dfo cannot pass a value with '\"' or a control character to ssh_config")
    return f'"{value}"'


def bare(key: str, value: str) -> str:
    """A value that ssh_config (or ``ssh -o``) takes unquoted (Port, ProxyJump): one word, checked again here
    whatever the inventory's model let through (orchestrator/config/sshvalues.py), so that no value can end
    dfo's line and write directives of its own."""
    v = value.strip()
    why = jump_problem(v) if key == "ProxyJump" else word_problem(v, key)
    if why is not None:
        raise ConfigError(f"{key}: {why}", hint="fix it in the inventory")
    return v


def pct(value: str) -> str:
    """A path for a keyword that expands %-tokens (IdentityFile, UserKnownHostsFile, ControlPath)."""
    return value.replace("%", "%%")


def policy_lines(connect_timeout: float, interval: float, dead: float) -> list[str]:
    """dfo's rules for every hop (see the module's docstring). ServerAlive: a keepalive every
    ``interval`` s that wants an answer; ssh gives up at the first one past CountMax unanswered, so
    (CountMax + 1) x interval = ``dead`` (5 s and 20 s: 3), as the paramiko transport's liveness."""
    every = max(1, round(interval))
    count = max(1, math.ceil(dead / every) - 1)
    return [
        "  BatchMode yes",  # never a prompt: dfo has no terminal (passphrases: ssh-agent)
        "  HashKnownHosts no",  # dfo's known_hosts stays readable, one line per host
        "  UpdateHostKeys no",  # ssh never rewrites dfo's known_hosts
        "  CheckHostIP no",  # one line per host name, not name + address
        f"  ConnectTimeout {max(1, math.ceil(connect_timeout))}",
        f"  ServerAliveInterval {every}",
        f"  ServerAliveCountMax {count}",
        "  RequestTTY no",
        "  RemoteCommand none",
        "  ClearAllForwardings yes",
        "  PermitLocalCommand no",
        "  ForkAfterAuthentication no",
        "  LogLevel " + ("DEBUG" if os.environ.get("DFO_DEBUG") else "ERROR"),
    ]


@dataclass
class SshSetup:
    """Everything the OpenSSH transport needs for one inventory host, resolved by ``ssh -G``."""

    alias: str  # what ssh is given
    options: list[str]  # the host's own inventory fields, as -o KEY=VALUE (they win)
    config: Path  # the resolution config (policy + the user's files + the inventory's defaults)
    resolved: dict[str, list[str]] = field(default_factory=dict)  # ssh -G's answer: keyword -> values

    def one(self, key: str, default: str | None = None) -> str | None:
        v = self.resolved.get(key)
        return v[0] if v else default


def user_config_lines(explicit: str | None) -> list[str]:
    if explicit:
        return [f"Include {q(explicit)}"]
    return ["Include ~/.ssh/config", "Include /etc/ssh/ssh_config"]


def write_config(name: str, lines: list[str], *, folder: Path | None = None) -> Path:
    """Write a config file named by its content's hash (once), 0600 in dfo's folder; its path."""
    text = "\n".join(lines) + "\n"
    folder = folder or state_dir()
    path = folder / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:16]}.conf"
    # in use: write_private sets its time to now once a day (openssh_keys.clean_stale removes only files unused for
    # a week); never more often: its mtime is one of `ssh -G`'s inputs (_g_inputs), which key that answer's cache
    write_private(path, text)
    return path


def resolution_config(alias: str, explicit: str | None, policy: list[str], defaults: dict[str, str],
                      prefer_gcm: bool = True) -> Path:
    lines = ["# written by dfo (orchestrator/transport/openssh_setup.py): dfo's rules first, then your ssh_config,",
             "# then the inventory's defaults for this host. Rewritten when any of them changes.",
             "Host *", *policy, *user_config_lines(explicit)]
    own = {k: v for k, v in defaults.items() if k in ("Port", "ProxyJump")}
    every = {k: v for k, v in defaults.items() if k not in own}
    if own:  # the host's port and jump path: this host only (a jump host has its own)
        lines.append(f"Match originalhost {q(alias)}")
        lines += [f"  {k} {bare(k, v)}" for k, v in own.items()]
    if every:  # user and key: the hops of its ProxyJump path too, as the paramiko transport does
        lines.append("Host *")
        lines += [f"  {k} {q(v)}" for k, v in every.items()]
    # last, so that it counts only where nothing above set Ciphers (the first value obtained wins): AES-GCM
    # put at the head of ssh's own default list, nothing removed from it (see CIPHERS_FIRST)
    if prefer_gcm:
        lines += ["Host *", f"  Ciphers {CIPHERS_FIRST}"]
    # last as well: `ssh -G` then says the user's own StrictHostKeyChecking (accept-new where they set none);
    # each connection's config (openssh_keys.prepare) puts dfo's rule first: yes where the user's is yes,
    # accept-new for every other value (ask and no included: a new key recorded, a changed one refused)
    lines += ["Host *", "  StrictHostKeyChecking accept-new"]
    return write_config("resolve", lines)


G_CACHE_S = 3600.0  # a cached `ssh -G` answer is used for at most this long, even with its inputs unchanged
_G_ENV = ("HOME", "USER", "LOGNAME", "SSH_AUTH_SOCK", "PATH")  # what ssh -G reads of the environment
_INCLUDE = re.compile(r"^\s*include\s+(.+)$", re.I | re.M)
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_MATCH_EXEC = re.compile(r"^\s*match\b.*\b(exec|localnetwork)\b", re.I | re.M)  # answers that vary by themselves


G_INPUTS_S = 2.0  # _g_inputs is worked out once per config for this long: a command's hosts share it
_G_INPUTS: dict[tuple[str, str, tuple[tuple[str, str], ...]], tuple[float, str | None]] = {}


def _g_inputs_now(ssh: str, config: Path) -> str | None:
    """_g_inputs, kept for G_INPUTS_S in this process (64 hosts read the same files once, not 64 times; a
    long-lived command such as dfo watch still sees a change to the user's ssh_config seconds later)."""
    key = (ssh, str(config), tuple(sorted(os.environ.items())))  # every ${VAR} the files may name
    now = time.monotonic()
    got = _G_INPUTS.get(key)
    if got is not None and now - got[0] < G_INPUTS_S:
        return got[1]
    text = _g_inputs(ssh, config)
    _G_INPUTS[key] = (now, text)
    return text


def _g_inputs(ssh: str, config: Path) -> str | None:
    """What `ssh -G` reads, as one text (its hash keys the cache), or None where its answer cannot be
    cached: a ``Match exec`` (runs a command: anything may change its answer) or a file that cannot be
    read. The files: dfo's resolution config (named by its content) and every file it includes, Include by
    Include (globs, relative to ~/.ssh or /etc/ssh as ssh reads them), each by path, size, mtime and inode,
    plus each folder a glob reads (a file added there changes its mtime); ssh's binary; the environment
    ssh reads (HOME, USER, the agent's socket, and every ${VAR} the files name); this machine's name and
    user (%l, %u)."""
    import glob

    parts = [f"ssh {ssh}", f"host {socket.gethostname()} uid {os.getuid()}"]
    try:
        st = os.stat(ssh)
        parts.append(f"bin {st.st_size} {st.st_mtime_ns}")
    except OSError:
        return None
    seen: set[str] = set()
    todo = [(str(config), Path.home() / ".ssh")]
    names: set[str] = set(_G_ENV)
    while todo:
        path, rel = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        try:
            st = os.stat(path)
            text = Path(path).read_text(errors="replace")
        except FileNotFoundError:
            parts.append(f"missing {path}")
            continue
        except OSError:
            return None
        parts.append(f"file {path} {st.st_size} {st.st_mtime_ns} {st.st_ino}")
        if _MATCH_EXEC.search(text):  # a command's answer (or the network's) can change with nothing here
            return None
        names.update(_ENV_REF.findall(text))
        for m in _INCLUDE.finditer(text):
            for word in shlex.split(m.group(1), comments=True):
                word = os.path.expanduser(word.strip('"'))
                if not os.path.isabs(word):
                    word = str(rel / word)
                if any(c in word for c in "*?["):
                    folder = os.path.dirname(word)
                    try:
                        parts.append(f"dir {folder} {os.stat(folder).st_mtime_ns}")
                    except OSError:
                        parts.append(f"missing {folder}")
                    matched = sorted(glob.glob(word))
                else:
                    matched = [word]
                # a file the user's config includes is read relative to ~/.ssh, the system's to /etc/ssh
                base = Path("/etc/ssh") if word.startswith("/etc/ssh") or str(rel) == "/etc/ssh" else rel
                todo += [(f, base) for f in matched]
    parts += [f"env {k}={os.environ.get(k, '')}" for k in sorted(names)]
    return "\n".join(parts)


def ssh_g(ssh: str, config: Path, alias: str, options: list[str], where: str) -> dict[str, list[str]]:
    """``ssh -G``: the settings ssh would use for ``alias`` (every keyword lower-case, its values). Its answer
    is kept in dfo's ssh folder, keyed on everything ssh read to give it (``_g_inputs``), and used again while
    none of that changed (at most G_CACHE_S): a warm command starts no `ssh -G` (issue 35)."""
    import json

    inputs = None if os.environ.get("DFO_SSH_G_CACHE") == "0" else _g_inputs_now(ssh, config)
    cached: Path | None = None
    if inputs is not None:
        key = hashlib.sha256("\0".join([inputs, alias, *options]).encode()).hexdigest()[:32]
        cached = state_dir() / "g" / f"{key}.json"
        try:
            if time.time() - cached.stat().st_mtime < G_CACHE_S:
                doc = json.loads(cached.read_text())
                if isinstance(doc, dict) and all(isinstance(v, list) for v in doc.values()):
                    return {str(k): [str(x) for x in v] for k, v in doc.items()}
        except (OSError, ValueError):
            pass
    out = _ssh_g(ssh, config, alias, options, where)
    if cached is not None:
        try:
            cached.parent.mkdir(mode=0o700, exist_ok=True)
            if not write_private(cached, json.dumps(out)):
                os.utime(cached)  # the same answer again: fresh for another G_CACHE_S
        except OSError:
            pass  # no cache: the next command asks ssh again
    return out


def _ssh_g(ssh: str, config: Path, alias: str, options: list[str], where: str) -> dict[str, list[str]]:
    argv = [ssh, "-G", "-F", str(config)]
    for o in options:
        argv += ["-o", o]
    argv += ["--", alias]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=G_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise HostError(f"`ssh -G {alias}` did not answer within {G_TIMEOUT_S:g}s",
                        hint="a Match exec in your ssh_config may hang") from None
    if r.returncode != 0:
        msg = " | ".join(ln.strip() for ln in r.stderr.splitlines() if ln.strip())[-400:]
        raise ConfigError(f"ssh cannot read its configuration for {alias}: {msg or f'exit {r.returncode}'}",
                          hint=f"fix the line it names (see ssh_config(5)); dfo's ssh_config: {where}")
    out: dict[str, list[str]] = {}
    for line in r.stdout.splitlines():
        k, _, v = line.partition(" ")
        out.setdefault(k.lower(), []).append(v)
    return out


def resolve(alias: str, options: list[str], defaults: dict[str, str], explicit: str | None,
            connect_timeout: float) -> tuple[Path, dict[str, list[str]]]:
    """(the resolution config, ``ssh -G``'s answer) for an inventory host on the OpenSSH transport."""
    from .liveness import bounds

    ssh = usable_ssh()
    if ssh is None:
        raise ConfigError("transport: openssh needs an OpenSSH client (ssh 8.0 or newer) on PATH",
                          hint="install one (Debian/Ubuntu: openssh-client), or set transport: paramiko")
    b = bounds()
    v = ssh_version(ssh)
    config = resolution_config(alias, explicit, policy_lines(connect_timeout, b.interval, b.dead), defaults,
                               prefer_gcm=v is not None and v >= CIPHERS_FIRST_SINCE)
    return config, ssh_g(ssh, config, alias, options, explicit or "~/.ssh/config and /etc/ssh/ssh_config")


def label(hostname: str, port: int) -> str:
    return hostname if int(port) == 22 else f"[{hostname}]:{port}"


def jump_hops(spec: str) -> list[tuple[str | None, str, int | None]]:
    """``[user@]host[:port],...`` (or ssh:// URIs) as (user, host, port) per hop, in order."""
    hops = []
    for raw in (h.strip() for h in spec.split(",")):
        if not raw:
            continue
        if raw.startswith("ssh://"):
            raw = raw[len("ssh://"):]
        user, _, rest = raw.rpartition("@")
        port: int | None = None
        m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:]+)(?::(\d+))?", rest)
        if m:
            host = m.group(1) or m.group(3)
            p = m.group(2) or m.group(4)
            port = int(p) if p else None
        else:
            host = rest
        hops.append((user or None, host, port))
    return hops


# ------------------------------------------------------------------------------------------ shared masters

def master_answers(path: str, timeout: float = MUX_PROBE_S) -> bool | None:
    """Whether a ControlMaster listens at ``path`` and answers the mux hello: True; no socket or a
    stale one (nobody listens: ssh replaces it): None; a socket whose master does not answer
    (stopped, hung): False."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTSOCK):
                return None
            return False
        # MUX_MSG_HELLO (1), protocol version 4, as a packet: uint32 length, then the body
        s.sendall(struct.pack(">III", 8, 1, 4))
        deadline = time.monotonic() + timeout
        got = b""
        while len(got) < 12 and time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = s.recv(12 - len(got))
            if not chunk:
                return False
            got += chunk
        return len(got) == 12 and struct.unpack(">I", got[4:8])[0] == 1
    except OSError:
        return False
    finally:
        s.close()


def known_hosts_value(files: list[str]) -> str:
    return " ".join(q(pct(f)) for f in files)


def quote_cmd(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
