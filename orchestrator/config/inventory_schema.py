"""inventory.yaml's schema (pydantic; extra fields forbidden): what a valid inventory is, and its errors as
``FILE:LINE: field: message`` (exit 2). Loaded only for an inventory text not validated before
(inventory.load_inventory); the result is made of hosttypes' plain objects. ``Strict`` is every model's base
(the job's too, in models.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from ..nodepath import canonical
from . import rules as jobrules
from . import sshvalues
from .hosttypes import DEFAULT_KNOWN_HOSTS, HostDefaults, HostEntry, Inventory, TransportName
from .yamlpos import load_model

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a host's, a group's, a job's name


class Strict(BaseModel):
    # defer_build: a model's validator is built when it first validates, not at import; a command pays only
    # for the models it uses (status reads the inventory, never a job)
    model_config = ConfigDict(extra="forbid", defer_build=True)


# --------------------------------------------------------------------------- inventory


# values that reach ssh_config or ssh's argv (orchestrator/config/sshvalues.py): no control characters, no
# blanks where ssh reads one word; numbers finite (a ConnectTimeout of inf is no number ssh takes)
SshHost = Annotated[str, AfterValidator(sshvalues.ssh_host)]
SshUser = Annotated[str, AfterValidator(sshvalues.ssh_user)]
SshPath = Annotated[str, AfterValidator(sshvalues.ssh_path)]
SshJump = Annotated[str, AfterValidator(sshvalues.ssh_jump)]
NodeText = AfterValidator(sshvalues.plain_text)


class HostDefaultsSchema(Strict):
    user: SshUser | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    identity: SshPath | None = None
    known_hosts: SshPath = DEFAULT_KNOWN_HOSTS
    python: Annotated[str, NodeText, AfterValidator(canonical)] = "python3"
    # None: the node's default, /workspace when its user can write it, else ~/workspace (remote/lib/fsutil.py)
    workspace: Annotated[str, NodeText, AfterValidator(jobrules.node_path)] | None = None
    connect_timeout: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    command_timeout: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    # seconds from a call's start (its connection included) until the node's side runs dfo's command; past it
    # the host does not answer (exit 4), whatever the call's own timeout (orchestrator/transport/base.py CallClock)
    start_timeout: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    proxy_jump: SshJump | None = None
    transport: TransportName | None = None  # every host's, unless its own entry says otherwise
    # OpenSSH: seconds a shared connection outlives dfo; 0: off
    ssh_persist: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    ssh_config: SshPath | None = None  # OpenSSH and paramiko: this ssh_config file only (as ssh -F)
    # every host's, unless its own entry says otherwise
    price_per_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class HostEntrySchema(Strict):
    host: SshHost | None = None
    port: int | None = Field(default=None, ge=1, le=65535)
    user: SshUser | None = None
    identity: SshPath | None = None
    gpus: int | None = Field(default=None, ge=0)
    python: Annotated[str, NodeText, AfterValidator(canonical)] | None = None
    workspace: Annotated[str, NodeText, AfterValidator(jobrules.node_path)] | None = None
    proxy_jump: SshJump | None = None
    transport: TransportName | None = None  # default: defaults.transport, else ssh
    private_address: SshHost | None = None  # how the other nodes of a gang reach this one; default: host
    start_timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # default: defaults.start_timeout
    # what the node costs (status, top, report)
    price_per_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class InventorySchema(Strict):
    defaults: HostDefaultsSchema = Field(default_factory=HostDefaultsSchema)  # a factory: no validator built at import
    hosts: dict[str, HostEntrySchema] = {}
    groups: dict[str, list[str]] = {}

    @field_validator("hosts")
    @classmethod
    def _names(cls, v: dict[str, HostEntrySchema]) -> dict[str, HostEntrySchema]:
        for name in v:
            if not NAME.match(name) or name == "all":
                raise ValueError(f"host name {name!r} must be letters, digits, '.', '_' or '-' (and not 'all')")
        return v


def validate_inventory(path: Path, display: str) -> Inventory:
    """inventory.yaml at ``path`` validated by the schema above, as the plain objects every command uses;
    ConfigError (exit 2) naming FILE:LINE: field for what is wrong (``display``: the name said)."""
    got = load_model(path, InventorySchema, display=display)
    return Inventory(defaults=HostDefaults(**got.defaults.model_dump()),
                     hosts={name: HostEntry(**e.model_dump()) for name, e in got.hosts.items()},
                     groups={name: list(members) for name, members in got.groups.items()})
