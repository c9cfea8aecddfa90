"""The queue's ops on the node (python3 3.8+, stdlib only): submit, queue, cancel (``python3 -m remote.runs``).

The queue itself, its files and its rule: remote/runs/queue.py. Here the three requests the laptop sends:

* ``submit``: the run's launch request (remote/runs/ops.py LaunchRequest, uploads with their content) and
  ``gpus``, ``node_gpus``, ``code``. The code the laptop has just pushed to code.dest is copied into the
  run's own folder (each file checked against the laptop's sha256 as it is copied: a push from elsewhere
  meanwhile is caught, ``code_changed``), run.upload's files beside it; then, under the lock, the entry
  gets its number and the queue moves on: the reply says whether the run started (and on which GPUs) or
  waits (its position).
* ``queue``: the queue moved on (a supervisor killed from outside starts no successor: looking does), then
  the GPUs, the running runs and the queued ones in order, with how long each has waited.
* ``cancel``: a queued run leaves the queue (its secrets and code with it); a running one is stopped as
  ``dfo stop`` stops it (its supervisor then moves the queue on).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time

from remote._proto import RemoteError
from remote.lib import fsutil
from remote.runs import gpuslots
from remote.runs import record as rec
from remote.runs.ops import RUN_ID_PATTERN, runs_root, workspace_of
from remote.runs.queue import (
    ENTRIES,
    ENTRY,
    SECRET,
    SECRET_KEYS,
    STATE,
    Lock,
    _advance,
    _entries,
    _prepare,
    _running,
    _state,
    queue_dir,
    view,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Set, Tuple

    from remote.runs.queue import CancelRequest, CodeSnapshot, SubmitReply, SubmitRequest

CHUNK = 1 << 20


def _bad_rel(rel: str) -> bool:
    parts = rel.split("/")
    return not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts)


def _snapshot(code: CodeSnapshot, into: str) -> None:
    """Copy the pushed tree (``code["files"]``: the laptop's view of it) from code.dest into ``into``."""
    src = fsutil.node_path(code["dest"])
    os.mkdir(into, 0o755)
    for rel in sorted(code.get("files") or {}):
        sha, mode, link = (list(code["files"][rel]) + [None, None, None])[:3]
        if _bad_rel(rel):
            raise RemoteError("usage", "code: a bad path in the tree: %r" % rel)
        dst = os.path.join(into, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if link is not None:
            os.symlink(link, dst)
            continue
        h = hashlib.sha256()
        try:
            fd = os.open(os.path.join(src, rel), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise RemoteError("verify", "code.dest %s: %s: %s (changed since the push?)" % (src, rel, exc.strerror),
                              hint="submit again", code_changed=True) from None
        with os.fdopen(fd, "rb") as f, open(dst, "wb") as out:
            for block in iter(lambda: f.read(CHUNK), b""):
                h.update(block)
                out.write(block)
        if h.hexdigest() != sha:
            raise RemoteError("verify", "code.dest %s: %s is not what this submit pushed (another push into it "
                              "meanwhile?)" % (src, rel), hint="submit again", code_changed=True)
        os.chmod(dst, (mode or 0o644) & 0o777)


def _keep_uploads(uploads: List[Dict[str, Any]], into: str) -> List[Dict[str, Any]]:
    """run.upload's files (their content came with the request) kept by name, each checked."""
    import base64

    os.mkdir(into, 0o700)
    kept: List[Dict[str, Any]] = []
    for u in uploads:
        data = base64.b64decode(u.get("content_b64") or "")
        if hashlib.sha256(data).hexdigest() != u.get("sha256"):
            raise RemoteError("verify", "run.upload %s: content does not match its sha256" % u.get("path"))
        name = os.path.basename(u["path"])
        if name in ("", ".", ".."):
            raise RemoteError("usage", "run.upload: a bad name %r" % u.get("path"))
        with open(os.path.join(into, name), "wb") as f:
            f.write(data)
        kept.append({"path": name, "sha256": u["sha256"], "mode": u.get("mode", 0o644)})
    return kept


def _node_gpus(req: Dict[str, Any], st: Dict[str, Any], smi: Tuple[Optional[int], Set[int]]) -> Tuple[int, str]:
    """(count, from): the inventory's, else nvidia-smi's, else what the queue knew, else 0."""
    ng = req.get("node_gpus")
    if isinstance(ng, int) and not isinstance(ng, bool) and ng >= 0:
        return ng, "inventory"
    if smi[0] is not None:
        return smi[0], "nvidia-smi"
    if st.get("gpus_from") in ("inventory", "nvidia-smi") and isinstance(st.get("gpus"), int):
        return st["gpus"], st["gpus_from"]
    return 0, "none"


def _set_gpus(q: str, req: Dict[str, Any], smi: Tuple[Optional[int], Set[int]]) -> Dict[str, Any]:
    st = _state(q)
    total, src = _node_gpus(req, st, smi)
    if st.get("gpus") != total or st.get("gpus_from") != src:
        st.update(gpus=total, gpus_from=src)
        rec.write_json(os.path.join(q, STATE), st)
    return st


def submit(request: SubmitRequest) -> SubmitReply:
    import re

    req: Dict[str, Any] = dict(request)
    rid = req.get("run_id") or ""
    if not re.match(RUN_ID_PATTERN, rid):
        raise RemoteError("usage", "bad run id %r" % rid)
    workspace, q = _prepare(req)
    req = dict(req, workspace=workspace, workdir=fsutil.node_path(req["workdir"]))
    if isinstance(req.get("outputs"), dict):
        req["outputs"] = dict(req["outputs"], path=fsutil.node_path(req["outputs"].get("path")))
    if "CUDA_VISIBLE_DEVICES" in (req.get("env") or {}) or "CUDA_VISIBLE_DEVICES" in (req.get("secret_env") or {}):
        raise RemoteError("usage", "run.env sets CUDA_VISIBLE_DEVICES: the queue hands GPUs out itself",
                          hint="take it out of run.env; set run.gpus to the number of GPUs the run needs")
    need = req.get("gpus")
    tmp = os.path.join(q, ENTRIES, ".new-%s-%d" % (rid, os.getpid()))
    os.mkdir(tmp, 0o700)
    try:
        entry = {"v": 1, "run": rid, "job": req.get("job"), "gpus": need, "submitted_by": req.get("submitted_by")}
        code = req.get("code")
        if isinstance(code, dict):
            _snapshot(code, os.path.join(tmp, "code"))  # type: ignore[arg-type]
            entry["code"] = {"workdir": code.get("workdir")}
        uploads = _keep_uploads(req.get("uploads") or [], os.path.join(tmp, "uploads"))
        secrets = dict((k, req[k]) for k in SECRET_KEYS if req.get(k))
        keep = dict((k, v) for k, v in req.items() if k not in SECRET_KEYS + ("code", "node_gpus", "op"))
        keep["uploads"] = uploads
        if secrets:  # the node's disk, 0600, until the run starts or leaves the queue (docs/queue.md)
            rec.write_json(os.path.join(tmp, SECRET), secrets)
        with Lock(q):
            smi = gpuslots.smi_view()
            st = _set_gpus(q, req, smi)
            total = st["gpus"]
            if need is not None and need > total:
                raise RemoteError("usage", "the run needs %d GPUs and this node has %d (%s)"
                                  % (need, total, _gpus_from_words(st.get("gpus_from"))),
                                  hint="lower run.gpus, or submit to a bigger node", too_big=True)
            if os.path.lexists(os.path.join(runs_root(req), rid)) or os.path.lexists(os.path.join(q, ENTRIES, rid)):
                raise RemoteError("usage", "run id %s exists already here" % rid)
            st["seq"] = seq = int(st.get("seq") or 0) + 1
            rec.write_json(os.path.join(q, STATE), st)
            now = time.time()
            entry.update(seq=seq, submitted=rec.now_iso(now), submitted_ts=now, request=keep)
            rec.write_json(os.path.join(tmp, ENTRY), entry)
            os.rename(tmp, os.path.join(q, ENTRIES, rid))
            started = dict(_advance(workspace, q, smi))
            reply: Dict[str, Any] = {"run": rid, "needs": total if need is None else need, "node_gpus": total,
                                     "gpus_from": st.get("gpus_from"),
                                     # the ids only: the laptop notes how its earlier submits here stand
                                     "queued_ids": [x[1] for x in _entries(q)],
                                     "running_ids": [x[0] for x in _running(workspace)]}
            if rid in started:
                reply.update(state="running", gpus=started[rid], position=None)
            else:
                ids = [e[1] for e in _entries(q)]
                if rid in ids:
                    reply.update(state="queued", gpus=None, position=ids.index(rid) + 1)
                else:  # it could not start: its failed record says why
                    end = rec.read_json(os.path.join(runs_root(req), rid, rec.END)) or {}
                    reply.update(state="failed", gpus=None, position=None, error=end.get("error"))
            return reply  # type: ignore[return-value]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gpus_from_words(src: Optional[str]) -> str:
    return {"inventory": "the inventory's gpus:", "nvidia-smi": "nvidia-smi's count"}.get(src or "",
                                                                                         "no gpus: in the inventory "
                                                                                         "and no nvidia-smi")


def queue(req: Dict[str, Any]) -> Dict[str, Any]:
    workspace = workspace_of(req)
    now = time.time()
    if not os.path.isdir(workspace):  # no run here yet: nothing to lock, nothing made by looking
        smi = gpuslots.smi_view()
        total, src = _node_gpus(req, {}, smi)
        return {"gpus": total, "gpus_from": src, "free": gpuslots.free_gpus(total, set(), smi[1]),
                "busy_other": sorted(smi[1]), "held": [], "running": [], "queued": [], "now": now, "started_now": []}
    _, q = _prepare(req)
    with Lock(q):
        smi = gpuslots.smi_view()
        st = _set_gpus(q, req, smi)
        started = _advance(workspace, q, smi)
        total, running, held, busy, free = view(workspace, q, smi)
        entries = _entries(q)
    now = time.time()
    run_rows = []
    for rid, meta in running:
        qd = meta.get("queue") or {}
        run_rows.append({"id": rid, "job": meta.get("job"), "gpus": meta.get("gpus") if "gpus" in meta else None,
                         "from_queue": "gpus" in meta, "started": meta.get("started"),
                         "started_ts": meta.get("started_ts"), "pid": meta.get("pid"),
                         "waited_s": qd.get("waited_s"), "submitted": qd.get("submitted")})
    rows = []
    for pos, (seq, rid, _, e) in enumerate(entries, 1):
        need = e.get("gpus")
        rows.append({"id": rid, "job": e.get("job"), "needs": total if need is None else need, "position": pos,
                     "seq": seq, "submitted": e.get("submitted"), "submitted_ts": e.get("submitted_ts"),
                     "waiting_s": round(now - float(e.get("submitted_ts") or now), 1),
                     "submitted_by": e.get("submitted_by")})
    return {"gpus": total, "gpus_from": st.get("gpus_from"), "free": free, "busy_other": sorted(busy - held),
            "held": sorted(held), "running": run_rows, "queued": rows, "now": now,
            "started_now": [{"id": r, "gpus": g} for r, g in started]}


def cancel(req: CancelRequest) -> Dict[str, Any]:
    want = req.get("run")
    if not want or not str(want).strip():
        raise RemoteError("usage", "the run id is empty", hint="give a run id or its unique prefix")
    workspace = workspace_of(req)
    q = queue_dir(workspace)
    if os.path.isdir(os.path.join(q, ENTRIES)):
        with Lock(q):
            entries = _entries(q)
            hits = [e for e in entries if e[1] == want] or [e for e in entries if e[1].startswith(want)]
            if len(hits) > 1:
                raise RemoteError("usage", "run %r is ambiguous: %s" % (want, ", ".join(e[1] for e in hits[:5])),
                                  hint="give more of the id")
            if hits:
                seq, rid, d, e = hits[0]
                position = [x[1] for x in entries].index(rid) + 1
                shutil.rmtree(d)  # its secrets and its code go with it
                started = _advance(workspace, q)
                return {"run": rid, "job": e.get("job"), "was": "queued", "state": "cancelled", "position": position,
                        "started_now": [{"id": r, "gpus": g} for r, g in started]}
    runs = rec.list_runs(runs_root({"workspace": workspace}))
    hits = [r for r in runs if r[1] == want] or [r for r in runs if r[1].startswith(want)]
    if not hits:
        raise RemoteError("usage", "no queued or started run %r here" % want, hint="dfo queue -H HOST lists them",
                          missing=True)
    if len(hits) > 1:
        raise RemoteError("usage", "run %r is ambiguous: %s" % (want, ", ".join(r[1] for r in hits[:5])),
                          hint="give more of the id")
    rid, run_dir = hits[0][1], hits[0][2]
    state, meta, _ = rec.run_state(run_dir)
    if req.get("only_queued") or state != "running":
        return {"run": rid, "job": (meta or {}).get("job"), "was": state, "state": state, "position": None}
    from remote.runs.ops import stop

    info = stop({"op": "stop", "workspace": workspace, "run": rid, "grace": req.get("grace")})
    return {"run": rid, "job": info.get("job"), "was": "running", "state": info.get("state"), "position": None,
            "stop": info.get("stop"), "stop_seconds": info.get("stop_seconds")}


OPS = {"submit": submit, "queue": queue, "cancel": cancel}
