"""Runs on the node: launch (detached), status, read, follow, stop; a run's outputs, ship, look (python3 3.8+,
stdlib only).

Each run has a directory ``<workspace>/.dfo/runs/<run-id>/`` holding meta.json (written by the
supervisor once the trainer started), log (the trainer's stdout+stderr), end.json (how it ended),
stop.json (a stop was asked for) and, with the autotune guard, autotune_guard.jsonl. Every JSON
file is written to a temp name and renamed. ``python3 -m remote.runs`` reads ``{"op": ...}``.
"""
from __future__ import annotations

import fcntl
import os
import select
import sys
import time

from remote._proto import RemoteError, emit_event, serve
from remote.lib import fastjson as json
from remote.lib import fsutil
from remote.lib.destsafety import open_meta
from remote.runs import outputs
from remote.runs import record as rec
from remote.runs.logfollow import LogReader, start_offset
from remote.runs.logfollow import Watch as _Watch
from remote.runs.logfollow import chunk_fields as _chunk_fields
from remote.runs.record import METRICS, last_rows

# status, read and follow, called most, import nothing more: what launch and stop need (re, subprocess,
# shutil, signal, the upload and redaction helpers) is imported where they start (~10 ms of a call otherwise)

# --------------------------------------------------------------------------- requests and replies
# python3 -m remote.runs reads one JSON object, {"op": NAME, ...}: every op's shapes, in this one place.
# total=False: python 3.8 has no NotRequired; the keys an op reads with req[...] are always sent.


