"""sync-data and stage-model on the controller: check the job, resolve credentials, drive the node.

The bytes never pass through the controller: ``remote.transfer.sync`` (data) and ``remote.transfer.stage``
(model) run on the node and fetch from S3 (or copy a node path, or pull from the Hub) themselves.
This side checks the job's ``data:`` / ``model:`` / ``s3:`` sections (exit 2 before any host is
touched), resolves S3 credentials once with botocore's usual chain (environment, then the profile
``s3.profile`` or the default one, ...), unless ``s3.credentials: node``, and sends them in the
request on stdin: never in argv, the environment of a process, a log or an error message.
Progress events from the node drive a rich progress bar on a terminal.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from remote.lib.fsutil import human_bytes  # noqa: F401 - re-exported: the one byte-size formatter

from ..agent import NODE, run_module
from ..config.models import LoadedJob, S3Config
from ..config.rules import source_kind
from ..errors import ConfigError, HostError, HostKeyError, NoResult
from ..transport.base import Transport
from .report import MoveReport
from .workspace import job_workspace

if TYPE_CHECKING:  # rich: only once there is a terminal to draw on (a --json run never imports it)
    from rich.console import Console

TRANSFER_TIMEOUT_S = 7 * 24 * 3600.0  # one transfer may take long; a dead link is caught by SSH keepalives
What = Literal["data", "model"]


class TransferReport(MoveReport):
    """One host's transfer; its serialisation (model_dump) is the --json document for that host."""

    what: str = Field(exclude=True)
    verified: dict[str, int] = {}
    changed: int = 0  # fetched again: changed on the node since dfo wrote them (kept size and mtime or not)
    changed_files: list[str] = []  # the first names, sorted


# --------------------------------------------------------------------------- the job


def controller_credentials(s3: S3Config, job_path: Path) -> dict[str, str | None] | None:
    """AWS credentials from the controller (botocore's chain), or None with ``s3.credentials: node``
    (the node's own) or ``anonymous`` (unsigned requests, for a public bucket).

    The environment comes first in botocore's chain, so with AWS_ACCESS_KEY_ID and
    AWS_SECRET_ACCESS_KEY set (and no s3.profile) they are used without importing botocore.
    Finding none is a ConfigError (exit 2) before any host is touched: an unsigned request to a
    private bucket would only come back as AccessDenied from the node, after the work before it."""
    if s3.credentials != "controller":
        return None
    env = os.environ
    if not s3.profile and env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        return {"access_key": env["AWS_ACCESS_KEY_ID"], "secret_key": env["AWS_SECRET_ACCESS_KEY"],
                "session_token": env.get("AWS_SESSION_TOKEN") or None}
    import botocore.exceptions
    import botocore.session

    try:
        creds = botocore.session.Session(profile=s3.profile).get_credentials()
        frozen = creds.get_frozen_credentials() if creds is not None else None
    except botocore.exceptions.ProfileNotFound:
        raise ConfigError(f"{job_path}: s3.profile {s3.profile!r} is not in ~/.aws/config or ~/.aws/credentials",
                          hint="fix s3.profile, or remove it to use the environment / default profile") from None
    except botocore.exceptions.BotoCoreError as exc:
        raise ConfigError(f"{job_path}: cannot resolve S3 credentials: {type(exc).__name__}",
                          hint="check ~/.aws/config and the AWS_* variables") from None
    if frozen is None or not frozen.access_key:
        where = f"profile {s3.profile!r} in ~/.aws" if s3.profile else "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws"
        raise ConfigError(f"{job_path}: no S3 credentials found on this machine ({where}, SSO, ...)",
                          hint="export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or set s3.profile; "
                               "s3.credentials: node uses the node's own; "
                               "s3.credentials: anonymous for a public bucket")
    return {"access_key": frozen.access_key, "secret_key": frozen.secret_key, "session_token": frozen.token}


