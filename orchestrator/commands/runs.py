"""dfo launch / tail / status / stop: thin click commands over orchestrator.steps.runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from ..cli_common import (
    Outcome,
    console,
    emit,
    err_console,
    exit_code_of,
    fleet_summary,
    hosts_json,
    hosts_option,
    job_option,
    json_option,
    print_json,
    safe,
    session,
    show_outcome,
)
from ..diagnosis import render as render_diagnoses
from ..errors import DfoError, UsageError
from ..steps import fleet
from ..steps import runs as steps
from ..steps.gang import check_hosts, is_gang
from ..steps.outputs import final_line as outputs_final
from ..transport.base import Transport
from .runs_follow import follow_hosts
from .runs_follow import run_workspace as _workspace
from .runs_gang import gang_line, gang_summary
from .runs_view import (
    OUT,
    RECAP_LINES,
    LogLines,
    dfo_cmd,
    duration,
    guard_line,
    how,
    print_lines,
    recap,
    render_status,
    state_markup,
)

if TYPE_CHECKING:
    from ..config.models import LoadedJob


def _load_job(path: str) -> LoadedJob:
    """The job file (its models, pydantic and yaml, are loaded here: status and tail without -j never load them)."""
    from ..config.models import load_job

    return load_job(path)


def _given_run(run: str | None, command: str) -> str | None:
    """RUN as given. An explicitly empty one (a script's unset $RUN) is refused (exit 2), never taken
    to mean "the newest run": `dfo stop -H node ""` must not stop whichever run happens to be newest."""
    if run is not None and not run.strip():
        leave_out = "" if command == "stop" else ", or leave RUN out for the newest run"
        raise UsageError(f"dfo {command}: RUN is empty (an unset variable?): give a run id or its unique prefix"
                         f"{leave_out}")
    return run


# --------------------------------------------------------------------------- launch


@click.command("launch")
@hosts_option
@job_option()
@click.option("--wait", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Watch the new run this long (default: the job's run.wait), streaming its first lines.")
@click.option("--force", is_flag=True, help="Launch even though the job already has a live run on the host "
              "(the old run keeps running).")
@json_option
@click.pass_context
def launch_cmd(ctx: click.Context, hosts: tuple[str, ...], job_path: str, wait: float | None, force: bool,
               as_json: bool) -> int:
    """Start the job's run.command detached on the node and watch its first seconds.

    Pushes the job's code: folder first (as sync-code does). With outputs.dest and
    outputs.restore (the default), when outputs.path on the node is missing or empty (dfo's
    .dfo names aside), it is filled from outputs.dest first with sync-data's engine
    (verified, resumable) and one line says what came back ("restore: ..."); a path that
    holds files is left alone. With outputs.dest, the run's supervisor also starts the
    shipper (S3 credentials reach it on stdin only): see dfo outputs.
    Copies run.upload files (relative to the job file) into run.workdir when their sha256
    differs, then starts the trainer with `bash -c` under a small supervisor in a new session:
    stdin from /dev/null, stdout+stderr to the run's log, PYTHONUNBUFFERED=1 and run.env. The
    SSH call returns at once; the run survives the connection. The run's record lives in
    <workspace>/.dfo/runs/<run-id>/ (meta.json, log, end.json); secret variables (names matching
    SECRET/TOKEN/PASSWORD/KEY..., or listed in run.secret_env) reach the trainer's environment
    only, never the disk.

    \b
    A job with a live run on the host is refused (exit 2) unless --force. Then launch streams
    the log for --wait seconds: if the run dies in that window it prints the last lines and a
    diagnosis and exits 5; if it is alive it prints the run id, its pid, and the commands to
    follow, inspect and stop it (with -i and -j as given, so they work when pasted).
    Ctrl-C while watching leaves the run running (exit 130).

    \b
    Exit codes: 0 the run is alive after --wait (or ended with 0 in it); 2 bad job file, a
    run.upload file missing, no S3 credentials for outputs, or a live run refused; 3 the
    restore failed a check, or the run ended with 0 in the window but the last pass of its
    outputs failed; 4 host unreachable; 5 the run died in the window (failed, stopped or
    lost); 130 Ctrl-C (the run goes on).
    """
    from ..config.models import RunConfig

    loaded = _load_job(job_path)
    run = loaded.need("run")
    assert isinstance(run, RunConfig)
    from .preflight import check_run  # launch only: status and tail need not import it

    check_run(loaded)  # the whole run: section, before any host is touched (exit 2)
    from ..steps.outputs import check as check_outputs

    check_outputs(loaded)  # S3 credentials for outputs.dest (exit 2)
    window = run.wait if wait is None else wait
    sess = session(ctx, hosts)
    if is_gang(loaded.job):  # -H names exactly run.nodes hosts (exit 2, before any host is touched)
        check_hosts(run, [sess.hosts[n] for n in sess.names], loaded.job.name)
    gang: dict[str, Any] = {}
    one, render, started = launcher(ctx, loaded, job_path, window=window, force=force, quiet=as_json,
                                    multi=len(sess.names) > 1, gang=gang)
    try:
        with sess:
            prepare_gang(sess, loaded, gang, quiet=as_json)
            outcomes = sess.each(one)
    except KeyboardInterrupt:
        detached_launch(ctx, started, job_path)
        return 130
    return emit(outcomes, as_json, fleet.Launched.to_json, render)


def show_gang(plan: Any) -> None:
    ranks = ", ".join(f"{n.host}={n.rank}" for n in plan.nodes)
    err_console.print(f"dfo: gang of {len(plan.nodes)}: run {safe(plan.run_id)} (ranks {safe(ranks)}; rank 0 at "
                      f"{safe(plan.master.address)}:{plan.rdzv_port}); preflight and address check passed",
                      highlight=False, soft_wrap=True)


def prepare_gang(sess: Any, loaded: LoadedJob, gang: dict[str, Any], *, quiet: bool) -> None:
    """A gang job: plan and check it (steps/fleet.py prepare_gang), and say so."""
    plan = fleet.prepare_gang(sess, loaded, gang)
    if plan is not None and not quiet:
        show_gang(plan)


def detached_launch(ctx: click.Context, started: dict[str, steps.RunInfo], job_path: str) -> None:
    for host, info in started.items():
        err_console.print(f"dfo: detached; run {safe(info.id)} keeps running on {safe(host)}: "
                          f"{safe(dfo_cmd(ctx, 'tail', host, info.id, job_path=job_path))}", highlight=False,
                          soft_wrap=True)


class _LaunchView:
    """A launch as the terminal shows it: the restore's progress bar (one host), the run started, the
    first seconds of its log."""

    def __init__(self, ctx: click.Context, job_path: str, lines: LogLines, *, quiet: bool, multi: bool,
                 workdir: str) -> None:
        self.ctx, self.job_path, self.quiet, self.multi, self.workdir = ctx, job_path, quiet, multi, workdir
        self.line, self.note = lines.line, lines.note
        self.started_runs: dict[str, steps.RunInfo] = {}

    @contextmanager
    def progress(self, host: str) -> Iterator[Callable[[dict[str, Any]], None]]:
        # a restore shows a progress bar on a terminal (one host: several bars would fight over it)
        from ..steps.transfer import ProgressView

        with ProgressView(console, enabled=not self.quiet and not self.multi) as view:
            yield view.callback(host)

    def started(self, host: str, info: steps.RunInfo, window: float) -> None:
        self.started_runs[host] = info
        if self.quiet:
            return
        with OUT:
            console.print(f"[bold]{safe(host)}[/]: started run [bold]{safe(info.id)}[/] (pid {safe(info.pid)}); "
                          f"watching {window:g}s", highlight=False, soft_wrap=True)
        for u in info.uploads or []:
            if u.get("changed"):
                self.note(host)(f"uploaded {u['path']} to {self.workdir} (sha256 {u['sha256'][:12]})")

    def command(self, command: str, host: str, run_id: str) -> str:
        return dfo_cmd(self.ctx, command, host, run_id, job_path=self.job_path)


def launcher(ctx: click.Context, loaded: LoadedJob, job_path: str, *, window: float, force: bool, quiet: bool,
             multi: bool, gang: dict[str, Any] | None = None
             ) -> tuple[Callable[[Transport], fleet.Launched], Callable[[str, fleet.Launched], None],
                        dict[str, steps.RunInfo]]:
    """(launch on one connection, render one host's result, the runs started so far by host).
    ``gang``: filled with {"plan": GangPlan} before the launch when the job is a gang's."""
    run = loaded.job.run
    assert run is not None
    view = _LaunchView(ctx, job_path, LogLines(multi, quiet=quiet), quiet=quiet, multi=multi, workdir=run.workdir)

    def one(conn: Transport) -> fleet.Launched:
        return fleet.launch_and_watch(conn, loaded, view, window=window, force=force, plan=(gang or {}).get("plan"))

    def render(host: str, r: fleet.Launched) -> None:
        f = r.final
        if f.state == "running":
            console.print(f"[bold]{safe(host)}[/]: run [bold]{safe(f.id)}[/] is {state_markup(f.state)} "
                          f"(pid {safe(f.pid)}) after {r.watched:.0f}s", soft_wrap=True)
            plan = (gang or {}).get("plan")
            if plan is None or host == plan.nodes[-1].host:  # a gang: once, for every node (-H all of them)
                where = ",".join(n.host for n in plan.nodes) if plan is not None else host
                for label, command in (("follow", "tail"), ("status", "status"), ("stop", "stop")):
                    console.print(f"  {label + ':':8}{safe(view.command(command, where, f.id))}", highlight=False,
                                  soft_wrap=True)
        else:
            console.print(f"[bold]{safe(host)}[/]: run [bold]{safe(f.id)}[/] {state_markup(f.state)} after "
                          f"{duration(f)} ({how(f)})", soft_wrap=True)
            if f.state != "succeeded" and len(r.seen) > RECAP_LINES:  # else they are right above
                console.print("last lines:")
                print_lines(recap(f, r.seen), "  ")
            print_lines(render_diagnoses(f.diagnoses(r.seen)))
            ended = outputs_final(f.outputs)
            if ended:
                console.print(("  [red]" if ended[1] else "  ") + safe(ended[0]) + ("[/]" if ended[1] else ""),
                              soft_wrap=True)
        guard = guard_line(f)
        if guard:
            console.print("  " + safe(guard), soft_wrap=True)

    return one, render, view.started_runs


# --------------------------------------------------------------------------- tail


@click.command("tail")
@hosts_option
@click.argument("run", required=False)
@click.option("--no-follow", is_flag=True, help="Print the last lines and exit 0, like `tail` without -f.")
@click.option("--from-s3", "from_s3", is_flag=True,
              help="Print the run's log from outputs.dest (with -j; RUN whole), for a run whose node is gone.")
@click.option("-n", "--lines", default="10", show_default=True, metavar="N|+N",
              help="Start with the last N lines, or from line N with +N (+1: the whole log).")
@job_option(required=False)
@click.pass_context
def tail_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str | None, no_follow: bool, from_s3: bool,
             lines: str, job_path: str | None) -> int:
    """Follow a run's log until the run ends (RUN: an id or its unique prefix; default: the newest run).

    \b
    The controller holds the byte offset of the next line it needs. When the connection drops
    (or nothing, not even a heartbeat, arrives for 8s) it reconnects with backoff and resumes at
    that exact offset: every line is printed once, in order. It ends when the run has ended and
    its log is drained: exit 0 when the run succeeded, 5 when it failed, was stopped or was lost
    (with a diagnosis on stderr). A run with outputs: is followed until the last pass of its
    shipper (after the run ended) has finished or failed, and a line on stderr says which.
    Ctrl-C detaches and leaves the run alone: exit 130.
    Log lines go to stdout exactly as the trainer wrote them; dfo's own notes go to stderr.
    With -j, runs are looked up in the job's workspace and RUN defaults to that job's newest run;
    without RUN or -j it is the newest run of any job there. Without RUN, the run taken (and its
    job) is named on stderr first.

    \b
    Exit codes: 0 the run succeeded (or --no-follow); 2 bad usage or no such run; 3 the run
    succeeded but the last pass of its outputs failed (dfo outputs --ship retries it); 4 host
    unreachable, or the connection stayed lost for 300s; 5 the run failed, was stopped or
    was lost; 130 Ctrl-C (the run goes on).
    """
    run = _given_run(run, "tail")
    if not (lines.isdigit() or (lines.startswith("+") and lines[1:].isdigit())):
        raise UsageError(f"--lines {lines!r}: expected N or +N")
    start: int | str = lines if lines.startswith("+") else int(lines)
    loaded = _load_job(job_path) if job_path else None
    if from_s3:  # the copy the node's supervisor put beside the checkpoints (docs/metrics.md)
        from .plot import print_log_from_s3

        return print_log_from_s3(loaded, run, start)
    sess = session(ctx, hosts)
    with sess:
        code, _, _ = follow_hosts(ctx, sess, run=run, no_follow=no_follow, start=start, loaded=loaded,
                                  job_path=job_path)
    return code


# --------------------------------------------------------------------------- status


@click.command("status")
@hosts_option
@click.argument("run", required=False)
@job_option(required=False)
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="Show at most this many runs per host.")
@json_option
@click.pass_context
def status_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str | None, job_path: str | None, limit: int,
               as_json: bool) -> int:
    """The runs on each host, newest first: id, job, state, started, duration, exit code, last line.

    \b
    States: running; succeeded (exit 0); failed (non-zero exit or a signal); stopped (by dfo
    stop); lost (its processes are gone and nothing recorded the end: the node rebooted or the
    processes were killed from outside; pids are checked together with their start times, so a
    reused pid never passes for the run). A failed or lost run gets a diagnosis. With RUN: that
    run in detail, with its last lines. With -j: only that job's runs, in its workspace; without
    it, every job's runs in the host's workspace (the job column says whose). A run with
    outputs: gets one "outputs:" line: the shipper's state, files and bytes shipped, how the
    last pass went and when, the lag, the last error (details: dfo outputs).

    \b
    Exit codes: 0 listed (also when there are no runs); 2 bad usage or no such run;
    4 host unreachable.
    """
    run = _given_run(run, "status")
    loaded = _load_job(job_path) if job_path else None
    sess = session(ctx, hosts)

    def one(conn: Transport) -> list[steps.RunInfo]:
        runs = steps.status(conn, _workspace(conn, loaded), run=run, job=loaded.job.name if loaded else None,
                            limit=limit)
        from ..steps.metrics import cost, price_of

        price = price_of(sess.inventory, conn.host.name)
        for r in runs:
            r.cost = cost(r, price)
        return runs

    record: dict[str, Any] = {}  # the generation record, read once, when a host's run first needs it (-j)
    shown = [0]

    def arrived(o: Outcome[list[steps.RunInfo]]) -> None:
        """Each host's runs as that host answers (a slow or hung host holds back nobody's)."""
        if loaded is not None and o.value:
            _resumed_steps(loaded, o.value, record)
        if not as_json:
            shown.append(show_outcome(o, lambda host, runs: render_status(ctx, host, runs, detail=run is not None,
                                                                          job_path=job_path)))

    with sess:
        outcomes = sess.each(one, on_done=arrived)
    gang = gang_summary(outcomes) if run is not None else None
    to_json = lambda runs: steps.StatusReport(runs=[r.brief() for r in runs]).model_dump()  # noqa: E731
    if as_json:
        print_json({**hosts_json(outcomes, to_json), **({"gang": gang} if gang is not None else {})})
        return exit_code_of(outcomes)
    if gang is not None:
        console.print(gang_line(gang), highlight=False, soft_wrap=True)
    fleet_summary("status", outcomes)
    return max(max(shown), exit_code_of(outcomes))


