"""Tail latency and node CPU: `dfo tail` against plain `ssh HOST tail -F`, on a testbed node.

    python bench/tail_bench.py [--rates 20,2000] [--seconds 10] [--out bench/results/tail.json]

Three followers: `dfo tail` (one long-lived remote command streaming framed chunks), plain
`ssh HOST tail -F LOG`, and "poll 1s", the design dfo did not take: a new remote command
(`remote.runs` read from an offset) once a second over the same SSH connection.

For each rate, a writer on the node (started by `dfo launch`) prints lines carrying
``time.time_ns()``, flushing each one, for --seconds. The follower under test prints them on
this machine; the latency of a line is the time it was read from the follower's stdout minus
its stamp (the testbed node shares this machine's clock). Node CPU is the CPU time of the
follower's processes on the node: the follower (``python3 -m remote.runs`` or ``tail``) plus its
per-connection sshd processes, sampled from /proc until they exit. Controller CPU is the
follower's client process here (``dfo tail`` or ``ssh``), from wait4's rusage.

With ``--memory-mb N`` (0 skips it) it also measures the controller's peak RSS (wait4's
ru_maxrss) while ``dfo tail -n +1`` reads, to its end, a log of N MB made on the node in two
shapes: many lines, and one line with no newline (tqdm-style ``\r`` updates), next to
``ssh HOST cat LOG`` reading the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.testbed import Testbed  # noqa: E402

WRITER = """\
import sys, time
rate, seconds, pad = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
time.sleep(float(sys.argv[4]))
n = int(rate * seconds)
t0 = time.perf_counter()
for i in range(n):
    target = t0 + i / rate
    while True:
        now = time.perf_counter()
        if now >= target:
            break
        time.sleep(min(target - now, 0.002))
    sys.stdout.write("%d %d %s\\n" % (i, time.time_ns(), "x" * pad))
    sys.stdout.flush()
"""
TICK = os.sysconf("SC_CLK_TCK")
SSHD_SESSION = re.compile(r"^sshd(-session)?: ")


def stat(pid: int) -> tuple[int, int] | None:
    """(ppid, utime+stime ticks) of a pid, or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[11]) + int(fields[12])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class NodeCpu(threading.Thread):
    """CPU of the follower on the node: new processes in the node's network namespace whose
    cmdline matches ``pattern``, plus new per-connection sshd processes there (its SSH session)."""

    def __init__(self, pattern: str, netns: str, exclude: set[int]) -> None:
        super().__init__(daemon=True)
        self.pattern, self.netns, self.exclude = re.compile(pattern), netns, exclude
        self.last: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in self.exclude:
                    continue
                pid = int(name)
                if pid not in self.names:
                    try:
                        if os.readlink(f"/proc/{pid}/ns/net") != self.netns:
                            self.exclude.add(pid)
                            continue
                    except OSError:
                        continue
                    cmd = cmdline(pid)
                    if not (self.pattern.search(cmd) or SSHD_SESSION.search(cmd)):
                        if cmd:
                            self.exclude.add(pid)
                        continue
                    self.names[pid] = cmd
                st = stat(pid)
                if st is not None:
                    self.last[pid] = st[1]
            time.sleep(0.1)

    def seconds(self) -> float:
        return sum(self.last.values()) / TICK


