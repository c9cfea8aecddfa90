"""Outputs on the node (issue 12): the supervisor starts, feeds, watches and ends the outputs shipper;
remote.runs reports it (describe/status, follow, stop, the ``outputs`` and ``ship`` ops).

Two levels:
* unit: ``python3 -m remote.runs`` on this machine with a copy of remote/ whose shipper.py is a small
  stand-in that follows the shipper's protocol (spec line on stdin, ``final``/EOF, SIGUSR1, outputs.json):
  the supervisor's side of that protocol, its restarts and its ordering, at a controlled pace;
* testbed: the real remote.ship.shipper on a real node shipping to the testbed's real S3.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import remote
from remote._proto import split_frame
from tests._cli import dfo

REMOTE_ROOT = Path(remote.__file__).resolve().parent

# The stand-in shipper. Behaviour knobs come from the spec (never from the environment):
#   die_first: the first N starts exit with code 3 after their first pass (a counter file counts starts);
#   final_sleep: seconds the last pass takes; fail_final: the last pass fails (exit 1).
FAKE_SHIPPER = r'''
import hashlib, json, os, select, signal, sys, time
run_dir = sys.argv[1]
spec = json.loads(sys.stdin.readline())
creds = spec.pop("credentials", None)
out_path = os.path.join(run_dir, "outputs.json")
starts_path = os.path.join(run_dir, "fake-starts")
starts = int(open(starts_path).read()) + 1 if os.path.exists(starts_path) else 1
open(starts_path, "w").write(str(starts))
with open(os.path.join(run_dir, "fake-received.jsonl"), "a") as f:  # what came: the secret only as a hash
    f.write(json.dumps({"argv": sys.argv, "spec": spec, "secret_sha": hashlib.sha256(
        ((creds or {}).get("secret_key") or "").encode()).hexdigest()}) + "\n")
prev = {}
try:
    prev = json.load(open(out_path))
except Exception:
    pass
state = {"pid": os.getpid(), "state": "idle", "dest": spec["dest"], "path": spec["path"], "every": spec["every"],
         "passes": prev.get("passes", 0), "failed_passes": 0, "last_pass": None, "final": None,
         "shipped": {"files": 0, "bytes": 0}, "pending": 0, "lag_s": 0, "errors": []}
def write():
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, out_path)
def do_pass(final=False, why="timer"):
    state["state"] = "shipping"
    write()
    if final:
        time.sleep(float(spec.get("final_sleep") or 0))
    ok = not (final and spec.get("fail_final"))
    state["passes"] += 1
    p = {"n": state["passes"], "final": final, "ok": ok, "files": 1, "bytes": 5, "why": why,
         "end_seen": os.path.exists(os.path.join(run_dir, "end.json")), "error": None if ok else "boom",
         "status": "shipped" if ok else "failed"}
    state["last_pass"] = p
    if final:
        state["final"] = p
        state["state"] = "done" if ok else "failed"
    else:
        state["state"] = "idle"
    write()
    print("pass %d %s%s" % (p["n"], why, " final" if final else ""), flush=True)
    return ok
asked = []
signal.signal(signal.SIGUSR1, lambda *a: asked.append(1))
write()
next_at = time.time() + float(spec["every"])
while True:
    r, _, _ = select.select([sys.stdin], [], [], 0.05)
    if r:
        line = sys.stdin.readline()
        if line in ("", "final\n"):
            sys.exit(0 if do_pass(final=True, why="final") else 1)
        if line == "ship\n":
            do_pass(why="ship")
    if asked:
        del asked[:]
        do_pass(why="sigusr1")
    if time.time() >= next_at:
        do_pass()
        next_at = time.time() + float(spec["every"])
        if starts <= int(spec.get("die_first") or 0):
            sys.exit(3)
'''


class LocalNode:
    """remote.runs on this machine, from a copy of remote/ with the stand-in shipper."""

    def __init__(self, tmp: Path) -> None:
        self.agent = tmp / "agent"
        shutil.copytree(REMOTE_ROOT, self.agent / "remote", ignore=shutil.ignore_patterns("__pycache__", "_vendor"))
        (self.agent / "remote" / "ship" / "shipper.py").write_text(FAKE_SHIPPER)
        self.ws = tmp / "ws"
        self.workdir = tmp / "work"
        self.workdir.mkdir()

    def call(self, req: dict[str, Any], timeout: float = 60) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTHON"))}
        env["PYTHONPATH"] = str(self.agent)
        r = subprocess.run([sys.executable, "-m", "remote.runs"], input=json.dumps({"workspace": str(self.ws), **req}),
                           capture_output=True, text=True, timeout=timeout, env=env, cwd=self.agent)
        events, result = [], None
        for line in r.stdout.splitlines():
            fr = split_frame(line)
            if fr and fr[0] == "event":
                events.append(json.loads(fr[1]))
            elif fr:
                result = json.loads(fr[1])
        assert result is not None, r.stdout + r.stderr
        assert result["ok"], result
        return result["data"], events

    def launch(self, command: str, spec: dict[str, Any] | None, creds: dict[str, Any] | None) -> str:
        run_id = f"r-{secrets.token_hex(3)}"
        req: dict[str, Any] = {"op": "launch", "run_id": run_id, "job": "outjob", "host": "local", "command": command,
                               "workdir": str(self.workdir), "env": {"PLAIN": "v"}, "secret_env": {}, "uploads": []}
        if spec is not None:
            req.update({"outputs": spec, "outputs_credentials": creds})
        self.call(req)
        return run_id

    def run_dir(self, run: str) -> Path:
        return self.ws / ".dfo" / "runs" / run

    def file(self, run: str, name: str) -> Any:
        return json.loads((self.run_dir(run) / name).read_text())

    def wait_for(self, what: Any, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            got = what()
            if got or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


def spec(tmp: Path, **kw: Any) -> dict[str, Any]:
    return {"path": str(tmp / "ckpt"), "dest": "s3://bucket/runs/outjob/", "every": 0.3, "settle": 0,
            "include": ["**"], "cpu": 2.0, "endpoint_url": "http://127.0.0.1:1", "region": "us-east-1",
            "credentials_mode": "controller", "profile": None, "concurrency": 4, "part_size_mb": 16,
            "multipart_threshold_mb": 64, **kw}


SECRET = "outSECRET" + "x" * 8
CREDS = {"access_key": "AKIAOUTPUTS", "secret_key": SECRET, "session_token": None}


@pytest.fixture
def node(tmp_path: Path) -> LocalNode:
    return LocalNode(tmp_path)


def test_the_shipper_gets_the_credentials_on_stdin_only_and_ships_while_the_trainer_runs(
        node: LocalNode, tmp_path: Path) -> None:
    # the trainer runs until the test says go (at most 60 s): a loaded machine cannot end it before status
    run = node.launch("env > trainer-env.txt; cat /proc/$$/environ > trainer-environ.bin; "
                      "for i in $(seq 600); do [ -e go ] && break; sleep 0.1; done", spec(tmp_path), CREDS)
    rd = node.run_dir(run)
    # passes happen while the trainer runs, every `every` seconds
    assert node.wait_for(lambda: (json.loads((rd / "outputs.json").read_text()).get("passes", 0) >= 2
                                  if (rd / "outputs.json").exists() else False), timeout=10)
    st, _ = node.call({"op": "status", "run": run})
    assert st["runs"][0]["state"] == "running" and st["runs"][0]["outputs"]["state"] in ("idle", "shipping")
    assert st["runs"][0]["outputs"]["alive"] is True
    got = [json.loads(ln) for ln in (rd / "fake-received.jsonl").read_text().splitlines()]
    assert got[0]["secret_sha"] == hashlib.sha256(SECRET.encode()).hexdigest()  # it reached the shipper
    assert got[0]["argv"][1:] == [str(rd)] and "credentials" not in got[0]["spec"]
    (node.workdir / "go").touch()
    fin, _ = node.call({"op": "follow", "run": run}, timeout=30)
    assert fin["state"] == "succeeded" and fin["outputs"]["state"] == "done"
    # never on disk, in the trainer's environment, or in the log
    for f in rd.iterdir():
        assert SECRET not in f.read_text(errors="replace"), f.name
    assert b"outSECRET" not in (node.workdir / "trainer-environ.bin").read_bytes()
    assert "outSECRET" not in (node.workdir / "trainer-env.txt").read_text()
    meta = node.file(run, "meta.json")
    assert meta["outputs"]["dest"] == "s3://bucket/runs/outjob/" and "credentials" not in meta["outputs"]
    log = (rd / "log").read_text().splitlines()
    assert "[dfo outputs] pass 1 timer" in log
    assert log[-1] == f"[dfo outputs] pass {fin['outputs']['passes']} final final"


def test_end_json_comes_first_then_the_last_pass_and_follow_waits_for_it(node: LocalNode, tmp_path: Path) -> None:
    run = node.launch("echo trained; exit 0", spec(tmp_path, every=60, final_sleep=1.5), CREDS)
    t0 = time.monotonic()
    fin, events = node.call({"op": "follow", "run": run, "lines": "+1"}, timeout=30)
    took = time.monotonic() - t0
    final = fin["outputs"]["final"]
    assert final["end_seen"] is True  # end.json existed when the last pass began
    assert fin["outputs"]["state"] == "done" and took >= 1.4  # follow ended only after the last pass
    text = "".join(e.get("t", "") for e in events if e["kind"] == "chunk")
    assert "trained" in text and "[dfo outputs] pass 1 final final" in text  # the shipper's last line came too
    assert any(e["kind"] == "outputs" and e["outputs"]["state"] == "shipping" for e in events)  # it said it waited
    # a last pass that fails is reported as such; the run's own state stays the trainer's
    run = node.launch("exit 0", spec(tmp_path, every=60, fail_final=True), CREDS)
    fin, _ = node.call({"op": "follow", "run": run}, timeout=30)
    assert fin["state"] == "succeeded" and fin["outputs"]["state"] == "failed"
    assert fin["outputs"]["final"]["error"] == "boom"


def test_a_dead_shipper_is_restarted_and_a_shipper_that_keeps_dying_never_kills_the_run(
        node: LocalNode, tmp_path: Path) -> None:
    wait_restarted = ('for i in $(seq 600); do grep -q \'"restarts": 2\' "$DFO_RUN_DIR/shipper.json" 2>/dev/null '
                      '&& break; sleep 0.1; done')  # the trainer outlives two deaths of its shipper, no longer
    run = node.launch(wait_restarted, spec(tmp_path, every=0.2, die_first=2), CREDS)
    fin, _ = node.call({"op": "follow", "run": run}, timeout=60)
    sh = node.file(run, "shipper.json")
    assert sh["restarts"] == 2 and [e["code"] for e in sh["exits"]][:2] == [3, 3]
    assert fin["state"] == "succeeded" and fin["outputs"]["state"] == "done"
    got = [json.loads(ln) for ln in (node.run_dir(run) / "fake-received.jsonl").read_text().splitlines()]
    assert len(got) == 3 and {g["secret_sha"] for g in got} == {hashlib.sha256(SECRET.encode()).hexdigest()}
    log = (node.run_dir(run) / "log").read_text()
    assert "[dfo outputs] the shipper ended (exit code 3); starting it again (2 of 3)" in log
    # one that always dies: 3 restarts, then the supervisor gives up and says so; the trainer runs on
    wait_gave_up = ('for i in $(seq 600); do grep -q \'"gave_up": true\' "$DFO_RUN_DIR/shipper.json" 2>/dev/null '
                    '&& break; sleep 0.1; done; echo still-here')
    run = node.launch(wait_gave_up, spec(tmp_path, every=0.2, die_first=99), CREDS)
    fin, _ = node.call({"op": "follow", "run": run}, timeout=60)
    assert fin["state"] == "succeeded" and "still-here" in (node.run_dir(run) / "log").read_text()
    out = fin["outputs"]
    assert out["state"] == "failed" and out["gave_up"] is True and node.file(run, "shipper.json")["restarts"] == 3
    assert "the shipper ended 4 times (last: exit code 3); gave up" in out["errors"][-1]["error"]


def test_stop_ends_the_trainer_and_the_last_pass_still_runs(node: LocalNode, tmp_path: Path) -> None:
    run = node.launch("sleep 600", spec(tmp_path, every=60, final_sleep=1.0), CREDS)
    node.wait_for(lambda: (node.run_dir(run) / "outputs.json").exists())
    info, events = node.call({"op": "stop", "run": run, "grace": 5, "wait_outputs": 30}, timeout=60)
    assert info["state"] == "stopped"
    assert info["outputs"]["state"] == "done" and info["outputs"]["final"]["end_seen"] is True
    assert any(e["kind"] == "outputs" for e in events)
    # without wait_outputs, stop returns at once and the last pass goes on by itself
    run = node.launch("sleep 600", spec(tmp_path, every=60, final_sleep=1.0), CREDS)
    node.wait_for(lambda: (node.run_dir(run) / "outputs.json").exists())
    info, _ = node.call({"op": "stop", "run": run, "grace": 5}, timeout=60)
    assert info["state"] == "stopped" and info["outputs"]["state"] in ("idle", "shipping")
    assert node.wait_for(lambda: node.file(run, "outputs.json")["state"] == "done", timeout=10)


def test_ship_asks_the_live_shipper_for_a_pass_and_outputs_reports_it(node: LocalNode, tmp_path: Path) -> None:
    run = node.launch("sleep 600", spec(tmp_path, every=600), CREDS)
    node.wait_for(lambda: (node.run_dir(run) / "outputs.json").exists())
    res, _ = node.call({"op": "ship", "run": run}, timeout=30)
    assert res["run"] == run and res["by"] == "shipper" and res["why"] == "sigusr1" and res["n"] == 1
    out, _ = node.call({"op": "outputs", "run": run})
    assert out["outputs"]["passes"] == 1 and out["outputs_spec"]["dest"] == "s3://bucket/runs/outjob/"
    node.call({"op": "stop", "run": run, "grace": 5, "wait_outputs": 30})
    # no live shipper and no credentials in the request: a clear error, not a pass without them
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "PYTHON"))}
    r = subprocess.run([sys.executable, "-m", "remote.runs"], capture_output=True, text=True, timeout=30,
                       input=json.dumps({"workspace": str(node.ws), "op": "ship", "run": run}),
                       env=dict(env, PYTHONPATH=str(node.agent)), cwd=node.agent)
    err = json.loads(r.stdout.split("@@DFO-RESULT@@ ", 1)[1])["error"]
    assert err["kind"] == "usage" and "-j JOB" in err["hint"]


def test_ship_during_the_last_pass_returns_that_pass_and_a_sigterm_then_ends_the_shipper(
        node: LocalNode, tmp_path: Path) -> None:
    run = node.launch("exit 0", spec(tmp_path, every=600, final_sleep=2.0), CREDS)
    assert node.wait_for(lambda: (node.run_dir(run) / "shipper.json").exists()
                         and node.file(run, "shipper.json")["final_sent"])
    res, _ = node.call({"op": "ship", "run": run}, timeout=30)
    assert res["by"] == "final" and res["final"] is True and res["why"] == "final"  # not a second pass beside it
    assert len((node.run_dir(run) / "fake-received.jsonl").read_text().splitlines()) == 1
    # a SIGTERM to the supervisor during the last pass goes to the shipper, which is not started again
    run = node.launch("exit 0", spec(tmp_path, every=600, final_sleep=30), CREDS)
    assert node.wait_for(lambda: (node.run_dir(run) / "shipper.json").exists()
                         and node.file(run, "shipper.json")["final_sent"])
    sup = node.file(run, "meta.json")["supervisor_pid"]
    t0 = time.monotonic()
    os.kill(sup, signal.SIGTERM)
    assert node.wait_for(lambda: node.file(run, "shipper.json")["pid"] is None, timeout=10)
    assert time.monotonic() - t0 < 5  # it did not sit out the 30 s pass
    sh = node.file(run, "shipper.json")
    assert sh["restarts"] == 0 and sh["exits"][-1]["code"] == -signal.SIGTERM
    fin, _ = node.call({"op": "follow", "run": run}, timeout=30)
    assert fin["state"] == "succeeded" and fin["outputs"]["alive"] is False


def test_a_run_without_outputs_has_none_and_follow_ends_with_the_run(node: LocalNode) -> None:
    run = node.launch("echo hi", None, None)
    fin, _ = node.call({"op": "follow", "run": run}, timeout=30)
    assert fin["state"] == "succeeded" and fin["outputs"] is None
    assert not (node.run_dir(run) / "shipper.json").exists()


# --------------------------------------------------------------------------- the real shipper on a testbed node

on_testbed = pytest.mark.testbed

# A trainer stand-in: after P seconds, N checkpoints of 300 KB into OUT (a temp name, then a rename),
# D seconds apart, then it sleeps S seconds (so a test can stop it) and exits 0.
CKPT_WRITER = """\
import os, sys, time
out, n, d, s, p = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
time.sleep(p)
os.makedirs(out, exist_ok=True)
for i in range(n):
    tmp = os.path.join(out, ".tmp-ckpt")
    with open(tmp, "wb") as f:
        f.write(os.urandom(300000) + b"step %d" % i)
    os.rename(tmp, os.path.join(out, "ckpt-%03d.bin" % i))
    print("wrote ckpt-%03d" % i, flush=True)
    time.sleep(d)