TYPE_CHECKING = False  # (typing is not imported at run time: ~1.5 ms of every call's start on the node)
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, TypedDict, Union

    class Where(TypedDict, total=False):
        """Which run: in ``workspace`` (default /workspace), ``run`` (an id or a unique prefix; default the
        newest, of ``job`` when given). Every op but launch and look takes these."""
        op: str
        workspace: str
        run: Optional[str]
        job: Optional[str]
        tail: int  # with a failed or lost run: its last lines, for the diagnosis


    class Upload(TypedDict, total=False):
        """A run.upload file: written into ``workdir`` when its sha256 differs (remote/files/runfiles.py)."""
        path: str
        sha256: str
        mode: int
        content_b64: str  # sent only when the node answered {"need": [path, ...]}


    class GangPlace(TypedDict, total=False):
        """This node's place in a gang; ``secret`` goes to the supervisor's stdin only (meta.json keeps the rest)."""
        rank: int
        hosts: List[str]
        hub: str
        port: int
        secret: str
        gloo_ifname: Optional[bool]
        address: str
        peer: Optional[str]
        addrs: List[str]  # the gang addresses, rank order: rank 0's hub admits its members' apart from strangers


    class LaunchRequest(TypedDict, total=False):
        """``launch`` -> RunInfo (+ ``uploads``: [{path, sha256, changed}]), or ``{"need": [path, ...]}``."""
        op: str
        workspace: str
        run_id: str
        job: str
        host: str
        command: str  # rendered, run with bash -c
        workdir: str
        env: Dict[str, str]
        secret_env: Dict[str, str]  # the trainer's environment only, never meta.json
        force: bool
        autotune_guard: bool
        stop_grace: Optional[float]
        job_file: str
        uploads: List[Upload]
        gang: GangPlace
        outputs: Dict[str, Any]  # the shipper's spec (steps/outputs.py outputs_spec)
        outputs_credentials: Optional[Dict[str, Optional[str]]]  # the shipper's stdin only
        metrics: Dict[str, Any]  # the sampler's spec (remote/runs/metrics.py): every, log_metrics, idle_*
        notify: Dict[str, Any]  # {webhook, on}: the webhook URL goes to the supervisor's stdin only
        generation: Dict[str, Any]  # a run that recovers (issue 20): lineage, generation, restarts so far


    class ReadRequest(Where, total=False):
        """``read`` -> RunInfo + a chunk (``o``, ``t`` or ``d``) + ``next_offset``."""
        offset: Optional[int]
        lines: Union[int, str, None]  # N: the last N lines; "+N": from line N
        max_bytes: int


    class FollowRequest(ReadRequest, total=False):
        """``follow`` -> events (``start``, ``chunk``, ``reset``, ``opened``, ``hb``, ``outputs``), then RunInfo."""
        ino: Optional[int]
        max_seconds: Optional[float]
        heartbeat: float
        to_end: bool
        coalesce: float
        outputs_wait: bool


    class StatusRequest(Where, total=False):
        """``status`` -> ``{"runs": [RunInfo, ...]}``, newest first."""
        limit: int


    class StopRequest(Where, total=False):
        """``stop`` -> RunInfo (+ ``stop``, ``stop_seconds``, ``group_left``)."""
        grace: Optional[float]
        wait_outputs: Optional[float]


    class ShipRequest(Where, total=False):
        """``ship`` -> the pass (``ok``, ``files``, ``bytes``, ...) + ``run`` and ``by``; events ``{"outputs": ...}``.
        ``outputs``/``outputs_credentials`` let the node make the pass itself when the run's shipper is gone.
        (``outputs`` takes Where alone -> RunInfo + ``outputs_spec``.)"""
        outputs: Dict[str, Any]
        outputs_credentials: Optional[Dict[str, Optional[str]]]


    class MetricsRequest(Where, total=False):
        """``metrics`` -> RunInfo + ``rows`` (metrics.jsonl, remote/runs/metrics.py) + ``total_rows``."""
        since: float  # only rows after this time (unix seconds)
        max_rows: int  # evenly thinned to at most this many, the newest kept


    class LookRequest(TypedDict):
        """``look`` -> LookReply: what outputs.path holds before a launch's restore."""
        op: str
        path: str


    class LookReply(TypedDict, total=False):
        kind: str  # "missing" | "empty" | "full" | "notdir"
        path: str  # ~ expanded on the node
        count: int  # with "full"


    class RunInfo(TypedDict, total=False):
        """One run as ``describe`` reports it (orchestrator/steps/runs.py RunInfo reads it)."""
        id: str
        job: Optional[str]
        state: str  # running | succeeded | failed | stopped | lost
        started: Optional[str]
        ended: Optional[str]
        exit_code: Optional[int]
        signal: Optional[int]
        pid: Optional[int]
        pgid: Optional[int]
        supervisor_pid: Optional[int]
        host: Optional[str]
        run_dir: str
        command: Optional[str]
        workdir: Optional[str]
        end: Optional[Dict[str, Any]]
        last_line: Optional[str]
        log_size: int
        autotune_guard: Optional[Dict[str, Any]]
        outputs: Optional[Dict[str, Any]]
        tail: List[str]
        group_left: List[int]
        gang: Dict[str, Any]
        metrics: Optional[Dict[str, Any]]  # the last sys and train rows of metrics.jsonl
        generation: Optional[Dict[str, Any]]  # lineage, generation, restarts (remote/runs/generation.py)


AGENT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a run id (orchestrator/steps/pull.py RUN_ID: the same)
_DROP_ENV = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK")


def runs_root(req):
    return os.path.join(workspace_of(req), ".dfo", "runs")


def workspace_of(req):
    """The request's workspace (``~`` expanded here), else this node's default one (remote.lib.fsutil)."""
    return fsutil.workspace(req.get("workspace"))


# --------------------------------------------------------------------------- state of a run


