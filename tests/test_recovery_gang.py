"""Recovery of gangs on the testbed (issue 20): a 2-node gang plus a spare under `dfo up --watch` -- rank 0's
node lost and replaced, a killed trainer restarted and exit 1 left alone, and the demo trainer itself in its
DDP mode under torchrun on CPU torch (the demo's wheels): a lost node, a killed worker, a rank's exit 1. The
single-node stories and the fixtures (Bed, bed_factory) are in tests/test_recovery.py; the two files run side
by side (pytest-xdist, by file)."""

from __future__ import annotations

import hashlib
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.demo.data import write_data, write_model
from orchestrator.demo.setup import DEFAULT_WHEELS
from orchestrator.testbed import Testbed
from orchestrator.testbed import system as tsys
from tests.test_node_dies import _upload_wheels, ckpt_step
from tests.test_recovery import BUCKET, SAVE, TRAINER, Bed, MakeTestbed, _trainer_pid, bed_factory

__all__ = ["bed_factory"]  # the fixture, imported for this file's tests


@pytest.mark.timeout(600)
def test_a_gang_loses_rank_0_and_a_spare_takes_its_rank(make_testbed: MakeTestbed, bed_factory: Any) -> None:
    """A 2-node gang plus one spare: rank 0's node vanishes; the other node's run is stopped, the spare is
    brought to parity and takes rank 0, the gang relaunches (preflight, fresh rendezvous) and resumes from
    the last shipped checkpoint (rank 0 saves; the other rank only counts)."""
    tb = make_testbed(nodes=3, s3=True)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    a, b, spare = tb.nodes
    bed: Bed = bed_factory(tb, "gang-lost", spares=[spare.name],
                           restarts={"max": 2, "backoff": 0, "lost_after": 4})
    (bed.tmp / "trainer" / "train.py").write_text(TRAINER.replace(
        "def save():\n", "def save():\n    if os.environ.get('DFO_NODE_RANK', '0') != '0':\n        return\n"))
    doc = yaml.safe_load(bed.job.read_text())
    doc["run"]["nodes"] = 2
    bed.job.write_text(yaml.safe_dump(doc, sort_keys=False))
    up = bed.start("up.log", "up", "-H", f"{a.name},{b.name}", "-j", bed.job.name, "--watch")
    bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= 3 * SAVE, 300, [up])
    before = bed.shipped_step()
    tb.vanish(a)
    code = bed.finish(up, 400)
    out = bed.out("up.log")
    assert code == 0, out[-4000:]
    rec = bed.record()
    assert rec["state"] == "succeeded" and rec["generation"] == 2, rec
    assert rec["hosts"] == [spare.name, b.name], rec  # the spare in the lost node's rank
    (r,) = rec["restarts"]
    assert (r["why"], r["lost_host"], r["spare"]) == ("lost", a.name, spare.name), r
    assert r["resumed_step"] is not None and r["resumed_step"] >= before, (r, before)
    bed.final_checks(spare)
    st = bed.run("status", "-H", f"{spare.name},{b.name}", rec["run"])
    assert st.returncode == 0, st.stdout + st.stderr
    assert f"{a.name} lost, {spare.name} took its place" in st.stdout, st.stdout


