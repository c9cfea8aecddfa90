"""Gangs (issue 13) end to end on the testbed: one run over 3 real sshd nodes (network namespaces),
launched as one with launcher: none and a stdlib stand-in trainer (no torch needed).

One run id, each node's rank and addresses, a merged tail; a failing node ends the others with no
controller attached; a vanished node ends the others and shows as lost; a node whose provision
record differs is refused before any launch (exit 3).

The provision records are written into each node's workspace in the layout remote/env/provision.py
writes (tests/test_provision.py covers provision itself): the gang's preflight only reads them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.demo.data import write_data, write_model
from orchestrator.demo.setup import DEFAULT_WHEELS
from orchestrator.testbed import Testbed
from tests._runs_fixtures import dfo, inventory_copy
from tests.conftest import start_testbed

pytestmark = pytest.mark.testbed

# The stand-in trainer: says who it is, then runs; the rank named by FAIL_RANK exits 1 after a moment.
NODE = """\
import os, sys, time
e = os.environ
print("rank=%s of %s run=%s addrs=%s master=%s:%s" % (e["DFO_NODE_RANK"], e["DFO_NUM_NODES"], e["DFO_RUN_ID"],
      e["DFO_NODE_ADDRS"], e["MASTER_ADDR"], e["MASTER_PORT"]), flush=True)
if e["DFO_NODE_RANK"] == e.get("FAIL_RANK"):
    time.sleep(3)
    print("rank %s fails now" % e["DFO_NODE_RANK"], flush=True)
    sys.exit(1)
for i in range(int(e.get("STEPS", "2"))):
    print("step %d" % i, flush=True)
    time.sleep(1)