def follow(argv: list[str], n: int, cpu: NodeCpu, kill_after_all: bool) -> dict[str, float]:
    """Run a follower; time each of the n writer lines as it arrives on its stdout."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    cpu.start()
    lat: list[float] = []
    assert proc.stdout is not None
    for raw in proc.stdout:
        now = time.time_ns()
        parts = raw.split(b" ", 2)
        if len(parts) >= 2 and parts[0].isdigit():
            lat.append((now - int(parts[1])) / 1e6)
            if len(lat) == n and kill_after_all:
                proc.terminate()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    time.sleep(0.3)
    cpu.stop.set()
    cpu.join()
    lat.sort()
    return {"lines": len(lat), "median_ms": statistics.median(lat), "p99_ms": lat[int(0.99 * (len(lat) - 1))],
            "max_ms": lat[-1], "node_cpu_s": cpu.seconds(), "client_cpu_s": usage.ru_utime + usage.ru_stime}


def poll(inv: Path, node: str, run: str, n: int, cpu: NodeCpu, every: float) -> dict[str, float]:
    """The alternative design: one round trip (a new remote command) per ``every`` seconds."""
    from orchestrator.agent import NODE, run_module
    from orchestrator.hosts import HostSession

    cpu.start()
    lat: list[float] = []
    with HostSession(inv, [node]) as sess:
        conn = sess.conn(node)
        offset, pending = 0, b""
        while len(lat) < n:
            t0 = time.monotonic()
            data = run_module(conn, NODE.runs, {"op": "read", "run": run, "offset": offset,
                                                     "max_bytes": 8 << 20, "workspace": conn.host.workspace})
            now = time.time_ns()
            chunk = data["t"].encode() if "t" in data else b""
            offset = data["next_offset"]
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                parts = raw.split(b" ", 2)
                if len(parts) >= 2 and parts[0].isdigit():
                    lat.append((now - int(parts[1])) / 1e6)
            time.sleep(max(0.0, every - (time.monotonic() - t0)))
    time.sleep(0.3)
    cpu.stop.set()
    cpu.join()
    lat.sort()
    return {"lines": len(lat), "median_ms": statistics.median(lat), "p99_ms": lat[int(0.99 * (len(lat) - 1))],
            "max_ms": lat[-1], "node_cpu_s": cpu.seconds(), "client_cpu_s": None}


MEMORY_LOGS = {
    "lines": "yes 'step 123456 loss 0.123456 lr 6.0e-04 tokens/s 123456 grad_norm 0.98765' | head -c {size}",
    "one line": "yes $'step 12345/99999 [=====>    ] 3.21it/s loss=0.1234\\r' | tr -d '\\n' | head -c {size}",
}


# Linux carries the forking process's RSS into a child's ru_maxrss (fork copies the high-water mark and
# exec keeps it), so the measured command is forked from this small wrapper, not from the bench.
MAXRSS_WRAPPER = """\
import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def peak_rss(argv: list[str], work: Path) -> tuple[int, float, int, float]:
    """(exit code, peak RSS in MiB, bytes on stdout, seconds) of a command reading a log to its end."""
    t0 = time.monotonic()
    out = work / "maxrss"
    proc = subprocess.Popen([sys.executable, "-c", MAXRSS_WRAPPER, str(out), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    n = 0
    while block := proc.stdout.read(1 << 20):
        n += len(block)
    code = proc.wait()
    return code, int(out.read_text()) / 1024, n, time.monotonic() - t0


def memory(tb: Testbed, dfo: list[str], work: Path, mb: int) -> list[dict[str, object]]:
    node, out = tb.nodes[0], []
    for shape, cmd in MEMORY_LOGS.items():
        job = work / "mem.yaml"
        job.write_text(yaml.safe_dump({"name": "mem", "run": {"workdir": "/root/bench", "wait": 0,
                                                             "command": cmd.format(size=mb * 1_000_000)}}))
        r = subprocess.run([*dfo, "launch", "-H", node.name, "-j", str(job), "--json"], capture_output=True,
                           text=True, check=True)
        info = json.loads(r.stdout)["hosts"][node.name]
        while json.loads(subprocess.run([*dfo, "status", "-H", node.name, info["run"], "--json"], capture_output=True,
                                        text=True).stdout)["hosts"][node.name]["runs"][0]["state"] == "running":
            time.sleep(0.5)
        for tool, argv in (("dfo tail", [*dfo, "tail", "-H", node.name, info["run"], "-n", "+1"]),
                           ("ssh cat", tb.ssh_argv(node, "cat", info["run_dir"] + "/log"))):
            code, rss, n, secs = peak_rss(argv, work)
            out.append({"tool": tool, "shape": shape, "mb": mb, "exit": code, "peak_rss_mib": round(rss, 1),
                        "stdout_bytes": n, "seconds": round(secs, 1)})
            print(f"{tool:12s} {mb} MB log, {shape:8s}: peak RSS {rss:6.1f} MiB, {n} bytes out in {secs:.1f} s "
                  f"(exit {code})", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="20,2000", help="lines per second to compare at (comma-separated)")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the writer writes at each rate")
    ap.add_argument("--pad", type=int, default=80, help="bytes of padding per line")
    ap.add_argument("--memory-mb", type=int, default=100, help="size of the log for the memory check (0: skip it)")
    ap.add_argument("--out", help="also write the results as JSON here")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dfo-tailbench-"))
    results = []
    with Testbed(work / "tb", nodes=1, s3=False) as tb:
        node = tb.nodes[0]
        (work / "writer.py").write_text(WRITER)
        inv = work / "inventory.yaml"
        doc = yaml.safe_load(Path(tb.inventory_path).read_text())
        doc["defaults"]["known_hosts"] = str(tb.known_hosts)
        inv.write_text(yaml.safe_dump(doc))
        dfo = [sys.executable, "-m", "orchestrator", "-i", str(inv)]
        subprocess.run([*dfo, "status", "-H", node.name], capture_output=True)  # agent upload, host key
        for rate in [float(r) for r in a.rates.split(",")]:
            n = int(rate * a.seconds)
            for tool in ("dfo tail", "ssh tail -F", "poll 1s"):
                job = work / f"w{int(rate)}.yaml"
                job.write_text(yaml.safe_dump({"name": f"w{int(rate)}", "run": {
                    "workdir": "/root/bench", "upload": ["writer.py"], "wait": 0,
                    "command": f"python3 writer.py {rate} {a.seconds} {a.pad} 2.5"}}))
                r = subprocess.run([*dfo, "launch", "-H", node.name, "-j", str(job), "--json"], capture_output=True,
                                   text=True, check=True)
                info = json.loads(r.stdout)["hosts"][node.name]
                log = info["run_dir"] + "/log"
                before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
                netns = tb.node_exec(node, "readlink /proc/self/ns/net").stdout.strip()
                if tool == "dfo tail":
                    res = follow([*dfo, "tail", "-H", node.name, info["run"], "-n", "+1"], n,
                                 NodeCpu(r"-m remote\.runs", netns, before), kill_after_all=False)
                elif tool == "ssh tail -F":
                    res = follow(tb.ssh_argv(node, "tail", "-F", "-n", "+1", log), n,
                                 NodeCpu(r"^tail -F", netns, before), kill_after_all=True)
                else:
                    res = poll(inv, node.name, info["run"], n, NodeCpu(r"-m remote\.runs", netns, before), 1.0)
                res.update(tool=tool, rate=rate, seconds=a.seconds)
                results.append(res)
                client_cpu = "-" if res["client_cpu_s"] is None else f"{res['client_cpu_s']:.2f} s"
                print(f"{tool:12s} {rate:7.0f} lines/s: {res['lines']} lines, "
                      f"latency median {res['median_ms']:.1f} ms, "
                      f"p99 {res['p99_ms']:.1f} ms, max {res['max_ms']:.1f} ms; node CPU {res['node_cpu_s']:.2f} s, "
                      f"client CPU {client_cpu}", flush=True)
                time.sleep(1)
        mem = memory(tb, dfo, work, a.memory_mb) if a.memory_mb > 0 else []
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"results": results, "memory": mem, "argv": sys.argv[1:]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
