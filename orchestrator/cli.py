"""The dfo command line: thin click commands over the library (load models -> call a step -> render)."""

from __future__ import annotations

import importlib
import os
import sys

import click

from . import __version__
from .cli_common import clean, print_json, report_error
from .errors import EXIT_UNEXPECTED, DfoError

# module -> the click commands it exports as COMMANDS; order is the order of `dfo --help`
COMMAND_MODULES = ["verify_env", "provision", "data", "runs", "up", "demo"]


class DfoGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        order = ["verify-env", "provision", "stage-model", "sync-data", "launch", "tail", "status", "stop",
                 "up", "demo"]
        names = super().list_commands(ctx)
        return [n for n in order if n in names] + [n for n in names if n not in order]


@click.group(cls=DfoGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("-i", "--inventory", metavar="INVENTORY", default=None,
              help="Inventory file. Defaults to $DFO_INVENTORY, then ./inventory.yaml.")
@click.version_option(__version__, prog_name="dfo")
@click.pass_context
def cli(ctx: click.Context, inventory: str | None) -> None:
    """dfo drives rented GPU nodes over plain SSH.

    It provisions the node's Python environment and verifies every install, stages the
    model in /dev/shm, pulls data from S3 straight onto the node, launches the trainer
    detached, and follows its log until the run ends. Nothing is needed on the node but
    sshd and python3.

    \b
    Exit codes: 0 done; 1 unexpected error; 2 bad usage or invalid inventory/job file;
    3 verification failed (a version, a pin, a checksum, a capacity check);
    4 host unreachable, authentication failed or host key changed;
    5 the run failed (died at launch, or ended non-zero while tailed).
    """
    ctx.ensure_object(dict)
    ctx.obj["inventory"] = inventory


for _mod in COMMAND_MODULES:
    try:
        _m = importlib.import_module(f"orchestrator.commands.{_mod}")
    except ModuleNotFoundError as _exc:  # a command family not built yet
        if _exc.name != f"orchestrator.commands.{_mod}":
            raise
        continue
    for _cmd in getattr(_m, "COMMANDS", []):
        cli.add_command(_cmd)


def main(argv: list[str] | None = None) -> None:
    try:
        rv = cli.main(args=argv, prog_name="dfo", standalone_mode=False)
    except click.exceptions.Abort:
        sys.stderr.write("aborted\n")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)
    except DfoError as exc:
        report_error(exc)
        if "--json" in (argv if argv is not None else sys.argv[1:]):
            print_json({"ok": False, "error": exc.to_json()})  # --json: stdout always holds a document
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - never a bare traceback for the user
        if os.environ.get("DFO_DEBUG"):
            raise
        sys.stderr.write(f"error: unexpected {type(exc).__name__}: {clean(exc)}\n  set DFO_DEBUG=1 for a traceback\n")
        sys.exit(EXIT_UNEXPECTED)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
