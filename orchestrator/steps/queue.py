"""The run queue, the library side: ``dfo submit``, ``dfo queue``, ``dfo cancel``.

The queue lives on each node (remote/runs/queue.py: files beside the run records, one lock, moved on by
whoever submits, looks or ends a run; no daemon). Here: the requests, and where a run goes.

Where a run goes (``choose``): a node that can start it now (nothing queued there, its GPUs free), the
one with the fewest free GPUs that fit it (best fit: bigger holes stay for bigger runs); else the node
whose queue should free them soonest. dfo cannot know how long runs last, so "soonest" is counted in
GPU-runs: the GPUs held now plus the GPUs of the runs queued ahead, per GPU of the node, as if every run
lasted alike (a sweep); then fewer runs queued; then -H order. A node too small for the run is never chosen.
"""

from __future__ import annotations

import base64
import getpass
import random
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..agent import NODE, run_module
from ..config.models import LoadedJob, RunConfig
from ..errors import ConfigError, DfoError, HostError, VerifyError
from ..transport.base import Transport
from .runs import collect_uploads, render_command, split_env
from .workspace import job_workspace

TRIES = 5  # push + submit, when another push into code.dest came between them


class QueuedRow(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    job: str | None = None
    needs: int = 0
    position: int = 0
    submitted: str | None = None
    submitted_ts: float | None = None
    waiting_s: float | None = None
    submitted_by: str | None = None


class RunningRow(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    job: str | None = None
    gpus: list[int] | None = None  # None: a run from dfo launch (it may use every GPU)
    from_queue: bool = False
    started: str | None = None
    started_ts: float | None = None
    pid: int | None = None
    waited_s: float | None = None


class QueueView(BaseModel):
    """One node's queue (remote/runs/queue_ops.py ``queue``)."""

    model_config = ConfigDict(extra="ignore")

    gpus: int = 0
    gpus_from: str | None = None
    free: list[int] = []
    busy_other: list[int] = []  # GPUs a process that is no dfo run holds (nvidia-smi)
    held: list[int] = []
    running: list[RunningRow] = []
    queued: list[QueuedRow] = []
    now: float | None = None
    started_now: list[dict[str, Any]] = []

    def needs(self, gpus: int | None) -> int:
        return self.gpus if gpus is None else gpus


class Placed(BaseModel):
    """Where a submitted run went, and how it stood there."""

    run: str
    job: str
    host: str
    state: str  # running | queued | failed
    gpus: list[int] | None = None
    position: int | None = None
    needs: int = 0
    node_gpus: int = 0
    why: str = ""
    error: str | None = None
    requeued_from: str | None = None
    # what the hosts looked at said of their runs: host -> {"queued": [id], "running": [id]} (not in --json; the
    # laptop's record of earlier submits is brought up to date with it)
    seen: dict[str, dict[str, list[str]]] = Field(default={}, exclude=True)


class Cancelled(BaseModel):
    model_config = ConfigDict(extra="ignore")

    run: str
    job: str | None = None
    was: str  # queued | running | succeeded | failed | stopped | lost
    state: str  # cancelled | stopped | ...
    position: int | None = None
    stop: str | None = None
    stop_seconds: float | None = None


def node_queue(conn: Transport, workspace: str | None) -> QueueView:
    data = run_module(conn, NODE.runs, {"op": "queue", "workspace": workspace, "node_gpus": conn.host.gpus},
                      timeout=60)
    return QueueView.model_validate(data)


def cancel(conn: Transport, workspace: str | None, run: str, grace: float | None = None,
           only_queued: bool = False) -> Cancelled:
    timeout = (grace if grace is not None else 300.0) + 60
    data = run_module(conn, NODE.runs, {"op": "cancel", "workspace": workspace, "run": run, "grace": grace,
                                        "only_queued": only_queued}, timeout=timeout)
    return Cancelled.model_validate(data)


# --------------------------------------------------------------------------- where a run goes


def choose(views: dict[str, QueueView], gpus: int | None, order: list[str]) -> list[tuple[str, str]]:
    """The hosts that could take the run, best first, each with why (see the module's docstring)."""
    keyed: list[tuple[tuple[Any, ...], str, str]] = []
    for i, host in enumerate(order):
        v = views.get(host)
        if v is None:
            continue
        need = v.needs(gpus)
        if need > v.gpus:
            continue
        if not v.queued and need <= len(v.free):
            keyed.append(((0, len(v.free) - need, i), host,
                          f"{need} GPU{'s' if need != 1 else ''} free now ({len(v.free)} of {v.gpus} free)"))
        else:
            ahead = (v.gpus - len(v.free)) + sum(q.needs for q in v.queued)
            per = ahead / v.gpus if v.gpus else float(ahead)
            keyed.append(((1, per, len(v.queued), i), host,
                          f"{ahead} GPU-run{'s' if ahead != 1 else ''} ahead on {v.gpus} GPUs "
                          f"({len(v.queued)} queued)"))
    keyed.sort()
    return [(host, why) for _, host, why in keyed]


def too_small(views: dict[str, QueueView], gpus: int | None) -> str:
    sizes = ", ".join(f"{h}: {v.gpus}" for h, v in views.items())
    return f"no host can take a run of {gpus} GPUs (GPUs per host: {sizes})"


# --------------------------------------------------------------------------- the submit


def workdir_in_code(loaded: LoadedJob, dest: str) -> str | None:
    """run.workdir relative to code.dest ("" when the same folder), None when it lies outside."""
    run = loaded.job.run
    assert run is not None
    w, d = run.workdir.rstrip("/") or "/", dest.rstrip("/") or "/"
    if w == d:
        return ""
    if w.startswith(d + "/"):
        return w[len(d) + 1:]
    return None


def submit_request(conn: Transport, loaded: LoadedJob, run_id: str, code: dict[str, Any] | None) -> dict[str, Any]:
    """The node's ``submit`` request: launch's fields (remote/runs/ops.py LaunchRequest), every upload with
    its content, the GPUs the run needs and the node has, the code pushed for it."""
    job = loaded.job
    run = loaded.need("run")
    assert isinstance(run, RunConfig)
    workspace = job_workspace(job, conn.host.workspace)
    plain, secret = split_env(loaded)
    uploads = collect_uploads(loaded)
    req: dict[str, Any] = {
        "op": "submit", "workspace": workspace, "run_id": run_id, "job": job.name, "host": conn.host.name,
        "command": render_command(job, run_id=run_id, workspace=workspace), "workdir": run.workdir,
        "env": plain, "secret_env": secret, "autotune_guard": run.autotune_guard, "stop_grace": run.stop_grace,
        "job_file": str(loaded.path),
        "uploads": [{**{k: v for k, v in u.items() if not k.startswith("_")},
                     "content_b64": base64.b64encode(Path(u["_local"]).read_bytes()).decode()} for u in uploads],
        "gpus": run.gpus, "node_gpus": conn.host.gpus, "code": code,
        "submitted_by": f"{getpass.getuser()}@{socket.gethostname()}",
    }
    if job.outputs is not None:
        from .outputs import launch_fields

        req.update(launch_fields(loaded, run_id))
    from .metrics_spec import launch_fields as metrics_fields

    req.update(metrics_fields(loaded))
    return req


def submit_on(conn: Transport, loaded: LoadedJob, run_id: str, why: str = "",
              note: Callable[[str], None] | None = None) -> Placed:
    """Push the job's code (from the laptop's copy) and queue the run on this node; a push into code.dest
    from elsewhere between the two is caught by the node and the pair made again (TRIES tries, a random
    pause between them so that two laptops pushing at once fall out of step)."""
    for attempt in range(TRIES):
        if attempt:
            time.sleep(random.uniform(0.05, 0.5 * attempt))
        code = None
        if loaded.job.code is not None:
            from .code import push_code, start_local

            local = start_local(loaded)
            report = push_code(conn, loaded, note=note, local=local)
            code = {"dest": report.dest, "files": {rel: [e["sha256"], e["mode"], e["link"]]
                                                   for rel, e in local.view().items()},
                    "workdir": workdir_in_code(loaded, local.dest)}
        try:
            data = run_module(conn, NODE.runs, submit_request(conn, loaded, run_id, code), timeout=300)
        except VerifyError as exc:
            if (exc.details or {}).get("code_changed") and attempt < TRIES - 1:
                continue
            raise
        seen = {conn.name: {"queued": [str(x) for x in data.get("queued_ids") or []],
                            "running": [str(x) for x in data.get("running_ids") or []]}}
        return Placed(run=run_id, job=loaded.job.name, host=conn.name, state=str(data.get("state")),
                      gpus=data.get("gpus"), position=data.get("position"), needs=int(data.get("needs") or 0),
                      node_gpus=int(data.get("node_gpus") or 0), why=why, error=data.get("error"), seen=seen)
    raise AssertionError("unreachable")  # pragma: no cover


def place(session: Any, loaded: LoadedJob, run_id: str, names: list[str],
          warn: Callable[[str], None], note: Callable[[str], None] | None = None) -> Placed:
    """Look at every host's queue (several hosts), choose, submit there; a chosen host that cannot be
    reached now passes the run to the next best."""
    gpus = loaded.job.run.gpus if loaded.job.run else None
    seen: dict[str, dict[str, list[str]]] = {}
    if len(names) == 1:
        order = [(names[0], "the only host named")]
    else:
        views: dict[str, QueueView] = {}
        for o in session.each(lambda conn: node_queue(conn, job_workspace(loaded.job, conn.host.workspace)), names):
            if o.value is not None:
                views[o.host] = o.value
                seen[o.host] = {"queued": [q.id for q in o.value.queued], "running": [r.id for r in o.value.running]}
            else:
                warn(f"{o.host}: not considered: {o.error}")
        if not views:
            raise HostError("no host could be reached to take the run", hint="dfo queue -H HOSTS says why")
        order = choose(views, gpus, names)
        if not order:
            raise ConfigError(too_small(views, gpus), hint="lower run.gpus (--set run.gpus=N), or name bigger hosts")
    last: DfoError | None = None
    for host, why in order:
        out = session.each(lambda conn, why=why: submit_on(conn, loaded, run_id, why, note), [host])[0]
        if out.value is not None:
            placed: Placed = out.value
            placed.seen = {**seen, **placed.seen}
            return placed
        last = out.error
        if not isinstance(last, HostError):
            break
        warn(f"{host}: could not take the run ({last}); trying the next host")
    assert last is not None
    raise last
