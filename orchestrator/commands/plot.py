"""dfo plot: a run's curves (loss, throughput, GPU utilisation, ...) from its metrics.jsonl, as a PNG
(matplotlib: the ``plot`` extra) or drawn in the terminal; several runs overlaid."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import click

from ..cli_common import console, job_option, json_option, print_json, safe
from ..config.models import LoadedJob, load_job
from ..errors import DfoError, UsageError
from ..steps import metrics as sm
from ..transport.base import Transport
from .runs_follow import run_workspace

BUILTIN = ("loss", "lr", "tok_s", "step", "gpu_util", "gpu_mem", "gpu_power", "gpu_temp", "cpu_pct", "rss",
           "mem_used", "load1")
DEFAULT_METRICS = ("loss", "tok_s", "gpu_util")


def say_note(note: str | None) -> None:
    """A remark of dfo's on stderr (stdout stays the document or the log): a --from-s3 bound hit."""
    if note:
        from ..cli_common import err_console

        err_console.print(f"dfo: {safe(note)}", highlight=False, soft_wrap=True)


def print_log_from_s3(loaded: LoadedJob | None, run: str | None, start: int | str) -> int:
    """dfo tail --from-s3: the run's log as its node last put it beside outputs.dest, read as a stream
    (at most metrics.from_s3_bound("log") bytes: its newest part, said on stderr when the bound is hit)."""
    if loaded is None or not run:
        raise UsageError("dfo tail --from-s3 needs the job (-j) and the run's whole id",
                         hint="dfo tail -H HOST --from-s3 -j JOB RUN")
    import sys
    from collections import deque

    body = sm.open_from_s3(loaded, run, "log")
    lines = (text for raw in body.lines() for text in (raw.decode(errors="replace").splitlines() or [""]))
    out: list[str] = []

    def flush() -> None:
        sys.stdout.write("".join(out))  # the trainer's bytes, as tail prints them
        out.clear()

    if isinstance(start, str):  # +K: from line K on, written as it comes
        first = int(start[1:])
        for i, text in enumerate(lines, 1):
            if i >= first:
                out.append(text + "\n")
                if len(out) >= 4096:
                    flush()
    elif start:  # the last N lines
        out.extend(text + "\n" for text in deque(lines, maxlen=start))
    flush()
    sys.stdout.flush()
    say_note(body.note)
    return 0


