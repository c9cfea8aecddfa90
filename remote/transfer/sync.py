"""``python3 -m remote.transfer.sync``: copy an S3 prefix onto this node, fast, verified, resumable.

Request (JSON on stdin; secrets only here, never in argv or the environment)::

    {"source": "s3://bucket/prefix/", "dest": "/abs/dir", "delete": false,
     "endpoint_url": null, "region": "us-east-1",
     "credentials": {"access_key", "secret_key", "session_token"} | null,
     "credentials_mode": "controller" | "node", "profile": null,
     "concurrency": 32, "part_size_mb": 16, "multipart_threshold_mb": 64,
     "check_space": true, "margin_pct": 0, "what": "data",
     "workspace": "/workspace", "venv": "/root/venv"}

Steps: check the destination (``remote.lib.destsafety``: refuses /, $HOME, the workspace root, a dest
holding the venv or another dest, one others own or may write, symlinks inside it; exit 2) ->
list the prefix (every page) -> compare with DEST/.dfo/manifest.json (size + ETag, and the file
on disk still the one dfo wrote) -> check the destination filesystem has room for what is missing
(plus ``margin_pct``) before any byte moves -> fetch the rest in parallel (``remote.s3.download``)
-> with ``delete``, remove the files dfo wrote that the source no longer has (never a file dfo
did not write, nor one changed on the node since: those are reported as ``kept``). Events
(remote/_proto.py EVENTS): one ``plan``, then ``progress`` every 0.5 s. The result is
the summary (fetched, skipped, deleted, bytes, seconds, mb_per_s, changed, kept, ...). Failures are
RemoteError "verify" (S3 said no, a check failed, the disk is full or read-only) or "unreachable"
(no answer from the endpoint), naming the object and the endpoint; the next run resumes.
"""
from __future__ import annotations

import os
import signal
import threading
import time

from remote._proto import RemoteError, emit_event, main
from remote.lib.destsafety import META_DIR, Tree, check_dest, open_dest
from remote.lib.fsutil import node_path, workspace
from remote.s3.client import S3Client, S3Error, split_s3_url
from remote.s3.download import Engine, Obj, describe_failure, free_bytes, human
from remote.s3.manifest import Manifest
from remote.s3.sig import node_credentials

TICK_S = 0.5
MIB = 1 << 20
NAMES_SHOWN = 20  # changed_files / kept_files: the first names (sorted), the counts are complete


class Progress:
    """Counters shared by the workers, and the ticker that streams them to the controller."""

    def __init__(self, files_total, bytes_total, stop):
        self.lock = threading.Lock()
        self.files_total, self.bytes_total = files_total, bytes_total
        self.bytes = 0
        self.files = 0
        self.verified = {}
        self.stop = stop
        self.t0 = time.monotonic()
        self.broken = False
        self._emit_lock = threading.Lock()
        self._ticker = None
        self._tick_hooks = []

    def add(self, n):
        with self.lock:
            self.bytes += n

    def file_done(self, kind):
        with self.lock:
            self.files += 1
            self.verified[kind] = self.verified.get(kind, 0) + 1

    def emit(self, kind, **fields):
        if self.broken:
            return
        try:
            with self._emit_lock:
                emit_event(kind, **fields)
        except (OSError, ValueError):  # the controller is gone (SSH dropped): stop, keep what is done
            self.broken = True
            self.stop.set()

    def snapshot(self):
        with self.lock:
            dt = max(time.monotonic() - self.t0, 1e-6)
            return {"bytes": self.bytes, "bytes_total": self.bytes_total,
                    "files": self.files, "files_total": self.files_total, "rate": self.bytes / dt,
                    "seconds": round(dt, 3)}

    def start(self, hooks=()):
        self._tick_hooks = list(hooks)
        self._done = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="dfo-progress", daemon=True)
        self._ticker.start()

    def _tick(self):
        while not self._done.wait(TICK_S):
            for hook in self._tick_hooks:
                hook()
            self.emit("progress", **self.snapshot())

    def finish(self):
        if self._ticker is not None:
            self._done.set()
            self._ticker.join()
            self._ticker = None
        self.emit("progress", **self.snapshot())


class Signals:
    """SIGTERM/SIGHUP/SIGINT set the stop flag: workers finish their chunk, temps are removed,
    the journal is kept; then the run reports "interrupted"."""

    NAMES = ("SIGTERM", "SIGHUP", "SIGINT")

    def __init__(self, stop):
        self.stop = stop
        self.got = None
        self._old = {}

    def __enter__(self):
        for name in self.NAMES:
            sig = getattr(signal, name)
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.got = signal.Signals(signum).name
        self.stop.set()

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


