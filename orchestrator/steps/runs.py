"""Runs, the library side: render the command, launch detached, follow the log, status, stop.

The node side is remote/runs/ops.py (+ remote/runs/supervisor.py). Everything here goes through
``agent.run_module(conn, NODE.runs, {"op": ...})``; secrets travel in the request on stdin.

Following a log (``follow``, ``read_lines``) lives in orchestrator.steps.logstream: one
long-lived remote command per connection streams the log's new bytes as framed events with their
byte offsets; the controller resumes at the exact offset after a dropped connection, follows a
truncated or rotated log from its new start, and holds at most one bounded partial line.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
import shlex
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, field_validator

from .. import nodepath
from ..agent import NODE, run_module
from ..config.rules import PLACEHOLDERS, fill_placeholders
from ..diagnosis import Diagnosis, diagnose
from ..errors import ConfigError
from ..transport.base import Transport
from . import logstream
from .logstream import LINE_MAX, RECONNECT_BUDGET_S, SPLIT_MARK, STALL_S, LineSplitter  # noqa: F401 (re-exported)
from .workspace import job_workspace, run_dir_of

if TYPE_CHECKING:  # the job's models (pydantic, yaml): loaded by what reads a job, not by status or tail
    from ..config.models import Job, LoadedJob

TAIL_FOR_DIAGNOSIS = 80


class RunInfo(BaseModel):
    """One run as the node describes it (remote.runs.ops.describe)."""

    model_config = ConfigDict(defer_build=True, extra="ignore")

    id: str
    job: str | None = None
    state: str
    started: str | None = None
    started_ts: float | None = None
    ended: str | None = None
    ended_ts: float | None = None
    exit_code: int | None = None
    signal: str | None = None
    pid: int | None = None
    pgid: int | None = None
    supervisor_pid: int | None = None
    host: str | None = None
    run_dir: str | None = None
    command: str | None = None
    workdir: str | None = None
    end: dict[str, Any] | None = None
    last_line: str | None = None
    log_size: int = 0
    autotune_guard: dict[str, Any] | None = None
    tail: list[str] | None = None
    uploads: list[dict[str, Any]] | None = None
    stop: str | None = None
    stop_seconds: float | None = None
    group_left: list[int] | None = None
    offset: int | None = None
    outputs: dict[str, Any] | None = None  # the shipper's record (RUN_DIR/outputs.json); None: nothing ships
    restore: dict[str, Any] | None = None  # launch only: what restore fetched before the run started
    gang: dict[str, Any] | None = None  # a node of a gang: rank, hosts, hub, port, run, watch (its gang.json)
    metrics: dict[str, Any] | None = None  # the sampler's last rows: {"sys": ..., "train": ...} (docs/metrics.md)
    cost: float | None = None  # status: the cost so far (hosts.NAME.price_per_hour), set by the command
    generation: dict[str, Any] | None = None  # a run that recovers: lineage, generation, restarts (issue 20)

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics_read_once(cls, v: object) -> dict[str, Any] | None:
        """The node's last rows, through the one reading place (noderows): finite figures only."""
        from .noderows import last

        return last(v)

    @field_validator("started_ts", "ended_ts", "stop_seconds", mode="before")
    @classmethod
    def _finite_or_none(cls, v: object) -> object:
        """A time from the node that is no finite number (NaN, Infinity, true, text) is no time: None."""
        from .noderows import finite

        return finite(v)

    def diagnoses(self, seen: list[str] | None = None) -> list[Diagnosis]:
        if self.state not in ("failed", "lost"):
            return []
        lines = self.tail if self.tail else (seen or [])
        return diagnose(lines, {**(self.end or {}), "state": self.state})

    def brief(self) -> RunBrief:
        return RunBrief(id=self.id, job=self.job, state=self.state, exit_code=self.exit_code, started=self.started,
                        ended=self.ended, signal=self.signal, pid=self.pid, last_line=self.last_line,
                        autotune_guard=self.autotune_guard, diagnosis=[d.to_json() for d in self.diagnoses()],
                        outputs=self.outputs, metrics=self.metrics, cost=self.cost, generation=self.generation)

    def outputs_failed(self) -> bool:
        """The run ended and the last pass of its outputs failed (tail and up exit 3 when it succeeded)."""
        o = self.outputs or {}
        last = o.get("final") or {}
        return self.state != "running" and (o.get("state") == "failed" or last.get("ok") is False)


