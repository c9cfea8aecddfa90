"""dfo up: provision, stage-model, sync-data, launch, tail -- stopping at the first failure."""

from __future__ import annotations

import time

import click

from ..cli_common import err_console, hosts_option, job_option, safe, session
from ..config import load_job
from ..steps.runs import job_workspace, status
from .data import stage_model, sync_data
from .preflight import check_job
from .provision import provision_cmd
from .runs import launch_cmd, tail_cmd


def _banner(step: str, note: str = "") -> None:
    err_console.print(f"[bold cyan]==> {step}[/]" + (f" [dim]{note}[/]" if note else ""), highlight=False)


def live_runs(ctx: click.Context, hosts: tuple[str, ...], job_path: str) -> dict[str, str]:
    """The job's live run on each host that has one (host -> run id)."""
    loaded = load_job(job_path)
    found: dict[str, str] = {}
    with session(ctx, hosts) as s:
        for o in s.each(lambda c: status(c, job_workspace(loaded.job, c.host.workspace), job=loaded.job.name, limit=5)):
            if o.error is not None:
                raise o.error
            for r in o.value or []:
                if r.state == "running":
                    found[o.host] = r.id
                    break
    return found


@click.command("up")
@hosts_option
@job_option()
@click.option("--no-tail", is_flag=True, help="Stop after launch instead of following the log to the end.")
@click.pass_context
def up_cmd(ctx: click.Context, hosts: tuple[str, ...], job_path: str, no_tail: bool) -> int:
    """The whole job: provision, stage-model, sync-data, launch, tail.

    The whole job is checked here first (hosts, package specs, model:/data: and their S3
    credentials, run.upload files, run.command placeholders, secret variables): a mistake is
    exit 2 before any step runs. Each step runs on every host given (in parallel) and the
    chain stops at the first step that fails, with that step's exit code. Steps with nothing
    to do say so and cost little, so `up` is safe to re-run: a job whose run is still alive is
    not launched twice; dfo follows it instead. Sections the job does not have (model:, data:)
    are skipped. Ctrl-C while following detaches and leaves the run alone.

    \b
    Exit codes: those of the step that stopped the chain (2 bad job file, 3 verification,
    4 host unreachable, 5 the run died at launch), else tail's: 0 the run succeeded, 5 it failed,
    130 detached with Ctrl-C.
    """
    loaded = load_job(job_path)
    job = loaded.job
    check_job(ctx, hosts, loaded)
    t0 = time.monotonic()
    plan: list[tuple[str, click.Command, dict[str, object]]] = [
        ("provision", provision_cmd, {"as_json": False, "clear_triton_cache": False}),
    ]
    if job.model is not None:
        plan.append(("stage-model", stage_model, {"as_json": False}))
    if job.data is not None:
        plan.append(("sync-data", sync_data, {"as_json": False, "delete": None}))
    for name, cmd, kw in plan:
        _banner(name)
        code = ctx.invoke(cmd, hosts=hosts, job_path=job_path, **kw)
        if code:
            err_console.print(f"[red]up: stopped at {name} (exit {code})[/]", highlight=False)
            return int(code)
    if job.run is None:
        _banner("launch", "skipped: the job has no run: section")
        return 0
    running = live_runs(ctx, hosts, job_path)
    todo = tuple(h for h in session(ctx, hosts).names if h not in running)
    for host, run_id in running.items():
        _banner("launch", f"{safe(host)}: run {safe(run_id)} of {safe(job.name)} is already running; following it")
    if todo:
        _banner("launch")
        # no watch window here: tail below shows the run from its first line (each line once)
        code = ctx.invoke(launch_cmd, hosts=todo, job_path=job_path, wait=0.0 if not no_tail else None,
                          force=False, as_json=False)
        if code:
            err_console.print(f"[red]up: stopped at launch (exit {code})[/]", highlight=False)
            return int(code)
    if no_tail:
        return 0
    _banner("tail", "Ctrl-C detaches; the run goes on")
    # a new run is shown from its first byte; a run that was already going, from its last lines
    lines = "+0" if not running else "10"
    code = ctx.invoke(tail_cmd, hosts=hosts, run=None, no_follow=False, lines=lines, job_path=job_path)
    err_console.print(f"up: finished in {time.monotonic() - t0:.0f}s (exit {code})", highlight=False)
    return int(code)


COMMANDS = [up_cmd]
