"""Following runs' logs on every host of a session, as `dfo tail` shows it, and the last step of `dfo up`
(on the connections `up` already holds): the view of steps/fleet.py follow_all, Ctrl-C, the end of
each run."""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

import click

from ..cli_common import err_console, report_error, safe
from ..diagnosis import render as render_diagnoses
from ..steps import fleet
from ..steps import runs as steps
from ..steps.outputs import final_line
from ..steps.workspace import job_workspace
from .runs_view import RECAP_LINES, LogLines, dfo_cmd, how, state_markup

if TYPE_CHECKING:
    from ..config.models import LoadedJob
    from ..hosts import HostSession, Outcome
    from ..transport.base import Transport


def run_workspace(conn: Transport, loaded: LoadedJob | None) -> str | None:
    """Where the runs are: the job's workspace, else the host's."""
    return job_workspace(loaded.job if loaded else None, conn.host.workspace)


class _View:
    """Log lines on stdout, dfo's notes on stderr, and the commands that follow a run again."""

    def __init__(self, ctx: click.Context, out: LogLines, run: str | None, job_path: str | None) -> None:
        self.ctx, self.out, self.run, self.job_path = ctx, out, run, job_path
        self.current: dict[str, str | None] = {}
        self.line, self.note = out.line, out.note

    def following(self, host: str, run: str | None) -> None:
        self.current[host] = run

    def resume(self, host: str, run: str | None = None) -> str:
        the_run = run or self.current.get(host) or self.run
        return dfo_cmd(self.ctx, "tail", host, *([the_run] if the_run else []), job_path=self.job_path)


def _across_restarts(sess: HostSession, view: _View, followed: fleet.Followed, loaded: LoadedJob) -> fleet.Followed:
    """A job with run.spares/run.restarts: when the run followed ends and its watcher starts a newer
    generation (orchestrator/steps/recovery.py), follow that one, on its hosts, with a line at each restart."""
    from ..hosts import HostSession as Session
    from ..steps.recovery import next_generation

    while True:
        runs_seen = [r for r in followed.current.values() if r]
        if not runs_seen:
            return followed
        ended_ok = all(o.error is None and o.value is not None and o.value.state == "succeeded"
                       for o in followed.outcomes)
        doc = next_generation(loaded, runs_seen[0], ended_ok)
        if doc is None:
            return followed
        last = (doc.get("restarts") or [{}])[-1]
        who = f"{last.get('lost_host')} lost, {last.get('spare')} in its place" if last.get("lost_host") else \
            str(last.get("detail") or last.get("why") or "")
        hosts = [h for h in doc.get("hosts") or [] if h in sess.inventory.hosts]
        err_console.print(safe(f"dfo: --- restart: generation {doc.get('generation')} ({who}): following run "
                               f"{doc.get('run')} on {', '.join(hosts)} ---"), highlight=False, soft_wrap=True)
        if not hosts:
            return followed
        with Session.from_inventory(sess.inventory, sess.inventory_path, hosts) as nsess:
            followed = fleet.follow_all(nsess, view, run=str(doc.get("run")), no_follow=False, start="+1",
                                        loaded=loaded, keep=RECAP_LINES)


def follow_hosts(ctx: click.Context, sess: HostSession, *, run: str | None, no_follow: bool, start: int | str,
                 loaded: LoadedJob | None, job_path: str | None, quiet: bool = False
                 ) -> tuple[int, list[Outcome[steps.RunInfo]], dict[str, list[str]]]:
    """tail on every host of the session (its connections kept open): (exit code, outcome per host, the
    last lines seen per host). ``quiet``: the log lines are not printed (dfo's notes and the end of each
    run still go to stderr)."""
    view = _View(ctx, LogLines(len(sess.names) > 1, quiet=quiet), run, job_path)

    def detached() -> None:
        for host in sess.names:
            err_console.print(f"dfo: detached from {safe(host)}; the run keeps running "
                              f"(resume: {safe(view.resume(host))})", highlight=False, soft_wrap=True)

    def on_sigint(signum: int, frame: object) -> None:
        # Ctrl-C while following: leave at once. Nothing on the node needs cleaning up, and closing
        # SSH connections politely can stall on a loaded machine or a dead link.
        try:
            sys.stdout.flush()
            detached()
            sys.stderr.flush()
        finally:
            os._exit(130)

    previous = None
    if not no_follow and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        followed = fleet.follow_all(sess, view, run=run, no_follow=no_follow, start=start, loaded=loaded,
                                    keep=RECAP_LINES)
        if not no_follow and loaded is not None and loaded.job.run is not None and loaded.job.run.recovers:
            followed = _across_restarts(sess, view, followed, loaded)
    except KeyboardInterrupt:
        detached()
        return 130, [], {}
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    for o in followed.outcomes:
        if o.error is not None:
            report_error(o.error)
            continue
        info = o.value
        assert info is not None  # no error: one() returned it
        if no_follow:
            err_console.print(f"dfo: {safe(o.host)}: run {safe(info.id)}: {safe(info.state)}", highlight=False,
                              soft_wrap=True)
            continue
        err_console.print(f"dfo: {safe(o.host)}: run {safe(info.id)} {state_markup(info.state)} ({how(info)})",
                          highlight=False, soft_wrap=True)
        for ln in render_diagnoses(info.diagnoses()):
            err_console.print(safe(ln), highlight=False, soft_wrap=True)
        ended = final_line(info.outputs)
        if ended:  # how the run's last pass went (the follow ends only after it)
            err_console.print(f"dfo: {safe(o.host)}: " + (f"[red]{safe(ended[0])}[/]" if ended[1] else safe(ended[0])),
                              highlight=False, soft_wrap=True)
    return followed.code, followed.outcomes, followed.last
