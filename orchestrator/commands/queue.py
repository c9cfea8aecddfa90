"""dfo submit / queue / cancel: thin click commands over orchestrator.steps.queue (the node side:
remote/runs/queue.py; the laptop's record of submits: orchestrator/steps/submits.py)."""

from __future__ import annotations

from typing import Any

import click

from ..cli_common import (
    console,
    exit_code_of,
    host_json,
    hosts_option,
    job_option,
    json_option,
    print_json,
    safe,
    session,
    show_outcome,
)
from ..config.models import LoadedJob, RunConfig, load_job
from ..errors import EXIT_RUN, ConfigError, DfoError, HostError, UsageError
from ..steps import queue as steps
from ..steps import submits
from ..transport.base import Transport
from . import queue_view as view
from .runs_follow import run_workspace


def _check_submittable(loaded: LoadedJob) -> None:
    run = loaded.need("run")
    assert isinstance(run, RunConfig)
    from ..steps.gang import is_gang

    if is_gang(loaded.job):
        raise UsageError(f"{loaded.path}: dfo submit queues runs of one node; this job is a gang (run.nodes "
                         f"{run.nodes}, launcher {run.launcher})", hint="launch gangs with dfo launch or dfo up")
    if run.recovers:
        raise UsageError(f"{loaded.path}: dfo submit does not recover runs onto spares (run.spares/run.restarts)",
                         hint="take them out for a queued run, or use dfo up --watch")
    if "CUDA_VISIBLE_DEVICES" in run.env or "CUDA_VISIBLE_DEVICES" in run.secret_env:
        raise ConfigError(f"{loaded.path}: run.env sets CUDA_VISIBLE_DEVICES: the queue hands GPUs out itself",
                          hint="take it out; set run.gpus to the number of GPUs one run needs")
    from .preflight import check_run

    check_run(loaded)
    from ..steps.outputs import check as check_outputs

    check_outputs(loaded)


# --------------------------------------------------------------------------- submit


@click.command("submit")
@hosts_option
@job_option(required=False)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Change a field of the job for this run only (run.env.LR=3e-4, run.command=..., run.gpus=2); "
                   "may repeat.")
@click.option("--requeue-from", "requeue_from", metavar="HOST",
              help="Move the runs this machine queued on HOST (a lost node) to the -H hosts, as submitted.")
@json_option
@click.pass_context
def submit_cmd(ctx: click.Context, hosts: tuple[str, ...], job_path: str | None, sets: tuple[str, ...],
               requeue_from: str | None, as_json: bool) -> int:
    """Queue one run of the job on the node that can start it soonest; prints the run id and where it went.

    The run needs run.gpus GPUs (default: all of the node's; the node's count is the inventory's
    gpus:, else nvidia-smi's). It goes to a -H host that has them free now (the one with the fewest
    free that fit), else to the host whose queue should free them soonest (GPU-runs ahead per GPU,
    as if runs lasted alike). On the node it waits in a queue kept beside the run records: FIFO, and a
    run that waits for GPUs is passed by nobody. When a run ends, its supervisor starts the next ones
    that fit, with this machine gone. Each gets its GPUs in CUDA_VISIBLE_DEVICES (never one another
    run holds, nor one a process outside dfo uses), and runs the code and job as they were now: the
    code is kept here (for --requeue-from) and copied into the run's own folder on the node.

    \b
    --set KEY=VALUE changes one field for this run (VALUE read as YAML; under run.env as text), so a
    sweep is a loop of submits. --requeue-from HOST takes the runs this machine queued on HOST and
    not yet seen started, cancels them there if HOST answers, and submits each to the -H hosts (same
    run id, same code and job). Not for gangs or runs with spares.

    \b
    Exit codes: 0 submitted (running or queued); 2 bad job file or --set, a run too big for every
    host; 3 the code changed under the submit five times; 4 no host could be reached; 5 the run
    could not start (its record, a failed run, says why).
    """
    if requeue_from:
        if job_path or sets:
            raise UsageError("dfo submit --requeue-from HOST takes no -j or --set: the runs go as they were submitted")
        return _requeue(ctx, hosts, requeue_from, as_json)
    if not job_path:
        raise UsageError("dfo submit: give -j JOB (or --requeue-from HOST)")
    from ..config.overrides import apply_sets
    from ..steps.runs import new_run_id

    loaded = apply_sets(load_job(job_path), sets)
    _check_submittable(loaded)
    sess = session(ctx, hosts)
    rid = new_run_id(loaded.job.name)
    rec = submits.keep(loaded, rid, list(sets))
    unreachable: dict[str, str] = {}

    def warn(text: str) -> None:
        host, _, rest = text.partition(": ")
        unreachable[host] = rest
        if not as_json:
            view.warn(text)

    try:
        with sess:
            placed = steps.place(sess, rec.loaded(), rid, sess.names, warn, note=None if not as_json else _quiet)
    except BaseException:
        submits.forget(rid)
        raise
    rec.seen_as(placed.state, placed.host)
    view.seen(placed)
    if as_json:
        print_json(view.placed_json([placed], unreachable))
    else:
        view.render_placed(ctx, placed, job_path)
    return EXIT_RUN if placed.state == "failed" else 0


