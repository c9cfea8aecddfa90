"""What launch / tail / status / stop print about runs (the human view; --json is the contract).

Every string here that comes from the node (run ids, job names, states, times, commands, paths,
log lines, diagnoses) goes through ``safe``: it is text, never rich markup, and its control
characters are shown as escapes, never obeyed. Only the log stream itself (`tail`, and the first
seconds that `launch` watches) passes the trainer's bytes through untouched.
"""

from __future__ import annotations

import shlex
import sys
import threading
import time
from collections.abc import Callable

import click

from ..cli_common import console, err_console, safe
from ..diagnosis import render as render_diagnoses
from ..steps import runs as steps
from ..steps.fleet import RECAP_LINES, recap  # noqa: F401 - re-exported
from ..steps.metrics import sample_line
from ..steps.outputs import summary_line

STATE_STYLE = {"running": "cyan", "succeeded": "green", "failed": "red", "stopped": "yellow", "lost": "magenta"}
OUT = threading.Lock()  # one writer at a time: log lines and dfo's notes from several hosts


class LogLines:
    """Log lines to stdout (raw, never markup), prefixed with the host when there are several."""

    def __init__(self, multi: bool, quiet: bool = False) -> None:
        self.multi, self.quiet = multi, quiet

    def line(self, host: str) -> Callable[[str], None]:
        def out(text: str) -> None:
            if self.quiet:
                return
            with OUT:
                sys.stdout.write(f"[{host}] {text}\n" if self.multi else text + "\n")
                sys.stdout.flush()
        return out

    def note(self, host: str) -> Callable[[str], None]:
        """dfo's own remarks (uploads, reconnects): stderr, so stdout stays the log."""
        def out(text: str) -> None:
            with OUT:
                named = text.startswith(f"{host}: ")  # a note that names its host already
                err_console.print(f"[dim]dfo: {safe(f'{host}: {text}' if self.multi and not named else text)}[/]",
                                  soft_wrap=True)
        return out


def dfo_cmd(ctx: click.Context, command: str, host: str, *args: str, job_path: str | None = None) -> str:
    """A dfo command line that works when pasted: with -i when an inventory was given, and -j (the
    job file as given) when a job was used, since a job's runs live in its own workspace."""
    inv = (ctx.obj or {}).get("inventory")
    argv = ["dfo", *(["-i", inv] if inv else []), command, "-H", host, *(["-j", job_path] if job_path else []), *args]
    return shlex.join(argv)


def state_markup(state: str) -> str:
    return f"[{STATE_STYLE.get(state, 'white')}]{safe(state)}[/]"


def how(info: steps.RunInfo) -> str:
    """How the run ended, as markup-safe text."""
    if info.state == "lost":
        if info.group_left:
            return (f"the trainer and its supervisor are gone with no end record, but {len(info.group_left)} "
                    "processes of its group are still alive: dfo stop ends them")
        return "its processes are gone and nothing recorded how it ended"
    if info.signal:
        return f"killed by {safe(info.signal)}"
    return f"exit code {info.exit_code}"


def guard_line(info: steps.RunInfo) -> str | None:
    """The autotune guard's state, as plain text (may quote the node: escape before printing)."""
    g = info.autotune_guard
    if not g:
        return None
    if g.get("installed"):
        return "autotune guard: installed in the trainer's interpreter"
    last = g.get("last") or {}
    if g.get("records"):
        return f"autotune guard: NOT installed: {last.get('error') or last}"
    return "autotune guard: enabled; no record yet (the guard records when triton is first imported)"


def print_lines(lines: list[str], indent: str = "") -> None:
    for ln in lines:
        console.print(indent + safe(ln), highlight=False, soft_wrap=True)


def when(iso: str | None) -> str:
    return (iso or "-").replace("T", " ").replace("Z", "")


