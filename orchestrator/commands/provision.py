"""dfo provision: thin click command over orchestrator.steps.provision."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from ..cli_common import (
    console,
    hosts_option,
    job_option,
    json_option,
    print_json,
    report_error,
    safe,
    session,
)
from ..config.models import LoadedJob, load_job
from ..errors import EXIT_OK, DfoError
from ..steps.provision import ProvisionReport, provision, provision_json

if TYPE_CHECKING:
    from ..hosts import HostSession, Outcome

STATUS_STYLE = {"done": "green", "no change": "dim", "warning": "yellow", "failed": "bold red"}
_OUT = threading.Lock()


def _step_line(host: str, multi: bool, step: dict[str, Any]) -> None:
    status = str(step.get("status", "?"))
    message = "see below" if status == "failed" else str(step.get("message", ""))
    secs = step.get("seconds") or 0
    took = f" ({secs:.1f}s)" if secs >= 1 else ""
    prefix = f"{safe(host)}: " if multi else ""
    style = STATUS_STYLE.get(status, "")
    with _OUT:
        console.print(f"{prefix}{safe(str(step.get('name')))}: [{style}]{safe(status)}[/]{took}  {safe(message)}",
                      soft_wrap=True)


def _summary(r: ProvisionReport) -> None:
    counts: dict[str, int] = {}
    for s in r.steps:
        counts[s.get("status", "?")] = counts.get(s.get("status", "?"), 0) + 1
    parts = ", ".join(f"{n} {k}" for k, n in counts.items())
    for w in r.warnings:
        console.print(f"[yellow]warning[/]: {safe(r.host)}: {safe(str(w.get('message')))}", soft_wrap=True)
    if r.ok:
        where = f"; record: {r.record}" if r.record else ""
        console.print(f"{safe(r.host)}: [green]provisioned[/] ({parts}){safe(where)}", soft_wrap=True)


@click.command("provision")
@hosts_option
@job_option()
@json_option
@click.option("--clear-triton-cache", is_flag=True,
              help="Also empty the node's Triton kernel cache (TRITON_CACHE_DIR from the job's run.env or the "
                   "node's environment, else ~/.triton/cache) and say how many bytes went.")
@click.pass_context
def provision_cmd(ctx: click.Context, hosts: tuple[str, ...], job_path: str, as_json: bool,
                  clear_triton_cache: bool) -> int:
    """Build the job's Python environment on each node, verifying every install.

    \b
    Steps, each reported as done / no change / warning / failed:
      workspace    the workspace, its .dfo/provision dir and the job's run.workdir
      venv         the job's venv (uv venv when installer: uv and the node has uv,
                   else `python -m venv` with the job's python)
      installer    uv (the node's, else installed into the venv with pip) or pip
      <package>    one step per line of packages:, in order
      overrides    every overridden package that is installed matches its override
      triton cache only with --clear-triton-cache

    Before each package step the venv's own interpreter, in a fresh process, checks whether
    the line (and every earlier one) is already satisfied and every installed distribution's
    requirements hold: then the step is "no change" and no installer runs. Otherwise the line
    is installed together with the earlier lines (so the resolver sees their pins) using the
    job's index options, and checked again in a fresh process: the asked version must really
    be installed (metadata and the module's __version__; an installer that exits 0 and changes
    nothing is caught) and no pin may break, e.g. "torch 2.11.0 requires triton==3.6.0;
    triton is 3.7.0". A break listed in the job's overrides: with a reason is a warning
    quoting the reason; uv gets overrides as --override, pip installs the override's version
    after resolving the rest. On failure the report gives the version before and after, what
    was asked, the installer's own output, and what changed in the venv.

    A record of the run goes to <workspace>/.dfo/provision/<job>.json on the node
    (verify-env shows it).

    \b
    Exit codes: 0 done; 2 bad job file or package spec; 3 an install or its verification
    failed (also: the job's python or the node's python3 is missing); 4 host unreachable.
    """
    loaded = load_job(job_path)  # package specs, overrides and index checked there (exit 2, FILE:LINE)
    with session(ctx, hosts) as s:
        # each host's summary printed as soon as that host is done (a slow host holds nobody back)
        outcomes = run_provision(s, loaded, quiet=as_json, clear_triton_cache=clear_triton_cache,
                                 on_done=None if as_json else render_one)
    if as_json:
        print_json({"hosts": {o.host: provision_json(o) for o in outcomes}})
    return max((o.exit_code for o in outcomes), default=EXIT_OK)


def run_provision(s: HostSession, loaded: LoadedJob, *, quiet: bool, clear_triton_cache: bool = False,
                  on_done: Callable[[Outcome[ProvisionReport]], None] | None = None
                  ) -> list[Outcome[ProvisionReport]]:
    """Provision every host of the session on its one connection; each step's line printed as it ends
    unless ``quiet``; ``on_done(outcome)`` as each host finishes (HostSession.each)."""
    multi = len(s.names) > 1

    def one(conn: Any) -> ProvisionReport:
        def on_step(step: dict[str, Any]) -> None:
            if not quiet:
                _step_line(conn.name, multi, step)

        return provision(conn, loaded, clear_triton_cache=clear_triton_cache, on_step=on_step)

    return s.each(one, on_done=on_done)


def render_one(o: Outcome[ProvisionReport]) -> None:
    """One host's summary (or its error)."""
    if o.error is not None:
        report_error(o.error)
        return
    r = o.value
    assert r is not None
    with _OUT:
        _summary(r)
    if not r.ok and r.error:
        report_error(DfoError(r.error["message"], host=r.host, hint=r.error.get("hint")))


def render_provision(outcomes: list[Outcome[ProvisionReport]]) -> None:
    for o in outcomes:
        render_one(o)


COMMANDS = [provision_cmd]
