"""dfo exec: an ad-hoc command on every host at once, output prefixed by host."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import click

from ..cli_common import clean, exit_code_of, hosts_option, json_option, print_json, report_error, session
from ..hosts import Outcome
from ..steps.exec import CONTROLLER_MARGIN_S, ExecResult, exec_on

_OUT = threading.Lock()


def _text(line: str) -> str:
    """A node's line made inert for this terminal (control characters shown), tabs kept."""
    return "\t".join(clean(part) for part in line.split("\t"))


def _writer(stream: Any, host: str) -> Any:
    prefix = f"[{clean(host)}] "

    def write(lines: list[str]) -> None:
        text = "".join(f"{prefix}{_text(ln)}\n" for ln in lines)
        with _OUT:
            stream.write(text)
            stream.flush()

    return write


def _ended(o: Outcome[ExecResult], seconds: float) -> None:
    """One host's end, on stderr, as soon as that host is done."""
    if o.error is not None:
        with _OUT:
            report_error(o.error)
        return
    r = o.value
    assert r is not None
    if r.timed_out and r.unconfirmed:
        line = (f"dfo: {clean(o.host)}: timed out after {r.given:g}s (--timeout); the node did not confirm the kill "
                f"within {CONTROLLER_MARGIN_S:g}s more, so dfo ended the call (exit {r.exit})")
    elif r.timed_out:
        given = f"{r.given:g}s (--timeout)" if r.given else f"{r.seconds:.1f}s"
        line = f"dfo: {clean(o.host)}: timed out after {given}: its process group was killed (exit {r.exit})"
    elif r.signal:
        line = f"dfo: {clean(o.host)}: killed by signal {r.signal} (exit {r.exit}) after {r.seconds:.1f}s"
    else:
        line = f"dfo: {clean(o.host)}: exit {r.exit} ({r.seconds:.1f}s)"
    with _OUT:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _summary(outcomes: list[Outcome[ExecResult]]) -> None:
    by: dict[int, list[str]] = {}
    for o in outcomes:
        by.setdefault(o.exit_code, []).append(o.host)
    parts = "; ".join(f"exit {code} on {', '.join(clean(h) for h in hosts)}" for code, hosts in sorted(by.items()))
    sys.stderr.write(f"dfo: {len(outcomes)} hosts: {parts}\n")


@click.command("exec", context_settings={"allow_interspersed_args": False})
@hosts_option
@json_option
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="S",
              help="A host whose command still runs after S seconds gets its command's whole process "
                   "group killed (SIGTERM, SIGKILL 2 s later); its status is 124, as with timeout(1). "
                   "Default: none (a dead link still ends the call). A host whose side does not start "
                   "within its start_timeout (inventory, 30 s) is unreachable (4), whatever S is.")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED, metavar="-- CMD [ARGS]...")
@click.pass_context
def exec_cmd(ctx: click.Context, hosts: tuple[str, ...], as_json: bool, timeout: float | None,
             argv: tuple[str, ...]) -> int:
    """Run a command on every host at once; output prefixed by host, exit status per host.

    Each host runs CMD ARGS... as given: the words are quoted (shlex.join) and the node's
    login shell runs them from $HOME, as ssh does, so no word is split or expanded again.
    For pipes, globs or variables, give the shell yourself:
    dfo exec -H all -- bash -c 'nvidia-smi | head -5'. The command reads nothing
    (stdin is /dev/null) and runs in its own session on the node: --timeout, Ctrl-C or a
    lost link end its whole process group. Without --timeout the node needs only sh and
    setsid (no Python starts there); with --timeout, dfo's node module (python3) keeps the
    clock.

    Each line of output is printed as it arrives, prefixed "[host] " (stdout to stdout,
    stderr to stderr); each host's exit status goes to stderr as soon as that host is done,
    so a slow or dead host holds nobody back. --json prints one document at the end:
    {"exit": N, "hosts": {NAME: {"host", "exit", "seconds", "timed_out", "signal",
    "stdout", "stderr"}}} (an unreachable host has "error" instead of the output).

    \b
    Exit code: the highest of the hosts' statuses (the command's own exit status; 124 for
    a --timeout; 128+N for a command killed by signal N; 4 for a host that could not be
    reached, or whose side did not start within its start_timeout, or that this machine had
    no open files, processes or memory left for; 3 for a node without python3 where one is
    needed: --timeout, or no setsid); 2 for bad usage.
    """
    starts: dict[str, float] = {}
    t0 = time.monotonic()

    def one(conn: Any) -> ExecResult:
        starts[conn.name] = time.monotonic()
        if as_json:
            return exec_on(conn, argv, timeout=timeout, keep=True)
        return exec_on(conn, argv, timeout=timeout, on_out=_writer(sys.stdout, conn.name),
                       on_err=_writer(sys.stderr, conn.name))

    def seconds(o: Outcome[ExecResult]) -> float:
        return o.value.seconds if o.value is not None else time.monotonic() - starts.get(o.host, t0)

    took: dict[str, float] = {}

    def done(o: Outcome[ExecResult]) -> None:
        took[o.host] = seconds(o)
        if not as_json:
            _ended(o, took[o.host])

    with session(ctx, hosts) as s:
        outcomes = s.each(one, on_done=done, parallel=None)  # every host at once, however many
    code = exit_code_of(outcomes)
    if as_json:
        doc: dict[str, Any] = {}
        for o in outcomes:
            if o.error is not None:
                doc[o.host] = {"host": o.host, "exit": o.exit_code, "seconds": round(took[o.host], 3),
                               "timed_out": False, "signal": None, "error": o.error.to_json()}
            else:
                assert o.value is not None
                doc[o.host] = o.value.to_json()
        print_json({"exit": code, "hosts": doc})
    elif len(outcomes) > 1:
        _summary(outcomes)
    return code


COMMANDS = [exec_cmd]
