"""Read-only facts about a node (python3 >= 3.8, stdlib only): ``python3 -m remote.env.probe``.

Request: {"paths": {"workspace": str, "shm": str}, "venv_python": str|null, "records": [path...]}
Data: os, kernel, cpus, memory, python, disk space per path, nvidia-smi GPUs, Triton cache,
the JSON records asked for (e.g. the provision record) when they exist.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys

from remote._proto import main
from remote.lib.triton_cache import cache_dir, dir_size


def _os_release():
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
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
    p = os.path.abspath(os.path.expanduser(path))
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


def nvidia():
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {"present": False, "gpus": []}
    q = "index,name,memory.total,compute_cap,driver_version"
    try:
        r = subprocess.run([exe, "--query-gpu=" + q, "--format=csv,noheader,nounits"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30,
                           universal_newlines=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"present": True, "error": str(exc), "gpus": []}
    if r.returncode != 0:
        return {"present": True, "error": (r.stderr or r.stdout).strip()[-300:], "gpus": []}
    gpus = []
    driver = None
    for line in r.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        driver = parts[4]
        mem = int(parts[2]) * 1024 * 1024 if parts[2].isdigit() else None
        gpus.append({"index": int(parts[0]), "name": parts[1], "memory": mem, "capability": parts[3]})
    cuda = None
    try:
        r2 = subprocess.run([exe], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30,
                            universal_newlines=True)
        for tok in r2.stdout.split("CUDA Version:")[1:2]:
            cuda = tok.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"present": True, "driver": driver, "cuda": cuda, "gpus": gpus}


def triton_cache():
    path = cache_dir()
    size, files = dir_size(path) if os.path.isdir(path) else (0, 0)
    return {"path": path, "exists": os.path.isdir(path), "bytes": size, "files": files}


def _record(path):
    p = os.path.expanduser(path)
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def handle(req):
    paths = req.get("paths") or {}
    venv_python = req.get("venv_python")
    return {
        "hostname": platform.node(),
        "os": _os_release(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "cpus": os.cpu_count(),
        "memory": _meminfo(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "disk": {name: disk(p) for name, p in paths.items()},
        "nvidia": nvidia(),
        "triton_cache": triton_cache(),
        "venv_python": venv_python,
        "venv_python_exists": bool(venv_python) and os.access(os.path.expanduser(venv_python), os.X_OK),
        "records": {p: _record(p) for p in req.get("records") or []},
    }


if __name__ == "__main__":
    main(handle)
