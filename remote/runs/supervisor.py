"""The run supervisor (python3 3.8+, stdlib). The run record it writes is read through ``remote.runs.record``.

``python3 -m remote.runs.supervisor RUN_DIR STATUS_FD`` is started by ``remote.runs`` in a new session
(setsid), stdin a pipe, stdout/stderr the run's log. It reads its spec (JSON: the command, working
directory, the trainer's full environment -- secrets included -- and the static part of meta.json)
from stdin until EOF, then points stdin at /dev/null, so secrets never touch the disk or argv.

It starts the trainer with ``bash -c COMMAND`` in its own session and process group (``dfo stop``
signals the group), writes meta.json (with pids and their /proc start times, so a reused pid is
never mistaken for the run), reports ``{"pid": ...}`` on STATUS_FD and closes it, waits, and writes
end.json: exit code or signal, end time, whether a stop was asked for, and for a SIGKILL nobody
asked for, the likely-OOM hint with the kernel's word where the node lets it be read.

With ``outputs`` in its spec (and ``outputs_credentials``, which only ever travel on stdin), it also
starts and watches the outputs shipper (``remote.ship.watch``): it ships while the trainer runs; when
the trainer ends, end.json is written FIRST (the run's state is known at once), then the shipper makes
its last pass and the supervisor waits for it, however long that takes. A stopped run gets its last
pass too: its checkpoint is exactly what one wants shipped. A SIGTERM while the trainer runs ends the
trainer (as before); one during the last pass is forwarded to the shipper.

When the workspace has a run queue (``dfo submit``: remote/runs/queue.py), the supervisor moves it on
right after end.json, before the last pass and the alerts: the next queued runs that fit in the GPUs its
trainer gave back start, each under a supervisor of its own, with nobody else on the node or the laptop.
"""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import List, Optional, Tuple

from remote.runs.metrics import Sampler
from remote.runs.notify import IdleWatch, Notifier
from remote.runs.record import (
    END,
    LOG,
    META,
    STOP,
    boot_id,
    leftovers,
    now_iso,
    proc_stat,
    read_json,
    write_json,
)
from remote.runs.runship import RunFilesShip
from remote.ship.watch import ShipperWatch

GANG = "gang.json"
GANG_GRACE_MAX = 30.0  # a gang stop never waits longer: every node ends within the 60 s bound (docs/gangs.md)


