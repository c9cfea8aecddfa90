"""Benches time dfo as an installed dfo runs: from bytecode. `pip install` writes the bytecode of what it
installs; a checkout gets it on its first run, unless PYTHONDONTWRITEBYTECODE is set (as on the machines
these benches ran on), where every dfo process compiled dfo's modules from source again (about 60-80 ms of
CPU a run, measured with cProfile on `dfo status`). ``compile_trees(*roots)`` writes the bytecode of
orchestrator/ and remote/ under each dfo checkout given, before any timing."""

from __future__ import annotations

import compileall
from pathlib import Path


def compile_trees(*roots: Path | str) -> None:
    for root in roots:
        for sub in ("orchestrator", "remote"):
            if (Path(root) / sub).is_dir():
                compileall.compile_dir(str(Path(root) / sub), quiet=1)
