"""dfo outputs, restore before launch, and the outputs lines of status / tail / up: the real CLI against a
testbed node and its S3 server (SeaweedFS)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.testbed import Testbed
from tests._cli import dfo
from tests._runs_fixtures import inventory_copy

on_testbed = pytest.mark.testbed

# A trainer stand-in: writes N checkpoints into OUT (one a second, renamed into place), then waits for
# the file OUT/../go (or G seconds) and exits with code E.
WRITER = """\
import os, sys, time
out, n, wait, code = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
os.makedirs(out, exist_ok=True)
print("found:", sorted(x for x in os.listdir(out) if not x.startswith(".dfo")), flush=True)
for i in range(n):
    tmp = os.path.join(out, ".tmp-%d" % i)
    with open(tmp, "wb") as f:
        f.write(("step %d\\n" % i).encode() * 1000)
    os.rename(tmp, os.path.join(out, "ckpt-%d.txt" % i))
    print("wrote ckpt-%d" % i, flush=True)
    time.sleep(0.3)
deadline = time.time() + wait
while time.time() < deadline and not os.path.exists(out + ".go"):
    time.sleep(0.1)
sys.exit(code)
"""


class OutEnv:
    """One test's job with outputs:, its bucket, and dfo through the real CLI."""

    def __init__(self, tb: Testbed, tmp: Path) -> None:
        assert tb.s3 is not None
        self.tb, self.tmp, self.s3, self.node = tb, tmp, tb.s3, tb.nodes[0]
        self.inv = inventory_copy(tb, tmp)
        self.id = secrets.token_hex(3)
        self.bucket = f"out-{self.id}"
        self.s3.create_bucket(self.bucket)
        self.base = f"/workspace/outtest-{self.id}"
        (tmp / "writer.py").write_text(WRITER)

    def job(self, *, n: int = 2, wait: float = 0, code: int = 0, name: str | None = None,
            dest: str | None = "s3://{bucket}/runs/{name}/", venv: str = "/usr", **outputs: Any) -> tuple[Path, str]:
        name = name or f"o-{secrets.token_hex(3)}"
        path = f"{self.base}/{{name}}"
        doc: dict[str, Any] = {
            "name": name, "venv": venv,
            "s3": {"endpoint_url": self.s3.url, "region": self.s3.region},
            "outputs": {"path": path, "every": 1, "settle": 0,
                        **({"dest": dest.format(bucket=self.bucket, name="{name}")} if dest else {}), **outputs},
            "run": {"workdir": "/root/outtest", "upload": ["writer.py"], "wait": 0,
                    "command": f"python3 writer.py {self.base}/{name} {n} {wait} {code}"},
        }
        p = self.tmp / f"{name}.yaml"
        p.write_text(yaml.safe_dump(doc, sort_keys=False))
        return p, name

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update({"AWS_ACCESS_KEY_ID": self.s3.access_key, "AWS_SECRET_ACCESS_KEY": self.s3.secret_key,
                    "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                    "COLUMNS": "200"})
        return env

    def dfo(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return dfo(self.inv, *args, timeout=timeout, env=self.env(), cwd=self.tmp)

    def json(self, *args: str, expect: int = 0, timeout: float = 180) -> dict[str, Any]:
        r = self.dfo(*args, "--json", timeout=timeout)
        assert r.returncode == expect, f"exit {r.returncode}: {r.stdout}\n{r.stderr}"
        return json.loads(r.stdout)["hosts"][self.node.name]  # type: ignore[no-any-return]

    def sh(self, cmd: str) -> str:
        r = self.tb.node_exec(self.node, cmd)
        assert r.returncode == 0, f"{cmd}: {r.stderr}"
        return r.stdout

    def keys(self, prefix: str) -> dict[str, bytes]:
        c = self.s3.core_client()
        out: dict[str, bytes] = {}
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                out[o["Key"][len(prefix):]] = c.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
        return out

    def wait_ended(self, run: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            st = self.json("status", "-H", self.node.name, run)["runs"][0]
            if st["state"] != "running" or time.monotonic() > deadline:
                return st  # type: ignore[no-any-return]
            time.sleep(0.3)


@pytest.fixture
def oenv(testbed: Testbed, tmp_path: Path) -> OutEnv:
    if testbed.s3 is None or not testbed.isolated:
        pytest.skip("needs the testbed's S3 server and nodes with their own /workspace")
    env = OutEnv(testbed, tmp_path)
    yield env  # type: ignore[misc]
    testbed.node_exec(env.node, f"rm -rf {shlex.quote(env.base)} {shlex.quote(env.base)}-*")



# --------------------------------------------------------------------------- restore before launch


@on_testbed
def test_restore_fetches_dest_into_an_empty_path_and_skips_a_full_one(oenv: OutEnv,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    job, name = oenv.job(n=0, restore=True)
    prefix = f"runs/{name}/"
    body = b"last shipped\n" * 100
    oenv.s3.put_bytes(oenv.bucket, prefix + "ckpt-7.txt", body)
    oenv.s3.put_bytes(oenv.bucket, prefix + "sub/opt.bin", b"\x00" * 5000)
    oenv.s3.put_bytes(oenv.bucket, prefix + ".dfo/shipper-state.json", b"{}")  # dfo's bookkeeping: never restored
    path = f"{oenv.base}/{name}"
    oenv.sh(f"mkdir -p {path}/.dfo")  # a folder holding only dfo's names counts as empty
    r = oenv.dfo("launch", "-H", oenv.node.name, "-j", str(job))
    assert r.returncode == 0, r.stdout + r.stderr
    from remote.lib.fsutil import human_bytes

    size = human_bytes(len(body) + 5000)
    assert f"restore: 2 files, {size} from s3://{oenv.bucket}/{prefix} into {path}" in r.stderr, r.stderr
    assert hashlib.sha256(oenv.sh(f"cat {path}/ckpt-7.txt").encode()).hexdigest() == hashlib.sha256(body).hexdigest()
    assert oenv.sh(f"stat -c %s {path}/sub/opt.bin").strip() == "5000"
    assert oenv.sh(f"ls -A {path}/.dfo").split().count("shipper-state.json") == 0
    run = oenv.json("status", "-H", oenv.node.name, "-j", str(job))["runs"][0]["id"]
    st = oenv.wait_ended(run)
    assert st["state"] == "succeeded"
    # the trainer saw the restored files when it started
    assert "found: ['ckpt-7.txt', 'sub']" in oenv.sh(f"cat /workspace/.dfo/runs/{run}/log")
    # the path holds files now: a second launch leaves them alone (a file changed on the node stays)
    oenv.sh(f"echo mine > {path}/ckpt-7.txt")
    doc = oenv.json("launch", "-H", oenv.node.name, "-j", str(job))
    assert doc["restore"]["status"] == "skipped" and "holds files already" in doc["restore"]["why"]
    assert oenv.sh(f"cat {path}/ckpt-7.txt") == "mine\n"
    # that run shipped the changed file; once its last pass is done, a node's copy goes stale (a node that
    # kept its disk while another node wrote newer checkpoints)
    run2 = oenv.json("status", "-H", oenv.node.name, "-j", str(job))["runs"][0]["id"]
    assert oenv.dfo("tail", "-H", oenv.node.name, run2).returncode == 0
    shipped = oenv.keys(prefix)["ckpt-7.txt"]
    assert shipped == b"mine\n"
    oenv.sh(f"echo stale > {path}/ckpt-7.txt; echo only-here > {path}/local.txt")
    # a recovering run's new generation (launch refreshes from generation 2 on): what differs from the
    # shipped files is replaced by them, whatever the node kept; a file that was never shipped stays
    from orchestrator.config.models import load_job
    from orchestrator.hosts import HostSession
    from orchestrator.steps.outputs import restore

    for k, v in oenv.env().items():
        if k.startswith("AWS_"):
            monkeypatch.setenv(k, v)
    session = HostSession(oenv.inv, (oenv.node.name,))
    try:
        rep = restore(session.conn(oenv.node.name), load_job(job), "refresh-run", refresh=True)
    finally:
        session.close()
    assert rep is not None and rep.status == "done" and rep.fetched == 1, rep  # ckpt-7.txt; sub/opt.bin is as shipped
    assert oenv.sh(f"cat {path}/ckpt-7.txt") == "mine\n"
    assert oenv.sh(f"cat {path}/local.txt") == "only-here\n"


@on_testbed
def test_restore_says_nothing_at_an_empty_dest_and_restore_false_skips_it(oenv: OutEnv) -> None:
    job, name = oenv.job(n=0)
    r = oenv.dfo("launch", "-H", oenv.node.name, "-j", str(job))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"restore: nothing at s3://{oenv.bucket}/runs/{name}/" in r.stderr, r.stderr
    off, name2 = oenv.job(n=0, restore=False)
    oenv.s3.put_bytes(oenv.bucket, f"runs/{name2}/ckpt-1.txt", b"x")
    doc = oenv.json("launch", "-H", oenv.node.name, "-j", str(off))
    assert doc["restore"] is None
    assert oenv.tb.node_exec(oenv.node, f"test -e {oenv.base}/{name2}/ckpt-1.txt").returncode != 0


@on_testbed
def test_restore_needs_credentials_before_any_host_is_touched(oenv: OutEnv) -> None:
    job, _ = oenv.job(n=0)
    env = {k: v for k, v in oenv.env().items() if not k.startswith("AWS_ACCESS") and not k.startswith("AWS_SECRET")}
    r = dfo(oenv.inv, "launch", "-H", "nosuchhost", "-j", str(job), timeout=60, env=env, cwd=oenv.tmp)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no S3 credentials found" in r.stderr and "nosuchhost" not in r.stderr


# --------------------------------------------------------------------------- a bad outputs: field


BAD = [
    ("dest", "http://bucket/x/", "must be an s3://bucket/prefix/ URL"),
    ("path", "relative/dir", "must be an absolute path on the node"),
    ("path", "/workspace/{job}", "unknown placeholder {job}"),
    ("every", 0, "greater than 0"),
]


@pytest.mark.parametrize(("field", "value", "says"), BAD)
def test_a_bad_outputs_field_is_exit_2_with_file_line(tmp_path: Path, field: str, value: Any, says: str) -> None:
    job = tmp_path / "bad.yaml"
    other = "" if field == "path" else "  path: /workspace/ckpt\n"
    job.write_text(f"name: bad\nvenv: /usr\noutputs:\n  {field}: {json.dumps(value)}\n{other}"
                   "run:\n  command: python3 x.py\n")
    inv = tmp_path / "inv.yaml"
    inv.write_text("hosts:\n  n1:\n    address: 127.0.0.1\n")
    for argv in (["launch", "-H", "n1", "-j", str(job)], ["outputs", "-H", "n1", "-j", str(job)],
                 ["up", "-H", "n1", "-j", str(job)]):
        r = dfo(inv, *argv, timeout=60, env=dict(os.environ))
        assert r.returncode == 2, (argv, r.stdout + r.stderr)
        assert f"{job}:4" in r.stderr and f"outputs.{field}" in r.stderr and says in r.stderr, (argv, r.stderr)


# --------------------------------------------------------------------------- dfo outputs, --ship, tail


@on_testbed
def test_outputs_shows_what_was_shipped_and_ship_makes_a_pass(oenv: OutEnv) -> None:
    job, name = oenv.job(n=3, wait=60, every=600)  # no pass on schedule in this test: --ship makes them
    launched = oenv.json("launch", "-H", oenv.node.name, "-j", str(job))
    run = launched["run"]
    prefix = f"runs/{name}/"
    path = f"{oenv.base}/{name}"
    deadline = time.monotonic() + 30
    while oenv.tb.node_exec(oenv.node, f"test -e {path}/ckpt-2.txt").returncode != 0:
        assert time.monotonic() < deadline, "the trainer wrote no checkpoints"
        time.sleep(0.2)
    first = oenv.json("outputs", "-H", oenv.node.name, run, "--ship")
    assert first["run"] == run and first["status"] in ("done", "no change") and first["ok"], first
    assert {"ok", "status", "fetched", "skipped", "bytes", "seconds", "mb_per_s", "dest", "source", "files_total",
            "bytes_total"} <= set(first)
    assert first["dest"] == f"s3://{oenv.bucket}/{prefix}" and first["source"] == path
    doc = oenv.json("outputs", "-H", oenv.node.name, run)
    assert doc["run"] == run and doc["state"] in ("idle", "shipping") and doc["shipped"]["files"] == 3, doc
    assert doc["dest"] == f"s3://{oenv.bucket}/{prefix}" and doc["passes"] >= 1 and doc["last_pass"]["ok"]
    assert sorted(oenv.keys(prefix)) == ["ckpt-0.txt", "ckpt-1.txt", "ckpt-2.txt"]
    text = oenv.dfo("outputs", "-H", oenv.node.name, run)
    assert text.returncode == 0 and f"s3://{oenv.bucket}/{prefix}" in text.stdout, text.stdout + text.stderr
    assert "shipped 3 files" in text.stdout
    st = oenv.dfo("status", "-H", oenv.node.name)
    assert f"{run}: outputs: " in st.stdout and "shipped 3 files" in st.stdout, st.stdout
    # --ship: a new file goes now, in sync-data's report shape; nothing new is "no change"
    oenv.sh(f"echo fresh > {path}/extra.txt")
    shipped = oenv.json("outputs", "-H", oenv.node.name, run, "--ship")
    assert shipped["status"] == "done" and shipped["fetched"] == 1 and shipped["bytes"] == 6, shipped
    assert oenv.keys(prefix)["extra.txt"] == b"fresh\n"
    again = oenv.json("outputs", "-H", oenv.node.name, run, "--ship")
    assert again["status"] == "no change" and again["fetched"] == 0, again
    text = oenv.dfo("outputs", "-H", oenv.node.name, run, "--ship")
    assert text.returncode == 0 and f"no change: nothing new under {path}" in text.stdout, text.stdout + text.stderr
    assert "4 files, 20.5 KiB shipped to" in text.stdout
    # the run ends: tail waits for the last pass and says how it went
    oenv.sh(f"touch {path}.go")
    tail = oenv.dfo("tail", "-H", oenv.node.name, run)
    assert tail.returncode == 0, tail.stdout + tail.stderr
    assert f"s3://{oenv.bucket}/{prefix}; 4 files (20.5 KiB) shipped in all" in tail.stderr, tail.stderr
    assert "outputs: last pass shipped 0 files (0 B) to" in tail.stderr  # the final pass found nothing new
    final = oenv.json("outputs", "-H", oenv.node.name, run)
    assert final["state"] == "done" and final["final"]["ok"], final
    # the S3 secret went on stdin only: no file of the run (meta.json, log, outputs.json, ...) holds it
    held = oenv.tb.node_exec(oenv.node,
                             f"grep -rlF {shlex.quote(oenv.s3.secret_key)} /workspace/.dfo/runs/{run} {path}")
    assert held.returncode == 1 and not held.stdout, held.stdout


@on_testbed
def test_tail_and_up_exit_3_when_the_run_succeeded_but_its_last_pass_failed(oenv: OutEnv) -> None:
    job, name = oenv.job(n=1, dest=f"s3://nosuchbucket-{oenv.id}/runs/{{name}}/", restore=False,
                         venv=f"{oenv.base}/venv")
    up = oenv.dfo("up", "-H", oenv.node.name, "-j", str(job), "--json", timeout=300)
    assert up.returncode == 3, up.stdout + up.stderr
    doc = json.loads(up.stdout)
    run = doc["hosts"][oenv.node.name]["run"]
    assert run is not None, up.stdout + up.stderr
    assert run["state"] == "succeeded" and doc["exit_code"] == 3
    assert run["outputs"]["state"] == "failed" and run["outputs"]["final"]["ok"] is False, run
    assert "outputs: last pass FAILED" in up.stderr
    tail = oenv.dfo("tail", "-H", oenv.node.name, run["id"])
    assert tail.returncode == 3 and "outputs: last pass FAILED" in tail.stderr, tail.stdout + tail.stderr
    shown = oenv.json("outputs", "-H", oenv.node.name, run["id"])
    assert shown["errors"] and shown["failed_passes"] >= 1
    # launch watching the whole run says the same (exit 3, the line)
    watched = oenv.dfo("launch", "-H", oenv.node.name, "-j", str(job), "--wait", "120", timeout=300)
    assert watched.returncode == 3 and "outputs: last pass FAILED" in watched.stdout, watched.stdout + watched.stderr
    # the shipper has ended: --ship makes the pass on the node, which needs the job's credentials (-j)
    bare = oenv.json("outputs", "-H", oenv.node.name, run["id"], "--ship", expect=2)
    assert "-j JOB" in bare["error"]["hint"], bare
    again = oenv.dfo("outputs", "-H", oenv.node.name, run["id"], "--ship", "-j", str(job))
    assert again.returncode == 3 and "outputs --ship: FAILED" in again.stdout and "NoSuchBucket" in again.stdout, (
        again.stdout + again.stderr)


@on_testbed
def test_a_run_without_outputs_says_so(oenv: OutEnv) -> None:
    job, name = oenv.job(n=0, dest=None)
    run = oenv.json("launch", "-H", oenv.node.name, "-j", str(job))["run"]
    assert oenv.wait_ended(run)["state"] == "succeeded"
    doc = oenv.json("outputs", "-H", oenv.node.name, run)
    assert doc["run"] == run and doc["state"] is None and doc["shipped"] == {}
    text = oenv.dfo("outputs", "-H", oenv.node.name, "-j", str(job))  # RUN left out: the job's newest run
    assert text.returncode == 0 and f"run {run} " in text.stdout and "ships no outputs" in text.stdout, text.stdout
    assert f"run {run} (job {name}): the newest run of job {name}" in text.stderr
    r = oenv.json("outputs", "-H", oenv.node.name, run, "--ship", expect=2)
    assert "ships no outputs" in r["error"]["message"]


# --------------------------------------------------------------------------- pure logic


def test_outputs_spec_expands_name_and_run_id(tmp_path: Path) -> None:
    from orchestrator.config.models import load_job
    from orchestrator.steps.outputs import launch_fields, outputs_spec

    job = tmp_path / "j.yaml"
    job.write_text("name: jn\nvenv: /usr\ns3: {credentials: node, part_size_mb: 8}\n"
                   "outputs: {path: '/w/{name}/{run_id}/', dest: 's3://b/r/{name}/{run_id}', every: 5}\n"
                   "run: {command: x}\n")
    loaded = load_job(str(job))
    spec = outputs_spec(loaded, "jn-1")
    assert spec["path"] == "/w/jn/jn-1" and spec["dest"] == "s3://b/r/jn/jn-1/"
    assert spec["every"] == 5 and spec["credentials_mode"] == "node" and spec["part_size_mb"] == 8
    assert "credentials" not in spec
    assert launch_fields(loaded, "jn-1") == {"outputs": spec, "outputs_credentials": None}
    job.write_text("name: jn\nvenv: /usr\noutputs: {path: /w}\nrun: {command: x}\n")
    assert launch_fields(load_job(str(job)), "r") == {}  # no dest: nothing ships


def test_ship_report_and_final_line() -> None:
    from orchestrator.steps.outputs import ShipReport, final_line

    p = {"n": 3, "ok": True, "files": 0, "bytes": 0, "skipped": 4, "seconds": 0.1, "mb_per_s": 0.0, "error": None}
    r = ShipReport.of("h", "run1", p, "/w", "s3://b/")
    assert (r.status, r.fetched, r.skipped, r.files_total, r.ok) == ("no change", 0, 4, 4, True)
    r = ShipReport.of("h", "run1", {**p, "files": 2, "bytes": 10}, "/w", "s3://b/")
    assert (r.status, r.fetched, r.files_total) == ("done", 2, 6)
    r = ShipReport.of("h", "run1", {**p, "ok": False, "error": "AccessDenied"}, "/w", "s3://b/")
    assert (r.status, r.ok, r.error) == ("failed", False, "AccessDenied")
    ok = final_line({"state": "done", "dest": "s3://b/", "final": {"ok": True, "files": 1, "bytes": 3 << 20},
                     "shipped": {"files": 5, "bytes": 7 << 20}})
    assert ok == ("outputs: last pass shipped 1 file (3.0 MiB) to s3://b/; 5 files (7.0 MiB) shipped in all", False)
    bad = final_line({"state": "failed", "final": {"ok": False, "error": "no such bucket"}})
    assert bad == ("outputs: last pass FAILED: no such bucket", True)
    assert final_line(None) is None
