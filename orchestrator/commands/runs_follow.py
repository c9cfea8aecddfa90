"""Following runs' logs on every host of a session: what `dfo tail` does, and the last step of `dfo up`
(on the connections `up` already holds)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import click

from ..cli_common import err_console, report_error, safe
from ..config import LoadedJob
from ..diagnosis import render as render_diagnoses
from ..errors import EXIT_RUN, EXIT_VERIFY, ConnectionLost
from ..steps import runs as steps
from ..steps.outputs import final_line
from .runs_view import RECAP_LINES, LogLines, dfo_cmd, how, state_markup

if TYPE_CHECKING:
    from ..hosts import HostSession, Outcome
    from ..transport import Transport


def run_workspace(conn: Transport, loaded: LoadedJob | None) -> str | None:
    """Where the runs are: the job's workspace, else the host's."""
    return steps.job_workspace(loaded.job if loaded else None, conn.host.workspace)


def follow_hosts(ctx: click.Context, sess: HostSession, *, run: str | None, no_follow: bool, start: int | str,
                 loaded: LoadedJob | None, job_path: str | None, quiet: bool = False
                 ) -> tuple[int, list[Outcome[steps.RunInfo]], dict[str, list[str]]]:
    """tail on every host of the session (its connections kept open): (exit code, outcome per host, the
    last lines seen per host). ``quiet``: the log lines are not printed (dfo's notes and the end of each
    run still go to stderr)."""
    out = LogLines(len(sess.names) > 1, quiet=quiet)
    current: dict[str, str | None] = {}
    last: dict[str, deque[str]] = {h: deque(maxlen=RECAP_LINES) for h in sess.names}

    def line(host: str) -> Callable[[str], None]:
        show = out.line(host)

        def on_line(text: str) -> None:
            last[host].append(text)
            show(text)
        return on_line

    def one(conn: Transport) -> steps.RunInfo:
        ws, job = run_workspace(conn, loaded), loaded.job.name if loaded else None
        current[conn.name] = the_run = run
        if the_run is None:  # the newest run (of the job with -j): say which one is followed
            newest = steps.status(conn, ws, job=job, limit=1)
            if newest:
                the_run = current[conn.name] = newest[0].id
                among = f"of job {job}" if job else "of any job here (-j JOB: a job's newest)"
                out.note(conn.name)(f"run {the_run} (job {newest[0].job or '?'}): the newest run {among}")
        if no_follow:
            return steps.read_lines(conn, ws, the_run, start, line(conn.name), job=job)
        return steps.follow(conn, ws, run=the_run, job=job, lines=start, on_line=line(conn.name),
                            on_note=out.note(conn.name))

    def resume(host: str) -> str:
        the_run = current.get(host) or run
        return dfo_cmd(ctx, "tail", host, *([the_run] if the_run else []), job_path=job_path)

    def detached() -> None:
        for host in sess.names:
            err_console.print(f"dfo: detached from {safe(host)}; the run keeps running (resume: {safe(resume(host))})",
                              highlight=False, soft_wrap=True)

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
        outcomes = sess.each(one)
    except KeyboardInterrupt:
        detached()
        return 130, [], {}
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    code = 0
    for o in outcomes:
        if o.error is not None:
            if isinstance(o.error, ConnectionLost):
                o.error.hint = f"the run is not affected; resume with: {resume(o.host)}"
            report_error(o.error)
            code = max(code, o.error.exit_code)
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
        if info.state != "succeeded":
            code = max(code, EXIT_RUN)
        elif info.outputs_failed():
            code = max(code, EXIT_VERIFY)
    return code, outcomes, {h: list(v) for h, v in last.items()}
