"""ssh's failures (exit 255 without the command's exit marker) as dfo's errors, from what ssh wrote on
stderr (LogLevel ERROR: its errors only). Every one is exit 4 (HostError) but a broken ssh_config (exit 2):

* a changed, revoked or unverifiable host key, on the target or any hop: HostKeyError naming that
  hop (ssh names it), with the known_hosts line and both fingerprints where ssh gives them;
* the link or the node gone while a command ran (ServerAlive gave up, the master ended, a reset):
  ConnectionLost, the same error the paramiko transport raises;
* refused, unreachable, no answer, a name that does not resolve, authentication: HostError with
  what to do.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from ..config.inventory import ResolvedHost
from ..errors import AuthFailed, ConfigError, ConnectionLost, DfoError, HostError, HostKeyError
from .known_hosts import fingerprint, parse_line

LOST_HINT = ("once the node answers again, run the same command again "
             "(provision, stage-model and sync-data resume where they stopped)")
_MUX = ("mux_client_request_session", "mux_client_hello_exchange", "Control socket connect",
        "mux_client_forward", "master hello")


def mux_failed_before_session(text: str) -> bool:
    """ssh's shared connection (ControlMaster) failed before the session opened: nothing ran."""
    return any(m in text for m in _MUX)


def _line_fp(path: str, lineno: int) -> str | None:
    try:
        line = Path(path).read_text(errors="replace").splitlines()[lineno - 1]
    except (OSError, IndexError):
        return None
    got = parse_line(line)
    return fingerprint(got[3]) if got is not None and not isinstance(got, str) else None


def _changed(host: ResolvedHost, prep: Any, text: str) -> HostKeyError:
    """A changed key: every file and line that holds an old key for the host (ssh names only the first it
    met), each with its `ssh-keygen -R`."""
    from .known_hosts import changed, holding
    from .openssh_keys import _files, key_kind

    label = _find(r"Host key for (\S+) has changed", text) or host.hostname
    kind = _find(r"The fingerprint for the (\S+) key sent", text) or "?"
    offered = _find(r"sent by the remote host is\s+(SHA256:[A-Za-z0-9+/=]+)", text) or "?"
    strict = next((files for _, lab, files in getattr(prep, "user_strict", []) if lab == label), None)
    files = strict if strict is not None else [host.known_hosts, *_files(host, "userknownhostsfile")]
    files += _files(host, "globalknownhostsfile")
    old = [(f, e) for f, e in holding(files, label)
           if key_kind(e.key_type) == kind and fingerprint(e.blob) != offered]
    if not old:  # nothing readable here says it: ssh's own words (the first file it met)
        where = re.search(r"Offending \S+ key in (.+?):(\d+)\s*$", text, re.M)
        recorded, at, path = "?", "", host.known_hosts
        if where:
            path, n = where.group(1), int(where.group(2))
            recorded, at = _line_fp(path, n) or "?", f" ({path}:{n})"
        return HostKeyError(f"host key for {label} CHANGED: recorded {recorded}{at}, offered {offered} ({kind}); "
                            "nothing was run", host=host.name,
                            hint="if the node was really rebuilt, forget the old key with: "
                                 f"ssh-keygen -R {shlex.quote(label)} -f {shlex.quote(path)}")
    message, hint = changed(label, offered, kind, old)
    return HostKeyError(message, host=host.name, hint=hint)


def _revoked(host: ResolvedHost, prep: Any, text: str) -> HostKeyError:
    kind = _find(r"The (\S+) host key for \S+ is marked as revoked", text) or "?"
    label = _find(r"host key for (\S+) is marked as revoked", text) or host.hostname
    from .known_hosts import KnownHosts
    from .openssh_keys import key_kind

    lines = [f"{host.known_hosts}:{e.lineno}" for e in KnownHosts.load(host.known_hosts).entries
             if e.marker == "@revoked" and key_kind(e.key_type) == kind]
    at = f" ({', '.join(lines)})" if lines else ""
    return HostKeyError(f"host key for {label} is REVOKED{at} ({kind}); nothing was run", host=host.name,
                        hint="a @revoked key is never accepted; check the node's real key out of band "
                             "(is it compromised, or was it rebuilt?)")


