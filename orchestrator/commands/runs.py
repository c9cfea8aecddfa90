"""dfo launch / tail / status / stop: thin click commands over orchestrator.steps.runs."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..cli_common import (
    console,
    emit,
    err_console,
    hosts_option,
    job_option,
    json_option,
    report_error,
    session,
)
from ..config import LoadedJob, RunConfig, load_job
from ..connection import Connection
from ..diagnosis import render as render_diagnoses
from ..errors import EXIT_RUN, UsageError
from ..steps import runs as steps

_OUT = threading.Lock()
STATE_STYLE = {"running": "cyan", "succeeded": "green", "failed": "red", "stopped": "yellow", "lost": "magenta"}
RECAP_LINES = 10


def _given_run(run: str | None, command: str) -> str | None:
    """RUN as given. An explicitly empty one (a script's unset $RUN) is refused (exit 2), never taken
    to mean "the newest run": `dfo stop -H node ""` must not stop whichever run happens to be newest."""
    if run is not None and not run.strip():
        leave_out = "" if command == "stop" else ", or leave RUN out for the newest run"
        raise UsageError(f"dfo {command}: RUN is empty (an unset variable?): give a run id or its unique prefix"
                         f"{leave_out}")
    return run


class _Lines:
    """Log lines to stdout (raw, never markup), prefixed with the host when there are several."""

    def __init__(self, multi: bool, quiet: bool = False) -> None:
        self.multi, self.quiet = multi, quiet

    def line(self, host: str) -> Callable[[str], None]:
        def out(text: str) -> None:
            if self.quiet:
                return
            with _OUT:
                sys.stdout.write(f"{host} | {text}\n" if self.multi else text + "\n")
                sys.stdout.flush()
        return out

    def note(self, host: str) -> Callable[[str], None]:
        """dfo's own remarks (uploads, reconnects): stderr, so stdout stays the log."""
        def out(text: str) -> None:
            with _OUT:
                err_console.print(f"[dim]dfo: {escape(f'{host}: {text}' if self.multi else text)}[/]", soft_wrap=True)
        return out


def _dfo(ctx: click.Context, *args: str) -> str:
    inv = ctx.obj.get("inventory")
    return shlex.join(["dfo", *(["-i", inv] if inv else []), *args])


def _workspace(conn: Connection, loaded: LoadedJob | None) -> str:
    return steps.job_workspace(loaded.job if loaded else None, conn.host.workspace)


def _recap(info: steps.RunInfo, seen: list[str]) -> list[str]:
    lines = info.tail or seen
    return lines[-RECAP_LINES:]


def _how(info: steps.RunInfo) -> str:
    if info.state == "lost":
        if info.group_left:
            return (f"the trainer and its supervisor are gone with no end record, but {len(info.group_left)} "
                    "processes of its group are still alive: dfo stop ends them")
        return "its processes are gone and nothing recorded how it ended"
    if info.signal:
        return f"killed by {info.signal}"
    return f"exit code {info.exit_code}"


def _guard_line(info: steps.RunInfo) -> str | None:
    g = info.autotune_guard
    if not g:
        return None
    if g.get("installed"):
        return "autotune guard: installed in the trainer's interpreter"
    last = g.get("last") or {}
    if g.get("records"):
        return f"autotune guard: NOT installed: {last.get('error') or last}"
    return "autotune guard: enabled; no record yet (the guard records when triton is first imported)"


# --------------------------------------------------------------------------- launch


@dataclass
class Launched:
    info: steps.RunInfo
    final: steps.RunInfo
    seen: list[str] = field(default_factory=list)
    watched: float = 0.0

    @property
    def exit_code(self) -> int:
        return EXIT_RUN if self.final.state in ("failed", "lost", "stopped") else 0

    def to_json(self) -> dict[str, Any]:
        f = self.final
        return {"run": self.info.id, "pid": self.info.pid, "state": f.state, "exit_code": f.exit_code,
                "signal": f.signal, "run_dir": self.info.run_dir, "uploads": self.info.uploads,
                "autotune_guard": f.autotune_guard, "watched_seconds": round(self.watched, 1),
                "last_lines": _recap(f, self.seen) if f.state != "running" else [],
                "diagnosis": [d.to_json() for d in f.diagnoses(self.seen)]}


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
    tail and stop it (exit 0). Ctrl-C while watching leaves the run running (exit 130).
    """
    loaded = load_job(job_path)
    run = loaded.need("run")
    assert isinstance(run, RunConfig)
    window = run.wait if wait is None else wait
    sess = session(ctx, hosts)
    lines = _Lines(len(sess.names) > 1, quiet=as_json)
    started: dict[str, steps.RunInfo] = {}

    def one(conn: Connection) -> Launched:
        info = steps.launch(conn, loaded, force=force)
        started[conn.name] = info
        if not as_json:
            with _OUT:
                console.print(f"[bold]{conn.name}[/]: started run [bold]{info.id}[/] (pid {info.pid}); "
                              f"watching {window:g}s", highlight=False, soft_wrap=True)
            for u in info.uploads or []:
                if u.get("changed"):
                    lines.note(conn.name)(f"uploaded {u['path']} to {run.workdir} (sha256 {u['sha256'][:12]})")
        seen: deque[str] = deque(maxlen=steps.TAIL_FOR_DIAGNOSIS)
        show = lines.line(conn.name)

        def on_line(text: str) -> None:
            seen.append(text)
            show(text)

        t0 = time.monotonic()
        final = info
        if window > 0:
            # a dead link ends the watch within ~30 s (exit 4, the run keeps going), not after tail's 300 s
            final = steps.follow(conn, _workspace(conn, loaded), run=info.id, lines="+1", max_seconds=window,
                                 on_line=on_line, on_note=lines.note(conn.name), reconnect_budget_s=10)
        return Launched(info, final, list(seen), time.monotonic() - t0)

    def render(host: str, r: Launched) -> None:
        f = r.final
        style = STATE_STYLE.get(f.state, "white")
        if f.state == "running":
            console.print(f"[bold]{host}[/]: run [bold]{f.id}[/] is [{style}]running[/] (pid {f.pid}) "
                          f"after {r.watched:.0f}s")
            console.print(f"  follow: {_dfo(ctx, 'tail', '-H', host, f.id)}", highlight=False, soft_wrap=True)
            console.print(f"  status: {_dfo(ctx, 'status', '-H', host, f.id)}", highlight=False, soft_wrap=True)
            console.print(f"  stop:   {_dfo(ctx, 'stop', '-H', host, f.id)}", highlight=False, soft_wrap=True)
        else:
            console.print(f"[bold]{host}[/]: run [bold]{f.id}[/] [{style}]{f.state}[/] after {_duration(f)} "
                          f"({_how(f)})")
            if f.state != "succeeded" and len(r.seen) > RECAP_LINES:  # else they are right above
                console.print("last lines:")
                for ln in _recap(f, r.seen):
                    console.print("  " + escape(ln), highlight=False, soft_wrap=True)
            for ln in render_diagnoses(f.diagnoses(r.seen)):
                console.print(escape(ln), highlight=False, soft_wrap=True)
        guard = _guard_line(f)
        if guard:
            console.print("  " + escape(guard))

    try:
        with sess:
            outcomes = sess.each(one)
    except KeyboardInterrupt:
        for host, info in started.items():
            err_console.print(f"dfo: detached; run {info.id} keeps running on {host}: "
                              f"{_dfo(ctx, 'tail', '-H', host, info.id)}", highlight=False, soft_wrap=True)
        return 130
    return emit(outcomes, as_json, Launched.to_json, render)


# --------------------------------------------------------------------------- tail


@click.command("tail")
@hosts_option
@click.argument("run", required=False)
@click.option("--no-follow", is_flag=True, help="Print the last lines and exit 0, like `tail` without -f.")
@click.option("-n", "--lines", default="10", show_default=True, metavar="N|+N",
              help="Start with the last N lines, or from line N with +N (+1: the whole log).")
@job_option(required=False)
@click.pass_context
def tail_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str | None, no_follow: bool, lines: str,
             job_path: str | None) -> int:
    """Follow a run's log until the run ends (RUN: an id or its unique prefix; default: the newest run).

    \b
    The controller holds the byte offset of the next line it needs. When the connection drops
    (or nothing, not even a heartbeat, arrives for 8s) it reconnects with backoff and resumes at
    that exact offset: every line is printed once, in order. It ends when the run has ended and
    its log is drained: exit 0 when the run succeeded, 5 when it failed, was stopped or was lost
    (with a diagnosis on stderr). Ctrl-C detaches and leaves the run alone: exit 130.
    Log lines go to stdout exactly as the trainer wrote them; dfo's own notes go to stderr.
    With -j, runs are looked up in the job's workspace and RUN defaults to that job's newest run.
    """
    run = _given_run(run, "tail")
    if not (lines.isdigit() or (lines.startswith("+") and lines[1:].isdigit())):
        raise UsageError(f"--lines {lines!r}: expected N or +N")
    start: int | str = lines if lines.startswith("+") else int(lines)
    loaded = load_job(job_path) if job_path else None
    sess = session(ctx, hosts)
    out = _Lines(len(sess.names) > 1)
    current: dict[str, str | None] = {}

    def one(conn: Connection) -> steps.RunInfo:
        ws, job = _workspace(conn, loaded), loaded.job.name if loaded else None
        current[conn.name] = run
        if no_follow:
            return steps.read_lines(conn, ws, run, start, out.line(conn.name), job=job)
        return steps.follow(conn, ws, run=run, job=job, lines=start, on_line=out.line(conn.name),
                            on_note=out.note(conn.name))

    def detached() -> None:
        for host in sess.names:
            err_console.print(f"dfo: detached from {host}; the run keeps running "
                              f"(resume: {_dfo(ctx, 'tail', '-H', host, *([run] if run else []))})", highlight=False, soft_wrap=True)

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
        with sess:
            outcomes = sess.each(one)
    except KeyboardInterrupt:
        detached()
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    code = 0
    for o in outcomes:
        if o.error is not None:
            report_error(o.error)
            code = max(code, o.error.exit_code)
            continue
        info: steps.RunInfo = o.value
        if no_follow:
            err_console.print(f"dfo: {o.host}: run {info.id}: {info.state}", highlight=False, soft_wrap=True)
            continue
        style = STATE_STYLE.get(info.state, "white")
        err_console.print(f"dfo: {o.host}: run {info.id} [{style}]{info.state}[/] ({_how(info)})", highlight=False, soft_wrap=True)
        for ln in render_diagnoses(info.diagnoses()):
            err_console.print(escape(ln), highlight=False, soft_wrap=True)
        if info.state != "succeeded":
            code = max(code, EXIT_RUN)
    return code


# --------------------------------------------------------------------------- status


def _when(iso: str | None) -> str:
    return (iso or "-").replace("T", " ").replace("Z", "")


def _duration(info: steps.RunInfo) -> str:
    if not info.started_ts:
        return "-"
    end = info.ended_ts or (time.time() if info.state == "running" else None)
    if end is None:
        return "-"
    s = int(max(0, end - info.started_ts))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def _exit(info: steps.RunInfo) -> str:
    return info.signal or ("-" if info.exit_code is None else str(info.exit_code))


def _render_status(host: str, runs: list[steps.RunInfo], detail: bool) -> None:
    if not runs:
        console.print(f"[bold]{host}[/]: no runs")
        return
    if detail:
        r = runs[0]
        t = Table(title=f"{host}: run {r.id}", title_justify="left", show_header=False, box=None, pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        style = STATE_STYLE.get(r.state, "white")
        for k, v in [("job", r.job), ("state", f"[{style}]{r.state}[/]" + (f" ({_how(r)})" if r.state == "lost" else "")),
                     ("pid", str(r.pid)),
                     ("started", _when(r.started)), ("ended", _when(r.ended)), ("duration", _duration(r)),
                     ("exit", _exit(r)), ("command", escape(r.command or "")), ("workdir", escape(r.workdir or "")),
                     ("run dir", escape(r.run_dir or ""))]:
            t.add_row(k, v or "-")
        guard = _guard_line(r)
        if guard:
            t.add_row("autotune", escape(guard.split(": ", 1)[1]))
        console.print(t)
        lines = r.tail or ([r.last_line] if r.last_line else [])
        if lines:
            console.print("last lines:" if len(lines) > 1 else "last line:")
            for ln in lines[-RECAP_LINES:]:
                console.print("  " + escape(ln), highlight=False, soft_wrap=True)
        for ln in render_diagnoses(r.diagnoses()):
            console.print(escape(ln), highlight=False, soft_wrap=True)
        return
    t = Table(title=f"{host}", title_justify="left", box=None, pad_edge=False, header_style="bold")
    for col in ("id", "job", "state", "started", "duration", "exit"):
        t.add_column(col, no_wrap=True)
    t.add_column("last line", no_wrap=True, overflow="ellipsis")
    for r in runs:
        style = STATE_STYLE.get(r.state, "white")
        t.add_row(r.id, r.job or "?", f"[{style}]{r.state}[/]", _when(r.started), _duration(r), _exit(r),
                  escape((r.last_line or "")[:80]))
    (console if console.is_terminal else Console(highlight=False, width=250)).print(t)  # a pipe gets whole ids
    for r in runs:
        ds = r.diagnoses()
        if ds:
            console.print(f"  {r.id}: {ds[0].title} (details: {_dfo(click.get_current_context(), 'status', '-H', host, r.id)})",
                          highlight=False, soft_wrap=True)


@click.command("status")
@hosts_option
@click.argument("run", required=False)
@job_option(required=False)
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Show at most this many runs per host.")
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
    run in detail, with its last lines. With -j: only that job's runs, in its workspace.
    """
    run = _given_run(run, "status")
    loaded = load_job(job_path) if job_path else None
    sess = session(ctx, hosts)

    def one(conn: Connection) -> list[steps.RunInfo]:
        return steps.status(conn, _workspace(conn, loaded), run=run, job=loaded.job.name if loaded else None,
                            limit=limit)

    with sess:
        outcomes = sess.each(one)
    return emit(outcomes, as_json, lambda runs: {"runs": [r.brief_json() for r in runs]},
                lambda host, runs: _render_status(host, runs, detail=run is not None))


# --------------------------------------------------------------------------- stop


@click.command("stop")
@hosts_option
@click.argument("run")
@click.option("--grace", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="Seconds between SIGTERM and SIGKILL (default: the run's job run.stop_grace, 30).")
@job_option(required=False)
@json_option
@click.pass_context
def stop_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str, grace: float | None, job_path: str | None,
             as_json: bool) -> int:
    """Stop a run: SIGTERM to its whole process group, then SIGKILL after the grace period.

    The run is recorded as stopped (dfo status shows it so). A run that has already ended is
    left as it is (exit 0, says so). RUN is an id or its unique prefix.
    """
    run = _given_run(run, "stop") or ""
    loaded = load_job(job_path) if job_path else None
    sess = session(ctx, hosts)

    def one(conn: Connection) -> steps.RunInfo:
        return steps.stop(conn, _workspace(conn, loaded), run, grace, job=loaded.job.name if loaded else None)

    def render(host: str, r: steps.RunInfo) -> None:
        if r.stop and r.stop.startswith("nothing to stop"):
            console.print(f"[bold]{host}[/]: run {r.id}: {escape(r.stop or '')}")
            return
        left = f"; {len(r.group_left)} processes of its group remain!" if r.group_left else ""
        console.print(f"[bold]{host}[/]: run {r.id} [{STATE_STYLE.get(r.state, 'white')}]{r.state}[/] "
                      f"({escape(r.stop or '')}; {r.stop_seconds or 0:.1f}s){left}")

    with sess:
        outcomes = sess.each(one)
    return emit(outcomes, as_json, lambda r: {"run": r.id, "state": r.state, "stop": r.stop,
                                              "seconds": r.stop_seconds, "group_left": r.group_left}, render)


COMMANDS = [launch_cmd, tail_cmd, status_cmd, stop_cmd]
