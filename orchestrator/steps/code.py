"""sync-code on the controller: push the job's code folder to the node, only what changed.

1. List the code (orchestrator.steps.codetree: what git would commit, less code.exclude) and hash
   it (sha256, cached locally by size, mtime and inode). ``start_local`` does it in a thread, so
   that ``dfo sync-code`` lists while it imports the SSH layer and connects.
2. When this machine pushed to that node and dest before, it knows the manifest it left there
   (codetree.Pushed): ONE command (``remote.files.push`` op ``sync``) carries the files changed
   since, the deletions, and ``want``, the digest of the whole tree here. The node applies them
   (each file's sha256 checked, renamed into place), then checks that its manifest has digest
   ``want`` and that every file is still as dfo left it (stat only). Nothing changed: nothing
   sent, the check alone, ``no change``.
3. Otherwise (first push from here, or the node is not as this machine left it): the node's
   manifest (op ``state``, asked while the files here are listed, hashed, and read ahead:
   ``Prefetch``, for a tree up to PREFETCH_MAX bytes), then ``sync`` with the
   difference. A ``sync`` that does not match answers with the manifest, and the rest follows in
   one more ``sync``. No round trip per file; what is known here is only a guess of what to send,
   never a reason to skip the node's check.

``push_code(conn, loaded)`` is the step that ``launch`` (and so ``up``) runs first for a job
with ``code:``.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from remote.files.push import digest_of
from remote.lib.fsutil import human_bytes

from ..config.models import LoadedJob, RunConfig
from ..errors import ConfigError
from ..terminal import clean
from .codetree import (
    LocalFile,
    Pushed,
    Reader,
    cached_tree_digest,
    fill_hashes,
    list_code,
    manifest_view,
    save_tree_digest,
    stat_digest,
    warnings,
)
from .report import MoveReport

if TYPE_CHECKING:
    from ..transport.base import Transport

PUSH_TIMEOUT_S = 24 * 3600.0


class CodeReport(MoveReport):
    """sync-data's report shape (status, counts of files and bytes); ``fetched`` counts the files
    sent (``sent`` in --json too)."""

    what: str = Field(default="code", exclude=True)
    warnings: list[str] = []
    in_git: bool = False
    took_over: str | None = None  # this push took the folder over from that job ("": a manifest naming none)
    released: int = 0  # that job's files this push left in place (not deleted, no longer dfo's)

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


class Local:
    """The code here, listed and hashed in a thread (``start_local``); ``result()`` waits for it."""

    def __init__(self, loaded: LoadedJob) -> None:
        self.source, self.dest, self.exclude = resolve(loaded)
        self.files: dict[str, LocalFile] = {}
        self.in_git = False
        self.digest = ""
        self._hashed = False
        self._view_lock = threading.Lock()  # view() is called from the prefetch thread too
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="code-local", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.files, self.in_git = list_code(self.source, self.exclude)
            stat_sum = stat_digest(self.files)
            digest = cached_tree_digest(self.source, stat_sum)
            if digest is None:  # some file is not as the last listing saw it: hashes (cached per file)
                self.view()
                save_tree_digest(self.source, stat_sum, self.digest)
            else:
                self.digest = digest
        except BaseException as exc:  # noqa: BLE001 - raised by result(), in the caller's thread
            self._error = exc

    def view(self) -> dict[str, dict[str, object]]:
        """path -> {sha256, mode, link}, hashing (from the per-file cache) on first use."""
        self.hashed()
        return manifest_view(self.files)

    def hashed(self) -> None:
        """Every file's sha256 filled in (from the per-file cache), and the digest made from them, once."""
        with self._view_lock:
            if not self._hashed:
                fill_hashes(self.source, self.files)
                self._hashed = True
                self.digest = digest_of(manifest_view(self.files))

    def busy(self) -> bool:
        """Still listing or hashing."""
        return self._thread.is_alive()

    def result(self) -> Local:
        while self._thread.is_alive():
            self._thread.join(0.25)  # in slices: Ctrl-C reaches the main thread at once
        if self._error is not None:
            raise self._error
        return self


def start_local(loaded: LoadedJob) -> Local:
    return Local(loaded)


def _call(conn: Transport, header: dict[str, Any], payload: list[bytes] | None = None, timeout: float = 120) -> Any:
    from ..agent import NODE, run_module

    # -S: remote/ is stdlib only, and the node's site-packages cost its python ~10 ms to start
    return run_module(conn, NODE.push, header, payload=payload or [], timeout=timeout)


def _stderr(host: str) -> Callable[[str], None]:
    def say(text: str) -> None:
        sys.stderr.write(f"{host}: {clean(text)}\n")
        sys.stderr.flush()
    return say


def node_key(conn: Transport, dest: str) -> str:
    """Names the node and dest for the cache of what the last push left there."""
    h = conn.host
    return f"{h.user}@{h.hostname}:{h.port}\0{conn.name}\0{dest}"


