"""The node's run queue (python3 3.8+, stdlib only): ``dfo submit``, ``dfo queue``, ``dfo cancel``.

No daemon keeps it: the queue is files beside the run records, under one lock, and whoever changes it
or ends a run moves it on. ``WORKSPACE/.dfo/queue/``:

* ``lock``: flock'd by submit, queue, cancel and a run's supervisor when its trainer has ended;
* ``state.json``: ``{"gpus": N, "gpus_from": "inventory"|"nvidia-smi"|"none", "seq": the last number given}``;
* ``entries/RUN_ID/``: one queued run: ``entry.json`` (the launch request without its secrets, ``seq``,
  ``gpus`` needed, when submitted), ``secret.json`` (0600: the request's secrets, only until the run starts
  or is cancelled), ``code/`` (the code as submitted), ``uploads/`` (run.upload's files as submitted);
* ``errors.log``: what went wrong when a supervisor moved the queue on (it never stops the supervisor).

``advance`` (under the lock) starts queued runs in submission order while the first one waiting fits in
the free GPUs (remote/runs/gpuslots.py): strict FIFO, head of line. A run that needs more GPUs than are
free blocks every run behind it, even ones that would fit: without knowing how long runs last, any run
let past it could take the GPUs it waits for, again and again (a 2-GPU run behind a stream of 1-GPU
runs would never start). Each start is a normal detached supervisor (remote.runs.ops._start), with
``CUDA_VISIBLE_DEVICES`` the GPUs it got; its meta.json keeps them (``gpus``) and the queue's record
(``queue``). A run that cannot start (its workdir cannot be made, ...) is recorded as a failed run with
the reason, and the queue goes on.
"""
from __future__ import annotations

import fcntl
import os
import time

from remote._proto import RemoteError
from remote.lib.destsafety import open_meta
from remote.runs import gpuslots
from remote.runs import record as rec
from remote.runs.ops import _start, runs_root, workspace_of

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Set, Tuple, TypedDict

    from remote.runs.ops import LaunchRequest

    class CodeSnapshot(TypedDict, total=False):
        dest: str  # code.dest on the node, as the push left it (~ expanded here)
        files: Dict[str, List[Any]]  # path -> [sha256, mode, link]: the laptop's tree, checked as it is copied
        workdir: Optional[str]  # run.workdir relative to code.dest ("" : the same folder), None: outside it

    class SubmitRequest(LaunchRequest, total=False):
        """``submit`` -> SubmitReply. LaunchRequest's fields (uploads with their content), and:"""
        gpus: Optional[int]  # GPUs the run needs (run.gpus); None: all of the node's
        node_gpus: Optional[int]  # the inventory's gpus: for the host; None: nvidia-smi's count
        code: Optional[CodeSnapshot]
        submitted_by: str

    class SubmitReply(TypedDict, total=False):
        run: str
        state: str  # "running" (started at once) | "queued" | "failed" (could not start)
        gpus: Optional[List[int]]  # the GPUs it got, when started
        position: Optional[int]  # 1: next to start
        needs: int
        node_gpus: int

    class CancelRequest(TypedDict, total=False):
        op: str
        workspace: str
        run: str  # an id or a unique prefix
        grace: Optional[float]  # a running run: as dfo stop
        only_queued: bool  # leave a run that has started alone (dfo submit --requeue-from)


QUEUE = "queue"
ENTRIES = "entries"
ENTRY = "entry.json"
SECRET = "secret.json"
STATE = "state.json"
SECRET_KEYS = ("secret_env", "outputs_credentials", "notify")
ERRORS_MAX = 256 * 1024


def queue_dir(workspace: str) -> str:
    return os.path.join(workspace, ".dfo", QUEUE)


def _prepare(req: Dict[str, Any]) -> Tuple[str, str]:
    """The workspace (made as launch makes it) and the queue's folder."""
    workspace = workspace_of(req)
    try:
        os.makedirs(workspace, exist_ok=True)
    except OSError as exc:
        raise RemoteError("config", "workspace %s: %s" % (workspace, exc.strerror),
                          hint="set workspace: (inventory or job) to a folder this user may write") from None
    os.close(open_meta(workspace, "workspace"))  # its .dfo: no symlink, this user's
    q = queue_dir(workspace)
    os.makedirs(q, mode=0o700, exist_ok=True)
    os.makedirs(os.path.join(q, ENTRIES), mode=0o700, exist_ok=True)
    os.makedirs(runs_root({"workspace": workspace}), exist_ok=True)
    return workspace, q


