"""run.health on the testbed (issue 34): ``dfo up`` and ``dfo launch`` stop at the GPU health gate (exit 3,
naming the GPU, the figure and the value it should have) and go when it passes; the recovery watcher sets
aside a spare that fails the gate and takes the next one. The nodes have no GPU: a fake nvidia-smi on the
job's PATH replays ``nvidia-smi -q -x`` as captured on an H100 (tests/data/health/h100: idle, another
tenant's matmuls, a process holding 90% of the memory), and the jobs use ``measure: false`` (the checks
from nvidia-smi and the kernel log; the measuring part runs on GPU machines: tests/test_gpu_health.py)."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.testbed import Testbed
from tests._runs_fixtures import RunsEnv, inventory_copy

pytestmark = pytest.mark.testbed
DATA = Path(__file__).parent / "data" / "health" / "h100"
FAKEBIN = "/root/dfo-fakebin-health"
PATH = f"{FAKEBIN}:/usr/local/bin:/usr/bin:/bin"
# `nvidia-smi -q -x` answers with the capture; anything else is refused, as a real one refuses what it lacks
FAKE_SMI = '#!/bin/sh\n[ "$*" = "-q -x" ] && exec cat "$(dirname "$0")/q.xml"\necho "not replayed: $*" >&2\nexit 2\n'
HOG = ("GPU 0 (NVIDIA H100 80GB HBM3): 71.87 GiB of 79.65 GiB in use before the gate, at most 3.98 GiB allowed "
       "(0.05 of it)")


def put_smi(tb: Testbed, node: Any, capture: str) -> None:
    """The fake nvidia-smi on ``node``, replaying tests/data/health/h100/CAPTURE-q.xml."""
    q = shlex.quote
    xml = (DATA / f"{capture}-q.xml").read_text()
    r = tb.node_exec(node, f"mkdir -p {FAKEBIN} && printf %s {q(FAKE_SMI)} > {FAKEBIN}/nvidia-smi && "
                           f"chmod +x {FAKEBIN}/nvidia-smi && printf %s {q(xml)} > {FAKEBIN}/q.xml")
    assert r.returncode == 0, r.stderr


def health_job(tmp: Path, name: str) -> Path:
    doc = {"name": name, "venv": "/root/venv-health", "run": {
        "workdir": "/root/health-run", "command": "{python} -c \"print('the trainer ran')\"", "wait": 0,
        "env": {"PATH": PATH}, "health": {"measure": False}}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.timeout(300)
def test_up_and_launch_stop_at_the_gate_and_go_once_it_passes(testbed: Testbed, tmp_path: Path) -> None:
    env = RunsEnv(testbed, testbed.nodes[0], inventory_copy(testbed, tmp_path), tmp_path)
    host = env.node.name
    job = health_job(tmp_path, f"hg-{int(time.time() * 1000) % 10**8}")
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # where this machine keeps each host's last verdict
    # 1. a process holds 90% of the GPU's memory: up stops at the gate, and nothing is launched
    put_smi(testbed, env.node, "hog")
    r = env.dfo("up", "-H", host, "-j", str(job), timeout=240, env=cache)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "the GPU health gate (run.health) failed" in r.stderr and HOG in r.stderr, r.stderr
    assert f"{host}: FAILED: GPU 0 (NVIDIA H100 80GB HBM3): 1 compute process(es) that are not this job's" in r.stderr
    assert "up: stopped at launch (exit 3)" in r.stderr
    assert f"every figure: dfo verify-env -H {host} -j {job} --health" in r.stderr
    st = env.dfo("status", "-H", host, "-j", str(job), "--json")
    assert json.loads(st.stdout)["hosts"][host]["runs"] == []
    # 2. another tenant's matmuls: launch stops at the gate too
    put_smi(testbed, env.node, "tenant")
    r = env.dfo("launch", "-H", host, "-j", str(job), "--json", timeout=120, env=cache)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "GPU 0 (NVIDIA H100 80GB HBM3): 99% busy before the gate's own load" in r.stderr, r.stderr
    # verify-env --health shows every check, its figure and verdict (--json: the gate's whole document)
    r = env.dfo("verify-env", "-H", host, "-j", str(job), "--health", "--json", timeout=120, env=cache)
    assert r.returncode == 3, r.stderr
    doc = json.loads(r.stdout)["hosts"][host]
    fails = {c["check"] for c in doc["health"]["checks"] if c["verdict"] == "fail"}
    assert fails == {"processes", "busy_before"} and doc["ok"] is False
    assert any(p["kind"] == "health" and "99% busy" in p["message"] for p in doc["problems"])
    # 3. a healthy GPU: the gate passes, the run starts and succeeds
    put_smi(testbed, env.node, "idle")
    r = env.dfo("up", "-H", host, "-j", str(job), timeout=240, env=cache)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{host}: healthy (1 GPU" in r.stderr and "the trainer ran" in r.stdout, r.stdout + r.stderr
    # 4. top and report show the gate's last verdict for the node
    rep = env.dfo("report", "-H", host, "-j", str(job), "--json", env=cache)
    h = json.loads(rep.stdout)["hosts"][host]["health"]
    assert h["ok"] is True and h["line"].startswith("healthy (1 GPU"), rep.stdout
    top = env.dfo("top", "-H", host, "-j", str(job), "--once", env=cache)
    assert top.returncode == 0 and "gate: healthy (1 GPU" in top.stdout, top.stdout + top.stderr
    rep = env.dfo("report", "-H", host, "-j", str(job), env=cache)
    assert "health gate  gate: healthy (1 GPU" in rep.stdout, rep.stdout


@pytest.mark.timeout(480)
def test_a_spare_that_fails_the_gate_is_skipped_for_the_next(make_testbed: Any, tmp_path: Path) -> None:
    from tests.test_recovery import SAVE, Bed

    tb = make_testbed(nodes=3, s3=True)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    a, bad, good = tb.nodes
    for node, capture in ((a, "idle"), (bad, "hog"), (good, "idle")):
        put_smi(tb, node, capture)
    (tmp_path / "bed").mkdir()
    bed = Bed(tb, tmp_path / "bed", "health-spare", spares=[bad.name, good.name],
              restarts={"max": 2, "backoff": 0, "lost_after": 4})
    try:
        doc = yaml.safe_load(bed.job.read_text())
        doc["run"].update(env={"PATH": PATH}, health={"measure": False})
        bed.job.write_text(yaml.safe_dump(doc, sort_keys=False))
        up = bed.start("up.log", "up", "-H", a.name, "-j", bed.job.name, "--watch")
        bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= 2 * SAVE, 240, [up])
        tb.vanish(a)
        code = bed.finish(up, 300)
        out = bed.out("up.log")
        assert code == 0, out[-4000:]
        assert f"{a.name}: healthy (1 GPU" in out  # the first launch's gate
        assert f"watch: spare {bad.name} failed the health gate: GPU 0 (NVIDIA H100 80GB HBM3): 1 compute " \
               "process(es) that are not this job's" in out, out[-4000:]
        assert HOG in out and f"watch: spare {good.name}: health gate passed" in out, out[-4000:]
        assert f"{good.name} took {a.name}'s place" in out, out[-4000:]
        rec = bed.record()
        assert rec["state"] == "succeeded" and rec["hosts"] == [good.name] and rec["bad_spares"] == [bad.name], rec
        assert rec["restarts"][0]["spare"] == good.name
        r = tb.ssh(bad, "ls /workspace/.dfo/runs 2>/dev/null | wc -l")
        assert r.stdout.split() == ["0"], r.stdout  # nothing ran on the spare that failed
        bed.final_checks(good)
    finally:
        bed.close()
