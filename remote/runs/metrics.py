"""The run's metrics sampler (python3 3.8+, stdlib only): a thread of the supervisor that writes
RUN_DIR/metrics.jsonl.

Every ``every`` seconds (run.metrics_every, default 10) it appends one ``sys`` row::

    {"t": 1796186153.3, "kind": "sys", "gpus": [{"i": 0, "util": 100, "mem_used": 1139, ...}],
     "host": {"cpu_pct": 12.5, "load1": 0.9, "mem_used": 2048, "mem_total": 128000, "shm_used": ...,
              "disk_used": ..., "disk_total": ..., "rss": 812}, "xid": []}

GPU figures come from ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` (found on the
trainer's PATH, so run.env can point at another one); a node without it records ``gpus: []`` and the
host figures alone. Memory figures are MiB, power W, clocks MHz, temperatures degrees C. New XID errors
are the kernel log's ``NVRM: Xid`` lines (``dmesg``) that were not there when the run started; ``xid``
is null where the kernel log cannot be read.

Training figures come from the run's log: each new line is matched against run.log_metrics (a name ->
regex with one group) and the default patterns (loss, lr, tok_s, step in ``key value``, ``key=value``
and ``key: value`` forms; ``step 10/500`` also gives ``total``; ``nan``, ``inf`` and ``-inf`` are kept as
such: a diverged run); a line that is a JSON object gives its numeric fields (NaN and Infinity too). The
values of one step are joined into one ``train`` row::

    {"t": 1796186153.3, "kind": "train", "step": 120, "loss": 2.31, "lr": 0.0003, "tok_s": 51234.0}

Bounded: past ``max_bytes`` (default 8 MiB) the file is rewritten (temp name, then rename) with the older
three quarters of its rows thinned to every second one, so a long run stays plottable end to end at a
coarser grain; at most ``TRAIN_ROWS_PER_TICK`` train rows are written per tick (evenly picked, the
newest always). The sampler costs one nvidia-smi call per tick (0.029 CPU s on an H200 node, measured:
bench/results/gpu/smi-h200/env.txt) plus a few /proc reads.

``on_sample(row)`` is called with every sys row (the supervisor's idle check uses it).
"""
import json
import os
import re
import shutil
import subprocess
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from remote.runs.record import METRICS, last_rows  # noqa: F401 - (status reads them without this module)

MAX_BYTES = 8 << 20
TRAIN_ROWS_PER_TICK = 50
LOG_READ_MAX = 4 << 20  # bytes of new log read per tick (a faster log is skipped forward)

GPU_FIELDS: Tuple[Tuple[str, str, Any], ...] = (
    ("index", "i", int), ("uuid", "uuid", str), ("name", "name", str), ("pci.bus_id", "bus", str),
    ("utilization.gpu", "util", float), ("utilization.memory", "mem_util", float),
    ("memory.used", "mem_used", float), ("memory.total", "mem_total", float),
    ("power.draw", "power", float), ("power.limit", "power_limit", float),
    ("temperature.gpu", "temp", float), ("clocks.sm", "sm_clock", float), ("clocks.mem", "mem_clock", float),
    ("clocks.max.sm", "sm_clock_max", float), ("ecc.errors.uncorrected.volatile.total", "ecc_uncorr", float),
    ("clocks_event_reasons.active", "throttle", str),
)
BASIC_FIELDS = 11  # index .. temperature.gpu: what every nvidia-smi of the last decade answers

# a number, or what a diverged trainer prints for one (``loss nan``, ``loss inf``: Python's and torch's
# str of a non-finite float): kept as that float, so that the views show the run diverged
_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?i:nan|inf(?:inity)?)(?![A-Za-z0-9_]))"
_SEP = r"(?:\s*[:=]\s*|\s+)"
DEFAULT_PATTERNS = {
    "loss": r"(?<![A-Za-z0-9_])(?:train[_ ])?loss" + _SEP + _NUM,
    "lr": r"(?<![A-Za-z0-9_])(?:lr|learning[_ ]rate)" + _SEP + _NUM,
    "tok_s": r"(?<![A-Za-z0-9_])(?:tok/s|tokens/s|tok_s|tokens_per_sec(?:ond)?)" + _SEP + _NUM,
    "step": r"(?<![A-Za-z0-9_])(?:step|iter|iteration)" + _SEP + r"(\d+)(?![\d.])",
}
_TOTAL = re.compile(r"(?<![A-Za-z0-9_])(?:step|iter|iteration)" + _SEP + r"\d+\s*/\s*(\d+)")
_XID = re.compile(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+)")


def _num(text, kind):
    text = text.strip()
    if text in ("", "[N/A]", "N/A", "[Not Supported]", "[Unknown Error]") or text.startswith("["):
        return None
    if kind is str:
        return text
    try:
        v = float(text)
    except ValueError:
        return None
    return int(v) if kind is int else v


