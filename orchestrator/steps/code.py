"""sync-code on the controller: push the job's code folder to the node, only what changed.

1. List the code (orchestrator.steps.codetree: what git would commit, less code.exclude) and hash
   it (sha256, cached locally by size, mtime and inode).
2. Meanwhile (a thread) one round trip (``remote.codepush`` op ``state``) asks the node for its
   manifest; when the node's tree already matches (same digest, every file as dfo left it) that
   is the end: ``no change``.
3. One more command (op ``push``) carries the deletions and the changed files' bytes as one
   stream on its stdin; the node checks each file's sha256, renames it into place and records
   its manifest. No round trip per file.

``push_code(conn, loaded)`` is the step that ``launch`` (and so ``up``) runs first for a job
with ``code:``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from pydantic import Field

from remote.fsutil import human_bytes

from ..agent import NEED_UPLOAD, module_command, parse_output, upload_agent
from ..cli_common import clean
from ..config import LoadedJob, RunConfig
from ..connection import Connection
from ..errors import ConfigError
from .codetree import fill_hashes, list_code, manifest_view, warnings
from .report import MoveReport

MODULE = "remote.codepush"
PUSH_TIMEOUT_S = 24 * 3600.0


class CodeReport(MoveReport):
    """sync-data's report shape (status, counts of files and bytes); ``fetched`` counts the files
    sent (``sent`` in --json too)."""

    what: str = Field(default="code", exclude=True)
    warnings: list[str] = []
    in_git: bool = False

    def to_json(self) -> dict[str, Any]:
        return {**self.model_dump(), "sent": self.fetched}


def resolve(loaded: LoadedJob) -> tuple[Path, str, list[str]]:
    """(source folder here, dest on the node, exclude patterns), or ConfigError (exit 2)."""
    code: Any = loaded.need("code")
    source = (loaded.path.parent / code.source).resolve()
    if not source.is_dir():
        raise ConfigError(f"{loaded.path}: code.source {code.source!r} is not a folder ({source})",
                          hint="code.source is relative to the job file")
    dest = code.dest
    if dest is None:
        run = loaded.job.run
        if not isinstance(run, RunConfig):
            raise ConfigError(f"{loaded.path}: code.dest is not set and the job has no run: section",
                              hint="set code.dest (a folder on the node) or run.workdir")
        dest = run.workdir
    if not dest.startswith(("/", "~")):
        raise ConfigError(f"{loaded.path}: code.dest {dest!r} must be an absolute path on the node",
                          hint="for example /root/code")
    return source, dest, list(code.exclude)


def _call(conn: Connection, header: dict[str, Any], payload: bytes = b"", timeout: float = 120) -> Any:
    cmd = module_command(MODULE, conn.host.python)
    buf = bytearray(json.dumps(header).encode("utf-8", "surrogateescape") + b"\n")
    buf += payload
    # a memoryview: paramiko's sendall slices what is left after each packet, a copy of the rest for bytes
    data = cast(bytes, memoryview(buf))

    def keep(line: str) -> bool:
        return "@@DFO-RESULT@@" in line

    res = conn.run(cmd, stdin=data, timeout=timeout, on_line=keep)
    if res.exit_code == NEED_UPLOAD:
        upload_agent(conn)
        res = conn.run(cmd, stdin=data, timeout=timeout, on_line=keep)
    return parse_output(conn, res, MODULE)


def _stderr(host: str) -> Callable[[str], None]:
    def say(text: str) -> None:
        sys.stderr.write(f"{host}: {clean(text)}\n")
        sys.stderr.flush()
    return say


def push_code(conn: Connection, loaded: LoadedJob, warn: Callable[[str], None] | None = None,
              note: Callable[[str], None] | None = None) -> CodeReport:
    """Push the job's code to the node; only changed files travel. Raises the DfoError of a failure.

    ``warn`` gets the warnings (big files, big trees) before anything travels; ``note`` a line
    saying what was pushed, when anything was. Both default to lines on stderr (launch, up)."""
    warn = warn or _stderr(conn.name)
    note = note or _stderr(conn.name)
    t0 = time.monotonic()
    source, dest, exclude = resolve(loaded)
    asked: dict[str, Any] = {}

    def ask() -> None:  # the node's manifest, while the files here are listed and hashed
        try:
            asked["state"] = _call(conn, {"op": "state", "dest": dest})
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            asked["error"] = exc

    th = threading.Thread(target=ask, name=f"code-state-{conn.name}", daemon=True)
    th.start()
    try:
        files, in_git = list_code(source, exclude)
        fill_hashes(source, files)
    finally:
        th.join()
    if "error" in asked:
        raise asked["error"]
    state = asked["state"]
    local = manifest_view(files)
    from remote.codepush import digest_of

    total_bytes = sum(f.size for f in files.values())

    def report(status: str, sent: int = 0, nbytes: int = 0, deleted: int = 0, kept: list[str] | None = None,
               real: str = dest, notes: list[str] | None = None) -> CodeReport:
        secs = time.monotonic() - t0
        return CodeReport(host=conn.name, what="code", status=status, source=str(source), dest=real,
                          fetched=sent, skipped=len(files) - sent, deleted=deleted, bytes=nbytes,
                          seconds=round(secs, 3), mb_per_s=round(nbytes / 1e6 / secs, 1) if secs > 0 else 0.0,
                          files_total=len(files), bytes_total=total_bytes, kept=len(kept or []),
                          kept_files=kept or [], warnings=notes or [], in_git=in_git)

    dirty = set(state.get("dirty") or [])
    if not dirty and files and state.get("digest") == digest_of(local):
        return report("no change", real=state["dest"])
    node = state.get("files") or {}
    to_send = sorted(rel for rel, e in local.items()
                     if rel in dirty or node.get(rel) != [e["sha256"], e["mode"], e["link"]])
    to_delete = sorted(rel for rel in node if rel not in local)
    if not to_send and not to_delete:
        return report("no change", real=state["dest"])
    notes = warnings(source, files, to_send)
    for n in notes:
        warn("warning: " + n)
    entries, chunks = [], []
    for rel in to_send:
        f = files[rel]
        if f.link is not None:
            entries.append({"path": rel, "link": f.link, "sha256": f.sha256, "mode": None, "size": 0})
            continue
        data = (source / rel).read_bytes()
        sha = hashlib.sha256(data).hexdigest()  # what travels is what is checked (a file may change meanwhile)
        entries.append({"path": rel, "sha256": sha, "mode": f.mode, "size": len(data), "link": None})
        chunks.append(data)
    done = _call(conn, {"op": "push", "dest": dest, "files": entries, "delete": to_delete}, b"".join(chunks),
                 timeout=PUSH_TIMEOUT_S)
    status = "done" if done["sent"] or done["deleted"] else "no change"
    if status == "done":
        note(f"code: sent {done['sent']} files ({human_bytes(done['bytes'])}), deleted {done['deleted']}, "
             f"to {done['dest']}")
    return report(status, done["sent"], done["bytes"], done["deleted"], done.get("kept_files") or [],
                  real=done["dest"], notes=notes)
