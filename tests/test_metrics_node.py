"""The sampler on a real testbed node (no GPU): a fake nvidia-smi on the trainer's PATH replays CSV recorded
on an H200 (tests/data/nvidia_smi, bench/gpu_record_smi.sh), its second sample changed (under load), and a
fake dmesg logs an XID mid-run. Checks metrics.jsonl's rows, status's last sample, `top --once --json`, a
`plot` PNG read back, the webhook of a failed run received on the testbed bridge, and the idle stop."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests._runs_fixtures import RunsEnv, dfo_popen, inventory_copy

DATA = Path(__file__).parent / "data" / "nvidia_smi"
FAKEBIN = "/root/dfo-fakebin"

# Replays the recorded samples: the Nth call prints the Nth line of samples.csv (the last one after that);
# it answers the sampler's own query only, like the real one refuses a field it does not know.
FAKE_SMI = """#!/bin/sh
d=$(dirname "$0")
case "$1" in --query-gpu=$(cat "$d/fields")) ;; *) echo "bad query $1" >&2; exit 2;; esac
n=$(cat "$d/count" 2>/dev/null || echo 0); n=$((n + 1)); echo $n > "$d/count"
total=$(wc -l < "$d/samples.csv")
[ $n -gt $total ] && n=$total
sed -n "${n}p" "$d/samples.csv"
"""
# The kernel log: an old XID (before the run: not the run's), and a new one once $d/xid exists.
FAKE_DMESG = """#!/bin/sh
d=$(dirname "$0")
echo "[    5.000000] NVRM: Xid (PCI:0000:00:06): 13, pid=1, old news"
echo "[    6.000000] eth0: link up"
[ -e "$d/xid" ] && echo "[  999.000000] NVRM: Xid (PCI:0000:00:06): 79, pid=4242, GPU has fallen off the bus."
exit 0
"""
TRAINER = """\
import os, sys, time
for i in range(1, 9):
    print("step %d/100 loss %.3f lr 3e-4 tok/s %d" % (i, 4.0 / i, 1000 + i), flush=True)
    if i == 4:
        open(os.environ["FAKEBIN"] + "/xid", "w").close()
    time.sleep(0.6)