def _quiet(text: str) -> None:
    return None


def _requeue(ctx: click.Context, hosts: tuple[str, ...], lost: str, as_json: bool) -> int:
    todo = [r for r in submits.all_records() if r.host == lost and r.state == "queued"]
    sess = session(ctx, (*hosts, lost))
    targets = [n for n in sess.names if n != lost]
    if lost not in sess.names:
        raise UsageError(f"--requeue-from {lost}: not a host of the inventory")
    if not targets:
        raise UsageError(f"--requeue-from {lost}: name the hosts to move its runs to with -H")
    if not todo:
        if not as_json:
            view.warn(f"{lost}: this machine has no run queued there (as last seen): nothing to move")
        else:
            print_json(view.placed_json([], {}, []))
        return 0
    placed: list[steps.Placed] = []
    unreachable: dict[str, str] = {}
    stayed: list[str] = []

    def warn(text: str) -> None:
        host, _, rest = text.partition(": ")
        unreachable[host] = rest
        if not as_json:
            view.warn(text)

    with sess:
        # the node answers: take each run out of its queue first (one that started meanwhile stays there)
        got = sess.each(lambda conn: [_take_out(conn, r) for r in todo], [lost])[0]
        if got.error is not None:
            if not isinstance(got.error, HostError):
                raise got.error
            warn(f"{lost}: {got.error.message}; moving the {len(todo)} run(s) it had queued when this machine "
                 f"last looked (should {lost} come back, its queue still holds them: dfo cancel there)")
            moving = todo
        else:
            moving = [r for r, ok in zip(todo, got.value or [], strict=True) if ok]
            for r, ok in zip(todo, got.value or [], strict=True):
                if not ok:
                    stayed.append(r.run)
                    if not as_json:
                        view.warn(f"{lost}: run {r.run} has started there: left where it is")
        for r in moving:
            p = steps.place(sess, r.loaded(), r.run, targets, warn, note=None if not as_json else _quiet)
            p.requeued_from = lost
            r.moves.append(submits.Move(at=submits.now_iso(), source=lost, to=p.host,
                                        why="requeued: the host was unreachable" if got.error else "requeued"))
            r.seen_as(p.state, p.host)
            view.seen(p)
            placed.append(p)
            if not as_json:
                view.render_placed(ctx, p, None)
    if as_json:
        print_json(view.placed_json(placed, unreachable, stayed))
    return EXIT_RUN if any(p.state == "failed" for p in placed) else 0


def _take_out(conn: Transport, r: submits.Submitted) -> bool:
    """True when the run was still queued on this node and has left its queue now."""
    from ..steps.workspace import job_workspace

    try:
        c = steps.cancel(conn, job_workspace(r.loaded().job, conn.host.workspace), r.run, only_queued=True)
    except ConfigError as exc:
        if (exc.details or {}).get("missing"):
            return True  # never reached the node's queue, or gone from it: this machine's copy goes
        raise
    if c.state != "cancelled":
        r.seen_as("started")
    return c.state == "cancelled"


# --------------------------------------------------------------------------- queue