@pytest.mark.timeout(600)
def test_a_gang_restarts_on_sigkill_and_not_on_exit_1(make_testbed: MakeTestbed, bed_factory: Any) -> None:
    """A 2-node gang plus one spare: rank 1's trainer killed with SIGKILL (its gang watch ends rank 0 too):
    the gang relaunches on the same two nodes from the last checkpoint. Then a trainer that exits 1: the
    run fails, no restart, and the spare is never touched."""
    tb = make_testbed(nodes=3, s3=True)
    a, b, spare = tb.nodes
    rank0_saves = TRAINER.replace(
        "def save():\n", "def save():\n    if os.environ.get('DFO_NODE_RANK', '0') != '0':\n        return\n")

    def gang_bed(name: str, **kw: Any) -> Bed:
        bed: Bed = bed_factory(tb, name, spares=[spare.name], **kw)
        (bed.tmp / "trainer" / "train.py").write_text(rank0_saves)
        doc = yaml.safe_load(bed.job.read_text())
        doc["run"]["nodes"] = 2
        bed.job.write_text(yaml.safe_dump(doc, sort_keys=False))
        return bed

    bed = gang_bed("gang-killed", restarts={"max": 1, "backoff": 0})
    up = bed.start("up.log", "up", "-H", f"{a.name},{b.name}", "-j", bed.job.name, "--watch")
    bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= 2 * SAVE, 300, [up])
    os.kill(_trainer_pid(tb, b, bed.record()["run"]), signal.SIGKILL)
    code = bed.finish(up, 400)
    out = bed.out("up.log")
    assert code == 0, out[-4000:]
    rec = bed.record()
    assert rec["state"] == "succeeded" and rec["generation"] == 2 and rec["hosts"] == [a.name, b.name], rec
    (r,) = rec["restarts"]
    assert r["why"] == "signal" and r["spare"] is None, r
    bed.final_checks(a)

    bad = gang_bed("gang-exits-1", restarts={"max": 3, "backoff": 0}, fail_at=2 * SAVE + 5)
    up = bad.start("up.log", "up", "-H", f"{a.name},{b.name}", "-j", bad.job.name, "--watch")
    bad.failed_not_restarted(up, 400, spare, "/root/venv-stand-in")


# --------------------------------------------------------------------------- the demo trainer: DDP under torchrun
DDP_JOB = Path(__file__).resolve().parents[1] / "jobs" / "demo-ddp.yaml"
DDP_STEPS = 200  # 0.05-0.1 s a step on 2 loaded cores: the run outlives a loss, a recovery, a kill
DDP_SAVE = 10


class DdpBed(Bed):
    """The demo trainer (orchestrator/demo/job/train.py) as a 2-node torchrun gang on CPU torch, from
    jobs/demo-ddp.yaml, with outputs, spares and restarts: rank 0 saves ckpt-last.pt (torch.save)."""

    def __init__(self, tb: Testbed, tmp: Path, name: str, **kw: Any) -> None:
        super().__init__(tb, tmp, name, **kw)
        assert tb.s3 is not None
        self.key = f"runs/{name}/ckpt-last.pt"
        self.ckpt = f"/workspace/checkpoints/{name}/ckpt-last.pt"
        src = tmp / "source"
        write_model(src / "model")
        write_data(src / "data", shards=2, tokens_per_shard=20000)
        tb.s3.put_tree(BUCKET, f"{name}/model", src / "model")
        tb.s3.put_tree(BUCKET, f"{name}/data", src / "data")
        stand_in = yaml.safe_load(self.job.read_text())
        doc = yaml.safe_load(DDP_JOB.read_text())
        doc.update(name=name, s3=stand_in["s3"], outputs=dict(stand_in["outputs"], include=["ckpt-*.pt"]),
                   model={"source": f"s3://{BUCKET}/{name}/model/", "dest": f"/dev/shm/{name}-target"},
                   data={"source": f"s3://{BUCKET}/{name}/data/", "dest": f"/workspace/{name}-data"},
                   code={"source": str((DDP_JOB.parent / doc["code"]["source"]).resolve())})
        doc["run"].update(nodes=2, workdir=f"/workspace/{name}", stop_grace=5, spares=kw["spares"],
                          restarts=kw["restarts"], command=(
                              f"train.py --target-model {{model.dest}} --data-dir {{data.dest}} --output-dir "
                              f"/workspace/checkpoints/{name} --max-steps {DDP_STEPS} --log-interval {DDP_SAVE} "
                              f"--save-interval {DDP_SAVE} --batch-size 4 --seq-len 64 --device cpu"))
        self.job.write_text(yaml.safe_dump(doc, sort_keys=False))

    def shipped_step(self) -> int:
        data = self.obj(self.key)
        return ckpt_step(data) if data else 0