def resolve(req):
    """The run directory named by req["run"] (an id or a unique prefix), or the newest one."""
    root = runs_root(req)
    runs = rec.list_runs(root, req.get("job"))
    want = req.get("run")
    where = "under %s" % root
    if want is not None and not str(want).strip():
        # an empty id is a script's unset variable, never "the newest run"
        raise RemoteError("usage", "the run id is empty", hint="give a run id or its unique prefix")
    if want is None and req.get("op") == "stop":
        raise RemoteError("usage", "stop needs a run id", hint="dfo status -H HOST lists the runs")
    if not want:
        if not runs:
            raise RemoteError("usage", "no runs %s%s" % (where, " for job %s" % req["job"] if req.get("job") else ""),
                              hint="start one with: dfo launch -H HOST -j JOB")
        return runs[0][1], runs[0][2]
    exact = [r for r in runs if r[1] == want]
    hits = exact or [r for r in runs if r[1].startswith(want)]
    if len(hits) == 1:
        return hits[0][1], hits[0][2]
    if not hits:
        queued = _queued_ids(os.path.dirname(root))
        hits = [r for r in queued if r == want] or [r for r in queued if r.startswith(want)]
        if len(hits) == 1:  # a run of the queue (remote/runs/queue.py) that has not started
            raise RemoteError("usage", "run %s is queued here and has not started yet" % hits[0],
                              hint="see the queue: dfo queue -H HOST; take it out: dfo cancel -H HOST %s" % hits[0])
        raise RemoteError("usage", "no run %r %s" % (want, where), hint="dfo status -H HOST lists the runs")
    raise RemoteError("usage", "run %r is ambiguous: %s" % (want, ", ".join(r[1] for r in hits[:5])),
                      hint="give more of the id")


def _queued_ids(dfo_dir):
    """The ids waiting in the queue beside ``dfo_dir``/runs (remote/runs/queue.py keeps them)."""
    try:
        return [n for n in os.listdir(os.path.join(dfo_dir, "queue", "entries")) if not n.startswith(".")]
    except OSError:
        return []


def describe(run_id, run_dir, tail=0, state=None):
    state, meta, end = state or rec.run_state(run_dir)
    meta = meta or {}
    log = os.path.join(run_dir, rec.LOG)
    last = rec.tail_lines(log, 1)
    info = {
        "id": run_id, "job": meta.get("job"), "state": state, "started": meta.get("started"),
        "started_ts": meta.get("started_ts"), "ended": (end or {}).get("ended"),
        "ended_ts": (end or {}).get("ended_ts"), "exit_code": (end or {}).get("exit_code"),
        "signal": (end or {}).get("signal"), "pid": meta.get("pid"), "pgid": meta.get("pgid"),
        "supervisor_pid": meta.get("supervisor_pid"), "host": meta.get("host"), "run_dir": run_dir,
        "command": meta.get("command"), "workdir": meta.get("workdir"), "end": end,
        "last_line": last[-1] if last else None, "log_size": rec.file_size(log),
        "autotune_guard": rec.guard_info(run_dir, meta), "outputs": outputs.info(run_dir, meta),
    }
    if tail and state in ("failed", "lost"):
        info["tail"] = rec.tail_lines(log, tail)
    if state == "lost":
        info["group_left"] = rec.leftovers(meta)
    sys_row, train = last_rows(os.path.join(run_dir, METRICS))
    if sys_row is not None or train is not None:  # the sampler's last rows (remote/runs/metrics.py)
        info["metrics"] = {"sys": sys_row, "train": train}
    if "gpus" in meta:  # a run from the queue: the GPUs it was given (CUDA_VISIBLE_DEVICES)
        info["gpus"] = meta["gpus"]
    if meta.get("generation"):  # a run that recovers: which generation of which lineage, restarts before it
        info["generation"] = meta["generation"]
    if meta.get("gang"):  # a node of a gang: its place, and what its gang watch recorded (gang.json)
        info["gang"] = dict(meta["gang"], watch=rec.read_json(os.path.join(run_dir, "gang.json")))
    return info


# --------------------------------------------------------------------------- launch


def trainer_env(req, run_id, run_dir):
    env = dict((k, v) for k, v in os.environ.items() if k not in _DROP_ENV)
    shown = {"PYTHONUNBUFFERED": "1", "DFO_RUN_ID": run_id, "DFO_RUN_DIR": run_dir, "DFO_AGENT_DIR": AGENT_DIR,
             "DFO_WORKSPACE": workspace_of(req)}  # run.command's {workspace} when the node chose it
    shown.update(req.get("env") or {})
    if req.get("autotune_guard"):
        # only the guard's folder: the sitecustomize loads the guard by file path, so nothing named
        # `remote` lands on the trainer's path (DFO_AGENT_DIR says where dfo's helpers are)
        parts = [os.path.join(AGENT_DIR, "remote", "gpu", "sitecustomize_guard")]
        if shown.get("PYTHONPATH"):
            parts.append(shown["PYTHONPATH"])
        shown["PYTHONPATH"] = os.pathsep.join(parts)
        shown["DFO_AUTOTUNE_GUARD_LOG"] = os.path.join(run_dir, rec.GUARD_LOG)
    env.update(shown)
    env.update(req.get("secret_env") or {})
    return env, shown