# --------------------------------------------------------------------------- request handling


def resolve_dest(dest, field):
    dest = node_path(dest or "")  # ~ and $HOME: this user's home
    if not os.path.isabs(dest):
        raise RemoteError("config", "%s must be an absolute path on the node, got %r" % (field, dest))
    return os.path.normpath(dest)


def checked_dest(req, what):
    """The request's dest, normalised, and its real path once ``remote.lib.destsafety`` accepts it (else exit 2)."""
    field = req.get("dest_field") or "%s.dest" % what
    dest = resolve_dest(req.get("dest"), field)
    return dest, check_dest(dest, field, workspace(req.get("workspace")), req.get("venv"))


def open_manifest(dest, source, field="dest"):
    """Create/open dest (0755, no symlinks), its .dfo/ (0700), take the lock, load the manifest."""
    try:
        tree = Tree(dest, open_dest(dest, field), field)
    except RemoteError:
        raise
    except OSError as exc:
        raise RemoteError("verify", "destination %s is not writable: %s" % (dest, exc.strerror or exc),
                          hint="choose a destination the SSH user may write, or fix its permissions") from None
    try:
        return Manifest(dest, source, tree, field).open()
    except BlockingIOError as exc:
        raise RemoteError("verify", str(exc.strerror or exc), hint="wait for it to end, or stop it") from None
    except OSError as exc:
        raise RemoteError("verify", "destination %s is not writable: %s" % (dest, exc.strerror or exc),
                          hint="choose a destination the SSH user may write, or fix its permissions") from None


def summary_names(out, key, names):
    """``key``: how many; ``key_files``: the first names, sorted."""
    out[key] = len(names)
    out[key + "_files"] = sorted(names)[:NAMES_SHOWN]
    return out


def check_space(dest, need, margin_pct, what):
    """Refuse before any byte moves when DEST's filesystem lacks room for ``need`` + margin."""
    want = int(need * (1.0 + float(margin_pct) / 100.0))
    st = os.statvfs(dest)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if want > free:
        raise RemoteError(
            "verify",
            "%s needs %s (%s to fetch + %g%% margin) on the filesystem of %s, which has %s free (of %s); "
            "nothing was transferred" % (what, human(want), human(need), margin_pct, dest, human(free), human(total)),
            hint="free space there, choose another destination, or lower the margin (model.margin_pct)",
            needed=want, available=free, total=total)
    return free


def make_client(req):
    mode = req.get("credentials_mode") or "controller"
    creds = req.get("credentials")
    if mode == "node":
        creds = node_credentials(req.get("profile"))
        if creds is None:
            raise RemoteError("verify", "s3.credentials is 'node' but this node has no AWS credentials "
                              "(environment, ~/.aws/credentials or an instance profile)",
                              hint="give the node credentials, or set s3.credentials: controller")
    try:
        return S3Client(req.get("endpoint_url"), req.get("region") or "us-east-1", creds)
    except ValueError as exc:
        raise RemoteError("config", "s3.endpoint_url: %s" % exc) from None


def list_source(client, bucket, prefix, skip_meta=False):
    """The objects under the prefix. ``skip_meta`` (restore of outputs): keys with a part starting with
    .dfo are dfo's bookkeeping there, skipped; otherwise such a key is refused."""
    objs = []
    try:
        for item in client.list_objects(bucket, prefix):
            key = item["key"]
            if key.endswith("/"):
                continue  # a "directory" marker
            rel = key[len(prefix):]
            parts = rel.split("/")
            if skip_meta and any(p.startswith(META_DIR) for p in parts):
                continue
            if any(p in ("", ".", "..", META_DIR) for p in parts) or "\0" in rel:
                raise RemoteError("verify", "s3://%s/%s: this key cannot be a file under the destination" % (
                    bucket, key), hint="rename the object, or sync a narrower prefix")
            objs.append(Obj(key, rel, item["size"], item["etag"]))
    except S3Error as exc:
        raise RemoteError(exc.kind, exc.described(), hint=exc.hint) from None
    return objs


