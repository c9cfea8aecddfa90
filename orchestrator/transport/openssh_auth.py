"""Why ssh's login was refused, from what it said (``Permission denied (METHODS)``) and what this machine holds:
the fix each case needs, in errors.AUTH_HINTS' words (the paramiko transport's table).

dfo runs ssh with BatchMode (it never prompts: no terminal of dfo's, no askpass), at LogLevel ERROR, so ssh
says only which methods the node still accepts. From that and the user's keys:

* ``publickey`` no longer listed but ``password`` or ``keyboard-interactive`` are: the node took the key (or
  wants none) and asks for a password or one-time code: a second factor. ``dfo login -H HOST`` types it once.
* ``publickey`` listed, and a key ssh would offer (ssh -G's IdentityFile) is encrypted and no agent holds
  it (SSH_AUTH_SOCK or IdentityAgent): BatchMode skipped it. ``ssh-add KEY``, or dfo login to type the
  passphrase once.
* else the node refused the keys offered (authorized_keys), and says when it would take a password too.

Keys are read here with the standard library only (the OpenSSH path imports no paramiko): an OpenSSH-format
private key says its cipher in the clear, a PEM key says ``Proc-Type: 4,ENCRYPTED``; the agent is asked
for its identities over its socket (SSH_AGENTC_REQUEST_IDENTITIES), and a key's public half comes from the
private key file (OpenSSH format: in the clear) or KEY.pub.
"""

from __future__ import annotations

import base64
import binascii
import os
import socket
import struct
from pathlib import Path

from ..config.inventory import ResolvedHost
from ..errors import AuthFailed

_INTERACTIVE = ("password", "keyboard-interactive")
_MAGIC = b"openssh-key-v1\x00"


def _strings(blob: bytes, count: int) -> list[bytes] | None:
    out, i = [], 0
    for _ in range(count):
        if i + 4 > len(blob):
            return None
        (n,) = struct.unpack(">I", blob[i:i + 4])
        out.append(blob[i + 4:i + 4 + n])
        i += 4 + n
    return out


def key_state(path: str) -> tuple[bool, bytes | None] | None:
    """(encrypted?, the public key's blob or None) of a private key file; None when it is not one (or
    cannot be read)."""
    try:
        with open(path, "rb") as f:
            text = f.read(65536)
    except OSError:
        return None
    pub = _pub_file(path)
    if b"-----BEGIN OPENSSH PRIVATE KEY-----" in text:
        body = b"".join(ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(b"-----"))
        try:
            raw = base64.b64decode(body)
        except (binascii.Error, ValueError):
            return None
        if not raw.startswith(_MAGIC):
            return None
        # cipher name, kdf name, kdf options, then uint32 count and the first public key, all in the clear
        got = _strings(raw[len(_MAGIC):], 3)
        if got is None:
            return None
        rest = raw[len(_MAGIC) + sum(4 + len(x) for x in got) + 4:]
        first = _strings(rest, 1)
        return got[0] != b"none", (first[0] if first else None) or pub
    if b"-----BEGIN" in text and b"PRIVATE KEY-----" in text:
        return (b"Proc-Type: 4,ENCRYPTED" in text or b"BEGIN ENCRYPTED PRIVATE KEY" in text), pub
    return None


def _pub_file(path: str) -> bytes | None:
    try:
        words = Path(path + ".pub").read_text(errors="replace").split()
        return base64.b64decode(words[1]) if len(words) >= 2 else None
    except (OSError, binascii.Error, ValueError):
        return None


def agent_keys(sock: str | None, timeout: float = 2.0) -> set[bytes] | None:
    """The public key blobs an ssh-agent at ``sock`` holds; None when there is no agent that answers."""
    if not sock:
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(sock)
        s.sendall(struct.pack(">IB", 1, 11))  # SSH_AGENTC_REQUEST_IDENTITIES
        head = recv_exact(s, 4)
        (n,) = struct.unpack(">I", head)
        body = recv_exact(s, min(n, 1 << 22))
    except (OSError, struct.error, ValueError):
        return None
    finally:
        s.close()
    if not body or body[0] != 12:  # SSH_AGENT_IDENTITIES_ANSWER
        return None
    (count,) = struct.unpack(">I", body[1:5])
    got = _strings(body[5:], 2 * count)
    return {got[i] for i in range(0, len(got), 2)} if got else set()


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``s`` (an agent's or a master's unix socket); ValueError when it closes first."""
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ValueError("the agent closed the connection")
        buf += chunk
    return buf


def _agent_socket(host: ResolvedHost) -> str | None:
    """The agent ssh would ask: IdentityAgent (ssh -G), where SSH_AUTH_SOCK (its default) means the variable."""
    value = (host.ssh_resolved.get("identityagent") or ["SSH_AUTH_SOCK"])[0]
    if value.lower() == "none":
        return None
    if value in ("SSH_AUTH_SOCK", "$SSH_AUTH_SOCK", "${SSH_AUTH_SOCK}"):
        return os.environ.get("SSH_AUTH_SOCK") or None
    if value.startswith("$"):
        return os.environ.get(value.strip("${}")) or None
    return _expand(value)


def _expand(path: str) -> str:
    """``~`` and the %-tokens ssh expands in a key's path that this machine alone decides (%d, %u, %%)."""
    import pwd

    home = os.path.expanduser("~")
    try:
        me = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        me = ""
    out = path.replace("%%", "\0").replace("%d", home).replace("%u", me).replace("\0", "%")
    return os.path.expanduser(out)


def locked_key(host: ResolvedHost) -> str | None:
    """The first key ssh would offer (IdentityFile, in order) that is encrypted and that no agent holds."""
    held = agent_keys(_agent_socket(host)) or set()
    for raw in host.ssh_resolved.get("identityfile", []):
        if "%" in raw.replace("%%", "").replace("%d", "").replace("%u", ""):
            continue  # a token of the host's (%h, %r...): not this machine's to guess
        path = _expand(raw)
        state = key_state(path)
        if state is not None and state[0] and (state[1] is None or state[1] not in held):
            return path
    return None


def refused(host: ResolvedHost, who: str, methods: str) -> AuthFailed:
    """The error for ``Permission denied (METHODS)``: the fix that this case needs."""
    accepts = [m.strip() for m in methods.split(",") if m.strip()]
    asks = [m for m in accepts if m in _INTERACTIVE]
    if asks and "publickey" not in accepts:
        return AuthFailed(f"authentication failed for {who}: the node asks for a password or one-time code "
                          f"({', '.join(asks)}), which dfo never types", reason="second_factor", host=host.name,
                          login=host.name)
    key = locked_key(host) if "publickey" in accepts else None
    if key is not None:
        return AuthFailed(f"authentication failed for {who} (it accepts: {methods})", reason="encrypted_key",
                          host=host.name, key=key, login=host.name)
    err = AuthFailed(f"authentication failed for {who} (it accepts: {methods})", reason="refused", host=host.name)
    if asks:
        err.hint = f"{err.hint}; it takes a password too: `dfo login -H {host.name}` asks for it once"
    return err
