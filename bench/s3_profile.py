"""Where the node-side S3 engines spend their CPU: cProfile of every thread, and CPU seconds per GiB.

    python bench/s3_profile.py [--server seaweedfs,rclone] [--big 4] [--shape down,up] [--top 12] [--runs 1]

One testbed node and the testbed's S3 server (each server given, in turn). The data: --big objects
of 256 MiB, uploaded by boto3 as s3_bench.py does (multipart, 8 MiB parts, composite CRC32) for
``down``, written on the node for ``up``. The engine runs ON the node as dfo runs it
(``python3 -m remote.transfer.sync`` with its request on stdin; ``python3 -m remote.ship.shipper`` for
uploads), under a wrapper that profiles every thread (cProfile per thread, merged) and reads the
process's CPU time (user + system, getrusage). s5cmd runs the same transfer under /usr/bin/time for
its CPU time. Prints, per server and shape: wall, CPU-s per GiB for dfo and s5cmd, and dfo's top
functions by internal time.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import s3_bench  # noqa: E402
import s3_upload_bench  # noqa: E402

from orchestrator.testbed import Testbed  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
BUCKET = s3_bench.BUCKET

WRAPPER = r'''
import cProfile, io, json, os, pstats, resource, runpy, sys, threading, time
profs = []
lock = threading.Lock()
_run = threading.Thread.run
PROF = os.environ.get("BENCH_CPROFILE") == "1"
def run(self):
    if not PROF:
        return _run(self)
    p = cProfile.Profile()
    with lock:
        profs.append(p)
    p.enable()
    try:
        _run(self)
    finally:
        p.disable()
threading.Thread.run = run
mod, out, top = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, os.getcwd())
sys.argv = [mod] + sys.argv[4:]
main = cProfile.Profile()
profs.append(main)
t0 = time.monotonic()
if PROF:
    main.enable()
try:
    runpy.run_module(mod, run_name="__main__")
except SystemExit:
    pass
finally:
    main.disable()
    wall = time.monotonic() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    s = io.StringIO()
    if PROF:
        st = pstats.Stats(profs[0], stream=s)
        for p in profs[1:]:
            try:
                st.add(p)
            except TypeError:
                pass
        st.sort_stats("tottime").print_stats(top)
    with open(out, "w") as f:
        json.dump({"wall": wall, "user": ru.ru_utime, "sys": ru.ru_stime, "stats": s.getvalue()}, f)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="seaweedfs,rclone")
    ap.add_argument("--big", type=int, default=4)
    ap.add_argument("--shape", default="down,up")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--how", default="perf", choices=["perf", "cprofile", "none"],
                    help="perf: perf record of the engine's process (native symbols: hashing, copies, syscalls); "
                    "cprofile: every thread's Python profile (slows it down); none: wall and CPU only")
    args = ap.parse_args()
    for server in args.server.split(","):
        with tempfile.TemporaryDirectory(prefix="dfo-s3prof-", dir="/var/tmp") as tmpd:
            tmp = Path(tmpd)
            with Testbed(tmp / "tb", nodes=1, s3=True, s3_server=server) as tb:
                profile_server(tb, tmp, server, args)


def profile_server(tb: Testbed, tmp: Path, server: str, args: argparse.Namespace) -> None:
    b = s3_upload_bench.UpBench(tb, tmp)
    b.setup(0, args.big if "up" in args.shape else 0)
    b.install_peers(aws=False)
    node_root = tb.workdir / b.node.name / "root"
    (node_root / "bench-prof.py").write_text(WRAPPER)
    shutil.copytree(ROOT / "remote", node_root / "bench-dfo" / "remote",
                    ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    gib = args.big * 256 * MIB / GIB
    assert tb.s3 is not None
    creds = {"access_key": tb.s3.access_key, "secret_key": tb.s3.secret_key, "session_token": None}
    if "down" in args.shape:
        src = tmp / "src"
        s3_bench.make_data(src, 0, args.big)
        s3_bench.upload(tb, src)
        shutil.rmtree(src)
        for r in range(args.runs):
            dest = "/workspace/prof-down"
            req = {"source": f"s3://{BUCKET}/b/", "dest": dest, "endpoint_url": tb.s3.url, "region": tb.s3.region,
                   "credentials": creds, "credentials_mode": "controller", "concurrency": args.concurrency,
                   "part_size_mb": 16, "multipart_threshold_mb": 64, "check_space": True, "what": "data",
                   "workspace": "/workspace"}
            (node_root / "bench-req.json").write_text(json.dumps(req))
            b.sh(f"rm -rf {dest} && mkdir -p {dest} && sync")
            run_prof(b, args, "remote.transfer.sync", "< /root/bench-req.json")
            report(b, server, "sync-data", node_root / "bench-prof.json", gib, args, r == 0)
            b.sh(f"rm -rf {dest} && mkdir -p {dest} && sync")
            wall, cpu = b.timed(f"/root/bench-bin/s5cmd --endpoint-url {tb.s3.url} sync 's3://{BUCKET}/b/*' {dest}/"
                                " >/dev/null")
            print(f"  s5cmd sync: wall {wall:.2f} s, CPU {cpu:.2f} s = {cpu / gib:.2f} CPU-s/GiB", flush=True)
            b.sh(f"rm -rf {dest}")
    if "up" in args.shape:
        for r in range(args.runs):
            prefix = f"prof-up-{r}"
            run_dir = f"/root/bench-run-{prefix}"
            spec = b.spec("b", prefix)
            spec["concurrency"] = args.concurrency
            (node_root / "bench-spec.json").write_text(json.dumps(spec) + "\n")
            time.sleep(max(0.0, b.written + 11 - time.time()))
            b.sh(f"rm -rf {b.DATA}/b/.dfo {run_dir} && mkdir -p {run_dir} && sync")
            run_prof(b, args, "remote.ship.shipper", f"{shlex.quote(run_dir)} < /root/bench-spec.json")
            report(b, server, "upload", node_root / "bench-prof.json", gib, args, r == 0)
            b.check_and_drop(prefix, args.big, args.big * 256 * MIB)
            b.sh(f"rm -rf {b.DATA}/b/.dfo {run_dir} && sync")
            wall, cpu = b.timed(f"/root/bench-bin/s5cmd --endpoint-url {tb.s3.url} cp '{b.DATA}/b/*' "
                                f"s3://{BUCKET}/{prefix}-s5/ >/dev/null")
            print(f"  s5cmd cp: wall {wall:.2f} s, CPU {cpu:.2f} s = {cpu / gib:.2f} CPU-s/GiB", flush=True)
            b.check_and_drop(prefix + "-s5", args.big, args.big * 256 * MIB)


def run_prof(b: s3_upload_bench.UpBench, args: argparse.Namespace, module: str, tail: str) -> None:
    env = "BENCH_CPROFILE=1 " if args.how == "cprofile" else ""
    perf = "perf record -q -F 999 -o /root/bench-perf.data -- " if args.how == "perf" else ""
    b.sh(f"cd /root/bench-dfo && {env}{perf}python3 /root/bench-prof.py {module} /root/bench-prof.json {args.top} "
         f"{tail} > /root/bench-out.txt 2>/root/bench-err.txt || {{ tail -20 /root/bench-err.txt; exit 1; }}")


def report(b: s3_upload_bench.UpBench, server: str, shape: str, path: Path, gib: float, args: argparse.Namespace,
           stats: bool) -> None:
    d = json.loads(path.read_text())
    cpu = d["user"] + d["sys"]
    print(f"[{server}] dfo {shape} {gib:.2f} GiB: wall {d['wall']:.2f} s, CPU {cpu:.2f} s (user {d['user']:.2f},"
          f" sys {d['sys']:.2f}) = {cpu / gib:.2f} CPU-s/GiB", flush=True)
    if stats and args.how == "perf":  # by library first (libcrypto: hashing, libz: CRC32, kernel: copies), then symbols
        for sort, top in (("dso", 6), ("dso,sym", args.top)):
            out = b.sh(f"perf report -q -i /root/bench-perf.data --no-children --sort {sort} --stdio 2>/dev/null"
                       f" | grep -v '^$' | head -{top}").stdout
            print("\n".join("    " + x.strip() for x in out.splitlines()), flush=True)
    elif stats and args.how == "cprofile":
        lines = [x for x in d["stats"].splitlines() if x.strip()]
        start = next((i for i, x in enumerate(lines) if x.strip().startswith("ncalls")), 0)
        print("\n".join("    " + x for x in lines[start:]), flush=True)


if __name__ == "__main__":
    main()
