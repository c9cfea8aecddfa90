"""Read-only facts about a node (python3 >= 3.8, stdlib only): ``python3 -m remote.env.probe``.

Request: {"paths": {"workspace": str, "shm": str}, "venv_python": str|null, "records": [path...],
"workspace": str|null, "provision_record": job name|null, "job_paths": {field: path},
"installer": {"kind": "uv"|"pip", "python": str, "venv": str}|null}. Every path may start with
``~`` or ``$HOME`` (this user's home, remote.lib.fsutil.node_path); a workspace of null is the node's
default (remote.lib.fsutil.default_workspace).
Data: os, kernel, cpus, memory, python, disk space per path, nvidia-smi GPUs, Triton cache, the
JSON records asked for (e.g. the provision record) when they exist, the user and the workspace
dfo uses, whether this user may write each of the job's paths, and what the job's installer
needs (ensurepip, uv).
"""
from __future__ import annotations

import os
import pwd
import sys

from remote._proto import main
from remote.lib import fastjson as json
from remote.lib.fsutil import default_workspace, home, node_path, which
from remote.lib.fsutil import workspace as resolve_workspace
from remote.lib.triton_cache import cache_dir, dir_size


def _os_release():
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    import platform  # only where /etc/os-release is missing: 1 ms of every probe otherwise

    return platform.platform()


