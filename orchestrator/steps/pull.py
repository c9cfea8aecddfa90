"""dfo pull on the controller: a run's files from the node to this machine, verified, resumable.

The node is not trusted: its run id, the names and sizes it lists and the bytes it sends are
checked before anything is written here (docs/security.md).

1. The run's id, as the node reports it, must be a run id as dfo makes them (``RUN_ID``) and the
   RUN asked for (or begin with it: RUN may be a prefix); else exit 3 with nothing written. DIR is
   ``--to DIR``, else ./runs/RUN/; with several hosts, a folder per host below it (DIR/HOST/).
2. One command lists the files under the run's folder (``remote.files.pull`` op ``list``): the
   run's outputs.path as its record on the node says (a run that ships: outputs.dest), else the
   job's (-j) outputs.path, else the run's workdir. A name that could leave DIR (``..``, absolute)
   is exit 3; a name with a ``.git`` component is refused (not pulled, said in the report).
3. DIR is opened and locked (steps.pullsink.PullDir: one pull at a time per DIR; no symlink inside
   DIR is followed). Files already here as dfo pulled them (same size and mtime on the node as
   recorded in DIR/.dfo/pull-manifest.json, and the local copy unchanged since) are skipped. A file
   here that the manifest does not list, or that changed since dfo wrote it, is kept (not replaced)
   unless ``overwrite``.
4. One more command sends the rest as a raw stream (steps.pullwire: the file bytes as they are,
   in length-prefixed records); each file goes to DIR/.dfo/partial/ first (never past its listed
   size: a record that would pass it is refused before its bytes are read), is read back from
   disk (by a thread behind the writer, while the rest arrives; a write here by anything else, even
   to bytes already read back, is caught: steps.pullsink) and checked against its listed size and the
   sha256 the node computed of the whole file as it read it, then renamed into place. An
   interrupted pull keeps its partial files: the next one asks only for the bytes after them (when
   the node's file is unchanged) and checks the whole file again on arrival.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..agent import NODE, run_module
from ..config.models import LoadedJob
from ..errors import ConfigError, VerifyError
from ..transport.base import Transport
from .pullsink import InTheWay, PullDir, Sink, is_git, local_error
from .pullwire import send
from .report import MoveReport
from .runs import status
from .workspace import job_workspace

PULL_TIMEOUT_S = 7 * 24 * 3600.0
NAMES_SHOWN = 10
# a run id as dfo makes them (steps.runs.new_run_id), the pattern remote/runs/ops.py launches with
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class PullReport(MoveReport):
    """sync-data's report shape: status, counts of files and bytes; ``kept``: files here this pull
    did not replace (not written by dfo pull, changed since it did, or behind a symlink)."""

    run: str
    resumed: int = 0  # files continued from an earlier, interrupted pull
    changed: int = 0  # changed on the node while being pulled: not fetched, pull again
    changed_files: list[str] = []
    links_skipped: int = 0
    refused: int = 0  # names the node listed with a .git component: never pulled
    refused_files: list[str] = []

    def to_json(self) -> dict[str, Any]:
        return self.model_dump()


def _bad_name(rel: object) -> bool:
    if not isinstance(rel, str):
        return True
    parts = rel.split("/")
    return (not rel or rel.startswith("/") or "\0" in rel or any(p in ("", ".", "..") for p in parts)
            or parts[0].lower().startswith(".dfo"))


def check_run_id(host: str, got: object, asked: str | None) -> str:
    """The run id the node reported, if it is one dfo makes and the one asked for; else VerifyError."""
    if not isinstance(got, str) or not RUN_ID.match(got):
        raise VerifyError(f"pull: the node reported the run id {got!r}, which is not a run id; nothing was written",
                          host=host, hint="the node is not to be trusted: check it")
    if asked is not None and not got.startswith(asked):
        raise VerifyError(f"pull: the node reported the run id {got!r} for the run {asked!r} asked for; "
                          "nothing was written", host=host, hint="the node is not to be trusted: check it")
    return got


def _recorded_path(outputs: dict[str, Any] | None) -> str | None:
    """outputs.path as the run's record on the node holds it (``{name}``/``{run_id}`` expanded at launch)."""
    path = (outputs or {}).get("path")
    return path if isinstance(path, str) and path else None


def _outputs_path(loaded: LoadedJob | None, run_id: str) -> str | None:
    outputs = getattr(loaded.job, "outputs", None) if loaded is not None else None
    path = getattr(outputs, "path", None)
    if not path:
        return None
    return str(path).replace("{name}", loaded.job.name).replace("{run_id}", run_id)  # type: ignore[union-attr]


def destination(host: str, run_id: str, to: str | None, per_host: bool) -> tuple[Path, list[str]]:
    """(the folder the user chose, the names below it): DIR = ``--to`` or ./runs, then RUN (without
    --to), then HOST (several hosts). Each name is one checked path component."""
    parts = ([] if to else [run_id]) + ([host] if per_host else [])
    for p in parts:
        if not RUN_ID.match(p):  # the host: an inventory name (checked there too)
            raise VerifyError(f"pull: {p!r} cannot name a folder here", host=host)
    return (Path(to) if to else Path("runs")), parts


