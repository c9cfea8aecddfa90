"""Run remote/ modules on a node: upload once per content hash, then ``python3 -m remote.<name>``.

The package remote/ is packed into a tar.gz whose sha256 names its place on the node,
``$HOME/.cache/dfo/agent/<hash>/``. A call that finds it there costs one round trip; a
missing copy is uploaded through stdin (no sftp needed) and made visible by an atomic rename.
The module reads its request (JSON) from stdin and answers with one framed JSON document.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shlex
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import remote
from remote._proto import RESULT_PREFIX, split_frame

from . import nodepath
from .errors import (
    AgentMissing,
    ConfigError,
    DfoError,
    HostError,
    NoResult,
    PythonTooOld,
    RemoteCommandError,
    RunFailed,
    VerifyError,
)
from .transport.base import Result, Transport

REMOTE_ROOT = Path(remote.__file__).resolve().parent


@dataclass(frozen=True)
class NodeModules:
    """The node's entry modules: what the controller runs there as ``python3 -m MODULE``. Each reads
    one JSON request on stdin and prints one framed result (remote/_proto.py); the ones with several
    operations take ``{"op": ...}``. Modules that node modules start themselves (the run's supervisor,
    its shipper and gang watch, pkgcheck in a venv) are started by name in remote/ (tests/test_layout.py
    checks every one)."""

    probe: str = "remote.env.probe"              # verify-env: python, OS, GPUs, disk (read only)
    pkgcheck: str = "remote.env.pkgcheck"        # verify-env: the job's pins against the venv (its python)
    gpu_preflight: str = "remote.gpu.preflight"  # verify-env --gpu (the venv's python: torch, triton)
    provision: str = "remote.env.provision"      # provision: the venv, installs, each install verified
    sync: str = "remote.transfer.sync"           # sync-data, and launch's restore of outputs
    stage: str = "remote.transfer.stage"         # stage-model
    push: str = "remote.files.push"              # sync-code (ops state, push, sync)
    pull: str = "remote.files.pull"              # pull (ops list, send)
    runs: str = "remote.runs"                    # launch, status, tail, stop, outputs (ops: see remote/runs/ops.py)
    gang: str = "remote.gang"                    # a gang's preflight, address check, interface (ops)
    exec: str = "remote.exec"                    # exec: an ad-hoc command, streamed


NODE = NodeModules()
NEED_UPLOAD = 97
PY_MISSING = 127


def _bundle_files() -> list[Path]:
    return sorted(
        p for p in REMOTE_ROOT.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
        and (p.suffix in {".py", ".json", ".txt"} or p.name.startswith("LICENSE"))
    )


@lru_cache(maxsize=1)
def bundle_digest() -> str:
    """The bundle's hash alone (no tar.gz made: that costs ~50 ms, needed only to upload)."""
    h = hashlib.sha256()
    for p in _bundle_files():
        rel = p.relative_to(REMOTE_ROOT.parent).as_posix()
        h.update(rel.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@lru_cache(maxsize=1)
def bundle() -> tuple[str, bytes]:
    """(hash, tar.gz bytes) of remote/*.py, data files and vendored licences, deterministic."""
    files = _bundle_files()
    digest = bundle_digest()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for p in files:
            info = tarfile.TarInfo(p.relative_to(REMOTE_ROOT.parent).as_posix())
            data = p.read_bytes()
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return digest, buf.getvalue()


def agent_dir_expr(digest: str) -> str:
    return f'"$HOME/.cache/dfo/agent/{digest}"'


def upload_agent(conn: Transport) -> None:
    digest, data = bundle()
    d = agent_dir_expr(digest)
    cmd = (
        f'D={d}; T="$D.tmp.$$"; rm -rf "$T" && mkdir -p "$T" && tar -xzf - -C "$T" '
        f'&& touch "$T/.complete" && {{ mv -T "$T" "$D" 2>/dev/null || rm -rf "$T"; }}'
    )
    res = conn.run(cmd, stdin=data, timeout=120)
    if res.exit_code != 0:
        raise AgentMissing(f"could not upload dfo's remote code: {plain_tail(res.stderr, 300)}", host=conn.name,
                                 hint="is $HOME writable and tar installed on the node?")


def module_command(module: str, python: str, env: dict[str, str] | None = None, args: list[str] | None = None,
                   flags: str = "") -> str:
    """``flags``: python's own options, before -m (``-S``: a module that needs no site-packages)."""
    digest = bundle_digest()
    envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    argv = " ".join(shlex.quote(a) for a in (args or []))
    return (
        f'D={agent_dir_expr(digest)}; [ -f "$D/.complete" ] || exit {NEED_UPLOAD}; '
        f'command -v {nodepath.shell(python)} >/dev/null 2>&1 || exit {PY_MISSING}; '
        f'cd "$D" && PYTHONPATH="$D" PYTHONDONTWRITEBYTECODE=1 {envs} '
        f'exec {nodepath.shell(python)} {flags} -m {module} {argv}'
    )


_ERR_CLASSES: dict[str, type[DfoError]] = {
    "verify": VerifyError,
    "config": ConfigError,
    "usage": ConfigError,
    "unreachable": HostError,
    "run_failed": RunFailed,
    "python_too_old": PythonTooOld,  # remote/__init__.py, before any module is compiled
}


# ANSI sequences a login shell prints (colours, terminal titles), then any other control character
_ESCAPES = re.compile(r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]?")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain_tail(text: str, limit: int = 400) -> str:
    """The end of a node's output for an error message: escape sequences and control characters
    removed (they would act on this terminal), lines joined with " | "."""
    text = _CONTROL.sub("", _ESCAPES.sub("", text[-4 * limit:]))
    return " | ".join(ln.strip() for ln in text.splitlines() if ln.strip())[-limit:]


def parse_output(conn: Transport, res: Result, module: str) -> Any:
    """The data of the module's result frame (found wherever it starts in its line), or its error raised."""
    for line in reversed(res.stdout.split("\n")):
        frame = split_frame(line)
        if frame is not None and frame[0] == "result":
            try:
                doc = json.loads(frame[1])
            except ValueError:
                raise RemoteCommandError(f"{module} gave a malformed result (exit {res.exit_code}): "
                                         f"{plain_tail(frame[1], 200)}", host=conn.name) from None
            break
    else:
        tail = plain_tail(res.stderr.strip() or res.stdout.strip())
        raise NoResult(f"{module} gave no result (exit {res.exit_code})" + (f": {tail}" if tail else ""),
                            host=conn.name, hint=_NO_RESULT_HINT.format(host=conn.name) if res.exit_code == 0 else None)
    if not isinstance(doc, dict):
        raise RemoteCommandError(f"{module} gave a malformed result (exit {res.exit_code})", host=conn.name)
    if doc.get("ok"):
        return doc.get("data")
    err = doc.get("error") or {}
    cls = _ERR_CLASSES.get(err.get("kind", ""), RemoteCommandError)
    raise cls(err.get("message", "remote error"), host=conn.name, hint=err.get("hint"), details=err)


_NO_RESULT_HINT = ("if a login file on the node (~/.bashrc, /etc/bash.bashrc) redirects or swallows stdout, "
                   "fix it: `ssh {host} true` should print nothing")


def run_module(
    conn: Transport,
    module: str,
    request: dict[str, Any] | None = None,
    *,
    python: str | None = None,
    timeout: float | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    payload: bytes | None = None,
    flags: str = "",
) -> Any:
    """Run ``python3 -m <module>`` on the node with ``request`` on stdin; return the result's data.

    The request is one line of JSON; ``payload`` (bytes an op takes, such as code push's files)
    follows it on stdin. ``env`` is for non-secret values only (they appear in the node's process
    listing); put secrets in ``request``. ``flags``: python's own options (``-S`` for a module that
    needs no site-packages). Frames are found wherever they start in a line, so a login shell's
    banner or title escape glued in front of one does no harm. Only the result frame is kept in
    memory; events go to ``on_event`` as they arrive. A node without this bundle gets it uploaded
    and the call is made again, once.
    """
    py = python or conn.host.python
    text = json.dumps(request or {})
    stdin: bytes | str = text
    if payload is not None:
        buf = bytearray(text.encode() + b"\n")
        buf += payload
        # a memoryview: paramiko's sendall slices what is left after each packet, a copy of the rest for bytes
        stdin = cast(bytes, memoryview(buf))

    def on_line(line: str) -> bool:
        """Dispatch an event; True for the result frame, the one line the connection keeps."""
        frame = split_frame(line)
        if frame is None:
            return False
        if frame[0] == "result":
            return True
        if on_event is not None:
            try:
                ev = json.loads(frame[1])
            except ValueError:
                return False
            if isinstance(ev, dict):
                on_event(ev)
        return False

    cmd = module_command(module, py, env, args, flags=flags)
    res = conn.run(cmd, stdin=stdin, timeout=timeout, on_line=on_line)
    if res.exit_code == NEED_UPLOAD:
        upload_agent(conn)
        res = conn.run(cmd, stdin=stdin, timeout=timeout, on_line=on_line)
    if res.exit_code == PY_MISSING and RESULT_PREFIX not in res.stdout:
        raise VerifyError(f"{py} not found on the node", host=conn.name,
                          hint="install python3 (3.8 or newer) there, or set python: for this host in the inventory")
    if RESULT_PREFIX not in res.stdout and "SyntaxError" in res.stderr:
        too_old(conn, py)
    return parse_output(conn, res, module)


_OLD_PYTHON = re.compile(r"^Python (\d+)\.(\d+)(\S*)", re.M)


def too_old(conn: Transport, python: str) -> None:
    """After a SyntaxError with no result (an interpreter too old to run remote/__init__.py's check):
    PythonTooOld (exit 3) naming its version and path when it is older than 3.8; else nothing."""
    res = conn.run(f'P=$(command -v {nodepath.shell(python)}) && echo "$P" && "$P" -V 2>&1', timeout=30)
    lines = res.stdout.strip().splitlines()
    m = _OLD_PYTHON.search(res.stdout)
    if res.exit_code == 0 and m and (int(m.group(1)), int(m.group(2))) < (3, 8):
        found = plain_tail(f"{m.group(1)}.{m.group(2)}{m.group(3)}", 40)
        raise PythonTooOld(f"needs python3 >= 3.8 on the node; found {found} at {plain_tail(lines[0], 200)}",
                           host=conn.name)