# --------------------------------------------------------------------------- the --json documents


class RunBrief(BaseModel):
    """A run in status --json: id, job, state, exit_code, started, ended (+ a few extras)."""

    model_config = ConfigDict(defer_build=True)  # built when first used, not at import

    id: str
    job: str | None
    state: str
    exit_code: int | None
    started: str | None
    ended: str | None
    signal: str | None
    pid: int | None
    last_line: str | None
    autotune_guard: dict[str, Any] | None
    diagnosis: list[dict[str, Any]]
    outputs: dict[str, Any] | None = None  # the shipper's record (state, shipped, last_pass, lag_s, errors)
    metrics: dict[str, Any] | None = None  # the sampler's last sys and train rows
    cost: float | None = None  # the cost so far, with hosts.NAME.price_per_hour
    # a run that recovers (issue 20): {"lineage", "generation", "restarts": [{at, why, lost_host, spare,
    # resumed_step, generation}], "record"}; null for a run of a job without run.spares/run.restarts
    generation: dict[str, Any] | None = None


class StatusReport(BaseModel):
    """One host's status --json document."""

    model_config = ConfigDict(defer_build=True)  # built when first used, not at import

    runs: list[RunBrief]


class LaunchReport(BaseModel):
    """One host's launch --json document: the run started, and how it stood after the watch."""

    model_config = ConfigDict(defer_build=True)  # built when first used, not at import

    run: str
    pid: int | None
    state: str
    exit_code: int | None
    signal: str | None
    run_dir: str | None
    uploads: list[dict[str, Any]] | None
    autotune_guard: dict[str, Any] | None
    watched_seconds: float
    last_lines: list[str]
    diagnosis: list[dict[str, Any]]
    restore: dict[str, Any] | None = None  # outputs restore before the launch (sync-data's report), or null
    outputs: dict[str, Any] | None = None
    rank: int | None = None  # a gang's node: its rank (every node's entry has the same run)

    @classmethod
    def of(cls, info: RunInfo, final: RunInfo, seen: list[str], watched: float, last_lines: list[str]) -> LaunchReport:
        return cls(run=info.id, pid=info.pid, state=final.state, exit_code=final.exit_code, signal=final.signal,
                   run_dir=info.run_dir, uploads=info.uploads, autotune_guard=final.autotune_guard,
                   watched_seconds=round(watched, 1), last_lines=last_lines if final.state != "running" else [],
                   diagnosis=[d.to_json() for d in final.diagnoses(seen)], restore=info.restore,
                   outputs=final.outputs, rank=(info.gang or {}).get("rank"))


class StopReport(BaseModel):
    """One host's stop --json document."""

    model_config = ConfigDict(defer_build=True)  # built when first used, not at import

    run: str
    state: str
    stop: str | None
    seconds: float | None
    group_left: list[int] | None
    outputs: dict[str, Any] | None = None  # the run's outputs record after its last pass (or the wait)

    @classmethod
    def of(cls, r: RunInfo) -> StopReport:
        return cls(run=r.id, state=r.state, stop=r.stop, seconds=r.stop_seconds, group_left=r.group_left,
                   outputs=r.outputs)


# --------------------------------------------------------------------------- job -> request


