"""`dfo sync-code` against `rsync -a` over ssh and `git ls-files | tar | ssh tar x`, on a testbed node.

    python bench/code_bench.py [--files 5000] [--mb 50] [--repeat 3] [--first-only] [--out bench/results/code.json]

A git repo of --files files and --mb MB in all (sizes spread from 200 B to ~200 KB, in nested
folders, a few executables) is made on this machine. Each tool pushes it to its own folder on
one testbed node, three cases in turn:

* first: the folder on the node is empty, and for dfo the node has never seen dfo: its agent
  cache (~/.cache/dfo on the node) and this machine's record of what the node holds
  (agent-known) are removed before each of these pushes, so dfo's own node code travels too (its
  size is printed; sync-code needs its core part only). The hash cache here stays: the code was
  hashed here before;
* no change: the same tree again;
* one change: one file's content changed here.

Every figure is end to end: the wall time of the whole command as a user runs it (for dfo, a
fresh `python -m orchestrator` (what the `dfo` script runs), its start-up and its own SSH connection included: the
inventory sets ssh_persist 0, so no shared connection outlives a command; for rsync and tar, the
`ssh` client's connection included). Each case is timed --repeat times (a fresh node folder for "first"), the
tools in turn (their order rotates each round), best and median are reported, and the ratios
are dfo / rsync and dfo / tar (lower is better; the goal is at most 1.0x rsync in every case).
tar has no notion of "changed": it sends everything each time.
``--shared`` adds two tools timed in the same rounds: "dfo-shared", dfo with the inventory's default
connection sharing (``ssh_persist`` 60 s: each command runs within the persist window of the one
before, the way a user's edit-push loop runs), and "rsync-shared", rsync over an ssh given the same
sharing (ControlMaster auto, ControlPersist 60 s), so each tool's figure with a shared connection
stands beside the other's, as each without one does.
rsync must be installed here (the testbed node shares this machine's /usr, so it has it too).
Beside the wall times: the CPU time each command used on this machine (user + system of its
processes: a busy machine changes it least), and the floor every tool stands on (`ssh node
true`; a bare python3; python3 importing what dfo's SSH path needs).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.bytecode import compile_trees  # noqa: E402
from orchestrator.testbed import Testbed  # noqa: E402


def make_repo(repo: Path, files: int, total_mb: float, seed: int = 7) -> int:
    rng = random.Random(seed)
    weights = [rng.paretovariate(1.2) for _ in range(files)]
    scale = total_mb * 1e6 / sum(weights)
    for _ in range(20):  # sizes clipped to 200 B .. 2 MB, scaled until they add up to total_mb
        sizes = [max(200, min(int(w * scale), 2_000_000)) for w in weights]
        scale *= total_mb * 1e6 / sum(sizes)
    total = 0
    for i, size in enumerate(sizes):
        d = repo / f"pkg{i % 20}" / f"mod{(i // 20) % 25}"
        d.mkdir(parents=True, exist_ok=True)
        p = d / f"file_{i}.py"
        p.write_bytes(rng.randbytes(size // 2).hex().encode()[:size])
        if i % 97 == 0:
            p.chmod(0o755)
        total += size
    git = ["git", "-c", "user.email=b@b", "-c", "user.name=b"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "bench"], cwd=repo, check=True)
    return total


CPU: dict[str, dict[str, list[float]]] = {}  # tool -> case -> CPU seconds (user + system) of the command


def timed(argv: list[str] | str, env: dict[str, str] | None = None, cwd: Path | None = None) -> float:
    """Wall seconds of one command; its CPU seconds (the command's processes here, user + system)
    go to CPU via ``cpu``. CPU time is what a busy machine changes least."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(argv, shell=isinstance(argv, str), capture_output=True, text=True, env=env, cwd=cwd)
    secs = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    timed.cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)  # type: ignore[attr-defined]
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {argv}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return secs


def floor(ssh: list[str], target: str, n: int) -> dict[str, float]:
    """What any tool pays before its first byte: `ssh node true` (OpenSSH's client start-up, key
    exchange, auth and one exec: what rsync and tar pay) and a bare python3 start here."""
    runs = {"ssh node true": [timed([*ssh, target, "true"]) for _ in range(n)],
            "python3 -c pass": [timed([sys.executable, "-c", "pass"]) for _ in range(n)],
            "python3 -c 'import click, pydantic, paramiko, fabric, rich'":
                [timed([sys.executable, "-c", "import click, pydantic, paramiko, fabric, rich"]) for _ in range(n)]}
    return {k: statistics.median(v) for k, v in runs.items()}