class Lock:
    """The queue's lock (fcntl.flock on ``lock``): one change of the queue at a time on this node."""

    def __init__(self, q: str) -> None:
        self.f = open(os.path.join(q, "lock"), "a")

    def __enter__(self) -> Lock:
        fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.f, fcntl.LOCK_UN)
        self.f.close()


def _state(q: str) -> Dict[str, Any]:
    st = rec.read_json(os.path.join(q, STATE))
    return st if isinstance(st, dict) else {}


def _entries(q: str) -> List[Tuple[int, str, str, Dict[str, Any]]]:
    """[(seq, run_id, folder, entry)] in submission order."""
    out: List[Tuple[int, str, str, Dict[str, Any]]] = []
    base = os.path.join(q, ENTRIES)
    try:
        names = os.listdir(base)
    except OSError:
        return out
    for name in names:
        if name.startswith("."):
            continue
        d = os.path.join(base, name)
        e = rec.read_json(os.path.join(d, ENTRY))
        if isinstance(e, dict):
            out.append((int(e.get("seq") or 0), name, d, e))
    out.sort()
    return out


def _running(workspace: str) -> List[Tuple[str, Dict[str, Any]]]:
    """[(run_id, meta)] of the dfo runs running in this workspace."""
    out: List[Tuple[str, Dict[str, Any]]] = []
    for _, rid, d in rec.list_runs(runs_root({"workspace": workspace})):
        state, meta, _ = rec.run_state(d)
        if state == "running":
            out.append((rid, meta or {}))
    return out


def _total(q: str, st: Optional[Dict[str, Any]] = None) -> int:
    st = _state(q) if st is None else st
    g = st.get("gpus")
    return g if isinstance(g, int) and not isinstance(g, bool) and g >= 0 else 0


def view(workspace: str, q: str, smi: Optional[Tuple[Optional[int], Set[int]]] = None
         ) -> Tuple[int, List[Tuple[str, Dict[str, Any]]], Set[int], Set[int], List[int]]:
    """(total, running [(id, meta)], held, busy, free) as this node stands now; ``smi``: smi_view()'s answer,
    when the caller asked it already."""
    total = _total(q)
    running = _running(workspace)
    held = gpuslots.held_by([m for _, m in running], total)
    busy = (smi if smi is not None else gpuslots.smi_view())[1]
    return total, running, held, busy, gpuslots.free_gpus(total, held, busy)


# --------------------------------------------------------------------------- moving the queue on


def advance(workspace: str) -> List[Tuple[str, List[int]]]:
    """Start the queued runs that fit, first come first served; takes the lock. [(run_id, gpus)] started."""
    q = queue_dir(workspace)
    if not os.path.isdir(os.path.join(q, ENTRIES)):
        return []
    with Lock(q):
        return _advance(workspace, q)


def _advance(workspace: str, q: str, smi: Optional[Tuple[Optional[int], Set[int]]] = None
             ) -> List[Tuple[str, List[int]]]:
    """advance, the lock held."""
    todo = _entries(q)
    if not todo:
        return []
    total, _, _, _, free = view(workspace, q, smi)
    started: List[Tuple[str, List[int]]] = []
    for _, rid, d, e in todo:
        need = e.get("gpus")
        need = total if need is None else int(need)
        if need > total:
            _fail(workspace, rid, d, e, "it needs %d GPUs and this node has %d" % (need, total))
            continue
        if need > len(free):
            break  # strict FIFO: nobody passes the run that waits (see the module's docstring)
        take, free = free[:need], free[need:]
        try:
            _start_entry(workspace, rid, d, e, take)
            started.append((rid, take))
        except Exception as exc:  # noqa: BLE001 -- this run's failure, recorded; the queue goes on
            why = exc.message if isinstance(exc, RemoteError) else "%s: %s" % (type(exc).__name__, exc)
            _fail(workspace, rid, d, e, why)
            free = sorted(free + take)
    return started


