"""Outputs shipping on the node (python3 3.8+, stdlib only): new and changed files under outputs.path to
outputs.dest, on schedule, while the run lives (issue 12; docs/outputs.md).

``run_pass(spec, run_dir, final=False, stop=None) -> PASS``: one pass; RUN_DIR/outputs.json is written
(atomically) when it starts ("state": "shipping") and when it ends.

``python3 -m remote.ship.shipper RUN_DIR``: the long-lived shipper. It reads ONE JSON line on stdin (the
spec, credentials included: they stay in this process's memory alone) and keeps stdin open. A pass at
once, then one every ``every`` seconds; a line ``ship`` on stdin, or SIGUSR1, asks for a pass now; a line
``final`` or the end of stdin asks for the last pass, after which it exits (0 when the last pass was
ok, 1 when not). SIGTERM: the objects being sent are finished or their multipart uploads aborted, the
pass is recorded, and it exits 1 (state "failed": the last pass did not run). It prints one line per
pass that shipped something or failed (the supervisor puts it in the run's log).
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Set, Tuple

from remote._proto import RemoteError
from remote.lib.destsafety import open_meta
from remote.lib.fsutil import FILE_FLAGS, human_bytes
from remote.lib.retry import Stopped, retry
from remote.runs import generation
from remote.s3.client import S3Error, split_s3_url
from remote.s3.upload import MIB, CpuGovernor, Uploader, abort_upload, local_etag, open_uploads, part_size_for
from remote.ship.scan import Includer, OpenUploads, Shipped, open_for_writing, renamed, scan, settled
from remote.ship.state import ENDED, ERRORS_KEPT, OUTPUTS_JSON, State, iso  # noqa: F401 - re-exported

FIELD = "outputs.path"
HEAD_AT_MOST = 32  # files not yet in shipped.json: up to this many are looked up with a HEAD each, else a listing
FINAL_WAIT_STEP_S = 0.5


def make_client(spec):
    from remote.transfer.sync import make_client as _make  # the same client sync-data builds

    return _make(spec)


def dest_parts(dest):
    bucket, prefix = split_s3_url(dest or "")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


class Shipper:
    def __init__(self, spec, run_dir, stop=None):
        self.spec = spec
        self.run_dir = run_dir
        self.stop = stop or threading.Event()
        self.root = os.path.normpath(spec.get("path") or "")
        self.dest = spec.get("dest")
        self.state = State(run_dir, spec)
        self.client = None
        self.governor = CpuGovernor(float(2.0 if spec.get("cpu") is None else spec["cpu"]), stop=self.stop)

    def _client(self):
        if self.client is None:
            self.client = make_client(self.spec)
        return self.client

    def run_pass(self, final=False):
        started = time.time()
        t0 = time.monotonic()
        self.state.write(**({} if self.state.ended and not final else {"state": "shipping"}))
        p = {"n": self.state.doc["passes"] + 1, "started": iso(started), "final": bool(final), "ok": True,
             "files": 0, "bytes": 0, "skipped": 0, "pending": 0, "changed_during": 0, "error": None}
        lag = 0.0
        try:
            lag = self._pass(p, final)
        except Stopped:
            p.update(ok=False, error="stopped (SIGTERM) during the pass")
        except generation.Superseded as exc:  # an old generation: nothing uploaded, its trainer told to stop
            p.update(ok=False, error=str(exc), superseded=exc.generation)
        except RemoteError as exc:  # outputs.path/.dfo refused (remote.lib.destsafety.open_meta): nothing written
            hint = exc.extra.get("hint")
            p.update(ok=False, error=exc.message + ("; %s" % hint if hint else ""))
        except S3Error as exc:
            p.update(ok=False, error=exc.described())
        except OSError as exc:
            p.update(ok=False, error="%s: %s" % (getattr(exc, "filename", None) or self.root, exc.strerror or exc))
        except Exception as exc:  # noqa: BLE001 - a pass never kills the run; the next one tries again
            p.update(ok=False, error="%s: %s" % (type(exc).__name__, exc))
        seconds = time.monotonic() - t0
        p.update(ended=iso(), seconds=round(seconds, 3),
                 mb_per_s=round(p["bytes"] / 1e6 / seconds, 1) if seconds > 0 else 0.0)
        p["status"] = "failed" if not p["ok"] else ("shipped" if p["files"] else "no change")
        self.state.passed(p, lag, final)
        return p

    def _pass(self, p, final):
        if not self.dest:
            return 0.0
        bucket, prefix = dest_parts(self.dest)
        if not os.path.isdir(self.root):
            return 0.0  # nothing written yet
        settle = float(self.spec.get("settle") if self.spec.get("settle") is not None else 10)
        includer = Includer(self.spec.get("include"))
        # PATH/.dfo: never through a symlink, this user's, nobody else may write it; all under it by its fd
        meta_fd = open_meta(self.root, FIELD)
        try:
            lock_fd = os.open("ship.lock", os.O_RDWR | os.O_CREAT | FILE_FLAGS, 0o600, dir_fd=meta_fd)
        except BaseException:
            os.close(meta_fd)
            raise
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # one pass at a time on this path (shipper, or dfo outputs --ship)
            journal = OpenUploads(meta_fd)
            self._abort_left(journal)
            shipped = Shipped(meta_fd).load()
            ready, pending = self._ready(includer, shipped, prefix, settle, final, p)
            shipped.files = {rel: e for rel, e in shipped.files.items() if rel in self._seen}  # gone: forgotten
            p["pending"] = len(pending)
            if ready:
                self._check_bucket(bucket)
            todo = self._not_in_dest(ready, shipped, bucket, prefix, p)
            results = []
            if todo:
                generation.fence(self._client(), bucket, prefix, self.spec, self.run_dir)  # issue 20
                mine = self.spec.get("generation")  # a run that recovers: each upload conditional too
                up = Uploader(self._client(), bucket, int(self.spec.get("concurrency") or 8),
                              int(self.spec.get("part_size_mb") or 16) * MIB,
                              int(self.spec.get("multipart_threshold_mb") or 64) * MIB,
                              stop=self.stop, governor=self.governor, journal=journal,
                              guard=generation.WriteGuard(self._client(), bucket, mine) if mine else None)
                items = [{"path": os.path.join(self.root, rel), "key": prefix + rel, "size": st.st_size}
                         for rel, st in todo]
                results = up.upload(items)
            errors, oldest, refused = [], None, None
            for (rel, st), res in zip(todo, results):
                refused = refused or res.get("refused")
                if res["ok"]:
                    shipped.record(rel, st, res["key"], res["etag"], res["sha256"])
                    p["files"] += 1
                    p["bytes"] += res["size"] or 0
                    continue
                oldest = st.st_mtime if oldest is None else min(oldest, st.st_mtime)
                if res["changed"]:
                    p["changed_during"] += 1
                else:
                    errors.append(res["error"])
            shipped.save()
        finally:
            os.close(lock_fd)
            os.close(meta_fd)
        if isinstance(refused, generation.Superseded):  # a newer generation's object where this one would write
            generation.stop_trainer(self.run_dir, "superseded by generation %d" % refused.generation)
            raise refused
        if self.stop.is_set():
            raise Stopped()
        if errors:
            more = " (and %d more failed)" % (len(errors) - 1) if len(errors) > 1 else ""
            p.update(ok=False, error=errors[0] + more)
        return round(max(0.0, time.time() - oldest), 3) if oldest is not None else 0.0

    def _ready(self, includer, shipped, prefix, settle, final, p):
        """(files to ship now, files still settling) among those not shipped as they are."""
        cache: List[Set[Tuple[int, int]]] = []

        def open_w():
            if not cache:
                cache.append(open_for_writing())
            return cache[0]

        while True:
            ready, pending = [], []
            now = time.time_ns()
            inodes: Dict[Tuple[int, int], str] = {}
            found = scan(self.root, includer, inodes)
            before, self._inodes = getattr(self, "_inodes", None), inodes
            before_names = set(before.values()) if before else set()
            self._seen = {rel for rel, _ in found}
            for rel, st in found:
                if shipped.current(rel, st, prefix + rel):
                    continue
                moved = renamed(rel, st, before, before_names)
                if settled(st, now, settle, open_w, moved) or (final and (st.st_dev, st.st_ino) not in open_w()):
                    ready.append((rel, st))
                else:
                    pending.append((rel, st))
            if not (final and pending) or self.stop.is_set():
                return ready, pending
            # the last pass: a file still open for writing after the run ended may settle soon
            waited = getattr(self, "_final_waited", 0.0)
            if waited >= settle:
                return ready, pending
            self.stop.wait(FINAL_WAIT_STEP_S)
            self._final_waited = waited + FINAL_WAIT_STEP_S
            cache.clear()

    def _not_in_dest(self, ready, shipped, bucket, prefix, p):
        """Files not in shipped.json at all (a fresh node after restore) that the dest already holds, byte
        for byte, are recorded and not sent: same size and the ETag this engine would give them (same
        part size), or, when the ETag is another tool's, the same sha256 as the object's x-amz-meta-sha256."""
        unknown = [(rel, st) for rel, st in ready if rel not in shipped.files]
        if not unknown:
            return ready
        look: Callable[[str], Any]  # key -> {size, etag, sha256?} or None
        if len(unknown) > HEAD_AT_MOST:  # many (a restore put them back): one listing
            try:
                listed = {o["key"]: o for o in self._client().list_objects(bucket, prefix, stop=self.stop)}
            except S3Error as exc:
                if exc.status != 403:
                    raise
                listed = {}  # credentials that may write but not list: nothing to compare with, all is sent
            look = listed.get
        else:  # a few new files (a checkpoint): a HEAD each, not a listing of every object the run shipped
            look = lambda key: self._head(bucket, key)  # noqa: E731
        same = set()
        psize = int(self.spec.get("part_size_mb") or 16) * MIB
        for rel, st in unknown:
            obj = look(prefix + rel)
            if obj is None or obj["size"] != st.st_size:
                continue
            path = os.path.join(self.root, rel)
            etag = obj["etag"].lower()
            parts = etag.rsplit("-", 1)[1] if "-" in etag else None
            try:
                mine = None
                fsize = part_size_for(st.st_size, psize)
                if parts is None or (parts.isdigit() and int(parts) == max(1, -(-st.st_size // fsize))):
                    mine = local_etag(path, st.st_size, fsize, parts is not None, governor=self.governor)
                sha = None
                if mine != etag:
                    sha = obj.get("sha256") if "sha256" in obj else self._meta_sha256(bucket, prefix + rel)
                    if not sha or sha != _file_sha256(path, self.governor):
                        continue
                shipped.record(rel, st, prefix + rel, etag, sha)
                same.add(rel)
                p["skipped"] += 1
            except OSError:
                continue
        return [(rel, st) for rel, st in ready if rel not in same]

    def _abort_left(self, journal):
        """Multipart uploads a shipper that was killed left open: abort them now. An entry with no id was
        being created when it died: the uploads open for that key are asked for and aborted."""
        for b, k, uid in journal.left():
            ids = [uid] if uid else open_uploads(self._client(), b, k)
            if all(abort_upload(self._client(), b, k, i) is None for i in ids):
                journal.closed(b, k, uid)

    def _check_bucket(self, bucket):
        """The bucket must exist (some servers create a missing one on PUT: a typo in outputs.dest would
        ship into a bucket nobody looks at). Once per shipper; credentials that may not look (403) pass."""
        if getattr(self, "_bucket_ok", False):
            return
        client = self._client()

        def head():
            resp = client.request("HEAD", bucket, "", label="")
            resp.read()
            return resp.status

        status = retry(lambda: _status_or_raise(client, head, bucket), stop=self.stop)
        if status == 404:
            raise S3Error("verify", "%s: NoSuchBucket (HTTP 404): the bucket of outputs.dest does not exist"
                          % client.where(bucket), status=404, code="NoSuchBucket",
                          hint="create it, or fix outputs.dest in the job file")
        self._bucket_ok = True

    def _head(self, bucket, key):
        """{size, etag, sha256} of the object, or None when there is none (404)."""
        try:
            h = retry(lambda: self._client().head(bucket, key), stop=self.stop)
        except S3Error as exc:
            if exc.status in (403, 404):  # none, or credentials that may not read it: it is sent
                return None
            raise
        return {"size": int(h.get("content-length") or -1), "etag": (h.get("etag") or "").strip('"'),
                "sha256": (h.get("x-amz-meta-sha256") or "").strip().lower() or None}

    def _meta_sha256(self, bucket, key):
        try:
            return (self._client().head(bucket, key).get("x-amz-meta-sha256") or "").strip().lower() or None
        except S3Error:
            return None


def _status_or_raise(client, head, bucket):
    """HEAD's status when it says something about the bucket (200, 301, 403, 404); a retryable S3Error else."""
    status = head()
    if status in (500, 502, 503, 504, 429, 408):
        raise S3Error("unreachable", "%s: HTTP %d" % (client.where(bucket), status), status=status, retryable=True)
    return status


