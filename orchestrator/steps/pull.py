"""dfo pull on the controller: a run's files from the node to this machine, verified, resumable.

1. One command lists the files under the run's folder (``remote.files.pull`` op ``list``): the
   run's outputs.path as its record on the node says (a run that ships: outputs.dest), else the
   job's (-j) outputs.path, else the run's workdir.
2. Files already here as dfo pulled them (same size and mtime on the node as recorded in
   DIR/.dfo/pull-manifest.json, and the local copy unchanged since) are skipped.
3. One more command sends the rest as a stream of events; each file goes to
   DIR/.dfo/partial/ first, is checked against the sha256 the node computed of the whole file
   as it read it, then renamed into place. An interrupted pull keeps its partial files: the
   next one asks only for the bytes after them (when the node's file is unchanged) and checks
   the whole file again on arrival.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from remote.lib.fsutil import write_atomic

from ..agent import NODE, run_module
from ..config.models import LoadedJob
from ..errors import ConfigError, VerifyError
from ..transport.ssh import Connection
from .report import MoveReport
from .runs import status
from .workspace import job_workspace

PULL_TIMEOUT_S = 7 * 24 * 3600.0
MANIFEST = "pull-manifest.json"


class PullReport(MoveReport):
    """sync-data's report shape: status, counts of files and bytes."""

    run: str
    resumed: int = 0  # files continued from an earlier, interrupted pull
    changed: int = 0  # changed on the node while being pulled: not fetched, pull again
    changed_files: list[str] = []
    links_skipped: int = 0

    def to_json(self) -> dict[str, Any]:
        return self.model_dump()


def _check_rel(rel: str) -> str:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0].startswith(".dfo"):
        raise VerifyError(f"pull: the node listed an unsafe name {rel!r}; nothing was written for it")
    return rel


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


