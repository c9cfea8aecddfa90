"""dfo's known_hosts file, read strictly and appended to, never rewritten (standard library only).

OpenSSH's format (sshd(8), "SSH_KNOWN_HOSTS FILE FORMAT"): one key per line,
``[@marker] hostnames keytype base64-key [comment]``; blank lines and ``#`` comments.

* Every line is kept as it is: comments, ``sk-*`` and other key types, markers. dfo only ever
  appends a new line (O_APPEND + fsync, under the caller's locks), so nothing it does not
  understand is lost.
* A line dfo cannot read (too few fields, a key that is not valid base64 or whose blob is cut
  short, an unknown ``@marker``, a bad hashed name) is an error naming FILE:LINE (exit 2). It is
  never skipped: a skipped line would make its host look new, and accept-new would trust
  whatever key the host offers next.
* Host names match as OpenSSH matches them: comma-separated patterns with ``*`` and ``?``,
  ``!pattern`` negation, case-insensitive; hashed names ``|1|salt|hash`` (HMAC-SHA1).
  A host on a port other than 22 is written ``[host]:port``.
* ``@revoked`` key: refused for every host (sshd(8): "must not ever be accepted").
* ``@cert-authority``: kept, and never taken for a host's own key. The OpenSSH transport lets ssh
  verify host certificates against them; where one covers a host, neither transport trusts a plain
  key there on first use (the paramiko transport, which cannot check certificates, refuses such a
  host unless its key was recorded by hand: hostkeys.py).
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import re
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

KH_LOCK = threading.Lock()  # held (with flock on FILE.lock) while a key is added to dfo's known_hosts

MARKERS = ("@cert-authority", "@revoked")

# How many SSH strings (uint32 length + bytes) make a public key blob of each type, the type name
# included: a blob with fewer, more, or a cut-off last one is a damaged line.
_BLOB_FIELDS = {
    "ssh-ed25519": 2, "sk-ssh-ed25519@openssh.com": 3,
    "ecdsa-sha2-nistp256": 3, "ecdsa-sha2-nistp384": 3, "ecdsa-sha2-nistp521": 3,
    "sk-ecdsa-sha2-nistp256@openssh.com": 4,
    "ssh-rsa": 3, "ssh-dss": 5,
}


@dataclass(frozen=True)
class Entry:
    lineno: int
    marker: str | None  # None, "@cert-authority" or "@revoked"
    hosts: str  # the hostnames field as written
    key_type: str
    blob: bytes

    def matches(self, label: str) -> bool:
        return host_matches(self.hosts, label)


class KnownHostsError(ConfigError):
    """A line of a known_hosts file that dfo cannot read (exit 2)."""

    def __init__(self, path: str, lineno: int, why: str) -> None:
        super().__init__(f"{path}:{lineno}: unreadable known_hosts line: {why}",
                         hint="fix or delete that line (it is never skipped: its host would look new and be "
                              "trusted anew)")
        self.path = path
        self.lineno = lineno


def _strings(blob: bytes) -> list[bytes] | None:
    """The blob as SSH strings, or None when it is not exactly a sequence of them."""
    out, i = [], 0
    while i < len(blob):
        if i + 4 > len(blob):
            return None
        (n,) = struct.unpack(">I", blob[i:i + 4])
        if i + 4 + n > len(blob):
            return None
        out.append(blob[i + 4:i + 4 + n])
        i += 4 + n
    return out


def _check_blob(key_type: str, blob: bytes) -> str | None:
    """Why this key blob is damaged, or None when it is whole."""
    if len(blob) < 4:
        return "the key is empty or cut short"
    (n,) = struct.unpack(">I", blob[:4])
    if blob[4:4 + n] != key_type.encode():
        return f"the key's data does not start with its type {key_type}"
    if key_type.endswith("-cert-v01@openssh.com"):
        return None  # certificates hold fixed-size fields too; their type prefix is all we check
    fields = _strings(blob)
    want = _BLOB_FIELDS.get(key_type)
    if fields is None or (want is not None and len(fields) != want):
        return "the key is cut short or has extra bytes"
    if key_type in ("ssh-ed25519", "sk-ssh-ed25519@openssh.com") and len(fields[1]) != 32:
        return "the ed25519 key is not 32 bytes"
    return None


def _b64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def parse_line(line: str) -> tuple[str | None, str, str, bytes] | str | None:
    """(marker, hosts, key_type, blob) for a key line, None for a blank or comment line, or a string
    saying why the line is damaged."""
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    fields = text.split()
    marker = None
    if fields[0].startswith("@"):
        if fields[0] not in MARKERS:
            return f"unknown marker {fields[0][:40]!r} (known: {', '.join(MARKERS)})"
        marker = fields.pop(0)
    if len(fields) < 3:
        return "expected [marker] hostnames keytype base64-key [comment]; the line is cut short"
    hosts, key_type, key = fields[0], fields[1], fields[2]
    if hosts.startswith("|"):
        why = _check_hashed(hosts)
        if why:
            return why
    try:
        blob = _b64(key)
    except (binascii.Error, ValueError):
        return "the key is not valid base64 (cut short?)"
    why = _check_blob(key_type, blob)
    if why:
        return why
    return marker, hosts, key_type, blob


def _check_hashed(hosts: str) -> str | None:
    parts = hosts.split("|")
    if len(parts) != 4 or parts[1] != "1":
        return "a hashed host name must read |1|salt|hash"
    try:
        salt, digest = _b64(parts[2]), _b64(parts[3])
    except (binascii.Error, ValueError):
        return "the hashed host name is not valid base64"
    if len(salt) != 20 or len(digest) != 20:
        return "the hashed host name has a salt or hash of the wrong length"
    return None


def _glob(pattern: str, name: str) -> bool:
    """OpenSSH's match_pattern: only * and ? are special (so [host]:port is literal)."""
    if "*" not in pattern and "?" not in pattern:
        return pattern == name  # most lines: a name (a fleet's known_hosts is matched line by line, host by host)
    return _glob_rx(pattern).fullmatch(name) is not None


