"""dfo: drive rented GPU nodes over plain SSH (the controller side)."""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_dir() -> Path:
    """dfo's cache folder on this machine: $XDG_CACHE_HOME/dfo, else ~/.cache/dfo."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dfo"
