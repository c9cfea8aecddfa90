"""dfo submit / queue / cancel: the queue on the nodes themselves (issue 36).

Testbed tests: real sshd nodes, GPU counts from the inventory's ``gpus:`` (the testbed has no GPUs),
runs of a stand-in trainer that prints the CUDA_VISIBLE_DEVICES it got and holds its GPUs until a gate
file appears on its node (then ~1 s more). What happened is read from the nodes' own run records
(meta.json: the GPUs and start time; end.json: the end), through the testbed, never through dfo.
Unit tests (no testbed): --set, where a run goes, the node's queue with a stand-in nvidia-smi.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.testbed import Testbed
from tests._cli import cli_env
from tests._cli import dfo as run_dfo

# prints the GPUs it got, holds them until the gate file exists (at most 120 s), then HOLD s more
GATED = """\
import os, sys, time
print("run", os.environ["DFO_RUN_ID"], "CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
      "LR=" + os.environ.get("LR", "-"), flush=True)
gate, hold = sys.argv[1], float(sys.argv[2])
deadline = time.time() + 120
while not os.path.exists(gate) and time.time() < deadline:
    time.sleep(0.05)
time.sleep(hold)
print("done", flush=True)
"""

# every run record under ROOT: its GPUs, start, end, exit code and first log line (JSON on stdout)
COLLECT = r"""
import json, os, sys
root, out = sys.argv[1], {}
for rid in (os.listdir(root) if os.path.isdir(root) else []):
    d = os.path.join(root, rid)
    def j(n):
        try:
            with open(os.path.join(d, n)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None
    m, e = j("meta.json"), j("end.json")
    if m is None:
        continue
    try:
        with open(os.path.join(d, "log")) as f:
            first = f.readline().strip()
    except OSError:
        first = ""
    out[rid] = {"gpus": m.get("gpus"), "start": m.get("started_ts"), "end": (e or {}).get("ended_ts"),
                "exit": (e or {}).get("exit_code"), "line": first, "seq": (m.get("queue") or {}).get("seq")}
print(json.dumps(out))
"""


class Bed:
    """A testbed of N nodes with G GPUs each (inventory gpus:), each node its own workspace, no shared ssh."""

    def __init__(self, tb: Testbed, tmp: Path, gpus: int, laptop: str = "a") -> None:
        self.tb, self.tmp = tb, tmp
        inv = yaml.safe_load(Path(tb.inventory_path).read_text())
        inv["defaults"].update(known_hosts=str(tmp / f"known_hosts-{laptop}"), connect_timeout=3, ssh_persist=0)
        for name, h in inv["hosts"].items():
            h.update(gpus=gpus, workspace=f"/workspace/q-{name}")
        self.inv = tmp / f"inventory-{laptop}.yaml"
        self.inv.write_text(yaml.safe_dump(inv))
        # the laptop's own folders: its record of submits, its caches (another laptop: other folders)
        self.env = cli_env(XDG_STATE_HOME=str(tmp / f"state-{laptop}"), XDG_CACHE_HOME=str(tmp / f"cache-{laptop}"),
                           XDG_RUNTIME_DIR=None)
        (tmp / "train.py").write_text(GATED)

    def job(self, name: str = "sweep", hold: float = 1.0, gpus: int | None = 1, code: Path | None = None,
            **run: Any) -> Path:
        """A job whose runs print their GPUs and hold them until {workspace}/gate exists on the node."""
        doc: dict[str, Any] = {"name": name, "venv": "/usr", "run": {
            "workdir": "/root/qtest", "upload": [] if code else ["train.py"], "wait": 0, "stop_grace": 5,
            "command": f"python3 train.py {{workspace}}/gate {hold}", **({"gpus": gpus} if gpus is not None else {}),
            **run}}
        if code is not None:
            doc["code"] = {"source": str(code)}
        path = self.tmp / f"{name}-{self.inv.stem}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def dfo(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run_dfo(self.inv, *args, env=self.env, timeout=timeout)

    def submit(self, hosts: str, job: Path, *sets: str) -> dict[str, Any]:
        r = self.dfo("submit", "-H", hosts, "-j", str(job), *[a for s in sets for a in ("--set", s)], "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        (host, got), = doc["hosts"].items()
        return dict(got["runs"][0], host=host)

    def gate(self, node: str, open_: bool = True) -> None:
        cmd = f"touch /workspace/q-{node}/gate" if open_ else f"rm -f /workspace/q-{node}/gate"
        r = self.tb.node_exec(node, cmd)
        assert r.returncode == 0, r.stderr

    def runs(self, node: str) -> dict[str, dict[str, Any]]:
        r = self.tb.node_exec(node, f"python3 -c {shlex.quote(COLLECT)} /workspace/q-{node}/.dfo/runs")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)  # type: ignore[no-any-return]

    def wait_ended(self, node: str, count: int, timeout: float = 90) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            runs = self.runs(node)
            if sum(1 for r in runs.values() if r["end"] is not None) >= count or time.monotonic() > deadline:
                return runs
            time.sleep(0.3)

    def laptop_processes(self) -> list[str]:
        """Processes of this machine that talk to these nodes or read this inventory (dfo, its ssh)."""
        marks = [str(self.inv), *(n.address for n in self.tb.nodes)]
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(m in cmd for m in marks) and "nsenter" not in cmd and "sshd" not in cmd:
                found.append(f"{pid}: {cmd}")
        return found


def gpu_overlaps(runs: dict[str, dict[str, Any]]) -> list[str]:
    """Pairs of runs that held one GPU at the same time (none, when the queue works)."""
    bad = []
    by_gpu: dict[int, list[tuple[float, float, str]]] = {}
    for rid, r in runs.items():
        for g in r["gpus"] or []:
            by_gpu.setdefault(g, []).append((r["start"], r["end"] or float("inf"), rid))
    for g, spans in by_gpu.items():
        spans.sort()
        for (_, e1, a), (s2, _, b) in zip(spans, spans[1:], strict=False):
            if s2 < e1:
                bad.append(f"GPU {g}: {a} and {b}")
    return bad


def most_at_once(runs: dict[str, dict[str, Any]]) -> int:
    points = sorted([(r["start"], 1) for r in runs.values()] + [(r["end"] or float("inf"), -1) for r in runs.values()],
                    key=lambda p: (p[0], p[1]))
    now = best = 0
    for _, step in points:
        now += step
        best = max(best, now)
    return best


def cvd_printed(r: dict[str, Any]) -> str:
    return r["line"].split("CUDA_VISIBLE_DEVICES=")[1].split()[0]


# --------------------------------------------------------------------------- on the testbed


@pytest.mark.testbed
def test_ten_one_gpu_runs_on_two_4gpu_nodes_run_8_at_a_time_and_the_queue_goes_on_without_the_laptop(
        make_testbed: Any, tmp_path: Path) -> None:
    bed = Bed(make_testbed(nodes=2, s3=False), tmp_path, gpus=4)
    job = bed.job(hold=1.0)
    placed = [bed.submit("testbed", job, f"run.env.LR=0.{i}") for i in range(10)]
    t_last_submit = time.time()
    # eight start at once, four on each node, each on its own GPU; the ninth and tenth wait, one per node
    assert [p["state"] for p in placed] == ["running"] * 8 + ["queued"] * 2, [(p["host"], p["why"]) for p in placed]
    assert [p["host"] for p in placed[:8]] == ["node-1"] * 4 + ["node-2"] * 4
    assert {p["host"] for p in placed[8:]} == {"node-1", "node-2"} and all(p["position"] == 1 for p in placed[8:])
    for node in ("node-1", "node-2"):
        assert sorted(g for p in placed[:8] if p["host"] == node for g in p["gpus"]) == [0, 1, 2, 3]
    q = bed.dfo("queue", "-H", "testbed", "--json")
    assert q.returncode == 0, q.stderr
    for node, doc in json.loads(q.stdout)["hosts"].items():
        assert doc["gpus"] == 4 and doc["free"] == [] and len(doc["running"]) == 4 and len(doc["queued"]) == 1, node
    # the laptop is gone: no dfo, no ssh of its own to the nodes; the nodes' supervisors go on alone
    assert bed.laptop_processes() == []
    bed.gate("node-1")
    bed.gate("node-2")
    runs = {**bed.wait_ended("node-1", 5), **bed.wait_ended("node-2", 5)}
    assert len(runs) == 10 and all(r["exit"] == 0 for r in runs.values()), runs
    last_two = [runs[p["run"]] for p in placed[8:]]
    assert all(r["start"] > t_last_submit for r in last_two)  # started after the last dfo had exited
    for node in ("node-1", "node-2"):
        mine = {p["run"]: runs[p["run"]] for p in placed if p["host"] == node}
        assert gpu_overlaps(mine) == [] and most_at_once(mine) == 4
        for r in mine.values():  # each run saw exactly the GPU the queue gave it
            assert cvd_printed(r) == ",".join(str(g) for g in r["gpus"]) and len(r["gpus"]) == 1
    assert most_at_once(runs) == 8
    assert [runs[p["run"]]["line"].split("LR=")[1] for p in placed] == [f"0.{i}" for i in range(10)]  # --set
    st = bed.dfo("status", "-H", "testbed", "--json")
    states = [r["state"] for h in json.loads(st.stdout)["hosts"].values() for r in h["runs"]]
    assert sorted(states) == ["succeeded"] * 10


@pytest.mark.testbed
def test_fifo_per_node_and_cancel(make_testbed: Any, tmp_path: Path) -> None:
    bed = Bed(make_testbed(nodes=1, s3=False), tmp_path, gpus=1)
    first = bed.submit("node-1", bed.job("gated", hold=0.5))
    quick = bed.job("quick", hold=0.3)
    bed.gate("node-1", open_=False)
    waiting = [bed.submit("node-1", quick, f"run.env.LR={i}") for i in range(4)]
    assert first["state"] == "running" and first["gpus"] == [0]
    assert [w["position"] for w in waiting] == [1, 2, 3, 4]
    # a queued run is no run yet: tail says so (exit 2), and cancel takes it out
    t = bed.dfo("tail", "-H", "node-1", waiting[1]["run"])
    assert t.returncode == 2 and "is queued here and has not started yet" in t.stderr
    c = bed.dfo("cancel", "-H", "node-1", waiting[1]["run"], "--json")
    assert c.returncode == 0, c.stderr
    got = json.loads(c.stdout)["hosts"]["node-1"]
    assert {k: got[k] for k in ("run", "job", "was", "state", "position")} == {
        "run": waiting[1]["run"], "job": "quick", "was": "queued", "state": "cancelled", "position": 2}
    q = json.loads(bed.dfo("queue", "-H", "node-1", "--json").stdout)["hosts"]["node-1"]
    assert [r["id"] for r in q["queued"]] == [waiting[i]["run"] for i in (0, 2, 3)]
    assert [r["position"] for r in q["queued"]] == [1, 2, 3]
    # an unknown run: exit 2
    assert bed.dfo("cancel", "-H", "node-1", "no-such-run").returncode == 2
    bed.gate("node-1")
    runs = bed.wait_ended("node-1", 4)
    started = sorted((r["start"], rid) for rid, r in runs.items())
    assert [rid for _, rid in started] == [first["run"]] + [waiting[i]["run"] for i in (0, 2, 3)]  # FIFO
    assert waiting[1]["run"] not in runs  # the cancelled one never ran
    assert gpu_overlaps(runs) == []
    # a started run is stopped as dfo stop does; cancelling it again: nothing to cancel
    bed.gate("node-1", open_=False)
    long = bed.submit("node-1", bed.job("long", hold=0.3))
    c = bed.dfo("cancel", "-H", "node-1", long["run"])
    assert c.returncode == 0 and "stopped" in c.stdout, c.stdout + c.stderr
    assert bed.wait_ended("node-1", 5)[long["run"]]["end"] is not None
    c = bed.dfo("cancel", "-H", "node-1", long["run"])
    assert c.returncode == 0 and "nothing to cancel: the run is stopped" in c.stdout


@pytest.mark.testbed
def test_two_laptops_submitting_at_once_never_double_book_a_gpu(make_testbed: Any, tmp_path: Path) -> None:
    tb = make_testbed(nodes=1, s3=False)
    laptops = [Bed(tb, tmp_path, gpus=2, laptop=name) for name in ("a", "b")]
    jobs = {}
    for bed in laptops:  # the same job, the same code.dest, each laptop its own code
        src = tmp_path / f"code-{bed.inv.stem}"
        src.mkdir()
        (src / "train.py").write_text(GATED.replace('"run",', f'"run", "{bed.inv.stem}",'))
        jobs[bed.inv.stem] = bed.job(hold=0.5, code=src)
    laptops[0].gate("node-1", open_=False)
    placed: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
    errors: list[str] = []

    def submit_three(bed: Bed, key: str) -> None:
        try:
            for _ in range(3):
                placed[key].append(bed.submit("node-1", jobs[bed.inv.stem]))
        except BaseException as exc:  # noqa: BLE001 -- said by the test below
            errors.append(repr(exc))

    threads = [threading.Thread(target=submit_three, args=(bed, key)) for bed, key in zip(laptops, "ab", strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert errors == []
    every = placed["a"] + placed["b"]
    running = [p for p in every if p["state"] == "running"]
    assert len(running) == 2 and sorted(g for p in running for g in p["gpus"]) == [0, 1]  # the node's lock decided
    assert sorted(p["position"] for p in every if p["state"] == "queued") == [1, 2, 3, 4]
    laptops[0].gate("node-1")
    runs = laptops[0].wait_ended("node-1", 6)
    assert len(runs) == 6 and all(r["exit"] == 0 for r in runs.values())
    assert gpu_overlaps(runs) == [] and most_at_once(runs) == 2
    for key, bed in zip("ab", laptops, strict=True):  # each run ran the code its own laptop sent
        assert all(runs[p["run"]]["line"].startswith(f"run {bed.inv.stem} ") for p in placed[key])


@pytest.mark.testbed
def test_a_two_gpu_run_waits_for_two_free_gpus_and_is_not_starved_by_one_gpu_runs(make_testbed: Any,
                                                                               tmp_path: Path) -> None:
    bed = Bed(make_testbed(nodes=1, s3=False), tmp_path, gpus=2)
    bed.gate("node-1", open_=False)
    one = bed.job("one", hold=0.5)
    a = bed.submit("node-1", one)
    big = bed.submit("node-1", bed.job("two", hold=0.5, gpus=2))
    behind = [bed.submit("node-1", one, f"run.env.LR={i}") for i in range(3)]
    assert a["state"] == "running" and big["state"] == "queued" and big["position"] == 1
    q = json.loads(bed.dfo("queue", "-H", "node-1", "--json").stdout)["hosts"]["node-1"]
    assert len(q["free"]) == 1 and [r["id"] for r in q["queued"]] == [big["run"]] + [b["run"] for b in behind]
    # one GPU is free, and the one-GPU runs behind the 2-GPU run still wait: nobody passes it
    assert all(b["state"] == "queued" for b in behind)
    bed.gate("node-1")
    runs = bed.wait_ended("node-1", 5)
    r_big = runs[big["run"]]
    assert r_big["gpus"] == [0, 1] and cvd_printed(r_big) == "0,1" and r_big["exit"] == 0
    assert r_big["start"] >= runs[a["run"]]["end"]
    assert all(runs[b["run"]]["start"] >= r_big["end"] for b in behind)
    assert gpu_overlaps(runs) == []


@pytest.mark.testbed
def test_a_lost_node_with_queued_runs_is_named_and_its_runs_move(make_testbed: Any, tmp_path: Path) -> None:
    tb = make_testbed(nodes=2, s3=False)
    bed = Bed(tb, tmp_path, gpus=1)
    bed.gate("node-2", open_=False)
    job = bed.job(hold=0.3)
    first = bed.submit("node-2", job)
    queued = [bed.submit("node-2", job, f"run.env.LR={i}") for i in range(2)]
    assert first["state"] == "running" and [q["state"] for q in queued] == ["queued", "queued"]
    tb.link_down("node-2")
    try:
        r = bed.dfo("queue", "-H", "testbed", timeout=90)
        assert r.returncode == 4, r.stdout + r.stderr
        assert "node-2" in r.stderr and "2 run(s) were queued there" in r.stderr
        assert all(q["run"] in r.stderr for q in queued) and "--requeue-from node-2" in r.stderr
        assert "node-1: 1 GPU (" in r.stdout  # the other host is shown
        m = bed.dfo("submit", "--requeue-from", "node-2", "-H", "node-1", "--json", timeout=90)
        assert m.returncode == 0, m.stderr
        moved = json.loads(m.stdout)["hosts"]["node-1"]["runs"]
        assert [x["run"] for x in moved] == [q["run"] for q in queued]
        assert all(x["requeued_from"] == "node-2" for x in moved)
    finally:
        tb.link_up("node-2")
    bed.gate("node-1")
    runs = bed.wait_ended("node-1", 2)
    assert sorted(runs) == sorted(q["run"] for q in queued) and all(r["exit"] == 0 for r in runs.values())
    assert [runs[q["run"]]["line"].split("LR=")[1] for q in queued] == ["0", "1"]  # as they were submitted
    # node-2 is back: its queue still holds them, and dfo queue says they were moved
    r = bed.dfo("queue", "-H", "node-2")
    assert r.returncode == 0 and r.stdout.count("was requeued to node-1 from this machine") == 2, r.stdout
    for q in queued:
        assert bed.dfo("cancel", "-H", "node-2", q["run"]).returncode == 0
    bed.gate("node-2")
    assert list(bed.wait_ended("node-2", 1)) == [first["run"]]


# --------------------------------------------------------------------------- without a testbed


def test_set_changes_one_field_for_this_run(tmp_path: Path) -> None:
    from orchestrator.config.models import load_job
    from orchestrator.config.overrides import apply_sets
    from orchestrator.errors import ConfigError, UsageError

    p = tmp_path / "j.yaml"
    p.write_text("name: j\nrun: {command: python3 t.py, env: {A: '1'}}\n")
    loaded = load_job(p)
    got = apply_sets(loaded, ["run.env.LR=1.5e-4", "run.gpus=2", "run.command=echo a: b", "outputs.every=30",
                              "run.autotune_guard=true"])
    run = got.job.run
    assert run is not None and run.env == {"A": "1", "LR": "1.5e-4"} and run.gpus == 2
    assert run.command == "echo a: b" and run.autotune_guard is True
    assert loaded.job.run is not None and loaded.job.run.gpus is None  # the file's job is left as it was
    with pytest.raises(ConfigError, match=r"--set run.gpus=-1: run.gpus: input should be greater than or equal"):
        apply_sets(loaded, ["run.gpus=-1"])
    with pytest.raises(ConfigError, match=r"--set run.nope=1: run.nope: unknown field"):
        apply_sets(loaded, ["run.nope=1"])
    with pytest.raises(UsageError, match="expected KEY=VALUE"):
        apply_sets(loaded, ["run.gpus"])
    with pytest.raises(UsageError, match="run.command is not a section"):
        apply_sets(loaded, ["run.command.x=1"])


def test_a_run_goes_where_its_gpus_are_free_else_where_fewest_gpu_runs_wait() -> None:
    from orchestrator.steps.queue import QueuedRow, QueueView, choose

    def v(gpus: int, free: list[int], queued: list[int] = ()) -> QueueView:  # type: ignore[assignment]
        return QueueView(gpus=gpus, free=free, queued=[QueuedRow(id=f"q{i}", needs=n) for i, n in enumerate(queued)])

    # free now: the fewest free GPUs that fit (best fit), -H order on a tie
    assert choose({"a": v(4, [0, 1, 2]), "b": v(4, [3])}, 1, ["a", "b"])[0][0] == "b"
    assert choose({"a": v(4, [0, 1, 2]), "b": v(4, [3])}, 2, ["a", "b"])[0][0] == "a"
    assert choose({"a": v(4, [0]), "b": v(4, [1])}, 1, ["a", "b"])[0][0] == "a"
    # a node with free GPUs but a queue: its first waiting run goes first, so it does not start now
    assert choose({"a": v(4, [0], [2]), "b": v(2, [])}, 1, ["a", "b"])[0][0] == "b"  # 5/4 vs 2/2 GPU-runs per GPU
    # none free: fewest GPU-runs ahead per GPU; a node too small is never chosen
    assert [h for h, _ in choose({"a": v(8, [], [1]), "b": v(4, [], [1])}, 1, ["a", "b"])] == ["a", "b"]
    assert [h for h, _ in choose({"a": v(8, []), "b": v(2, [0, 1])}, 4, ["a", "b"])] == ["a"]
    assert choose({"a": v(2, [0, 1])}, None, ["a"])[0][0] == "a"  # None: all of the node's


def _stand_in_smi(folder: Path, busy_uuid: str) -> None:
    """An nvidia-smi that answers the two queries the queue asks: 4 GPUs, one compute process on one."""
    folder.mkdir()
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$1\" in\n"
                   "  --query-gpu=*) for i in 0 1 2 3; do echo \"$i, GPU-$i\"; done ;;\n"
                   f"  --query-compute-apps=*) echo \"{busy_uuid}, 4242\" ;;\n"
                   "  *) exit 6 ;;\nesac\n")
    smi.chmod(0o755)


def test_the_node_queue_skips_gpus_used_outside_dfo_and_keeps_secrets_only_until_the_start(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """remote/runs/queue_ops.py on this machine (real supervisors, real processes), nvidia-smi a stand-in that
    says GPU 1 has a compute process no dfo run holds, and the GPU count (no gpus: given) is its count."""
    from remote.runs import queue_ops

    _stand_in_smi(tmp_path / "bin", "GPU-1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    ws = tmp_path / "ws"
    gate = tmp_path / "gate"
    (tmp_path / "t.py").write_text(GATED)

    def submit(i: int, gpus: int) -> dict[str, Any]:
        return queue_ops.submit({  # type: ignore[typeddict-item]
            "op": "submit", "workspace": str(ws), "run_id": f"r{i}", "job": "j", "host": "here",
            "command": f"{shlex.quote(sys.executable)} {tmp_path / 't.py'} {gate} 0.2", "workdir": str(tmp_path),
            "env": {}, "secret_env": {"HF_TOKEN": "hf_secret_value"}, "gpus": gpus, "node_gpus": None, "uploads": []})

    got = [submit(0, 2), submit(1, 1), submit(2, 1)]
    assert got[0]["node_gpus"] == 4 and got[0]["gpus"] == [0, 2]  # GPU 1 is someone else's
    assert got[1]["gpus"] == [3] and got[2]["state"] == "queued"
    # the queued run's secret waits on disk, 0600, only until it starts
    secret = ws / ".dfo" / "queue" / "entries" / "r2" / "secret.json"
    assert secret.stat().st_mode & 0o777 == 0o600
    assert "hf_secret_value" not in (ws / ".dfo" / "queue" / "entries" / "r2" / "entry.json").read_text()
    q = queue_ops.queue({"workspace": str(ws)})
    assert q["busy_other"] == [1] and q["free"] == [] and [r["id"] for r in q["queued"]] == ["r2"]
    gate.touch()
    deadline = time.monotonic() + 30
    while not (ws / ".dfo" / "runs" / "r2" / "end.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    meta = json.loads((ws / ".dfo" / "runs" / "r2" / "meta.json").read_text())
    assert meta["gpus"] in ([0], [2], [3]) and meta["env"]["CUDA_VISIBLE_DEVICES"] == str(meta["gpus"][0])
    assert meta["env"]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and meta["secret_env"] == ["HF_TOKEN"]
    assert not secret.parent.exists()


def test_a_push_into_code_dest_between_the_push_and_the_submit_is_caught(tmp_path: Path) -> None:
    """The node copies code.dest into the run's own folder checking each file against the laptop's sha256:
    a file another push changed meanwhile is ``code_changed`` (the laptop pushes and submits again)."""
    import hashlib

    from remote._proto import RemoteError
    from remote.runs import queue_ops

    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "train.py").write_text("print('from the other laptop')\n")
    mine = hashlib.sha256(b"print('mine')\n").hexdigest()
    with pytest.raises(RemoteError) as ei:
        queue_ops.submit({  # type: ignore[typeddict-item]
            "op": "submit", "workspace": str(tmp_path / "ws"), "run_id": "r1", "job": "j", "host": "here",
            "command": "true", "workdir": str(dest), "env": {}, "gpus": 0, "node_gpus": 0, "uploads": [],
            "code": {"dest": str(dest), "files": {"train.py": [mine, 0o644, None]}, "workdir": ""}})
    assert ei.value.kind == "verify" and ei.value.extra.get("code_changed") is True
    assert "train.py is not what this submit pushed" in ei.value.message
    entries = tmp_path / "ws" / ".dfo" / "queue" / "entries"
    assert list(entries.iterdir()) == []  # nothing queued, nothing half-made left
