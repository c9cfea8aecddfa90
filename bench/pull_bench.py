"""dfo pull of one big file against `ssh HOST cat FILE > file` (issue 23): timed alternately, same run.

    python bench/pull_bench.py [-n 3] [--mib 1024] [--code DIR] [--transports openssh,paramiko]
                               [--before DIR] [--peer-cipher CIPHER] [--parallel] [--parts] [--out FILE]

One testbed node (real sshd in its own network namespace, on this machine). A run on the node writes
one file of --mib MiB of random bytes. Then, for each transport, N times in turn after one warm-up of
each: `dfo pull -H node RUN --to <fresh folder>` (end to end: its status and list calls, the transfer,
fsync, the sha256 read back from disk) and `ssh -F <the same ssh_config> ... HOST cat FILE > file` (the
system client, its own connection each time; dfo's shared connection is up from the warm-up, as it is
for a user within ssh_persist; ``--peer-cipher C``: also `ssh -c C ... cat`, in the same turns). Best
and median wall time of each, their ratio (peer time / dfo time: 1.0x means as fast as ssh cat; the goal
is >= 0.8x) and MB/s. Then the CPU seconds of each: this machine's side (the processes the bench
started), and the whole machine's (/proc/stat), which, since the testbed node runs here, counts both
ends of the transfer: what each tool costs per GiB in all, the bound on two shared cores.

``--parts``: only the CPU per GiB of dfo's own two stages (the node's send, the controller's reader),
without SSH. ``--code DIR``: run the dfo of another checkout (its orchestrator/ and remote/), e.g. main's, for a
"before" figure from the same machine; ``--before DIR``: time that checkout's dfo too, in the same
turns as this one (before and after side by side, under the same load). ``--parallel``: also time 1, 2
and 4 `ssh cat` of ranges of the file at once (each its own connection) against one: does a second SSH
channel buy anything here?
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.bytecode import compile_trees  # noqa: E402
from orchestrator.testbed import Testbed  # noqa: E402


def dfo_argv(code: Path) -> list[str]:
    return [sys.executable, "-c",
            f"import sys; sys.path.insert(0, {str(code)!r}); from orchestrator.cli import main; "
            "sys.argv[0] = 'dfo'; sys.exit(main())"]


CPU: dict[str, list[float]] = {}  # what -> CPU seconds (user + system) of the processes this bench started
MACHINE: dict[str, list[float]] = {}  # what -> CPU seconds the whole machine was busy (both ends: the node is here)


def _machine_busy() -> float:
    """CPU seconds this machine has been busy since boot, all cores (/proc/stat: user, nice, system, irq,
    softirq); 0.0 where there is no /proc/stat. The testbed's node runs on this machine too, so a run's
    difference counts both ends of the transfer (sshd, the node's python, ssh, dfo), and other work."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (1, 2, 3, 6, 7)) / ticks


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed(argv: list[str], env: dict[str, str], stdout: Path | None = None, what: str = "") -> float:
    """Wall seconds of one run; its CPU (this machine's side: dfo's Python and its ssh client, or the
    peer's ssh client; not a ControlMaster that outlives the call, nor the node's side) goes to CPU."""
    t0, c0, m0 = time.perf_counter(), _children_cpu(), _machine_busy()
    with open(stdout, "wb") if stdout is not None else open(os.devnull, "wb") as out:
        r = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, env=env, timeout=900, stdin=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    m1 = _machine_busy()
    if r.returncode != 0:
        raise SystemExit(f"pull_bench: {' '.join(argv)} exited {r.returncode}: {r.stderr.decode()[-600:]}")
    if what:
        CPU.setdefault(what, []).append(_children_cpu() - c0)
        MACHINE.setdefault(what, []).append(m1 - m0)
    return dt


def pair(name: str, a: tuple[str, Callable[[], float]], b: tuple[str, Callable[[], float]], n: int,
         nbytes: int, *more: tuple[str, Callable[[], float]]) -> dict[str, object]:
    """a(), b() (and each of ``more``) in turn n times after a warm-up of each; each ratio is the
    other's time over a's (``ratio_best``/``ratio_median``: b's)."""
    runs = [a, b, *more]
    for _, f in runs:
        f()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(n):
        for (_, f), t in zip(runs, times, strict=True):
            t.append(f())
    ta = times[0]
    out: dict[str, object] = {"what": name}
    mb = nbytes / 1e6
    lines = [name]
    for (nx, _), tx in zip(runs, times, strict=True):
        out[nx] = {"best": min(tx), "median": statistics.median(tx), "all": tx}
        lines.append(f"  {nx:44} best {min(tx):6.2f} s ({mb / min(tx):5.0f} MB/s)  "
                     f"median {statistics.median(tx):6.2f} s")
    for k, ((nx, _), tx) in enumerate(zip(runs[1:], times[1:], strict=True)):
        rb, rm = min(tx) / min(ta), statistics.median(tx) / statistics.median(ta)
        if k == 0:
            out["ratio_best"], out["ratio_median"] = rb, rm
        else:
            out[f"ratio_best {nx}"], out[f"ratio_median {nx}"] = rb, rm
        lines.append(f"  ratio ({nx} time / {a[0]} time): best {rb:.2f}x  median {rm:.2f}x")
    print("\n".join(lines), flush=True)
    return out


NODE_SIDE = """
import os, sys
sys.path.insert(0, sys.argv[1])
from remote.files import pull
st = os.stat(sys.argv[2])
pull.op_send({"op": "send", "root": os.path.dirname(sys.argv[2]), "nonce": "ab" * 16, "files": [
    {"path": os.path.basename(sys.argv[2]), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "offset": 0}]})
"""


def parts(mib: int) -> None:
    """CPU per GiB of each of this checkout's own stages, each in its own process here (no SSH): the
    node's send (read, sha256, write the records) into a pipe, and the controller's reader (records
    into the partial file, fsync, read back, sha256, rename) fed from that pipe. CPU time, not wall:
    the machine's load does not change it much."""
    from orchestrator.steps.pullsink import PullDir, Sink
    from orchestrator.steps.pullwire import RawReader

    work = Path(tempfile.mkdtemp(prefix="dfo-pullparts-"))
    try:
        src = work / "src.bin"
        with open(src, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        st = src.stat()
        d = PullDir(work / "dest", [], "bench")
        sink = Sink(d, [{"path": "x.bin", "size": st.st_size, "mtime_ns": st.st_mtime_ns, "offset": 0}], {}, False,
                    lambda: None)
        reader = RawReader("ab" * 16, sink, "bench")
        c0, r0 = _children_cpu(), resource.getrusage(resource.RUSAGE_SELF)
        proc = subprocess.Popen([sys.executable, "-c", NODE_SIDE, str(ROOT), str(src)], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        while True:
            chunk = os.read(proc.stdout.fileno(), 1 << 20)
            if not chunk:
                break
            reader.feed(chunk)
        proc.wait()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        d.close()
        if sink.done != 1:
            raise SystemExit(f"pull_bench: the parts run did not place the file ({sink.bad})")
        gib = mib / 1024
        node = (_children_cpu() - c0) / gib
        ctl_user, ctl_sys = (r1.ru_utime - r0.ru_utime) / gib, (r1.ru_stime - r0.ru_stime) / gib
        print(f"CPU per GiB of dfo's own stages (no SSH): node send {node:.2f} s, controller reader "
              f"{ctl_user + ctl_sys:.2f} s ({ctl_user:.2f} user, {ctl_sys:.2f} system)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=3)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose dfo is timed (default: this one)")
    ap.add_argument("--transports", default="openssh,paramiko")
    ap.add_argument("--parallel", action="store_true")
    ap.add_argument("--parts", action="store_true", help="only the CPU per GiB of dfo's own stages, without SSH")
    ap.add_argument("--before", type=Path, metavar="DIR",
                    help="also time the dfo of the checkout DIR (e.g. main's, before a change) in the same turns")
    ap.add_argument("--peer-cipher", action="append", default=[], metavar="CIPHER",
                    help="also time the peer with `ssh -c CIPHER` (e.g. aes128-gcm@openssh.com), in the same turns")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    compile_trees(args.code, *([args.before] if args.before else []))
    if args.parts:
        parts(args.mib)
        return
    work = Path(tempfile.mkdtemp(prefix="dfo-pullbench-"))
    env = dict(os.environ, COLUMNS="200")
    cfg = work / "ssh_config"  # no ~/.ssh: the bench's own user config, read by dfo and by the peer's ssh
    cfg.write_text(f"Host *\n  UserKnownHostsFile {work}/user_known_hosts\n")
    env["DFO_SSH_CONFIG"] = str(cfg)
    env.pop("DFO_SSH_TRANSPORT", None)
    nbytes = args.mib << 20
    results: list[dict[str, object]] = []
    try:
        with Testbed(work / "tb", nodes=1, s3=False) as tb:
            node = tb.nodes[0]
            doc = yaml.safe_load(Path(tb.inventory_path).read_text())
            doc["defaults"].update({"known_hosts": str(work / "known_hosts"), "ssh_persist": 600})
            src = work / "src"
            src.mkdir()
            (src / "job.sh").write_text(f"head -c {nbytes} /dev/urandom > big.bin\n")
            job = work / "job.yaml"
            workdir = "/root/pullbench"
            job.write_text(yaml.safe_dump({"name": "pullbench", "venv": "/usr", "code": {"source": "src"},
                                           "run": {"workdir": workdir, "command": "sh job.sh", "wait": 0}}))
            invs = {}
            for t in args.transports.split(","):
                d = dict(doc, defaults=dict(doc["defaults"], transport=t))
                invs[t] = work / f"inventory-{t}.yaml"
                invs[t].write_text(yaml.safe_dump(d))
            first = invs[next(iter(invs))]
            dfo = dfo_argv(args.code)
            r = subprocess.run([*dfo, "-i", str(first), "launch", "-H", node.name, "-j", str(job), "--json"],
                               capture_output=True, text=True, env=env, cwd=work, timeout=300)
            if r.returncode != 0:
                raise SystemExit(f"pull_bench: launch: {r.stderr[-600:]}")
            run = json.loads(r.stdout)["hosts"][node.name]["run"]
            deadline = time.monotonic() + 300
            while True:
                st = subprocess.run([*dfo, "-i", str(first), "status", "-H", node.name, run, "--json"],
                                    capture_output=True, text=True, env=env, timeout=120)
                state = json.loads(st.stdout)["hosts"][node.name]["runs"][0]["state"]
                if state != "running":
                    break
                if time.monotonic() > deadline:
                    raise SystemExit("pull_bench: the writer did not finish")
                time.sleep(1)
            size = tb.node_exec(node, f"stat -c %s {workdir}/big.bin").stdout.strip()
            if size != str(nbytes):
                raise SystemExit(f"pull_bench: the node's file is {size!r} bytes, not {nbytes} ({state})")
            dest = work / "dest"
            count = [0]

            def pull(inv: Path, code: list[str] = dfo, label: str = "") -> float:
                count[0] += 1
                to = dest / f"pull-{count[0]}"
                try:
                    return timed([*code, "-i", str(inv), "pull", "-H", node.name, run, "--to", str(to)], env,
                                 what=f"dfo pull{label} ({inv.stem.split('-')[-1]})")
                finally:
                    shutil.rmtree(to, ignore_errors=True)

            ssh = tb.ssh_argv(node, f"cat {workdir}/big.bin", known_hosts=work / "peer_known_hosts")
            ssh[1:1] = ["-F", str(cfg), "-o", "ControlMaster=no", "-o", "ControlPath=none"]
            peer_file = dest / "peer.bin"
            dest.mkdir(exist_ok=True)

            def cat(cipher: str | None = None) -> float:
                what = "ssh HOST cat FILE > file" + (f" (-c {cipher})" if cipher else "")
                try:
                    return timed(ssh[:1] + ["-c", cipher] + ssh[1:] if cipher else ssh, env, stdout=peer_file,
                                 what=what)
                finally:
                    peer_file.unlink(missing_ok=True)

            peers = [(f"ssh HOST cat FILE > file (-c {c})", lambda c=c: cat(c)) for c in args.peer_cipher]
            for t, inv in invs.items():
                also = [(f"dfo pull, before ({t})",
                         lambda inv=inv: pull(inv, dfo_argv(args.before), ", before"))] if args.before else []
                results.append(pair(f"{args.mib} MiB file: dfo pull ({t}) vs ssh HOST cat FILE > file",
                                    (f"dfo pull ({t})", lambda inv=inv: pull(inv)),  # type: ignore[misc]
                                    ("ssh HOST cat FILE > file", cat), args.n, nbytes, *peers, *also))
            print("CPU seconds on this machine's side per run (median; the node's side and a ControlMaster are "
                  "not counted):")
            for what, secs in CPU.items():
                med = statistics.median(secs)
                print(f"  {what:44} {med:6.2f} s  ({med / (nbytes / 2**30):.2f} s per GiB)")
            print("CPU seconds of the whole machine per run (median; both ends of the transfer, since the node runs "
                  f"here too, on {os.cpu_count()} cores):")
            for what, secs in MACHINE.items():
                med = statistics.median(secs)
                print(f"  {what:44} {med:6.2f} s  ({med / (nbytes / 2**30):.2f} s per GiB)")
            if args.parallel:
                results.append(parallel(tb, node, cfg, work, workdir, nbytes, env, args.n))
            load = os.getloadavg()
            print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} on {os.cpu_count()} cores")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps({"results": results, "cpu": CPU, "machine_cpu": MACHINE,
                                        "load": os.getloadavg()}, indent=1))


