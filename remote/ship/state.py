"""RUN_DIR/outputs.json: the outputs shipper's record (python3 3.8+, stdlib only), written atomically.

Read by ``dfo status``, ``dfo outputs`` and ``tail`` (through ``remote.runs``); its shape is in
docs/outputs.md and the internal contract. A restarted shipper, or a pass made in another process,
goes on counting from what is there.
"""
from __future__ import annotations

import datetime
import json
import os
import time

from remote.lib.fsutil import write_atomic

OUTPUTS_JSON = "outputs.json"
ERRORS_KEPT = 5
ENDED = ("done", "failed")


def iso(ts=None):
    return datetime.datetime.fromtimestamp(ts if ts is not None else time.time(), datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


class State:
    """RUN_DIR/outputs.json: read once (a restarted shipper goes on counting), written atomically."""

    def __init__(self, run_dir, spec):
        self.path = os.path.join(run_dir, OUTPUTS_JSON)
        doc = {}
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError):
            doc = {}
        if not isinstance(doc, dict):
            doc = {}
        self.pid = None  # set by the shipper process; a pass run elsewhere keeps the recorded pid
        self.ended = doc.get("state") in ENDED  # after the last pass: a later pass does not undo that
        self.doc = {"pid": doc.get("pid"), "state": doc.get("state") or "idle", "dest": spec.get("dest"),
                    "path": spec.get("path"),
                    "every": spec.get("every"), "passes": int(doc.get("passes") or 0),
                    "failed_passes": int(doc.get("failed_passes") or 0), "last_pass": doc.get("last_pass"),
                    "final": doc.get("final"), "shipped": doc.get("shipped") or {"files": 0, "bytes": 0},
                    "pending": doc.get("pending") or 0, "lag_s": doc.get("lag_s"),
                    "errors": list(doc.get("errors") or [])[-ERRORS_KEPT:]}

    def write(self, **changes):
        self.doc.update(changes)
        if self.pid is not None:
            self.doc["pid"] = self.pid
        data = json.dumps(self.doc, sort_keys=True, indent=1, default=str) + "\n"
        write_atomic(self.path, data.encode("utf-8"), 0o644)

    def passed(self, p, lag, final):
        d = self.doc
        shipped = {"files": d["shipped"]["files"] + p["files"], "bytes": d["shipped"]["bytes"] + p["bytes"]}
        errors = d["errors"]
        if p["error"]:
            errors = (errors + [{"at": p["ended"], "error": p["error"]}])[-ERRORS_KEPT:]
        state = ("done" if p["ok"] else "failed") if final else (d["state"] if self.ended else "idle")
        self.ended = self.ended or final
        self.write(state=state, passes=d["passes"] + 1, failed_passes=d["failed_passes"] + (0 if p["ok"] else 1),
                   last_pass=p, final=p if final else d.get("final"), shipped=shipped, pending=p["pending"],
                   lag_s=lag, errors=errors)