def _start_entry(workspace: str, rid: str, d: str, e: Dict[str, Any], gpus: List[int]) -> None:
    import shutil

    req = dict(e["request"])
    secrets = rec.read_json(os.path.join(d, SECRET)) or {}
    for k in SECRET_KEYS:
        if k in secrets:
            req[k] = secrets[k]
    run_dir = os.path.join(runs_root({"workspace": workspace}), rid)
    os.mkdir(run_dir)
    env = dict(req.get("env") or {})
    env.update(gpuslots.visible_env(gpus))
    code = e.get("code") or {}
    if os.path.isdir(os.path.join(d, "code")):
        snap = os.path.join(run_dir, "code")
        os.rename(os.path.join(d, "code"), snap)
        env["DFO_CODE_DIR"] = snap
        if code.get("workdir") is not None:
            req["workdir"] = os.path.join(snap, code["workdir"]) if code["workdir"] else snap
    req["env"] = env
    req["gpus"] = gpus
    now = time.time()
    req["queue"] = {"seq": e.get("seq"), "submitted": e.get("submitted"), "submitted_ts": e.get("submitted_ts"),
                    "waited_s": round(now - float(e.get("submitted_ts") or now), 3),
                    "submitted_by": e.get("submitted_by"), "code": env.get("DFO_CODE_DIR")}
    try:
        os.makedirs(req["workdir"], exist_ok=True)
    except OSError as exc:
        raise RemoteError("config", "run.workdir %s: %s" % (req["workdir"], exc.strerror)) from None
    uploads: List[Dict[str, Any]] = []
    if req.get("uploads"):  # run.upload's files as submitted, written as launch writes them
        import base64

        from remote.files.runfiles import sync_uploads

        ups = []
        for u in req["uploads"]:
            with open(os.path.join(d, "uploads", os.path.basename(u["path"])), "rb") as f:
                ups.append(dict(u, content_b64=base64.b64encode(f.read()).decode()))
        _, uploads = sync_uploads(req["workdir"], ups)
    _start(req, rid, run_dir, uploads)  # (removes run_dir when the trainer could not start)
    shutil.rmtree(d, ignore_errors=True)


def _fail(workspace: str, rid: str, d: str, e: Dict[str, Any], why: str) -> None:
    """A queued run that cannot start: a failed run record saying why (dfo status shows it), out of the queue."""
    import shutil

    run_dir = os.path.join(runs_root({"workspace": workspace}), rid)
    try:
        os.makedirs(run_dir, exist_ok=True)
        req = e.get("request") or {}
        now = time.time()
        with open(os.path.join(run_dir, rec.LOG), "a") as f:
            f.write("dfo queue: the run could not start: %s\n" % why)
        rec.write_json(os.path.join(run_dir, rec.META), {
            "id": rid, "job": req.get("job"), "host": req.get("host"), "command": req.get("command"),
            "workdir": req.get("workdir"), "started": rec.now_iso(now), "started_ts": now, "gpus": [],
            "queue": {"seq": e.get("seq"), "submitted": e.get("submitted"), "error": why}})
        rec.write_json(os.path.join(run_dir, rec.END), {"ended": rec.now_iso(now), "ended_ts": now, "exit_code": None,
                                                        "signal": None, "stopped": False, "oom_suspected": False,
                                                        "error": "could not start: %s" % why})
    finally:
        shutil.rmtree(d, ignore_errors=True)


def after_run(run_dir: str) -> None:
    """Called by a run's supervisor once its trainer has ended: the next queued runs start. Never raises."""
    try:
        workspace = os.path.dirname(os.path.dirname(os.path.dirname(run_dir)))
        if os.path.isdir(os.path.join(queue_dir(workspace), ENTRIES)):
            advance(workspace)
    except Exception as exc:  # noqa: BLE001 -- the supervisor's own end comes first
        try:
            log = os.path.join(queue_dir(os.path.dirname(os.path.dirname(os.path.dirname(run_dir)))), "errors.log")
            if os.path.exists(log) and os.path.getsize(log) > ERRORS_MAX:
                os.replace(log, log + ".1")
            with open(log, "a") as f:
                f.write("%s %s: %s: %s\n" % (rec.now_iso(), os.path.basename(run_dir), type(exc).__name__, exc))
        except OSError:
            pass
