"""Typed views of what the node's read-only probes answer (remote/env/probe.py, remote/env/pkgcheck.py)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")


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