def render_command(job: Job, *, run_id: str | None = None, workspace: str | None = None) -> str:
    """The job's run.command with {python}, {model.dest}, {data.dest}, {workspace}, {run_id},
    {run_dir} filled in (values shell-quoted). ``${VAR}`` and other braces are left to bash; an
    unknown ``{name}`` is an error. Without ``run_id``, {run_id} and {run_dir} stay as they are.
    A path under ``~`` stays for the node's shell to expand (``"$HOME"/venv/bin/python``); without a
    workspace (the node's default, decided there) {workspace} and {run_dir} are ``"$DFO_WORKSPACE"``
    and ``"$DFO_RUN_DIR"``, which the node's supervisor sets for the trainer."""
    if job.run is None:
        raise ConfigError(f"job {job.name}: no 'run:' section", hint="add run: {command: ...} to the job file")
    ws = workspace or job.workspace
    values: dict[str, str | None] = {
        "python": nodepath.shell(job.venv_python), "workspace": nodepath.shell(ws) if ws else '"$DFO_WORKSPACE"',
        "model.dest": nodepath.shell(job.model.dest) if job.model else None,
        "data.dest": nodepath.shell(job.data.dest) if job.data else None,
        "run_id": shlex.quote(run_id) if run_id else None,
        "run_dir": (nodepath.shell(run_dir_of(ws, run_id)) if ws else '"$DFO_RUN_DIR"') if run_id else None,
    }

    def sub(m: re.Match[str]) -> str:
        key = m.group(1)
        if key not in values:
            raise ConfigError(f"job {job.name}: run.command: unknown placeholder {{{key}}}",
                              hint=f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}; write ${{VAR}} for bash")
        value = values[key]
        if value is None:
            if key in ("run_id", "run_dir"):
                return m.group(0)
            section = key.split(".")[0]
            raise ConfigError(f"job {job.name}: run.command uses {{{key}}} but the job has no '{section}:' section",
                              hint=f"add {section}: {{source: ..., dest: ...}} or drop {{{key}}}")
        return value  # quoted already

    return fill_placeholders(job.run.command, sub).strip()


def new_run_id(job_name: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{job_name}-{stamp}-{secrets.token_hex(2)}"


def split_env(loaded: LoadedJob) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret) environment for the trainer. Secret names and values holding URL credentials
    (orchestrator.config.models.is_secret_env) keep their values off the node's disk; a run.secret_env name
    absent from run.env takes its value from this shell's environment."""
    from ..config.models import RunConfig, is_secret_env
    from ..config.yamlpos import line_in_file

    job, run = loaded.job, loaded.need("run")
    assert isinstance(run, RunConfig)
    plain = {k: v for k, v in run.env.items() if not is_secret_env(k, job, v)}
    secret = {k: v for k, v in run.env.items() if is_secret_env(k, job, v)}
    for name in run.secret_env:
        if name not in run.env:
            value = os.environ.get(name)
            if value is None:
                line = line_in_file(loaded.path, ("run", "secret_env", run.secret_env.index(name)))
                raise ConfigError(f"{loaded.path}:{line}: run.secret_env: {name} is not set in this shell's "
                                  "environment",
                                  hint=f"export {name}=... before launching (it reaches the node on stdin only)")
            secret[name] = value
    return plain, secret


def collect_uploads(loaded: LoadedJob) -> list[dict[str, Any]]:
    """run.upload files (relative to the job file), each to land as run.workdir/<its file name>."""
    from ..config.models import RunConfig

    run = loaded.need("run")
    assert isinstance(run, RunConfig)
    out: list[dict[str, Any]] = []
    for rel in run.upload:
        local = loaded.path.parent / rel
        if not local.is_file():
            raise ConfigError(f"{loaded.path}: run.upload: {local} is not a file",
                              hint="paths are relative to the job file")
        clash = [u for u in out if u["path"] == local.name]
        if clash:
            raise ConfigError(f"{loaded.path}: run.upload: {rel!r} and {clash[0]['_rel']!r} would both land as "
                              f"{local.name} in run.workdir", hint="rename one of them")
        data = local.read_bytes()
        out.append({"path": local.name, "sha256": hashlib.sha256(data).hexdigest(),
                    "mode": local.stat().st_mode & 0o777, "_local": str(local), "_rel": rel})
    return out


