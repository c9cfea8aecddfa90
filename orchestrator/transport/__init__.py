"""How a node is reached: the Transport interface (base), OpenSSH/paramiko (ssh), this machine (local),
host keys and liveness. ``open_connection`` is the one way in; it imports a transport only when used, and
``resolve.ssh_transport`` says what ``transport: ssh`` means on this machine (the OpenSSH client when
usable).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.inventory import ResolvedHost
    from .base import Transport


def open_connection(host: ResolvedHost) -> Transport:
    """The transport the inventory names for this host (imported only when used); ``dfo -v`` says which."""
    if host.transport == "local":
        from .local import LocalConnection

        _say(host, "local (bash on this machine)")
        return LocalConnection(host)
    from .resolve import ssh_transport

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
