"""How long dfo takes to start: `dfo --version` against `python3 -c "import click"`, side by side.

    python3 bench/startup.py [-n 20]

Part 1 runs the two commands interleaved N times (after one warm-up each) and prints the median and the
minimum of each and their ratio (goal: at most 1.5x; dfo's own cost over click's is its CLI module and
the command table). Part 2 measures `dfo status` and `dfo tail` up to the point where the first byte
would go to the node: an inventory whose host refuses at once (127.0.0.1 port 1), so each run ends
with exit 4 right after its connect; it prints their wall and CPU time up to that connect() and, from
`python -X importtime`, what they import before it, by top-level package. On a busy machine the CPU
figures are the ones to compare.

`dfo` is the console script beside this Python (a pyenv shim would add its own bash start-up); without
one, the same entry point through `python -c`.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bytecode import compile_trees  # noqa: E402


def dfo_argv() -> list[str]:
    script = Path(sys.executable).parent / "dfo"
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from orchestrator.cli import main; sys.argv[0] = 'dfo'; main()"]


def timed(argv: list[str], expect: int = 0, env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one run; CPU time is what a busy machine changes least."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, timeout=60)
    dt = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != expect:
        raise SystemExit(f"startup: {' '.join(argv)} exited {r.returncode}, expected {expect}: "
                         f"{r.stderr.decode()[-500:]}")
    return dt, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def interleaved(cmds: dict[str, tuple[list[str], int]], n: int,
                env: dict[str, str] | None = None) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in cmds}
    for argv, code in cmds.values():  # warm the page cache and .pyc files
        timed(argv, code, env)
    for _ in range(n):
        for k, (argv, code) in cmds.items():
            out[k].append(timed(argv, code, env))
    return out


def show(runs: dict[str, list[tuple[float, float]]]) -> None:
    for k, v in runs.items():
        w, c = [x[0] for x in v], [x[1] for x in v]
        print(f"  {k:28} wall median {ms(statistics.median(w))}  min {ms(min(w))}   "
              f"cpu median {ms(statistics.median(c))}  min {ms(min(c))}")


def ms(x: float) -> str:
    return f"{x * 1000:6.0f} ms"


# dfo's entry point, with the first socket connect marked on stderr (its time on the monotonic clock,
# which every process on this machine shares)
PROBE = """import socket, sys, time
real = socket.socket.connect
def spy(self, addr):
    if not getattr(spy, "done", False):
        spy.done = True
        sys.stderr.write("dfo-first-connect %r %r\\n" % (time.perf_counter(), time.process_time()))
        sys.stderr.flush()
    return real(self, addr)
socket.socket.connect = spy
from orchestrator.cli import main
main()
"""


def to_connect(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds from starting `dfo ARGS` to its first connect() (it must exit 4: the host
    refuses); CPU is the process's own, up to that point."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=60)
    m = re.search(r"^dfo-first-connect (\S+) (\S+)$", r.stderr, re.M)
    if r.returncode != 4 or m is None:
        raise SystemExit(f"startup: dfo {' '.join(args)} exited {r.returncode}: {r.stderr[-500:]}")
    return float(m.group(1)) - t0, float(m.group(2))


def import_profile(args: list[str], env: dict[str, str]) -> tuple[float, dict[str, float]]:
    """(import time before the first connect, the same by top-level package), from -X importtime
    (self times summed; importtime's own overhead makes these larger than in a plain run)."""
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", PROBE, *args], capture_output=True, text=True,
                       env=env, timeout=60)
    head = r.stderr.split("dfo-first-connect")[0]
    by: dict[str, float] = {}
    for m in re.finditer(r"^import time:\s+(\d+) \|\s+\d+ \| *(\S+)$", head, re.M):
        top = m.group(2).split(".")[0]
        by[top] = by.get(top, 0.0) + int(m.group(1)) / 1e6
    return sum(by.values()), by


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20, help="runs of each command (default 20)")
    # PYTHONPATH=DIR (a `git archive` of another commit's orchestrator/ and remote/) measures that code
    args = ap.parse_args()
    compile_trees(*[d for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d],
                  Path(__file__).resolve().parent.parent)
    dfo = dfo_argv()

    print(f"python {sys.version.split()[0]} ({sys.executable}); dfo: {' '.join(dfo[:1])}; {os.cpu_count()} cores; "
          f"N={args.n}, interleaved")
    runs = interleaved({"dfo --version": ([*dfo, "--version"], 0),
                        "python3 -c 'import click'": ([sys.executable, "-c", "import click"], 0)}, args.n)
    show(runs)
    (a, b) = runs.values()
    for i, what in ((0, "wall"), (1, "cpu")):
        x, y = [r[i] for r in a], [r[i] for r in b]
        print(f"  ratio dfo/click ({what}): median {statistics.median(x) / statistics.median(y):.2f}x, "
              f"min {min(x) / min(y):.2f}x (goal <= 1.5x)")

    with tempfile.TemporaryDirectory(prefix="dfo-startup-") as tmp:
        key = Path(tmp) / "id_ed25519"
        if shutil.which("ssh-keygen"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True,
                           stdin=subprocess.DEVNULL, timeout=30)
        inv = Path(tmp) / "inventory.yaml"
        inv.write_text(f"defaults: {{user: root, identity: {key}, known_hosts: {tmp}/known_hosts}}\n"
                       "hosts:\n  dead: {host: 127.0.0.1, port: 1}\n")
        env = {**os.environ, "HOME": tmp}
        n = max(5, args.n // 2)
        print(f"\nfrom start to the first connect() (the host refuses at once: exit 4), N={n}, interleaved")
        for c in ("status", "tail"):
            argv = ["-i", str(inv), c, "-H", "dead"]
            to_connect(argv, env)  # warm
        times: dict[str, list[tuple[float, float]]] = {"status": [], "tail": []}
        for _ in range(n):
            for c in times:
                times[c].append(to_connect(["-i", str(inv), c, "-H", "dead"], env))
        show({f"dfo {c} to connect": v for c, v in times.items()})
        for c in times:
            total, by = import_profile(["-i", str(inv), c, "-H", "dead"], env)
            top = sorted(by.items(), key=lambda kv: -kv[1])[:12]
            print(f"  imports before dfo {c}'s connect: {ms(total).strip()} (-X importtime self times, ms): "
                  + ", ".join(f"{k} {v * 1000:.0f}" for k, v in top))


if __name__ == "__main__":
    main()