time.sleep(s)
print("trainer done", flush=True)
"""


class ShipBed:
    """A job with outputs: on the session's testbed node, shipping to a fresh bucket on its S3."""

    def __init__(self, tb: Any, tmp: Path) -> None:
        from tests._runs_fixtures import inventory_copy

        assert tb.s3 is not None
        self.tb, self.tmp, self.s3, self.node = tb, tmp, tb.s3, tb.nodes[0]
        self.inv = inventory_copy(tb, tmp)
        self.id = secrets.token_hex(3)
        self.bucket = f"shipnode-{self.id}"
        self.s3.create_bucket(self.bucket)
        self.out = f"/root/shipnode-{self.id}"
        (tmp / "ckpt_writer.py").write_text(CKPT_WRITER)

    def job(self, n: int, d: float, s: float, every: float = 1, p: float = 0) -> tuple[Path, str]:
        import yaml

        name = f"ship-{self.id}"
        doc = {"name": name, "venv": "/usr", "s3": {"endpoint_url": self.s3.url, "region": self.s3.region},
               "outputs": {"path": self.out, "dest": f"s3://{self.bucket}/runs/{{name}}/", "every": every,
                           "settle": 0, "include": ["ckpt-*"], "restore": False},
               "run": {"workdir": "/root/shipnode-work", "upload": ["ckpt_writer.py"], "wait": 0,
                       "command": f"python3 ckpt_writer.py {self.out} {n} {d} {s} {p}"}}
        p = self.tmp / f"{name}.yaml"
        p.write_text(yaml.safe_dump(doc, sort_keys=False))
        return p, name

    def dfo(self, *args: str, timeout: float = 120, secret: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update({"AWS_ACCESS_KEY_ID": self.s3.access_key, "AWS_SECRET_ACCESS_KEY": secret or self.s3.secret_key,
                    "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                    "COLUMNS": "200"})
        return dfo(self.inv, *args, timeout=timeout, env=env)

    def sh(self, cmd: str) -> str:
        r = self.tb.node_exec(self.node, cmd, timeout=30)
        assert r.returncode == 0, f"{cmd}: {r.stderr}"
        return str(r.stdout)

    def run_file(self, run: str, name: str) -> Any:
        return json.loads(self.sh(f"cat /workspace/.dfo/runs/{run}/{name}"))

    def shipper(self, run: str, timeout: float = 20) -> Any:
        """RUN_DIR/shipper.json once the supervisor has written it with the shipper's pid: launch (wait 0)
        can return before the supervisor has started the shipper (seen once in a fresh-clone CI run)."""
        deadline = time.monotonic() + timeout
        while True:
            r = self.tb.node_exec(self.node, f"cat /workspace/.dfo/runs/{run}/shipper.json", timeout=30)
            if r.returncode == 0 and r.stdout.strip():
                doc = json.loads(r.stdout)
                if doc.get("pid"):
                    return doc
            assert time.monotonic() < deadline, f"no shipper.json for {run} after {timeout:g}s: {r.stderr}"
            time.sleep(0.1)

    def status(self, run: str) -> dict[str, Any]:
        r = self.dfo("status", "-H", self.node.name, run, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["hosts"][self.node.name]["runs"][0]  # type: ignore[no-any-return]

    def objects(self, name: str) -> dict[str, bytes]:
        c = self.s3.client()
        prefix = f"runs/{name}/"
        keys = [o["Key"] for o in c.list_objects_v2(Bucket=self.bucket, Prefix=prefix).get("Contents", [])]
        return {k[len(prefix):]: c.get_object(Bucket=self.bucket, Key=k)["Body"].read() for k in keys}

    def node_files(self) -> dict[str, str]:
        out = self.sh(f"cd {self.out} && sha256sum ckpt-*")
        return {ln.split()[1]: ln.split()[0] for ln in out.splitlines()}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@on_testbed
def test_on_a_node_the_real_shipper_ships_while_the_run_lives_and_the_secret_stays_in_its_memory(
        testbed: Any, tmp_path: Path) -> None:
    t = ShipBed(testbed, tmp_path)
    # s=6: the trainer lives about 10 s, so a shipper slow to start on a loaded machine still ships while it
    # runs (with s=0 it lived 4.2 s, and a fresh-clone CI once saw the first object only after its end)
    job, name = t.job(n=6, d=0.7, s=6)
    r = t.dfo("launch", "-H", t.node.name, "-j", str(job), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)["hosts"][t.node.name]["run"]
    secret = t.s3.secret_key
    shipped_while_running, snapshots = False, []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        snapshots.append(t.sh("ps -ww -eo args"))
        if t.objects(name) and t.status(run)["state"] == "running":
            shipped_while_running = True
            break
        time.sleep(0.3)
    assert shipped_while_running  # objects arrived in S3 while the trainer still ran
    meta = t.run_file(run, "meta.json")
    sh = t.run_file(run, "shipper.json")
    trainer_env = t.sh(f"cat /proc/{meta['pid']}/environ | tr '\\0' '\\n'")
    shipper_env = t.sh(f"cat /proc/{sh['pid']}/environ | tr '\\0' '\\n'")
    shipper_args = t.sh(f"cat /proc/{sh['pid']}/cmdline | tr '\\0' ' '")
    assert "remote.ship.shipper" in shipper_args and f"/workspace/.dfo/runs/{run}" in shipper_args
    for where, text in [("ps", "\n".join(snapshots)), ("trainer environ", trainer_env),
                        ("shipper environ", shipper_env), ("shipper argv", shipper_args)]:
        assert secret not in text, where
    assert "AWS_SECRET_ACCESS_KEY" not in trainer_env
    # tail ends after the last pass, which shipped the last checkpoint
    r = t.dfo("tail", "-H", t.node.name, run, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    st = t.status(run)
    assert st["state"] == "succeeded" and st["outputs"]["state"] == "done" and st["outputs"]["final"]["ok"]
    got = t.objects(name)
    assert sorted(got) == [f"ckpt-{i:03d}.bin" for i in range(6)]
    assert {k: _sha(v) for k, v in got.items()} == t.node_files()  # byte-identical
    # the secret is nowhere on the node's disk under the run, nor in the log
    run_dir = f"/workspace/.dfo/runs/{run}"
    assert t.tb.node_exec(t.node, f"grep -rl -F {secret} {run_dir} {t.out}").stdout == ""
    log = t.sh(f"cat {run_dir}/log")
    assert "[dfo outputs] pass" in log and secret not in log


@on_testbed
def test_on_a_node_a_killed_shipper_is_restarted_and_the_last_pass_still_ships(testbed: Any, tmp_path: Path) -> None:
    t = ShipBed(testbed, tmp_path)
    job, name = t.job(n=8, d=0.5, s=0)
    r = t.dfo("launch", "-H", t.node.name, "-j", str(job), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)["hosts"][t.node.name]["run"]
    first = t.shipper(run)["pid"]
    t.sh(f"kill -9 {first}")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        sh = t.run_file(run, "shipper.json")
        if sh["pid"] not in (None, first):
            break
        time.sleep(0.2)
    assert sh["restarts"] == 1 and sh["pid"] not in (None, first)
    # the whole log (+1): on a loaded machine the restart's line can be more than the default 10 lines back
    r = t.dfo("tail", "-H", t.node.name, run, "-n", "+1", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "starting it again (1 of 3)" in r.stdout
    st = t.status(run)
    assert st["state"] == "succeeded" and st["outputs"]["state"] == "done"
    assert {k: _sha(v) for k, v in t.objects(name).items()} == t.node_files()
    assert len(t.node_files()) == 8


@on_testbed
def test_on_a_node_dfo_stop_stops_the_trainer_then_the_last_pass_ships_its_checkpoint(
        testbed: Any, tmp_path: Path) -> None:
    t = ShipBed(testbed, tmp_path)
    job, name = t.job(n=1, d=0, s=600, every=600, p=2)  # one pass at the start, the next in 10 minutes
    r = t.dfo("launch", "-H", t.node.name, "-j", str(job), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)["hosts"][t.node.name]["run"]
    deadline = time.monotonic() + 20
    while "ckpt-000.bin" not in t.sh(f"ls {t.out} 2>/dev/null || true") and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    st = t.status(run)
    assert st["outputs"]["passes"] == 1 and st["outputs"]["shipped"]["files"] == 0  # the first pass found nothing
    assert t.objects(name) == {}
    r = t.dfo("stop", "-H", t.node.name, run, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # stop waits for the stopped run's last pass: once it returns, the node can be let go
    assert "outputs: last pass shipped 1 file" in r.stdout, r.stdout
    st = t.status(run)
    assert st["state"] == "stopped" and st["outputs"]["state"] == "done", st["outputs"]
    assert st["outputs"]["final"]["final"] is True and st["outputs"]["final"]["files"] == 1
    assert t.run_file(run, "end.json")["stopped"] is True
    got = t.objects(name)
    assert list(got) == ["ckpt-000.bin"] and {k: _sha(v) for k, v in got.items()} == t.node_files()


@on_testbed
def test_on_a_node_passes_that_fail_never_kill_the_run_and_status_shows_them(testbed: Any, tmp_path: Path) -> None:
    t = ShipBed(testbed, tmp_path)
    job, name = t.job(n=3, d=0.7, s=0, every=0.5)
    wrong = "wrong" + secrets.token_hex(8)  # S3 refuses every request signed with it
    r = t.dfo("launch", "-H", t.node.name, "-j", str(job), "--json", secret=wrong)
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)["hosts"][t.node.name]["run"]
    r = t.dfo("tail", "-H", t.node.name, run, timeout=120, secret=wrong)
    assert "trainer done" in r.stdout and "FAILED" in r.stdout + r.stderr
    st = t.status(run)
    out = st["outputs"]
    assert st["state"] == "succeeded" and st["exit_code"] == 0  # the run itself is untouched
    assert out["state"] == "failed" and out["failed_passes"] >= 2 and out["final"]["ok"] is False
    assert out["errors"] and t.run_file(run, "shipper.json")["restarts"] == 0  # failed passes, not a dead shipper
    assert t.objects(name) == {}
    assert wrong not in t.sh(f"cat /workspace/.dfo/runs/{run}/log /workspace/.dfo/runs/{run}/outputs.json")