def _torchrun_worker(tb: Testbed, node: Any) -> int:
    """The pid of the trainer process torchrun started on a namespace node (not torchrun itself)."""
    found = [p for p in tb.node_pids(node) if "train.py" in tsys.cmdline(p) and "torch.distributed.run" not in
             tsys.cmdline(p)]
    assert len(found) == 1, [tsys.cmdline(p) for p in tb.node_pids(node)]
    return found[0]


@pytest.mark.timeout(900)
@pytest.mark.skipif(not any(DEFAULT_WHEELS.glob("torch-*.whl")), reason="no demo wheels: run bash .ci/setup --demo")
def test_a_ddp_gang_loses_a_node_then_a_worker_and_goes_on(make_testbed: MakeTestbed, bed_factory: Any) -> None:
    """The issue's story with the demo trainer itself: a 2-node gang (DDP over gloo under torchrun, CPU
    torch from the demo's wheels) plus one spare, under `dfo up --watch`.
    1. Rank 0's node vanishes (it hosts the c10d store): the watcher stops the survivor, brings the spare
       to parity (a full provision: torch from the wheels) and relaunches the gang with a fresh rendezvous,
       the spare in the lost node's place; both ranks resume from the last shipped checkpoint.
    2. A worker is killed with SIGKILL (what the OOM killer does): torchrun exits 1, its report names the
       signal, and the watcher relaunches the gang on the same nodes.
    Training finishes; the final checkpoint in S3 is the trainer's last one; status tells the story."""
    tb = make_testbed(nodes=3, s3=True)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    a, b, spare = tb.nodes
    for n in tb.nodes:
        _upload_wheels(tb, n, DEFAULT_WHEELS)
    bed: Bed = bed_factory(tb, "ddp-lost", cls=DdpBed, spares=[spare.name],
                           restarts={"max": 2, "backoff": 0, "lost_after": 4})
    up = bed.start("up.log", "up", "-H", f"{a.name},{b.name}", "-j", bed.job.name, "--watch")
    bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= 2 * DDP_SAVE, 600, [up])
    before = bed.shipped_step()
    assert before < DDP_STEPS, "the run ended before its node could be lost: raise DDP_STEPS"
    tb.vanish(a)
    resumed = bed.wait("generation 2 resumed", lambda: (bed.record().get("restarts") or [{}])[0].get("resumed_step"),
                       400, [up])
    # no step lost beyond one outputs interval: it resumed at the last shipped checkpoint, or later
    assert before <= resumed < DDP_STEPS, (resumed, before)
    bed.wait("generation 2 shipped a checkpoint", lambda: bed.shipped_step() > resumed, 120, [up])
    before_kill = bed.shipped_step()
    assert before_kill < DDP_STEPS, "the run ended before its worker could be killed: raise DDP_STEPS"
    os.kill(_torchrun_worker(tb, spare), signal.SIGKILL)
    code = bed.finish(up, 400)
    out = bed.out("up.log")
    assert code == 0, out[-4000:]
    rec = bed.record()
    assert rec["state"] == "succeeded" and rec["generation"] == 3, rec
    assert rec["hosts"] == [spare.name, b.name] and rec["lost"] == [a.name], rec  # the spare in the lost one's place
    r1, r2 = rec["restarts"]
    assert (r1["why"], r1["lost_host"], r1["spare"], r1["resumed_step"]) == ("lost", a.name, spare.name, resumed), r1
    assert r2["why"] == "signal" and r2["spare"] is None and "SIGKILL (a worker of torchrun" in r2["detail"], r2
    assert r2["resumed_step"] is not None and before_kill <= r2["resumed_step"] < DDP_STEPS, (r2, before_kill)
    assert f"bringing spare {spare.name} to parity" in out and f"{spare.name} took {a.name}'s place" in out, out[-4000:]
    # both ranks of the last generation resumed from the last checkpoint, and finished. Torchrun's RANK 0,
    # the one that saves, is not dfo's rank 0: its c10d rendezvous numbers the nodes in the order of their
    # --local-addr strings, so after the recovery the writer may be the survivor (from generation 2 on, restore
    # brings every node's outputs.path to the last shipped checkpoint, so both ranks resume at one step)
    log = bed.run("tail", "-H", f"{spare.name},{b.name}", rec["run"], "-n", "+1", timeout=120)
    assert log.returncode == 0, log.stdout[-3000:] + log.stderr[-3000:]
    for host in (spare.name, b.name):
        assert re.search(rf"^\[{host}\] rank [01]: resumed from {bed.ckpt} at step {r2['resumed_step']}$", log.stdout,
                         re.M), log.stdout[-3000:]
    (writer,) = re.findall(rf"^\[(\S+)\] rank 0: done: {DDP_STEPS} steps, checkpoint {bed.ckpt}$", log.stdout, re.M)
    # the final checkpoint in S3 is the trainer's last one, byte for byte, at the last step
    final = bed.obj(bed.key)
    assert final is not None and ckpt_step(final) == DDP_STEPS
    assert hashlib.sha256(final).hexdigest() == bed.node_sha(writer)
    # status tells the story (with -j it reads the resumed steps from the generation record)
    st = bed.run("status", "-H", f"{spare.name},{b.name}", "-j", bed.job.name, rec["run"])
    assert st.returncode == 0, st.stdout + st.stderr
    assert f"generation 3 of run {rec['lineage']}; restarts: 2" in st.stdout, st.stdout
    assert f"{a.name} lost, {spare.name} took its place, resumed at step {resumed}" in st.stdout, st.stdout
    assert f"{spare.name}: trainer killed by SIGKILL" in st.stdout, st.stdout