def split_args(args: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """[RUN] [METRIC...]: the first argument is a run unless it names a built-in metric."""
    if args and args[0] not in BUILTIN:
        return args[0], list(args[1:])
    return None, list(args)


MARKS = (("!", "nan"), ("^", "inf"), ("v", "-inf"))  # how a non-finite training figure is drawn


def _kind(y: float) -> str:
    return "nan" if math.isnan(y) else "inf" if y > 0 else "-inf"


def nonfinite(xs: list[float], ys: list[float]) -> list[dict[str, Any]]:
    """The points of a series whose value is not finite (a diverged trainer's nan or inf): ``{x, value}``;
    JSON prints their ``y`` as null, this list says which they were."""
    return [{"x": x, "value": _kind(y)} for x, y in zip(xs, ys, strict=True) if not math.isfinite(y)]


def _xs_text(xs: list[float], xlabel: str) -> str:
    shown = ", ".join(f"{x:.6g}" for x in xs[:8])
    return f"{xlabel} {shown}" + (f" and {len(xs) - 8} more" if len(xs) > 8 else "")


def terminal_plot(xs: list[float], ys: list[float], width: int = 64, height: int = 12,
                  xlabel: str = "x") -> list[str]:
    """A character plot of one series: ``height`` rows of ``width`` columns, the y range on the left.
    A value that is not finite is a marked point (``!`` nan and ``^`` inf on the top row, ``v`` -inf on
    the bottom one) outside the range, named under the plot; the range is that of the finite values."""
    if not ys:
        return ["  (no values)"]
    fin = [y for y in ys if math.isfinite(y)]
    lo, hi = (min(fin), max(fin)) if fin else (0.0, 0.0)
    x0, x1 = min(xs), max(xs)
    span, xspan = (hi - lo) or 1.0, (x1 - x0) or 1.0
    grid = [[" "] * width for _ in range(height)]
    marks = dict((k, m) for m, k in MARKS)
    for x, y in zip(xs, ys, strict=True):
        c = min(width - 1, int((x - x0) / xspan * (width - 1)))
        if math.isfinite(y):
            r = min(height - 1, int((y - lo) / span * (height - 1)))
            grid[height - 1 - r][c] = "*"
        else:
            grid[height - 1 if y < 0 else 0][c] = marks[_kind(y)]
    label = max(len(f"{hi:.4g}"), len(f"{lo:.4g}"))
    out = []
    for i, row in enumerate(grid):
        tick = f"{hi:.4g}" if i == 0 else f"{lo:.4g}" if i == height - 1 else ""
        out.append(f"{tick:>{label}} |{''.join(row)}")
    out.append(" " * label + " +" + "-" * width)
    out.append(" " * label + f"  {x0:.6g}" + f"{x1:.6g}".rjust(max(1, width - len(f'{x0:.6g}'))))
    for mark, kind in MARKS:
        at = [x for x, y in zip(xs, ys, strict=True) if not math.isfinite(y) and _kind(y) == kind]
        if at:
            out.append(f"  {mark} {kind} at {_xs_text(at, xlabel)}")
    if not fin:
        out.append("  (no finite values)")
    return out


def write_png(series: list[dict[str, Any]], metrics: list[str], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("dfo plot -o needs matplotlib, which is not installed here",
                         hint="pip install 'dfo-orchestrator[plot]' (or leave -o out for a terminal plot)") from None
    n = len(metrics)
    cols = 1 if n == 1 else 2
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.6 * rows), squeeze=False)
    for k, metric in enumerate(metrics):
        ax = axes[k // cols][k % cols]
        for s in (s for s in series if s["metric"] == metric):
            ys = [y if math.isfinite(y) else math.nan for y in s["y"]]  # a gap where the value is not finite
            line = ax.plot(s["x"], ys, label=f"{s['run']} ({s['host']})", linewidth=1.2)[0]
            for mark, kind in MARKS:  # and a marked point at the top (nan, inf) or the bottom (-inf)
                at = [p["x"] for p in s["nonfinite"] if p["value"] == kind]
                if at:
                    ax.plot(at, [0.0 if kind == "-inf" else 1.0] * len(at), linestyle="none", clip_on=False,
                            marker={"!": "x", "^": "^", "v": "v"}[mark], color=line.get_color(),
                            transform=ax.get_xaxis_transform(), label=f"{kind} ({s['run']})")
        ax.set_title(metric)
        ax.set_xlabel(next((s["xlabel"] for s in series if s["metric"] == metric), ""))
        ax.grid(alpha=0.3)
        if len({(s["host"], s["run"]) for s in series}) > 1 or any(s["nonfinite"] for s in series
                                                                   if s["metric"] == metric):
            ax.legend(fontsize=7)
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp{time.time_ns()}{out.suffix}")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)  # nothing half-written


@click.command("plot")
@click.option("-H", "--host", "hosts", multiple=True, metavar="HOST",
              help="A host, a group, or 'all' from the inventory; may repeat (or comma-separate).")
@click.argument("args", nargs=-1, metavar="[RUN] [METRIC...]")
@click.option("--vs", "more_runs", multiple=True, metavar="RUN", help="Another run to overlay (may repeat).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None, metavar="FILE.png",
              help="Write a PNG (needs matplotlib: the plot extra); without it, a plot in the terminal.")
@click.option("--from-s3", "from_s3", is_flag=True,
              help="Read the run's metrics.jsonl from outputs.dest (with -j) instead of the node: for a run whose "
                   "node is gone. RUN must be whole.")
@job_option(required=False)
@json_option
@click.pass_context
def plot_cmd(ctx: click.Context, hosts: tuple[str, ...], args: tuple[str, ...], more_runs: tuple[str, ...],
             output: Path | None, from_s3: bool, job_path: str | None, as_json: bool) -> int:
    """Plot a run's curves: loss, throughput, GPU utilisation over time.

    RUN: an id or its unique prefix (default: the newest run). METRIC: a training figure from the
    log (loss, lr, tok_s, or a run.log_metrics name), plotted against the step; or a sample,
    plotted against seconds since the first row: gpu_util, gpu_mem, gpu_power, gpu_temp (mean
    over the GPUs), cpu_pct, load1, mem_used, rss. Default: loss, tok_s and gpu_util (those the
    run has). Several hosts (-H) or --vs RUN overlay their runs, one line each. --json prints the
    series plotted (and the file). docs/metrics.md.

    \b
    Exit codes: 0 plotted; 2 bad usage, no such run, no such metric, or -o without matplotlib;
    4 host unreachable.
    """
    run, metrics = split_args(args)
    loaded = load_job(job_path) if job_path else None
    if from_s3:
        if loaded is None or run is None:
            raise UsageError("dfo plot --from-s3 needs the job (-j) and the run's whole id",
                             hint="dfo plot --from-s3 -j JOB RUN [METRIC...]")
        got = []
        for r in (run, *more_runs):
            rows, note = sm.rows_from_s3(loaded, r)
            say_note(note)
            got.append(("s3", r, rows))
        return _plot(got, metrics, output, as_json)
    if not hosts:
        raise UsageError("dfo plot needs -H HOST (or --from-s3 with -j)")
    from ..hosts import HostSession

    sess = HostSession(ctx.obj.get("inventory"), hosts)

    def one(conn: Transport) -> list[tuple[str, list[dict[str, Any]]]]:
        ws = run_workspace(conn, loaded)
        out = []
        for r in (run, *more_runs) if more_runs else (run,):
            info, rows = sm.fetch(conn, ws, run=r, job=loaded.job.name if loaded else None, max_rows=20000)
            out.append((info.id, rows))
        return out

    with sess:
        outcomes = sess.each(one)
    for o in outcomes:
        if o.error is not None:
            raise o.error
    return _plot([(o.host, rid, rows) for o in outcomes for rid, rows in (o.value or [])], metrics, output, as_json)


def _plot(runs: list[tuple[str, str, list[dict[str, Any]]]], metrics: list[str], output: Path | None,
          as_json: bool) -> int:
    wanted = metrics or [m for m in DEFAULT_METRICS if any(sm.series(rows, m)[1] for _, _, rows in runs)]
    if not wanted:
        raise UsageError("nothing to plot: the run has no rows in its metrics.jsonl yet",
                         hint="the sampler writes one every run.metrics_every seconds (docs/metrics.md)")
    series: list[dict[str, Any]] = []
    for host, rid, rows in runs:
        for metric in wanted:
            xs, ys = sm.series(rows, metric)
            series.append({"host": host, "run": rid, "metric": metric, "xlabel": sm.x_label(rows, metric),
                           "x": xs, "y": ys, "nonfinite": nonfinite(xs, ys)})
    empty = [m for m in wanted if not any(s["y"] for s in series if s["metric"] == m)]
    if empty:
        raise UsageError(f"no values of {', '.join(empty)} in the run's metrics.jsonl",
                         hint="known: " + ", ".join(BUILTIN) + ", and run.log_metrics names")
    if output is not None:
        try:
            write_png(series, wanted, output)
        except OSError as exc:
            raise DfoError(f"{output}: {exc.strerror or exc}", hint="give a path this user may write") from None
    if as_json:
        print_json({"file": str(output) if output else None, "series": series})
        return 0
    if output is not None:
        console.print(f"wrote {safe(output)}: {', '.join(wanted)} of {len(runs)} run(s)", highlight=False)
        return 0
    for s in series:
        console.print(f"[bold]{safe(s['metric'])}[/] of {safe(s['run'])} on {safe(s['host'])} "
                      f"(x: {s['xlabel']}, {len(s['y'])} points)", highlight=False)
        for ln in terminal_plot(s["x"], s["y"], xlabel=s["xlabel"]):
            console.print(safe(ln), highlight=False, markup=False)
    return 0


COMMANDS = [plot_cmd]
