"""The inventory and a resolved host as every command uses them: plain objects, no pydantic, no yaml.

inventory_schema.py validates inventory.yaml into these; inventory.py loads them (from a record of an earlier
validation when there is one)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

DEFAULT_KNOWN_HOSTS = "~/.config/dfo/known_hosts"
# ssh: the OpenSSH client when a usable one is on PATH, else paramiko; openssh, paramiko: that one; local: bash here
TransportName = Literal["ssh", "openssh", "paramiko", "local"]


@dataclass
class HostDefaults:
    """inventory.yaml's ``defaults:`` (docs/configuration.md); validated by inventory_schema.HostDefaultsSchema."""

    user: str | None = None
    port: int | None = None
    identity: str | None = None
    known_hosts: str = DEFAULT_KNOWN_HOSTS
    python: str = "python3"
    # None: the node's default, /workspace when its user can write it, else ~/workspace (remote/lib/fsutil.py)
    workspace: str | None = None
    connect_timeout: float = 10.0
    command_timeout: float = 600.0
    # seconds from a call's start (its connection included) until the node's side runs dfo's command; past it
    # the host does not answer (exit 4), whatever the call's own timeout (orchestrator/transport/base.py CallClock)
    start_timeout: float = 30.0
    proxy_jump: str | None = None
    transport: TransportName | None = None  # every host's, unless its own entry says otherwise
    ssh_persist: float = 60.0  # OpenSSH: seconds a shared connection outlives dfo; 0: off
    ssh_config: str | None = None  # OpenSSH and paramiko: this ssh_config file only (as ssh -F)
    price_per_hour: float | None = None  # every host's, unless its own entry says otherwise


@dataclass
class HostEntry:
    """One host under ``hosts:``; validated by inventory_schema.HostEntrySchema."""

    host: str | None = None
    port: int | None = None
    user: str | None = None
    identity: str | None = None
    gpus: int | None = None
    python: str | None = None
    workspace: str | None = None
    proxy_jump: str | None = None
    transport: TransportName | None = None  # default: defaults.transport, else ssh
    private_address: str | None = None  # how the other nodes of a gang reach this one; default: host
    start_timeout: float | None = None  # default: defaults.start_timeout
    price_per_hour: float | None = None  # what the node costs (status, top, report)


@dataclass
class Inventory:
    defaults: HostDefaults = field(default_factory=HostDefaults)
    hosts: dict[str, HostEntry] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class ResolvedHost:
    """Everything the connection layer needs for one host (after ~/.ssh/config)."""

    name: str
    transport: TransportName = "ssh"  # as resolved: openssh, paramiko or local ("ssh": decided when it connects)
    hostname: str = "localhost"
    port: int = 22
    user: str | None = None
    identities: list[str] = field(default_factory=list)
    known_hosts: str = DEFAULT_KNOWN_HOSTS
    proxy_jump: str | None = None  # "a,b": through a, then b (ProxyJump)
    proxy_command: str | None = None  # ~/.ssh/config ProxyCommand (when no ProxyJump applies)
    python: str = "python3"
    workspace: str | None = None  # None: the node's default workspace (decided on the node)
    connect_timeout: float = 10.0
    command_timeout: float = 600.0
    start_timeout: float = 30.0  # the host's start_timeout, else the defaults' (HostDefaults.start_timeout)
    gpus: int | None = None
    private_address: str | None = None  # the inventory's hosts.NAME.private_address, else None
    # the OpenSSH transport's (orchestrator/transport/openssh_setup.py): the name ssh is given, the host's own
    # inventory fields as -o options, the ssh_config file dfo wrote for it, and `ssh -G`'s answer
    alias: str | None = None
    ssh_options: list[str] = field(default_factory=list)
    ssh_config: str | None = None  # the user's own file (defaults.ssh_config or $DFO_SSH_CONFIG), else None
    ssh_resolve: str | None = None
    ssh_resolved: dict[str, list[str]] = field(default_factory=dict)
    ssh_persist: float = 60.0
    user_known_hosts: list[str] = field(default_factory=list)  # the user's own known_hosts files: trusted too
    strict_host_keys: bool = False  # the user's StrictHostKeyChecking yes: a key must be in user_known_hosts

    @property
    def gang_address(self) -> str:
        """How the other nodes of a gang reach this one: private_address, else the SSH host name."""
        return self.private_address or self.hostname

    @property
    def known_hosts_name(self) -> str:
        return self.hostname if self.port == 22 else f"[{self.hostname}]:{self.port}"

    def replace(self, **changes: Any) -> ResolvedHost:
        """A copy with ``changes`` (lists and dicts are the same objects, as a shallow copy has them)."""
        return dataclasses.replace(self, **changes)
