"""Helpers for the runs tests: the real dfo CLI against testbed nodes, job files, trainer stand-ins."""

from __future__ import annotations

import contextlib
import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orchestrator.testbed import Node, Testbed
from tests import _cli

# A trainer stand-in: N numbered lines, D seconds apart, then exit with code E.
COUNTER = """\
import sys, time
n, d, code = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0
for i in range(n):
    print("line %06d" % i, flush=True)
    time.sleep(d)
sys.exit(code)
"""

# N numbered lines, D seconds apart, but it holds at line N/2 until the file GATE exists.
GATED_COUNTER = """\
import os, sys, time
n, d, gate = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
for i in range(n):
    while i == n // 2 and not os.path.exists(gate):
        time.sleep(0.05)
    print("line %06d" % i, flush=True)
    time.sleep(d)
"""

# Dies at start with the traceback of Triton's autotuner race (as seen in the real session).
AUTOTUNER_CRASH = """\
import sys
print("loading target model from /dev/shm/Qwen3.6-27B", flush=True)
sys.stderr.write('''Traceback (most recent call last):
  File "/root/train_dflash_online.py", line 412, in <module>
    hs = list(pool.map(target_forward, pairs))
  File "/usr/lib/python3.11/concurrent/futures/_base.py", line 619, in result_iterator
    yield _result_or_cancel(fs.pop())
  File "/root/venv/lib/python3.11/site-packages/triton/runtime/autotuner.py", line 239, in run
    timings = {config: self._bench(*args, config=config, **kwargs) for config in pruned_configs}
  File "/root/venv/lib/python3.11/site-packages/triton/runtime/autotuner.py", line 143, in _bench
    full_nargs = {**self.nargs, **current}
TypeError: 'NoneType' object is not a mapping
''')
sys.exit(1)
"""

# A process tree: the trainer, a child, and a grandchild, all printing their pids; runs until stopped.
TREE = """\
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import os, subprocess, sys, time\\n"
    "g = subprocess.Popen(['sleep', '600'])\\n"
    "print('grandchild', g.pid, flush=True)\\n"
    "time.sleep(600)\\n"])
print("trainer", os.getpid(), flush=True)
print("child", child.pid, flush=True)
while True:
    time.sleep(0.2)
"""


def dfo(inv: Path, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
        ) -> subprocess.CompletedProcess[str]:
    """The real CLI (tests/_cli.py), with ``env`` added to this process's environment."""
    return _cli.dfo(inv, *args, timeout=timeout, env=_cli.cli_env(**(env or {})))


def dfo_popen(inv: Path, *args: str, env: dict[str, str] | None = None, stderr: Any = subprocess.PIPE
              ) -> subprocess.Popen[str]:
    return _cli.dfo_popen(inv, *args, env=_cli.cli_env(**(env or {})), stderr=stderr)


@dataclass
class RunsEnv:
    tb: Testbed
    node: Node
    inv: Path
    tmp: Path

    def job(self, command: str, files: dict[str, str] | None = None, name: str | None = None,
            **run: Any) -> tuple[Path, str]:
        """A job file with a unique name whose run uploads ``files`` to /root/runs-test."""
        name = name or f"t-{secrets.token_hex(3)}"
        for fname, text in (files or {}).items():
            (self.tmp / fname).write_text(text)
        doc = {"name": name, "venv": "/usr", "run": {"workdir": "/root/runs-test", "upload": sorted(files or {}),
                                                     "command": command, "wait": 0, **run}}
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path, name

    def dfo(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return dfo(self.inv, *args, **kw)

    def launch(self, job: Path, *extra: str) -> dict[str, Any]:
        r = self.dfo("launch", "-H", self.node.name, "-j", str(job), "--json", *extra)
        assert r.returncode in (0, 5), r.stderr
        return json.loads(r.stdout)["hosts"][self.node.name]

    def status(self, run: str) -> dict[str, Any]:
        r = self.dfo("status", "-H", self.node.name, run, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["hosts"][self.node.name]["runs"][0]

    def wait_state(self, run: str, states: tuple[str, ...], timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status(run)
            if st["state"] in states or time.monotonic() > deadline:
                return st
            time.sleep(0.3)

    def node_sh(self, cmd: str) -> str:
        r = self.tb.node_exec(self.node, cmd)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def run_file(self, run: str, name: str) -> dict[str, Any]:
        return json.loads(self.node_sh(f"cat /workspace/.dfo/runs/{run}/{name}"))

    def alive(self, pid: int) -> bool:
        """A live, non-zombie process with this pid on the node."""
        r = self.tb.node_exec(self.node, f"cat /proc/{pid}/stat 2>/dev/null")
        return bool(r.stdout) and r.stdout.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def inventory_copy(tb: Testbed, tmp_path: Path) -> Path:
    inv = yaml.safe_load(Path(tb.inventory_path).read_text())
    inv["defaults"]["known_hosts"] = str(tmp_path / "known_hosts")
    inv["defaults"]["connect_timeout"] = 3
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(inv))
    return p


def expected_lines(n: int) -> list[str]:
    return [f"line {i:06d}" for i in range(n)]


@contextlib.contextmanager
def memory_cgroup(limit_mb: int) -> Iterator[str | None]:
    """A child of this process's memory cgroup limited to ``limit_mb`` (cgroup v1 or v2); yields the
    file a shell writes its pid into to join it, or None where no such cgroup can be made here."""
    made: Path | None = None
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, ctrls, path = line.split(":", 2)
            if "memory" in ctrls.split(","):
                base, procs, limits = Path("/sys/fs/cgroup/memory" + path), "tasks", ["memory.limit_in_bytes",
                                                                                        "memory.memsw.limit_in_bytes"]
            elif hid == "0" and not ctrls and Path("/sys/fs/cgroup/cgroup.controllers").exists():
                base, procs, limits = Path("/sys/fs/cgroup" + path), "cgroup.procs", ["memory.max", "memory.swap.max"]
            else:
                continue
            d = base / f"dfo-oom-{secrets.token_hex(3)}"
            try:
                d.mkdir()
            except OSError:
                continue
            made = d
            try:
                (d / limits[0]).write_text(str(limit_mb << 20))
            except OSError:
                continue
            with contextlib.suppress(OSError):
                (d / limits[1]).write_text(str(limit_mb << 20) if "memsw" in limits[1] else "0")
            yield str(d / procs)
            return
        yield None
    finally:
        if made is not None:
            for _ in range(50):  # empty once the killed process is reaped
                try:
                    made.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
