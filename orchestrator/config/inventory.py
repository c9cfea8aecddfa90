"""Loading the inventory: its plain objects (hosttypes.py), validated once per text.

``load_inventory`` validates inventory.yaml with the pydantic schema in inventory_schema.py (YAML
1.1's traps, extra fields forbidden, ``FILE:LINE: field: message`` on exit 2) the first time it sees a given
text, and keeps the validated result in dfo's cache folder (``inventory/``, named by a hash of the file's
bytes and of the schema's own source files). A later command that reads the same text builds these plain
objects from that record: no YAML parser, no pydantic, about 0.1-0.15 s less for every fleet command (the
schema's import and build were most of `dfo exec`'s own start). An edit to the file, or a dfo whose schema
differs, validates again. ``DFO_INVENTORY_CACHE=0`` validates every time.

Nothing here imports pydantic or yaml: with the record there, a command that needs only the inventory (exec)
loads neither, and status, tail and top only pydantic (for the node's replies).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UsageError
from .hosttypes import (  # noqa: F401 - re-exported: the inventory's plain objects
    DEFAULT_KNOWN_HOSTS,
    HostDefaults,
    HostEntry,
    Inventory,
    ResolvedHost,
    TransportName,
)

CACHE_VERSION = 1
CACHE_KEEP_S = 30 * 86400  # a record not written again for this long is removed (on a later miss)
# the files whose rules decide what a valid inventory is: their text is part of every record's name
_SCHEMA_FILES = ("inventory_schema.py", "hosttypes.py", "inventory.py", "sshvalues.py", "rules.py", "yaml11.py",
                 "yamlpos.py", "../nodepath.py")


# --------------------------------------------------------------------------- loading


def _plain(cls: type[Any], data: dict[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    if set(data) - names:
        raise ValueError(f"unknown fields {sorted(set(data) - names)}")
    return cls(**data)


def _from_doc(doc: dict[str, Any]) -> Inventory:
    """The plain inventory of a record's document (ValueError/TypeError/KeyError: not one of ours)."""
    hosts = doc["hosts"]
    groups = doc["groups"]
    if not isinstance(hosts, dict) or not isinstance(groups, dict):
        raise ValueError("hosts and groups must be mappings")
    return Inventory(defaults=_plain(HostDefaults, doc["defaults"]),
                     hosts={str(k): _plain(HostEntry, v) for k, v in hosts.items()},
                     groups={str(k): [str(m) for m in v] for k, v in groups.items()})


def to_doc(inv: Inventory) -> dict[str, Any]:
    return dataclasses.asdict(inv)


@functools.cache  # the schema's files do not change under a running dfo
def _schema_hash() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    for name in _SCHEMA_FILES:
        try:
            h.update((here / name).read_bytes())
        except OSError:
            h.update(b"\0missing " + name.encode())
    return h.hexdigest()


def _record_path(raw: bytes) -> Path | None:
    if os.environ.get("DFO_INVENTORY_CACHE") == "0":
        return None
    from .. import cache_dir

    key = hashlib.sha256(_schema_hash().encode() + b"\0" + raw).hexdigest()[:40]
    return cache_dir() / "inventory" / f"{key}.json"


def _read_record(path: Path) -> Inventory | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return _from_doc(doc)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # none, or not one of ours: validated again below


def _write_record(path: Path, inv: Inventory) -> None:
    """The validated inventory's record, 0600 in a 0700 folder, through a temporary name (best effort)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(to_doc(inv), f)
        os.replace(tmp, path)
        old = time.time() - CACHE_KEEP_S
        for p in path.parent.glob("*.json"):
            if p.stat().st_mtime < old:
                p.unlink()
    except OSError:
        pass  # no record: the next command validates again


def _same_text(p: Path, raw: bytes | None) -> bool:
    try:
        return p.read_bytes() == raw
    except OSError:
        return False


def inventory_path(path: str | os.PathLike[str] | None) -> Path:
    return Path(path or os.environ.get("DFO_INVENTORY") or "inventory.yaml")


def load_inventory(path: str | os.PathLike[str] | None) -> tuple[Inventory, Path]:
    """The inventory at ``path`` (else $DFO_INVENTORY, else ./inventory.yaml) and its path. ConfigError (exit 2)
    for a file that is missing, not YAML, or not a valid inventory (FILE:LINE: field: message)."""
    p = inventory_path(path)
    display = str(path or p)
    record: Path | None = None
    inv: Inventory | None = None
    try:
        raw = p.read_bytes()
    except OSError:
        raw = None  # the schema's loader says why (not found, cannot read)
    if raw is not None:
        record = _record_path(raw)
        inv = _read_record(record) if record is not None else None
    if inv is None:
        from .inventory_schema import validate_inventory  # pydantic and yaml: only for a text not seen before

        inv = validate_inventory(p, display)
        if record is not None and _same_text(p, raw):  # the text validated is the one the record is named for
            _write_record(record, inv)
    for group, members in inv.groups.items():
        for m in members:
            if m not in inv.hosts and m not in inv.groups:
                raise ConfigError(f"{p}: groups.{group}: unknown host {m!r}",
                                  hint="add it under hosts: or fix the name")
    return inv, p


def expand_targets(inv: Inventory, targets: tuple[str, ...] | list[str], inv_path: Path) -> list[str]:
    """Expand -H values (host names, group names, ``all``) into host names, in order, no repeats."""
    if not targets:
        raise UsageError("no host given", hint="pass -H HOST (a host, a group, or 'all')")
    out: list[str] = []

    def add(name: str, seen: tuple[str, ...] = ()) -> None:
        if name == "all":
            for h in inv.hosts:
                add(h)
        elif name in inv.groups:
            if name in seen:
                raise ConfigError(f"{inv_path}: groups.{name}: group includes itself")
            for m in inv.groups[name]:
                add(m, seen + (name,))
        elif name in inv.hosts:
            if name not in out:
                out.append(name)
        else:
            known = ", ".join(list(inv.hosts) + list(inv.groups)) or "none"
            raise UsageError(f"unknown host or group {name!r}", hint=f"known in {inv_path}: {known}, all")

    for t in targets:
        for piece in t.split(","):
            if piece.strip():
                add(piece.strip())
    return out


__all__ = ["DEFAULT_KNOWN_HOSTS", "HostDefaults", "HostEntry", "Inventory", "ResolvedHost", "TransportName",
           "expand_targets", "load_inventory"]
