"""The dfo command line: thin click commands over the library (load models -> call a step -> render).

Start-up is lazy: `dfo --help`, `dfo --version` and a mistyped command import only click. A command's
module (and with it pydantic, paramiko, rich, ...) is imported when that command runs or shows its own
help; the table below gives each command's module and the one line `dfo --help` shows for it
(tests/test_startup.py checks the table against the commands themselves).
"""

from __future__ import annotations

import atexit
import importlib
import os
import select
import sys
import threading
from pathlib import Path
from typing import NoReturn

import click

from . import __version__, cache_dir
from .errors import EXIT_UNEXPECTED, DfoError

# name -> (module under orchestrator.commands, attribute, short help); the order of `dfo --help`
COMMANDS: dict[str, tuple[str, str, str]] = {
    "verify-env": ("verify_env", "verify_env_cmd", "Probe nodes and check the job's environment; change nothing."),
    "provision": ("provision", "provision_cmd",
                  "Build the job's Python environment on each node, verifying every install."),
    "stage-model": ("data", "stage_model",
                    "Put the job's model.source at model.dest on each node (normally under /dev/shm)."),
    "sync-data": ("data", "sync_data", "Copy the job's data.source (s3://bucket/prefix/) to data.dest on each node."),
    "sync-code": ("code", "sync_code", "Push the job's code: folder to the node (launch and up do it first)."),
    "pull": ("code", "pull_cmd", "Copy a run's files from the node to this machine, verified (default ./runs/RUN/)."),
    "outputs": ("outputs", "outputs_cmd",
                "What a run shipped to outputs.dest: files, bytes, passes, last pass, lag, errors."),
    "launch": ("runs", "launch_cmd", "Start the job's run.command detached on the node and watch its first seconds."),
    "tail": ("runs", "tail_cmd",
             "Follow a run's log until the run ends (RUN: an id or its unique prefix; default: the newest run)."),
    "status": ("runs", "status_cmd",
               "The runs on each host, newest first: id, job, state, started, duration, exit code, last line."),
    "stop": ("runs", "stop_cmd",
             "Stop a run: SIGTERM to its whole process group, then SIGKILL after the grace period."),
    "submit": ("queue", "submit_cmd",
               "Queue one run of the job on the node that can start it soonest; prints the run id and where it went."),
    "queue": ("queue", "queue_cmd",
              "Each node's run queue: its GPUs, the runs running (with their GPUs) and the runs queued, in order."),
    "cancel": ("queue", "cancel_cmd",
               "Take a queued run out of its node's queue; a run that has started is stopped as dfo stop does."),
    "top": ("top", "top_cmd",
            "A live view of a run on every node: GPUs, host, training figures, step rate, ETA, cost."),
    "plot": ("plot", "plot_cmd",
             "Plot a run's curves: loss, throughput, GPU utilisation over time."),
    "report": ("report", "report_cmd",
               "What a run cost and how it used its GPUs: cost, GPU-hours, mean GPU utilisation, tokens/s."),
    "exec": ("exec", "exec_cmd", "Run a command on every host at once; output prefixed by host, exit status per host."),
    "up": ("up", "up_cmd", "The whole job: provision, stage-model, sync-data, launch, tail."),
    "watch": ("watch", "watch_cmd",
              "Watch a running run and recover it: a lost node replaced by a spare, a killed trainer relaunched."),
    "login": ("login", "login_cmd",
              "Log in once with your terminal (password, one-time code, passphrase) for dfo's later commands."),
    "logout": ("login", "logout_cmd", "End each host's shared connection (the one dfo login made, or a command's)."),
    "demo": ("demo", "demo_cmd", "Run dfo's main job end to end on a throwaway node on this machine."),
}


def load_command(name: str) -> click.Command:
    """The click command `name`, importing its module now."""
    module, attr, _ = COMMANDS[name]
    command: click.Command = getattr(importlib.import_module(f"orchestrator.commands.{module}"), attr)
    return command