@functools.lru_cache(maxsize=1024)
def _glob_rx(pattern: str) -> re.Pattern[str]:
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern), re.DOTALL)


def host_matches(hosts: str, label: str) -> bool:
    """Whether a hostnames field (patterns, or one hashed name) covers ``label``."""
    if hosts.startswith("|1|"):
        _, _, salt, digest = hosts.split("|")
        mac = hmac.new(_b64(salt), label.encode(), hashlib.sha1).digest()
        return hmac.compare_digest(mac, _b64(digest))
    name = label.lower()
    hit = False
    for pat in hosts.lower().split(","):
        if pat.startswith("!"):
            if _glob(pat[1:], name):
                return False  # a negated match excludes the line whatever else matches
        elif _glob(pat, name):
            hit = True
    return hit


class KnownHosts:
    """The readable contents of one known_hosts file (an absent file is an empty one)."""

    def __init__(self, path: str, entries: list[Entry]) -> None:
        self.path = path
        self.entries = entries

    @classmethod
    def cached(cls, path: str) -> KnownHosts:
        """``load``, parsed once per process while the file stays as it is (its size, mtime and inode): a command
        on a fleet reads dfo's known_hosts for every host. Read-only: a writer loads the file itself, under
        its lock."""
        try:
            return _parsed("dfo", path, lambda: cls.load(path))
        except OSError:  # no stat to key it on: read as it is
            return cls.load(path)

    @classmethod
    def load(cls, path: str) -> KnownHosts:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8", errors="surrogateescape")
        except FileNotFoundError:
            return cls(path, [])
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read dfo's known_hosts: {exc.strerror or exc}",
                              hint="check the file's permissions, or point defaults.known_hosts elsewhere") from None
        entries = []
        for n, line in enumerate(text.splitlines(), 1):
            got = parse_line(line)
            if isinstance(got, str):
                raise KnownHostsError(path, n, got)
            if got is not None:
                entries.append(Entry(n, *got))
        return cls(path, entries)

    def revoked(self, blob: bytes) -> Entry | None:
        """The @revoked line for this key, if any (whatever host names it carries)."""
        return next((e for e in self.entries if e.marker == "@revoked" and e.blob == blob), None)

    def recorded(self, label: str) -> list[Entry]:
        """The plain lines for this host, in file order, less any key that is also @revoked."""
        revoked = {e.blob for e in self.entries if e.marker == "@revoked"}
        return [e for e in self.entries if e.marker is None and e.blob not in revoked and e.matches(label)]