def delete_extra(manifest, keep):
    """Remove the files this dest's manifest says dfo wrote and the source no longer has, while they are still
    what dfo wrote; then the folders that became empty. Never follows a symlink. Returns (deleted, kept)."""
    tree = manifest.tree
    deleted, kept, emptied = 0, [], set()
    for rel in sorted(manifest.written() - keep):
        st = tree.lstat(rel)
        if st is None:
            manifest.forget(rel)
            continue
        if not manifest.still_ours(rel, st):
            kept.append(rel)  # changed or replaced on the node since dfo wrote it: no longer dfo's
            manifest.forget(rel)
            continue
        reldir, name = tree.split(rel)
        try:
            os.unlink(name, dir_fd=tree.dir(reldir))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise RemoteError("verify", "cannot delete %s: %s"
                              % (os.path.join(manifest.dest, rel), exc.strerror)) from None
        manifest.forget(rel)
        deleted += 1
        emptied.add(reldir)
    for reldir in sorted(emptied, key=lambda d: -d.count("/")):
        while reldir:
            parent, name = tree.split(reldir)
            tree.drop(reldir)
            try:
                os.rmdir(name, dir_fd=tree.dir(parent))  # only when it became empty
            except OSError:
                break
            reldir = parent
    return deleted, kept


def sync(req):
    t0 = time.monotonic()
    source = req.get("source") or ""
    what = req.get("what") or "data"
    try:
        bucket, prefix = split_s3_url(source)
    except ValueError as exc:
        raise RemoteError("config", "%s.source: %s" % (what, exc)) from None
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    source = "s3://%s/%s" % (bucket, prefix)
    shown, dest = checked_dest(req, what)
    client = make_client(req)
    objs = list_source(client, bucket, prefix, skip_meta=bool(req.get("restore")))
    if not objs and req.get("restore"):  # outputs restore: nothing shipped there yet
        return {"source": source, "dest": shown, "endpoint": client.endpoint, "fetched": 0, "skipped": 0,
                "deleted": 0, "bytes": 0, "files_total": 0, "bytes_total": 0,
                "seconds": round(time.monotonic() - t0, 3),
                "mb_per_s": 0.0, "verified": {}, "changed": 0, "changed_files": [], "kept": 0, "kept_files": []}
    if not objs:
        raise RemoteError("verify", "no objects under %s (%s)" % (source, client.endpoint),
                          hint="check %s.source in the job file; nothing was changed on the node" % what)
    manifest = open_manifest(dest, source, req.get("dest_field") or "%s.dest" % what)
    stop = threading.Event()
    kept = []
    try:
        keep = {o.rel for o in objs}
        for rel in sorted(keep | (manifest.written() - keep if req.get("delete") else set())):
            manifest.tree.check(rel)  # a symlinked or foreign folder on the way: refused before any change
        todo = [o for o in objs if not manifest.present(o.rel, o.size, o.etag)]
        need = sum(o.size for o in todo)
        if req.get("check_space", True) and todo:
            check_space(shown, need, req.get("margin_pct") or 0, source)
        progress = Progress(len(todo), need, stop)
        progress.emit("plan", source=source, dest=shown, files_total=len(objs), bytes_total=sum(o.size for o in objs),
                      to_fetch=len(todo), bytes_to_fetch=need, skipped=len(objs) - len(todo))
        error, interrupted = None, None
        if todo:
            engine = Engine(client, bucket, manifest, int(req.get("concurrency") or 32),
                            int(req.get("part_size_mb") or 16) * MIB,
                            int(req.get("multipart_threshold_mb") or 64) * MIB, progress, stop)
            with Signals(stop) as sigs:
                progress.start(hooks=[manifest.sync])
                error = engine.run(todo)
                progress.finish()
                interrupted = sigs.got
        if error is not None:
            kind, message, hint = describe_failure(error[0], error[1], shown, bucket, client.endpoint)
            raise RemoteError(kind, message, hint=hint, fetched=progress.files, object=error[1].key)
        if interrupted or progress.broken:
            raise RemoteError("interrupted", "interrupted by %s after %d of %d files; the next run resumes"
                              % (interrupted or "a closed connection", progress.files, len(todo)))
        deleted = 0
        if req.get("delete"):
            deleted, kept = delete_extra(manifest, keep)
    finally:
        try:
            manifest.close()
        except OSError:
            pass  # the journal stays; the next run folds it in
    seconds = time.monotonic() - t0
    out = {"source": source, "dest": shown, "endpoint": client.endpoint, "fetched": progress.files,
           "skipped": len(objs) - len(todo), "deleted": deleted, "bytes": progress.bytes,
           "files_total": len(objs), "bytes_total": sum(o.size for o in objs), "seconds": round(seconds, 3),
           "mb_per_s": round(progress.bytes / 1e6 / seconds, 1) if seconds > 0 else 0.0,
           "verified": progress.verified, "free_after": free_bytes(dest)}
    summary_names(out, "changed", manifest.changed)
    return summary_names(out, "kept", kept)


def entry():
    """The run: ``python3 -m remote.transfer.sync``, or the controller's ``-c`` launch (agent.module_command)."""
    main(sync)


if __name__ == "__main__":
    entry()
