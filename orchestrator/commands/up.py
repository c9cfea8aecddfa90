"""dfo up: provision, stage-model, sync-data, launch, tail -- stopping at the first failure.

One HostSession for the whole chain: the inventory and the job are read once, every host gets one
SSH connection, and each step runs on it (the agent upload included). Each step is the same library
call and prints the same lines as its own command; ``--json`` gathers each step's per-host document
(the one that command's ``--json`` prints) into one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click
from pydantic import BaseModel

from ..cli_common import (
    emit,
    err_console,
    error_json,
    exit_code_of,
    hosts_option,
    job_option,
    json_option,
    print_json,
    report_error,
    safe,
    session,
)
from ..config import LoadedJob, load_job
from ..errors import DfoError, UsageError
from ..hosts import HostSession, Outcome
from ..steps.gang import check_hosts, is_gang
from ..steps.runs import job_workspace, status
from ..steps.transfer import What
from .data import render_transfer, run_transfer
from .preflight import check_job
from .provision import provision_json, render_provision, run_provision
from .runs import Launched, detached_launch, launcher, prepare_gang
from .runs_follow import follow_hosts
from .runs_view import RECAP_LINES


class UpHost(BaseModel):
    """One host's steps: each is that command's --json document for the host (null: not run)."""

    provision: dict[str, Any] | None = None
    stage_model: dict[str, Any] | None = None
    sync_data: dict[str, Any] | None = None
    launch: dict[str, Any] | None = None  # null too when a live run of the job was followed instead
    run: dict[str, Any] | None = None  # the run as it stands at the end: status's fields + last_lines


class UpReport(BaseModel):
    """`up --json`: every host's steps, the step the chain stopped at (null: none), the exit code."""

    hosts: dict[str, UpHost]
    stopped_at: str | None = None
    exit_code: int = 0


def _banner(step: str, note: str = "") -> None:
    err_console.print(f"[bold cyan]==> {step}[/]" + (f" [dim]{note}[/]" if note else ""), highlight=False)


def live_runs(sess: HostSession, loaded: LoadedJob) -> list[Outcome[str | None]]:
    """The job's live run on each host (its id, or None)."""

    def one(conn: Any) -> str | None:
        runs = status(conn, job_workspace(loaded.job, conn.host.workspace), job=loaded.job.name, limit=5)
        return next((r.id for r in runs if r.state == "running"), None)

    return sess.each(one)


@click.command("up")
@hosts_option
@job_option()
@click.option("--no-tail", is_flag=True, help="Stop after launch instead of following the log to the end.")
@json_option
@click.pass_context
def up_cmd(ctx: click.Context, hosts: tuple[str, ...], job_path: str, no_tail: bool, as_json: bool = False) -> int:
    """The whole job: provision, stage-model, sync-data, launch, tail.

    The whole job is checked here first (hosts, package specs, model:/data: and their S3
    credentials, run.upload files, run.command placeholders, secret variables): a mistake is
    exit 2 before any step runs. Each step runs on every host given (in parallel), all of them
    over one SSH connection per host, and the chain stops at the first step that fails, with
    that step's exit code. Steps with nothing to do say so and cost little, so `up` is safe to
    re-run: a job whose run is still alive is not launched twice; dfo follows it instead.
    Sections the job does not have (model:, data:) are skipped. Ctrl-C while following
    detaches and leaves the run alone. Launch pushes code: and, with outputs.dest and
    outputs.restore, puts back what outputs.dest holds when outputs.path on the node is
    missing or empty, so a trainer that resumes from its last checkpoint goes on where a
    lost node stopped. With outputs:, the tail ends after the run's last pass has finished
    or failed, and a line says which.

    With --json, stdout holds one document: {"hosts": {NAME: {"provision", "stage_model",
    "sync_data", "launch", "run"}}, "stopped_at", "exit_code"}, each step's object being what
    that command's --json prints for the host (null: not run), "run" the run at the end (id,
    state, exit_code, ..., outputs, last_lines; outputs: the shipper's record, with "final",
    the last pass). The log itself is not printed then; the banners and
    dfo's notes still go to stderr.

    \b
    Exit codes: those of the step that stopped the chain (2 bad job file, 3 verification,
    4 host unreachable, 5 the run died at launch), else tail's: 0 the run succeeded, 3 it
    succeeded but the last pass of its outputs failed, 5 it failed, 130 detached with Ctrl-C.
    """
    loaded = load_job(job_path)
    sess = session(ctx, hosts)  # the hosts and groups exist in the inventory (nothing is connected yet)
    requests = check_job(loaded)
    from ..steps.outputs import check as check_outputs

    check_outputs(loaded)  # S3 credentials for outputs.dest (exit 2 before any step)
    if loaded.job.run is not None and is_gang(loaded.job):  # -H names exactly run.nodes hosts (exit 2, no host touched)
        check_hosts(loaded.job.run, [sess.hosts[n] for n in sess.names], loaded.job.name)
    report = UpReport(hosts={n: UpHost() for n in sess.names})
    t0 = time.monotonic()
    with sess:
        code = _chain(ctx, sess, loaded, job_path, requests, no_tail, as_json, report)
    if code is None:  # the run was followed to its end
        code = report.exit_code
        err_console.print(f"up: finished in {time.monotonic() - t0:.0f}s (exit {code})", highlight=False)
    report.exit_code = code
    if as_json:
        print_json(report.model_dump(by_alias=True))
    return code


