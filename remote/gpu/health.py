"""The GPU health gate, node side: ``python -m remote.gpu.health`` (``dfo verify-env --health``, ``run.health``).

Run it with the job's python (torch is needed for the measurements; the rest is stdlib). On every GPU of
the node at once, bounded by ``seconds`` (60 by default, for up to 8 GPUs), each figure beside what the
GPU's model should give (remote/gpu/gpu_models.json) and a verdict (remote/gpu/health_verdict.py):

1. before any load (nvidia-smi -q -x): compute processes that are not this job's, memory in use, the GPU
   busy, uncorrected ECC errors, pending page retirement or row remap, the reset state, the power limit
   against the default; XIDs from the kernel log (dmesg, else journalctl -k, else /var/log/kern.log);
   GPUs nvidia-smi lists against those torch sees (CUDA_VISIBLE_DEVICES) and the inventory's count;
2. ``measure`` (default on): one worker process per GPU (remote/gpu/health_worker.py): pinned
   host<->device copies one GPU at a time, then bf16 matmuls and a device copy on every GPU at once while
   nvidia-smi is read under load (clock event reasons, PCIe generation and width), then the P2P matrix,
   ``nvidia-smi topo -m`` / ``nvlink -s`` and an NCCL all-reduce over every GPU (two or more).

Request (stdin JSON, every key optional): {"measure": true, "seconds": 60, "min_fraction": 0.8,
"max_memory_used": 0.05, "path": the trainer's PATH, "env": {CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER,
NCCL_*: the job's}, "expect_gpus": the inventory's gpus, "job": name (its runs' processes are its own),
"matmul_seconds": 3, "matmul_n": 8192, "link_bytes", "copy_bytes", "nccl_bytes"}.
Data: {"ok", "seconds", "measured", "driver", "cuda", "torch", "visible", "gpus": [...], "checks": [...],
"phases": {name: seconds}, "kernel_log": {...}, "problems": [...]} (a failed check is a problem).
"""
from __future__ import annotations

import json
import os
import pwd
import select
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from remote._proto import RemoteError, emit_event, main
from remote.gpu import health_verdict as hv
from remote.gpu.health_smi import (
    SmiError,
    find_tool,
    parse_nvlink_status,
    parse_smi_xml,
    parse_topo,
    parse_xids,
    read_kernel_log,
    run_tool,
)
from remote.gpu.health_table import lookup
from remote.gpu.health_worker import PREFIX

