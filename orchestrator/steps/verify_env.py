"""verify-env: probe a node, read the job's venv, compare with pins, report problems.

Facts only: nothing on the node is changed (the remote code cache aside).
"""

from __future__ import annotations

import re
from typing import Any

from packaging.utils import canonicalize_name
from pydantic import BaseModel, ConfigDict, model_serializer

from ..agent import NODE, run_module
from ..config.models import Job
from ..errors import EXIT_OK, EXIT_VERIFY, DfoError, HostError
from ..facts.node import NodeFacts, PkgReport, Problem
from ..transport.base import Transport


def workspace_of(conn: Transport, job: Job | None) -> str | None:
    """The job's workspace, else the host's; None: the node's default (decided there)."""
    return (job.workspace if job and job.workspace else None) or conn.host.workspace


def job_paths(job: Job) -> dict[str, str]:
    """Every path of the job on the node that its commands write, by field (``~`` left to the node)."""
    out = {"venv": job.venv}
    if job.model is not None:
        out["model.dest"] = job.model.dest
    if job.data is not None:
        out["data.dest"] = job.data.dest
    if job.run is not None:
        out["run.workdir"] = job.run.workdir
    if job.code is not None and job.code.dest:
        out["code.dest"] = job.code.dest
    if job.outputs is not None:
        out["outputs.path"] = job.outputs.path.replace("{name}", job.name)
    return out


def path_problems(facts: NodeFacts, host: str) -> list[Problem]:
    """A problem for each path of the job (and the workspace) that the node's user cannot write,
    naming the field, the path, the folder in the way and what to do."""
    who = facts.user.name if facts.user else "this user"
    out = []
    for field, a in facts.job_paths.items():
        if a.ok:
            continue
        why = f"{a.why}" if a.blocker in (None, a.path) else f"{a.blocker}: {a.why}"
        fix = (f"set {field} to a folder {who} may write, e.g. under its home (~/...)" if field != "workspace" else
               "set workspace: (inventory or job) to a folder it may write, e.g. ~/workspace, or leave it unset "
               "(the node's default: /workspace when writable, else ~/workspace)")
        out.append(Problem(kind="not_writable", package=None, expected=a.path, found=a.blocker,
                           message=f"{field}: {who} on {host} cannot write {a.path} ({why}); {fix}"))
    return out


def installer_warnings(facts: NodeFacts, job: Job) -> list[Problem]:
    """Warnings that name what the job's provision will miss here: ensurepip, uv, the job's python."""
    n = facts.installer
    if n is None:
        return []
    if n.executable is None:
        return [Problem(kind="python_missing", package=None, expected=job.python, found=None,
                        message=f"the job's python {job.python!r} is not on the node: provision cannot create the "
                                f"venv {job.venv}; install it there, or set python: in the job file to one it has")]
    e = n.ensurepip
    if not n.needs_ensurepip or e is None or e.ok:
        return []
    fix = f"install {e.package} on the node (sudo apt install {e.package})"
    if n.kind == "uv":
        message = (f"installer: uv, but the node has no uv (PATH, ~/.local/bin, ~/.cargo/bin), and {n.executable} "
                   f"has no ensurepip to make a venv that pip could install uv into: install uv on the node "
                   f"(its installer puts it in ~/.local/bin), or {fix}")
    else:
        message = (f"installer: pip makes the venv {job.venv} with `{job.python} -m venv`, which needs ensurepip, "
                   f"and {n.executable} (python {e.version or '?'}) has none: {fix}, or use installer: uv with uv "
                   f"on the node")
    return [Problem(kind="ensurepip_missing", package=e.package, expected="ensurepip", found=None, message=message)]


def dist_name(spec: str) -> str:
    """The distribution name of a requirement line (``torch==2.11.0`` -> ``torch``)."""
    name = re.split(r"[\s<>=!~\[;@(]", spec.strip(), maxsplit=1)[0]
    return canonicalize_name(name)


class VerifyReport(BaseModel):
    model_config = ConfigDict(defer_build=True)  # built when first used, not at import
    host: str
    facts: NodeFacts
    packages: dict[str, str | None] = {}
    problems: list[Problem] = []
    warnings: list[Problem] = []
    gpu: dict[str, Any] | None = None
    health: dict[str, Any] | None = None  # the health gate's data (--health): checks, gpus, phases
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
                "user": f.user.model_dump() if f.user else None,
                "workspace": f.workspace.model_dump() if f.workspace else None,
                "paths": {k: v.model_dump() for k, v in f.job_paths.items()},
                "installer": f.installer.model_dump() if f.installer else None,
            },
            "venv_python": f.venv_python,
            "provision": self.provision,
            "gpu_checks": self.gpu,
            "health": self.health,
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


def verify_env(conn: Transport, job: Job | None, *, gpu: bool = False, gpu_timeout: float = 900,
               health: bool = False) -> VerifyReport:
    ws = workspace_of(conn, job)
    raw = run_module(conn, NODE.probe, {
        "workspace": ws, "paths": {"home": "~", "shm": "/dev/shm"},  # home: beside the workspace
        "venv_python": job.venv_python if job else None,
        "provision_record": job.name if job else None,
        "job_paths": {"workspace": ws or "", **(job_paths(job) if job else {})},
        "installer": {"kind": job.installer, "python": job.python, "venv": job.venv} if job else None,
    })  # the host's command_timeout
    facts = NodeFacts.model_validate(raw)
    report = VerifyReport(host=conn.name, facts=facts)
    if job is not None:
        report.provision = facts.records.get("provision")
        report.problems.extend(path_problems(facts, conn.name))
        report.warnings.extend(installer_warnings(facts, job))
    elif facts.workspace is not None:  # no job: only the workspace, and only as a warning
        report.warnings.extend(path_problems(facts.model_copy(update={"job_paths": {
            k: v for k, v in facts.job_paths.items() if k == "workspace"}}), conn.name))
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
    if health:
        from .health import run_gate

        py = job.venv_python if job is not None and facts.venv_python_exists else conn.host.python
        try:
            report.health = run_gate(conn, job, python=py)
        except HostError:
            raise
        except DfoError as exc:
            report.problems.append(Problem(kind="health", message=f"the GPU health gate failed to run: {exc.message}"))
        if report.health:
            report.problems.extend(Problem.model_validate(p) for p in report.health.get("problems") or [])
    seen = {(p.kind, p.package, p.message) for p in report.problems}
    for p in _known_bad(all_packages, facts, report.gpu):
        if (p.kind, p.package, p.message) not in seen:
            report.problems.append(p)
    return report