def _resumed_steps(loaded: LoadedJob, runs: list[steps.RunInfo], record: dict[str, Any]) -> None:
    """A run's meta.json holds its restarts as they stood at its launch, before the trainer said where it
    resumed; the watcher notes that step in the generation record since: with -j, status shows it from
    there (one GET; an unreadable record leaves the runs as the nodes told them)."""
    todo = [r for r in runs if r.generation and any(x.get("resumed_step") is None
                                                    for x in r.generation.get("restarts") or [])]
    if not todo or loaded.job.run is None or not loaded.job.run.recovers:
        return
    from ..steps.generation import place  # S3's client: only for a run that recovers

    if "doc" not in record:  # one GET for the whole command, whatever the number of hosts
        try:
            record["doc"], _ = place(loaded).read()
        except DfoError:
            record["doc"] = None
    doc = record["doc"]
    noted = {x.get("generation"): x.get("resumed_step") for x in (doc or {}).get("restarts") or []}
    for r in todo:
        g = r.generation or {}
        if doc and g.get("lineage") == doc.get("lineage"):
            g["restarts"] = [x if x.get("resumed_step") is not None else dict(x, resumed_step=noted.get(
                x.get("generation"))) for x in g.get("restarts") or []]


# --------------------------------------------------------------------------- stop