def _file_sha256(path, governor):
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            governor.throttle()
            data = f.read(4 * MIB)
            if not data:
                return h.hexdigest()
            h.update(data)


def run_pass(spec, run_dir, final=False, stop=None):
    """One pass now (in this process): the PASS summary; RUN_DIR/outputs.json updated."""
    return Shipper(spec, run_dir, stop).run_pass(final)


def describe(p, dest):
    if not p["ok"]:
        return "pass %d FAILED: %s" % (p["n"], p["error"])
    return "pass %d: shipped %d file%s (%s) to %s in %.1f s%s" % (
        p["n"], p["files"], "" if p["files"] == 1 else "s", human_bytes(p["bytes"]), dest, p["seconds"],
        ", %d waiting to settle" % p["pending"] if p["pending"] else "")


# --------------------------------------------------------------------------- the process


def serve(run_dir, stdin=None, out=None):
    stdin = stdin or sys.stdin.buffer
    out = out or sys.stdout
    line = stdin.readline()
    try:
        spec = json.loads(line.decode("utf-8") if isinstance(line, bytes) else line)
        if not isinstance(spec, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        out.write("dfo outputs: the shipper's spec on stdin is not valid JSON (%s); nothing ships\n" % exc)
        out.flush()
        return 2
    if spec.get("credentials") is None and isinstance(spec.get("outputs_credentials"), dict):
        spec["credentials"] = spec.pop("outputs_credentials")
    stop, wake, final = threading.Event(), threading.Event(), threading.Event()
    got = {}

    def on_term(signum, frame):
        got["term"] = True
        stop.set()
        wake.set()

    def on_usr1(signum, frame):
        wake.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGUSR1, on_usr1)

    def reader():
        try:
            for raw in stdin:
                word = (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw).strip()
                if word == "ship":
                    wake.set()
                elif word == "final":
                    break
        except (OSError, ValueError):
            pass
        final.set()
        wake.set()

    threading.Thread(target=reader, name="dfo-ship-stdin", daemon=True).start()
    shipper = Shipper(spec, run_dir, stop)
    every = max(float(spec.get("every") or 300), 0.05)
    shipper.state.pid = os.getpid()
    shipper.state.ended = False  # a (re)started shipper: the run's last pass is still to come
    shipper.state.write(state="idle")
    request = os.path.join(run_dir, "ship.request")
    while True:
        if not got.get("term"):
            last = final.is_set()
            wake.clear()
            try:
                os.unlink(request)
            except OSError:
                pass
            p = shipper.run_pass(final=last)
            if p["files"] or not p["ok"]:
                out.write(describe(p, spec.get("dest")) + "\n")
                out.flush()
            if last:
                return 0 if p["ok"] else 1
            deadline = time.monotonic() + every
            while not wake.is_set() and time.monotonic() < deadline:
                wake.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        if got.get("term"):
            err = "stopped by SIGTERM: the last pass did not run"
            errors = (shipper.state.doc["errors"] + [{"at": iso(), "error": err}])[-ERRORS_KEPT:]
            shipper.state.write(state="failed", errors=errors)
            out.write("%s\n" % err)
            out.flush()
            return 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        sys.stderr.write("usage: python3 -m remote.ship.shipper RUN_DIR (an existing folder), spec on stdin\n")
        return 2
    return serve(argv[0])


if __name__ == "__main__":
    sys.exit(main())