class _Sink:
    """Writes the node's events into partial files and checks each file on arrival."""

    def __init__(self, to: Path, wanted: list[dict[str, Any]], manifest: dict[str, Any], save: Callable[[], None]):
        self.to, self.wanted, self.manifest, self.save = to, wanted, manifest, save
        self.part_dir = to / ".dfo" / "partial"
        self.cur: int | None = None
        self.fh: Any = None
        self.hash: Any = None
        self.bytes = 0
        self.done = 0
        self.changed: list[str] = []
        self.bad: list[str] = []
        self.last_save = time.monotonic()

    def part(self, rel: str) -> Path:
        return self.part_dir / (hashlib.sha256(rel.encode("utf-8", "surrogateescape")).hexdigest()[:32] + ".part")

    def _open(self, i: int) -> None:
        f = self.wanted[i]
        self.cur, self.hash = i, hashlib.sha256()
        p = self.part(f["path"])
        if f["offset"]:
            with open(p, "rb") as old:
                left = f["offset"]
                while left:
                    buf = old.read(min(8 << 20, left))
                    if not buf:
                        break
                    self.hash.update(buf)
                    left -= len(buf)
            self.fh = open(p, "r+b")  # noqa: SIM115 - closed in _close
            self.fh.seek(f["offset"])
            self.fh.truncate()
        else:
            self.fh = open(p, "wb")  # noqa: SIM115 - closed in _close
        write_atomic(str(p) + ".json", json.dumps({"path": f["path"], "size": f["size"],
                                                   "mtime_ns": f["mtime_ns"]}).encode())

    def _close(self) -> None:
        if self.fh is not None:
            self.fh.close()
        self.fh, self.cur = None, None

    def on_event(self, ev: dict[str, Any]) -> None:
        t, i = ev.get("t"), ev.get("i")
        if not isinstance(i, int) or not 0 <= i < len(self.wanted):
            return
        f = self.wanted[i]
        if t == "d":
            if self.cur != i:
                self._close()
                self._open(i)
            data = base64.b64decode(ev["b"])
            self.fh.write(data)
            self.hash.update(data)
            self.bytes += len(data)
        elif t == "end":
            if self.cur != i:  # nothing after the offset (an empty file, or all of it was here)
                self._close()
                self._open(i)
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self._close()
            p = self.part(f["path"])
            if self.hash.hexdigest() != ev.get("sha256"):
                p.unlink(missing_ok=True)
                Path(str(p) + ".json").unlink(missing_ok=True)
                self.bad.append(f["path"])
                return
            dest = self.to / f["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, dest)
            Path(str(p) + ".json").unlink(missing_ok=True)
            st = os.lstat(dest)
            self.manifest[f["path"]] = {"size": f["size"], "mtime_ns": f["mtime_ns"], "sha256": ev["sha256"],
                                        "local": [st.st_size, st.st_mtime_ns, st.st_ino]}
            self.done += 1
            if time.monotonic() - self.last_save > 2:
                self.save()
                self.last_save = time.monotonic()
        elif t == "changed":
            self.changed.append(f["path"])


def pull(conn: Connection, *, run: str | None, paths: list[str], to: str | None, loaded: LoadedJob | None,
         on_event: Callable[[dict[str, Any]], None] | None = None) -> PullReport:
    t0 = time.monotonic()
    workspace = job_workspace(loaded.job if loaded is not None else None, conn.host.workspace)
    info = status(conn, workspace, run=run, job=loaded.job.name if loaded is not None else None, limit=1)[0]
    source = _recorded_path(info.outputs) or _outputs_path(loaded, info.id) or info.workdir
    if not source:
        raise ConfigError(f"run {info.id}: its record on the node names no workdir", host=conn.name)
    dest = Path(to) if to else Path("runs") / info.id
    listing = run_module(conn, NODE.pull, {"op": "list", "root": source, "paths": paths}, timeout=600)
    if listing.get("missing"):
        raise ConfigError(f"pull: not on the node under {listing['root']}: {', '.join(listing['missing'])}",
                          host=conn.name, hint="PATH is relative to the run's folder")
    meta_dir = dest / ".dfo"
    meta_dir.mkdir(parents=True, exist_ok=True)
    (meta_dir / "partial").mkdir(exist_ok=True)
    try:
        manifest = json.loads((meta_dir / MANIFEST).read_text()).get("files", {})
    except (OSError, ValueError):
        manifest = {}

    def save() -> None:
        write_atomic(str(meta_dir / MANIFEST), json.dumps({"version": 1, "run": info.id, "source": listing["root"],
                                                           "files": manifest}).encode(), mode=0o644)

    wanted: list[dict[str, Any]] = []
    skipped = resumed = 0
    files = listing["files"]
    for rel in sorted(files):
        size, mtime_ns = files[rel]
        _check_rel(rel)
        m = manifest.get(rel)
        if m and m["size"] == size and m["mtime_ns"] == mtime_ns:
            try:
                st = os.lstat(dest / rel)
                if [st.st_size, st.st_mtime_ns, st.st_ino] == m["local"]:
                    skipped += 1
                    continue
            except OSError:
                pass
        offset = 0
        sink_probe = _Sink(dest, [], manifest, save)
        part = sink_probe.part(rel)
        try:
            pm = json.loads(Path(str(part) + ".json").read_text())
            have = part.stat().st_size
            if pm.get("size") == size and pm.get("mtime_ns") == mtime_ns and 0 < have <= size:
                offset = have
                resumed += 1
        except (OSError, ValueError):
            pass
        wanted.append({"path": rel, "size": size, "mtime_ns": mtime_ns, "offset": offset})
    sink = _Sink(dest, wanted, manifest, save)
    if wanted:
        if on_event is not None:
            on_event({"type": "plan", "to_fetch": len(wanted),
                      "bytes_to_fetch": sum(w["size"] - w["offset"] for w in wanted)})

        def ev(e: dict[str, Any]) -> None:
            sink.on_event(e)
            if on_event is not None and e.get("t") == "d":
                on_event({"type": "progress", "bytes": sink.bytes, "files": sink.done, "files_total": len(wanted)})

        try:
            run_module(conn, NODE.pull, {"op": "send", "root": source,
                                      "files": [{k: w[k] for k in ("path", "size", "mtime_ns", "offset")}
                                                for w in wanted]}, timeout=PULL_TIMEOUT_S, on_event=ev)
        finally:
            sink._close()
            save()
    else:
        save()
    if sink.bad:
        raise VerifyError(f"pull: {len(sink.bad)} file(s) did not match the node's sha256 on arrival: "
                          f"{', '.join(sink.bad[:5])}", host=conn.name, hint="run the same pull again")
    secs = time.monotonic() - t0
    return PullReport(host=conn.name, status="done" if sink.done else "no change", run=info.id, fetched=sink.done,
                      skipped=skipped, bytes=sink.bytes, resumed=resumed if sink.done else 0, seconds=round(secs, 3),
                      mb_per_s=round(sink.bytes / 1e6 / secs, 1) if secs > 0 else 0.0, dest=str(dest),
                      source=listing["root"], files_total=len(files),
                      bytes_total=sum(v[0] for v in files.values()), changed=len(sink.changed),
                      changed_files=sink.changed[:10], links_skipped=listing.get("n_links", 0))