def parallel(tb: Testbed, node: object, cfg: Path, work: Path, workdir: str, nbytes: int, env: dict[str, str],
             n: int) -> dict[str, object]:
    """1 ssh of the whole file against k at once, each a 1/k range (dd): each its own connection, or each
    a channel of one shared connection (ControlMaster, as dfo's OpenSSH transport shares one)."""
    control = work / "cm"
    master = tb.ssh_argv(node, known_hosts=work / "peer_known_hosts")  # type: ignore[arg-type]
    master[1:1] = ["-F", str(cfg), "-o", "ControlMaster=yes", "-o", f"ControlPath={control}", "-N", "-f"]
    subprocess.run(master, check=True, env=env, timeout=60)

    def ranges(k: int, shared: bool = False) -> float:
        part = nbytes // k
        procs = []
        t0 = time.perf_counter()
        for j in range(k):
            cmd = f"dd if={workdir}/big.bin bs=1M skip={j * part >> 20} count={part >> 20} status=none"
            argv = tb.ssh_argv(node, cmd, known_hosts=work / "peer_known_hosts")  # type: ignore[arg-type]
            argv[1:1] = ["-F", str(cfg), "-o", "ControlMaster=no", "-o",
                         f"ControlPath={control}" if shared else "ControlPath=none"]
            out = open(work / f"range-{j}", "wb")
            procs.append((subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL, env=env), out))
        for p, out in procs:
            if p.wait(900) != 0:
                raise SystemExit("pull_bench: a range's ssh failed")
            out.close()
        dt = time.perf_counter() - t0
        for j in range(k):
            (work / f"range-{j}").unlink()
        return dt

    res = {}
    for k in (2, 4):
        res[f"{k} connections"] = pair(
            f"parallel streams: {k} ssh connections vs 1", ("1 ssh", lambda: ranges(1)),
            (f"{k} ssh at once", lambda k=k: ranges(k)), n, nbytes)  # type: ignore[misc]
        res[f"{k} channels"] = pair(
            f"parallel streams: {k} channels of one shared connection vs 1", ("1 channel", lambda: ranges(1, True)),
            (f"{k} channels at once", lambda k=k: ranges(k, True)), n, nbytes)  # type: ignore[misc]
    subprocess.run(master[:1] + ["-o", f"ControlPath={control}", "-O", "exit", "x"], env=env, capture_output=True,
                   timeout=30)
    return {"what": "parallel", "k": res}


if __name__ == "__main__":
    main()