def parse_gpu_csv(text, fields):
    """Rows of ``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`` as dicts (short names)."""
    out = []
    for ln in text.splitlines():
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) != len(fields):
            continue
        row = {}
        for (_, short, kind), val in zip(fields, parts):
            v = _num(val, kind)
            if v is not None:
                row[short] = v
        if "i" in row:
            out.append(row)
    return out


class GpuReader:
    """nvidia-smi on ``path`` (the trainer's PATH): all fields, or the basic ones where the driver is older."""

    def __init__(self, path=None):
        self.exe = shutil.which("nvidia-smi", path=path)
        self.fields: Tuple[Tuple[str, str, Any], ...] = GPU_FIELDS
        self.dmesg = shutil.which("dmesg", path=path) if self.exe else None
        self.xid_seen: Optional[set] = None

    def read(self):
        if not self.exe:
            return []
        for fields in (self.fields, GPU_FIELDS[:BASIC_FIELDS]):
            try:
                res = subprocess.run([self.exe, "--query-gpu=" + ",".join(f[0] for f in fields),
                                      "--format=csv,noheader,nounits"], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, timeout=20)
            except (OSError, subprocess.SubprocessError):
                return []
            if res.returncode == 0:
                self.fields = fields
                return parse_gpu_csv(res.stdout.decode("utf-8", "replace"), fields)
            if fields is GPU_FIELDS[:BASIC_FIELDS]:
                break
        return []

    def new_xids(self):
        """[{"bus": ..., "xid": N, "line": ...}] logged since the first call; None: the kernel log is unreadable."""
        if not self.dmesg:
            return None
        try:
            res = subprocess.run([self.dmesg], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        if res.returncode != 0:
            return None
        lines = [ln.strip() for ln in res.stdout.decode("utf-8", "replace").splitlines() if "Xid" in ln]
        if self.xid_seen is None:
            self.xid_seen = set(lines)
            return []
        out = []
        for ln in lines:
            if ln in self.xid_seen:
                continue
            self.xid_seen.add(ln)
            m = _XID.search(ln)
            if m:
                out.append({"bus": m.group(1), "xid": int(m.group(2)), "line": ln[-300:]})
        return out


class HostReader:
    def __init__(self, workspace):
        self.workspace = workspace
        self.prev_cpu = None
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def cpu_pct(self):
        try:
            with open("/proc/stat") as f:
                vals = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle, total = vals[3] + (vals[4] if len(vals) > 4 else 0), sum(vals)
        prev, self.prev_cpu = self.prev_cpu, (idle, total)
        if prev is None or total <= prev[1]:
            return None
        return round(100.0 * (1 - (idle - prev[0]) / float(total - prev[1])), 1)

    @staticmethod
    def _df(path):
        try:
            st = os.statvfs(path)
        except OSError:
            return None, None
        total = st.f_blocks * st.f_frsize
        return round((total - st.f_bavail * st.f_frsize) / 1048576.0, 1), round(total / 1048576.0, 1)

    def rss(self, pgid):
        """The trainer's process group's resident memory, in MiB."""
        if not pgid:
            return None
        total = 0
        try:
            names = os.listdir("/proc")
        except OSError:
            return None
        for name in names:
            if not name.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % name) as f:
                    fields = f.read().rsplit(")", 1)[-1].split()
                if int(fields[2]) != pgid:
                    continue
                total += int(fields[21]) * self.page
            except (OSError, ValueError, IndexError):
                continue
        return round(total / 1048576.0, 1)

    def read(self, pgid):
        out: Dict[str, Any] = {"cpu_pct": self.cpu_pct()}
        try:
            out["load1"] = float(open("/proc/loadavg").read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
        mem = {}
        try:
            with open("/proc/meminfo") as f:
                for ln in f:
                    k, _, v = ln.partition(":")
                    if k in ("MemTotal", "MemAvailable"):
                        mem[k] = int(v.split()[0]) / 1024.0
        except (OSError, ValueError):
            pass
        if "MemTotal" in mem:
            out["mem_total"] = round(mem["MemTotal"], 1)
            out["mem_used"] = round(mem["MemTotal"] - mem.get("MemAvailable", 0), 1)
        out["shm_used"], out["shm_total"] = self._df("/dev/shm")
        out["disk_used"], out["disk_total"] = self._df(self.workspace)
        out["rss"] = self.rss(pgid)
        return dict((k, v) for k, v in out.items() if v is not None)


def compile_patterns(user):
    """The default patterns with run.log_metrics over them (a user's name wins)."""
    pats = dict(DEFAULT_PATTERNS)
    pats.update(user or {})
    out = {}
    for name, pat in pats.items():
        try:
            rx = re.compile(pat)
        except re.error:
            continue  # the controller checked them; a bad one is skipped, never fatal on the node
        if rx.groups >= 1:
            out[name] = rx
    return out


def parse_line(line, patterns):
    """The metrics of one log line: {name: number}; a JSON object line gives its numeric fields."""
    s = line.strip()
    vals: Dict[str, Any] = {}
    if s.startswith("{") and s.endswith("}"):
        try:
            doc = json.loads(s)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            for k, v in list(doc.items())[:64]:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    vals[str(k)[:64]] = v
            for alias in ("global_step", "iter", "iteration"):
                if "step" not in vals and alias in vals:
                    vals["step"] = vals[alias]
            return vals
    if len(s) > 4096:
        s = s[:4096]
    for name, rx in patterns.items():
        m = rx.search(s)
        if m:
            try:
                v = float(m.group(1))
            except (ValueError, IndexError, TypeError):
                continue
            vals[name] = int(v) if name == "step" and v.is_integer() else v
    if "step" in vals:
        m = _TOTAL.search(s)
        if m:
            vals["total"] = int(m.group(1))
    return vals


class LogMetrics:
    """Reads the log's new lines each tick; returns the train rows (one per step) they make."""

    def __init__(self, log_path, patterns, start=0):
        self.path, self.patterns, self.offset, self.partial = log_path, patterns, start, b""
        self.step = None

    def poll(self, now):
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return []
        if size < self.offset:  # truncated: read on from its start
            self.offset, self.partial = 0, b""
        if size - self.offset > LOG_READ_MAX:
            self.offset, self.partial = size - LOG_READ_MAX, b""
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()[-65536:]
        rows: List[Dict[str, Any]] = []
        for raw in lines:
            vals = parse_line(raw.decode("utf-8", "replace"), self.patterns)
            if "step" in vals:
                self.step = vals.pop("step")
            if not [k for k in vals if k != "total"]:
                continue  # a step alone: the step the next values belong to
            if rows and rows[-1]["step"] == self.step:
                rows[-1].update(vals)
            else:
                rows.append(dict(vals, t=round(now, 3), kind="train", step=self.step))
        return rows


def thin(rows, n):
    """At most ``n`` rows, evenly picked, the last always kept."""
    if len(rows) <= n:
        return rows
    stride = len(rows) / float(n)
    picked = [rows[int(i * stride)] for i in range(n - 1)]
    return picked + [rows[-1]]


def downsample(path, max_bytes):
    """Past ``max_bytes``: the older three quarters of the rows thinned to every second one (temp, rename)."""
    try:
        if os.path.getsize(path) <= max_bytes:
            return False
        with open(path, "rb") as f:
            rows = f.read().splitlines(True)
    except OSError:
        return False
    cut = len(rows) * 3 // 4
    kept = rows[:cut][::2] + rows[cut:]
    tmp = "%s.tmp%d" % (path, os.getpid())
    with open(tmp, "wb") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return True


class Sampler(object):
    """The supervisor's sampler thread. ``spec``: {every, log_metrics, max_bytes}; ``path``: the trainer's PATH."""

    def __init__(self, run_dir: str, spec: Dict[str, Any], pgid: int, workspace: str, path: Optional[str] = None,
                 on_sample: Optional[Callable[[Dict[str, Any]], None]] = None) -> None:
        self.run_dir, self.pgid = run_dir, pgid
        self.every = float(spec.get("every") or 10)
        self.max_bytes = int(spec.get("max_bytes") or MAX_BYTES)
        self.out = os.path.join(run_dir, METRICS)
        self.gpu = GpuReader(path)
        self.host = HostReader(workspace)
        self.log = LogMetrics(os.path.join(run_dir, "log"), compile_patterns(spec.get("log_metrics")))
        self.on_sample = on_sample
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="dfo-metrics", daemon=True)
        self.cpu_s = 0.0  # this thread's CPU time plus its children's (nvidia-smi, dmesg), for the record

    def start(self):
        self.host.cpu_pct()  # the baseline of the first row's CPU figure
        self.gpu.new_xids()  # the baseline: XIDs already logged are not this run's
        self.thread.start()
        return self

    def stop(self, final=True):
        self.stopped.set()
        self.thread.join(timeout=30)
        if final:
            self.tick()  # the last train values and one last sample, after the trainer ended

    def _loop(self):
        while not self.stopped.wait(self.every):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 -- metrics are a courtesy: never end the supervisor
                pass

    def tick(self):
        t0 = time.thread_time()
        c0 = os.times()
        now = time.time()
        rows = thin(self.log.poll(now), TRAIN_ROWS_PER_TICK)
        sample: Dict[str, Any] = {"t": round(now, 3), "kind": "sys", "gpus": self.gpu.read(),
                                  "host": self.host.read(self.pgid)}
        if self.gpu.exe:
            sample["xid"] = self.gpu.new_xids()
        rows.append(sample)
        data = "".join(json.dumps(r, separators=(",", ":"), sort_keys=True) + "\n" for r in rows)
        fd = os.open(self.out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)
        downsample(self.out, self.max_bytes)
        c1 = os.times()
        self.cpu_s += (time.thread_time() - t0) + (c1[2] - c0[2]) + (c1[3] - c0[3])
        if self.on_sample is not None:
            self.on_sample(sample)
        return rows
