"""Checks of a whole job on the controller, before any host is touched: a mistake in the job file
costs seconds (exit 2), never a minutes-long provision and sync that ends at launch."""

from __future__ import annotations

import os
from typing import Any

from ..config import LoadedJob
from ..errors import ConfigError
from ..steps.provision import validate_job
from ..steps.runs import render_command, split_env
from ..steps.transfer import build_request


def check_uploads(loaded: LoadedJob) -> None:
    """Every run.upload entry is a readable file (paths relative to the job file), and no two land
    under the same name in run.workdir."""
    run = loaded.job.run
    if run is None:
        return
    where = loaded.path.parent
    landed: dict[str, str] = {}
    for rel in run.upload:
        local = where / rel
        if local.is_dir():
            raise ConfigError(f"{loaded.path}: run.upload: {rel!r} is a folder ({local}); run.upload takes files",
                              hint="list its files in run.upload one by one, or push folders with code: "
                                   "(coming in the code-push feature)")
        if not local.exists():
            raise ConfigError(f"{loaded.path}: run.upload: {rel!r} does not exist ({local})",
                              hint=f"paths in run.upload are relative to the job file, here {where}")
        if not local.is_file():
            raise ConfigError(f"{loaded.path}: run.upload: {rel!r} is not a regular file ({local})",
                              hint="run.upload takes regular files")
        if not os.access(local, os.R_OK):
            raise ConfigError(f"{loaded.path}: run.upload: {rel!r} cannot be read ({local})",
                              hint="check its permissions")
        if local.name in landed:
            raise ConfigError(f"{loaded.path}: run.upload: {rel!r} and {landed[local.name]!r} would both land as "
                              f"{local.name} in run.workdir", hint="rename one of them")
        landed[local.name] = rel


def check_run(loaded: LoadedJob) -> None:
    """The run: section as launch needs it: upload files, command placeholders, secret variables."""
    if loaded.job.run is None:
        return
    check_uploads(loaded)
    render_command(loaded.job)
    split_env(loaded)


def check_job(loaded: LoadedJob) -> dict[str, dict[str, Any]]:
    """Everything `up` can check here before its first step (each failure is exit 2): package specs,
    the model:/data: sections and their S3 credentials, and the run: section. Returns the transfer
    requests by section ("model", "data"), credentials included (for the node's stdin only)."""
    validate_job(loaded)
    requests: dict[str, dict[str, Any]] = {}
    if loaded.job.model is not None:
        requests["model"] = build_request(loaded, "model")
    if loaded.job.data is not None:
        requests["data"] = build_request(loaded, "data")
    check_run(loaded)
    return requests