def _entry(local: Local, reader: Reader, rel: str) -> tuple[dict[str, Any], bytes]:
    """One file's entry and bytes, read without following a symlink on its path (codetree.Reader: a
    folder swapped for a link since the listing is refused, never read). A file whose (size,
    mtime_ns, inode) after reading is still the listing's keeps the listing's sha256 (what the hash
    cache trusts); any other is hashed as read: what travels is what is checked, and the node checks
    every file's sha256 on arrival."""
    f = local.files[rel]
    if f.link is not None:
        return {"path": rel, "link": f.link, "sha256": f.sha256, "mode": None, "size": 0}, b""
    data, key = reader.read_keyed(f.via or rel)
    sha = f.sha256 if f.sha256 and key == f.key else hashlib.sha256(data).hexdigest()
    return {"path": rel, "sha256": sha, "mode": f.mode, "size": len(data), "link": None}, data


def _stream(local: Local, to_send: list[str]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The entries and the bytes of the files to send (``_entry``), in order."""
    entries: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    if not to_send:
        return entries, chunks
    with Reader(local.source) as reader:
        for rel in to_send:
            entry, data = _entry(local, reader, rel)
            entries.append(entry)
            if entry["link"] is None:
                chunks.append(data)
    return entries, chunks


def _diff(view: dict[str, dict[str, object]], node: dict[str, Any], dirty: set[str]) -> tuple[list[str], list[str]]:
    to_send = sorted(rel for rel, e in view.items()
                     if rel in dirty or node.get(rel) != [e["sha256"], e["mode"], e["link"]])
    return to_send, sorted(rel for rel in node if rel not in view)


PREFETCH_MAX = 256 * 1000 * 1000  # bytes: a tree up to this is read ahead while the node's manifest is asked


class Prefetch:
    """Every file of the code read (and its entry made) in a thread while the node's manifest is asked:
    a push to a node this machine never pushed to usually sends them all. ``take`` gives the entries
    and bytes of the files to send, read again here for any the thread did not read; ``cancel`` stops
    it (the node had them)."""

    def __init__(self, local: Local) -> None:
        self.rows: dict[str, tuple[dict[str, Any], bytes]] = {}
        self._stop = False
        self._done = threading.Event()
        threading.Thread(target=self._run, args=(local,), name="code-prefetch", daemon=True).start()

    def _run(self, local: Local) -> None:
        try:
            local.result()
            if sum(f.size for f in local.files.values()) > PREFETCH_MAX:
                return
            local.hashed()
            with Reader(local.source) as reader:
                for rel in sorted(local.files):
                    if self._stop:
                        return
                    self.rows[rel] = _entry(local, reader, rel)
        except BaseException:  # noqa: BLE001 - the same read in take() raises it, in the caller's thread
            pass
        finally:
            self._done.set()

    def cancel(self) -> None:
        self._stop = True

    def take(self, local: Local, to_send: list[str]) -> tuple[list[dict[str, Any]], list[bytes]]:
        if len(to_send) * 2 < len(local.files):  # the node holds most of them: read only what it lacks
            self.cancel()
        while not self._done.wait(0.25):  # in slices: Ctrl-C reaches the main thread at once
            pass
        entries: list[dict[str, Any]] = []
        chunks: list[bytes] = []
        reader: Reader | None = None
        try:
            for rel in to_send:
                row = self.rows.get(rel)
                if row is None:
                    reader = reader or Reader(local.source)
                    row = _entry(local, reader, rel)
                entries.append(row[0])
                if row[0]["link"] is None:
                    chunks.append(row[1])
        finally:
            if reader is not None:
                reader.close()
        self.rows = {}
        return entries, chunks


def push_code(conn: Transport, loaded: LoadedJob, warn: Callable[[str], None] | None = None,
              note: Callable[[str], None] | None = None, local: Local | None = None) -> CodeReport:
    """Push the job's code to the node; only changed files travel. Raises the DfoError of a failure.

    ``warn`` gets the warnings (big files, big trees) before anything travels; ``note`` a line
    saying what was pushed, when anything was. Both default to lines on stderr (launch, up).
    ``local``: the code here, from ``start_local`` (started early); else it is listed now."""
    warn = warn or _stderr(conn.name)
    note = note or _stderr(conn.name)
    t0 = time.monotonic()
    if local is None:
        local = start_local(loaded)
    dest = local.dest
    # the job that owns what it pushes there (remote.files.push: another job's live run refuses this push)
    who = {"dest": dest, "job": loaded.job.name, "workspace": loaded.job.workspace or conn.host.workspace,
           "host": conn.name}
    known = Pushed(node_key(conn, dest))
    state: dict[str, Any] | None = None
    ahead: Prefetch | None = None
    if known.digest is None:  # nothing known of the node: its manifest, asked while the files here are listed
        ahead = Prefetch(local)  # ...and read: a node never pushed to from here most often gets them all
        try:
            state = _call(conn, {"op": "state", **who})
        except BaseException:
            ahead.cancel()
            raise
    if ahead is None and local.busy():  # the connection is made while the code here is still listed
        conn.warm()
    local.result()
    files = local.files
    base: dict[str, Any] | None = None
    if state is None and known.digest != local.digest:  # changed here since the last push: what, exactly
        base = known.files()
        if base is None:  # the cache went away meanwhile
            state = _call(conn, {"op": "state", **who})
    total_bytes = sum(f.size for f in files.values())
    sent = nbytes = deleted = kept_n = 0
    kept: list[str] = []
    notes: list[str] = []
    warned: set[str] = set()
    real = dest
    took_over: str | None = None
    released = 0
    takeover = False  # another job's folder (its owner has no live run): send the whole tree, delete nothing
    to_send: list[str]
    to_delete: list[str]

    encoded: list[bytes] = []  # the cache's bytes, made in a thread while the push runs (remember() writes them)

    def remember() -> None:  # what the node now holds, for the next push's guess
        if known.digest != local.digest:
            local.hashed()
            known.save(local.digest, files, encoded[0] if encoded else None)

    def report(status: str) -> CodeReport:
        secs = time.monotonic() - t0
        return CodeReport(host=conn.name, what="code", status=status, source=str(local.source), dest=real,
                          fetched=sent, skipped=len(files) - sent, deleted=deleted, bytes=nbytes,
                          seconds=round(secs, 3), mb_per_s=round(nbytes / 1e6 / secs, 1) if secs > 0 else 0.0,
                          files_total=len(files), bytes_total=total_bytes, kept=kept_n,
                          kept_files=sorted(kept)[:10], warnings=notes, in_git=local.in_git,
                          took_over=took_over, released=released)

    if state is not None and state.get("foreign"):
        real, takeover = state["dest"], True
        to_send, to_delete = sorted(local.view()), []
    elif state is not None:
        real = state["dest"]
        dirty = set(state.get("dirty") or [])
        if not dirty and files and state.get("digest") == local.digest:
            if ahead is not None:
                ahead.cancel()
            remember()
            return report("no change")
        to_send, to_delete = _diff(local.view(), state.get("files") or {}, dirty)
        if not to_send and not to_delete:
            if ahead is not None:
                ahead.cancel()
            return report("no change")
    elif base is not None:
        to_send, to_delete = _diff(local.view(), base, set())
    else:  # nothing changed here since the last push: the node's check alone
        to_send, to_delete = [], []
    encoder: threading.Thread | None = None
    for attempt in range(2):
        new = [n for n in warnings(local.source, files, [r for r in to_send if r not in warned]) if n not in notes]
        for n in new:
            warn("warning: " + n)
        notes += new
        warned.update(to_send)
        entries, payload = ahead.take(local, to_send) if ahead is not None and not attempt else _stream(local, to_send)
        if not attempt and known.digest != local.digest:  # what remember() writes, made while the push runs
            local.hashed()
            encoder = threading.Thread(target=lambda d=local.digest: encoded.append(known.encode(d, files)),
                                       daemon=True, name="code-cache")
            encoder.start()
        done = _call(conn, {"op": "sync", **who, "want": local.digest, "files": entries, "delete": to_delete,
                            "takeover": takeover}, payload, timeout=PUSH_TIMEOUT_S)
        real = done["dest"]
        sent, nbytes, deleted = sent + done["sent"], nbytes + done["bytes"], deleted + done["deleted"]
        kept += done.get("kept_files") or []
        kept_n += done.get("kept") or 0
        if done.get("took_over") is not None:
            took_over, released = done["took_over"], released + int(done.get("released") or 0)
        if done.get("match"):
            if encoder is not None:
                encoder.join()
            remember()
            break
        if done.get("foreign") and not attempt:  # another job's folder, not running: take it over (whole tree)
            takeover, to_send, to_delete = True, sorted(local.view()), []
            continue
        takeover = False
        to_send, to_delete = _diff(local.view(), done.get("files") or {}, set(done.get("dirty") or []))
        if attempt or (not to_send and not to_delete):
            break  # the node changed under this push (another push into the same dest): reported as it went
    status = "done" if sent or deleted or took_over is not None else "no change"
    if status == "done":
        note(f"code: sent {sent} file{'s' if sent != 1 else ''} ({human_bytes(nbytes)}), deleted {deleted}, to {real}"
             + (f"; {took_over_line(took_over, released)}" if took_over is not None else ""))
    return report(status)


def took_over_line(owner: str, released: int) -> str:
    """What a takeover did, in words (for the report and launch's note)."""
    prev = f"job {owner}" if owner else "a push that named no job (an older dfo)"
    left = f"{released} of its file{'s' if released != 1 else ''} left in place, not deleted" if released else \
        "none of its files left behind"
    return f"took the folder over from {prev} (no live run): {left}"