@pytest.mark.timeout(600)
@pytest.mark.skipif(not any(DEFAULT_WHEELS.glob("torch-*.whl")), reason="no demo wheels: run bash .ci/setup --demo")
def test_a_ddp_gang_whose_rank_exits_1_is_not_restarted(make_testbed: MakeTestbed, bed_factory: Any) -> None:
    """The demo trainer's DDP gang under `dfo up --watch`, one spare: rank 1 exits 1 at a step of its own
    (`--exit-at-step`): a failure of the trainer's own. The watcher does not restart it (restarts.max 3): the
    run fails with exit 5, generation 1, no restart recorded, and the spare is never touched (no run, no venv)."""
    tb = make_testbed(nodes=3, s3=True)
    a, b, spare = tb.nodes
    for n in (a, b):
        _upload_wheels(tb, n, DEFAULT_WHEELS)
    bed: Bed = bed_factory(tb, "ddp-exits-1", cls=DdpBed, spares=[spare.name],
                           restarts={"max": 3, "backoff": 0, "lost_after": 4})
    doc = yaml.safe_load(bed.job.read_text())
    doc["run"]["command"] += " --exit-at-step 15 --exit-rank 1"
    bed.job.write_text(yaml.safe_dump(doc, sort_keys=False))
    up = bed.start("up.log", "up", "-H", f"{a.name},{b.name}", "-j", bed.job.name, "--watch")
    rec = bed.failed_not_restarted(up, 500, spare, "/root/venv-demo")
    assert rec["hosts"] == [a.name, b.name] and not rec.get("lost"), rec
    # the rank that exited is the one named, and it exited at its own step
    log = bed.run("tail", "-H", f"{a.name},{b.name}", rec["run"], "-n", "+1", timeout=120)
    assert re.search(r"^\[\S+\] rank 1: exiting with 1 at step 15 \(--exit-at-step\)$", log.stdout, re.M), \
        log.stdout[-3000:]
