"""Run remote/ modules on a node: their code travels once per content hash, then ``python3 -m remote.<name>``.

The package remote/ is named by one hash over its files; its place on the node is
``$HOME/.cache/dfo/agent/<hash>/``. It travels in two parts, each a tar.gz built here: ``core``
(all of remote/ but the vendored packaging, about 134 kB) and ``vendor`` (remote/_vendor/packaging,
about 88 kB), the second only for the modules that import it (``VENDOR_USERS``: provision, pkgcheck,
the GPU preflight). A call to a node this machine knows holds the parts it needs (a record under
~/.cache/dfo/agent-known/, per user, host and port) is one command that checks their markers. A
call to a node not known to hold them carries them in the same command (remote/_boot.py: the
parts' bytes first on stdin, each checked against its sha256, unpacked under a temporary name and
renamed into place; then the module runs): no extra round trip. When the record was wrong (the node's
cache was removed) the command exits NEED_UPLOAD and is made again with the parts: one more.
The module reads its request (JSON) from stdin and answers with one framed JSON document.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import shlex
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import remote
from remote._proto import RESULT_PREFIX, split_frame
from remote.lib.fsutil import write_atomic

from . import cache_dir, nodepath
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
    gpu_health: str = "remote.gpu.health"        # verify-env --health, run.health (the venv's python: torch)
    provision: str = "remote.env.provision"      # provision: the venv, installs, each install verified
    sync: str = "remote.transfer.sync"           # sync-data, and launch's restore of outputs
    stage: str = "remote.transfer.stage"         # stage-model
    push: str = "remote.files.push"              # sync-code (ops state, push, sync)
    pull: str = "remote.files.pull"              # pull (ops list, send)
    runs: str = "remote.runs"                    # launch, status, tail, stop, outputs (ops: see remote/runs/ops.py)
    gang: str = "remote.gang"                    # a gang's preflight, address check, interface (ops)
    exec: str = "remote.exec"                    # exec: an ad-hoc command, streamed


NODE = NodeModules()
# entry modules of the standard library and remote/ alone, called often (status, tail, stop, sync-code, sync-data,
# verify-env, pull): they run with python's -S (no site module: about 9 ms less on the node each call); a child they
# start gets no -S
SITE_FREE = frozenset({NODE.runs, NODE.push, NODE.sync, NODE.probe, NODE.pull, NODE.exec})
NEED_UPLOAD = 97
PY_MISSING = 127
PARTS = ("core", "vendor")  # in the order they are installed; the node marks each: D/.complete, D/.vendor
MARKERS = {"core": ".complete", "vendor": ".vendor"}
# the entry modules whose code imports the vendored packaging (tests/test_agent_bundle.py checks the set
# against every import, and every ``-m remote.X`` a node module starts, reachable from each entry)
VENDOR_USERS = frozenset({NODE.provision, NODE.pkgcheck, NODE.gpu_preflight})


def _bundle_files() -> list[Path]:
    return sorted(
        p for p in REMOTE_ROOT.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
        and (p.suffix in {".py", ".json", ".txt"} or p.name.startswith("LICENSE"))
    )


def part_of(rel: str) -> str:
    """The part a bundle file (``remote/...``) travels in."""
    return "vendor" if rel.startswith("remote/_vendor/packaging/") else "core"


def parts_for(module: str) -> tuple[str, ...]:
    """The parts a node module needs on the node."""
    return PARTS if module in VENDOR_USERS else ("core",)


@lru_cache(maxsize=1)
def bundle_digest() -> str:
    """The bundle's hash alone (no tar.gz made: that costs ~50 ms, needed only to upload). Kept in dfo's
    cache beside the size and mtime of every file it covers: a command whose files all still match
    reads none of them (8 ms less each command here); any difference, or no cache, hashes them again."""
    files = _bundle_files()
    stats: list[list[str | int]] = []
    for p in files:
        st = p.stat()
        stats.append([p.relative_to(REMOTE_ROOT.parent).as_posix(), st.st_size, st.st_mtime_ns])
    cache = cache_dir() / "bundle-digest.json"
    try:
        doc = json.loads(cache.read_text())
        if doc.get("root") == str(REMOTE_ROOT) and doc.get("files") == stats and isinstance(doc.get("digest"), str):
            return str(doc["digest"])
    except (OSError, ValueError, AttributeError):
        pass
    h = hashlib.sha256()
    for p, (rel, _, _) in zip(files, stats, strict=True):
        h.update(str(rel).encode() + b"\0" + p.read_bytes() + b"\0")
    digest = h.hexdigest()[:16]
    try:
        cache.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(str(cache), json.dumps({"root": str(REMOTE_ROOT), "files": stats, "digest": digest}).encode())
    except OSError:
        pass  # no cache: the next command hashes the files again
    return digest


@lru_cache(maxsize=3)
def bundle(part: str | None = None) -> tuple[str, bytes]:
    """(hash, tar.gz bytes) of one part of the node code (None: all of it in one archive), deterministic:
    remote/*.py, data files and the vendored licences; no __pycache__."""
    files = [p for p in _bundle_files()
             if part is None or part_of(p.relative_to(REMOTE_ROOT.parent).as_posix()) == part]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for p in files:
            info = tarfile.TarInfo(p.relative_to(REMOTE_ROOT.parent).as_posix())
            data = p.read_bytes()
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return bundle_digest(), gzip.compress(raw.getvalue(), compresslevel=6, mtime=0)  # 9: 4x the time, 0.7% less


def bundle_sizes() -> dict[str, int]:
    """Each part's size as it travels (bytes of its tar.gz)."""
    return {part: len(bundle(part)[1]) for part in PARTS}


def agent_dir_expr(digest: str) -> str:
    return f'"$HOME/.cache/dfo/agent/{digest}"'


AGENT_NOTE = "@@DFO-AGENT@@ "  # remote/_boot.py: dfo's code went to a place other than the home's cache


def workspaces_expr(workspace: str | None) -> list[str]:
    """Shell words of the workspaces whose ``.dfo/agent`` may hold dfo's node code, after the home's cache and
    before ``/tmp/dfo-agent-UID`` (remote/_boot.py): the one given (the job's or the host's), then the node's
    defaults, /workspace and ~/workspace (a scratch disk beside a full or read-only home)."""
    words = [nodepath.shell(workspace)] if workspace else []
    return list(dict.fromkeys([*words, "/workspace", '"$HOME"/workspace']))


# --------------------------------------------------------------------------- which nodes hold which parts

_KNOWN: dict[str, set[str]] = {}  # node key -> parts of this bundle it holds, as this process saw or read
_KNOWN_LOCK = threading.Lock()


def _node_key(conn: Transport) -> str:
    h = conn.host  # fields read with defaults: a stand-in host (tests) may carry only some
    return f"{getattr(h, 'user', '')}@{getattr(h, 'hostname', '') or conn.name}:{getattr(h, 'port', '')}"


def _known_path(key: str) -> Path:
    return cache_dir() / "agent-known" / (hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:20]
                                           + ".json")


def known_parts(conn: Transport) -> set[str]:
    """The parts of this bundle the node holds, as far as this machine knows (a guess: the node's
    markers decide)."""
    key = _node_key(conn)
    with _KNOWN_LOCK:
        if key not in _KNOWN:
            try:
                doc = json.loads(_known_path(key).read_text())
            except (OSError, ValueError):
                doc = None
            ok = isinstance(doc, dict) and doc.get("node") == key and doc.get("digest") == bundle_digest()
            _KNOWN[key] = {p for p in doc.get("parts") or [] if p in PARTS} if ok else set()
        return set(_KNOWN[key])


def _remember(conn: Transport, parts: set[str]) -> None:
    key = _node_key(conn)
    with _KNOWN_LOCK:
        if parts == _KNOWN.get(key):
            return
        _KNOWN[key] = set(parts)
        path = _known_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            doc = {"node": key, "digest": bundle_digest(), "parts": sorted(parts)}
            write_atomic(str(path), json.dumps(doc).encode("utf-8", "surrogateescape"))
        except OSError:
            pass  # a record that cannot be written costs only the parts' bytes on the next first call


@lru_cache(maxsize=1)
def _boot_text() -> str:
    return (REMOTE_ROOT / "_boot.py").read_text()


def module_command(module: str, python: str, env: dict[str, str] | None = None, args: list[str] | None = None,
                   flags: str = "", carry: list[tuple[str, str, int]] | None = None, bytecode: bool = True,
                   workspace: str | None = None) -> str:
    """``flags``: python's own options, before -m (``-S``: a module that needs no site-packages).
    ``carry``: (part, sha256, size) of the parts whose bytes come first on stdin (remote/_boot.py
    installs the missing ones, then runs the module); without it the parts' markers are checked
    and a node that lacks one exits NEED_UPLOAD. ``bytecode``: the module writes the bytecode of dfo's
    node code beside it (remote/__init__.py); False for an interpreter that imports the job's packages
    (a venv's), which must never get bytecode written into its site-packages. ``workspace``: the job's (or
    the host's), a place for dfo's code when the home's cache cannot take it (workspaces_expr); the plain
    call looks in the home's cache first (one test when it is there), then in the same places _boot.py
    may have used: a workspace's ``.dfo`` and the /tmp folder only when they are this user's and no symlink."""
    digest = bundle_digest()
    pairs = {"DFO_NODE_PYC": "1"} if bytecode else {}
    pairs.update(env or {})
    envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in pairs.items())
    argv = " ".join(shlex.quote(a) for a in (args or []))
    py = nodepath.shell(python)
    places = workspaces_expr(workspace)
    if carry:
        specs = ",".join(f"{part}:{sha}:{size}" for part, sha, size in carry)
        return (
            f'command -v {py} >/dev/null 2>&1 || exit {PY_MISSING}; cd / && PYTHONDONTWRITEBYTECODE=1 {envs} '
            f'exec {py} {flags} -c {shlex.quote(_boot_text())} {digest} "$HOME/.cache/dfo/agent" {" ".join(places)} '
            f'-- {specs} {module} {argv}'
        )
    checks = " && ".join(f'[ -f "$D/{MARKERS[p]}" ]' for p in parts_for(module))
    elsewhere = "".join(f' || {{ B={w}/.dfo; D="$B/agent/{digest}"; [ -O "$B" ] && [ ! -L "$B" ] && {checks}; }}'
                        for w in places)
    elsewhere += f' || {{ B="/tmp/dfo-agent-$(id -u)"; D="$B/{digest}"; [ -O "$B" ] && [ ! -L "$B" ] && {checks}; }}'
    return (
        f'D={agent_dir_expr(digest)}; {{ {checks}; }}{elsewhere} || exit {NEED_UPLOAD}; '
        f'command -v {py} >/dev/null 2>&1 || exit {PY_MISSING}; '
        f'cd "$D" && PYTHONPATH="$D" PYTHONDONTWRITEBYTECODE=1 {envs} '
        f'exec {py} {flags} {launch(module)} {argv}'
    )


def launch(module: str) -> str:
    """How the node's python starts ``module``: ``-m MODULE``, or for the modules called most often
    (SITE_FREE: status, sync-code, verify-env...) ``-c 'from MODULE import entry; entry()'``, the same run
    without runpy (importing it and importlib.util costs each call 1.5-3.5 ms on the node)."""
    if module in SITE_FREE:
        return "-c " + shlex.quote(f"from {module} import entry; entry()")
    return f"-m {module}"



def _carried(parts: list[str]) -> tuple[list[tuple[str, str, int]], bytes]:
    """(part, sha256, size) of each part to carry, and their bytes in that order."""
    blobs = [bundle(p)[1] for p in parts]
    return [(p, hashlib.sha256(b).hexdigest(), len(b)) for p, b in zip(parts, blobs, strict=True)], b"".join(blobs)


def carried_parts(module: str) -> tuple[list[tuple[str, str, int]], bytes]:
    """Every part ``module`` needs, to carry on a call's stdin (``module_command(carry=...)``): for a
    caller that runs the command itself (pull's raw stream) and met a node that lost dfo's code."""
    return _carried(list(parts_for(module)))


_ERR_CLASSES: dict[str, type[DfoError]] = {
    "agent": AgentMissing,  # remote/_boot.py: the node code arrived short or damaged, or could not be installed
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
    payload: bytes | list[bytes] | None = None,
    flags: str = "",
) -> Any:
    """Run ``python3 -m <module>`` on the node with ``request`` on stdin; return the result's data.

    The request is one line of JSON; ``payload`` (bytes an op takes, such as code push's files, or
    a list of chunks sent one after another) follows it on stdin. ``env`` is for non-secret values
    only (they appear in the node's process listing); put secrets in ``request``. ``flags``:
    python's own options (``-S`` for a module that needs no site-packages). Frames are found
    wherever they start in a line, so a login shell's banner or title escape glued in front of one
    does no harm. Only the result frame is kept in memory; events go to ``on_event`` as they
    arrive, each a dict with a str ``kind`` (remote/_proto.py EVENTS; a frame without one is
    dropped). dfo's node code goes first on stdin when this machine does not know the node holds the
    parts the module needs; a node that lacks them after all (exit NEED_UPLOAD) gets the call again
    with them, once.
    """
    py = python or conn.host.python
    if not flags and module in SITE_FREE:
        flags = "-S"
    text = json.dumps(request or {})
    needed = parts_for(module)

    def stdin_for(carry: bytes) -> bytes | str:
        if payload is None and not carry:
            return text
        buf = bytearray(carry)
        buf += text.encode()
        if payload is not None:
            buf += b"\n"
            for chunk in [payload] if isinstance(payload, bytes) else payload:  # one copy of each file's bytes
                buf += chunk
        # a memoryview: paramiko's sendall slices what is left after each packet, a copy of the rest for bytes
        return cast(bytes, memoryview(buf))

    def on_line(line: str) -> bool:
        """Dispatch an event; True for the result frame, the one line the connection keeps."""
        frame = split_frame(line)
        if frame is None:
            if line.startswith(AGENT_NOTE):
                _placed(conn, line[len(AGENT_NOTE):])
            return False
        if frame[0] == "result":
            return True
        if on_event is not None:
            try:
                ev = json.loads(frame[1])
            except ValueError:
                return False
            if isinstance(ev, dict) and isinstance(ev.get("kind"), str):  # the envelope: remote/_proto.py EVENTS
                on_event(ev)
        return False

    given = (request or {}).get("workspace")
    workspace = given if isinstance(given, str) and given else getattr(conn.host, "workspace", None)

    def call(parts: list[str]) -> Result:
        specs, blobs = _carried(parts) if parts else ([], b"")
        cmd = module_command(module, py, env, args, flags=flags, carry=specs, bytecode=python is None,
                             workspace=workspace)
        return conn.run(cmd, stdin=stdin_for(blobs), timeout=timeout, on_line=on_line)

    known = known_parts(conn)
    carry = [p for p in needed if p not in known]
    res = call(carry)
    if res.exit_code == NEED_UPLOAD:  # this machine's record was wrong: the node lacks a part
        known = set()
        carry = list(needed)
        res = call(carry)
    if carry and RESULT_PREFIX in res.stdout and '"kind": "agent"' not in res.stdout:  # the module ran
        _remember(conn, known | set(needed))
    if res.exit_code == PY_MISSING and RESULT_PREFIX not in res.stdout:
        raise VerifyError(f"{py} not found on the node", host=conn.name,
                          hint="install python3 (3.8 or newer) there, or set python: for this host in the inventory")
    if RESULT_PREFIX not in res.stdout and "SyntaxError" in res.stderr:
        too_old(conn, py)
    return parse_output(conn, res, module)


def _placed(conn: Transport, text: str) -> None:
    """dfo's code went elsewhere than the node's home cache (remote/_boot.py): said under -v, where and why."""
    import os
    import sys

    if not os.environ.get("DFO_VERBOSE"):
        return
    try:
        doc = json.loads(text)
        why = "; ".join(f"{p}: {w}" for p, w in doc["passed"])
        line = f"dfo: {conn.name}: dfo's node code is in {doc['where']} ({why})"
    except (ValueError, KeyError, TypeError):
        return
    sys.stderr.write(plain_tail(line, 1000) + "\n")


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
