"""``--set KEY=VALUE``: a field of a job changed for one command (``dfo submit``), the job checked again.

KEY is the field's dotted path in the job file (``run.env.LR``, ``run.command``, ``run.gpus``); a section
that is missing is made. VALUE is read as YAML, as the job file would read it (``2``, ``true``, ``[a, b]``),
except under ``run.env``, where it is the text as given (``3e-4`` stays ``3e-4``); a value that YAML reads
as something the field does not take (``run.command=echo a: b`` is a mapping to YAML) is taken as its text.
The whole job is then validated again: a bad value is exit 2, naming the --set.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import ConfigError, UsageError
from .models import Job, LoadedJob
from .yamlpos import _describe


def _yaml(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _put(doc: dict[str, Any], path: list[str], value: Any, item: str) -> None:
    node = doc
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise UsageError(f"--set {item}: {'.'.join(path[:i + 1])} is not a section of the job (it holds "
                             f"{type(nxt).__name__})")
        node = nxt
    node[path[-1]] = value


def parse(sets: Sequence[str]) -> list[tuple[list[str], str]]:
    """[(dotted path, raw value)] of ``--set`` items, or UsageError (exit 2) for one that is no KEY=VALUE."""
    out: list[tuple[list[str], str]] = []
    for item in sets:
        key, sep, raw = item.partition("=")
        path = key.strip().split(".")
        if not sep or not key.strip() or any(not p.strip() for p in path):
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, KEY a field's dotted path (e.g. run.env.LR=3e-4)")
        out.append(([p.strip() for p in path], raw))
    return out


def apply_sets(loaded: LoadedJob, sets: Sequence[str]) -> LoadedJob:
    """The job with each ``--set`` applied, in order, and validated again (ConfigError, exit 2, naming it)."""
    if not sets:
        return loaded
    items = parse(sets)
    doc: dict[str, Any] = loaded.job.model_dump(mode="python", exclude_unset=True)
    values: list[Any] = []
    for (path, raw), item in zip(items, sets, strict=True):
        value = raw if len(path) == 3 and path[:2] == ["run", "env"] else _yaml(raw)
        values.append(value)
        _put(doc, path, value, item)
    for _ in range(len(items) + 1):
        try:
            return LoadedJob(job=Job.model_validate(doc), path=loaded.path)
        except ValidationError as exc:
            errors = exc.errors()
            retried = False
            for i, (path, raw) in enumerate(items):  # a set YAML read as what the field does not take: its text
                hit = any(tuple(str(p) for p in e["loc"][:len(path)]) == tuple(path) for e in errors)
                if hit and values[i] != raw:
                    values[i] = raw
                    _put(doc, path, raw, sets[i])
                    retried = True
            if retried:
                continue
            err = errors[0]
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            field = ".".join(str(p) for p in loc) or "(top level)"
            at = tuple(str(p) for p in loc)
            named = [sets[i] for i, (path, _) in enumerate(items)
                     if at[:len(path)] == tuple(path) or tuple(path[:len(at)]) == at]
            where = f"--set {named[0]}" if named else f"{loaded.path} (with --set {', '.join(sets)})"
            raise ConfigError(f"{where}: {field}: {_describe(err)}") from None
    raise ConfigError(f"--set {', '.join(sets)}: the job does not validate")  # pragma: no cover - bounded loop
