"""Typed views of what the node's read-only probes answer (remote/env/probe.py, remote/env/pkgcheck.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Loose(BaseModel):
    model_config = ConfigDict(defer_build=True, extra="allow")


class Disk(Loose):
    path: str
    exists: bool = False
    total: int | None = None
    free: int | None = None
    writable: bool | None = None
    error: str | None = None


class Gpu(Loose):
    index: int
    name: str
    memory: int | None = None
    capability: str | None = None


class Nvidia(Loose):
    present: bool = False
    driver: str | None = None
    cuda: str | None = None
    gpus: list[Gpu] = []
    error: str | None = None


class Memory(Loose):
    total: int | None = None
    available: int | None = None


class TritonCache(Loose):
    path: str
    exists: bool = False
    bytes: int = 0
    files: int = 0


class NodeUser(Loose):
    name: str
    uid: int
    home: str


class WorkspaceFacts(Loose):
    """The workspace dfo uses on the node: the one given (job, else inventory), else the node's default."""

    path: str
    given: str | None = None
    default: bool = False
    why: str | None = None  # the default's reason (/workspace writable, or not and so ~/workspace)


class PathAccess(Loose):
    """Whether the node's user may write a path of the job (or create it)."""

    path: str
    ok: bool = True
    exists: bool = False
    blocker: str | None = None  # the folder in the way: the path or its nearest existing parent
    why: str | None = None


class Ensurepip(Loose):
    ok: bool = False
    version: str | None = None
    package: str = "python3-venv"
    error: str | None = None


class InstallerNeeds(Loose):
    """What the job's provision needs on this node (remote.env.probe.installer_needs)."""

    kind: str
    python: str | None = None
    executable: str | None = None
    venv_exists: bool = False
    uv: str | None = None
    needs_ensurepip: bool = False
    ensurepip: Ensurepip | None = None


class NodeFacts(Loose):
    hostname: str
    os: str
    kernel: str
    arch: str
    cpus: int | None
    memory: Memory
    python: str
    python_executable: str
    disk: dict[str, Disk] = {}
    nvidia: Nvidia = Nvidia()
    triton_cache: TritonCache
    venv_python: str | None = None
    venv_python_exists: bool = False
    records: dict[str, Any] = {}
    user: NodeUser | None = None
    workspace: WorkspaceFacts | None = None
    job_paths: dict[str, PathAccess] = {}
    installer: InstallerNeeds | None = None


class Problem(Loose):
    kind: str
    package: str | None = None
    expected: str | None = None
    found: str | None = None
    message: str
    reason: str | None = None


class PkgReport(Loose):
    python: str
    executable: str
    packages: dict[str, str] = {}
    module_versions: dict[str, str | None] = {}
    problems: list[Problem] = []
    warnings: list[Problem] = []
