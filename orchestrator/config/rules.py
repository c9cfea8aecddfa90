"""The rules a job file's fields obey, as pydantic validators (orchestrator.config uses them).

A broken rule is a ``PydanticCustomError`` whose text is the whole message, so ``yamlpos.load_model``
reports it as ``FILE:LINE: field: message`` like any other validation error (exit 2, before any host
is touched). Only rules that need nothing but the file itself live here; run.upload files (the
filesystem) and run.secret_env values (this shell's environment) are checked in commands/preflight.

Every message that quotes a value goes through ``redact``: a package line or an index URL may hold
credentials.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from remote.lib.redact import redact

from ..nodepath import canonical, in_home

if TYPE_CHECKING:
    from pydantic_core import PydanticCustomError

_PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\}")
PLACEHOLDERS = ("python", "model.dest", "data.dest", "workspace", "run_id", "run_dir")


def fail(message: str) -> PydanticCustomError:
    from pydantic_core import PydanticCustomError  # here: what reads only PLACEHOLDERS loads no pydantic

    return PydanticCustomError("dfo_job", "{message}", {"message": message})


def placeholders(command: str) -> list[str]:
    """The ``{name}`` placeholders of a run.command (``${VAR}`` is bash's, not one)."""
    return [m.group(1) for m in _PLACEHOLDER.finditer(command)]


def fill_placeholders(command: str, sub: Any) -> str:
    return _PLACEHOLDER.sub(sub, command)


# --------------------------------------------------------------------------- packages


def _requirement(spec: str) -> Any:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.specifiers import InvalidSpecifier

    try:
        return Requirement(spec)
    except (InvalidRequirement, InvalidSpecifier) as exc:
        why = redact((str(exc).splitlines() or ["?"])[0])
        raise fail(f"{redact(spec)!r} is not a valid package spec ({why}); write it as PEP 508 wants, "
                   "e.g. torch==2.11.0, triton>=3.6, 'pkg[extra]==1.0'") from None


def package_spec(spec: str) -> str:
    """A line of packages: a PEP 508 requirement."""
    _requirement(spec)
    return spec


def override_spec(spec: str) -> str:
    """overrides[].package: a requirement that names a version (or a URL)."""
    req = _requirement(spec)
    if not str(req.specifier) and not req.url:
        raise fail(f"{redact(spec)!r} names no version: an override replaces a pin with a version, "
                   "write e.g. triton==3.7.0")
    return spec


def index_location(url: str | None) -> str | None:
    """index.url, extra_urls, find_links: no whitespace (the installers split on it)."""
    if url is not None and any(c.isspace() for c in url):
        raise fail(f"{redact(url)!r} contains whitespace: index URLs and find_links paths cannot contain spaces")
    return url


# --------------------------------------------------------------------------- model: / data:


def source_kind(source: str) -> str:
    source = source.strip()
    if source.startswith("s3://"):
        return "s3"
    if source.startswith("hf://"):
        return "hf"
    if source.startswith(("/", "~", "file://")):
        return "path"
    return "unknown"


def transfer_source(source: str, section: str) -> str:
    """data.source: s3://bucket/prefix/; model.source: that, hf://org/name[@rev] or a node path."""
    src = source.strip()
    kind = source_kind(src)
    if kind not in (("s3",) if section == "data" else ("s3", "hf", "path")):
        want = ("s3://bucket/prefix/" if section == "data"
                else "s3://bucket/prefix/, hf://org/name or /a/path/on/the/node")
        raise fail(f"{src!r} is not {want}")
    if kind == "s3" and (len(src) <= 5 or src[5] == "/"):
        raise fail(f"{src!r} names no bucket: write it as s3://bucket/prefix/")
    if kind == "hf" and src[5:].split("@")[0].count("/") != 1:
        raise fail(f"{src!r}: expected hf://org/name or hf://org/name@revision")
    return source


def node_path(dest: str) -> str:
    """A path on the node: absolute, or under the node user's home (``~``, ``$HOME``: expanded on the
    node, never here; spelled ``~``, see orchestrator.nodepath)."""
    if not (dest.strip().startswith("/") or in_home(dest.strip())):
        raise fail(f"{dest.strip()!r} must be an absolute path on the node or one under its user's home, for "
                   "example /workspace/data, /dev/shm/model or ~/data")
    return canonical(dest)


# --------------------------------------------------------------------------- outputs:

_OUTPUT_KEYS = ("name", "run_id")


def _output_placeholders(value: str) -> None:
    for key in placeholders(value):
        if key not in _OUTPUT_KEYS:
            raise fail(f"unknown placeholder {{{key}}} (known: {{name}}, {{run_id}})")


def outputs_path(path: str) -> str:
    node_path(path)
    _output_placeholders(path)
    if path.rstrip("/") in ("", "~") or path.rstrip("/") == "/":
        raise fail(f"{path!r} is too wide: give the folder the trainer writes its checkpoints to")
    return path


def outputs_dest(dest: str | None) -> str | None:
    if dest is None:
        return None
    if not dest.startswith("s3://") or not dest[5:].split("/", 1)[0]:
        raise fail(f"{dest!r} must be an s3://bucket/prefix/ URL")
    _output_placeholders(dest)
    return dest


# --------------------------------------------------------------------------- run:


def command_placeholders(command: str, sections: dict[str, bool]) -> str:
    """run.command: every ``{name}`` is known, and a {model.dest} / {data.dest} has its section
    (``sections``: section name -> present; a section missing from it is not judged)."""
    for key in placeholders(command):
        if key not in PLACEHOLDERS:
            known = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
            raise fail(f"unknown placeholder {{{key}}} (known: {known}; write ${{VAR}} for bash)")
        section = key.split(".")[0] if "." in key else None
        if section is not None and sections.get(section) is False:
            raise fail(f"uses {{{key}}} but the job has no '{section}:' section: add {section}: "
                       f"{{source: ..., dest: ...}} or drop {{{key}}}")
    return command
