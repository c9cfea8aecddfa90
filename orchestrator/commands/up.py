"""dfo up: provision, stage-model, sync-data, launch, tail -- stopping at the first failure.

One HostSession for the whole chain: the inventory and the job are read once, every host gets one
SSH connection, and each step runs on it (the agent upload included). Each step is the same library
call and prints the same lines as its own command; ``--json`` gathers each step's per-host document
(the one that command's ``--json`` prints) into one. The chain itself is steps/fleet.py ``up_chain``;
this module shows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import click

from ..cli_common import (
    emit,
    err_console,
    hosts_option,
    job_option,
    json_option,
    print_json,
    report_error,
    safe,
    session,
)
from ..config.models import LoadedJob, load_job
from ..errors import DfoError
from ..hosts import HostSession, Outcome
from ..steps import fleet
from ..steps.fleet import UpHost, UpReport  # noqa: F401 - re-exported: up --json's models
from ..steps.gang import check_hosts, is_gang
from .data import render_transfer, run_transfer
from .preflight import check_job
from .provision import render_provision, run_provision
from .runs import detached_launch, launcher, show_gang
from .runs_follow import follow_hosts


class _UpView:
    """up as the terminal shows it: a banner per step, each step's own lines; under --json only stderr's."""

    def __init__(self, ctx: click.Context, loaded: LoadedJob, job_path: str, as_json: bool) -> None:
        self.ctx, self.loaded, self.job_path, self.quiet = ctx, loaded, job_path, as_json

    def banner(self, step: str, note: str = "") -> None:
        err_console.print(f"[bold cyan]==> {step}[/]" + (f" [dim]{safe(note)}[/]" if note else ""), highlight=False)

    def provision(self, sess: HostSession) -> list[Outcome[Any]]:
        outs = run_provision(sess, self.loaded, quiet=self.quiet)
        if not self.quiet:
            render_provision(outs)
        return outs

    def transfer(self, sess: HostSession, what: str, request: dict[str, Any], command: str) -> list[Outcome[Any]]:
        outs = run_transfer(sess, self.loaded, what, request, quiet=self.quiet)  # type: ignore[arg-type]
        if not self.quiet:
            render_transfer(outs, command)
        return outs

    def live_failed(self, failed: list[Outcome[Any]]) -> None:
        if not self.quiet:
            emit(failed, False, dict, lambda host, r: None)

    def stopped(self, step: str, code: int) -> None:
        err_console.print(f"[red]up: stopped at {step} (exit {code})[/]", highlight=False)

    def error(self, exc: DfoError) -> None:
        report_error(exc)

    def launcher(self, names: list[str], gang: dict[str, Any], window: float
                 ) -> tuple[Callable[[Any], fleet.Launched], Callable[[list[Outcome[fleet.Launched]]], None],
                            Callable[[], None]]:
        one, render, started = launcher(self.ctx, self.loaded, self.job_path, window=window, force=False,
                                        quiet=self.quiet, multi=len(names) > 1, gang=gang)

        def show(outs: list[Outcome[fleet.Launched]]) -> None:
            if not self.quiet:
                emit(outs, False, fleet.Launched.to_json, render)

        return one, show, lambda: detached_launch(self.ctx, started, self.job_path)

    def gang_ready(self, plan: Any) -> None:
        if not self.quiet:
            show_gang(plan)

    def follow(self, sess: HostSession, start: int | str) -> fleet.Followed | None:
        code, outs, seen = follow_hosts(self.ctx, sess, run=None, no_follow=False, start=start, loaded=self.loaded,
                                        job_path=self.job_path, quiet=self.quiet)
        if code == 130 and not outs:
            return None
        return fleet.Followed(code, outs, seen, {})


@click.command("up")
@hosts_option
@job_option()
@click.option("--no-tail", is_flag=True, help="Stop after launch instead of following the log to the end.")
@click.option("--watch", "watch_run", is_flag=True,
              help="After launch (or finding the live run), watch the run and recover it onto run.spares "
                   "(dfo watch; the log is not followed).")
@json_option
@click.pass_context
def up_cmd(ctx: click.Context, hosts: tuple[str, ...], job_path: str, no_tail: bool, as_json: bool = False,
           watch_run: bool = False) -> int:
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
    if watch_run and (loaded.job.run is None or not loaded.job.run.recovers):
        from ..errors import UsageError

        raise UsageError(f"{loaded.path}: up --watch needs run.spares or run.restarts in the job",
                         hint="add run: {spares: [HOST], restarts: {max: 3}} (docs/recovery.md)")
    if loaded.job.run is not None and is_gang(loaded.job):  # -H names exactly run.nodes hosts (exit 2, no host touched)
        check_hosts(loaded.job.run, [sess.hosts[n] for n in sess.names], loaded.job.name)
    report = UpReport(hosts={n: UpHost() for n in sess.names})
    t0 = time.monotonic()
    with sess:
        code = fleet.up_chain(sess, loaded, requests, _UpView(ctx, loaded, job_path, as_json),
                              no_tail=no_tail or watch_run, report=report)
    if watch_run and code == 0:
        from .watch import watch

        err_console.print("[bold cyan]==> watch[/] [dim]Ctrl-C stops watching; the run goes on[/]", highlight=False)
        code = watch(ctx, hosts, job_path, None)
        report.exit_code = code
    if code is None:  # the run was followed to its end
        code = report.exit_code
        err_console.print(f"up: finished in {time.monotonic() - t0:.0f}s (exit {code})", highlight=False)
    report.exit_code = code
    if as_json:
        print_json(report.model_dump(by_alias=True))
    return code


COMMANDS = [up_cmd]