def hf_token() -> str | None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        if os.environ.get(name):
            return os.environ[name]
    path = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "token"
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def build_request(loaded: LoadedJob, what: What, delete: bool | None = None) -> dict[str, Any]:
    """The request for the node (credentials included: send it on stdin only). The section's fields
    were checked when the job was read (orchestrator.config.rules)."""
    job = loaded.job
    section: Any = loaded.need(what)
    kind = source_kind(section.source.strip())
    req: dict[str, Any] = {
        "what": what, "source": section.source.strip(), "dest": section.dest.strip(),
        "endpoint_url": job.s3.endpoint_url, "region": job.s3.region, "profile": job.s3.profile,
        "credentials_mode": job.s3.credentials, "credentials": None,
        "concurrency": job.s3.concurrency, "part_size_mb": job.s3.part_size_mb,
        "multipart_threshold_mb": job.s3.multipart_threshold_mb, "check_space": True,
        "margin_pct": section.margin_pct if what == "model" else 0.0,
        "delete": bool(section.delete if delete is None else delete) if what == "data" else False,
    }
    if kind == "s3":
        req["credentials"] = controller_credentials(job.s3, loaded.path)
    elif kind == "hf":
        req["hf_token"] = hf_token()
    return req


# --------------------------------------------------------------------------- the node


def transfer(conn: Transport, loaded: LoadedJob, what: What, request: dict[str, Any],
             on_event: Callable[[dict[str, Any]], None] | None = None) -> TransferReport:
    """Run the node side; return its summary, or raise the DfoError its failure maps to."""
    module = NODE.sync if what == "data" else NODE.stage
    python = loaded.job.venv_python if source_kind(request["source"]) == "hf" else None
    # what the node refuses to sync into (remote/lib/destsafety.py): the workspace root, a dest holding the venv
    request = dict(request, workspace=job_workspace(loaded.job, conn.host.workspace), venv=loaded.job.venv)
    stopped = HostError(f"the {what} transfer on the node stopped without a result (the SSH connection "
                        "dropped, or its process was killed)", host=conn.name,
                        hint="finished files are kept; run the same command again to fetch the rest")
    try:
        data = run_module(conn, module, request, python=python, timeout=TRANSFER_TIMEOUT_S, on_event=on_event)
    except HostKeyError:
        raise
    except HostError as exc:
        if exc.details is not None:
            raise  # the node's own answer (the S3 endpoint unreachable): as it is
        # the link died under the call (ConnectionLost; a plain HostError before connection.py raises it)
        stopped.message = f"the {what} transfer on the node stopped without a result ({exc.message})"
        raise stopped from None
    except NoResult:
        raise stopped from None  # no framed result at all: the session died under it, or its process was killed
    status = data.get("status") or ("no change" if not data["fetched"] and not data.get("deleted") else "done")
    return TransferReport(host=conn.name, what=what, status=status, **{k: data[k] for k in (
        "source", "dest", "fetched", "skipped", "deleted", "bytes", "seconds", "mb_per_s", "files_total",
        "bytes_total")}, verified=data.get("verified") or {}, changed=data.get("changed") or 0,
        changed_files=data.get("changed_files") or [], kept=data.get("kept") or 0,
        kept_files=data.get("kept_files") or [])


# --------------------------------------------------------------------------- progress on a terminal


class ProgressView:
    """One rich progress bar per host (bytes, files, rate, ETA), fed by the node's events."""

    def __init__(self, console: Console, enabled: bool) -> None:
        self.enabled = enabled and console.is_terminal
        self._lock = threading.Lock()
        self._tasks: dict[str, Any] = {}
        self.progress: Any = None
        if self.enabled:
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                                     TextColumn("{task.fields[files]}"), TransferSpeedColumn(),
                                     TextColumn("eta"), TimeRemainingColumn(), console=console, transient=True)

    def __enter__(self) -> ProgressView:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def callback(self, host: str) -> Callable[[dict[str, Any]], None]:
        def on_event(ev: dict[str, Any]) -> None:
            if self.progress is None:
                return
            with self._lock:
                if ev["kind"] == "plan":
                    self._tasks[host] = self.progress.add_task(
                        host, total=max(int(ev.get("bytes_to_fetch") or 0), 1),
                        files=f"0/{ev.get('to_fetch', 0)} files")
                elif ev["kind"] == "progress" and host in self._tasks:
                    self.progress.update(self._tasks[host], completed=int(ev.get("bytes") or 0),
                                         files=f"{ev.get('files', 0)}/{ev.get('files_total', 0)} files")
        return on_event