PASS_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")  # and NCCL_*: what the job's run.env may set
AGENT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Worker:
    """One GPU's worker process and its reply lines."""

    def __init__(self, index: int, env: Dict[str, str]) -> None:
        self.index = index
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "remote.gpu.health_worker", str(index)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, env=env)
        self.buf = b""
        self.info: Dict[str, Any] = {}

    def send(self, obj: Dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: recv says so

    def recv(self, deadline: float) -> Optional[Dict[str, Any]]:
        """The next reply, or None: the worker ended or the deadline passed."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                text = line.decode("utf-8", "replace")
                if text.startswith(PREFIX):
                    try:
                        return dict(json.loads(text[len(PREFIX):]))
                    except ValueError:
                        continue
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk

    def stderr_tail(self) -> str:
        try:
            self.err.seek(0)
            lines = [ln for ln in self.err.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""

    def stop(self) -> None:
        """Ask it to end (it finishes the op in hand first)."""
        self.send({"op": "exit"})
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass

    def reap(self, until: float) -> None:
        """Wait for it until ``until``, then kill it (a GPU that hangs holds up nothing after the bound)."""
        try:
            self.proc.wait(timeout=max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


def _owner(pid: Optional[int], job: Optional[str], gate: set) -> Dict[str, Any]:
    """Whose a GPU process is: its user, and ``ours`` "gate" / "job" (a run of this job: DFO_RUN_ID) / None."""
    out: Dict[str, Any] = {"user": None, "ours": None}
    if pid is None:
        return out
    try:
        with open("/proc/%d/status" % pid) as f:
            for ln in f:
                if ln.startswith("Uid:"):
                    uid = int(ln.split()[1])
                    try:
                        out["user"] = pwd.getpwuid(uid).pw_name
                    except KeyError:
                        out["user"] = str(uid)
    except (OSError, ValueError):
        pass  # another pid namespace (a container) or gone
    if pid in gate:
        out["ours"] = "gate"
    elif job:
        try:
            with open("/proc/%d/environ" % pid, "rb") as f:
                env = f.read().split(b"\0")
            run = next((e[len(b"DFO_RUN_ID="):].decode("utf-8", "replace") for e in env
                        if e.startswith(b"DFO_RUN_ID=")), "")
            if run.startswith(job + "-"):
                out["ours"] = "job"
        except OSError:
            pass  # not ours to read: someone else's
    return out


def _options(req: Dict[str, Any]) -> Dict[str, Any]:
    def num(key: str, default: float, lo: float, hi: float) -> float:
        v = req.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise RemoteError("usage", "%s must be a number from %g to %g (got %r)" % (key, lo, hi, v))
        return float(v)
    return {"seconds": num("seconds", 60, 5, 600), "min_fraction": num("min_fraction", 0.8, 0.01, 1.0),
            "max_memory_used": num("max_memory_used", 0.05, 0.0, 1.0),
            "matmul_seconds": num("matmul_seconds", 3.0, 0.2, 60), "matmul_n": int(num("matmul_n", 8192, 256, 32768)),
            "link_bytes": int(num("link_bytes", 256 << 20, 1 << 20, 4 << 30)),
            "copy_bytes": int(num("copy_bytes", 1 << 30, 1 << 20, 16 << 30)),
            "nccl_bytes": int(num("nccl_bytes", 1 << 30, 1 << 20, 16 << 30)),
            "measure": bool(req.get("measure", True)), "expect_gpus": req.get("expect_gpus"),
            "job": req.get("job"), "path": req.get("path") or os.environ.get("PATH")}


class Gate:
    def __init__(self, req: Dict[str, Any]) -> None:
        self.o = _options(req)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.o["seconds"]
        self.env = dict(os.environ)
        for k, v in (req.get("env") or {}).items():
            if k in PASS_ENV or k.startswith("NCCL_"):
                self.env[k] = str(v)
        self.env.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast: the ring/tree bandwidth is measured
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join(x for x in (AGENT_DIR, os.environ.get("PYTHONPATH")) if x)
        self.data: Dict[str, Any] = {"ok": False, "measured": self.o["measure"], "checks": [], "phases": {},
                                     "gpus": [], "visible": self.env.get("CUDA_VISIBLE_DEVICES"), "torch": None,
                                     "driver": None, "cuda": None, "kernel_log": {}}
        self.checks: List[Dict[str, Any]] = self.data["checks"]
        self._phase_t = self.t0
        self.smi_exe = ""
        self.gpus: List[Dict[str, Any]] = []

    def phase(self, name: str) -> None:
        now = time.monotonic()
        self.data["phases"][name] = round(now - self._phase_t, 3)
        self._phase_t = now
        emit_event("health", phase=name, seconds=self.data["phases"][name])

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def by(self, seconds: float) -> float:
        """A reply's deadline: ``seconds`` from now, never past the gate's bound."""
        return min(time.monotonic() + seconds, self.deadline)

    def run(self) -> Dict[str, Any]:
        smi_exe = find_tool("nvidia-smi", self.o["path"])
        if smi_exe is None:
            self.checks.append(hv.check(None, "nvidia_smi", "fail", "no nvidia-smi on the trainer's PATH (%s) nor in "
                                        "/usr/bin, /usr/local/nvidia/bin: no NVIDIA driver here?" % self.o["path"]))
            return self.finish()
        try:
            smi = parse_smi_xml(run_tool(smi_exe, ["-q", "-x"]))
        except SmiError as exc:
            self.checks.append(hv.check(None, "nvidia_smi", "fail", str(exc)))
            return self.finish()
        self.smi_exe = smi_exe
        self.data.update(driver=smi["driver"], cuda=smi["cuda"])
        self.gpus = gpus = smi["gpus"]
        for g in gpus:
            model = lookup(g.get("name"))
            g["model"], g["model_name"] = (model["key"], model["name"]) if model else (None, None)
            for p in g.get("processes") or []:
                p.update(_owner(p.get("pid"), self.o["job"], set()))
        self.data["gpus"] = gpus
        self._busy_again(gpus)
        self.phase("nvidia_smi")
        text, source, why = read_kernel_log(self.o["path"])
        found = parse_xids(text) if text is not None else None
        self.data["kernel_log"] = {"readable": text is not None, "source": source, "why": why,
                                   "xids": (found or [])[-20:]}
        self.phase("kernel_log")
        if not self.o["measure"]:
            self.checks.extend(hv.gpu_count(len(gpus), None, self.o["expect_gpus"], self.data["visible"]))
        for g in gpus:
            self.checks.extend(hv.before_load(g, self.o["max_memory_used"]))
        self.checks.extend(hv.xids(gpus, found, source, why))
        if not gpus:
            self.checks.append(hv.check(None, "gpus", "fail", "nvidia-smi lists no GPU"))
        elif self.o["measure"]:
            self.measure()
        else:
            self.checks.append(hv.check(None, "measure", "skip", "measure: false: no matmul, copy, link or "
                                        "all-reduce figures (nvidia-smi and the kernel log only)"))
        return self.finish()

    def _busy_again(self, gpus: List[Dict[str, Any]]) -> None:
        """A GPU that reads busy is read again a second later, and the lower reading stands: nvidia-smi's
        utilisation averages its last sample period, so work that just ended (a gate run before this one)
        still shows; another tenant's does not stop."""
        busy = [g for g in gpus if (g.get("util_gpu") or 0) > hv.BUSY_UTIL_PCT]
        if not busy:
            return
        time.sleep(1.0)
        try:
            again = {g.get("bus"): g for g in parse_smi_xml(run_tool(self.smi_exe, ["-q", "-x"]))["gpus"]}
        except SmiError:
            return
        for g in busy:
            later = (again.get(g.get("bus")) or {}).get("util_gpu")
            if later is not None:
                g["util_readings"] = [g["util_gpu"], later]
                g["util_gpu"] = min(g["util_gpu"], later)

    # ------------------------------------------------------------------ the measurements
    def measure(self) -> None:
        workers = [Worker(i, self.env) for i in range(len(self.gpus))]
        try:
            self._measure(workers)
        finally:
            for w in workers:
                w.stop()
            until = time.monotonic() + 5
            for w in workers:
                w.reap(until)

    def _by_torch(self, info: Dict[str, Any], i: int) -> Optional[Dict[str, Any]]:
        """The nvidia-smi GPU a worker's torch device is: by UUID, else PCI address, else position."""
        uid = (info.get("uuid") or "").lower().replace("gpu-", "")
        for g in self.gpus:
            if uid and (g.get("uuid") or "").lower().replace("gpu-", "") == uid:
                return g
        for g in self.gpus:
            if info.get("bus") and g.get("bus") == info["bus"]:
                return g
        return self.gpus[i] if self.data["visible"] is None and i < len(self.gpus) else None

    def _measure(self, workers: List[Worker]) -> None:
        until = self.by(60)
        hello = [w.recv(until) for w in workers]
        first = next((h for h in hello if h), None) or {}
        self.data["torch"] = first.get("torch")
        if first.get("error") or not any(h for h in hello):
            why = first.get("error") or workers[0].stderr_tail() or "no answer"
            self.checks.extend(hv.gpu_count(len(self.gpus), None, self.o["expect_gpus"], self.data["visible"]))
            self.checks.append(hv.check(None, "torch", "fail", "the job's python cannot measure: %s" % why))
            return
        count = int(first.get("count") or 0)
        self.checks.extend(hv.gpu_count(len(self.gpus), count, self.o["expect_gpus"], self.data["visible"]))
        live = []
        for w, h in zip(workers, hello):
            if h and h.get("visible"):
                g = self._by_torch(h, w.index)
                if g is not None:
                    w.info, g["torch_index"], g["figures"] = h, w.index, {}
                    live.append((w, g))
        self.phase("workers")
        seen = {id(g) for _, g in live}
        for g in self.gpus:
            if id(g) not in seen:
                self.checks.append(hv.check(g["index"], "measure", "skip", "%s: not measured: the job's torch does "
                                            "not see it" % hv.label(g)))
        if not live:
            return
        for w, g in live:  # one GPU at a time: GPUs behind one PCIe switch would share its uplink
            if self.left() < 20:
                g["figures"]["error"] = "the gate's time bound was reached before the link test"
                continue
            w.send({"op": "link", "bytes": self.o["link_bytes"]})
            r = w.recv(self.by(20)) or {"error": "no answer within 20 s: %s" % w.stderr_tail()}
            g["figures"].update({k: r[k] for k in ("h2d_gbps", "d2h_gbps") if k in r})
            if r.get("error"):
                g["figures"]["error"] = "link: " + r["error"]
        self.phase("link")
        if self.left() < self.o["matmul_seconds"] + 5:
            self.checks.append(hv.check(None, "measure", "fail", "the gate's bound (%.0f s) was reached before the "
                                        "matmuls: the GPUs answered too slowly" % self.o["seconds"]))
            return
        loaded = self._compute(live)
        self.phase("compute")
        for _w, g in live:
            self.checks.extend(hv.under_load(g, loaded.get(g.get("bus") or "")))
            self.checks.extend(hv.measured(g, g["figures"], self.o["min_fraction"], g.get("pcie") or {}))
        self._between(live)

    def _compute(self, live: List[Any]) -> Dict[str, Dict[str, Any]]:
        for w, _ in live:
            w.send({"op": "compute", "seconds": self.o["matmul_seconds"], "n": self.o["matmul_n"],
                    "copy_bytes": self.o["copy_bytes"]})
        until = self.by(30)
        early: Dict[int, Optional[Dict[str, Any]]] = {}
        for w, _ in live:
            r = w.recv(until)  # "started": every GPU is under load
            if r is None or not r.get("started"):
                early[w.index] = r  # it failed before the load began: that is its answer
        time.sleep(min(1.0, self.o["matmul_seconds"] / 2))
        loaded: Dict[str, Dict[str, Any]] = {}
        try:
            for g in parse_smi_xml(run_tool(self.smi_exe, ["-q", "-x"]))["gpus"]:
                loaded[g.get("bus") or ""] = g
        except SmiError as exc:
            self.data["under_load_error"] = str(exc)
        until = self.by(self.o["matmul_seconds"] + 30)
        for w, g in live:
            r = (early[w.index] if w.index in early else w.recv(until)) or {
                "error": "no answer: %s" % w.stderr_tail()}
            for k, v in r.items():
                if k != "error" and k != "copy_error":
                    g["figures"][k] = v
            if r.get("error") or r.get("copy_error"):
                g["figures"]["error"] = "; ".join(x for x in (g["figures"].get("error"), r.get("error"),
                                                             r.get("copy_error") and "copy: " + r["copy_error"]) if x)
        return loaded

    def _between(self, live: List[Any]) -> None:
        if len(live) < 2:
            self.checks.extend(hv.between([g for _, g in live], None, None, None, None, self.o["min_fraction"]))
            return
        topo = nvl = None
        try:
            topo = parse_topo(run_tool(self.smi_exe, ["topo", "-m"]))
            nvl = parse_nvlink_status(run_tool(self.smi_exe, ["nvlink", "-s"]))
        except SmiError as exc:
            self.data["topology_error"] = str(exc)
        w0 = live[0][0]
        w0.send({"op": "p2p"})
        p2p = (w0.recv(self.by(15)) or {}).get("p2p")
        nccl: Optional[Dict[str, Any]] = None
        if self.left() > 10:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            for rank, (w, _) in enumerate(live):
                w.send({"op": "nccl", "rank": rank, "world": len(live), "port": port, "bytes": self.o["nccl_bytes"],
                        "timeout": max(5.0, self.left() - 5)})
            until = self.by(max(5.0, self.left()))
            res = [w.recv(until) or {"error": "no answer: %s" % w.stderr_tail()} for w, _ in live]
            bad = [r["error"] for r in res if r.get("error")]
            if bad:
                nccl = {"error": bad[0], "busbw_gbps": None}
            else:
                slow = max(res, key=lambda r: r["seconds"])  # the all-reduce ends when its slowest rank does
                nccl = dict(slow, sum_right=all(r.get("sum_right") for r in res))
                if not nccl["sum_right"]:
                    nccl = {"error": "the all-reduce gave a wrong sum", "busbw_gbps": None}
        self.data["between"] = {"topology": topo, "nvlink": nvl, "p2p": p2p, "nccl": nccl}
        self.phase("between")
        self.checks.extend(hv.between([g for _, g in live], topo, nvl, p2p, nccl, self.o["min_fraction"]))

    def finish(self) -> Dict[str, Any]:
        fails = [c for c in self.checks if c["verdict"] == "fail"]
        self.data["ok"] = not fails
        self.data["seconds"] = round(time.monotonic() - self.t0, 3)
        self.data["problems"] = [{"kind": "health", "package": None, "found": None if c["value"] is None
                                  else str(c["value"]), "expected": None if c["threshold"] is None
                                  else str(round(c["threshold"], 3)), "message": c["message"]} for c in fails]
        return self.data


def handler(request: Dict[str, Any]) -> Dict[str, Any]:
    if not isinstance(request, dict):
        raise RemoteError("usage", "the request is a JSON object")
    return Gate(request).run()


if __name__ == "__main__":
    main(handler)
