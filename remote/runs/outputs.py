"""A run's outputs as ``remote.runs`` reports them (python3 3.8+, stdlib only): what describe/status
show, when follow may end, and the ``outputs`` and ``ship`` ops.

The shipper writes RUN_DIR/outputs.json (``remote.ship.shipper``); the supervisor writes RUN_DIR/shipper.json
(which process the shipper is: ``remote.ship.watch``). meta.json's ``outputs`` is the spec without
credentials; a run without it ships nothing.
"""
import os
import time

from remote._proto import RemoteError, emit_event
from remote.runs import record as rec

ENDED = ("done", "failed")


def spec_of(meta):
    """The run's outputs spec (no credentials) when it ships (has a dest), else None."""
    spec = (meta or {}).get("outputs")
    return spec if isinstance(spec, dict) and spec.get("dest") else None


def shipper_alive(run_dir):
    """(pid, alive) of the run's shipper as the supervisor recorded it (pid None: none now)."""
    sh = rec.read_json(os.path.join(run_dir, rec.SHIPPER)) or {}
    pid = sh.get("pid")
    return pid, bool(pid) and rec.proc_alive(pid, sh.get("starttime"))


def supervisor_alive(meta):
    meta = meta or {}
    same_boot = not meta.get("boot_id") or meta.get("boot_id") == rec.boot_id()
    return same_boot and rec.proc_alive(meta.get("supervisor_pid"), meta.get("supervisor_starttime"))


def info(run_dir, meta):
    """outputs.json (plus "alive": is a shipper or the supervisor that restarts it still there), or
    {"state": "starting"} before the first record; None for a run that ships nothing."""
    spec = spec_of(meta)
    got = rec.read_json(os.path.join(run_dir, rec.OUTPUTS))
    if spec is None and got is None:
        return None
    alive = shipper_alive(run_dir)[1] or supervisor_alive(meta)
    if got is None:
        got = {"state": "starting" if alive else "failed", "dest": spec.get("dest"), "path": spec.get("path"),
               "every": spec.get("every")}
        if not alive:
            got["errors"] = [{"at": None, "error": "no shipper ran for this run (its supervisor is gone)"}]
    got["alive"] = alive
    sh = rec.read_json(os.path.join(run_dir, rec.SHIPPER))
    if sh:
        got["restarts"] = sh.get("restarts", 0)
    return got


def follow_done(run_dir, meta, out):
    """settled, and the shipper's last words are in the log: the supervisor clears shipper.json's pid
    only after its relay wrote everything the shipper printed (or nobody is left to write it)."""
    if out is None or not out.get("alive"):
        return True
    pid, alive = shipper_alive(run_dir)
    return out.get("state") in ENDED and (pid is None or not (alive or supervisor_alive(meta)))


def settled(out):
    """True when nothing more will happen to this run's outputs: no outputs, the last pass is done or
    failed, or nobody is left to make it."""
    return out is None or out.get("state") in ENDED or not out.get("alive")


def _brief(out):
    return dict((k, out.get(k)) for k in ("state", "passes", "failed_passes", "pending", "lag_s", "shipped",
                                          "alive") if k in out)


def wait_settled(run_dir, meta, deadline=None, hb=2.0, wake=None):
    """Until the run's outputs are settled (or ``deadline``): ``outputs`` events on each change,
    heartbeats in between. ``wake(seconds)`` waits for a change (inotify), else a short sleep."""
    last, last_sent = None, time.time()
    while True:
        out = info(run_dir, meta)
        if settled(out) or (deadline is not None and time.time() >= deadline):
            return out
        brief = _brief(out)
        now = time.time()
        if brief != last:
            emit_event("outputs", outputs=brief)
            last, last_sent = brief, now
        elif now - last_sent >= hb:
            emit_event("outputs", outputs=brief)
            last_sent = now
        (wake or time.sleep)(min(hb, 0.5))


# --------------------------------------------------------------------------- ops


def op_outputs(req, resolve, describe):
    run_id, run_dir = resolve(req)
    d = describe(run_id, run_dir)
    d["outputs_spec"] = spec_of(rec.read_json(os.path.join(run_dir, rec.META)))
    return d


def op_ship(req, resolve):
    """A pass now: the run's live shipper makes it (ship.request + SIGUSR1; wait until its pass counter
    says a pass begun after the request ended), else one in this process with the request's spec."""
    run_id, run_dir = resolve(req)
    meta = rec.read_json(os.path.join(run_dir, rec.META)) or {}
    path = os.path.join(run_dir, rec.OUTPUTS)
    before = rec.read_json(path) or {}
    sh = rec.read_json(os.path.join(run_dir, rec.SHIPPER)) or {}
    pid, alive = shipper_alive(run_dir)
    if alive and (sh.get("final_sent") or before.get("state") in ENDED):
        # the run ended and its last pass is under way: that pass is the one asked for (a second one
        # beside it would send the same files twice)
        out = wait_settled(run_dir, meta) or {}
        res = dict(out.get("final") or out.get("last_pass") or {})
        res.update({"run": run_id, "by": "final"})
        return res
    if alive:
        n0 = int(before.get("passes") or 0)
        want = n0 + (2 if before.get("state") == "shipping" else 1)  # a pass under way began before the ask
        rec.write_json(os.path.join(run_dir, rec.SHIP_REQUEST), {"requested": rec.now_iso()})
        try:
            import signal

            os.kill(pid, signal.SIGUSR1)
        except OSError:
            alive = False
        last, last_sent = None, time.time()
        while alive:
            now_out = rec.read_json(path) or {}
            if int(now_out.get("passes") or 0) >= want:
                res = dict(now_out.get("last_pass") or {})
                res.update({"run": run_id, "by": "shipper"})
                return res
            brief = _brief(now_out)
            if brief != last or time.time() - last_sent >= 2.0:
                emit_event("outputs", outputs=brief)
                last, last_sent = brief, time.time()
            time.sleep(0.2)
            alive = shipper_alive(run_dir)[1]
        # the shipper ended meanwhile (the run's last pass, or it died): make the pass here
    spec = req.get("outputs") or spec_of(meta)
    if spec and spec.get("path"):  # ~ and $HOME: this user's home (a job's spec; a run's meta holds it expanded)
        from remote.lib.fsutil import node_path

        spec = dict(spec, path=node_path(spec["path"]))
    if not spec or not spec.get("dest"):
        raise RemoteError("config", "run %s ships no outputs (no outputs.dest in its job)" % run_id,
                          hint="set outputs.dest in the job file; dfo pull fetches files without S3")
    creds = req.get("outputs_credentials")
    if creds is None and (spec.get("credentials_mode") or "controller") == "controller":
        raise RemoteError("usage", "run %s has no live shipper, and a pass here needs the job's S3 credentials"
                          % run_id, hint="name the job (-j JOB) so that its credentials come with the request")
    from remote.ship import shipper

    res = shipper.run_pass(dict(spec, credentials=creds), run_dir, final=False)
    res = dict(res or {})
    res.update({"run": run_id, "by": "request"})
    return res


def op_look(req):
    """Before a launch's restore: what outputs.path (``path``, ~ expanded here) holds: "missing", "empty",
    "notdir" or "full" (then ``count``, its entries). dfo's own .dfo names do not count: a folder
    holding only them is empty."""
    path = os.path.expanduser(req["path"])
    try:
        names = [n for n in os.listdir(path) if not n.startswith(".dfo")]
    except FileNotFoundError:
        return {"kind": "missing", "path": path}
    except NotADirectoryError:
        return {"kind": "notdir", "path": path}
    return {"kind": "full" if names else "empty", "path": path, "count": len(names)}
