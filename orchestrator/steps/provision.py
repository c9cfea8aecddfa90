"""provision: the job's venv on a node, with every install verified (the node side is remote/env/provision.py).

The controller checks the job's package specs (a bad one is exit 2 before any host is touched),
sends the job to ``python3 -m remote.env.provision`` on the node, relays its per-step events, and
turns the answer into a ProvisionReport. Exit codes: 0 done; 2 bad job file or spec; 3 an install
step failed or its verification did (a version, a pin, a missing python); 4 host unreachable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier
from packaging.utils import canonicalize_name
from pydantic import BaseModel, ConfigDict, Field

from remote.lib.redact import redact, redact_obj

from ..agent import NODE, run_module
from ..config.models import Job, LoadedJob
from ..errors import EXIT_OK, DfoError
from ..hosts import Outcome
from ..transport.base import Transport

INSTALL_TIMEOUT_S = 3600.0  # one installer call (torch wheels are large); the whole run gets one per step


class ProvisionReport(BaseModel):
    """One host's provision; its serialisation (model_dump) is the --json document for that host."""

    model_config = ConfigDict(defer_build=True)  # built when first used, not at import

    host: str = Field(exclude=True)
    ok: bool
    steps: list[dict[str, Any]] = []
    warnings: list[dict[str, Any]] = []
    problems: list[dict[str, Any]] = []
    record: str | None = None
    packages: dict[str, str | None] = {}
    error: dict[str, Any] | None = Field(default=None, exclude_if=lambda v: v is None)
    exit_code: int = Field(default=EXIT_OK, exclude=True)

    @classmethod
    def failed(cls, host: str, err: DfoError) -> ProvisionReport:
        """A host where provision never got an answer (unreachable, ...)."""
        return cls(host=host, ok=False, error=err.to_json(), exit_code=err.exit_code)


def provision_request(job: Job, conn: Transport, *, clear_triton_cache: bool = False,
                      install_timeout: float = INSTALL_TIMEOUT_S) -> dict[str, Any]:
    dirs = [job.run.workdir] if job.run is not None else []
    env = job.run.env if job.run is not None else {}
    return {
        "host": conn.name,
        "job": {
            "name": job.name, "python": job.python, "venv": job.venv, "installer": job.installer,
            "packages": job.packages, "index": job.index.model_dump(),
            "overrides": [o.model_dump() for o in job.overrides],
        },
        "workspace": job.workspace or conn.host.workspace,
        "dirs": dirs,
        "clear_triton_cache": clear_triton_cache,
        "triton_cache_dir": env.get("TRITON_CACHE_DIR"),
        "install_timeout": install_timeout,
    }


def provision(conn: Transport, loaded: LoadedJob, *, clear_triton_cache: bool = False,
              on_step: Callable[[dict[str, Any]], None] | None = None,
              install_timeout: float = INSTALL_TIMEOUT_S) -> ProvisionReport:
    """Provision one host. Verification failures come back as a report with ok=False and its exit code;
    an unreachable host raises HostError."""
    job = loaded.job
    req = provision_request(job, conn, clear_triton_cache=clear_triton_cache, install_timeout=install_timeout)

    def on_event(ev: dict[str, Any]) -> None:
        if on_step is not None and ev["kind"] == "step" and isinstance(ev.get("step"), dict):
            on_step(redact_obj(ev["step"]))  # the node redacts too: credentials in URLs never reach the terminal

    timeout = 600 + install_timeout * (len(job.packages) + 3)
    try:
        data = run_module(conn, NODE.provision, req, timeout=timeout, on_event=on_event)
    except DfoError as exc:
        details = exc.details or {}
        rep = details.get("report")
        if not isinstance(rep, dict):
            exc.message, exc.hint = redact(exc.message), exc.hint and redact(exc.hint)
            raise
        rep = redact_obj(rep)
        err = redact_obj({"kind": exc.kind, "message": exc.message, "hint": exc.hint})
        return ProvisionReport(
            host=conn.name, ok=False, steps=rep.get("steps") or [], warnings=rep.get("warnings") or [],
            problems=_problems(rep, err["message"]), record=rep.get("record"), error=err,
            packages=_asked(job, rep.get("packages_after") or {}), exit_code=exc.exit_code,
        )
    data = redact_obj(data)
    return ProvisionReport(host=conn.name, ok=True, steps=data.get("steps") or [], warnings=data.get("warnings") or [],
                           problems=[], record=data.get("record"),
                           packages=_asked(job, data.get("packages_after") or {}))


def _asked(job: Job, packages: dict[str, str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for spec in job.packages:
        key = canonicalize_name(Requirement(spec).name)
        out[key] = packages.get(key)
    return out


def _problems(rep: dict[str, Any], message: str) -> list[dict[str, Any]]:
    """The failed step as a problem first, then what pkgcheck found wrong in the venv."""
    failed: dict[str, Any] = next((s for s in reversed(rep.get("steps") or []) if s.get("status") == "failed"), {})
    key = None
    if failed.get("asked"):
        try:
            key = canonicalize_name(Requirement(failed["asked"]).name)
        except (InvalidRequirement, InvalidSpecifier):
            key = None
    expected = None
    if failed.get("effective"):
        try:
            expected = str(Requirement(failed["effective"]).specifier) or None
        except (InvalidRequirement, InvalidSpecifier):
            expected = None
    head = {"kind": "install" if failed.get("installer") else "step", "package": key, "expected": expected,
            "found": failed.get("after"), "message": message, "step": failed.get("name")}
    rest = [p for p in rep.get("problems") or [] if p.get("message") not in message]
    return [head] + rest


def provision_json(o: Outcome[ProvisionReport]) -> dict[str, Any]:
    """One host's --json document: the report's own serialisation (a failure too)."""
    r = o.value if o.error is None else ProvisionReport.failed(o.host, o.error)
    assert r is not None
    return r.model_dump(by_alias=True)
