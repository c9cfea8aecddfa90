"""Pieces shared by the click commands: options, the host session, JSON/human output, exit codes."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from .errors import DfoError
from .hosts import HostSession, Outcome

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def hosts_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "-H", "--host", "hosts", multiple=True, required=True, metavar="HOST",
        help="A host, a group, or 'all' from the inventory; may repeat (or comma-separate).",
    )(f)


def job_option(required: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "-j", "--job", "job_path", required=required, metavar="JOB",
        help="The job file (jobs/NAME.yaml, or just NAME when jobs/NAME.yaml exists).",
    )


def json_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True,
                        help="Print one JSON document on stdout and nothing else there.")(f)


def session(ctx: click.Context, hosts: tuple[str, ...]) -> HostSession:
    return HostSession(ctx.obj.get("inventory"), hosts)


def exit_code_of(outcomes: list[Outcome[Any]]) -> int:
    return max((o.exit_code for o in outcomes), default=0)


def error_json(err: DfoError) -> dict[str, Any]:
    return {"ok": False, "error": err.to_json()}


def print_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def report_error(err: DfoError) -> None:
    err_console.print(f"[bold red]error[/]: {escape(err.render())}", markup=True, soft_wrap=True)
    if os.environ.get("DFO_DEBUG") and err.__cause__ is not None:
        import traceback

        traceback.print_exception(err.__cause__)


def emit(
    outcomes: list[Outcome[Any]],
    as_json: bool,
    to_json: Callable[[Any], dict[str, Any]],
    render: Callable[[str, Any], None],
) -> int:
    """Print per-host results (JSON contract or human) and return the exit code."""
    if as_json:
        doc = {"hosts": {o.host: (error_json(o.error) if o.error else to_json(o.value)) for o in outcomes}}
        print_json(doc)
    else:
        for o in outcomes:
            if o.error is not None:
                report_error(o.error)
            else:
                render(o.host, o.value)
    return exit_code_of(outcomes)
