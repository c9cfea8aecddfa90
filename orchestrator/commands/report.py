"""dfo report: what a run cost and how it used its GPUs, from its record and metrics.jsonl."""

from __future__ import annotations

import math
from typing import Any

import click

from ..cli_common import console, emit, hosts_option, job_option, json_option, print_json, safe
from ..config.models import load_job
from ..errors import UsageError
from ..steps import metrics as sm
from ..steps.health import brief, brief_text
from ..steps.runs import RunInfo
from ..transport.base import Transport
from .plot import say_note
from .runs_follow import run_workspace


def render(host: str, s: dict[str, Any]) -> None:
    def v(x: Any, fmt: str = "", unit: str = "") -> str:
        """A figure as text; ``nan``/``inf`` (the last loss of a diverged run) as themselves."""
        if x is None:
            return "-"
        if isinstance(x, float) and not math.isfinite(x):
            return str(x) + unit
        return (format(x, fmt) if fmt else str(x)) + unit

    rows = [("run", s["run"]), ("host", host), ("state", s["state"]), ("started", s["started"]),
            ("ended", s["ended"]), ("hours", v((s["seconds"] or 0) / 3600, ".2f")),
            ("cost", v(s["cost"], ".2f", f" (at {s['price_per_hour']}/h)") if s["cost"] is not None
             else "- (no hosts.NAME.price_per_hour)"),
            ("GPUs", v(s["gpus"])), ("GPU-hours", v(s["gpu_hours"], ".2f")),
            ("mean GPU util", v(s["mean_gpu_util"], ".1f", "%")), ("mean tok/s", v(s["mean_tok_s"], ".1f")),
            ("last step", v(s["last_step"])), ("last loss", v(s["last_loss"])), ("XID errors", v(len(s["xid"]))),
            ("shipper restarts", v((s["restarts"] or {}).get("shipper", 0))), ("samples", v(s["samples"])),
            ("health gate", brief_text(s["health"], 200) if s.get("health") else "- (none recorded here)")]
    for k, x in rows:
        console.print(f"[bold]{k:>16}[/]  {safe(x)}", highlight=False)


@click.command("report")
@hosts_option
@click.argument("run", required=False)
@click.option("--from-s3", "from_s3", is_flag=True,
              help="Read the run's metrics.jsonl from beside outputs.dest (with -j; RUN whole): for a run whose "
                   "node is gone. Its times are those of the first and last rows.")
@job_option(required=False)
@json_option
@click.pass_context
def report_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str | None, from_s3: bool, job_path: str | None,
               as_json: bool) -> int:
    """What a run cost and how it used its GPUs: cost, GPU-hours, mean GPU utilisation, tokens/s.

    Also the last step and loss, the XID errors seen and the outputs shipper's restarts. The
    cost is the run's wall time times hosts.NAME.price_per_hour (or defaults.price_per_hour);
    the rest comes from the run's metrics.jsonl (docs/metrics.md). RUN: an id or its unique
    prefix (default: the newest run).

    \b
    Exit codes: 0 reported; 2 bad usage or no such run; 4 host unreachable.
    """
    loaded = load_job(job_path) if job_path else None
    from ..hosts import HostSession

    sess = HostSession(ctx.obj.get("inventory"), hosts)
    if from_s3:  # no node: the rows the node put beside outputs.dest, priced as the first host of -H
        if loaded is None or not run:
            raise UsageError("dfo report --from-s3 needs the job (-j) and the run's whole id",
                             hint="dfo report -H HOST --from-s3 -j JOB RUN")
        rows, note = sm.rows_from_s3(loaded, run)  # bounded, parsed as a stream, thinned as the node thins
        say_note(note)
        ts = [float(r["t"]) for r in rows]  # noderows: every row has a finite t
        info = RunInfo(id=run, job=loaded.job.name, state="unknown (from S3)", started_ts=min(ts, default=None),
                       ended_ts=max(ts, default=None), host=sess.names[0])
        doc = sm.summary(info, rows, sm.price_of(sess.inventory, sess.names[0]))
        if as_json:
            print_json({"hosts": {sess.names[0]: doc}})
        else:
            render(sess.names[0], doc)
        return 0

    def one(conn: Transport) -> dict[str, Any]:
        info, rows = sm.fetch(conn, run_workspace(conn, loaded), run=run, job=loaded.job.name if loaded else None)
        return {**sm.summary(info, rows, sm.price_of(sess.inventory, conn.host.name)), "health": brief(conn.host)}

    with sess:
        outcomes = sess.each(one)
    return emit(outcomes, as_json, lambda d: d, render)


COMMANDS = [report_cmd]
