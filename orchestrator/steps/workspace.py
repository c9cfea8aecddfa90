"""Where dfo keeps its records on a node: the job's workspace (else the host's), a run's folder."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.models import Job


def job_workspace(job: Job | None, host_workspace: str | None) -> str | None:
    """The job's workspace, else the host's; None: the node's default (remote/fsutil.default_workspace)."""
    return (job.workspace if job is not None and job.workspace else None) or host_workspace


def run_dir_of(workspace: str, run_id: str) -> str:
    return f"{workspace.rstrip('/')}/.dfo/runs/{run_id}"