def _meminfo():
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("MemTotal", "MemAvailable"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return {"total": out.get("MemTotal"), "available": out.get("MemAvailable")}


def disk(path):
    """Free space of the filesystem that holds ``path`` (or its nearest existing parent)."""
    p = os.path.abspath(node_path(path))
    probe = p
    while not os.path.exists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError as exc:
        return {"path": p, "exists": False, "error": str(exc)}
    return {
        "path": p,
        "exists": os.path.exists(p),
        "measured_at": probe,
        "total": st.f_blocks * st.f_frsize,
        "free": st.f_bavail * st.f_frsize,
        "writable": os.access(probe, os.W_OK),
    }


def driver_cuda():
    """The CUDA version the driver supports ("13.0"), from libcuda's cuDriverGetVersion (no GPU is touched:
    about 5 ms, where a plain nvidia-smi takes 100 ms on an H200 node); None where libcuda cannot be loaded
    here. It is what nvidia-smi's header shows, except where a CUDA forward-compatibility libcuda comes
    first on the library path (then it is that one's version: what a CUDA program there gets)."""
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
            return None
    except (OSError, AttributeError, ImportError):
        return None
    return cuda_str(v.value)


def cuda_str(version):
    """cuDriverGetVersion's number as CUDA writes it: 12040 -> "12.4", 13000 -> "13.0"; None for none."""
    if version <= 0:
        return None
    return "%d.%d" % (version // 1000, (version % 1000) // 10)


def nvidia():
    exe = which("nvidia-smi")
    if not exe:
        return {"present": False, "gpus": []}
    import subprocess  # here: a node without GPUs never needs it

    q = "index,name,memory.total,compute_cap,driver_version"
    procs = []
    try:
        procs.append(subprocess.Popen([exe, "--query-gpu=" + q, "--format=csv,noheader,nounits"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                      universal_newlines=True))
        cuda = driver_cuda()  # while the query runs
        if cuda is None:  # no libcuda here: nvidia-smi's header says it (a second nvidia-smi, at once)
            try:
                procs.append(subprocess.Popen([exe], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              stdin=subprocess.DEVNULL, universal_newlines=True))
            except OSError:
                pass  # the GPUs are still reported, without the CUDA version
        try:
            out, err = procs[0].communicate(timeout=30)
        except subprocess.TimeoutExpired as exc:
            return {"present": True, "error": str(exc), "gpus": []}
        if procs[0].returncode != 0:
            return {"present": True, "error": (err or out).strip()[-300:], "gpus": []}
        gpus = []
        driver = None
        for line in out.strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 5:
                continue
            driver = parts[4]
            mem = int(parts[2]) * 1024 * 1024 if parts[2].isdigit() else None
            gpus.append({"index": int(parts[0]), "name": parts[1], "memory": mem, "capability": parts[3]})
        if len(procs) > 1:
            try:
                for tok in procs[1].communicate(timeout=30)[0].split("CUDA Version:")[1:2]:
                    cuda = tok.split()[0]
            except subprocess.TimeoutExpired:
                pass
        return {"present": True, "driver": driver, "cuda": cuda, "gpus": gpus}
    except OSError as exc:
        return {"present": True, "error": str(exc), "gpus": []}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def triton_cache():
    path = cache_dir()
    size, files = dir_size(path) if os.path.isdir(path) else (0, 0)
    return {"path": path, "exists": os.path.isdir(path), "bytes": size, "files": files}


def _record(path):
    p = node_path(path)
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- the node's user and paths


def user():
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = "uid %d" % uid
    return {"name": name, "uid": uid, "home": home()}


def workspace_facts(given):
    """The workspace dfo uses here: the one given (``~`` expanded), else the node's default and why."""
    if given:
        return {"path": resolve_workspace(given), "given": given, "default": False, "why": None}
    path, why = default_workspace()
    return {"path": path, "given": None, "default": True, "why": why}


def _owner(st):
    try:
        return pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        return "uid %d" % st.st_uid


def writable(path):
    """Whether this user may write ``path``, or create it: {"path", "ok", "exists", "blocker", "why"}.
    ``blocker`` is the folder that stops it (the path, or its nearest existing parent). A path with a
    ``{placeholder}`` (outputs.path's {run_id}) is judged up to the folder before it."""
    raw = path
    if "{" in path:
        path = path.split("{", 1)[0]
        path = path if path.endswith("/") else os.path.dirname(path)
    p = os.path.abspath(node_path(path) or "/")
    out = {"path": node_path(raw), "ok": True, "exists": os.path.lexists(p), "blocker": None, "why": None}
    probe = p
    while not os.path.lexists(probe) and probe != "/":
        probe = os.path.dirname(probe)
    try:
        st = os.stat(probe)
    except OSError as exc:
        out.update(ok=False, blocker=probe, why=exc.strerror or str(exc))
        return out
    if not os.path.isdir(probe):
        if probe != p:
            out.update(ok=False, blocker=probe, why="%s is a file, not a folder" % probe)
        elif not os.access(probe, os.W_OK):
            out.update(ok=False, blocker=probe, why="owned by %s, mode %o" % (_owner(st), st.st_mode & 0o7777))
        return out
    if not os.access(probe, os.W_OK | os.X_OK):
        out.update(ok=False, blocker=probe, why="owned by %s, mode %o" % (_owner(st), st.st_mode & 0o7777))
    return out


# --------------------------------------------------------------------------- what the job's installer needs

UV_PLACES = ("~/.local/bin/uv", "~/.cargo/bin/uv")  # where uv's own installer puts it (not on a login's PATH)


def find_uv(venv=None):
    """uv on PATH, else where uv's installer puts it, else the venv's own; None without one."""
    found = which("uv")
    if found:
        return found
    for p in list(UV_PLACES) + ([venv.rstrip("/") + "/bin/uv"] if venv else []):
        p = node_path(p)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def interpreter(python):
    """The executable ``python`` names here (a path, or a name on PATH), or None."""
    py = node_path(python or "python3")
    if os.path.isabs(py):
        return py if os.access(py, os.X_OK) else None
    return which(py)


def ensurepip(exe):
    """{"ok": bool, "package": "python3.X-venv", "version": "3.X.Y", "error": str|None} for interpreter
    ``exe``: does ``EXE -m ensurepip --version`` work (what ``EXE -m venv`` needs to give a venv pip)?
    Debian and Ubuntu ship ensurepip apart, in python3.X-venv (the python3-venv package pulls it in)."""
    import subprocess

    version = python_version() if os.path.realpath(exe) == os.path.realpath(sys.executable) else None
    if version is None:
        try:
            r = subprocess.run([exe, "-V"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60,
                               universal_newlines=True, cwd="/")
            version = (r.stdout.split() or ["", "?"])[-1] if r.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            version = None
    xy = ".".join((version or "").split(".")[:2])
    out = {"ok": False, "version": version, "package": "python%s-venv" % xy if xy else "python3-venv", "error": None}
    try:
        r = subprocess.run([exe, "-m", "ensurepip", "--version"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           timeout=60, universal_newlines=True, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["error"] = str(exc)
        return out
    out["ok"] = r.returncode == 0
    if not out["ok"]:
        out["error"] = " | ".join(ln.strip() for ln in r.stdout.strip().splitlines()[-2:])[-300:]
    return out


def installer_needs(job):
    """What the job's provision will need here: a venv made with ``PY -m venv`` needs ensurepip (an
    existing venv needs nothing); installer uv makes it with uv when the node has one, and needs
    ensurepip only to bootstrap uv with pip when it has none."""
    kind, venv = job.get("kind") or "pip", node_path(job.get("venv") or "")
    exe = interpreter(job.get("python"))
    has_venv = bool(venv) and os.path.isfile(os.path.join(venv, "pyvenv.cfg"))
    uv = find_uv(venv) if kind == "uv" else None
    out = {"kind": kind, "python": job.get("python"), "executable": exe, "venv_exists": has_venv, "uv": uv,
           "needs_ensurepip": not has_venv and not (kind == "uv" and uv), "ensurepip": None}
    if exe and out["needs_ensurepip"]:
        out["ensurepip"] = ensurepip(exe)
    return out


def python_version():
    """This interpreter's version as platform.python_version() gives it ("3.11.2", "3.13.0rc1")."""
    return sys.version.split()[0]


def handle(req):
    ws = workspace_facts(req.get("workspace"))
    paths = dict({"workspace": ws["path"]}, **(req.get("paths") or {}))
    venv_python = req.get("venv_python")
    records = {p: _record(p) for p in req.get("records") or []}
    job = req.get("provision_record")
    if job:
        records["provision"] = _record(os.path.join(ws["path"], ".dfo", "provision", "%s.json" % job))
    uname = os.uname()
    return {
        "hostname": uname.nodename,
        "os": _os_release(),
        "kernel": uname.release,
        "arch": uname.machine,
        "cpus": os.cpu_count(),
        "memory": _meminfo(),
        "python": python_version(),
        "python_executable": sys.executable,
        "disk": {name: disk(p) for name, p in paths.items()},
        "nvidia": nvidia(),
        "triton_cache": triton_cache(),
        "venv_python": node_path(venv_python),
        "venv_python_exists": bool(venv_python) and os.access(node_path(venv_python), os.X_OK),
        "records": records,
        "user": user(),
        "workspace": ws,
        "job_paths": {field: writable(p or (ws["path"] if field == "workspace" else ""))
                      for field, p in (req.get("job_paths") or {}).items() if p or field == "workspace"},
        "installer": installer_needs(req["installer"]) if req.get("installer") else None,
    }


def entry():
    """The module's run: ``python3 -m remote.env.probe``, or the controller's ``-c`` launch (agent.module_command)."""
    main(handle)


if __name__ == "__main__":
    entry()
