"""Recovery on the testbed (issue 20): `dfo up --watch` / `dfo watch` replace a lost node by a spare,
relaunch a trainer killed by a signal, leave a trainer that exits 1 alone, and a watcher killed in the
middle of a recovery finishes it when started again. Each test stops by itself (timeouts everywhere).

The trainer is the stdlib stand-in of tests/test_node_dies.py (its state after N steps is known, so a
checkpoint proves that no step was lost or done twice), plus ``--fail-at``: exit 1 at that step; and once
the demo trainer itself, in its DDP mode under torchrun on CPU torch (the demo's wheels)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest
import yaml
from botocore.exceptions import ClientError

from orchestrator.testbed import Testbed
from tests._cli import dfo, dfo_popen
from tests.test_node_dies import STAND_IN, stand_in_state

pytestmark = pytest.mark.testbed

MakeTestbed = Callable[..., Testbed]
STEPS = 400  # 0.05 s each: about 20 s of training, a checkpoint every 20 steps (1 s)
SAVE = 20
BUCKET = "recovery"
TRAINER = STAND_IN.replace(
    "a = p.parse_args()\n",
    "a = p.parse_args()\nimport signal\nstop = []\nsignal.signal(signal.SIGTERM, lambda s, f: stop.append(s))\n",
).replace(
    "while step < a.max_steps:\n", "while step < a.max_steps and not stop:\n",
).replace(
    'print("done: %d steps" % step, flush=True)',
    'if stop:\n    save()\n    print("stopped at step %d" % step, flush=True)\n    raise SystemExit(0)\n'
    'print("done: %d steps" % step, flush=True)',
).replace(
    'p.add_argument("--sleep", type=float, required=True)',
    'p.add_argument("--sleep", type=float, required=True)\np.add_argument("--fail-at", type=int, default=0)',
).replace(
    "    step += 1\n",
    "    step += 1\n    if step == a.fail_at:\n        print('failing at step %d' % step, flush=True)\n"
    "        raise SystemExit(1)\n",
)


class Bed:
    """One testbed story: the job file, dfo's environment, S3, the processes started (all stopped at the end)."""

    def __init__(self, tb: Testbed, tmp: Path, name: str, *, spares: list[str], restarts: dict[str, Any],
                 fail_at: int = 0) -> None:
        assert tb.s3 is not None
        self.tb, self.tmp, self.name = tb, tmp, name
        self.key = f"runs/{name}/ckpt-last.json"
        self.record_key = f"runs/{name}/.dfo/generation.json"
        self.ckpt = f"/workspace/checkpoints/{name}/ckpt-last.json"
        try:
            tb.s3.create_bucket(BUCKET)
        except ClientError:
            pass  # a second story on the same testbed
        (tmp / "trainer").mkdir(exist_ok=True)
        (tmp / "trainer" / "train.py").write_text(TRAINER)
        self.job = tmp / f"{name}.yaml"
        self.job.write_text(yaml.safe_dump({
            "name": name, "python": "python3", "venv": "/root/venv-stand-in",
            "s3": {"endpoint_url": tb.s3.url, "region": tb.s3.region},
            "code": {"source": "trainer"},
            "outputs": {"path": "/workspace/checkpoints/{name}", "dest": f"s3://{BUCKET}/runs/{{name}}/",
                        "every": 1, "settle": 0.3, "include": ["ckpt-*.json"]},
            "run": {"workdir": f"/workspace/{name}",
                    "command": f"{{python}} train.py --output-dir /workspace/checkpoints/{name} --max-steps {STEPS} "
                               f"--save-every {SAVE} --sleep 0.05 --fail-at {fail_at}",
                    "wait": 0, "stop_grace": 5, "spares": spares, "restarts": restarts}}, sort_keys=False))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        self.env.update(COLUMNS="200", AWS_ACCESS_KEY_ID=tb.s3.access_key, AWS_SECRET_ACCESS_KEY=tb.s3.secret_key,
                        AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
                        DFO_WATCH_POLL_S="1")
        shutil.copy(tb.inventory_path, tmp / "inventory.yaml")
        self.s3 = tb.s3.client()
        self.procs: list[tuple[subprocess.Popen[str], IO[str]]] = []

    def start(self, log: str, *args: str) -> subprocess.Popen[str]:
        f = open(self.tmp / log, "w")  # noqa: SIM115 - closed in close()
        p = dfo_popen(None, *args, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=self.tmp)
        self.procs.append((p, f))
        return p

    def out(self, log: str) -> str:
        return (self.tmp / log).read_text()

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return dfo(None, *args, timeout=timeout, env=self.env, cwd=self.tmp)

    def obj(self, key: str) -> bytes | None:
        try:
            return bytes(self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        except ClientError:
            return None

    def record(self) -> dict[str, Any]:
        data = self.obj(self.record_key)
        return json.loads(data) if data else {}

    def shipped_step(self) -> int:
        data = self.obj(self.key)
        return int(json.loads(data)["step"]) if data else 0

    def wait(self, what: str, pred: Callable[[], Any], timeout: float, procs: list[subprocess.Popen[str]] = ()
             ) -> Any:  # type: ignore[assignment]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = pred()
            if got:
                return got
            for p in procs:
                if p.poll() is not None:
                    raise AssertionError(f"waiting for {what}: dfo ended early (exit {p.returncode})")
            time.sleep(0.3)
        raise AssertionError(f"waited {timeout:.0f}s for {what}; record: {self.record()}")

    def finish(self, p: subprocess.Popen[str], timeout: float) -> int:
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise

    def failed_not_restarted(self, up: subprocess.Popen[str], timeout: float, spare: Any, venv: str) -> dict[str, Any]:
        """`dfo up --watch` of a run that fails on its own (exit 1): exit 5, "not restarted", generation 1 with
        no restart recorded, and nothing launched or provisioned on the spare (no run, no ``venv``)."""
        code = self.finish(up, timeout)
        out = self.out("up.log")
        assert code == 5, out[-4000:]
        assert "not restarted" in out, out[-4000:]
        rec = self.record()
        assert rec["state"] == "failed" and rec["generation"] == 1 and rec["restarts"] == [], rec
        r = self.tb.ssh(spare, f"ls /workspace/.dfo/runs 2>/dev/null | wc -l; test -e {venv} && echo venv")
        assert r.stdout.split() == ["0"], r.stdout
        return rec

    def close(self) -> None:
        for p, f in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            f.close()

    def node_sha(self, node: Any) -> str:
        r = self.tb.ssh(node, f"sha256sum {self.ckpt}")
        assert r.returncode == 0, r.stderr
        return r.stdout.split()[0]

    def final_checks(self, node: Any) -> dict[str, Any]:
        """Training finished: the final checkpoint in S3 is the trainer's last one, byte for byte, and its
        state is the one of STEPS steps done once each (none lost, none twice)."""
        final = self.obj(self.key)
        assert final is not None
        doc = json.loads(final)
        assert doc["step"] == STEPS and doc["state"] == stand_in_state(STEPS)
        assert hashlib.sha256(final).hexdigest() == self.node_sha(node)
        return doc


@pytest.fixture
def bed_factory(make_testbed: MakeTestbed, tmp_path: Path) -> Any:
    beds: list[Bed] = []

    def make(tb: Testbed, name: str, cls: type[Bed] = Bed, **kw: Any) -> Bed:
        d = tmp_path / name
        d.mkdir()
        b = cls(tb, d, name, **kw)
        beds.append(b)
        return b

    yield make
    for b in beds:
        b.close()


def _trainer_pid(tb: Testbed, node: Any, run: str) -> int:
    r = tb.ssh(node, f"cat /workspace/.dfo/runs/{run}/meta.json")
    assert r.returncode == 0, r.stderr
    pid = int(json.loads(r.stdout)["pid"])
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()  # the node's pid is this machine's (no pid namespace)
    assert b"train.py" in cmd, cmd  # never signal a process that is not the trainer
    return pid


@pytest.mark.timeout(420)
def test_a_lost_node_is_replaced_by_a_spare(make_testbed: MakeTestbed, bed_factory: Any) -> None:
    tb = make_testbed(nodes=2, s3=True)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    a, spare = tb.nodes
    bed: Bed = bed_factory(tb, "lost-node", spares=[spare.name],
                           restarts={"max": 2, "backoff": 0, "lost_after": 4})
    up = bed.start("up.log", "up", "-H", a.name, "-j", bed.job.name, "--watch")
    bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= 3 * SAVE, 240, [up])
    # a second watcher of the same run refuses (exit 2), naming the first
    second = bed.run("watch", "-H", a.name, "-j", bed.job.name, timeout=60)
    assert second.returncode == 2, second.stdout + second.stderr
    assert "another watcher holds it" in second.stderr, second.stderr
    before = bed.shipped_step()
    run1 = bed.record()["run"]
    # a tail of the run on the node that is lost: it stops reconnecting to that node once the record says the
    # run is being replaced, and goes on with generation 2 on the spare (not after its 300 s reconnect budget)
    tail = bed.start("tail.log", "tail", "-H", a.name, "-j", bed.job.name)
    bed.wait("the tail is following", lambda: "the newest run of job" in bed.out("tail.log"), 60, [tail])
    tb.vanish(a)
    code = bed.finish(up, 300)
    out = bed.out("up.log")
    assert code == 0, out[-4000:]
    assert bed.finish(tail, 120) == 0, bed.out("tail.log")[-4000:]
    tailed = bed.out("tail.log")
    assert f"--- restart: generation 2 ({a.name} lost, {spare.name} in its place): following run {run1}.g2 on " \
           f"{spare.name} ---" in tailed, tailed[-3000:]
    assert tailed.index("--- restart") < tailed.index(f"done: {STEPS} steps"), tailed[-3000:]
    rec = bed.record()
    assert rec["state"] == "succeeded" and rec["generation"] == 2 and rec["hosts"] == [spare.name], rec
    assert rec["lost"] == [a.name]
    (r,) = rec["restarts"]
    assert (r["why"], r["lost_host"], r["spare"]) == ("lost", a.name, spare.name), r
    # no step lost beyond one outputs interval: it resumed at the last shipped checkpoint, or later
    assert r["resumed_step"] is not None and r["resumed_step"] >= before, (r, before)
    assert f"{spare.name} took {a.name}'s place" in out, out[-4000:]
    bed.final_checks(spare)
    # status tells the story: the run on the spare is generation 2, after one restart
    st = bed.run("status", "-H", spare.name, "--json")
    assert st.returncode == 0, st.stderr
    run = json.loads(st.stdout)["hosts"][spare.name]["runs"][0]
    assert run["generation"]["generation"] == 2 and run["generation"]["restarts"][0]["lost_host"] == a.name


