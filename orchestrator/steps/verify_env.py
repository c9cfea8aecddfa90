"""verify-env: probe a node, read the job's venv, compare with pins, report problems.

Facts only: nothing on the node is changed (the remote code cache aside).
"""

from __future__ import annotations

import re
from typing import Any

from packaging.utils import canonicalize_name
from pydantic import BaseModel, model_serializer

from ..agent import NODE, run_module
from ..config.models import Job
from ..errors import EXIT_OK, EXIT_VERIFY, DfoError, HostError
from ..facts.node import NodeFacts, PkgReport, Problem
from ..transport.base import Transport


def workspace_of(conn: Transport, job: Job | None) -> str:
    return (job.workspace if job and job.workspace else None) or conn.host.workspace


def provision_record_path(workspace: str, job_name: str) -> str:
    return f"{workspace.rstrip('/')}/.dfo/provision/{job_name}.json"


def dist_name(spec: str) -> str:
    """The distribution name of a requirement line (``torch==2.11.0`` -> ``torch``)."""
    name = re.split(r"[\s<>=!~\[;@(]", spec.strip(), maxsplit=1)[0]
    return canonicalize_name(name)


class VerifyReport(BaseModel):
    host: str
    facts: NodeFacts
    packages: dict[str, str | None] = {}
    problems: list[Problem] = []
    warnings: list[Problem] = []
    gpu: dict[str, Any] | None = None
    provision: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.ok else EXIT_VERIFY

    @model_serializer(mode="plain")
    def _document(self) -> dict[str, Any]:
        """The verify-env --json document for this host (model_dump gives it)."""
        f = self.facts
        return {
            "ok": self.ok,
            "python": f.python,
            "packages": self.packages,
            "problems": [p.model_dump(exclude_none=True) | {"package": p.package, "expected": p.expected,
                                                              "found": p.found} for p in self.problems],
            "warnings": [p.model_dump(exclude_none=True) for p in self.warnings],
            "gpus": (self.gpu or {}).get("gpus") or [g.model_dump() for g in f.nvidia.gpus],
            "node": {
                "hostname": f.hostname, "os": f.os, "kernel": f.kernel, "arch": f.arch, "cpus": f.cpus,
                "memory": f.memory.model_dump(), "python_executable": f.python_executable,
                "disk": {k: v.model_dump() for k, v in f.disk.items()},
                "nvidia": {"present": f.nvidia.present, "driver": f.nvidia.driver, "cuda": f.nvidia.cuda},
                "triton_cache": f.triton_cache.model_dump(),
            },
            "venv_python": f.venv_python,
            "provision": self.provision,
            "gpu_checks": self.gpu,
        }


def _known_bad(packages: dict[str, str | None], facts: NodeFacts, gpu: dict[str, Any] | None) -> list[Problem]:
    try:
        from remote.env.known_bad import match_known_bad
    except ImportError:  # the table ships with the GPU helpers
        return []
    caps = [g.capability for g in facts.nvidia.gpus if g.capability]
    arch_list = None
    if gpu:
        caps = [g.get("capability") for g in gpu.get("gpus", []) if g.get("capability")] or caps
        arch_list = gpu.get("arch_list")
    return [Problem.model_validate(p) for p in match_known_bad(packages, caps, arch_list)]


def verify_env(conn: Transport, job: Job | None, *, gpu: bool = False, gpu_timeout: float = 900) -> VerifyReport:
    ws = workspace_of(conn, job)
    record = provision_record_path(ws, job.name) if job else None
    raw = run_module(conn, NODE.probe, {
        "paths": {"workspace": ws, "shm": "/dev/shm"},
        "venv_python": job.venv_python if job else None,
        "records": [record] if record else [],
    })  # the host's command_timeout
    facts = NodeFacts.model_validate(raw)
    report = VerifyReport(host=conn.name, facts=facts)
    if record:
        report.provision = facts.records.get(record)
    for name, d in facts.disk.items():
        if d.error:
            report.warnings.append(Problem(kind="disk", message=f"{name} ({d.path}): {d.error}"))
    all_packages: dict[str, str | None] = {}
    if job is not None:
        if not facts.venv_python_exists:
            report.problems.append(Problem(
                kind="venv_missing", package=None, expected=job.venv_python, found=None,
                message=f"the job's interpreter {job.venv_python} does not exist; "
                        f"run: dfo provision -H {conn.name} -j {job.name}",
            ))
        else:
            pk = PkgReport.model_validate(run_module(conn, NODE.pkgcheck, {
                "pins": job.packages,
                "overrides": [o.model_dump() for o in job.overrides],
                "names": [dist_name(p) for p in job.packages],
            }, python=job.venv_python))
            all_packages = dict(pk.packages)
            report.packages = {dist_name(p): pk.packages.get(dist_name(p)) for p in job.packages}
            report.problems.extend(pk.problems)
            report.warnings.extend(pk.warnings)
    if gpu:
        py = job.venv_python if job is not None and facts.venv_python_exists else conn.host.python
        try:
            report.gpu = run_module(conn, NODE.gpu_preflight, {}, python=py, timeout=gpu_timeout)
        except HostError:
            raise  # the host went away: exit 4, not a GPU problem
        except DfoError as exc:
            report.problems.append(Problem(kind="gpu", message=f"GPU preflight failed: {exc.message}"))
        if report.gpu:
            report.problems.extend(Problem.model_validate(p) for p in report.gpu.get("problems", []))
            for k in ("torch", "triton", "fla"):
                if report.gpu.get(k) and k not in all_packages:
                    all_packages[k] = report.gpu[k]
    seen = {(p.kind, p.package, p.message) for p in report.problems}
    for p in _known_bad(all_packages, facts, report.gpu):
        if (p.kind, p.package, p.message) not in seen:
            report.problems.append(p)
    return report
