"""How a node is reached: the Transport interface (base), OpenSSH/paramiko (ssh), this machine (local),
host keys and liveness. ``open_connection`` is the one way in; it imports a transport only when used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.models import ResolvedHost
    from .base import Transport


def open_connection(host: ResolvedHost) -> Transport:
    """The transport the inventory names for this host (imported only when used)."""
    if host.transport == "local":
        from .local import LocalConnection

        return LocalConnection(host)
    from .ssh import Connection

    return Connection(host)
