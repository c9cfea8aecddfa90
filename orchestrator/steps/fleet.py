"""Runs on several hosts at once, the library side: launch on each host and watch the new run's first
seconds, follow every host's run to its end, and ``up``'s chain of steps.

What is shown is the caller's: each function takes a view (callbacks for log lines, dfo's notes,
progress bars, banners and each step's rendering), so commands/ only loads the job, calls these and
renders. Nothing here prints.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict

from ..errors import EXIT_RUN, EXIT_VERIFY, ConnectionLost, DfoError, UsageError
from ..hosts import HostSession, Outcome, error_json, exit_code_of
from . import runs
from .gang import is_gang
from .workspace import job_workspace

if TYPE_CHECKING:
    from ..config.models import LoadedJob
    from ..transport.base import Transport

Lines = Callable[[str], None]
OnEvent = Callable[[dict[str, Any]], None]
RECAP_LINES = 10  # a run's last lines, as launch, tail and up recap them (and --json's last_lines)


def recap(info: runs.RunInfo, seen: list[str]) -> list[str]:
    return (info.tail or seen)[-RECAP_LINES:]


def run_doc(info: runs.RunInfo, seen: list[str]) -> dict[str, Any]:
    """The run as it stands: status's fields for it, and its last lines (up --json's "run")."""
    return {**info.brief().model_dump(by_alias=True), "last_lines": recap(info, seen)}

# --------------------------------------------------------------------------- launch and watch


@dataclass
class Launched:
    """A run started on one host, and how it stood after the watch window."""

    info: runs.RunInfo
    final: runs.RunInfo
    seen: list[str] = field(default_factory=list)
    watched: float = 0.0

    @property
    def exit_code(self) -> int:
        if self.final.state in ("failed", "lost", "stopped"):
            return EXIT_RUN
        return EXIT_VERIFY if self.final.state == "succeeded" and self.final.outputs_failed() else 0

    def report(self) -> runs.LaunchReport:
        return runs.LaunchReport.of(self.info, self.final, self.seen, self.watched, recap(self.final, self.seen))

    def to_json(self) -> dict[str, Any]:
        return self.report().model_dump(by_alias=True)


class LaunchView(Protocol):
    """What a launch shows, per host."""

    def line(self, host: str) -> Lines: ...  # a log line of the watch window

    def note(self, host: str) -> Lines: ...  # dfo's own remark (the restore's line, an upload, a reconnect)

    def progress(self, host: str) -> AbstractContextManager[OnEvent]: ...  # the restore's progress bar

    def started(self, host: str, info: runs.RunInfo, window: float) -> None: ...

    def command(self, command: str, host: str, run_id: str) -> str: ...  # a dfo command line, for hints


def prepare_gang(sess: HostSession, loaded: LoadedJob, gang: dict[str, Any], names: list[str] | None = None,
                 say: Callable[[str], None] | None = None) -> Any:
    """Before a launch on ``names`` (default: the session's hosts): the job's run.health gate on each of them
    at once (exit 3 naming the host, GPU, figure and expected value; ``say`` gets each host's verdict). Then
    a gang job (run.nodes > 1 or launcher: torchrun): plan it over the session's hosts in -H order, check
    every node (preflight, addresses; exit 3 naming the nodes), and put the plan in ``gang`` (and return
    it); None for a job that is no gang."""
    from .gang import prepare
    from .health import gate

    run = loaded.job.run
    if not is_gang(loaded.job) and run is not None and run.recovers and len(sess.names) > 1:
        raise UsageError(f"job {loaded.job.name}: run.spares/run.restarts: one run per job, and -H names "
                         f"{len(sess.names)} hosts", hint="name one host, or make it a gang (run.nodes)")
    gate(sess, loaded, list(sess.names if names is None else names), say)
    if not is_gang(loaded.job):
        return None
    plan = gang["plan"] = prepare(sess, loaded.job, runs.new_run_id(loaded.job.name))
    if run is not None and run.recovers:  # the gang's generation, once for all its nodes (steps/generation.py)
        from .generation import begin

        plan.generation = begin(loaded, plan.run_id, [n.host for n in plan.nodes])
    return plan


def launch_and_watch(conn: Transport, loaded: LoadedJob, view: LaunchView, *, window: float, force: bool,
                     plan: Any = None) -> Launched:
    """Launch the job's run on one host (``plan``: the gang's, when it is one), then follow its log for
    ``window`` seconds. A refusal (a live run of the job) and a lost link name the dfo commands that
    reach the run."""
    run = loaded.job.run
    assert run is not None
    try:
        held: list[str] = []  # the restore's line, shown once its progress bar is gone
        try:
            with view.progress(conn.name) as on_event:
                info = runs.launch(conn, loaded, force=force, note=held.append, on_event=on_event,
                                   run_id=plan.run_id if plan else None, gang=plan)
        finally:
            for text in held:
                view.note(conn.name)(text)
    except DfoError as exc:
        live = (exc.details or {}).get("running")
        if live:  # refused: the job already runs here; say how to reach that run
            exc.hint = (f"follow it: {view.command('tail', conn.name, str(live))}; "
                        f"stop it: {view.command('stop', conn.name, str(live))}; or launch anyway with --force")
        raise
    view.started(conn.name, info, window)
    seen: deque[str] = deque(maxlen=runs.TAIL_FOR_DIAGNOSIS)
    show = view.line(conn.name)

    def on_line(text: str) -> None:
        seen.append(text)
        show(text)

    t0 = time.monotonic()
    final = info
    if window > 0:
        # a dead link ends the watch within ~30 s (exit 4, the run keeps going), not after tail's 300 s
        try:
            final = runs.follow(conn, job_workspace(loaded.job, conn.host.workspace), run=info.id, lines="+1",
                                max_seconds=window, on_line=on_line, on_note=view.note(conn.name),
                                reconnect_budget_s=10)
        except ConnectionLost as exc:  # the watch gave up reconnecting
            exc.hint = f"the run is not affected; resume with: {view.command('tail', conn.name, info.id)}"
            raise
    return Launched(info, final, list(seen), time.monotonic() - t0)


# --------------------------------------------------------------------------- follow every host


class FollowView(Protocol):
    def line(self, host: str) -> Lines: ...

    def note(self, host: str) -> Lines: ...

    def resume(self, host: str, run: str | None) -> str: ...  # the command that follows the run again

    def following(self, host: str, run: str | None) -> None: ...  # the run followed there is now known


@dataclass
class Followed:
    """Every host's run at the end (or its error), the exit code, and the last lines seen per host."""

    code: int
    outcomes: list[Outcome[runs.RunInfo]]
    last: dict[str, list[str]]
    current: dict[str, str | None]  # the run followed on each host (the newest, when none was named)


REPLACED_LOOK_S = 10.0  # while a followed node is silent: how often the generation record is read


def _replaced_check(loaded: LoadedJob | None, run: str | None) -> Callable[[], str | None] | None:
    """For a job that recovers: while the link to a followed node is down, is its run replaced (a watcher
    recovering it, a newer generation running)? Then tail stops reconnecting to that node and goes on with
    the newer generation (commands/runs_follow.py) instead of spending the reconnect budget. The record
    is read at most every REPLACED_LOOK_S; one that cannot be read answers no."""
    if loaded is None or run is None or loaded.job.run is None or not loaded.job.run.recovers:
        return None
    from .recovery import replaced

    looked = [0.0]

    def check() -> str | None:
        if time.monotonic() - looked[0] < REPLACED_LOOK_S:
            return None
        looked[0] = time.monotonic()
        try:
            return replaced(loaded, run)
        except DfoError:
            return None
    return check


def follow_all(sess: HostSession, view: FollowView, *, run: str | None, no_follow: bool, start: int | str,
               loaded: LoadedJob | None, keep: int) -> Followed:
    """tail on every host of the session (its connections kept open), until each run has ended and its
    log is drained (``no_follow``: the lines there are now). Exit code: the worst error's, else 5 when a
    run did not succeed, 3 when one succeeded but the last pass of its outputs failed, else 0."""
    current: dict[str, str | None] = {}
    last: dict[str, deque[str]] = {h: deque(maxlen=keep) for h in sess.names}

    def line(host: str) -> Lines:
        show = view.line(host)

        def on_line(text: str) -> None:
            last[host].append(text)
            show(text)
        return on_line

    def one(conn: Transport) -> runs.RunInfo:
        ws = job_workspace(loaded.job if loaded else None, conn.host.workspace)
        job = loaded.job.name if loaded else None
        current[conn.name] = the_run = run
        view.following(conn.name, the_run)
        if the_run is None:  # the newest run (of the job with -j): say which one is followed
            newest = runs.status(conn, ws, job=job, limit=1)
            if newest:
                the_run = current[conn.name] = newest[0].id
                view.following(conn.name, the_run)
                among = f"of job {job}" if job else "of any job here (-j JOB: a job's newest)"
                view.note(conn.name)(f"run {the_run} (job {newest[0].job or '?'}): the newest run {among}")
        if no_follow:
            return runs.read_lines(conn, ws, the_run, start, line(conn.name), job=job)
        return runs.follow(conn, ws, run=the_run, job=job, lines=start, on_line=line(conn.name),
                           on_note=view.note(conn.name), give_up=_replaced_check(loaded, the_run))

    outcomes = sess.each(one)
    code = 0
    for o in outcomes:
        if o.error is not None:
            if isinstance(o.error, ConnectionLost):
                again = view.resume(o.host, current.get(o.host) or run)
                o.error.hint = f"the run is not affected; resume with: {again}"
            code = max(code, o.error.exit_code)
        elif not no_follow:
            info = o.value
            assert info is not None
            if info.state != "succeeded":
                code = max(code, EXIT_RUN)
            elif info.outputs_failed():
                code = max(code, EXIT_VERIFY)
    return Followed(code, outcomes, {h: list(v) for h, v in last.items()}, current)


# --------------------------------------------------------------------------- up


class UpHost(BaseModel):
    """One host's steps: each is that command's --json document for the host (null: not run)."""

    model_config = ConfigDict(defer_build=True)  # built when first used, not at import

    provision: dict[str, Any] | None = None
    stage_model: dict[str, Any] | None = None
    sync_data: dict[str, Any] | None = None
    launch: dict[str, Any] | None = None  # null too when a live run of the job was followed instead
    run: dict[str, Any] | None = None  # the run as it stands at the end: status's fields + last_lines


class UpReport(BaseModel):
    """`up --json`: every host's steps, the step the chain stopped at (null: none), the exit code."""

    model_config = ConfigDict(defer_build=True)  # built when first used, not at import

    hosts: dict[str, UpHost]
    stopped_at: str | None = None
    exit_code: int = 0


class UpView(Protocol):
    """Each step of ``up`` as the caller runs and shows it; the chain decides the order, what is skipped,
    where it stops and what --json records."""

    def banner(self, step: str, note: str = "") -> None: ...  # note: plain text (it may quote the node)

    def provision(self, sess: HostSession) -> list[Outcome[Any]]: ...  # run on every host, and shown

    def transfer(self, sess: HostSession, what: str, request: dict[str, Any], command: str
                 ) -> list[Outcome[Any]]: ...

    def live_failed(self, failed: list[Outcome[Any]]) -> None: ...  # could not look for a live run

    def stopped(self, step: str, code: int) -> None: ...

    def error(self, exc: DfoError) -> None: ...

    def launcher(self, names: list[str], gang: dict[str, Any], window: float
                 ) -> tuple[Callable[[Any], Launched], Callable[[list[Outcome[Launched]]], None], Callable[[], None]]:
        """(launch on one connection, show the outcomes, say after Ctrl-C that the runs started go on)"""
        ...

    def gang_ready(self, plan: Any) -> None: ...

    def follow(self, sess: HostSession, start: int | str) -> Followed | None: ...  # None: detached (Ctrl-C)


def live_runs(sess: HostSession, loaded: LoadedJob) -> list[Outcome[str | None]]:
    """The job's live run on each host (its id, or None)."""

    def one(conn: Transport) -> str | None:
        found = runs.status(conn, job_workspace(loaded.job, conn.host.workspace), job=loaded.job.name, limit=5)
        return next((r.id for r in found if r.state == "running"), None)

    return sess.each(one)


def _record(report: UpReport, step: str, outcomes: list[Outcome[Any]], to_json: Callable[[Any], dict[str, Any]]
            ) -> int:
    for o in outcomes:
        setattr(report.hosts[o.host], step, error_json(o.error) if o.error is not None else to_json(o.value))
    return exit_code_of(outcomes)


def up_chain(sess: HostSession, loaded: LoadedJob, requests: dict[str, dict[str, Any]], view: UpView, *,
             no_tail: bool, report: UpReport) -> int | None:
    """provision, stage-model, sync-data, launch, tail on the session's connections, stopping at the first
    step that fails: its exit code; None when tail ran to the end (its code is then report.exit_code). A
    job whose run is alive on a host is not launched there again: that run is followed."""

    def stop(step: str, code: int) -> int:
        view.stopped(step, code)
        report.stopped_at = step
        return code

    from .provision import provision_json

    job = loaded.job
    view.banner("provision")
    outs = view.provision(sess)
    for o in outs:
        report.hosts[o.host].provision = provision_json(o)  # a failed host's too, as provision --json has it
    code = exit_code_of(outs)
    if code:
        return stop("provision", code)
    for what, step, command in (("model", "stage_model", "stage-model"), ("data", "sync_data", "sync-data")):
        if what not in requests:
            continue
        view.banner(command)
        outs = view.transfer(sess, what, requests[what], command)
        code = _record(report, step, outs, lambda r: r.model_dump(by_alias=True))
        if code:
            return stop(command, code)
    if job.run is None:
        view.banner("launch", "skipped: the job has no run: section")
        return 0
    live = live_runs(sess, loaded)
    failed = [o for o in live if o.error is not None]
    if failed:  # could not look for a live run: nothing is launched
        view.live_failed(failed)
        return stop("launch", _record(report, "launch", failed, dict))
    running = {o.host: o.value for o in live if o.value}
    todo = [h for h in sess.names if h not in running]
    for host, run_id in running.items():
        view.banner("launch", f"{host}: run {run_id} of {job.name} is already running; following it")
        report.hosts[host].run = {"id": run_id, "state": "running"}
    if todo:
        view.banner("launch")
        gang: dict[str, Any] = {}
        # no watch window without --no-tail: tail below shows the run from its first line (each line once)
        one, render, detached = view.launcher(todo, gang, job.run.wait if no_tail else 0.0)
        try:
            if running and is_gang(job):  # a gang starts on every node at once, or not at all
                raise UsageError(f"job {job.name}: a gang, and only some of its nodes run it "
                                 f"({', '.join(running)}): stop those runs first (dfo stop -H HOST RUN)")
            plan = prepare_gang(sess, loaded, gang, names=todo, say=lambda text: view.banner("health", text))
            if plan is not None:
                view.gang_ready(plan)
        except DfoError as exc:
            view.error(exc)
            for host in todo:
                report.hosts[host].launch = error_json(exc)
            return stop("launch", exc.exit_code)
        try:
            launched = sess.each(one, names=todo)
        except KeyboardInterrupt:
            detached()
            return 130
        render(launched)
        code = _record(report, "launch", launched, Launched.to_json)
        for o in launched:
            if o.value is not None:
                report.hosts[o.host].run = run_doc(o.value.final, o.value.seen)
        if code:
            return stop("launch", code)
    if no_tail:
        return 0
    view.banner("tail", "Ctrl-C detaches; the run goes on")
    # a new run is shown from its first byte; a run that was already going, from its last lines
    followed = view.follow(sess, "+0" if not running else 10)
    if followed is None:
        return 130
    for o in followed.outcomes:
        report.hosts[o.host].run = (error_json(o.error) if o.error is not None
                                    else run_doc(o.value, followed.last.get(o.host, [])))  # type: ignore[arg-type]
    report.exit_code = followed.code
    return None