@pytest.mark.timeout(420)
def test_a_killed_trainer_is_restarted_and_exit_1_is_not(make_testbed: MakeTestbed, bed_factory: Any) -> None:
    tb = make_testbed(nodes=2, s3=True)
    a, spare = tb.nodes
    # 1. SIGKILL (the OOM killer's signal): relaunched on the same node, from its last checkpoint
    bed: Bed = bed_factory(tb, "killed", spares=[spare.name], restarts={"max": 1, "backoff": 0})
    up = bed.start("up.log", "up", "-H", a.name, "-j", bed.job.name, "--watch")
    bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= 2 * SAVE, 240, [up])
    run1 = bed.record()["run"]
    tail = bed.start("tail.log", "tail", "-H", a.name, "-j", bed.job.name)  # follows the run across its restart
    os.kill(_trainer_pid(tb, a, run1), signal.SIGKILL)
    code = bed.finish(up, 300)
    out = bed.out("up.log")
    assert code == 0, out[-4000:]
    assert bed.finish(tail, 120) == 0, bed.out("tail.log")[-4000:]
    tailed = bed.out("tail.log")
    assert "--- restart: generation 2 (" in tailed and f"following run {run1}.g2 on {a.name} ---" in tailed, tailed
    assert tailed.index("--- restart") < tailed.index(f"done: {STEPS} steps"), tailed[-3000:]
    rec = bed.record()
    assert rec["state"] == "succeeded" and rec["generation"] == 2 and rec["hosts"] == [a.name], rec
    (r,) = rec["restarts"]
    assert r["why"] == "signal" and r["spare"] is None and "SIGKILL" in r["detail"], r
    bed.final_checks(a)

    # 2. exit 1: a failure of the trainer's own: not restarted, the run fails, the spare is untouched
    bad: Bed = bed_factory(tb, "exits-1", spares=[spare.name], restarts={"max": 3, "backoff": 0},
                           fail_at=3 * SAVE + 5)
    up = bad.start("up.log", "up", "-H", a.name, "-j", bad.job.name, "--watch")
    bad.failed_not_restarted(up, 300, spare, "/root/venv-stand-in")
    assert bad.shipped_step() == 3 * SAVE  # its last checkpoint shipped all the same


