"""The run's own record beside its checkpoints (python3 3.8+, stdlib only): with outputs.dest, the
supervisor's thread puts RUN_DIR/log and RUN_DIR/metrics.jsonl beside the dest folder: for a dest of
``s3://b/ckpt/`` at ``s3://b/ckpt.dfo-runs/RUN_ID/log`` and ``.../metrics.jsonl`` (at the bucket's
root, ``.dfo-runs/RUN_ID/``), every outputs.every seconds (10 at least, 60 at most) when they changed,
and once more after the run ended, once the shipper has made a pass that worked, so ``dfo tail
--from-s3`` and ``dfo plot --from-s3`` read a run whose node is gone.

Outside dest, so dest holds outputs.path's files alone and restore never brings these back (at a
bucket's root, restore skips keys with a part starting with ``.dfo``: remote/transfer/sync.py). The
log is put whole up to ``LOG_MAX`` (32 MiB), else its last 32 MiB (metrics.jsonl stays under 8 MiB by
itself). The credentials are the shipper's (stdin only); this thread holds them in memory until its
last put. It never creates the bucket (a HEAD first: some S3 servers make a bucket on a put, which
would hide a wrong outputs.dest from the shipper). It never fails the run: a failed put is tried
again next time and the last error is kept in RUN_DIR/runship.json (no credentials in it).
"""
import os
import threading
import time
from typing import Any, Dict, Optional

from remote.runs.record import OUTPUTS, now_iso, read_json, write_json

LOG_MAX = 32 << 20
MIN_EVERY = 10.0  # seconds between puts at least, however small outputs.every is
FILES = ("log", "metrics.jsonl")
RECORD = "runship.json"


def key_prefix(dest, run_id):
    from remote.s3.client import split_s3_url

    bucket, prefix = split_s3_url(dest or "")
    prefix = prefix.rstrip("/")
    return bucket, "%s.dfo-runs/%s/" % (prefix, run_id)  # beside dest, not in it: dest holds outputs.path alone


class RunFilesShip(object):
    def __init__(self, run_dir: str, run_id: str, spec: Dict[str, Any], credentials: Optional[Dict[str, Any]]) -> None:
        self.run_dir, self.every = run_dir, float(spec.get("every") or 300)
        self.bucket, self.prefix = key_prefix(spec.get("dest"), run_id)
        self.client_spec = dict(spec, credentials=credentials)
        self.client: Any = None
        self.bucket_ok = False
        self.sent: Dict[str, Any] = {}
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dfo-runship", daemon=True)
        self.doc: Dict[str, Any] = {"dest": "s3://%s/%s" % (self.bucket, self.prefix), "puts": 0, "error": None}

    def start(self):
        self.thread.start()
        return self

    def finish(self, timeout=120.0):
        """After the run ended: one last put of whatever changed."""
        self.stop_ev.set()
        self.thread.join(timeout)
        self.put_changed()
        self.client_spec = {}  # the credentials go with the last put

    def _loop(self):
        while not self.stop_ev.wait(min(max(self.every, MIN_EVERY), 60.0)):
            self.put_changed()

    def _shipper_ok(self):
        """The shipper made a pass that worked (outputs.json): the endpoint, the keys and the bucket are good."""
        doc = read_json(os.path.join(self.run_dir, OUTPUTS)) or {}
        return int(doc.get("passes") or 0) > int(doc.get("failed_passes") or 0)

    def put_changed(self):
        if not self.client_spec or not self._shipper_ok():
            return
        for name in FILES:
            path = os.path.join(self.run_dir, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            mark = (st.st_size, st.st_mtime_ns)
            if self.sent.get(name) == mark:
                continue
            try:
                with open(path, "rb") as f:
                    if st.st_size > LOG_MAX:
                        f.seek(st.st_size - LOG_MAX)
                    body = f.read(LOG_MAX)
                if self.client is None:
                    from remote.transfer.sync import make_client

                    self.client = make_client(self.client_spec)
                if not self.bucket_ok:  # never made by a put here (some servers create a bucket on a put)
                    head = self.client.request("HEAD", self.bucket)
                    head.read()
                    if head.status // 100 != 2:
                        raise OSError("bucket %s: HTTP %d" % (self.bucket, head.status))
                    self.bucket_ok = True
                resp = self.client.request("PUT", self.bucket, self.prefix + name, body=body,
                                           headers={"content-type": "text/plain"})
                resp.read()
                if resp.status // 100 != 2:
                    raise OSError("HTTP %d" % resp.status)
                self.sent[name] = mark
                self.doc.update(puts=self.doc["puts"] + 1, last_put=now_iso(), error=None)
            except Exception as exc:  # noqa: BLE001 -- never the run's end; the next pass tries again
                why = str(exc) if isinstance(exc, OSError) and str(exc).startswith(("HTTP", "bucket")) else ""
                self.doc.update(error="%s %s: %s" % (now_iso(), name, why or type(exc).__name__), error_ts=time.time())
                break  # the same trouble for the other file: next time
        try:
            write_json(os.path.join(self.run_dir, RECORD), self.doc)
        except OSError:
            pass