def agent_sizes(dfo_root: Path) -> dict[str, int]:
    """The agent bundles' sizes (bytes as they travel) of the dfo timed: name -> size (an older agent.py
    had one bundle)."""
    code = ("import json, orchestrator.agent as a; s = getattr(a, 'bundle_sizes', None); "
            "print(json.dumps(s() if s else {'remote (all)': len(a.bundle()[1])}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=dfo_root, capture_output=True, text=True, check=True)
    return {k: int(v) for k, v in json.loads(r.stdout).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--mb", type=float, default=50)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dfo-root", default=str(ROOT),
                    help="the dfo checkout whose code is timed (e.g. an export of main, for a before/after)")
    ap.add_argument("--compare-root", help="a second dfo checkout timed in turn too, as dfo-b (before/after)")
    ap.add_argument("--first-only", action="store_true", help="time only the first push (to a fresh node)")
    ap.add_argument("--shared", action="store_true",
                    help="also time dfo and rsync over a shared connection (ControlMaster, 60 s), as dfo-shared "
                         "and rsync-shared")
    ap.add_argument("--out", default=str(ROOT / "bench/results/code.json"))
    args = ap.parse_args()
    compile_trees(args.dfo_root, *([args.compare_root] if args.compare_root else []))
    if not shutil.which("rsync"):
        raise SystemExit("rsync is not installed here (apt-get install rsync)")
    work = Path(tempfile.mkdtemp(prefix="dfo-code-bench-"))
    repo = work / "repo"
    repo.mkdir()
    total = make_repo(repo, args.files, args.mb)
    print(f"repo: {args.files} files, {total / 1e6:.1f} MB in {repo}", flush=True)
    with Testbed(work / "tb", nodes=1, s3=False) as tb:
        node = tb.nodes[0]
        if not tb.use_netns:  # the node's /root would be this machine's: its agent cache is not the bench's to remove
            raise SystemExit("this bench needs the testbed's namespace nodes (root and `ip netns`)")
        inv = yaml.safe_load(Path(tb.inventory_path).read_text())
        # no shared connection outlives a dfo command: each one opens its own, as rsync's ssh does
        inv["defaults"]["ssh_persist"] = 0
        inv_path = work / "inventory.yaml"
        inv_path.write_text(yaml.safe_dump(inv))
        inv["defaults"]["ssh_persist"] = 60  # dfo's default: a shared connection lives 60 s after a command
        shared_inv = work / "inventory-shared.yaml"
        shared_inv.write_text(yaml.safe_dump(inv))
        ssh = tb.ssh_argv(node)[:-1]  # without user@host
        target = tb.ssh_argv(node)[-1]
        ssh_cmd = " ".join(shlex.quote(a) for a in ssh[1:])
        env = dict(os.environ, XDG_CACHE_HOME=str(work / "cache"))
        dfo_root = Path(args.dfo_root).resolve()
        tb.ssh(node, "python3 -c 1")  # host key recorded, node warm

        def dfo_push(dest: str, root: Path | None = None, inventory: Path = inv_path) -> float:
            job = work / "job.yaml"
            job.write_text(yaml.safe_dump({"name": "bench", "venv": "/usr",
                                           "code": {"source": str(repo), "dest": dest}}))
            where = root or dfo_root  # `python -m orchestrator` runs what the dfo script runs (an older tree: .cli)
            module = "orchestrator" if (where / "orchestrator" / "__main__.py").is_file() else "orchestrator.cli"
            return timed([sys.executable, "-m", module, "-i", str(inventory), "sync-code", "-H",
                          node.name, "-j", str(job)], env=env, cwd=root or dfo_root)

        share = ["-o", "ControlMaster=auto", "-o", f"ControlPath={work}/rsync-cm-%C", "-o", "ControlPersist=60"]

        def rsync_push(dest: str, shared: bool = False) -> float:
            tb.node_exec(node, f"mkdir -p {dest}")
            e = "ssh " + ssh_cmd + (" " + " ".join(shlex.quote(a) for a in share) if shared else "")
            return timed(["rsync", "-a", "--delete", "-e", e, f"{repo}/", f"{target}:{dest}/"])

        def tar_push(dest: str) -> float:
            remote = shlex.quote(f"mkdir -p {dest} && tar -xf - -C {dest}")
            return timed(f"git ls-files -z | tar --null -T - -cf - | {shlex.join(ssh)} {target} {remote}", cwd=repo)

        tools: dict[str, Any] = {"dfo": dfo_push, "rsync": rsync_push, "tar": tar_push}
        if args.compare_root:  # another dfo checkout, timed in turn with the others ("dfo-b")
            other = Path(args.compare_root).resolve()
            tools["dfo-b"] = lambda dest: dfo_push(dest, other)
        if args.shared:
            tools["dfo-shared"] = lambda dest: dfo_push(dest, inventory=shared_inv)
            tools["rsync-shared"] = lambda dest: rsync_push(dest, shared=True)
        cases: tuple[str, ...] = ("first",) if args.first_only else ("first", "no change", "one change")
        results: dict[str, dict[str, list[float]]] = {t: {c: [] for c in cases} for t in tools}
        cpu: dict[str, dict[str, list[float]]] = {t: {c: [] for c in cases} for t in tools}
        victim = next(repo.rglob("file_1*.py"))
        order = list(tools)
        for rep in range(args.repeat):
            for name in order[rep % len(order):] + order[:rep % len(order)]:
                push = tools[name]
                dest = f"/root/bench-{name}-{rep}"
                for case in cases:
                    if case == "first" and name.startswith("dfo"):  # a node that never saw dfo, nor this machine it
                        tb.node_exec(node, "rm -rf /root/.cache/dfo", timeout=120)
                        shutil.rmtree(work / "cache" / "dfo" / "agent-known", ignore_errors=True)
                    if case == "one change":
                        victim.write_bytes(victim.read_bytes()[::-1] + str(time.time()).encode())
                    results[name][case].append(push(dest))
                    cpu[name][case].append(timed.cpu)  # type: ignore[attr-defined]
                    print(f"  round {rep + 1}: {name:<6}{case:<11}{results[name][case][-1]:7.3f} s", flush=True)
                tb.node_exec(node, f"rm -rf {dest}", timeout=300)
        base = floor(ssh, target, max(5, args.repeat))
    load = os.getloadavg()
    med = {t: {c: statistics.median(v) for c, v in cs.items()} for t, cs in results.items()}
    best = {t: {c: min(v) for c, v in cs.items()} for t, cs in results.items()}
    cmed = {t: {c: statistics.median(v) for c, v in cs.items()} for t, cs in cpu.items()}
    sizes = agent_sizes(Path(args.dfo_root).resolve())
    print(f"\nwall (median and best of {args.repeat}); CPU here (user + system, median); "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("agent bundles (as they travel): " + ", ".join(f"{k} {v / 1000:.1f} kB" for k, v in sizes.items()))
    if "dfo-b" in results:
        other_sizes = agent_sizes(Path(args.compare_root).resolve())
        print("dfo-b's agent bundles: " + ", ".join(f"{k} {v / 1000:.1f} kB" for k, v in other_sizes.items()))
        for c in cases:
            for what, fig in (("median", med), ("best", best)):
                d, b, r = fig["dfo"][c], fig["dfo-b"][c], fig["rsync"][c]
                print(f"  {c} {what}: dfo-b {b:.3f} s, {b / r:.2f}x rsync; dfo {d:.3f} s, {d / r:.2f}x rsync; "
                      f"dfo / dfo-b {d / b:.2f}x; CPU here (median) dfo-b {cmed['dfo-b'][c]:.3f} s")
    print(f"{'case':<18}{'dfo s':>9}{'rsync s':>9}{'tar s':>9}{'dfo/rsync':>11}{'dfo/tar':>9}"
          f"{'dfo cpu':>9}{'rsync cpu':>10}{'tar cpu':>9}")
    for c in cases:
        for what, fig in (("median", med), ("best", best)):
            d, r, t = fig["dfo"][c], fig["rsync"][c], fig["tar"][c]
            label = f"{c} {what}" if what == "median" else "  best"
            print(f"{label:<18}{d:>9.3f}{r:>9.3f}{t:>9.3f}{d / r:>10.2f}x{d / t:>8.2f}x"
                  + (f"{cmed['dfo'][c]:>9.3f}{cmed['rsync'][c]:>10.3f}{cmed['tar'][c]:>9.3f}" if what == "median"
                     else ""))
    if "dfo-shared" in results:
        print("over a shared connection (ControlMaster, within its 60 s), each command after the one before:")
        print(f"{'case':<18}{'dfo-sh s':>10}{'rsync-sh s':>11}{'dfo-sh/rsync-sh':>16}{'dfo-sh/rsync':>13}")
        for c in cases:
            for what, fig in (("median", med), ("best", best)):
                d, r, r0 = fig["dfo-shared"][c], fig["rsync-shared"][c], fig["rsync"][c]
                label = f"{c} {what}" if what == "median" else "  best"
                print(f"{label:<18}{d:>10.3f}{r:>11.3f}{d / r:>15.2f}x{d / r0:>12.2f}x")
    for k, v in base.items():
        print(f"  floor: {k:<60}{v:.3f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"files": args.files, "bytes": total, "repeat": args.repeat, "load": load,
                               "median_s": med, "best_s": best, "median_cpu_s": cmed, "agent_bytes": sizes,
                               "floor_s": base,
                               "runs_s": results, "cpu_s": cpu}, indent=1) + "\n")
    print(f"\nwritten: {out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
