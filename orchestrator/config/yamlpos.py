"""Load YAML and keep line numbers, so a validation error can name the line of the bad field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from ..errors import ConfigError
from . import yaml11

# libyaml's safe loader when PyYAML was built with it: a job file in 1 ms instead of 7
_FAST = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """Walk a composed YAML node along a pydantic error location; return a 1-based line."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node.value == str(part):
                    node = value_node
                    line = key_node.start_mark.line + 1
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def line_in_file(path: Path, loc: tuple[Any, ...]) -> int:
    """The 1-based line of the field at ``loc`` in a YAML file (1 when it cannot be read or found)."""
    try:
        return _line_of(yaml.compose(path.read_text(encoding="utf-8")), loc) or 1
    except (OSError, yaml.YAMLError):
        return 1


def _describe(err: ErrorDetails) -> str:
    msg = err.get("msg", "invalid")
    if err.get("type") == "extra_forbidden":
        return "unknown field (check the spelling; see docs/configuration.md)"
    if err.get("type") == "missing":
        return "field required"
    if err.get("type") in {"int_parsing", "int_type"}:
        return "value is not a valid integer"
    return msg[0].lower() + msg[1:] if msg else "invalid"


# a construct the parser only finds unclosed lines later, at the next token that cannot be in it
_UNCLOSED = {"while scanning a quoted scalar": "a quoted string", "while parsing a flow sequence": "a '['",
             "while parsing a flow mapping": "a '{'"}


def yaml_error(name: str, text: str, exc: yaml.YAMLError) -> str:
    """``FILE:LINE: not valid YAML: ...`` naming the line of the fault. PyYAML's problem mark is where
    the parser gave up: for a quote or bracket never closed that is lines later (the end of the
    file, or the next ':'), so the line where that quote or bracket opened is named instead."""
    last = max(1, len(text.splitlines()))
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    line = min(mark.line + 1, last) if mark is not None else None
    ctx, ctx_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    what = _UNCLOSED.get(ctx or "")
    if what and ctx_mark is not None and (line is None or ctx_mark.line + 1 < line):
        later = "the file ends first" if "end of stream" in problem else f"line {line}: {problem}"
        return f"{name}:{ctx_mark.line + 1}: not valid YAML: {what} opened here is never closed ({later})"
    return f"{name}{f':{line}' if line else ''}: not valid YAML: {problem}"


def _load(text: str, loader: type[yaml.SafeLoader] | type[yaml.CSafeLoader], model: type[BaseModel]) -> Any:
    """The document, constructed after YAML 1.1's traps are met for ``model`` (orchestrator.config.yaml11:
    a bare ``on:`` key is "on", ``version: 3.10`` is refused): as yaml.load, with a step between."""
    parser = loader(text)
    try:
        node = parser.get_single_node()
        if node is None:
            return None
        yaml11.fit(node, model)
        return parser.construct_document(node)
    finally:
        parser.dispose()


def load_model(path: Path, model: type[BaseModel], *, display: str | None = None) -> Any:
    """Parse ``path`` as YAML and validate it with ``model``; errors name file, line and field."""
    name = display or str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: file not found", hint="give the right path (-i / -j) or create it") from None
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read: {exc.strerror}") from None
    try:
        try:
            data = _load(text, _FAST, model)  # a safe loader (libyaml's when PyYAML has it)
        except yaml.YAMLError:
            try:  # the pure-Python parser: its message and position, as ever; and it decides
                data = _load(text, yaml.SafeLoader, model)
            except yaml.YAMLError as exc:
                raise ConfigError(yaml_error(name, text, exc)) from None
    except yaml11.Trap as trap:
        field = ".".join(str(p) for p in trap.loc) or "(top level)"
        raise ConfigError(f"{name}:{trap.line}: {field}: {trap.message}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name}:1: expected a mapping at the top level")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        node = yaml.compose(text)  # the nodes' lines, only for an error (the pure-Python parser: 3 ms a job file)
        lines = []
        for err in exc.errors():
            loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
            line = _line_of(node, loc)
            field = ".".join(str(p) for p in loc) or "(top level)"
            lines.append(f"{name}:{line or 1}: {field}: {_describe(err)}")
        first, rest = lines[0], lines[1:]
        hint = None
        if rest:
            hint = f"and {len(rest)} more: " + "; ".join(r.split(': ', 1)[1] for r in rest[:3])
        raise ConfigError(first, hint=hint) from None