def launch(conn: Transport, loaded: LoadedJob, *, force: bool = False, run_id: str | None = None,
           note: Callable[[str], None] | None = None,
           on_event: Callable[[dict[str, Any]], None] | None = None, gang: Any = None,
           generation: dict[str, Any] | None = None) -> RunInfo:
    """Start the job's run detached on the node; returns once the trainer has a pid. First the code
    (code:) and the outputs restore (outputs.restore), unless the job has a live run there.
    ``gang``: the GangPlan (orchestrator.steps.gang) when this node is one of a gang: its run id,
    its command and env, and the gang watch's entry (secret on stdin only). ``generation``: a recovering
    job's generation (orchestrator.steps.generation); without it such a job starts a new lineage here
    (one host), or takes the gang plan's."""
    from ..config.models import RunConfig

    job = loaded.job
    run = loaded.need("run")
    assert isinstance(run, RunConfig)
    workspace = job_workspace(job, conn.host.workspace)
    rid = run_id or new_run_id(job.name)
    plain, secret = split_env(loaded)
    uploads = collect_uploads(loaded)
    restore = None
    out = job.outputs
    wants_restore = out is not None and bool(out.dest) and out.restore
    # a recovering run's new generation: every node is brought to what outputs.dest holds (outputs.restore)
    recovering = generation if generation is not None else getattr(gang, "generation", None)
    refresh = isinstance(recovering, dict) and int(recovering.get("generation") or 1) > 1
    if (job.code is not None or wants_restore) and (
            force or all(r.state != "running" for r in status(conn, workspace, job=job.name))):
        # code: and restore first; a live run's code and outputs are left alone (its launch is refused below)
        if job.code is not None:
            from .code import push_code

            push_code(conn, loaded)
        if wants_restore:
            from .outputs import restore as restore_outputs
            from .outputs import restore_line

            r = restore_outputs(conn, loaded, rid, on_event=on_event, refresh=refresh)
            if r is not None:
                restore = r.model_dump()
                if note is not None:
                    note(restore_line(r))
    req: dict[str, Any] = {
        "op": "launch", "workspace": workspace, "run_id": rid, "job": job.name, "host": conn.host.name,
        "command": render_command(job, run_id=rid, workspace=workspace), "workdir": run.workdir,
        "env": plain, "secret_env": secret, "force": force, "autotune_guard": run.autotune_guard,
        "stop_grace": run.stop_grace, "job_file": str(loaded.path),
        "uploads": [{k: v for k, v in u.items() if not k.startswith("_")} for u in uploads],
    }
    if gang is not None:
        node = gang.node(conn.host.name)
        req["command"] = node.command
        req["env"] = {**plain, **node.env}  # the gang's ranks and addresses win over run.env
        # the peer: for gloo's interface, and where rank 0's watch listens when its gang address is NAT'd
        peer = (gang.nodes[1].address if node.rank == 0 else gang.master.address) if len(gang.nodes) > 1 else None
        req["gang"] = {"rank": node.rank, "hosts": [n.host for n in gang.nodes], "hub": gang.master.address,
                       "port": gang.watch_port, "secret": gang.secret, "gloo_ifname": node.gloo_ifname,
                       "address": node.address, "peer": peer,
                       "addrs": [n.address for n in gang.nodes],  # the hub admits these apart from strangers
                       "join_timeout": gang.join_timeout}
    if out is not None:
        from .outputs import launch_fields

        req.update(launch_fields(loaded, rid))  # the spec; credentials (stdin only) beside it
    from .metrics_spec import launch_fields as metrics_fields

    req.update(metrics_fields(loaded))  # the sampler's spec; notify's webhook (stdin only)
    if generation is None and gang is not None:
        generation = getattr(gang, "generation", None)
    if generation is None and run.recovers and gang is None and (
            force or all(r.state != "running" for r in status(conn, workspace, job=job.name))):
        from .generation import begin  # (a live run of the job here: the node refuses; its generation stays)

        generation = begin(loaded, rid, [conn.host.name])  # a fresh launch: generation N+1 of a new lineage
    if generation is not None:
        req["generation"] = generation
        if isinstance(req.get("outputs"), dict):  # the shipper checks it before every upload
            req["outputs"] = dict(req["outputs"], generation=generation["generation"])
    data = run_module(conn, NODE.runs, req, timeout=120)
    if "need" in data:  # some files differ on the node: send their content (only theirs)
        need = set(data["need"])
        for up, local in zip(req["uploads"], uploads, strict=True):
            if up["path"] in need:
                up["content_b64"] = base64.b64encode(Path(local["_local"]).read_bytes()).decode()
        data = run_module(conn, NODE.runs, req, timeout=600)
    info = RunInfo.model_validate(data)
    info.restore = restore
    return info


