"""The metrics sampler's pure parts (remote/runs/metrics.py, remote/runs/notify.py) and the controller's
figures (orchestrator/steps/metrics.py): parsing real H200 nvidia-smi output, log metrics in their forms,
the bound on metrics.jsonl, the idle rule, and a webhook post to a local HTTP server."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from orchestrator.steps import metrics as sm
from orchestrator.steps.runs import RunInfo
from remote.runs import metrics as m
from remote.runs import notify

DATA = Path(__file__).parent / "data" / "nvidia_smi"


def recorded_samples() -> list[tuple[str, str]]:
    """(phase, csv line) of the samples recorded on an H200 (bench/gpu_record_smi.sh)."""
    out, phase = [], ""
    for ln in (DATA / "query-samples.txt").read_text().splitlines():
        if ln.startswith("# "):
            phase = ln.split()[1]
        elif ln.strip():
            out.append((phase, ln))
    return out


def test_recorded_h200_csv_parses_into_gpu_rows() -> None:
    header = (DATA / "query-header.csv").read_text().splitlines()[0]
    assert len(header.split(",")) == len(m.GPU_FIELDS)  # the fake nvidia-smi answers the sampler's own query
    samples = recorded_samples()
    idle = m.parse_gpu_csv(samples[0][1], m.GPU_FIELDS)
    load = m.parse_gpu_csv([s for p, s in samples if p == "load"][-1], m.GPU_FIELDS)
    assert idle[0]["i"] == 0 and idle[0]["name"] == "NVIDIA H200" and idle[0]["util"] == 0
    assert idle[0]["mem_total"] == 143771 and idle[0]["sm_clock"] == 345
    assert load[0]["util"] >= 99 and load[0]["power"] > 600 and load[0]["mem_used"] == 1139
    assert load[0]["throttle"] == "0x0000000000000004" and load[0]["ecc_uncorr"] == 0


def test_na_fields_are_left_out_and_bad_lines_skipped() -> None:
    line = "0, GPU-x, NVIDIA H200, 00000000:00:06.0, [N/A], 0, 10, 100, [Not Supported], 700, 40, 345, 3201, 1980, " \
           "[N/A], [N/A]"
    rows = m.parse_gpu_csv(line + "\nnot, a, row\n", m.GPU_FIELDS)
    assert len(rows) == 1 and "util" not in rows[0] and "power" not in rows[0] and rows[0]["temp"] == 40


def test_default_patterns_read_the_usual_forms() -> None:
    pats = m.compile_patterns({})
    assert m.parse_line("step 120 loss 2.5 lr 3e-4 tok/s 51234.5", pats) == {
        "step": 120, "loss": 2.5, "lr": 3e-4, "tok_s": 51234.5}
    assert m.parse_line("step=7 loss=0.125 lr=1e-05", pats) == {"step": 7, "loss": 0.125, "lr": 1e-05}
    assert m.parse_line("iter: 30/500 | train_loss: 1.75 | tokens/s: 900", pats) == {
        "step": 30, "total": 500, "loss": 1.75, "tok_s": 900.0}
    assert m.parse_line("epoch 3 val_loss 9.0", pats) == {}  # val_loss is not loss; epoch is not step
    assert m.parse_line("nothing here", pats) == {}


def test_json_lines_and_user_patterns() -> None:
    pats = m.compile_patterns({"acc": r"acc ([0-9.]+)", "loss": r"L=([0-9.]+)"})
    assert m.parse_line('{"global_step": 9, "loss": 1.5, "name": "x", "ok": true}', pats) == {
        "global_step": 9, "loss": 1.5, "step": 9}
    assert m.parse_line("step 3 L=0.5 acc 0.9 loss 7", pats) == {"step": 3, "loss": 0.5, "acc": 0.9}


def test_log_metrics_join_values_with_their_step(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("step 1\nloss 2.0\ntok/s 100\nstep 2 loss 1.5\nhello\nstep 3 lo")
    lm = m.LogMetrics(str(log), m.compile_patterns({}))
    rows = lm.poll(1000.0)
    assert [(r["step"], r.get("loss"), r.get("tok_s")) for r in rows] == [(1, 2.0, 100.0), (2, 1.5, None)]
    with log.open("a") as f:
        f.write("ss 1.25\n")  # the partial line completed: "step 3 loss 1.25"
    rows = lm.poll(1001.0)
    assert [(r["step"], r["loss"]) for r in rows] == [(3, 1.25)]


def test_metrics_file_stays_bounded_and_keeps_the_newest(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"t": i, "kind": "sys", "pad": "x" * 80}) + "\n" for i in range(1000)))
    size = path.stat().st_size
    assert m.downsample(str(path), size // 2)
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert path.stat().st_size < size * 0.7
    assert rows[0]["t"] == 0 and rows[-1]["t"] == 999 and [r["t"] for r in rows[-250:]] == list(range(750, 1000))
    assert not m.downsample(str(path), 10 << 20)  # under the bound: left alone


def test_sampler_tick_without_nvidia_smi_records_host_only(tmp_path: Path) -> None:
    (tmp_path / "log").write_text("step 5 loss 0.5\n")
    s = m.Sampler(str(tmp_path), {"every": 10}, os.getpgrp(), str(tmp_path), path=str(tmp_path / "nobin"))
    s.start()
    s.stop()
    rows = [json.loads(ln) for ln in (tmp_path / m.METRICS).read_text().splitlines()]
    sys_rows = [r for r in rows if r["kind"] == "sys"]
    assert sys_rows and sys_rows[-1]["gpus"] == [] and "xid" not in sys_rows[-1]
    host = sys_rows[-1]["host"]
    assert host["mem_total"] > 0 and host["disk_total"] > 0 and host["rss"] > 0
    assert [r for r in rows if r["kind"] == "train"] == [{"t": rows[0]["t"], "kind": "train", "step": 5, "loss": 0.5}]
    last_sys, last_train = m.last_rows(str(tmp_path / m.METRICS))
    assert last_sys == sys_rows[-1] and last_train is not None and last_train["loss"] == 0.5


def test_idle_watch_fires_once_per_spell() -> None:
    fired: list[dict[str, Any]] = []
    w = notify.IdleWatch(5, 1, "stop", fired.append)
    for t, util in ((0, 0), (30, 1), (61, 2), (90, 0)):
        w.feed({"t": t, "gpus": [{"util": util}, {"util": 0}]})
    assert len(fired) == 1 and fired[0]["action"] == "stop"
    w.feed({"t": 100, "gpus": [{"util": 80}]})
    for t in (110, 200):
        w.feed({"t": t, "gpus": [{"util": 0}]})
    assert len(fired) == 2
    w.feed({"t": 300, "gpus": []})  # no GPU figures: never idle by this rule
    assert len(fired) == 2


class _Hook(BaseHTTPRequestHandler):
    got: list[dict[str, Any]] = []
    fail_first = 0

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if _Hook.fail_first > 0:
            _Hook.fail_first -= 1
            self.send_response(503)
            self.end_headers()
            return
        _Hook.got.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a: Any) -> None:
        pass


def test_post_retries_and_never_names_the_url(tmp_path: Path) -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        _Hook.got, _Hook.fail_first = [], 2
        url = f"http://127.0.0.1:{srv.server_address[1]}/hook/SECRET-TOKEN"
        ok, attempts, status = notify.post(url, {"text": "hi"}, sleep=lambda s: None)
        assert (ok, attempts, status) == (True, 3, 200) and _Hook.got == [{"text": "hi"}]
        n = notify.Notifier(str(tmp_path), {"webhook": url, "on": ["failed"]}, {"id": "r1", "host": "n1"})
        n.send("succeeded", {"exit_code": 0})  # not asked for
        n.send("failed", {"exit_code": 3})
        n.wait(30)
        assert _Hook.got[-1]["text"].startswith("dfo: run r1 on n1 failed (exit code 3)")
        assert _Hook.got[-1]["dfo"]["event"] == "failed" and len(_Hook.got) == 2
        record = (tmp_path / notify.NOTIFY_LOG).read_text()
        assert '"delivered": true' in record and "SECRET" not in record and "127.0.0.1" not in record
    finally:
        srv.shutdown()
    ok, attempts, status = notify.post(url, {"text": "x"}, attempts=2, timeout=2, sleep=lambda s: None)
    assert not ok and attempts == 2 and "SECRET" not in str(status)


def test_series_rate_eta_and_summary() -> None:
    rows = [{"t": 100 + i, "kind": "train", "step": 10 * i, "total": 1000, "loss": 5 - i, "tok_s": 50.0}
            for i in range(5)]
    rows += [{"t": 100 + i, "kind": "sys", "gpus": [{"util": 50}, {"util": 100}], "host": {"cpu_pct": 10}}
             for i in range(3)]
    assert sm.series(rows, "loss") == ([0, 10, 20, 30, 40], [5, 4, 3, 2, 1])
    assert sm.series(rows, "gpu_util") == ([0.0, 1.0, 2.0], [75.0, 75.0, 75.0])
    assert sm.step_rate(rows) == 10.0 and sm.eta_seconds(rows) == 96.0
    info = RunInfo(id="r", state="succeeded", started_ts=0.0, ended_ts=7200.0)
    s = sm.summary(info, rows, 2.5)
    assert s["cost"] == 5.0 and s["gpu_hours"] == 4.0 and s["mean_gpu_util"] == 75.0 and s["mean_tok_s"] == 50.0


def test_lost_message_names_the_lost_node_and_run_files_go_beside_dest() -> None:
    from remote.runs.runship import key_prefix

    doc = notify.message("lost", {"id": "r1", "host": "node-1"}, {"lost_host": "node-2", "silent_s": 20.4})
    assert doc["text"] == "dfo: run r1: node node-2 lost (silent 20.4s; seen from node-1)"
    doc = notify.message("restarted", {"id": "r1", "host": "node-3"},
                         {"generation": 2, "why": "lost", "lost_host": "node-1", "resumed_step": 40})
    assert doc["text"].startswith("dfo: run r1 on node-3 restarted (generation 2, after lost on node-1)")
    assert doc["dfo"]["resumed_step"] == 40
    assert key_prefix("s3://b/ckpt/r1/", "r1") == ("b", "ckpt/r1.dfo-runs/r1/")
    assert key_prefix("s3://b", "r1") == ("b", ".dfo-runs/r1/")


def test_job_fields_log_metrics_and_webhook(tmp_path: Path, monkeypatch: Any) -> None:
    import pytest

    from orchestrator.config.models import load_job
    from orchestrator.errors import ConfigError
    from orchestrator.steps.metrics_spec import launch_fields

    job = tmp_path / "j.yaml"
    job.write_text("name: j\nrun:\n  command: python3 t.py\n  log_metrics: {acc: 'acc ([0-9.]+) (x)'}\n")
    with pytest.raises(ConfigError) as err:
        load_job(job)
    assert "run.log_metrics" in str(err.value.render()) and "2 groups" in str(err.value.render())
    job.write_text("name: j\nrun:\n  command: python3 t.py\n  idle_minutes: 30\n  idle_action: stop\n"
                   "notify: {webhook: $DFO_T_HOOK, on: [failed]}\n")
    monkeypatch.delenv("DFO_T_HOOK", raising=False)
    with pytest.raises(ConfigError) as err:
        launch_fields(load_job(job))
    assert "DFO_T_HOOK is not set" in err.value.render()
    monkeypatch.setenv("DFO_T_HOOK", "https://hooks.example/T/B/x")
    got = launch_fields(load_job(job))
    assert got["notify"] == {"webhook": "https://hooks.example/T/B/x", "on": ["failed"]}
    assert got["metrics"]["every"] == 10 and got["metrics"]["idle_minutes"] == 30
    assert got["metrics"]["idle_action"] == "stop"
