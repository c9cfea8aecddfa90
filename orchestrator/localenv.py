"""The environment of commands run with ``transport: local`` (an allow-list, not the controller's own).

Over SSH a node's commands get the node's login environment, never the laptop's. With
``transport: local`` the "node" is this machine, and a plain subprocess would hand the trainer
everything the controller's shell holds: AWS keys, HF_TOKEN, a PIP_INDEX_URL with a password. So
local commands get only the variables below; what a job's trainer needs beyond them it names in
``run.env`` or ``run.secret_env`` (they travel in the request, on stdin, as over SSH).

A variable is kept when its name is in ``ALLOW`` or starts with a prefix in ``ALLOW_PREFIXES``,
and it is not a secret by name or value (remote.lib.redact.is_secret: ``NVIDIA_API_KEY`` goes even
though ``NVIDIA_*`` is allowed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from remote.lib.redact import is_secret

ALLOW = frozenset({
    # the session
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "HOSTNAME",
    # loaders and thread counts
    "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    # cache locations (no credentials in them)
    "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_CACHE", "TRANSFORMERS_OFFLINE", "UV_CACHE_DIR", "PIP_CACHE_DIR",
})
ALLOW_PREFIXES = ("LC_", "XDG_", "CUDA_", "NVIDIA_", "NCCL_", "TORCH_", "PYTORCH_", "TRITON_")


def allowed(name: str, value: str) -> bool:
    return (name in ALLOW or name.startswith(ALLOW_PREFIXES)) and not is_secret(name, value)


def local_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allow-listed part of ``environ`` (default: this process's environment)."""
    src = os.environ if environ is None else environ
    return {k: v for k, v in src.items() if allowed(k, v)}
