"""When a node dies: the testbed's node.vanish(), and the whole story of issue 12 on it
(a run on node A ships its checkpoints, A vanishes, `dfo up` on node B resumes from the last shipped one)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from botocore.exceptions import ClientError

from orchestrator.demo.data import write_data, write_model
from orchestrator.demo.setup import DEFAULT_WHEELS
from orchestrator.testbed import Testbed, TestbedError
from orchestrator.testbed import system as tsys

pytestmark = pytest.mark.testbed

MakeTestbed = Callable[..., Testbed]


def dfo(inv: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real CLI in a fresh interpreter, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", "-i", str(inv), *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, COLUMNS="200"))


def _spaces(pid: int) -> set[tuple[str, int]]:
    return {(k, os.stat(f"/proc/{pid}/ns/{k}").st_ino) for k in ("net", "mnt")}


def _pids_in(spaces: set[tuple[str, int]]) -> list[int]:
    """Every live process of this machine in one of these namespaces (found afresh from /proc)."""
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            mine = _spaces(int(entry.name))
        except OSError:
            continue  # gone, or a zombie (no namespaces left)
        if mine & spaces and tsys.pid_alive(int(entry.name)):
            out.append(int(entry.name))
    return out


# a detached process, as the supervisor, trainer and shipper are: setsid, no terminal, survives the session
DETACH = "setsid sh -c 'exec sleep 600' </dev/null >/dev/null 2>&1 & echo $!"


def test_vanish_kills_every_process_of_the_node_and_nothing_else(make_testbed: MakeTestbed) -> None:
    tb = make_testbed(nodes=2, s3=False)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    a, b = tb.nodes
    detached = {}
    for n in (a, b):
        r = tb.ssh(n, DETACH)
        assert r.returncode == 0, r.stderr
        detached[n.name] = int(r.stdout.split()[-1])
    # a process entered only by nsenter (not under sshd) is the node's too
    inner = int(tb.node_exec(a, DETACH).stdout.split()[-1])
    before = tb.node_pids(a)
    assert detached[a.name] in before and inner in before
    assert detached[b.name] not in before and os.getpid() not in before
    spaces = _spaces(detached[a.name])
    assert spaces.isdisjoint(_spaces(os.getpid())) and spaces.isdisjoint(_spaces(detached[b.name]))
    netns = {ln.split()[0] for ln in tsys.run(["ip", "netns", "list"]).stdout.splitlines() if ln.strip()}

    killed = tb.vanish(a)

    assert {detached[a.name], inner} <= set(killed)
    assert not any(tsys.pid_alive(p) for p in before), [p for p in before if tsys.pid_alive(p)]
    assert _pids_in(spaces) == []  # nothing at all left in the node's network or mount namespace
    after = {ln.split()[0] for ln in tsys.run(["ip", "netns", "list"]).stdout.splitlines() if ln.strip()}
    assert len(netns - after) == 1 and after < netns  # exactly one namespace went: the node's
    assert tb.node_pids(a) == []
    # nothing outside the node was touched: node B and its detached process live on
    assert tsys.pid_alive(detached[b.name])
    r = tb.ssh(b, "echo alive")
    assert r.returncode == 0 and r.stdout.strip() == "alive", r.stderr
    # dfo finds node A gone quickly: exit 4 (unreachable), naming it, no traceback
    t0 = time.monotonic()
    r = dfo(tb.inventory_path, "status", "-H", a.name, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == 4, r.stdout + r.stderr
    assert a.name in r.stderr and "Traceback" not in r.stderr
    assert took < 20, f"dfo status took {took:.1f}s to find {a.name} gone"
    r = dfo(tb.inventory_path, "status", "-H", b.name, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    tsys.signal_pids([detached[b.name]], 9)


def test_vanish_needs_a_namespace_node(make_testbed: MakeTestbed) -> None:
    tb = make_testbed(nodes=1, s3=False, use_netns=False)
    with pytest.raises(TestbedError, match="vanish needs a namespace node"):
        tb.vanish(tb.nodes[0])
    assert tb.ssh(tb.nodes[0], "echo alive").stdout.strip() == "alive"


# --------------------------------------------------------------------------- the whole story (issue 12)

JOB = Path(__file__).resolve().parents[1] / "jobs" / "demo-outputs.yaml"
CKPT_DIR = "/workspace/checkpoints/demo-outputs"
MAX_STEPS = 300


class _NoTorch(pickle.Unpickler):
    """Reads a torch.save checkpoint's data.pkl without torch: tensors come back as None."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" or module.startswith("torch."):
            return lambda *a, **k: None
        if module in ("collections", "builtins"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a checkpoint")

    def persistent_load(self, pid: Any) -> None:
        return None


def ckpt_step(data: bytes) -> int:
    """The "step" a demo trainer checkpoint (torch.save's zip) was saved at."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
        return int(_NoTorch(io.BytesIO(z.read(pkl))).load()["step"])


def _shipped_files(doc: Any) -> int | None:
    """shipped.files out of `dfo outputs --json` (wherever the host's document nests it)."""
    if isinstance(doc, dict):
        shipped = doc.get("shipped")
        if isinstance(shipped, dict) and isinstance(shipped.get("files"), int):
            return int(shipped["files"])
        for v in doc.values():
            n = _shipped_files(v)
            if n is not None:
                return n
    elif isinstance(doc, list):
        for v in doc:
            n = _shipped_files(v)
            if n is not None:
                return n
    return None


class Story:
    """Runs dfo commands and keeps a transcript (the README's "When a node dies" is made from it)."""

    def __init__(self, cwd: Path, env: dict[str, str], out: Path) -> None:
        self.cwd, self.env, self.out = cwd, env, out  # cwd holds inventory.yaml (dfo's default) and the job
        self.lines: list[str] = []

    def note(self, text: str) -> None:
        self.lines.append(text)
        self.out.write_text("\n".join(self.lines) + "\n")

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "orchestrator.cli", *args]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        t0 = time.monotonic()
        r = subprocess.run(self.argv(*args), capture_output=True, text=True, timeout=timeout, env=self.env,
                           cwd=self.cwd)
        self.note(f"$ dfo {' '.join(args)}\n{r.stdout}{r.stderr}[exit {r.returncode}, {time.monotonic() - t0:.1f}s]")
        return r

    def stream(self, *args: str, timeout: float) -> tuple[int, str]:
        """A long command (up): its output (stdout and stderr) goes to the transcript as it comes."""
        t0 = time.monotonic()
        self.note(f"$ dfo {' '.join(args)}")
        proc = subprocess.Popen(self.argv(*args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=self.env, cwd=self.cwd)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        out: list[str] = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.append(line)
                self.note(line.rstrip("\n"))
            proc.wait()
        finally:
            timer.cancel()
        self.note(f"[exit {proc.returncode}, {time.monotonic() - t0:.1f}s]")
        return proc.returncode, "".join(out)


def _upload_wheels(tb: Testbed, node: Any, wheels: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(wheels.glob("*.whl")):
            tar.add(p, arcname=p.name)
    argv = tb.ssh_argv(node, "rm -rf /root/dfo-wheels && mkdir -p /root/dfo-wheels && tar -xf - -C /root/dfo-wheels")
    r = subprocess.run(argv, input=buf.getvalue(), capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr.decode()[-500:]


def _story_job(tmp_path: Path, endpoint: str) -> Path:
    """jobs/demo-outputs.yaml with the throwaway endpoint and an absolute code.source."""
    doc = yaml.safe_load(JOB.read_text())
    doc["s3"]["endpoint_url"] = endpoint
    doc["code"]["source"] = str((JOB.parent / doc["code"]["source"]).resolve())
    out = tmp_path / "demo-outputs.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def _two_ships_then_vanish(tb: Testbed, story: Story, node: Any, job: Path, bucket: str, key: str,
                           expect: tuple[str, ...], *, ship_timeout: float, detach_after: float) -> None:
    """Steps 1 and 2 of the story: `dfo up` on NODE (in the background, as a laptop runs it), until S3 has
    seen two versions of the checkpoint KEY; `dfo outputs` on it; then NODE vanishes (every process named
    in EXPECT was running there), and the laptop's `dfo up`, still following a dead node, gets Ctrl-C
    DETACH_AFTER seconds later (it would retry for 5 minutes)."""
    s3 = tb.s3.client()  # type: ignore[union-attr]
    up = subprocess.Popen(story.argv("up", "-H", node.name, "-j", job.name), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=story.env, cwd=story.cwd)
    try:
        etags: list[str] = []
        deadline = time.monotonic() + ship_timeout
        while len(etags) < 2 and time.monotonic() < deadline and up.poll() is None:
            try:
                etag = s3.head_object(Bucket=bucket, Key=key)["ETag"]
            except ClientError:
                etag = None
            if etag and etag not in etags:
                etags.append(etag)
            time.sleep(0.2)
        assert len(etags) >= 2, f"not two shipped checkpoints in {ship_timeout:.0f} s (dfo up: {up.poll()})"
        story.run("outputs", "-H", node.name, "-j", job.name)
        r = story.run("outputs", "-H", node.name, "-j", job.name, "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert (_shipped_files(json.loads(r.stdout)) or 0) >= 2, r.stdout
        before = {p: tsys.cmdline(p) for p in tb.node_pids(node)}
        for what in expect:
            assert any(what in c for c in before.values()), f"no {what} on {node.name}: {sorted(before.values())}"
        story.note(f"(node {node.name} vanishes: tb.vanish)")
        killed = tb.vanish(node)
        assert killed and not [p for p in before if tsys.pid_alive(p)]
    finally:
        if up.poll() is None:  # the laptop's `dfo up` on the node is still following a dead node: Ctrl-C
            time.sleep(detach_after)
            up.send_signal(signal.SIGINT)
        try:
            out, _ = up.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            out, _ = up.communicate()
        story.note(f"$ dfo up -H {node.name} -j {job.name}\n{out}[exit {up.returncode}]")


@pytest.mark.timeout(1500)
@pytest.mark.skipif(not any(DEFAULT_WHEELS.glob("torch-*.whl")), reason="no demo wheels: run bash .ci/setup --demo")
def test_a_node_dies_and_the_run_goes_on(make_testbed: MakeTestbed, tmp_path: Path) -> None:
    tb = make_testbed(nodes=2, s3=True)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    assert tb.s3 is not None
    a, b = tb.nodes
    src = tmp_path / "source"
    write_model(src / "model")
    write_data(src / "data")
    tb.s3.create_bucket("demo")
    tb.s3.put_tree("demo", "models/demo-target", src / "model")
    tb.s3.put_tree("demo", "tokenized", src / "data")
    for n in (a, b):
        _upload_wheels(tb, n, DEFAULT_WHEELS)
    job = _story_job(tmp_path, tb.s3.url)
    s3 = tb.s3.client()
    key = "runs/demo-outputs/ckpt-last.pt"
    env = dict(os.environ, COLUMNS="200", AWS_ACCESS_KEY_ID=tb.s3.access_key, AWS_SECRET_ACCESS_KEY=tb.s3.secret_key)
    shutil.copy(tb.inventory_path, tmp_path / "inventory.yaml")
    story = Story(tmp_path, env, Path(os.environ.get("DFO_STORY_OUT") or tmp_path / "story.txt"))

    # 1. dfo up on node A, with outputs: (it provisions, stages, syncs, launches and tails)
    # 2. after two shipped checkpoints, A vanishes
    _two_ships_then_vanish(tb, story, a, job, "demo", key,
                           ("sshd", "remote.runs.supervisor", "train.py", "remote.ship.shipper"),
                           ship_timeout=300, detach_after=15)
    shipped = s3.get_object(Bucket="demo", Key=key)["Body"].read()
    step = ckpt_step(shipped)
    assert 0 < step < MAX_STEPS, f"the last shipped checkpoint is at step {step}"
    story.note(f"(the last checkpoint A shipped, s3://demo/{key}: step {step})")
    r = story.run("status", "-H", a.name, timeout=60)
    assert r.returncode == 4, r.stdout + r.stderr

    # 3. dfo up on a fresh node B with the same job resumes at the last shipped step
    code, out = story.stream("up", "-H", b.name, "-j", job.name, timeout=900)
    assert code == 0, out[-4000:]
    assert re.search(r"restore: \d+ files?.* from s3://demo/runs/demo-outputs/", out), out[-4000:]
    assert f"resumed from {CKPT_DIR}/ckpt-last.pt at step {step}\n" in out, out[-4000:]
    after = out.split("resumed from", 1)[1]
    assert int(re.findall(r"^step (\d+) loss", after, re.M)[0]) > step  # it went on from there, not from 0
    assert f"done: {MAX_STEPS} steps" in out
    # 4. the last pass ships the final checkpoint, and dfo pull brings it here byte-identical
    assert re.search(r"outputs: last pass shipped \d+ files? .* to s3://demo/runs/demo-outputs/", out), out[-4000:]
    final = s3.get_object(Bucket="demo", Key=key)["Body"].read()
    assert ckpt_step(final) == MAX_STEPS
    r_node = tb.ssh(b, f"sha256sum {CKPT_DIR}/ckpt-last.pt")
    assert r_node.returncode == 0, r_node.stderr
    on_node = r_node.stdout.split()[0]
    assert on_node == hashlib.sha256(final).hexdigest()
    run_b = re.findall(r"started run (\S+)", out)[0]
    r = story.run("pull", "-H", b.name, "-j", job.name, timeout=300)  # into ./runs/RUN/
    assert r.returncode == 0, r.stdout + r.stderr
    got = (tmp_path / "runs" / run_b / "ckpt-last.pt").read_bytes()
    assert hashlib.sha256(got).hexdigest() == on_node
    here = subprocess.run(["sha256sum", f"runs/{run_b}/ckpt-last.pt"], cwd=tmp_path, capture_output=True, text=True)
    story.note(f"$ sha256sum runs/{run_b}/ckpt-last.pt\n{here.stdout}(on {b.name}: {r_node.stdout.strip()}; "
               f"the S3 object s3://demo/{key}: sha256 {hashlib.sha256(final).hexdigest()}, step {MAX_STEPS})")
    story.run("outputs", "-H", b.name, "-j", job.name)


# --------------------------------------------------------------------------- the story without torch (CI)

# A stand-in trainer (stdlib only): resumes from --output-dir/ckpt-last.json when it is there, takes a step
# every --sleep seconds (its state: a sha256 chain over the steps, so a resumed run ends in the same state as
# one never interrupted), checkpoints every --save-every steps and at the end (a temporary name, then a
# rename: the shipper sends it at once) and prints "step N" each time.
STAND_IN = '''\
import argparse, hashlib, json, os

import time

p = argparse.ArgumentParser()
p.add_argument("--output-dir", required=True)
p.add_argument("--max-steps", type=int, required=True)
p.add_argument("--save-every", type=int, required=True)
p.add_argument("--sleep", type=float, required=True)
a = p.parse_args()
os.makedirs(a.output_dir, exist_ok=True)
path = os.path.join(a.output_dir, "ckpt-last.json")
step, state = 0, hashlib.sha256(b"start").hexdigest()
if os.path.exists(path):
    with open(path) as f:
        ck = json.load(f)
    step, state = ck["step"], ck["state"]
    print("resumed from %s at step %d" % (path, step), flush=True)
else:
    print("no checkpoint in %s: starting at step 0" % a.output_dir, flush=True)


def save():
    tmp = "%s.tmp.%d" % (path, os.getpid())
    with open(tmp, "w") as f:
        json.dump({"step": step, "state": state, "weights": [state] * 64}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


while step < a.max_steps:
    time.sleep(a.sleep)
    step += 1
    state = hashlib.sha256(("%s:%d" % (state, step)).encode()).hexdigest()
    if step % a.save_every == 0 or step == a.max_steps:
        save()
        print("step %d" % step, flush=True)
print("done: %d steps" % step, flush=True)
'''

STAND_IN_STEPS = 600  # 0.05 s each: about 30 s of run in all, a checkpoint every 2 s (40 steps)


def stand_in_state(steps: int) -> str:
    """The stand-in trainer's state after STEPS steps, however many runs it took."""
    state = hashlib.sha256(b"start").hexdigest()
    for i in range(1, steps + 1):
        state = hashlib.sha256(f"{state}:{i}".encode()).hexdigest()
    return state


@pytest.mark.timeout(600)
def test_a_node_dies_and_the_run_goes_on_without_torch(make_testbed: MakeTestbed, tmp_path: Path) -> None:
    """The story of issue 12 with a stdlib stand-in trainer pushed as code: (no model:, data: or packages),
    so that it runs on CI in about a minute."""
    tb = make_testbed(nodes=2, s3=True)
    if not tb.isolated:
        pytest.skip("loopback fallback: a node has no namespace to vanish")
    assert tb.s3 is not None
    a, b = tb.nodes
    name, bucket = "stand-in", "story"
    ckpt_dir = f"/workspace/checkpoints/{name}"
    key = f"runs/{name}/ckpt-last.json"
    tb.s3.create_bucket(bucket)
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "train.py").write_text(STAND_IN)
    job = tmp_path / "stand-in.yaml"
    job.write_text(yaml.safe_dump({
        "name": name, "python": "python3", "venv": "/root/venv-stand-in",
        "s3": {"endpoint_url": tb.s3.url, "region": tb.s3.region},
        "code": {"source": "trainer"},
        "outputs": {"path": "/workspace/checkpoints/{name}", "dest": f"s3://{bucket}/runs/{{name}}/",
                    "every": 1, "settle": 0.5, "include": ["ckpt-*.json"]},
        "run": {"workdir": "/workspace/stand-in",
                "command": f"{{python}} train.py --output-dir {ckpt_dir} --max-steps {STAND_IN_STEPS} "
                           "--save-every 40 --sleep 0.05",
                "wait": 0}}, sort_keys=False))
    s3 = tb.s3.client()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(COLUMNS="200", AWS_ACCESS_KEY_ID=tb.s3.access_key, AWS_SECRET_ACCESS_KEY=tb.s3.secret_key,
               AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
    shutil.copy(tb.inventory_path, tmp_path / "inventory.yaml")
    story = Story(tmp_path, env, tmp_path / "story.txt")
    t0 = time.monotonic()

    # 1. dfo up on node A, with outputs:  2. after two shipped checkpoints, A vanishes
    _two_ships_then_vanish(tb, story, a, job, bucket, key,
                           ("sshd", "remote.runs.supervisor", "train.py", "remote.ship.shipper"),
                           ship_timeout=120, detach_after=1)
    shipped = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    step = shipped["step"]
    assert 0 < step < STAND_IN_STEPS, f"the last shipped checkpoint is at step {step}"
    assert shipped["state"] == stand_in_state(step)
    story.note(f"(the last checkpoint A shipped, s3://{bucket}/{key}: step {step})")
    r = story.run("status", "-H", a.name, timeout=60)
    assert r.returncode == 4, r.stdout + r.stderr

    # 3. dfo up on a fresh node B with the same job restores that checkpoint and resumes at its step
    code, out = story.stream("up", "-H", b.name, "-j", job.name, timeout=300)
    assert code == 0, out[-4000:]
    assert re.search(rf"restore: 1 file\b.* from s3://{bucket}/runs/{name}/", out), out[-4000:]
    assert "code: sent 1 file (" in out, out[-4000:]  # train.py, pushed to the fresh node
    assert f"resumed from {ckpt_dir}/ckpt-last.json at step {step}\n" in out, out[-4000:]
    assert "starting at step 0" not in out
    after = out.split("resumed from", 1)[1]
    assert int(re.findall(r"^step (\d+)$", after, re.M)[0]) > step  # it went on from there, not from 0
    assert f"done: {STAND_IN_STEPS} steps" in out
    # 4. the run ends, the last pass ships the final checkpoint, and dfo pull (no -j) brings it here byte-identical
    assert re.search(rf"outputs: last pass shipped \d+ files? .* to s3://{bucket}/runs/{name}/", out), out[-4000:]
    final = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    doc = json.loads(final)
    assert doc["step"] == STAND_IN_STEPS and doc["state"] == stand_in_state(STAND_IN_STEPS)
    r_node = tb.ssh(b, f"sha256sum {ckpt_dir}/ckpt-last.json")
    assert r_node.returncode == 0, r_node.stderr
    on_node = r_node.stdout.split()[0]
    assert on_node == hashlib.sha256(final).hexdigest()
    run_b = re.findall(r"started run (\S+)", out)[0]
    r = story.run("pull", "-H", b.name, timeout=120)  # the newest run, its outputs.path, into ./runs/RUN/
    assert r.returncode == 0, r.stdout + r.stderr
    got_dir = tmp_path / "runs" / run_b
    got = sorted(str(p.relative_to(got_dir)) for p in got_dir.rglob("*") if p.is_file() and ".dfo" not in p.parts)
    assert got == ["ckpt-last.json"], got  # outputs.path, not the workdir (train.py)
    assert hashlib.sha256((got_dir / "ckpt-last.json").read_bytes()).hexdigest() == on_node
    story.note(f"(the story took {time.monotonic() - t0:.0f}s)")
