"""Recovery (issue 20), the pure parts: the job's run.spares/run.restarts and the watcher's decision."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.config.models import RestartsConfig, load_job
from orchestrator.errors import ConfigError
from orchestrator.steps.recovery import Verdict, Watcher, backoff_s, classify, torchrun_root_cause
from orchestrator.steps.runs import RunInfo

OUT = {"dest": "s3://b/runs/{name}/"}


def _job(tmp_path: Path, run: dict[str, object], outputs: dict[str, object] | None = OUT) -> Path:
    doc: dict[str, object] = {"name": "j", "run": {"command": "true", **run}}
    if outputs is not None:
        doc["outputs"] = outputs
    p = tmp_path / "j.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_the_contract_names_load(tmp_path: Path) -> None:
    run = load_job(_job(tmp_path, {"spares": ["gpu-5", "gpu-6"],
                                   "restarts": {"max": 2, "on": ["lost", "signal", 134], "backoff": 5}})).job.run
    assert run is not None and run.recovers
    assert run.spares == ["gpu-5", "gpu-6"]
    assert run.restart_policy.max == 2 and run.restart_policy.on == ["lost", "signal", 134]
    assert run.restart_policy.backoff == 5 and run.restart_policy.lost_after == 60
    one = load_job(_job(tmp_path, {"spares": "pool"})).job.run
    assert one is not None and one.spares == ["pool"] and one.restart_policy.max == 3
    plain = load_job(_job(tmp_path, {})).job.run
    assert plain is not None and not plain.recovers


@pytest.mark.parametrize(("run", "outputs", "words"), [
    ({"spares": ["a"]}, None, "need outputs.dest"),
    ({"restarts": {"max": 1}}, {"path": "/w/c"}, "need outputs.dest"),
    ({"restarts": {"on": ["lost", "oom"]}}, OUT, "restarts.on"),
    ({"restarts": {"on": [0]}}, OUT, "exit code 0"),
    ({"restarts": {"max": -1}}, OUT, "restarts.max"),
    ({"restarts": {"backoff": -3}}, OUT, "restarts.backoff"),
    ({"restarts": {"tries": 3}}, OUT, "tries"),
    ({"spares": ["a", "a"]}, OUT, "named twice"),
    ({"spares": ["bad name"]}, OUT, "spare"),
    ({"spares": ["a"]}, {"dest": "s3://b/runs/{run_id}/"}, "take {run_id} out"),
])
def test_bad_recovery_fields_are_clear_errors(tmp_path: Path, run: dict[str, object],
                                              outputs: dict[str, object] | None, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_job(_job(tmp_path, run, outputs))
    assert words in e.value.render(), e.value.render()
    assert e.value.exit_code == 2


def _r(state: str, **kw: object) -> RunInfo:
    return RunInfo(id="r", state=state, **kw)  # type: ignore[arg-type]


POLICY = RestartsConfig()


def test_all_running_is_ok_and_all_succeeded_is_done() -> None:
    assert classify(["a", "b"], {"a": _r("running"), "b": _r("running")}, {}, POLICY).kind == "ok"
    assert classify(["a", "b"], {"a": _r("succeeded"), "b": _r("succeeded")}, {}, POLICY).kind == "done"


def test_a_transient_ssh_error_is_never_a_restart() -> None:
    v = classify(["a", "b"], {"a": _r("running"), "b": None}, {"b": 59.0}, POLICY)
    assert v.kind == "ok"
    v = classify(["a", "b"], {"a": _r("running"), "b": None}, {"b": 60.0}, POLICY)
    assert (v.kind, v.why, v.lost_host) == ("restart", "lost", "b")
    short = RestartsConfig(lost_after=5)
    assert classify(["a"], {"a": None}, {"a": 6.0}, short).lost_host == "a"


def test_the_gang_watch_verdict_makes_a_node_lost_at_once() -> None:
    gang = {"rank": 0, "watch": {"first_failure": {"host": "b", "how": "lost"}}}
    v = classify(["a", "b"], {"a": _r("stopped", gang=gang), "b": None}, {"b": 1.0}, POLICY)
    assert (v.kind, v.lost_host) == ("restart", "b")


def test_signal_deaths_restart_and_exit_1_does_not() -> None:
    assert classify(["a"], {"a": _r("failed", signal="SIGKILL")}, {}, POLICY).why == "signal"
    assert classify(["a"], {"a": _r("failed", exit_code=137)}, {}, POLICY).why == "signal"  # bash: 128 + 9
    v = classify(["a"], {"a": _r("failed", exit_code=1)}, {}, POLICY)
    assert (v.kind, v.why) == ("fail", "exit 1") and "not restarted" in v.detail
    listed = RestartsConfig(on=["lost", 3])
    assert classify(["a"], {"a": _r("failed", exit_code=3)}, {}, listed).kind == "restart"
    assert classify(["a"], {"a": _r("failed", signal="SIGKILL")}, {}, listed).kind == "fail"
    gang = {"rank": 0, "watch": {"first_failure": {"host": "b", "how": "exit 1"}}}
    v = classify(["a", "b"], {"a": _r("stopped", gang=gang), "b": _r("failed", exit_code=1)}, {}, POLICY)
    assert (v.kind, v.why) == ("fail", "exit 1")


def test_a_run_stopped_by_hand_is_not_restarted() -> None:
    assert classify(["a"], {"a": _r("stopped", end={"stopped": True})}, {}, POLICY).kind == "stopped"


def test_backoff_doubles() -> None:
    p = RestartsConfig(backoff=30)
    assert [backoff_s(p, n) for n in range(3)] == [30, 60, 120]


# torchrun's report when one of its workers was SIGKILLed (torch 2.13, CPU, 2 workers; the other was ended
# by torchrun itself): torchrun exits 1, the root cause names the signal
TORCHRUN_REPORT = """\
rank 0: step 20 loss 5.4101 (all-reduced over 2 ranks) tok/s 8101 elapsed 1.6s
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
==========================================================
train.py FAILED
----------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_07:26:11
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 29418)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 29418
----------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_07:26:11
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 29417)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 29417
==========================================================
[dfo outputs] pass 9: shipped 0 files (0 B) to s3://b/runs/j/ in 0.0 s
"""


def test_torchrun_root_cause_is_the_signal_that_killed_a_worker() -> None:
    lines = TORCHRUN_REPORT.splitlines()
    assert torchrun_root_cause(lines) == -9  # the root cause, not the SIGTERM listed first
    assert torchrun_root_cause([ln.replace("-9 (pid", "1 (pid") for ln in lines]) == 1  # a worker's own exit 1
    assert torchrun_root_cause(lines[:1]) is None  # no report: nothing to say
    assert torchrun_root_cause(lines[:15]) is None  # a report cut before its root cause


@pytest.mark.parametrize(("codes", "want"), [
    ({"a": -6, "b": -9}, "b: trainer killed by SIGKILL"),  # a's worker aborted when b's was killed: b's
    ({"a": -9, "b": -6}, "a: trainer killed by SIGKILL"),
    ({"a": -15, "b": -6}, "b: trainer killed by SIGABRT"),  # the gang watch's SIGTERM is an echo too
    ({"a": -6, "b": -11}, "b: trainer killed by SIGSEGV"),
    ({"a": -6, "b": -6}, "a: trainer killed by SIGABRT"),  # among equals: the first failure's node
    ({"a": 1, "b": -6}, "b: trainer killed by SIGABRT"),
])
def test_a_torchrun_gangs_signal_is_the_killed_worker_not_its_peers_abort(codes: dict[str, int], want: str) -> None:
    """Each node runs one worker: b's is killed, a's aborts when its collective breaks, and either torchrun
    may exit first. The verdict names the kill, whichever node the watcher looks at first."""
    w = Watcher.__new__(Watcher)
    w.policy = RestartsConfig(on=["signal"])
    asked: list[str] = []

    def root_cause(host: str, run_id: str) -> int | None:
        asked.append(host)
        return codes[host]

    w._torchrun_root_cause = root_cause  # type: ignore[method-assign]
    results = {"a": _r("failed", exit_code=1), "b": _r("failed", exit_code=1)}
    v = w._torchrun_worker_signal(["a", "b"], "r", results, Verdict("fail", "exit 1"))
    assert (v.kind, v.why, v.detail) == ("restart", "signal", f"{want} (a worker of torchrun, which exited 1)")
    if codes["a"] == -9:
        assert asked == ["a"]  # a SIGKILL ends the search


def test_a_torchrun_gangs_signal_fails_the_run_when_restarts_on_leaves_signal_out() -> None:
    w = Watcher.__new__(Watcher)
    w.policy = RestartsConfig(on=["lost"])
    w._torchrun_root_cause = lambda host, run_id: {"a": -6, "b": -9}[host]  # type: ignore[method-assign]
    results = {"a": _r("failed", exit_code=1), "b": _r("failed", exit_code=1)}
    v = w._torchrun_worker_signal(["a", "b"], "r", results, Verdict("fail", "exit 1"))
    assert (v.kind, v.why) == ("fail", "signal")
    assert v.detail == ("b: trainer killed by SIGKILL (a worker of torchrun, which exited 1); "
                        "restarts.on has no 'signal'")