@click.command("queue")
@hosts_option
@job_option(required=False)
@json_option
@click.pass_context
def queue_cmd(ctx: click.Context, hosts: tuple[str, ...], job_path: str | None, as_json: bool) -> int:
    """Each node's run queue: its GPUs, the runs running (with their GPUs) and the runs queued, in order.

    Looking moves the queue on: runs that fit start now (a supervisor killed from outside starts no
    successor; this does). With -j: the queue in that job's workspace (else the host's).
    A host that cannot be reached is exit 4, named, with the runs this machine had queued there
    when it last looked: dfo submit --requeue-from HOST -H OTHERS moves them.

    \b
    Exit codes: 0 listed; 2 bad usage; 4 a host could not be reached.
    """
    loaded = load_job(job_path) if job_path else None
    sess = session(ctx, hosts)

    def one(conn: Transport) -> steps.QueueView:
        return steps.node_queue(conn, run_workspace(conn, loaded))

    with sess:
        outcomes = sess.each(one)
    for o in outcomes:
        if o.value is not None:
            view.note_seen(o.host, [q.id for q in o.value.queued], [r.id for r in o.value.running])
        lost = view.lost_queue(o)
        if lost and o.error is not None:
            shown = ", ".join(lost[:10]) + (f" and {len(lost) - 10} more" if len(lost) > 10 else "")
            o.error.hint = (f"{len(lost)} run(s) were queued there when this machine last looked: {shown}; "
                            f"dfo submit --requeue-from {o.host} -H OTHER_HOSTS moves them")
    if as_json:
        doc: dict[str, Any] = {"hosts": {}}
        for o in outcomes:
            d = host_json(o, lambda v: v.model_dump())
            if o.error is not None:
                d["queued_when_last_seen"] = view.lost_queue(o)
            else:
                assert o.value is not None
                d["requeued_elsewhere"] = [{"id": q, "to": to} for q, to in view.moved_away(o.host, o.value)]
            doc["hosts"][o.host] = d
        print_json(doc)
        return exit_code_of(outcomes)
    shown_code = 0
    for o in outcomes:
        shown_code = max(shown_code, show_outcome(o, view.render_queue))
    return max(shown_code, exit_code_of(outcomes))


# --------------------------------------------------------------------------- cancel


@click.command("cancel")
@hosts_option
@click.argument("run")
@click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="A running run: seconds between SIGTERM and SIGKILL (default: its run.stop_grace, 30).")
@job_option(required=False)
@json_option
@click.pass_context
def cancel_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str, grace: float | None, job_path: str | None,
               as_json: bool) -> int:
    """Take a queued run out of its node's queue; a run that has started is stopped as dfo stop does.

    RUN is a run id or its unique prefix; it is looked for on every -H host. Cancelling the run that
    waited first lets the runs behind it start when they fit.

    \b
    Exit codes: 0 cancelled or stopped (or it had ended); 2 bad usage, or no -H host has that run;
    4 a host could not be reached.
    """
    if not run.strip():
        raise UsageError("dfo cancel: RUN is empty (an unset variable?): give a run id or its unique prefix")
    loaded = load_job(job_path) if job_path else None
    sess = session(ctx, hosts)

    def one(conn: Transport) -> steps.Cancelled | None:
        try:
            return steps.cancel(conn, run_workspace(conn, loaded), run, grace)
        except DfoError as exc:
            if (exc.details or {}).get("missing") and len(sess.names) > 1:
                return None  # not on this host: another -H host has it
            raise

    with sess:
        outcomes = sess.each(one)
    found = [o for o in outcomes if o.value is not None]
    mine = {r.run: r for r in submits.all_records()} if found else {}  # (never a path made of a node's id)
    for o in found:
        assert o.value is not None
        rec = mine.get(o.value.run) if o.value.was == "queued" else None
        if rec is not None and rec.host == o.host:
            rec.seen_as("cancelled")
    code = exit_code_of(outcomes)
    if not found and not any(o.error for o in outcomes):
        raise UsageError(f"no -H host has a queued or started run {run!r}", hint="dfo queue -H HOSTS lists them")
    if as_json:
        print_json({"hosts": {o.host: host_json(o, lambda v: v.model_dump() if v else {"found": False})
                              for o in outcomes}})
        return code

    def render(host: str, c: steps.Cancelled | None) -> None:
        if c is None:
            return
        if c.was == "queued":
            console.print(f"[bold]{safe(host)}[/]: run {safe(c.run)} left the queue (it was at position "
                          f"{c.position})", soft_wrap=True, highlight=False)
        elif c.was == "running":
            console.print(f"[bold]{safe(host)}[/]: run {safe(c.run)} {safe(c.state)} ({safe(c.stop)}; "
                          f"{c.stop_seconds or 0:.1f}s)", soft_wrap=True, highlight=False)
        else:
            console.print(f"[bold]{safe(host)}[/]: run {safe(c.run)}: nothing to cancel: the run is {safe(c.state)}",
                          soft_wrap=True, highlight=False)

    for o in outcomes:
        code = max(code, show_outcome(o, render))
    return code


COMMANDS = [submit_cmd, queue_cmd, cancel_cmd]
