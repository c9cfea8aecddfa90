"""dfo: drive rented GPU nodes over plain SSH (the controller side)."""

import os
from pathlib import Path

__version__ = "0.1.0"


_CACHE_DIRS: dict[tuple[str | None, str | None], Path] = {}


def cache_dir() -> Path:
    """dfo's cache folder on this machine: $XDG_CACHE_HOME/dfo, else ~/.cache/dfo (worked out once per value of
    those variables: a fleet command asks for it several times a host)."""
    key = (os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"))
    got = _CACHE_DIRS.get(key)
    if got is None:
        got = _CACHE_DIRS[key] = Path(key[0] or Path.home() / ".cache") / "dfo"
    return got