"""


@pytest.fixture(scope="module")
def tb3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    tb = start_testbed(tmp_path_factory.mktemp("gang3"), nodes=3, s3=False)
    try:
        yield tb
    finally:
        tb.stop()


def provision_record(tb: Testbed, node: str, job: str, torch: str = "2.11.0") -> None:
    rec = {"ok": True, "python": "3.12.3", "packages_after": {"torch": torch, "numpy": "2.3.0"},
           "finished": "2026-11-30T20:00:00Z"}
    r = tb.node_exec(node, f"mkdir -p /workspace/.dfo/provision && printf '%s' '{json.dumps(rec)}' "
                           f"> /workspace/.dfo/provision/{job}.json")
    assert r.returncode == 0, r.stderr


def gang_job(tb: Testbed, tmp: Path, torch: dict[str, str] | None = None, **env: str) -> tuple[Path, str]:
    name = f"g-{secrets.token_hex(3)}"
    (tmp / "node.py").write_text(NODE)
    doc = {"name": name, "venv": "/usr",
           "run": {"workdir": "/root/gang-test", "upload": ["node.py"], "command": "python3 node.py", "wait": 0,
                   "nodes": len(tb.nodes), "launcher": "none", "rdzv_port": 29400 + secrets.randbelow(500) * 2,
                   "stop_grace": 5, "env": env}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    for n in tb.nodes:
        provision_record(tb, n.name, name, (torch or {}).get(n.name, "2.11.0"))
    return path, name


def status(inv: Path, run: str, timeout: float = 60) -> tuple[int, dict[str, Any]]:
    r = dfo(inv, "status", "-H", "testbed", run, "--json", timeout=timeout)
    return r.returncode, json.loads(r.stdout)


def wait_gang_ended(inv: Path, run: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        _, doc = status(inv, run)
        if doc["gang"]["state"] != "running" and all(
                (h.get("runs") or [{}])[0].get("state") != "running" for h in doc["hosts"].values()):
            return doc
        assert time.monotonic() < deadline, f"the gang did not end within {timeout}s: {doc}"
        time.sleep(1)


def ended_ts(tb: Testbed, node: str, run: str) -> float:
    r = tb.node_exec(node, f"cat /workspace/.dfo/runs/{run}/end.json")
    assert r.returncode == 0, r.stderr
    return float(json.loads(r.stdout)["ended_ts"])


def test_a_gang_has_one_run_id_each_node_its_rank_and_tail_merges_them(tb3: Testbed, tmp_path: Path) -> None:
    inv = inventory_copy(tb3, tmp_path)
    job, _ = gang_job(tb3, tmp_path)
    r = dfo(inv, "launch", "-H", "testbed", "-j", str(job), "--json")
    assert r.returncode == 0, r.stderr
    hosts = json.loads(r.stdout)["hosts"]
    names = [n.name for n in tb3.nodes]
    assert list(hosts) == names
    run = hosts[names[0]]["run"]
    assert [hosts[h]["run"] for h in names] == [run] * 3
    assert [hosts[h]["rank"] for h in names] == [0, 1, 2]
    t = dfo(inv, "tail", "-H", "testbed", run, "-n", "+1", timeout=120)
    assert t.returncode == 0, t.stdout + t.stderr
    addrs = ",".join(n.address for n in tb3.nodes)
    for rank, n in enumerate(tb3.nodes):
        mine = [ln for ln in t.stdout.splitlines() if ln.startswith(f"[{n.name}] ")]
        assert mine == [f"[{n.name}] rank={rank} of 3 run={run} addrs={addrs} master={tb3.nodes[0].address}:"
                        f"{yaml.safe_load(job.read_text())['run']['rdzv_port']}", f"[{n.name}] step 0",
                        f"[{n.name}] step 1"], t.stdout
    code, doc = status(inv, run)
    assert code == 0
    assert doc["gang"]["run"] == run and doc["gang"]["state"] == "succeeded" and doc["gang"]["first_failure"] is None
    meta = json.loads(tb3.node_exec(names[1], f"cat /workspace/.dfo/runs/{run}/meta.json").stdout)
    assert meta["gang"]["rank"] == 1 and meta["gang"]["nodes"] == 3
    assert "secret" not in meta["gang"]
    # the gang's secret (64 hex digits) went to the supervisor's stdin only: no such value in the run's files
    # but the uploaded file's sha256
    files = tb3.node_exec(names[1], f"cat /workspace/.dfo/runs/{run}/*.json").stdout
    upload_sha = hashlib.sha256(NODE.encode()).hexdigest()
    assert set(re.findall(r"[0-9a-f]{64}", files)) == {upload_sha}, files


def test_one_node_failing_ends_the_others_with_no_controller_attached(tb3: Testbed, tmp_path: Path) -> None:
    inv = inventory_copy(tb3, tmp_path)
    job, _ = gang_job(tb3, tmp_path, FAIL_RANK="1", STEPS="600")
    r = dfo(inv, "launch", "-H", "testbed", "-j", str(job), "--json")  # wait 0: launch returns, nobody watches
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["hosts"]["node-1"]["run"]
    names = [n.name for n in tb3.nodes]
    failed = ended_ts_when_present(tb3, names[1], run, 60)
    doc = wait_gang_ended(inv, run, 90)
    assert doc["gang"]["state"] == "failed"
    assert doc["gang"]["first_failure"] == {"host": names[1], "how": "exit 1"}
    states = {h: doc["hosts"][h]["runs"][0]["state"] for h in names}
    assert states == {names[0]: "stopped", names[1]: "failed", names[2]: "stopped"}, states
    for h in (names[0], names[2]):
        assert ended_ts(tb3, h, run) - failed < 60
        stop = json.loads(tb3.node_exec(h, f"cat /workspace/.dfo/runs/{run}/stop.json").stdout)
        assert stop["why"] == f"gang failed: {names[1]} exit 1" and stop["grace"] == 5
    t = dfo(inv, "tail", "-H", "testbed", run, "-n", "+1", timeout=120)
    assert t.returncode == 5
    assert f"[{names[1]}] rank 1 fails now" in t.stdout.splitlines()


def test_stop_on_the_group_stops_every_node(tb3: Testbed, tmp_path: Path) -> None:
    inv = inventory_copy(tb3, tmp_path)
    job, _ = gang_job(tb3, tmp_path, STEPS="600")
    r = dfo(inv, "launch", "-H", "testbed", "-j", str(job), "--json")
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["hosts"]["node-1"]["run"]
    s = dfo(inv, "stop", "-H", "testbed", run, "--json", timeout=120)
    assert s.returncode == 0, s.stdout + s.stderr
    assert {h: d["state"] for h, d in json.loads(s.stdout)["hosts"].items()} == {n.name: "stopped" for n in tb3.nodes}
    doc = wait_gang_ended(inv, run, 60)
    assert doc["gang"]["state"] == "stopped", doc["gang"]
    assert doc["gang"]["nodes"] == {n.name: "stopped" for n in tb3.nodes}


def ended_ts_when_present(tb: Testbed, node: str, run: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while True:
        r = tb.node_exec(node, f"cat /workspace/.dfo/runs/{run}/end.json 2>/dev/null")
        if r.returncode == 0 and r.stdout:
            return float(json.loads(r.stdout)["ended_ts"])
        assert time.monotonic() < deadline, f"{node}: run {run} did not end"
        time.sleep(0.5)


def test_a_node_that_differs_is_refused_before_any_launch(tb3: Testbed, tmp_path: Path) -> None:
    inv = inventory_copy(tb3, tmp_path)
    job, name = gang_job(tb3, tmp_path, torch={"node-3": "2.10.0"})
    r = dfo(inv, "launch", "-H", "testbed", "-j", str(job))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "node-3: torch 2.10.0, node-1 has 2.11.0" in r.stderr
    for n in tb3.nodes:  # nothing was launched anywhere
        out = tb3.node_exec(n.name, "ls /workspace/.dfo/runs/ 2>/dev/null").stdout
        assert not [d for d in out.split() if d.startswith(name)], out
    two = dfo(inv, "launch", "-H", "node-1,node-2", "-j", str(job))
    assert two.returncode == 2 and "run.nodes is 3 but -H names 2 hosts" in two.stderr, two.stderr


def test_a_vanished_node_ends_the_others_and_shows_as_lost(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tb = make_testbed(nodes=3, s3=False)
    if not tb.nodes[0].address.startswith("10."):
        pytest.skip("vanish needs namespace nodes (root)")
    inv = inventory_copy(tb, tmp_path)
    job, _ = gang_job(tb, tmp_path, STEPS="600")
    r = dfo(inv, "launch", "-H", "testbed", "-j", str(job), "--json")
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["hosts"]["node-1"]["run"]
    time.sleep(3)  # every member has joined the hub
    tb.vanish("node-3")
    gone = time.time()
    doc = wait_gang_ended(inv, run, 90)
    assert doc["gang"]["state"] == "failed"
    assert doc["gang"]["first_failure"] == {"host": "node-3", "how": "lost"}
    assert doc["hosts"]["node-3"]["ok"] is False  # unreachable, and said so
    assert doc["gang"]["nodes"]["node-3"] == "lost (unreachable)"
    assert [doc["hosts"][h]["runs"][0]["state"] for h in ("node-1", "node-2")] == ["stopped", "stopped"]
    for h in ("node-1", "node-2"):
        assert ended_ts(tb, h, run) - gone < 60


# --------------------------------------------------------------------------- the demo trainer under torchrun (CPU torc
DDP_JOB = Path(__file__).resolve().parent.parent / "jobs" / "demo-ddp.yaml"


def _upload_wheels(tb: Testbed, node: str, wheels: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(wheels.glob("*.whl")):
            tar.add(p, arcname=p.name)
    argv = tb.ssh_argv(node, "rm -rf /root/dfo-wheels && mkdir -p /root/dfo-wheels && tar -xf - -C /root/dfo-wheels")
    r = subprocess.run(argv, input=buf.getvalue(), capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-500:]


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not any(DEFAULT_WHEELS.glob("torch-*.whl")), reason="no demo wheels: run bash .ci/setup --demo")
def test_demo_ddp_on_a_gang_of_three_logs_one_all_reduced_loss(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`dfo up -H testbed -j jobs/demo-ddp.yaml`: provision (CPU torch from the demo wheels), stage the
    model, sync the data, launch the gang under torchrun (gloo) and tail it: every rank logs the same
    all-reduced loss."""
    tb = make_testbed(nodes=3, s3=True)
    assert tb.s3 is not None
    src = tmp_path / "source"
    write_model(src / "model")
    write_data(src / "data", shards=2, tokens_per_shard=20000)
    tb.s3.create_bucket("demo")
    tb.s3.put_tree("demo", "models/demo-target", src / "model")
    tb.s3.put_tree("demo", "tokenized", src / "data")
    for n in tb.nodes:
        _upload_wheels(tb, n.name, DEFAULT_WHEELS)
    doc = yaml.safe_load(DDP_JOB.read_text())
    doc["s3"]["endpoint_url"] = tb.s3.url
    doc["code"]["source"] = str((DDP_JOB.parent / doc["code"]["source"]).resolve())
    job = tmp_path / "demo-ddp.yaml"
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    inv = inventory_copy(tb, tmp_path)
    env = {"AWS_ACCESS_KEY_ID": tb.s3.access_key, "AWS_SECRET_ACCESS_KEY": tb.s3.secret_key}
    r = dfo(inv, "up", "-H", "testbed", "-j", str(job), timeout=1200, env=env)
    out = os.environ.get("DFO_GANG_STORY_OUT")
    if out:
        Path(out).write_text(f"$ dfo up -H testbed -j jobs/demo-ddp.yaml\n{r.stdout}{r.stderr}[exit {r.returncode}]\n")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen: dict[int, dict[int, str]] = {}
    for _host, rank, step, loss in re.findall(r"^\[(node-\d)\] rank (\d+): step (\d+) loss (\S+) \(all-reduced over 3 "
                                             r"ranks\)", r.stdout, re.M):
        seen.setdefault(int(step), {})[int(rank)] = loss
    assert sorted(seen) == [10, 20, 30], r.stdout[-3000:]
    for step, by_rank in seen.items():
        assert set(by_rank) == {0, 1, 2} and len(set(by_rank.values())) == 1, (step, by_rank)
    # a rank exits 1 mid-run (the others block in the next all-reduce): the gang watch ends them all, with
    # no controller attached (launch returns at once), and status names the node that failed
    # (a fresh --output-dir: from the first run's checkpoint it would resume at step 30, past step 15)
    doc["run"]["command"] = doc["run"]["command"].replace("--max-steps 30", "--max-steps 100000").replace(
        "checkpoints/demo-ddp ", "checkpoints/demo-ddp-fail ") + " --exit-at-step 15 --exit-rank 1"
    assert "demo-ddp-fail" in doc["run"]["command"]
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = dfo(inv, "launch", "-H", "testbed", "-j", str(job), "--json", timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = json.loads(r.stdout)["hosts"]["node-1"]["run"]
    gone = time.time()
    ended = wait_gang_ended(inv, run, 180)
    t = dfo(inv, "tail", "-H", "testbed", run, "-n", "+1", timeout=120)
    if out:
        with open(out, "a") as f:
            f.write(f"$ dfo status -H testbed {run} --json\n{json.dumps(ended['gang'], indent=2)}\n"
                    f"$ dfo tail -H testbed {run} -n +1\n{t.stdout}{t.stderr}[exit {t.returncode}]\n")
    failer = re.findall(r"^\[(node-\d)\] rank 1: exiting with 1 at step 15", t.stdout, re.M)
    assert len(failer) == 1, t.stdout[-3000:]
    assert ended["gang"]["state"] == "failed" and ended["gang"]["first_failure"] == {"host": failer[0], "how": "exit 1"}
    fail_ts = ended_ts(tb, failer[0], run)
    for n in tb.nodes:
        if n.name != failer[0]:
            assert ended["gang"]["nodes"][n.name] == "stopped"
            assert ended_ts(tb, n.name, run) - fail_ts < 60
    assert fail_ts > gone and t.returncode == 5