@pytest.mark.timeout(480)
def test_a_watcher_killed_mid_recovery_finishes_it_when_started_again(make_testbed: MakeTestbed,
                                                                      bed_factory: Any) -> None:
    tb = make_testbed(nodes=2, s3=True)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    a, spare = tb.nodes
    bed: Bed = bed_factory(tb, "watcher-dies", spares=[spare.name],
                           restarts={"max": 2, "backoff": 6, "lost_after": 4})
    up = bed.run("up", "-H", a.name, "-j", bed.job.name, "--no-tail", timeout=240)
    assert up.returncode == 0, up.stdout + up.stderr
    w1 = bed.start("watch1.log", "watch", "-H", a.name, "-j", bed.job.name)
    bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= 2 * SAVE, 120, [w1])
    tb.vanish(a)
    # the recovery is recorded, then waits out its backoff (6 s): the watcher dies in the middle of it
    bed.wait("the recovery's backoff", lambda: (bed.record().get("recovery") or {}).get("phase") == "wait", 120, [w1])
    w1.kill()
    w1.wait()
    assert bed.record()["generation"] == 1
    w2 = bed.start("watch2.log", "watch", "-H", a.name, "-j", bed.job.name)
    code = bed.finish(w2, 300)
    out = bed.out("watch2.log")
    assert code == 0, out[-4000:]
    rec = bed.record()
    assert rec["state"] == "succeeded" and rec["generation"] == 2, rec
    assert len(rec["restarts"]) == 1 and rec["restarts"][0]["spare"] == spare.name, rec  # one recovery, not two
    assert "restart 1/2" not in out  # the second watcher did not decide a new one: it finished the first
    bed.final_checks(spare)