def _listing(host: str, listing: Any) -> dict[str, tuple[int, int]]:
    """The node's list, checked: names that stay inside DIR, sizes and mtimes that are integers."""
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(files, dict):
        raise VerifyError("pull: the node's file list is malformed; nothing was written", host=host)
    out: dict[str, tuple[int, int]] = {}
    for rel, v in files.items():
        if _bad_name(rel):
            raise VerifyError(f"pull: the node listed an unsafe name {rel!r}; nothing was written", host=host,
                              hint="the node is not to be trusted: check it")
        ok = isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
        if not ok or v[0] < 0:
            raise VerifyError(f"pull: the node listed {rel!r} with a malformed size or time; nothing was written",
                              host=host)
        out[rel] = (v[0], v[1])
    return out


def pull(conn: Transport, *, run: str | None, paths: list[str], to: str | None, loaded: LoadedJob | None,
         on_event: Callable[[dict[str, Any]], None] | None = None, per_host: bool = False,
         overwrite: bool = False) -> PullReport:
    t0 = time.monotonic()
    workspace = job_workspace(loaded.job if loaded is not None else None, conn.host.workspace)
    info = status(conn, workspace, run=run, job=loaded.job.name if loaded is not None else None, limit=1)[0]
    run_id = check_run_id(conn.name, info.id, run)
    base, parts = destination(conn.name, run_id, to, per_host)
    source = _recorded_path(info.outputs) or _outputs_path(loaded, run_id) or info.workdir
    if not source:
        raise ConfigError(f"run {run_id}: its record on the node names no workdir", host=conn.name)
    listing = run_module(conn, NODE.pull, {"op": "list", "root": source, "paths": paths}, timeout=600)
    if listing.get("missing"):
        raise ConfigError(f"pull: not on the node under {listing['root']}: {', '.join(listing['missing'])}",
                          host=conn.name, hint="PATH is relative to the run's folder")
    files = _listing(conn.name, listing)
    root = str(listing.get("root"))
    refused = sorted(rel for rel in files if is_git(rel))
    d = PullDir(base, parts, conn.name)
    try:
        manifest = d.read_manifest()

        def save() -> None:
            d.save_manifest({"version": 1, "run": run_id, "source": root, "files": manifest})

        sink = Sink(d, [], manifest, overwrite, save)
        wanted: list[dict[str, Any]] = []
        kept: list[str] = []
        skipped = resumed = 0
        for rel in sorted(set(files) - set(refused)):
            size, mtime_ns = files[rel]
            m = manifest.get(rel)
            try:
                st = d.lstat(rel)
                if st is not None and isinstance(m, dict) and d.ours(st, m) and m.get("size") == size \
                        and m.get("mtime_ns") == mtime_ns:
                    skipped += 1
                    continue
                if d.may_replace(rel, m, overwrite) is not None:
                    kept.append(rel)
                    continue
            except InTheWay:
                kept.append(rel)
                continue
            except OSError as exc:
                raise local_error(exc, f"{d.path}/{rel}", conn.name) from None
            offset = sink.resumable(rel, size, mtime_ns)
            resumed += bool(offset)
            wanted.append({"path": rel, "size": size, "mtime_ns": mtime_ns, "offset": offset})
        sink.wanted = wanted
        if wanted:
            if on_event is not None:
                on_event({"kind": "plan", "to_fetch": len(wanted),
                          "bytes_to_fetch": sum(w["size"] - w["offset"] for w in wanted)})

            def progress() -> None:
                if on_event is not None:
                    on_event({"kind": "progress", "bytes": sink.bytes, "files": sink.done, "files_total": len(wanted)})

            try:
                send(conn, None, {"root": source, "files": [{k: w[k] for k in ("path", "size", "mtime_ns", "offset")}
                                                            for w in wanted]},
                     sink, timeout=PULL_TIMEOUT_S, on_progress=progress)
            finally:
                sink.close()
                save()
        else:
            save()
    finally:
        d.close()
    if sink.bad:
        raise VerifyError(f"pull: {len(sink.bad)} file(s) did not match the node's listed size and sha256 on arrival, "
                          f"not kept: {', '.join(sink.bad[:5])}", host=conn.name, hint="run the same pull again")
    missing = sink.unfinished()
    if missing:
        raise VerifyError(f"pull: the node did not send {len(missing)} file(s) it was asked for: "
                          f"{', '.join(missing[:5])}", host=conn.name, hint="run the same pull again")
    kept = sorted(kept + sink.kept)
    secs = time.monotonic() - t0
    return PullReport(host=conn.name, status="done" if sink.done else "no change", run=run_id, fetched=sink.done,
                      skipped=skipped, bytes=sink.bytes, resumed=resumed if sink.done else 0, seconds=round(secs, 3),
                      mb_per_s=round(sink.bytes / 1e6 / secs, 1) if secs > 0 else 0.0, dest=str(d.path),
                      source=root, files_total=len(files), bytes_total=sum(v[0] for v in files.values()),
                      changed=len(sink.changed), changed_files=sink.changed[:NAMES_SHOWN],
                      links_skipped=listing.get("n_links", 0) if isinstance(listing.get("n_links"), int) else 0,
                      kept=len(kept), kept_files=kept[:NAMES_SHOWN], refused=len(refused),
                      refused_files=refused[:NAMES_SHOWN])