def cgroup_oom_kills():
    """The oom_kill counter of this process's memory cgroup (v2 memory.events, v1 memory.oom_control)."""
    try:
        with open("/proc/self/cgroup") as f:
            entries = [ln.rstrip("\n").split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        return None
    files = []
    for hid, ctrls, path in entries:
        if hid == "0" and not ctrls:
            files.append("/sys/fs/cgroup%s/memory.events" % path.rstrip("/"))
        elif "memory" in ctrls.split(","):
            files.append("/sys/fs/cgroup/memory%s/memory.oom_control" % path.rstrip("/"))
    for name in files:
        try:
            with open(name) as f:
                for ln in f:
                    if ln.startswith("oom_kill "):
                        return int(ln.split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return None


_OOM_LINE = re.compile(r"out of memory|oom-kill|oom_reaper|killed process", re.I)
_STAMP = re.compile(r"^\[\s*(\d+\.\d+)\]\s?(.*)$")


def _kmsg():
    """(seconds since boot, text) of /dev/kmsg's records, or None where it cannot be read."""
    out: List[Tuple[Optional[float], str]] = []
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        while len(out) < 200000:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on
                continue
            if not rec:
                break
            head, _, msg = rec.decode("utf-8", "replace").partition(";")
            fields = head.split(",")
            ts = int(fields[2]) / 1e6 if len(fields) > 2 and fields[2].isdigit() else None
            out.append((ts, msg.split("\n", 1)[0]))
    finally:
        os.close(fd)
    return out


def _stamped(argv):
    """(seconds since boot, text) of a command's "[ 123.456] text" lines, or None if it failed."""
    try:
        res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    out = []
    for ln in res.stdout.decode("utf-8", "replace").splitlines()[-20000:]:
        m = _STAMP.match(ln)
        out.append((float(m.group(1)), m.group(2)) if m else (None, ln))
    return out


def kernel_oom_words(pids, since):
    """(source, lines): the kernel's OOM lines logged since ``since`` (CLOCK_MONOTONIC, as the kernel
    stamps its log), those naming one of ``pids`` first; source None where no log is readable."""
    sources = (("dmesg", lambda: _stamped(["dmesg"])), ("/dev/kmsg", _kmsg),
               ("journalctl", lambda: _stamped(["journalctl", "-k", "-o", "short-monotonic", "-n", "5000",
                                                "--no-pager", "-q"])))
    for source, getter in sources:
        lines = getter()
        if lines is None:
            continue
        hits = [text.strip() for ts, text in lines
                if (ts is None or ts >= since - 1) and _OOM_LINE.search(text)]
        mine = [ln for ln in hits if any(re.search(r"\b%d\b" % p, ln) for p in pids)]
        return source, (mine or hits)[-4:]
    return None, []


def _gloo_ifname(gang):
    try:
        from remote.gang.ops import interface_for

        return interface_for(gang.get("address") or "", gang.get("peer"))
    except Exception:  # noqa: BLE001 -- unknown: leave GLOO_SOCKET_IFNAME unset rather than guess
        return None


def _write_gang(run_dir, watch):
    try:
        doc = dict(watch.state(), events=watch.events[-50:])
        write_json(os.path.join(run_dir, GANG), doc)
    except Exception:  # noqa: BLE001 -- the record is a courtesy: never let it end the supervisor
        pass


def _on_gang_event(run_dir, box, notifier, ev):
    if box:
        _write_gang(run_dir, box[0])
    if notifier is not None and ev.get("event") in ("member-lost", "hub-lost"):  # sent by a node still alive
        notifier.send("lost", {"lost_host": ev.get("host"), "silent_s": ev.get("silent")})


def _start_gang_watch(run_dir, spec, proc, meta, notifier=None):
    """The gang watch beside the trainer (remote/gang/watch.py): when the gang fails elsewhere, stop.json
    says why and the trainer's group gets SIGTERM, then SIGKILL after min(run.stop_grace, 30) s."""
    from remote.gang.watch import GangWatch

    gang = spec["gang"]
    grace = min(float(meta.get("stop_grace") or GANG_GRACE_MAX), GANG_GRACE_MAX)
    box: List[GangWatch] = []

    def stop_gang():
        ff = (box[0].state().get("first_failure") or {}) if box else {}
        _stop_group(run_dir, proc, meta, grace, "gang failed: %s %s" % (ff.get("host", "?"), ff.get("how", "?")))

    watch = GangWatch(int(gang["rank"]), gang["hosts"], gang["hub"], int(gang["port"]), bytes.fromhex(gang["secret"]),
                      stop_gang, gang_id=meta.get("id") or "", interval=float(gang.get("interval") or 2),
                      silence=float(gang.get("silence") or 20), join_timeout=float(gang.get("join_timeout") or 30),
                      on_event=lambda ev: _on_gang_event(run_dir, box, notifier, ev),
                      peer=gang.get("peer"),  # rank 0 listens on its gang address only (or toward the peer)
                      addrs=gang.get("addrs"))  # ... and admits its members' addresses apart from strangers
    box.append(watch)
    try:
        watch.start()
    except OSError as exc:  # rank 0 cannot listen: the gang cannot be watched; fail this node's run
        write_json(os.path.join(run_dir, GANG), {"state": "failed", "error": "gang watch: %s" % exc})
        stop_gang()
        return None
    _write_gang(run_dir, watch)
    return watch


def _stop_group(run_dir, proc, meta, grace, why):
    """As dfo stop does: stop.json (with why) unless one exists, SIGTERM to the trainer's process group,
    SIGKILL to what is left of it after ``grace`` s (stragglers too, even after the leader ended)."""
    if read_json(os.path.join(run_dir, STOP)) is None:
        write_json(os.path.join(run_dir, STOP), {"requested": now_iso(), "grace": grace, "why": why})
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except OSError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and leftovers(meta):
        time.sleep(0.1)
    if leftovers(meta):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass


def _idle_stop(run_dir, proc, meta, extra):
    """idle_action: stop -- as dfo stop does, why: idle."""
    _stop_group(run_dir, proc, meta, float(meta.get("stop_grace") or 30),
                "idle: every GPU under %s%% for %s min" % (extra.get("idle_util_pct"), extra.get("idle_minutes")))


def _start_sampler(run_dir, spec, proc, meta, notifier, trainer_path):
    """The metrics sampler (remote/runs/metrics.py) and, with run.idle_minutes, the idle watch on its rows."""
    mspec = spec.get("metrics") or {}
    if mspec.get("every") == 0:
        return None
    idle = None
    if mspec.get("idle_minutes"):
        def on_idle(extra):
            notifier.send("idle", extra)
            if extra.get("action") == "stop":
                threading.Thread(target=_idle_stop, args=(run_dir, proc, meta, extra), daemon=True).start()

        idle = IdleWatch(mspec.get("idle_util_pct") or 5, mspec["idle_minutes"], mspec.get("idle_action") or "alert",
                         on_idle)
    try:
        return Sampler(run_dir, mspec, proc.pid, meta.get("workspace") or os.path.dirname(os.path.dirname(
            os.path.dirname(run_dir))), path=trainer_path, on_sample=idle.feed if idle else None).start()
    except Exception:  # noqa: BLE001 -- metrics are a courtesy: never let them end the supervisor
        return None


def _queue_next(run_dir):
    """The next queued runs that fit start (remote/runs/queue.py), when this workspace has a queue. Never raises."""
    try:
        if os.path.isdir(os.path.join(os.path.dirname(os.path.dirname(run_dir)), "queue", "entries")):
            from remote.runs.queue import after_run

            after_run(run_dir)
    except Exception:  # noqa: BLE001 -- the queue is a courtesy here: never the supervisor's end
        pass


def supervise(run_dir, status_fd):
    spec = json.loads(sys.stdin.read() or "{}")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    log_fd = os.open(os.path.join(run_dir, LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    oom_before, t_start = cgroup_oom_kills(), time.monotonic()
    gang = spec.get("gang")
    if gang and gang.get("gloo_ifname") and "GLOO_SOCKET_IFNAME" not in spec["env"]:
        spec["env"]["GLOO_SOCKET_IFNAME"] = _gloo_ifname(gang)
        if not spec["env"]["GLOO_SOCKET_IFNAME"]:
            del spec["env"]["GLOO_SOCKET_IFNAME"]
    try:
        proc = subprocess.Popen(
            ["bash", "-c", spec["command"]], cwd=spec["workdir"], env=spec["env"],
            stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, start_new_session=True, close_fds=True,
        )
    except OSError as exc:
        os.write(status_fd, json.dumps({"error": "%s: %s" % (type(exc).__name__, exc)}).encode())
        os.close(status_fd)
        return 1
    os.close(log_fd)
    trainer_path = spec["env"].get("PATH")
    spec["env"] = None  # drop the secrets from this process as soon as the trainer has them
    st = proc_stat(proc.pid)
    me = proc_stat(os.getpid())
    meta = dict(spec["meta"])
    meta.update({
        "pid": proc.pid, "pgid": proc.pid, "pid_starttime": st[2] if st else None,
        "supervisor_pid": os.getpid(), "supervisor_starttime": me[2] if me else None,
        "boot_id": boot_id(), "started": now_iso(), "started_ts": time.time(),
    })
    write_json(os.path.join(run_dir, META), meta)
    os.write(status_fd, json.dumps({"pid": proc.pid, "pgid": proc.pid, "supervisor_pid": os.getpid()}).encode())
    os.close(status_fd)
    shipper = None
    if (spec.get("outputs") or {}).get("dest"):
        shipper = ShipperWatch(run_dir, spec["outputs"], spec.get("outputs_credentials"), os.path.join(run_dir, LOG))
        shipper.start()
    runship = None
    if (spec.get("outputs") or {}).get("dest"):  # the log and metrics.jsonl beside the checkpoints (runship.py)
        try:
            runship = RunFilesShip(run_dir, meta.get("id") or os.path.basename(run_dir), spec["outputs"],
                                   spec.get("outputs_credentials")).start()
        except Exception:  # noqa: BLE001 -- a courtesy: never the supervisor's end
            runship = None
    notifier = Notifier(run_dir, spec.get("notify"), meta)
    spec["notify"] = None  # the notifier holds the webhook URL (a secret)
    restarts = (meta.get("generation") or {}).get("restarts") or []
    if restarts and isinstance(restarts[-1], dict):  # a new generation of a run that recovers (issue 20)
        notifier.send("restarted", dict(restarts[-1], generation=meta["generation"].get("generation")))
    sampler = _start_sampler(run_dir, spec, proc, meta, notifier, trainer_path)
    spec["outputs_credentials"] = None  # the watcher holds them (for restarts) until its shipper's last exit
    trainer_done: List[int] = []
    watch = _start_gang_watch(run_dir, spec, proc, meta, notifier) if gang else None
    spec["gang"] = None  # the watch holds the secret

    def forward(signum, frame):  # someone ends the supervisor: end the trainer the same way, keep recording
        if trainer_done and shipper is not None:
            shipper.terminate()  # the last pass is under way: the shipper aborts cleanly and records
            return
        try:
            os.killpg(proc.pid, signum)
        except OSError:
            pass

    signal.signal(signal.SIGTERM, forward)
    code = proc.wait()
    trainer_done.append(code)
    end = {"ended": now_iso(), "ended_ts": time.time(), "exit_code": None, "signal": None, "oom_suspected": False}
    if code < 0:
        try:
            end["signal"] = signal.Signals(-code).name
        except ValueError:
            end["signal"] = "signal %d" % -code
    else:
        end["exit_code"] = code
    stop = read_json(os.path.join(run_dir, STOP))
    end["stopped"] = stop is not None
    killed = end["signal"] == "SIGKILL" or code == 128 + signal.SIGKILL
    if killed and stop is None:
        end["oom_suspected"] = True
        source, lines = kernel_oom_words([proc.pid], t_start)
        end["kernel_source"], end["kernel"] = source, lines
        after = cgroup_oom_kills()
        if oom_before is not None and after is not None:
            end["cgroup_oom_kills"] = after - oom_before
    if watch is not None:  # before end.json: a failure reaches the gang at once
        asked = (stop or {}).get("why") or ""
        # dfo stop on this node (not the gang's own stop): the gang ends too, and says it was stopped
        watch.trainer_ended(code, how="stopped" if stop is not None and not asked.startswith("gang failed") else None)
    write_json(os.path.join(run_dir, END), end)
    _queue_next(run_dir)  # its GPUs are free: the node's queue moves on now, before the last pass and alerts
    notifier.send("stopped" if end["stopped"] else "succeeded" if end["exit_code"] == 0 else "failed", end)
    if sampler is not None:
        sampler.stop()  # the log's last training figures and one last sample (after the alert: nvidia-smi may hang)
    if runship is not None:
        runship.finish()
    if watch is not None:
        watch.wait()  # the hub outlives its trainer until every member has ended (done, failed or lost)
        watch.close()
        _write_gang(run_dir, watch)
    if shipper is not None:
        shipper.finish()  # the last pass, after end.json: the run's end is known before the pass ends
        shipper.wait()
    notifier.wait()
    return 0


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1], int(sys.argv[2])))