def _record(report: UpReport, step: str, outcomes: list[Outcome[Any]], to_json: Callable[[Any], dict[str, Any]]
            ) -> int:
    for o in outcomes:
        setattr(report.hosts[o.host], step, error_json(o.error) if o.error is not None else to_json(o.value))
    return exit_code_of(outcomes)


def _stopped(report: UpReport, step: str, code: int) -> int:
    err_console.print(f"[red]up: stopped at {step} (exit {code})[/]", highlight=False)
    report.stopped_at = step
    return code


def _chain(ctx: click.Context, sess: HostSession, loaded: LoadedJob, job_path: str,
           requests: dict[str, dict[str, Any]], no_tail: bool, as_json: bool, report: UpReport) -> int | None:
    """The steps in order on the session's connections; an exit code, or None when tail ran to the end
    (its code is then in report.exit_code)."""
    job = loaded.job
    _banner("provision")
    outs = run_provision(sess, loaded, quiet=as_json)
    if not as_json:
        render_provision(outs)
    for o in outs:
        report.hosts[o.host].provision = provision_json(o)  # a failed host's too, as provision --json has it
    code = exit_code_of(outs)
    if code:
        return _stopped(report, "provision", code)
    stages: tuple[tuple[What, str, str], ...] = (("model", "stage_model", "stage-model"),
                                                 ("data", "sync_data", "sync-data"))
    for what, step, command in stages:
        if what not in requests:
            continue
        _banner(command)
        moved = run_transfer(sess, loaded, what, requests[what], quiet=as_json)
        if not as_json:
            render_transfer(moved, command)
        code = _record(report, step, moved, lambda r: r.model_dump(by_alias=True))
        if code:
            return _stopped(report, command, code)
    if job.run is None:
        _banner("launch", "skipped: the job has no run: section")
        return 0
    live = live_runs(sess, loaded)
    failed = [o for o in live if o.error is not None]
    if failed:  # could not look for a live run: nothing is launched
        if not as_json:
            emit(failed, False, dict, lambda host, r: None)
        return _stopped(report, "launch", _record(report, "launch", failed, dict))
    running = {o.host: o.value for o in live if o.value}
    todo = [h for h in sess.names if h not in running]
    for host, run_id in running.items():
        _banner("launch", f"{safe(host)}: run {safe(run_id)} of {safe(job.name)} is already running; following it")
        report.hosts[host].run = {"id": run_id, "state": "running"}
    if todo:
        _banner("launch")
        # no watch window here: tail below shows the run from its first line (each line once)
        window = job.run.wait if no_tail else 0.0
        gang: dict[str, Any] = {}
        one, render, started = launcher(ctx, loaded, job_path, window=window, force=False, quiet=as_json,
                                        multi=len(todo) > 1, gang=gang)
        try:
            if running and is_gang(job):  # a gang starts on every node at once, or not at all
                raise UsageError(f"job {job.name}: a gang, and only some of its nodes run it "
                                 f"({', '.join(running)}): stop those runs first (dfo stop -H HOST RUN)")
            prepare_gang(sess, loaded, gang, quiet=as_json)
        except DfoError as exc:
            report_error(exc)
            for host in todo:
                report.hosts[host].launch = error_json(exc)
            return _stopped(report, "launch", exc.exit_code)
        try:
            launched = sess.each(one, names=todo)
        except KeyboardInterrupt:
            detached_launch(ctx, started, job_path)
            return 130
        if not as_json:
            emit(launched, False, Launched.to_json, render)
        code = _record(report, "launch", launched, Launched.to_json)
        for lo in launched:
            if lo.value is not None:
                report.hosts[lo.host].run = _run_doc(lo.value.final, lo.value.seen)
        if code:
            return _stopped(report, "launch", code)
    if no_tail:
        return 0
    _banner("tail", "Ctrl-C detaches; the run goes on")
    # a new run is shown from its first byte; a run that was already going, from its last lines
    start: int | str = "+0" if not running else 10
    code, followed, seen = follow_hosts(ctx, sess, run=None, no_follow=False, start=start, loaded=loaded,
                                        job_path=job_path, quiet=as_json)
    if code == 130 and not followed:
        return 130
    for fo in followed:
        report.hosts[fo.host].run = (error_json(fo.error) if fo.error is not None
                                     else _run_doc(fo.value, seen.get(fo.host, [])))
    report.exit_code = code
    return None


def _run_doc(info: Any, seen: list[str]) -> dict[str, Any]:
    """The run as it stands: status's fields for it, and its last lines."""
    return {**info.brief().model_dump(by_alias=True), "last_lines": (info.tail or seen or [])[-RECAP_LINES:]}


COMMANDS = [up_cmd]
