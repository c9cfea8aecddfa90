"""The run record on the node (python3 3.8+, stdlib): where a run's files are, how to read them, and
whether its processes are still the run's.

A run is a folder ``RUNS_ROOT/RUN_ID/`` holding meta.json (what was started: command, job, pids and their
/proc start times, boot id), log (the trainer's stdout+stderr), end.json (how it ended), stop.json (a stop
was asked for), autotune_guard.jsonl and, for a run with ``outputs``, outputs.json (written by
``remote.ship.shipper``: what shipped), shipper.json (written by the supervisor: the shipper's pid, its
restarts) and ship.request (a pass asked for). ``remote.runs.supervisor`` writes meta.json and end.json;
``remote.runs`` (launch, status, tail, stop) and ``remote.runs.logfollow`` read them through this module:

* ``run_state``: running / succeeded / failed / stopped / lost, from the files and /proc;
* ``list_runs``: the runs under a root, newest first;
* ``proc_stat``, ``proc_alive``, ``group_members``, ``leftovers``: is a recorded pid still the run's
  process (same start time, same boot), and which of the run's process group is left;
* ``tail_lines``, ``offset_of_last_lines``, ``offset_of_line``: the log's last lines and byte offsets;
* ``read_json`` / ``write_json`` (durable, 0600), ``now_iso``, ``boot_id``, ``file_size``;
* ``guard_info``: what the autotune guard recorded;
* ``last_rows``: the last sys and train rows of the run's metrics.jsonl (written by remote.runs.metrics).
"""
from __future__ import annotations

import os
import time

from remote.lib import fastjson as json
from remote.lib.fsutil import write_json  # noqa: F401 - the one durable writer (fsync of file and directory), 0600

META = "meta.json"
END = "end.json"
STOP = "stop.json"
LOG = "log"
GUARD_LOG = "autotune_guard.jsonl"
OUTPUTS = "outputs.json"
SHIPPER = "shipper.json"
SHIP_REQUEST = "ship.request"
METRICS = "metrics.jsonl"  # the sampler's rows (remote/runs/metrics.py)


def now_iso(ts=None):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if ts is None else ts))


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def proc_stat(pid):
    """(state letter, pgrp, starttime in clock ticks since boot) of a live pid, or None."""
    try:
        with open("/proc/%d/stat" % int(pid)) as f:
            data = f.read()
    except (OSError, ValueError, TypeError):
        return None
    fields = data.rsplit(")", 1)[-1].split()
    # fields[0] is field 3 (state); pgrp is field 5; starttime is field 22
    try:
        return fields[0], int(fields[2]), int(fields[19])
    except (IndexError, ValueError):
        return None


def proc_alive(pid, starttime):
    """True when ``pid`` is alive, not a zombie, and is the same process (same start time)."""
    if not pid:
        return False
    st = proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    return starttime is None or st[2] == starttime


def group_members(pgid):
    """Pids of live (non-zombie) processes whose process group is ``pgid``."""
    out: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None and st[1] == pgid and st[0] not in ("Z", "X"):
                out.append(int(name))
    return out


def leftovers(meta):
    """Live processes of the run's process group, unless that pgid is no longer the run's."""
    pgid = meta.get("pgid")
    if not pgid or (meta.get("boot_id") and meta.get("boot_id") != boot_id()):
        return []
    leader = proc_stat(pgid)
    if leader is not None and meta.get("pid_starttime") is not None and leader[2] != meta["pid_starttime"]:
        return []  # a new process got the pid and leads its own group: not ours
    return group_members(pgid)  # (Linux never hands out a pid still in use as a pgid)


CHUNK = 65536


def run_state(run_dir, meta=None):
    """(state, meta, end): running / succeeded / failed / stopped / lost."""
    meta = meta if meta is not None else read_json(os.path.join(run_dir, META))
    end = read_json(os.path.join(run_dir, END))
    if end is None and meta is not None:
        same_boot = not meta.get("boot_id") or meta.get("boot_id") == boot_id()
        if same_boot and (proc_alive(meta.get("supervisor_pid"), meta.get("supervisor_starttime"))
                          or proc_alive(meta.get("pid"), meta.get("pid_starttime"))):
            return "running", meta, None
        end = read_json(os.path.join(run_dir, END))  # it may have ended between the two reads
    if end is None:
        return "lost", meta, None
    if end.get("stopped"):
        return "stopped", meta, end
    return ("succeeded" if end.get("exit_code") == 0 else "failed"), meta, end


def list_runs(root, job=None):
    """[(started_ts, run_id, run_dir)] newest first."""
    out: list[tuple[float, str, str]] = []
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in names:
        d = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(d):
            continue
        meta = read_json(os.path.join(d, META))
        if meta is None:
            continue  # a launch that never started its trainer (or is starting right now)
        if job and meta.get("job") != job:
            continue
        out.append((meta.get("started_ts") or os.path.getmtime(d), name, d))
    out.sort(reverse=True)
    return out


def tail_lines(path, n, max_bytes=262144):
    if n <= 0:
        return []
    try:
        start = max(offset_of_last_lines(path, n), os.path.getsize(path) - max_bytes)
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(max_bytes)
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()[-n:]


def offset_of_last_lines(path, n):
    """Byte offset where the last ``n`` lines of ``path`` begin (a final partial line counts as one)."""
    size = os.path.getsize(path)
    if n <= 0:
        return size
    with open(path, "rb") as f:
        end = size
        if size:
            f.seek(size - 1)
            if f.read(1) == b"\n":
                end = size - 1
        count, pos = 0, end
        while pos > 0:
            step = min(CHUNK, pos)
            pos -= step
            f.seek(pos)
            block = f.read(step)
            idx = len(block)
            while True:
                idx = block.rfind(b"\n", 0, idx)
                if idx < 0:
                    break
                count += 1
                if count == n:
                    return pos + idx + 1
    return 0


def offset_of_line(path, lineno):
    """Byte offset where line ``lineno`` (1-based) begins, like ``tail -n +N``."""
    skip, off = max(lineno - 1, 0), 0
    with open(path, "rb") as f:
        while skip:
            block = f.read(CHUNK)
            if not block:
                return off
            i = 0
            while skip:
                j = block.find(b"\n", i)
                if j < 0:
                    break
                skip -= 1
                i = j + 1
            off += i if not skip else len(block)
    return off


def file_size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def guard_info(run_dir, meta):
    if not (meta or {}).get("autotune_guard"):
        return None
    records = []
    try:
        with open(os.path.join(run_dir, GUARD_LOG)) as f:
            for ln in f:
                try:
                    records.append(json.loads(ln))
                except ValueError:
                    pass
    except OSError:
        pass
    installed = any(isinstance(r, dict) and (r.get("installed") is True or r.get("event") == "installed")
                    for r in records)
    return {"enabled": True, "installed": installed, "records": len(records), "last": records[-1] if records else None}


def last_rows(path, max_bytes=65536):
    """The last sys row and the last train row of a metrics.jsonl (None where there is none)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            f.seek(max(0, size - max_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None, None
    sys_row = train = None
    for raw in reversed(lines):
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        if sys_row is None and row.get("kind") == "sys":
            sys_row = row
        if train is None and row.get("kind") == "train":
            train = row
        if sys_row is not None and train is not None:
            break
    return sys_row, train