@click.command("stop")
@hosts_option
@click.argument("run")
@click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Seconds between SIGTERM and SIGKILL (default: the run's job run.stop_grace, 30).")
@click.option("--outputs-wait", type=click.FloatRange(min=0), default=600, show_default=True, metavar="SECONDS",
              help="With outputs.dest: wait this long for the stopped run's last pass (0: do not wait).")
@job_option(required=False)
@json_option
@click.pass_context
def stop_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str, grace: float | None, outputs_wait: float,
             job_path: str | None, as_json: bool) -> int:
    """Stop a run: SIGTERM to its whole process group, then SIGKILL after the grace period.

    The run is recorded as stopped (dfo status shows it so). A run that has already ended is
    left as it is (exit 0, says so). RUN is an id or its unique prefix. With -j, the run is
    looked up in the job's workspace. A run with outputs.dest gets one last pass after the
    trainer has stopped (it ships the checkpoint the trainer left): stop waits for it (up to
    --outputs-wait) and says how it went, so the node can be let go once stop returns.

    \b
    Exit codes: 0 stopped (or had already ended); 2 bad usage or no such run; 3 the last
    outputs pass failed or did not finish within --outputs-wait; 4 host unreachable.
    """
    run = _given_run(run, "stop") or ""
    loaded = _load_job(job_path) if job_path else None
    sess = session(ctx, hosts)

    def one(conn: Transport) -> steps.RunInfo:
        return steps.stop(conn, _workspace(conn, loaded), run, grace, job=loaded.job.name if loaded else None,
                          outputs_wait=outputs_wait)

    def shipped(r: steps.RunInfo) -> tuple[str, bool] | None:
        """How the stopped run's last outputs pass went (None: no outputs, or nothing was stopped)."""
        from orchestrator.steps.outputs import final_line

        if not r.outputs or (r.stop and r.stop.startswith("nothing to stop")):
            return None
        if outputs_wait == 0:
            return "outputs: not waited for (--outputs-wait 0); dfo outputs shows the last pass", False
        line = final_line(r.outputs)
        if line and r.outputs.get("state") not in ("done", "failed"):
            return f"outputs: the last pass did not finish within {outputs_wait:g}s; dfo outputs shows it", True
        return line

    def render(host: str, r: steps.RunInfo) -> None:
        if r.stop and r.stop.startswith("nothing to stop"):
            console.print(f"[bold]{safe(host)}[/]: run {safe(r.id)}: {safe(r.stop)}", soft_wrap=True)
            return
        left = f"; {len(r.group_left)} processes of its group remain!" if r.group_left else ""
        console.print(f"[bold]{safe(host)}[/]: run {safe(r.id)} {state_markup(r.state)} "
                      f"({safe(r.stop)}; {r.stop_seconds or 0:.1f}s){left}", soft_wrap=True)
        line = shipped(r)
        if line:
            console.print(f"[bold]{safe(host)}[/]: {safe(line[0])}", soft_wrap=True)

    with sess:
        outcomes = sess.each(one)
    code = emit(outcomes, as_json, lambda r: steps.StopReport.of(r).model_dump(), render)
    failed = any(o.value is not None and (s := shipped(o.value)) is not None and s[1] for o in outcomes)
    return max(code, 3) if failed else code


COMMANDS = [launch_cmd, tail_cmd, status_cmd, stop_cmd]