# --------------------------------------------------------------------------- status / stop / read


def status(conn: Transport, workspace: str | None, run: str | None = None, job: str | None = None,
           limit: int = 20) -> list[RunInfo]:
    data = run_module(conn, NODE.runs, {"op": "status", "workspace": workspace, "run": run, "job": job,
                                     "limit": limit, "tail": TAIL_FOR_DIAGNOSIS}, timeout=60)
    return [RunInfo.model_validate(r) for r in data["runs"]]


def outputs_of(conn: Transport, workspace: str | None, run: str | None, job: str | None) -> RunInfo:
    """The run with its outputs record in full (dfo outputs)."""
    data = run_module(conn, NODE.runs, {"op": "outputs", "workspace": workspace, "run": run, "job": job}, timeout=60)
    return RunInfo.model_validate(data)


def stop(conn: Transport, workspace: str | None, run: str, grace: float | None = None, job: str | None = None,
         outputs_wait: float = 0) -> RunInfo:
    """Stop the run; with ``outputs_wait`` > 0, also wait up to that long for a stopped run's last
    outputs pass (it ships the checkpoint the trainer left)."""
    timeout = (grace if grace is not None else 300.0) + 60 + outputs_wait
    data = run_module(conn, NODE.runs, {"op": "stop", "workspace": workspace, "run": run, "grace": grace,
                                     "job": job, "wait_outputs": outputs_wait or None}, timeout=timeout)
    return RunInfo.model_validate(data)


def read_lines(conn: Transport, workspace: str | None, run: str | None, lines: int | str,
               on_line: Callable[[str], None], job: str | None = None) -> RunInfo:
    """--no-follow: the log from the last ``lines`` lines (or line +N) to its current end, streamed
    (memory stays bounded however big the log); a lost connection is an error at once."""
    return follow(conn, workspace, run=run, job=job, lines=lines, on_line=on_line, reconnect_budget_s=0,
                  to_end=True)


def follow(
    conn: Transport,
    workspace: str | None,
    *,
    run: str | None = None,
    job: str | None = None,
    lines: int | str | None = None,
    max_seconds: float | None = None,
    on_line: Callable[[str], None],
    on_note: Callable[[str], None] | None = None,
    stall_s: float | None = None,
    reconnect_budget_s: float = RECONNECT_BUDGET_S,
    to_end: bool = False,
    give_up: Callable[[], str | None] | None = None,
) -> RunInfo:
    """Print the run's log line by line until it ends and is drained (or ``max_seconds`` pass).

    Returns the run as it stands at the end (``state`` is still "running" when ``max_seconds`` ran
    out first). ``lines``: start at the last N lines, or at line "+N"; None means the whole log.
    ``stall_s`` (default $DFO_TAIL_STALL_S or 8): silence after which the link counts as dead.
    ``give_up()``: asked while the link is down, a reason ends the reconnecting at once (ConnectionLost).
    A log truncated or replaced meanwhile is followed from its new start, with a note. How it
    works: orchestrator.steps.logstream.
    """
    data = logstream.stream(conn, {"workspace": workspace, "job": job, "tail": TAIL_FOR_DIAGNOSIS}, run=run,
                            lines=lines, max_seconds=max_seconds, on_line=on_line, on_note=on_note, stall_s=stall_s,
                            reconnect_budget_s=reconnect_budget_s, to_end=to_end, give_up=give_up)
    return RunInfo.model_validate(data)
