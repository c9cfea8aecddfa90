"""Checks of a whole job on the controller, before any host is touched: a mistake in the job file
costs seconds (exit 2), never a minutes-long provision and sync that ends at launch."""

from __future__ import annotations

import os
from typing import Any

from ..config.models import LoadedJob
from ..config.yamlpos import line_in_file
from ..errors import ConfigError
from ..steps.runs import split_env
from ..steps.transfer import build_request


def check_uploads(loaded: LoadedJob) -> None:
    """Every run.upload entry is a readable file (paths relative to the job file). The error names the
    job file's line of the entry. (Two entries landing under one name is a rule of the field itself.)"""
    run = loaded.job.run
    if run is None:
        return
    where = loaded.path.parent
    for i, rel in enumerate(run.upload):
        local = where / rel
        problem = None
        if local.is_dir():
            problem = (f"is a folder ({local}); run.upload takes files",
                       "list its files in run.upload one by one, or push folders with code: "
                       "(coming in the code-push feature)")
        elif not local.exists():
            problem = (f"does not exist ({local})", f"paths in run.upload are relative to the job file, here {where}")
        elif not local.is_file():
            problem = (f"is not a regular file ({local})", "run.upload takes regular files")
        elif not os.access(local, os.R_OK):
            problem = (f"cannot be read ({local})", "check its permissions")
        if problem is not None:
            line = line_in_file(loaded.path, ("run", "upload", i))
            raise ConfigError(f"{loaded.path}:{line}: run.upload.{i}: {rel!r} {problem[0]}", hint=problem[1])


def check_gang(loaded: LoadedJob) -> None:
    """A gang (run.nodes > 1, or launcher: torchrun) is planned and checked on its hosts at launch
    (orchestrator/steps/gang.py); its fields are checked when the job is read. Nothing more here."""
    return None


def check_run(loaded: LoadedJob) -> None:
    """The run: section as launch needs it, beyond its fields: gang fields, upload files, secret variables."""
    if loaded.job.run is None:
        return
    check_gang(loaded)
    check_uploads(loaded)
    split_env(loaded)


def check_job(loaded: LoadedJob) -> dict[str, dict[str, Any]]:
    """What `up` checks here, beyond the job's own fields (checked when it was read), before its first
    step (each failure is exit 2): the S3 credentials of model:/data:, and run.upload files and
    secret variables. Returns the transfer requests by section ("model", "data"), credentials
    included (for the node's stdin only)."""
    requests: dict[str, dict[str, Any]] = {}
    if loaded.job.model is not None:
        requests["model"] = build_request(loaded, "model")
    if loaded.job.data is not None:
        requests["data"] = build_request(loaded, "data")
    check_run(loaded)
    return requests