def fingerprint(blob: bytes) -> str:
    """ssh-keygen's SHA256 fingerprint of a key blob."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")


# KnownHosts.cached and lenient: each file's last parse, with the stat it was made under (size, mtime, ctime, inode:
# a write, a rename over it or a utime changes one of them)
_PARSED: dict[tuple[str, str], tuple[tuple[int, ...], KnownHosts]] = {}
_PARSED_LOCK = threading.Lock()


def _parsed(kind: str, path: str, parse: Callable[[], KnownHosts]) -> KnownHosts:
    """``parse()``'s answer for ``path``, made again only when the file's stat changed (OSError: no stat)."""
    st = os.stat(path)
    key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    with _PARSED_LOCK:
        kept = _PARSED.get((kind, path))
    if kept is not None and kept[0] == key:
        return kept[1]
    got = parse()
    with _PARSED_LOCK:
        _PARSED[(kind, path)] = (key, got)
    return got


def lenient(path: str) -> list[Entry]:
    """The lines of a known_hosts file that is not dfo's (the user's, the system's): unreadable lines skipped,
    as ssh does; an absent or unreadable file is empty. Parsed once per process while the file stays as it is."""
    try:
        return list(_parsed("lenient", path, lambda: KnownHosts(path, _lenient(path))).entries)
    except OSError:  # absent or unreadable
        return []


def _lenient(path: str) -> list[Entry]:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return []
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        got = parse_line(line)
        if got is not None and not isinstance(got, str):
            out.append(Entry(n, *got))
    return out


def holding(files: list[str], label: str) -> list[tuple[str, Entry]]:
    """(file, line) of every plain key line for ``label`` in ``files`` (each file once, in order; a key that
    one of them marks @revoked left out, as ``recorded`` does)."""
    got = [(f, e) for f in dict.fromkeys(files) for e in lenient(f)]
    revoked = {e.blob for _, e in got if e.marker == "@revoked"}
    return [(f, e) for f, e in got if e.marker is None and e.blob not in revoked and e.matches(label)]


def changed(label: str, offered: str, kind: str, old: list[tuple[str, Entry]]) -> tuple[str, str]:
    """(message, hint) for a host key that changed: every file and line that holds an old key for ``label``
    (``old``, in the order ssh reads them), and one ``ssh-keygen -R`` per file."""
    import shlex

    by_fp: dict[str, list[str]] = {}
    for f, e in old:
        by_fp.setdefault(fingerprint(e.blob), []).append(f"{f}:{e.lineno}")
    recorded = ", ".join(f"{fp} ({', '.join(where)})" for fp, where in by_fp.items()) or "?"
    files = list(dict.fromkeys(f for f, _ in old))
    forget = "; ".join(f"ssh-keygen -R {shlex.quote(label)} -f {shlex.quote(f)}" for f in files)
    return (f"host key for {label} CHANGED: recorded {recorded}, offered {offered} ({kind}); nothing was run",
            f"if the node was really rebuilt, forget the old key{' in each file' if len(files) > 1 else ''} "
            f"with: {forget}")


def append(path: str, label: str, key_type: str, blob: bytes) -> None:
    """Add ``label key_type base64`` as the file's new last line; the caller holds the file's locks.

    Never rewrites the file: O_APPEND, after a newline if the file does not end with one, then
    fsync. A new file is created 0600 (and its folder fsynced)."""
    p = Path(path)
    created = not p.exists()
    fd = os.open(p, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        size = os.fstat(fd).st_size
        lead = b"\n" if size and os.pread(fd, 1, size - 1) != b"\n" else b""
        line = f"{label} {key_type} {base64.b64encode(blob).decode()}\n".encode()
        os.write(fd, lead + line)
        os.fsync(fd)
    finally:
        os.close(fd)
    if created:
        dfd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