def live_runs(root, job):
    return [(rid, d) for _, rid, d in rec.list_runs(root, job) if rec.run_state(d)[0] == "running"]


def launch(req: LaunchRequest):
    import re

    run_id, job = req["run_id"], req["job"]
    if not re.match(RUN_ID_PATTERN, run_id):
        raise RemoteError("usage", "bad run id %r" % run_id)
    # node paths: ~ and $HOME are this user's home (remote.lib.fsutil.node_path), expanded once, here
    req = req.copy()
    req["workspace"], req["workdir"] = workspace_of(req), fsutil.node_path(req["workdir"])
    if isinstance(req.get("outputs"), dict):
        req["outputs"] = dict(req["outputs"], path=fsutil.node_path(req["outputs"].get("path")))
    root = runs_root(req)
    workspace = req["workspace"]
    try:
        os.makedirs(workspace, exist_ok=True)
    except OSError as exc:
        raise RemoteError("config", "workspace %s: %s" % (workspace, exc.strerror),
                          hint="set workspace: (inventory or job) to a folder this user may write, e.g. ~/workspace"
                          ) from None
    os.close(open_meta(workspace, "workspace"))  # its .dfo: no symlink, this user's, nobody else may write it
    os.makedirs(root, exist_ok=True)
    lock = open(os.path.join(root, ".launch.lock"), "a")
    fcntl.flock(lock, fcntl.LOCK_EX)  # one launch at a time per workspace: check + start is atomic
    try:
        live = live_runs(root, job)
        if live and not req.get("force"):
            rid, d = live[0]
            meta = rec.read_json(os.path.join(d, rec.META)) or {}
            raise RemoteError(
                "usage", "job %s already has a live run here: %s (pid %s, started %s)"
                % (job, rid, meta.get("pid"), meta.get("started")),
                hint="follow it: dfo tail -H %s %s; stop it: dfo stop -H %s %s; or launch anyway with --force"
                % (req.get("host"), rid, req.get("host"), rid), running=rid)
        workdir = req["workdir"]
        try:
            os.makedirs(workdir, exist_ok=True)
        except OSError as exc:
            raise RemoteError("config", "run.workdir %s: %s" % (workdir, exc.strerror)) from None
        from remote.files.runfiles import sync_uploads

        need, uploads = sync_uploads(workdir, req.get("uploads") or [])
        if need:
            return {"need": need}
        run_dir = os.path.join(root, run_id)
        try:
            os.mkdir(run_dir)
        except FileExistsError:
            raise RemoteError("usage", "run id %s exists already under %s" % (run_id, root)) from None
        return _start(req, run_id, run_dir, uploads)
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def _start(req, run_id, run_dir, uploads):
    import shutil
    import subprocess

    from remote.lib.redact import is_secret, redact

    env, shown = trainer_env(req, run_id, run_dir)
    # a value meta.json must not hold, even if the request called it plain (remote.lib.redact.is_secret)
    hidden = set(k for k, v in shown.items() if is_secret(k, v))
    meta = {
        "id": run_id, "job": req["job"], "host": req.get("host"), "command": redact(req["command"]),
        "workdir": req["workdir"], "env": dict((k, v) for k, v in shown.items() if k not in hidden),
        "secret_env": sorted(set(req.get("secret_env") or {}) | hidden),
        "uploads": uploads, "autotune_guard": bool(req.get("autotune_guard")), "job_file": req.get("job_file"),
        "stop_grace": req.get("stop_grace"), "log": os.path.join(run_dir, rec.LOG), "agent_dir": AGENT_DIR,
    }
    ship = req.get("outputs")
    if isinstance(ship, dict):  # the spec without credentials: those go to the supervisor's stdin alone
        meta["outputs"] = dict((k, v) for k, v in ship.items() if k != "credentials")
    if isinstance(req.get("generation"), dict):
        meta["generation"] = req["generation"]
    if "gpus" in req:  # a run from the queue (remote/runs/queue.py): its GPUs, and what the queue knew of it
        meta["gpus"], meta["queue"] = req["gpus"], req.get("queue")
    gang = req.get("gang")
    if isinstance(gang, dict):  # a node of a gang: its place in meta.json; the secret to the supervisor's stdin alone
        meta["gang"] = {"rank": gang.get("rank"), "nodes": len(gang.get("hosts") or []), "hosts": gang.get("hosts"),
                        "hub": gang.get("hub"), "port": gang.get("port"), "run": run_id,
                        "join_timeout": gang.get("join_timeout")}  # what the hub waits for a first join
    if isinstance(req.get("metrics"), dict):
        meta["metrics"] = req["metrics"]
    notify = req.get("notify") if isinstance(req.get("notify"), dict) else None
    if notify:  # the webhook URL (a secret) to the supervisor's stdin alone
        meta["notify"] = {"on": notify.get("on"), "webhook": bool(notify.get("webhook"))}
    spec = json.dumps({"command": req["command"], "workdir": req["workdir"], "env": env, "meta": meta,
                       "outputs": meta.get("outputs"), "outputs_credentials": req.get("outputs_credentials"),
                       "gang": gang if isinstance(gang, dict) else None, "metrics": req.get("metrics"),
                       "notify": notify})
    sup_env = dict((k, v) for k, v in os.environ.items() if k not in _DROP_ENV)
    sup_env.update({"PYTHONPATH": AGENT_DIR, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"})
    r, w = os.pipe()
    log_fd = os.open(os.path.join(run_dir, rec.LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        sup = subprocess.Popen(
            [sys.executable, "-m", "remote.runs.supervisor", run_dir, str(w)], cwd=AGENT_DIR, env=sup_env,
            stdin=subprocess.PIPE, stdout=log_fd, stderr=log_fd, start_new_session=True, pass_fds=(w,),
        )
    finally:
        os.close(w)
        os.close(log_fd)
    assert sup.stdin is not None  # PIPE
    try:
        sup.stdin.write(spec.encode())
        sup.stdin.close()
    except OSError:
        pass  # it died at once: its report (or its absence) below says why
    raw, deadline = b"", time.time() + 30
    while time.time() < deadline:
        ready, _, _ = select.select([r], [], [], 0.5)
        if ready:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            raw += chunk
    os.close(r)
    try:
        got = json.loads(raw.decode() or "{}")
    except ValueError:
        got = {}
    if "pid" not in got:  # no trainer: leave no half-made run behind
        said = rec.tail_lines(os.path.join(run_dir, rec.LOG), 5)
        shutil.rmtree(run_dir, ignore_errors=True)
        why = got.get("error") or "the supervisor did not report" + (": " + " / ".join(said) if said else "")
        raise RemoteError("run_failed", "could not start the trainer: %s" % why, run=run_id)
    info = describe(run_id, run_dir)
    info["uploads"] = uploads
    return info


# --------------------------------------------------------------------------- read / follow


def read(req: ReadRequest):
    run_id, run_dir = resolve(req)
    state = rec.run_state(run_dir)
    log = os.path.join(run_dir, rec.LOG)
    offset = start_offset(log, req)
    data = b""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            data = f.read(int(req.get("max_bytes") or 1 << 20))
    except OSError:
        pass
    info = describe(run_id, run_dir, tail=int(req.get("tail") or 0), state=state)
    info.update(_chunk_fields(offset, data))
    info["next_offset"] = offset + len(data)
    return info


def follow(req: FollowRequest):
    """Stream the log from an offset as events until the run has ended and the log is drained
    (``to_end``: until the end the log has now). The events: orchestrator/steps/logstream.py. A log
    truncated or replaced meanwhile is read on from its new start, after a reset event. A run with
    outputs is followed on after its end until its last pass is done or failed (or nobody is left to
    make it), with an ``outputs`` event on each change; the result carries ``outputs``. The events'
    kinds and fields: remote/_proto.py EVENTS (start, chunk, hb, reset, opened, outputs)."""
    run_id, run_dir = resolve(req)
    log = os.path.join(run_dir, rec.LOG)
    start = start_offset(log, req)
    hb = float(req.get("heartbeat") or 2.0)
    coalesce = float(req.get("coalesce") or 0)
    max_seconds = req.get("max_seconds")
    deadline = time.time() + float(max_seconds) if max_seconds is not None else None
    to_end = bool(req.get("to_end"))
    state = rec.run_state(run_dir)
    meta = state[1] or {}
    reader = LogReader(log, start, req.get("ino"))
    why = reader.open()
    emit_event("start", offset=start, run=run_id, job=meta.get("job"), pid=meta.get("pid"), ino=reader.ino)
    if why:
        emit_event("reset", **reader.reset_fields(why))
    stop_at = reader.size()
    watch = _Watch(run_dir, log)
    end_path = os.path.join(run_dir, rec.END)
    check_every = 2.0 if watch.fd is not None else 0.5  # full state check (pids): catches a lost run
    last_sent = last_check = time.time()
    ended = state if state[0] != "running" else None
    wait_outputs = req.get("outputs_wait", True) is not False  # until the last pass is done (or failed)
    last_look, seen_out = False, None
    try:
        while True:
            if reader.f is None:
                why = reader.open()
                if reader.f is not None:
                    if why:
                        emit_event("reset", **reader.reset_fields(why))
                    else:
                        emit_event("opened", ino=reader.ino)
                    watch.watch_file(log)
            at, data = reader.read(rec.CHUNK)
            if data:
                emit_event("chunk", **_chunk_fields(at, data))
                prev_sent, last_sent = last_sent, time.time()
                if to_end and reader.offset >= stop_at:
                    break
                if deadline is not None and last_sent >= deadline and ended is None:
                    break
                if coalesce and len(data) < rec.CHUNK and last_sent - prev_sent < 0.02:
                    time.sleep(coalesce)  # a fast log: let lines gather (fewer events, less CPU on both ends)
                continue
            if to_end:
                break
            why = reader.changed()
            if why:
                emit_event("reset", **reader.reset_fields(why))
                watch.watch_file(log)
                continue
            if ended is not None:  # the run had ended before this read reached the end of the log: drained
                out = outputs.info(run_dir, meta) if wait_outputs else None
                if outputs.follow_done(run_dir, meta, out):
                    if last_look:
                        break
                    last_look = True  # once more to the log's end: the shipper's last line is in it now
                    continue
                if out != seen_out:  # the last pass is still under way: say how it goes, follow the log on
                    emit_event("outputs", outputs=out)
                    seen_out, last_sent = out, time.time()
            now = time.time()
            if ended is None and (os.path.exists(end_path) or now - last_check >= check_every):  # inotify wakes
                last_check = now
                st = rec.run_state(run_dir)
                if st[0] != "running":
                    ended = st
                    continue
            if deadline is not None and now >= deadline:
                break
            if now - last_sent >= hb:
                emit_event("hb", offset=reader.offset)
                last_sent = now
            watch.wait(max(0.0, min(check_every, hb, deadline - now if deadline is not None else hb)))
    finally:
        reader.close()
    info = describe(run_id, run_dir, tail=int(req.get("tail") or 0), state=ended or rec.run_state(run_dir))
    info["offset"] = reader.offset
    return info


# --------------------------------------------------------------------------- stop


def _signal_group(meta, sig):
    if rec.leftovers(meta):
        try:
            os.killpg(meta["pgid"], sig)
        except OSError:
            pass


def _wait_gone(meta, seconds):
    deadline = time.time() + seconds
    while rec.leftovers(meta) or rec.proc_alive(meta.get("pid"), meta.get("pid_starttime")):
        if time.time() >= deadline:
            return False
        time.sleep(0.1)
    return True


def stop(req: StopRequest):
    """SIGTERM to the run's process group, ``grace`` seconds, SIGKILL; recorded as stopped. A lost
    run whose group still has processes (the trainer's children) gets the same treatment. The shipper
    is not in that group: a stopped run with outputs gets its last pass (the supervisor starts it once
    end.json is written); ``wait_outputs`` (seconds) waits for that pass, else it goes on unwatched."""
    run_id, run_dir = resolve(req)
    state, meta, end = rec.run_state(run_dir)
    if state != "running" and not (state == "lost" and rec.leftovers(meta or {})):
        info = describe(run_id, run_dir, state=(state, meta, end))
        info["stop"] = "nothing to stop: the run is %s" % state
        return info
    asked = req.get("grace")
    grace = float(asked if asked is not None else meta.get("stop_grace") or 30)
    t0 = time.time()
    rec.write_json(os.path.join(run_dir, rec.STOP), {"requested": rec.now_iso(), "grace": grace})
    import signal

    _signal_group(meta, signal.SIGTERM)
    sent = "SIGTERM"
    if not _wait_gone(meta, grace):
        _signal_group(meta, signal.SIGKILL)
        sent = "SIGTERM, then SIGKILL after %gs" % grace
        _wait_gone(meta, 10)
    end_path = os.path.join(run_dir, rec.END)
    deadline = time.time() + 10
    while rec.read_json(end_path) is None and time.time() < deadline:
        if not rec.proc_alive(meta.get("supervisor_pid"), meta.get("supervisor_starttime")):
            break
        time.sleep(0.05)
    if rec.read_json(end_path) is None:  # no supervisor to record it: record the stop here
        rec.write_json(end_path, {"ended": rec.now_iso(), "ended_ts": time.time(), "exit_code": None, "signal": None,
                                  "stopped": True, "oom_suspected": False,
                                  "note": "recorded by dfo stop (was %s: the supervisor was gone)" % state})
    wait = req.get("wait_outputs")
    if wait and outputs.spec_of(meta):  # seconds to wait for the stopped run's last pass
        outputs.wait_settled(run_dir, meta, deadline=time.time() + float(wait))
    info = describe(run_id, run_dir)
    info["stop"] = sent
    info["stop_seconds"] = round(time.time() - t0, 3)
    info["group_left"] = rec.leftovers(meta)
    return info


def status(req: StatusRequest):
    root = runs_root(req)
    if req.get("run"):
        run_id, run_dir = resolve(req)
        return {"runs": [describe(run_id, run_dir, tail=int(req.get("tail") or 0))]}
    runs = rec.list_runs(root, req.get("job"))[: int(req.get("limit") or 20)]
    return {"runs": [describe(rid, d, tail=int(req.get("tail") or 0)) for _, rid, d in runs]}


def outputs_op(req: Where):
    return outputs.op_outputs(req, resolve, describe)


def ship(req: ShipRequest):
    return outputs.op_ship(req, resolve)


def metrics_op(req: MetricsRequest):
    """``metrics`` -> RunInfo + ``rows`` (metrics.jsonl's rows after ``since``, at most ``max_rows``, evenly
    thinned, the newest kept) + ``total_rows``."""
    from remote.runs.metrics import thin

    run_id, run_dir = resolve(req)
    since = float(req.get("since") or 0)
    rows = []
    try:
        with open(os.path.join(run_dir, METRICS), "rb") as f:
            for raw in f:
                try:
                    row = json.loads(raw)
                except ValueError:
                    continue
                t = row.get("t") if isinstance(row, dict) else None
                # a row whose t is no number (a hostile or broken line) is skipped, never the whole op
                if isinstance(t, (int, float)) and not isinstance(t, bool) and t > since:
                    rows.append(row)
    except OSError:
        pass
    info = describe(run_id, run_dir)
    info["total_rows"] = len(rows)
    info["rows"] = thin(rows, int(req.get("max_rows") or 20000))
    return info


OPS = {"launch": launch, "status": status, "read": read, "follow": follow, "stop": stop, "outputs": outputs_op,
       "ship": ship, "look": outputs.op_look, "metrics": metrics_op}


if __name__ == "__main__":
    serve(OPS)  # (python3 -m remote.runs runs remote/runs/__main__.py: remote.runs.entry)