PARTITION_S = float(os.environ.get("DFO_TEST_PARTITION_S") or 15)  # the 90 s, shortened (configurable)


@pytest.mark.timeout(600)
def test_a_partitioned_node_that_comes_back_is_fenced(make_testbed: MakeTestbed, bed_factory: Any) -> None:
    """The node's link is cut (its packets dropped) for PARTITION_S seconds: the watcher replaces it by the
    spare; when the link comes back, the old trainer is still running, and its shipper's check before the
    next upload finds generation 2: nothing is uploaded, and the old trainer is stopped."""
    tb = make_testbed(nodes=2, s3=True)
    if not tb.isolated:
        pytest.skip("loopback fallback: a link cannot be cut")
    a, spare = tb.nodes
    bed: Bed = bed_factory(tb, "partition", spares=[spare.name],
                           restarts={"max": 2, "backoff": 0, "lost_after": 4})
    slow = yaml.safe_load(bed.job.read_text())  # 0.1 s a step: the old trainer outlives the partition
    slow["run"]["command"] = slow["run"]["command"].replace("--sleep 0.05", f"--sleep {max(0.15, PARTITION_S / 100)}")
    bed.job.write_text(yaml.safe_dump(slow, sort_keys=False))
    up = bed.start("up.log", "up", "-H", a.name, "-j", bed.job.name, "--watch")
    bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= 2 * SAVE, 240, [up])
    run1 = bed.record()["run"]
    tb.link_down(a)
    try:
        bed.wait("generation 2 on the spare", lambda: bed.record().get("run") != run1 and
                 bed.record().get("state") == "running", 120 + PARTITION_S, [up])
        t_gen2 = time.time()  # the partition lasts PARTITION_S in all (at least)
        time.sleep(max(0.0, PARTITION_S - 4))
    finally:
        tb.link_up(a)
    # the old node: its trainer was still running; it learns of generation 2 and stops, uploading nothing
    def old_run() -> dict[str, Any] | None:
        r = tb.ssh(a, f"cat /workspace/.dfo/runs/{run1}/outputs.json /workspace/.dfo/runs/{run1}/stop.json "
                      f"2>/dev/null; echo; cat /workspace/.dfo/runs/{run1}/end.json 2>/dev/null", timeout=30)
        return {"text": r.stdout} if r.returncode == 0 and "superseded by generation 2" in r.stdout else None

    got = bed.wait("the old node fenced", old_run, 120, [up])
    assert '"stopped": true' in got["text"], got["text"]
    out_doc = json.loads(tb.ssh(a, f"cat /workspace/.dfo/runs/{run1}/outputs.json").stdout)
    last = out_doc["last_pass"]
    assert last["ok"] is False and "superseded" in last["error"], last
    # every pass after generation 2 began shipped nothing: passes that shipped ended before it
    assert out_doc["final"] is None or out_doc["final"]["files"] == 0, out_doc["final"]
    code = bed.finish(up, 300)
    out = bed.out("up.log")
    assert code == 0, out[-4000:]
    rec = bed.record()
    assert rec["generation"] == 2 and rec["state"] == "succeeded" and rec["hosts"] == [spare.name], rec
    bed.final_checks(spare)
    assert t_gen2 > 0