sys.exit(int(sys.argv[1]))
"""


def _samples(kind: str) -> list[str]:
    out, phase = [], ""
    for ln in (DATA / "query-samples.txt").read_text().splitlines():
        if ln.startswith("# "):
            phase = ln.split()[1]
        elif ln.strip() and phase == kind:
            out.append(ln)
    return out


def _fields() -> str:
    from remote.runs.metrics import GPU_FIELDS

    return ",".join(f[0] for f in GPU_FIELDS)


class Hook:
    """A webhook receiver on the testbed's bridge address (never a public one)."""

    def __init__(self, address: str) -> None:
        got: list[tuple[float, dict[str, Any]]] = []

        class H(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                got.append((time.time(), json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.got = got
        self.srv = ThreadingHTTPServer((address, 0), H)
        self.url = f"http://{address}:{self.srv.server_address[1]}/services/T0/B0/SECRETPART"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def wait(self, n: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.got) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        return [d for _, d in self.got]

    def close(self) -> None:
        self.srv.shutdown()


def _fakebin(env: RunsEnv, samples: list[str]) -> None:
    q = shlex.quote
    env.node_sh(f"rm -rf {FAKEBIN} && mkdir -p {FAKEBIN} && printf %s {q(FAKE_SMI)} > {FAKEBIN}/nvidia-smi && "
                f"printf %s {q(FAKE_DMESG)} > {FAKEBIN}/dmesg && chmod +x {FAKEBIN}/nvidia-smi {FAKEBIN}/dmesg && "
                f"printf %s {q(_fields())} > {FAKEBIN}/fields && printf %s {q(chr(10).join(samples) + chr(10))} "
                f"> {FAKEBIN}/samples.csv")


def _job(env: RunsEnv, command: str, run: dict[str, Any], notify: dict[str, Any] | None = None) -> tuple[Path, str]:
    name = f"m-{int(time.time() * 1000) % 10**8}"
    (env.tmp / "train.py").write_text(TRAINER)
    doc: dict[str, Any] = {"name": name, "venv": "/usr", "run": {
        "workdir": "/root/runs-test", "upload": ["train.py"], "command": command, "wait": 0,
        "env": {"PATH": f"{FAKEBIN}:/usr/local/bin:/usr/bin:/bin", "FAKEBIN": FAKEBIN}, **run}}
    if notify:
        doc["notify"] = notify
    path = env.tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, name


def _rows(env: RunsEnv, run: str) -> list[dict[str, Any]]:
    text = env.node_sh(f"cat /workspace/.dfo/runs/{run}/metrics.jsonl")
    return [json.loads(ln) for ln in text.splitlines()]


@pytest.fixture
def env(testbed, tmp_path: Path) -> RunsEnv:  # type: ignore[no-untyped-def]
    inv = inventory_copy(testbed, tmp_path)
    doc = yaml.safe_load(inv.read_text())
    doc["defaults"]["price_per_hour"] = 3.6  # what the node costs: status, top and report show the cost so far
    inv.write_text(yaml.safe_dump(doc))
    return RunsEnv(testbed, testbed.nodes[0], inv, tmp_path)


def test_sampler_rows_top_plot_and_webhook_of_a_failed_run(env: RunsEnv) -> None:
    address = env.tb.bridge_address if env.tb.isolated and env.tb.bridge_address else "127.0.0.1"
    hook = Hook(address)
    try:
        samples = _samples("idle")[:1] + _samples("load")[1:3]  # the second sample changed: under load
        _fakebin(env, samples)
        job, _ = _job(env, "python3 train.py 3", {"metrics_every": 1}, notify={"webhook": "$DFO_TEST_HOOK"})
        r = env.dfo("launch", "-H", env.node.name, "-j", str(job), "--json", env={"DFO_TEST_HOOK": hook.url})
        assert r.returncode in (0, 5), r.stderr
        run = json.loads(r.stdout)["hosts"][env.node.name]["run"]
        st = env.wait_state(run, ("failed",), timeout=60)
        assert st["state"] == "failed"
        ended = time.time()
        got = hook.wait(1, 30)  # within 30 s of the failure
        assert got and got[0]["dfo"]["event"] == "failed" and got[0]["dfo"]["run"] == run
        assert got[0]["text"].startswith(f"dfo: run {run} on ") and "failed (exit code 3)" in got[0]["text"]
        assert hook.got[0][0] - ended < 30
        # the alert goes before the sampler's last pass (the log's last figures): read the rows once the
        # supervisor, which waits for that pass, has exited
        pid = env.run_file(run, "meta.json")["supervisor_pid"]
        deadline = time.monotonic() + 30
        while env.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not env.alive(pid), "the supervisor outlived its failed trainer by 30 s"
        rows = _rows(env, run)
        sys_rows = [x for x in rows if x["kind"] == "sys"]
        utils = [x["gpus"][0]["util"] for x in sys_rows if x["gpus"]]
        assert utils[0] == 0 and 100 in utils  # the recorded idle sample, then the changed one
        assert sys_rows[-1]["gpus"][0]["name"] == "NVIDIA H200" and sys_rows[-1]["gpus"][0]["power"] > 600
        xids = [x for s in sys_rows for x in s.get("xid") or []]
        assert [(x["xid"], x["bus"]) for x in xids] == [(79, "0000:00:06")]  # the new one only, once
        host = sys_rows[-1]["host"]
        assert host["mem_total"] > 0 and "shm_total" in host and "disk_total" in host
        train = [x for x in rows if x["kind"] == "train"]
        assert [x["step"] for x in train] == list(range(1, 9))
        assert train[-1]["loss"] == 0.5 and train[-1]["tok_s"] == 1008 and train[-1]["total"] == 100
        # nothing on the node holds the webhook URL: meta.json, the log, notify.jsonl
        secret = "SECRETPART"
        assert secret not in env.node_sh(f"cat /workspace/.dfo/runs/{run}/meta.json /workspace/.dfo/runs/{run}/log "
                                         f"/workspace/.dfo/runs/{run}/notify.jsonl")
        # status --json: the last sample
        st = env.status(run)
        r = env.dfo("status", "-H", env.node.name, run, "--json")
        doc = json.loads(r.stdout)["hosts"][env.node.name]["runs"][0]
        assert doc["metrics"]["sys"]["gpus"][0]["util"] in utils and doc["metrics"]["train"]["step"] == 8
        r = env.dfo("status", "-H", env.node.name, run)  # the detail view: the last sample, the cost
        assert r.returncode == 0 and "NVIDIA" not in r.stdout and "1 GPU util" in r.stdout, r.stdout
        assert "step 8/100 loss 0.5" in r.stdout and "cost" in r.stdout and doc["cost"] is not None
        r = env.dfo("report", "-H", env.node.name, run, "--json")
        rep = json.loads(r.stdout)["hosts"][env.node.name]
        assert rep["gpus"] == 1 and rep["mean_gpu_util"] is not None and rep["mean_tok_s"] is not None
        assert rep["price_per_hour"] == 3.6 and rep["cost"] == round(3.6 * rep["seconds"] / 3600, 2)
        # top --once --json
        r = env.dfo("top", "-H", env.node.name, run, "--once", "--json")
        assert r.returncode == 0, r.stderr
        top = json.loads(r.stdout)["hosts"][env.node.name]
        assert top["run"] == run and top["state"] == "failed" and top["train"]["loss"] == 0.5
        assert top["gpus"][0]["name"] == "NVIDIA H200" and top["xid"] == 1 and top["cost"] is not None
        # the live view (off a terminal it prints each refresh): Ctrl-C ends it, exit 0
        p = dfo_popen(env.inv, "top", "-H", env.node.name, run, "--every", "1", env={"PYTHONFAULTHANDLER": "1"})
        time.sleep(4)
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread's stack on SIGABRT
            p.send_signal(signal.SIGABRT)
            out, err = p.communicate(timeout=30)
            raise AssertionError(f"dfo top outlived Ctrl-C by 60 s: {err[-6000:]}") from None
        assert p.returncode == 0 and "dfo top" in out and run in out, out + err
        # plot: a PNG with the right series, read back
        png = env.tmp / "loss.png"
        r = env.dfo("plot", "-H", env.node.name, run, "loss", "gpu_util", "-o", str(png), "--json")
        assert r.returncode == 0, r.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        plotted = json.loads(r.stdout)["series"]
        loss = next(s for s in plotted if s["metric"] == "loss")
        assert loss["x"] == list(range(1, 9)) and loss["y"][-1] == 0.5
        assert 100 in next(s for s in plotted if s["metric"] == "gpu_util")["y"]
        # the terminal plot, with no file asked
        r = env.dfo("plot", "-H", env.node.name, run, "loss")
        assert r.returncode == 0 and "loss" in r.stdout, r.stderr
    finally:
        hook.close()


def test_idle_gpus_stop_the_run(env: RunsEnv) -> None:
    _fakebin(env, _samples("idle"))
    job, _ = _job(env, "sleep 300", {"metrics_every": 1, "idle_minutes": 0.05, "idle_action": "stop",
                                     "stop_grace": 2})
    run = env.launch(job)["run"]
    st = env.wait_state(run, ("stopped", "failed", "succeeded"), timeout=60)
    assert st["state"] == "stopped"
    stop = env.run_file(run, "stop.json")
    assert stop["why"].startswith("idle: every GPU under 5")


def test_tail_and_plot_from_s3_after_the_node_vanished(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With outputs.dest, the log and metrics.jsonl ship beside the checkpoints; once the node is gone,
    `tail --from-s3` and `plot --from-s3` read them there."""
    import os
    import secrets

    tb = make_testbed(nodes=1)
    env = RunsEnv(tb, tb.nodes[0], inventory_copy(tb, tmp_path), tmp_path)
    assert tb.s3 is not None
    bucket = f"runs-{secrets.token_hex(3)}"
    tb.s3.create_bucket(bucket)
    _fakebin(env, _samples("load")[1:3])
    job, name = _job(env, "python3 train.py 0", {"metrics_every": 1})
    doc = yaml.safe_load(job.read_text())
    doc["s3"] = {"endpoint_url": tb.s3.url, "region": tb.s3.region}
    doc["outputs"] = {"path": "/root/ckpt/{run_id}", "dest": f"s3://{bucket}/ckpt/{{run_id}}/", "every": 2}
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    aws = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    aws.update({"AWS_ACCESS_KEY_ID": tb.s3.access_key, "AWS_SECRET_ACCESS_KEY": tb.s3.secret_key,
                "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"})
    from tests import _cli

    def dfo(*args: str) -> Any:
        return _cli.dfo(env.inv, *args, env=_cli.cli_env(aws), timeout=120)

    r = dfo("launch", "-H", env.node.name, "-j", str(job), "--json")
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)["hosts"][env.node.name]["run"]
    r = dfo("tail", "-H", env.node.name, "-j", str(job), run)  # to the end, and the outputs' last pass
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 30  # the supervisor puts the files after the run's end
    while time.monotonic() < deadline:
        shipped = env.tb.node_exec(env.node, f"cat /workspace/.dfo/runs/{run}/runship.json").stdout
        if '"puts"' in shipped and json.loads(shipped)["puts"] >= 2 and not env.alive(env.run_file(run, "meta.json")
                                                                                       ["supervisor_pid"]):
            break
        time.sleep(0.5)
    tb.vanish(env.node)
    r = dfo("tail", "-H", env.node.name, "--from-s3", "-j", str(job), run, "-n", "+1")
    assert r.returncode == 0, r.stderr
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("step ")][-1].startswith("step 8/100 loss 0.500")
    png = tmp_path / "from-s3.png"
    r = dfo("plot", "--from-s3", "-j", str(job), run, "loss", "gpu_util", "-o", str(png), "--json")
    assert r.returncode == 0, r.stderr
    series = json.loads(r.stdout)["series"]
    assert next(s for s in series if s["metric"] == "loss")["x"] == list(range(1, 9))
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = dfo("report", "-H", env.node.name, "--from-s3", "-j", str(job), run, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)["hosts"][env.node.name]
    assert rep["last_step"] == 8 and rep["last_loss"] == 0.5 and rep["gpus"] == 1 and rep["mean_gpu_util"] == 100
    r = dfo("tail", "-H", env.node.name, "--from-s3", "-j", str(job), run + "x")
    assert r.returncode == 2 and "no log of run" in r.stderr, r.stderr


def test_a_lost_node_is_reported_by_another_node_of_the_gang(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The node that vanished cannot speak: the gang's hub posts `lost` for it."""
    from tests._cli import cli_env
    from tests._cli import dfo as run_dfo
    from tests.test_gang import gang_job, wait_gang_ended

    tb = make_testbed(nodes=2, s3=False)
    if not tb.isolated or not tb.bridge_address:
        pytest.skip("vanish needs namespace nodes (root)")
    hook = Hook(tb.bridge_address)
    try:
        inv = inventory_copy(tb, tmp_path)
        job, _ = gang_job(tb, tmp_path, STEPS="600")
        doc = yaml.safe_load(job.read_text())
        doc["notify"] = {"webhook": "${DFO_TEST_HOOK}", "on": ["lost"]}
        job.write_text(yaml.safe_dump(doc, sort_keys=False))
        r = run_dfo(inv, "launch", "-H", "testbed", "-j", str(job), "--json",
                    env=cli_env(DFO_TEST_HOOK=hook.url), timeout=120)
        assert r.returncode == 0, r.stderr
        run = json.loads(r.stdout)["hosts"]["node-1"]["run"]
        time.sleep(3)  # every member has joined the hub
        tb.vanish("node-2")
        got = hook.wait(1, 60)  # the hub's silence rule (20 s), then the post
        assert got and got[0]["dfo"]["event"] == "lost" and got[0]["dfo"]["lost_host"] == "node-2"
        assert got[0]["text"].startswith(f"dfo: run {run}: node node-2 lost")
        wait_gang_ended(inv, run, 90)
        assert len(hook.got) == 1  # on: [lost] only: the hub's own stop is not posted
    finally:
        hook.close()
