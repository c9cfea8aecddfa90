"""Pieces shared by the click commands: options, the host session, JSON/human output, exit codes."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from .errors import EXIT_UNEXPECTED, DfoError
from .hosts import HostSession, Outcome, error_json, exit_code_of  # noqa: F401 - re-exported
from .terminal import clean  # noqa: F401 - re-exported: the commands' one sanitiser

# --------------------------------------------------------------------------- text from the node

def safe(text: object) -> str:
    """``clean`` plus rich markup escaping: for node text inside a string that rich renders as markup
    (a job named ``[/x]`` is printed as is, never taken for a closing tag)."""
    from rich.markup import escape  # rich: once there is something to print

    return escape(clean(text))


# --------------------------------------------------------------------------- consoles

class LazyConsole:
    """Stands for an orchestrator.console.DfoConsole made on first use, so that rich is imported
    when there is something to print, not at start-up (nor before a command's first byte to a node).
    Attributes, assignments and `with console:` go to the real console; `real()` returns it."""

    def __init__(self, **kw: Any) -> None:
        object.__setattr__(self, "_kw", kw)
        object.__setattr__(self, "_real", None)

    def real(self) -> Any:
        c = object.__getattribute__(self, "_real")
        if c is None:
            from .console import DfoConsole

            c = DfoConsole(**object.__getattribute__(self, "_kw"))
            object.__setattr__(self, "_real", c)
        return c

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.real(), name, value)

    def __enter__(self) -> Any:
        return self.real().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.real().__exit__(*exc)


console: Any = LazyConsole(highlight=False)
err_console: Any = LazyConsole(stderr=True, highlight=False)


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


def finite_json(obj: Any) -> Any:
    """``obj`` with every float that is not finite (NaN, Infinity: a diverged trainer's loss, a node's
    figure) made None (a key: its text): what JSON can hold. Containers are copied, never changed."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k) if isinstance(k, float) and not math.isfinite(k) else k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite_json(v) for v in obj]
    return obj


def json_text(doc: Any) -> str:
    """The one way dfo writes a JSON document: non-finite floats as null (finite_json), and
    allow_nan=False, so what comes out is JSON that every parser takes (no NaN, no Infinity)."""
    return json.dumps(finite_json(doc), indent=2, default=str, allow_nan=False)


def print_json(doc: Any) -> None:
    """A --json document on stdout (every command's, and the error document of cli.py): json_text."""
    sys.stdout.write(json_text(doc) + "\n")
    sys.stdout.flush()


def report_error(err: DfoError) -> None:
    """The error on stderr: what happened (host: message) and, on its own line, what to do. Its text
    may quote the node, so it is cleaned (control characters shown, never obeyed)."""
    text = "\n".join(safe(ln) for ln in err.render().split("\n"))
    err_console.print(f"[bold red]error[/]: {text}", markup=True, soft_wrap=True)
    if os.environ.get("DFO_DEBUG") and err.__cause__ is not None:
        import traceback

        traceback.print_exception(err.__cause__)


def _unshown(host: str, exc: Exception) -> DfoError:
    err = DfoError(f"could not show this host's result: {type(exc).__name__}: {exc}", host=host,
                   hint="set DFO_DEBUG=1 for a traceback; please report it (the other hosts are shown)")
    err.__cause__ = exc
    return err


def print_outcome(o: Outcome[Any], render: Callable[[str, Any], None]) -> None:
    """One host's human result: its error (stderr), or ``render(host, value)`` (show_outcome)."""
    show_outcome(o, render)


def show_outcome(o: Outcome[Any], render: Callable[[str, Any], None]) -> int:
    """One host's human result: its error (stderr), or ``render(host, value)``. A host whose result
    cannot be shown gets that said as its error (exit 1), and the other hosts are still shown: one
    host's data never hides another's. Returns the exit code the showing itself adds (0 or 1)."""
    if o.error is not None:
        report_error(o.error)
        return 0
    try:
        render(o.host, o.value)
    except Exception as exc:  # noqa: BLE001 -- this host's view only: never the others'
        report_error(_unshown(o.host, exc))
        return EXIT_UNEXPECTED
    return 0


def host_json(o: Outcome[Any], to_json: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    """One host's --json document: its error, or ``to_json(value)`` (which, failing, is that host's error)."""
    if o.error is not None:
        return error_json(o.error)
    try:
        return to_json(o.value)
    except Exception as exc:  # noqa: BLE001 -- this host's document only
        return error_json(_unshown(o.host, exc))


def hosts_json(outcomes: list[Outcome[Any]], to_json: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    return {"hosts": {o.host: host_json(o, to_json) for o in outcomes}}


def emit(
    outcomes: list[Outcome[Any]],
    as_json: bool,
    to_json: Callable[[Any], dict[str, Any]],
    render: Callable[[str, Any], None],
) -> int:
    """Print per-host results (JSON contract or human) and return the exit code."""
    shown = 0
    if as_json:
        print_json(hosts_json(outcomes, to_json))
    else:
        for o in outcomes:
            shown = max(shown, show_outcome(o, render))
    return max(shown, exit_code_of(outcomes))


def fleet_summary(command: str, outcomes: list[Outcome[Any]]) -> None:
    """The end of a command over several hosts, on stderr, after each host's own result: how many hosts, and
    each exit code with its hosts (a host that did not answer named beside what kept it out)."""
    if len(outcomes) < 2:
        return
    by: dict[int, list[str]] = {}
    for o in outcomes:
        by.setdefault(o.exit_code, []).append(o.host)
    parts = []
    for code, names in sorted(by.items()):
        what = "ok" if code == 0 else f"exit {code}"
        shown = ", ".join(clean(h) for h in names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        parts.append(f"{what}: {len(names)} ({shown})" if code else f"{what}: {len(names)}")
    sys.stderr.write(f"dfo: {command}: {len(outcomes)} hosts; " + "; ".join(parts) + "\n")
    sys.stderr.flush()


def each_and_emit(
    s: HostSession,
    fn: Callable[[Any], Any],
    as_json: bool,
    to_json: Callable[[Any], dict[str, Any]],
    render: Callable[[str, Any], None],
    command: str = "",
) -> int:
    """Run ``fn(conn)`` on every host of ``s`` in parallel. Human output: each host's result printed
    as soon as that host is done (a slow or dead host holds nobody back); --json: one document at
    the end, hosts in -H order; ``command``: its name, for the summary line after several hosts. Returns the
    highest exit code."""
    shown = [0]
    outcomes = s.each(fn, on_done=None if as_json else (lambda o: shown.append(show_outcome(o, render))))
    if as_json:
        print_json(hosts_json(outcomes, to_json))
    elif command:
        fleet_summary(command, outcomes)
    return max(max(shown), exit_code_of(outcomes))