class DfoGroup(click.Group):
    """A click group whose commands are imported only when one of them is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*COMMANDS, *(n for n in super().list_commands(ctx) if n not in COMMANDS)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            self.add_command(load_command(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(self, ctx: click.Context, args: list[str]
                        ) -> tuple[str | None, click.Command | None, list[str]]:
        name = click.utils.make_str(args[0])
        if name not in COMMANDS and name not in self.commands and not ctx.resilient_parsing:
            if name.startswith("-"):
                self.parse_args(ctx, args)  # an option: let click say what is wrong with it
            raise click.exceptions.NoSuchCommand(name, possibilities=self.list_commands(ctx), ctx=ctx)
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(n) for n in names)
        rows = []
        for n in names:
            if n in COMMANDS:  # from the table: no import
                text = COMMANDS[n][2]
                rows.append((n, text if len(text) <= limit else text[: max(limit - 3, 1)].rstrip() + "..."))
            elif (cmd := self.get_command(ctx, n)) is not None and not cmd.hidden:
                rows.append((n, cmd.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=DfoGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-i", "--inventory", metavar="INVENTORY", default=None,
              help="Inventory file. Defaults to $DFO_INVENTORY, then ./inventory.yaml.")
@click.option("-v", "--verbose", is_flag=True, default=False,
              help="Say more on stderr: which SSH transport is used (OpenSSH's ssh, or paramiko without one).")
@click.version_option(__version__, prog_name="dfo")
@click.pass_context
def cli(ctx: click.Context, inventory: str | None, verbose: bool) -> None:
    """dfo drives rented GPU nodes over plain SSH.

    It provisions the node's Python environment and verifies every install, stages the
    model in /dev/shm, pulls data from S3 straight onto the node, launches the trainer
    detached, and follows its log until the run ends. Nothing is needed on the node but
    sshd and python3.

    \b
    Exit codes: 0 done; 1 unexpected error (or stdout's reader gone, as with | head);
    2 bad usage or invalid inventory/job file;
    3 verification failed (a version, a pin, a checksum, a capacity check);
    4 host unreachable, authentication failed or host key changed;
    5 the run failed (died at launch, or ended non-zero while tailed).
    """
    ctx.ensure_object(dict)
    ctx.obj["inventory"] = inventory
    if verbose:
        os.environ["DFO_VERBOSE"] = "1"  # read where it matters (transport.resolve.ssh_transport), in this process only


def _help_cache(args: list[str]) -> Path | None:
    """Where ``dfo CMD --help``'s text is kept once rendered (issue 18: a command's --help otherwise imports
    its module, and with it pydantic and the steps): ~/.cache/dfo/help/, under a name made of dfo's version,
    the size and time of every file of orchestrator/ and its subpackages, the command and the terminal's
    width. None when ``args`` is not exactly ``CMD --help`` (or -h)."""
    if len(args) != 2 or args[0] not in COMMANDS or args[1] not in ("--help", "-h"):
        return None
    import hashlib
    import shutil

    here = Path(__file__).resolve().parent
    key = [__version__, args[0], str(shutil.get_terminal_size().columns)]
    for f in sorted([*here.glob("*.py"), *here.glob("*/*.py")]):  # a help text may quote any module's constant
        st = f.stat()
        key.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    name = hashlib.sha256("\0".join(key).encode()).hexdigest()[:24]
    return cache_dir() / "help" / f"{args[0]}-{name}.txt"


def _help(args: list[str], cache: Path) -> int:
    """Print CMD's help: from the cache, or rendered by click (then kept for the next time)."""
    try:
        sys.stdout.write(cache.read_text())
        return 0
    except (OSError, UnicodeDecodeError):
        pass
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rv = cli.main(args=args, prog_name="dfo", standalone_mode=False)
    text = buf.getvalue()
    sys.stdout.write(text)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, cache)
    except OSError:
        pass
    return rv if isinstance(rv, int) else 0


def main(argv: list[str] | None = None) -> None:
    """The dfo command. With ``argv`` (tests and other in-process callers) it ends in SystemExit as
    usual; as the console script (no ``argv``) it leaves through ``_leave``."""
    if argv is not None:
        _main(argv)
        return
    try:
        _main(None)
    except SystemExit as exc:
        _leave(exc.code)


def _leave(code: str | int | None) -> NoReturn:
    """Exit as ``sys.exit(code)`` would, without the interpreter's teardown: freeing every module's
    objects one by one took 50-70 ms after each command here (dfo status in the persist window: about
    a sixth of it). atexit's handlers run and stdout and stderr are flushed first (a flush that fails,
    the reader of a pipe gone: quiet, exit 1, as click does). A thread other than daemons still running
    (Python would wait for it) leaves through sys.exit instead."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        sys.stderr.write(f"{code}\n")
        status = 1
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        status = status or 1
    os._exit(status)


def _main(argv: list[str] | None) -> None:
    try:
        args = list(sys.argv[1:] if argv is None else argv)
        cache = _help_cache(args)
        if cache is None:
            from .transport import openssh_early
            from .transport.base import raise_nofile

            raise_nofile()  # the soft open-file limit up to what a fleet needs (at most the hard limit)
            openssh_early.start(args)  # the handshake of each host named with -H begins now, beside the imports
        rv = _help(args, cache) if cache is not None else cli.main(args=argv, prog_name="dfo", standalone_mode=False)
    except click.exceptions.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)
    except DfoError as exc:
        from .cli_common import print_json, report_error  # rich: only once there is something to show

        report_error(exc)
        if "--json" in (argv if argv is not None else sys.argv[1:]):
            print_json({"ok": False, "error": exc.to_json()})  # --json: stdout always holds a document
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except BrokenPipeError as exc:
        if not _stdout_gone():
            _unexpected(exc)
        # `dfo status --help | head -1`: the reader left; quiet, exit 1, as click does for its own output
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no failing flush at exit
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001 - never a bare traceback for the user
        _unexpected(exc)
    finally:
        early = sys.modules.get("orchestrator.transport.openssh_early")
        if early is not None:
            early.finish()  # an early ssh the command never used is stopped
    sys.exit(rv if isinstance(rv, int) else 0)


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader went away (its write end reports an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _unexpected(exc: Exception) -> NoReturn:
    """An error nobody foresaw: one line and exit 1, never a bare traceback (DFO_DEBUG=1: the traceback)."""
    if os.environ.get("DFO_DEBUG"):
        raise exc
    from .terminal import clean

    sys.stderr.write(f"error: unexpected {type(exc).__name__}: {clean(exc)}\n  set DFO_DEBUG=1 for a traceback\n")
    sys.exit(EXIT_UNEXPECTED)


if __name__ == "__main__":
    main()
