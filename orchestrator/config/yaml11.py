"""YAML 1.1's traps, met where the schema says what a value is (docs/configuration.md, "YAML 1.1 traps").

PyYAML reads YAML 1.1: a bare ``on``, ``off``, ``yes`` or ``no`` is a bool, ``3.10`` is the float 3.1,
``0755`` the int 493, ``1:30`` the int 90, ``2026-12-02`` a date. ``fit`` walks the composed document (its
nodes keep the text as written) beside the pydantic model it is loaded into, before anything is
constructed, and re-tags or refuses:

- a mapping key written plain is its text: every key dfo reads is a string (``on:``, a host named ``no``,
  a variable ``ON`` in run.env);
- where the schema wants a string (``str``, a ``Literal`` of strings, the values of ``dict[str, str]``,
  the items of ``list[str]``) and not that type itself, a plain bool or date is its text (``FLAG: yes``
  is "yes"); a plain number is its text when that is how Python writes the number (``8``, ``3.5``), else
  it is refused, naming the quoting that keeps it (``write it quoted: '3.10'``);
- where the schema wants a number and neither a bool nor a string, a plain bool is refused
  (``gpus: yes`` would be 1).

A refusal is a ``Trap`` (the field's location, its line, the message); yamlpos makes it
``FILE:LINE: field: message``, exit 2. A quoted scalar is a string whatever it holds and is never touched.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

_STR = "tag:yaml.org,2002:str"
_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_DATE = "tag:yaml.org,2002:timestamp"
_MERGE = "tag:yaml.org,2002:merge"


class Trap(Exception):
    """A plain scalar that YAML 1.1 reads as something the field cannot mean."""

    def __init__(self, loc: tuple[str | int, ...], line: int, message: str) -> None:
        super().__init__(message)
        self.loc, self.line, self.message = loc, line, message


def _members(ann: Any) -> list[Any]:
    """The types a field accepts: Annotated unwrapped, unions flattened."""
    while get_origin(ann) is Annotated:
        ann = get_args(ann)[0]
    if get_origin(ann) in (Union, types.UnionType):
        return [m for a in get_args(ann) for m in _members(a)]
    return [ann]


def _model(members: list[Any]) -> type[BaseModel] | None:
    return next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)), None)


def _container(members: list[Any], origin: type) -> Any | None:
    """The item type of a list member, or the value type of a dict member."""
    for m in members:
        if get_origin(m) is origin and get_args(m):
            return get_args(m)[-1]
    return None


def _wants(members: list[Any]) -> tuple[bool, bool, bool]:
    """(a string, a number, a bool) among ``members``; a list's items count (``spares: gpu-5`` is a list)."""
    string = number = boolean = False
    for m in members:
        if get_origin(m) is list:
            s, n, b = _wants(_members(get_args(m)[0])) if get_args(m) else (False, False, False)
            string, number, boolean = string or s, number or n, boolean or b
        elif get_origin(m) is Literal:
            string = string or any(isinstance(a, str) for a in get_args(m))
            number = number or any(isinstance(a, int) and not isinstance(a, bool) for a in get_args(m))
        elif m is str:
            string = True
        elif m is bool:
            boolean = True
        elif m in (int, float):
            number = True
        elif m is Any:
            string = number = boolean = True  # anything goes: YAML's reading stands
    return string, number, boolean


def _plain(node: yaml.ScalarNode) -> bool:
    """Written without quotes (PyYAML's style None; libyaml's parser gives '')."""
    return not node.style


def _python_text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _scalar(node: yaml.ScalarNode, members: list[Any], loc: tuple[str | int, ...]) -> None:
    if not _plain(node) or node.tag not in (_BOOL, _INT, _FLOAT, _DATE):
        return  # quoted (a string whatever it holds), or a plain string already
    string, number, boolean = _wants(members)
    text, line = node.value, node.start_mark.line + 1
    if node.tag in (_BOOL, _DATE):
        if string and not boolean:
            node.tag = _STR  # `FLAG: yes` is "yes"; `name: 2026-12-02` is "2026-12-02"
        elif node.tag == _BOOL and number and not boolean:
            value = yaml.constructor.SafeConstructor().construct_object(node)
            raise Trap(loc, line, f"YAML 1.1 reads {text} as {str(value).lower()}, not a number: write a number")
    elif string and not number:
        value = yaml.constructor.SafeConstructor().construct_object(node)
        if _python_text(value) != text:
            raise Trap(loc, line, f"YAML 1.1 reads {text} as the number {_python_text(value)}: "
                                  f"write it quoted: '{text}'")
        node.tag = _STR  # `OMP_NUM_THREADS: 8` is "8"


def _keys(node: yaml.MappingNode) -> None:
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode) and _plain(key) and key.tag not in (_STR, _MERGE):
            key.tag = _STR  # `on:` is "on", not true; a host named `no` is "no"


def fit(node: yaml.Node, ann: Any, loc: tuple[str | int, ...] = (), seen: set[int] | None = None) -> None:
    """Re-tag ``node`` (and what it holds) for the type ``ann`` (a pydantic model, or a field's annotation),
    or raise Trap; what YAML 1.1 reads right, and what the schema does not know, is left as it is. A node
    that aliases make appear again is walked once (``&a [*a]`` holds itself; nested aliases would make the
    walk exponential)."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    members = _members(ann)
    if isinstance(node, yaml.MappingNode):
        _keys(node)
        model = _model(members)
        value_type = _container(members, dict)
        for key, value in node.value:
            name: str | None = str(key.value) if isinstance(key, yaml.ScalarNode) else None
            if model is not None:
                field = model.model_fields.get(name) if name is not None else None
                if field is not None and name is not None:
                    fit(value, field.annotation, (*loc, name), seen)
            elif value_type is not None and name is not None:
                fit(value, value_type, (*loc, name), seen)
            elif isinstance(value, yaml.MappingNode | yaml.SequenceNode):
                fit(value, Any, (*loc, name if name is not None else "?"), seen)  # keys, still
    elif isinstance(node, yaml.SequenceNode):
        item_type = _container(members, list)
        for i, item in enumerate(node.value):
            fit(item, item_type if item_type is not None else Any, (*loc, i), seen)
    elif isinstance(node, yaml.ScalarNode):
        _scalar(node, members, loc)
