"""The one way tests run the real CLI: `python -m orchestrator.cli` in a fresh interpreter, as a user runs it.

    from tests._cli import dfo, dfo_popen, dfo_argv, cli_env

    r = dfo(inv, "status", "-H", "node-1", "--json")          # subprocess.CompletedProcess[str]
    p = dfo_popen(inv, "tail", "-H", "node-1", stderr=subprocess.STDOUT)
    r = dfo(None, "demo", "--steps", "1", cwd=tmp_path)       # no -i: $DFO_INVENTORY, then ./inventory.yaml

``inv`` is the inventory (``-i``), or None for none. ``env`` is the whole environment of the command; by
default cli_env(): this process's environment with COLUMNS=200 (rich wraps at 80 columns on a pipe).
stdin is /dev/null unless ``input`` is given. The interpreter is the one running the tests (sys.executable),
so the command sees the same dfo, whatever PATH says.

In-process runs (click's CliRunner) stay where a test wants them (``--help`` text, exit codes without a
process); everything that should behave as the shell's `dfo` goes through here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from typing import IO, Any

PathLike = str | os.PathLike[str]


def dfo_argv(inv: PathLike | None, *args: str) -> list[str]:
    """argv of the real CLI with inventory ``inv`` (None: no -i)."""
    pre = ["-i", str(inv)] if inv is not None else []
    return [sys.executable, "-m", "orchestrator.cli", *pre, *args]


def cli_env(base: Mapping[str, str] | None = None, **over: str | None) -> dict[str, str]:
    """``base`` (default: this process's environment) with COLUMNS=200 and ``over`` applied
    (a None value removes the variable: ``cli_env(COLUMNS=None)`` is a pipe as a user's shell has it)."""
    env = dict(os.environ if base is None else base)
    env["COLUMNS"] = "200"
    for k, v in over.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def dfo(inv: PathLike | None, *args: str, env: Mapping[str, str] | None = None, cwd: PathLike | None = None,
        timeout: float = 120, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the real CLI to its end; stdout and stderr captured as text."""
    return subprocess.run(dfo_argv(inv, *args), capture_output=True, text=True, timeout=timeout,
                          env=dict(env) if env is not None else cli_env(), cwd=cwd, input=input,
                          stdin=None if input is not None else subprocess.DEVNULL)


def dfo_popen(inv: PathLike | None, *args: str, env: Mapping[str, str] | None = None, cwd: PathLike | None = None,
              stdout: int | IO[Any] | None = subprocess.PIPE, stderr: int | IO[Any] | None = subprocess.PIPE,
              stdin: int | IO[Any] | None = subprocess.DEVNULL) -> subprocess.Popen[str]:
    """Start the real CLI; text pipes (stderr=subprocess.STDOUT merges them)."""
    return subprocess.Popen(dfo_argv(inv, *args), stdout=stdout, stderr=stderr, stdin=stdin, text=True,
                            env=dict(env) if env is not None else cli_env(), cwd=cwd)


__all__ = ["cli_env", "dfo", "dfo_argv", "dfo_popen"]
