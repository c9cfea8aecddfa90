"""The ``dfo`` console script (and ``python -m orchestrator``): the ssh of each host the command names
starts here (transport/openssh_early.py), before click and the command's modules are imported, then
the command line runs (cli.main)."""

from __future__ import annotations

import sys


def main() -> None:
    from .transport import openssh_early
    from .transport.base import raise_nofile

    raise_nofile()  # the soft open-file limit up to what a fleet needs (at most the hard limit): issue 35
    openssh_early.start(sys.argv[1:])
    from .cli import main as cli_main

    cli_main()