@pytest.mark.timeout(300)
def test_a_planned_stop_loses_no_step(make_testbed: MakeTestbed, bed_factory: Any) -> None:
    """The trainer's side of a graceful stop: on SIGTERM it saves, and the run's last pass ships that
    checkpoint (dfo stop waits for it): the step in S3 is the step the trainer stopped at."""
    tb = make_testbed(nodes=1, s3=True)
    (a,) = tb.nodes
    bed: Bed = bed_factory(tb, "planned-stop", spares=[], restarts={"max": 1})
    up = bed.run("up", "-H", a.name, "-j", bed.job.name, "--no-tail", timeout=240)
    assert up.returncode == 0, up.stdout + up.stderr
    bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= SAVE, 120)
    run = bed.record()["run"]
    r = bed.run("stop", "-H", a.name, run, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    log = tb.ssh(a, f"cat /workspace/.dfo/runs/{run}/log").stdout
    stopped = [int(x) for x in re.findall(r"^stopped at step (\d+)$", log, re.M)]
    assert stopped, log[-2000:]
    data = bed.obj(bed.key)
    assert data is not None
    doc = json.loads(data)
    assert doc["step"] == stopped[0] and doc["state"] == stand_in_state(stopped[0]), (doc["step"], stopped)
    assert hashlib.sha256(data).hexdigest() == bed.node_sha(a)


@pytest.mark.timeout(300)
def test_a_lost_node_with_no_healthy_spare_fails_after_a_bounded_wait(make_testbed: MakeTestbed,
                                                                     bed_factory: Any) -> None:
    """The only spare does not answer (its namespace is gone too): the watcher looks again for
    DFO_WATCH_SPARE_WAIT_S (600 s by default; 6 s here), saying so, then the run fails (exit 5). The record
    stays consistent: failed, fenced at generation 2 (the lost node uploads nothing more if it comes back),
    no restart recorded, the last checkpoint left in S3; a watcher started again ends at once."""
    tb = make_testbed(nodes=2, s3=True)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    a, spare = tb.nodes
    bed: Bed = bed_factory(tb, "no-spare", spares=[spare.name], restarts={"max": 2, "backoff": 0, "lost_after": 4})
    bed.env["DFO_WATCH_SPARE_WAIT_S"] = "6"
    tb.vanish(spare)
    up = bed.start("up.log", "up", "-H", a.name, "-j", bed.job.name, "--watch")
    bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= SAVE, 240, [up])
    tb.vanish(a)
    before = bed.shipped_step()
    code = bed.finish(up, 240)
    out = bed.out("up.log")
    assert code == 5, out[-4000:]
    assert f"watch: no healthy spare for {a.name} yet ({spare.name} not answering)" in out, out[-4000:]
    assert f"{a.name} lost and no healthy spare within 6s ({spare.name} not answering): the run fails" in out, out
    rec = bed.record()
    assert rec["state"] == "failed" and rec["generation"] == 2 and rec["restarts"] == [], rec
    assert rec["lost"] == [a.name] and rec["recovery"]["phase"] == "gave-up" and rec["recovery"]["spare"] is None, rec
    assert bed.shipped_step() >= before  # what the lost node shipped stays for a relaunch
    again = bed.run("watch", "-H", a.name, "-j", bed.job.name, timeout=60)
    assert again.returncode == 5, again.stdout + again.stderr
    assert "failed at generation 2 after 0 restart(s)" in again.stdout + again.stderr, again.stdout + again.stderr
