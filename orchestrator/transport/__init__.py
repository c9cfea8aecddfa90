"""How a node is reached: the Transport interface (base), OpenSSH/paramiko (ssh), this machine (local),
host keys and liveness. ``open_connection`` is the one way in; it imports a transport only when used, and
``ssh_transport`` says what ``transport: ssh`` means on this machine (the OpenSSH client when usable).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.models import ResolvedHost
    from .base import Transport


def open_connection(host: ResolvedHost) -> Transport:
    """The transport the inventory names for this host (imported only when used); ``dfo -v`` says which."""
    if host.transport == "local":
        from .local import LocalConnection

        _say(host, "local (bash on this machine)")
        return LocalConnection(host)
    if host.transport == "openssh" or (host.transport == "ssh" and ssh_transport() == "openssh"):
        from .openssh import OpenSSH
        from .openssh_setup import ssh_binary

        _say(host, f"openssh ({ssh_binary()})")
        return OpenSSH(host)
    from .ssh import Connection

    _say(host, "paramiko")
    return Connection(host)


def _say(host: ResolvedHost, what: str) -> None:
    if os.environ.get("DFO_VERBOSE"):
        sys.stderr.write(f"dfo: {host.name}: transport {what}\n")


# transport: ssh prefers the OpenSSH client (issue 18); False: paramiko unless `transport: openssh`
PREFER_OPENSSH = True
_PICKED: list[str] = []


def ssh_transport() -> str:
    """What ``transport: ssh`` means here: "openssh" when an OpenSSH client >= 8.0 is on PATH (and
    PREFER_OPENSSH), else "paramiko" (said once on stderr under ``dfo -v``). DFO_SSH_TRANSPORT=openssh
    or paramiko decides instead (the tests run the same cases on both)."""
    forced = os.environ.get("DFO_SSH_TRANSPORT", "").strip().lower()
    if forced in ("openssh", "paramiko"):
        return forced
    if not PREFER_OPENSSH:
        return "paramiko"
    if not _PICKED:
        from .openssh_setup import usable_ssh

        _PICKED.append("openssh" if usable_ssh() else "paramiko")
        if _PICKED[0] == "paramiko" and os.environ.get("DFO_VERBOSE"):
            sys.stderr.write("dfo: no OpenSSH client (ssh 8.0 or newer) on PATH: using paramiko for transport: ssh\n")
    return _PICKED[0]
