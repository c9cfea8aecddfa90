"""dfo outputs: what a run's shipper sent to outputs.dest, and --ship for a pass now."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import click

from ..cli_common import hosts_option, job_option, json_option, session

if TYPE_CHECKING:
    from ..steps.outputs import OutputsReport, ShipReport
    from ..transport.base import Transport

_OUT = threading.Lock()


def _when(iso: str | None) -> str:
    return (iso or "-").replace("T", " ").replace("Z", "")


def render_outputs(host: str, r: OutputsReport) -> None:
    from remote.lib.fsutil import human_bytes

    from ..cli_common import console, safe
    from ..steps.outputs import files

    with _OUT:
        head = f"[bold]{safe(host)}[/]: run [bold]{safe(r.run)}[/] (job {safe(r.job or '?')}, {safe(r.run_state)})"
        if r.state is None:
            console.print(f"{head}: ships no outputs (its job had no outputs.dest when it was launched)",
                          soft_wrap=True, highlight=False)
            return
        console.print(f"{head}: outputs {safe(r.state)}", soft_wrap=True, highlight=False)
        if r.path or r.dest:
            every = f", every {r.every:g}s" if r.every else ""
            console.print(f"  {safe(r.path or '?')} -> {safe(r.dest or '?')}{every}", soft_wrap=True, highlight=False)
        lag = f"; lag {r.lag_s:.0f}s" if r.lag_s is not None else ""
        console.print(f"  shipped {files(r.shipped.get('files', 0))} ({human_bytes(r.shipped.get('bytes', 0))}) in "
                      f"{r.passes} pass{'es' if r.passes != 1 else ''} ({r.failed_passes} failed); "
                      f"{r.pending} pending{lag}", soft_wrap=True, highlight=False)
        for label, p in (("last pass", r.last_pass), ("final pass", r.final)):
            if not p or (label == "last pass" and r.final and p.get("n") == r.final.get("n")):
                continue
            if p.get("ok", True) is False:
                how = f"[red]FAILED[/]: {safe(p.get('error'))}"
            elif p.get("files"):
                how = (f"shipped {files(p.get('files') or 0)} ({human_bytes(p.get('bytes') or 0)}) in "
                       f"{float(p.get('seconds') or 0):.1f}s = {float(p.get('mb_per_s') or 0):.1f} MB/s")
            else:
                how = "no change"
            extra = "".join(f", {p[k]} {t}" for k, t in (("skipped", "already there"), ("pending", "pending"),
                                                          ("changed_during", "changed while sent")) if p.get(k))
            console.print(f"  {label} #{p.get('n', '?')} at {safe(_when(p.get('ended')))}: {how}{safe(extra)}",
                          soft_wrap=True, highlight=False)
        if r.errors:
            console.print("  errors:" if len(r.errors) > 1 else "  error:", highlight=False)
            for e in r.errors[-5:]:
                console.print(f"    {safe(_when(e.get('at')))}: {safe(e.get('error'))}", soft_wrap=True,
                              highlight=False)


def render_ship(host: str, r: ShipReport) -> None:
    from remote.lib.fsutil import human_bytes

    from ..cli_common import console, safe
    from ..steps.outputs import files
    from .report_view import print_moved

    with _OUT:
        if not r.ok:
            console.print(f"{safe(host)}: outputs --ship: [red]FAILED[/] (run {safe(r.run)}): {safe(r.error)}",
                          soft_wrap=True, highlight=False)
            return
        if r.status == "no change":
            console.print(f"{safe(host)}: outputs --ship: [dim]no change[/]: nothing new under {safe(r.source)} "
                          f"(run {safe(r.run)}: {files(r.files_total)}, {human_bytes(r.bytes_total)} shipped to "
                          f"{safe(r.dest)} so far; {r.seconds:.2f}s)", soft_wrap=True, highlight=False)
        else:
            print_moved(host, "outputs --ship", r, verb="shipped", detail=f" = {r.mb_per_s:.1f} MB/s")
        for n, t in ((r.pending, "still being written (changed within outputs.settle): the next pass takes {them}"),
                     (r.changed_during, "changed while being sent: not completed, the next pass sends {them}")):
            if n:
                console.print(f"  {files(n)} " + t.format(them="them" if n != 1 else "it"),
                              soft_wrap=True, highlight=False)


@click.command("outputs")
@hosts_option
@click.argument("run", required=False)
@job_option(required=False)
@click.option("--ship", is_flag=True, help="Make a pass now (new and changed files under outputs.path go to "
              "outputs.dest) and report it as sync-data does.")
@json_option
@click.pass_context
def outputs_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str | None, job_path: str | None, ship: bool,
                as_json: bool) -> int:
    """What a run shipped to outputs.dest: files, bytes, passes, last pass, lag, errors.

    RUN is a run id or its unique prefix (default: the newest run, of the job with -j).
    While the run lives, its shipper (started by the run's supervisor) sends new and changed
    files under outputs.path to outputs.dest every outputs.every seconds, once they are
    complete (unchanged for outputs.settle seconds, or renamed into place), and makes one
    last pass after the run ends. A failed pass never stops the run: the next pass retries
    it, and it shows here and in dfo status. Names starting with .dfo never ship.

    With --ship: a pass now. The run's shipper makes it when it is alive; once it has
    ended, the node makes the pass itself with the job's outputs: and S3 credentials,
    which needs -j JOB (credentials are resolved here as for sync-data and reach the node
    on stdin only). The report has sync-data's shape: "no change" when nothing new was
    complete, else the files and bytes shipped.

    With --json, each host's document is {"run", "job", "run_state", "state" (idle,
    shipping, done, failed, starting; null: the run ships nothing), "dest", "path", "every",
    "passes", "failed_passes", "shipped": {"files", "bytes"}, "pending", "lag_s",
    "last_pass", "final", "errors"}; with --ship, sync-data's report ("status": done, no
    change or failed; "fetched": files shipped, "bytes", "skipped", "files_total",
    "bytes_total", ...) plus "run", "pending", "changed_during" and "error".

    \b
    Exit codes: 0 listed, or --ship's pass went well (or had nothing to do); 2 bad usage,
    no such run, a run without outputs, or --ship on an ended run without -j; 3 --ship's
    pass failed (S3 refused, a check failed); 4 host unreachable.
    """
    from ..cli_common import emit
    from ..config.models import load_job
    from ..errors import EXIT_VERIFY, UsageError
    from ..steps import outputs as steps
    from ..steps.runs import outputs_of
    from .runs import _given_run
    from .runs_follow import run_workspace
    from .runs_view import LogLines

    run = _given_run(run, "outputs")
    loaded = load_job(job_path) if job_path else None
    if ship and loaded is not None:
        steps.check(loaded)  # S3 credentials, before any host is touched (exit 2)
    sess = session(ctx, hosts)
    notes = LogLines(len(sess.names) > 1, quiet=True)
    job = loaded.job.name if loaded else None

    def one(conn: Transport) -> Any:
        ws = run_workspace(conn, loaded)
        info = outputs_of(conn, ws, run, job)
        if run is None:
            among = f"of job {job}" if job else "of any job here (-j JOB: a job's newest)"
            notes.note(conn.name)(f"run {info.id} (job {info.job or '?'}): the newest run {among}")
        if not ship:
            return steps.OutputsReport.of(info)
        o = info.outputs or {}
        spec = (steps.outputs_spec(loaded, info.id)
                if loaded and loaded.job.outputs and loaded.job.outputs.dest else None)
        if not o and spec is None:
            raise UsageError(f"run {info.id} ships no outputs: its job had no outputs.dest when it was launched"
                             + ("" if loaded else " (or give -j JOB with outputs.dest to ship with it)"))
        p = steps.ship(conn, ws, info.id, loaded)
        return steps.ShipReport.of(conn.name, info.id, p,
                                   source=str(p.get("path") or o.get("path") or (spec or {}).get("path") or "?"),
                                   dest=str(p.get("dest") or o.get("dest") or (spec or {}).get("dest") or "?"),
                                   before=o.get("shipped"))

    with sess:
        outcomes = sess.each(one)
    if ship:
        code = emit(outcomes, as_json, lambda r: r.model_dump(), render_ship)
        failed = any(o.error is None and o.value is not None and not o.value.ok for o in outcomes)
        return max(code, EXIT_VERIFY if failed else 0)
    return emit(outcomes, as_json, lambda r: r.model_dump(), render_outputs)


COMMANDS = [outputs_cmd]
