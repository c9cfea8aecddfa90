"""dfo top: a live view of a run on every node (GPU util/memory/power per GPU, the host, the last training
figures, step rate, ETA, cost), from the sampler's metrics.jsonl (remote/runs/metrics.py)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import click

from ..cli_common import console, exit_code_of, hosts_json, hosts_option, job_option, json_option, print_json, safe
from ..config.models import load_job
from ..errors import UsageError
from ..steps import metrics as sm
from ..steps.health import brief, brief_text
from ..transport.base import Transport
from .runs_follow import run_workspace
from .runs_view import state_markup

WINDOW_S = 900  # rows of the last 15 minutes: enough for the step rate and the recent XIDs


def _hms(s: float | None) -> str:
    if s is None or not math.isfinite(s):
        return "-"
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _error_row(host: str, message: str) -> tuple[str, ...]:
    return safe(host), "-", "[red]error[/]", "", safe(message), "", "", "", "", ""


def row(host: str, d: dict[str, Any]) -> tuple[str, ...]:
    """One host's row of the table (markup), from its view (steps/metrics.py ``view``) or its error."""
    if "error" in d:
        return _error_row(host, (d["error"] or {}).get("message", ""))
    gpus = "\n".join(safe(sm.gpu_text(g)) for g in d["gpus"]) or "no GPU figures"
    if d.get("xid"):
        gpus += f"\n[red]XID x{d['xid']}[/]"
    if d.get("health"):  # the GPU health gate's last verdict here (steps/health.py)
        gpus += f"\n[{'green' if d['health']['ok'] else 'red'}]{safe(brief_text(d['health']))}[/]"
    rate = f"{d['steps_per_s']:.2f} st/s" if d.get("steps_per_s") else "-"
    cost = f"${d['cost']:.2f}" if d.get("cost") is not None else "-"
    return (safe(host), safe(d["run"]), state_markup(d["state"]), _hms(d.get("seconds")), gpus,
            safe(sm.host_text(d["host"])) if d["host"] else "-", safe(sm.train_text(d.get("train"))), rate,
            _hms(d.get("eta_s")), cost)


def render(docs: dict[str, dict[str, Any]]) -> Any:
    """The rich table of every host's view (errors as one row each). Each host's row is made on its
    own: one that cannot be shown is that host's error row, and every other host is still shown."""
    from rich.table import Table

    t = Table(box=None, pad_edge=False, header_style="bold", title=f"dfo top  {time.strftime('%H:%M:%S')}",
              title_justify="left")
    for col in ("host", "run", "state", "time", "GPUs (i util mem power temp clock)", "host", "training",
                "rate", "ETA", "cost"):
        t.add_column(col, overflow="fold")
    for host, d in docs.items():
        try:
            cells = row(host, d)
        except Exception as exc:  # noqa: BLE001 -- this host's row only, never the others'
            cells = _error_row(host, f"could not show this host's view: {type(exc).__name__}: {exc}")
        t.add_row(*cells)
    return t


@click.command("top")
@hosts_option
@click.argument("run", required=False)
@job_option(required=False)
@click.option("--once", is_flag=True, help="Print the view once and exit (with --json: one JSON document).")
@click.option("--every", type=click.FloatRange(min=1), default=5, show_default=True, metavar="SECONDS",
              help="Seconds between refreshes of the live view.")
@json_option
@click.pass_context
def top_cmd(ctx: click.Context, hosts: tuple[str, ...], run: str | None, job_path: str | None, once: bool,
            every: float, as_json: bool) -> int:
    """A live view of a run on every node: GPUs, host, training figures, step rate, ETA, cost.

    Per GPU: utilisation, memory used/total, power, temperature, SM clock (and new XID errors); per
    node: CPU, load, RAM, /dev/shm, workspace disk and the trainer's RSS; the run's last training
    figures (run.log_metrics), its step rate, the ETA when the trainer logs a total (step 10/500),
    and the cost so far (hosts.NAME.price_per_hour). Read from the run's metrics.jsonl, which the
    node's supervisor writes every run.metrics_every seconds (docs/metrics.md). RUN: an id or its
    unique prefix (default: the newest run on each host). Refreshed in place until Ctrl-C; --once
    prints it once, --json (implies --once) one document for scripts.

    \b
    Exit codes: 0 shown; 2 bad usage or no such run; 4 host unreachable.
    """
    if run is not None and not run.strip():
        raise UsageError("dfo top: RUN is empty (an unset variable?): give a run id or leave it out")
    loaded = load_job(job_path) if job_path else None
    from ..hosts import HostSession

    sess = HostSession(ctx.obj.get("inventory"), hosts)

    def one(conn: Transport) -> dict[str, Any]:
        info, rows = sm.fetch(conn, run_workspace(conn, loaded), run=run, job=loaded.job.name if loaded else None,
                              since=time.time() - WINDOW_S, max_rows=5000)
        return {**sm.view(info, rows, sm.price_of(sess.inventory, conn.host.name)), "health": brief(conn.host)}

    def poll() -> tuple[dict[str, dict[str, Any]], int]:
        outcomes = sess.each(one)
        return hosts_json(outcomes, lambda d: d)["hosts"], exit_code_of(outcomes)

    with sess:
        if once or as_json:
            docs, code = poll()
            if as_json:
                print_json({"hosts": docs})
            else:
                console.print(render(docs))
            return code
        from rich.live import Live

        # each host's row changes as that host answers: a slow or hung host holds back no other row (it keeps
        # its last view, or "waiting" until its first answer)
        docs = {h: {"error": {"message": "waiting for its first answer"}} for h in sess.names}
        codes = {h: 0 for h in sess.names}
        lock, stop = threading.Lock(), threading.Event()

        def refresh(host: str) -> None:  # each host on its own clock, in its own thread
            while not stop.is_set():
                o = sess.each(one, names=[host])[0]
                with lock:
                    docs[host], codes[host] = hosts_json([o], lambda d: d)["hosts"][host], o.exit_code
                stop.wait(every)

        for h in sess.names:
            threading.Thread(target=refresh, args=(h,), daemon=True, name=f"dfo-top-{h}").start()
        try:
            with Live(render(docs), console=console, refresh_per_second=1, screen=False) as live:
                while True:
                    time.sleep(1.0)
                    with lock:
                        view = render(dict(docs))
                    live.update(view)
        except KeyboardInterrupt:
            stop.set()
            return max(codes.values(), default=0)


COMMANDS = [top_cmd]