def _unverified(host: ResolvedHost, prep: Any, text: str) -> HostKeyError:
    from .openssh_keys import covering

    label = _find(r"host key is known for (\S+) and you have requested strict checking", text) or host.hostname
    name = label[1:label.index("]")] if label.startswith("[") and "]" in label else label
    port = int(label.rsplit(":", 1)[1]) if label.startswith("[") and "]:" in label else 22
    cert = _find(r"(Certificate invalid: [^\r\n]+)", text)
    ca = covering(getattr(prep, "ca", []), name, port)
    if ca is not None:
        path, entry = ca
        return HostKeyError(
            f"host key for {label}: no valid certificate from the CA that covers it ({path}:{entry.lineno})"
            + (f" ({cert})" if cert else "") + ", and no key recorded for it; a plain key is never trusted on "
            "first use where a @cert-authority line applies; nothing was run", host=host.name,
            hint="give the node a host certificate signed by that CA (sshd_config HostCertificate), or, if you "
                 f"trust its key, record it in {host.known_hosts} yourself")
    strict = getattr(prep, "user_strict", [])
    mine = next((s for s in strict if s[1] == label), strict[0] if len(strict) == 1 else None)
    if mine is not None:  # the user's own StrictHostKeyChecking yes: their ssh would refuse it as well
        theirs = mine[2][0] if mine[2] else "~/.ssh/known_hosts"
        scan = f"ssh-keyscan {'-p ' + str(port) + ' ' if port != 22 else ''}{shlex.quote(name)}"
        return HostKeyError(
            f"host key for {label} is not in your known_hosts ({theirs}), and your ssh_config says "
            f"StrictHostKeyChecking yes for {mine[0]}: dfo is never less strict than your ssh; nothing was run",
            host=host.name,
            hint=f"check the node's key out of band, then add it to {theirs} (`{scan}` prints it: compare its "
                 "fingerprint first), or let dfo record it on first use: StrictHostKeyChecking accept-new for "
                 "this host")
    return HostKeyError(f"host key for {label} is not known and ssh was told to check strictly"
                        + (f" ({cert})" if cert else "") + "; nothing was run", host=host.name,
                        hint="check StrictHostKeyChecking in your ssh_config")


def _find(rx: str, text: str) -> str | None:
    m = re.search(rx, text, re.I)
    return m.group(1) if m else None


def _last(text: str, n: int = 3) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("@@@")]
    return " | ".join(lines[-n:])[-400:]


def classify(host: ResolvedHost, prep: Any, text: str) -> DfoError:
    """The error for an ssh that exited 255 without running the command to its end."""
    text = text.replace("\r", "")
    who = f"{host.user + '@' if host.user else ''}{host.hostname}"
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or re.search(r"Host key for \S+ has changed", text):
        return _changed(host, prep, text)
    if "REVOKED HOST KEY" in text or "was revoked" in text:
        return _revoked(host, prep, text)
    if "host key is known for" in text:
        return _unverified(host, prep, text)
    if "Host key verification failed" in text:
        return HostKeyError(f"host key of {host.hostname} (or a hop) could not be verified: {_last(text)}; "
                            "nothing was run", host=host.name)
    m = re.search(r"^(?:ssh: )?(\S+ line \d+: .+|Bad owner or permissions on .+|Can't open user config file .+)$",
                  text, re.M)
    if m:
        return ConfigError(f"ssh cannot read its configuration: {m.group(1)}", host=host.name,
                           hint="fix that file (see ssh_config(5)), then check with `ssh -G HOST`")
    m = re.search(r"^(\S+): Permission denied \(([^)]*)\)", text, re.M)
    many = re.search(r"Received disconnect from (\S+) port (\d+).*Too many authentication failures", text)
    if many:
        who = m.group(1) if m else f"{host.user}@{many.group(1)}"
        return AuthFailed(f"authentication failed for {who} (too many keys offered)", reason="too_many_keys",
                          host=host.name)
    if m:  # what the node still accepts says which fix it needs (openssh_auth)
        from .openssh_auth import refused

        return refused(host, m.group(1), m.group(2))
    m = re.search(r"Could not resolve hostname (\S+?):", text)
    if m:
        return HostError(f"{m.group(1)}: the host name does not resolve", host=host.name,
                         hint="check the host name (inventory host:, or HostName in ~/.ssh/config for an alias), "
                              "and that DNS answers for it here")
    m = re.search(r"connect to host (\S+) port (\d+): (.+)$", text, re.M)
    if m:
        where, why = f"{m.group(1)}:{m.group(2)}", m.group(3).strip()
        if "refused" in why:
            return HostError(f"{where} refused the connection", host=host.name,
                             hint="is sshd running there, and is the port right (inventory port / ~/.ssh/config "
                                  "Port)?")
        if "timed out" in why.lower():
            return HostError(f"{where} did not answer within {host.connect_timeout:g}s", host=host.name,
                             hint="is the node up and the port right? (defaults.connect_timeout sets the limit)")
        return HostError(f"{where} is unreachable ({why})", host=host.name,
                         hint="is the node up and its address right? (a link that just came back can take a few "
                              "seconds)")
    if "banner exchange" in text or "kex_exchange_identification" in text:
        return HostError(f"cannot connect to {who}: {_last(text, 2)}", host=host.name,
                         hint="is sshd there healthy (not overloaded, not a firewall answering)?")
    if re.search(r"channel \d+: open failed|stdio forwarding failed", text):
        return HostError(f"a jump host could not reach the next hop to {who}: {_last(text, 2)}", host=host.name,
                         hint="is the target up, and does the jump host allow TCP forwarding (AllowTcpForwarding)?")
    m = re.search(r"Timeout, server (\S+) not responding", text)
    if m:
        return ConnectionLost(f"connection lost: {m.group(1)} did not answer ssh's keepalives (the link is down, "
                              "or the node or its sshd hung)", host=host.name, hint=LOST_HINT)
    detail = _last(text, 2)
    return ConnectionLost("connection lost: the connection closed while a command ran, or the node stopped "
                          "answering its keepalives (the link is down, or the node or its sshd hung)"
                          + (f": {detail}" if detail else ""), host=host.name, hint=LOST_HINT)