def duration(info: steps.RunInfo) -> str:
    if not info.started_ts:
        return "-"
    end = info.ended_ts or (time.time() if info.state == "running" else None)
    if end is None:
        return "-"
    s = int(max(0, end - info.started_ts))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else (f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s")


def exit_text(info: steps.RunInfo) -> str:
    return info.signal or ("-" if info.exit_code is None else str(info.exit_code))


def _story(g: dict[str, object] | None) -> str | None:
    if not g:
        return None
    from ..steps.generation import story  # S3's client: only for a run that recovers

    return story(g)


def render_status(ctx: click.Context, host: str, runs: list[steps.RunInfo], detail: bool,
                  job_path: str | None) -> None:
    from rich.table import Table  # rich once there is a table to print (after the node answered)

    if not runs:
        console.print(f"[bold]{safe(host)}[/]: no runs")
        return
    if detail:
        r = runs[0]
        t = Table(title=f"{safe(host)}: run {safe(r.id)}", title_justify="left", show_header=False, box=None,
                  pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        lost = f" ({how(r)})" if r.state == "lost" else ""
        for k, v in [("job", safe(r.job)), ("state", state_markup(r.state) + lost), ("pid", safe(r.pid)),
                     ("started", safe(when(r.started))), ("ended", safe(when(r.ended))), ("duration", duration(r)),
                     ("exit", safe(exit_text(r))), ("command", safe(r.command)), ("workdir", safe(r.workdir)),
                     ("run dir", safe(r.run_dir))]:
            t.add_row(k, v or "-")
        guard = guard_line(r)
        if guard:
            t.add_row("autotune", safe(guard.split(": ", 1)[1]))
        shipped = summary_line(r.outputs)
        if shipped:
            t.add_row("outputs", safe(shipped.split(": ", 1)[1]))
        sampled = sample_line(r.metrics)
        if sampled:
            t.add_row("metrics", safe(sampled))
        if r.cost is not None:
            t.add_row("cost", f"{r.cost:.2f}")
        recovered = _story(r.generation)
        if recovered:
            t.add_row("recovery", safe(recovered))
        console.print(t)
        lines = r.tail or ([r.last_line] if r.last_line else [])
        if lines:
            console.print("last lines:" if len(lines) > 1 else "last line:")
            print_lines(lines[-RECAP_LINES:], "  ")
        print_lines(render_diagnoses(r.diagnoses()))
        return
    t = Table(title=safe(host), title_justify="left", box=None, pad_edge=False, header_style="bold")
    for col in ("id", "job", "state", "started", "duration", "exit"):
        t.add_column(col, no_wrap=True)
    t.add_column("last line", no_wrap=True, overflow="ellipsis")
    for r in runs:
        t.add_row(safe(r.id), safe(r.job or "?"), state_markup(r.state), safe(when(r.started)), duration(r),
                  safe(exit_text(r)), safe((r.last_line or "")[:80]))
    console.print(t)  # off a terminal: whole ids, no padding (DfoConsole)
    for r in runs:
        shipped = summary_line(r.outputs)
        if shipped:
            console.print(f"  {safe(r.id)}: {safe(shipped)}", highlight=False, soft_wrap=True)
        sampled = sample_line(r.metrics) if r.state == "running" else None
        if sampled:  # the sampler's last row: one line per running run (docs/metrics.md)
            cost = f" | cost {r.cost:.2f}" if r.cost is not None else ""
            console.print(f"  {safe(r.id)}: {safe(sampled)}{cost}", highlight=False, soft_wrap=True)
        recovered = _story(r.generation)
        if recovered:
            console.print(f"  {safe(r.id)}: {safe(recovered)}", highlight=False, soft_wrap=True)
    for r in runs:
        ds = r.diagnoses()
        if ds:
            details = dfo_cmd(ctx, "status", host, r.id, job_path=job_path)
            console.print(f"  {safe(r.id)}: {safe(ds[0].title)} (details: {safe(details)})", highlight=False,
                          soft_wrap=True)
