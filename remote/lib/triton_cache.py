"""Where Triton keeps compiled kernels on this node, and how big it is (python3 3.8+, stdlib only)."""
from __future__ import annotations

import os


def cache_dir(configured: str | None = None) -> str:
    """``configured`` (e.g. the job's run.env), else TRITON_CACHE_DIR, else $TRITON_HOME/.triton/cache
    (TRITON_HOME defaults to the home directory), as Triton itself resolves it."""
    path = configured or os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache")
    return os.path.abspath(os.path.expanduser(path))


def dir_size(path: str) -> tuple:
    """(bytes, files) under ``path``; files that vanish while walking are skipped."""
    total, files = 0, 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
                files += 1
            except OSError:
                pass
    return total, files
