"""Issue 32, items 2 and 3: no figure can blind the views, and --from-s3 reads S3 with a bound.

* A diverged trainer (``loss nan``, ``loss inf``, a JSON line with ``NaN``/``-Infinity``) on a real testbed
  node: ``top``, ``status``, ``plot`` and ``report`` show ``nan``/``inf`` as what they are (a marked
  point in the plot), print ``null`` in JSON, and never fail.
* A node whose metrics.jsonl holds a sample with ``"mem_total": "x"`` (and rows with a bad ``t``,
  lines that are not JSON): its figures are read through one place (orchestrator/steps/noderows.py)
  that keeps finite numbers only; one host's bad rows never hide another host.
* Every dfo command with ``--json`` (enumerated from the CLI's own table, so a new one cannot escape)
  prints a document a strict parser (no NaN, no Infinity) accepts.
* ``--from-s3`` reads at most a bound (said when hit; DFO_FROM_S3_MAX_MIB), parses as a stream, and
  thins the rows as the node's own metrics op does.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.testbed import Testbed
from tests import _cli
from tests._runs_fixtures import inventory_copy

A, B, C = "node-1", "node-1b", "node-1c"  # one testbed node, three hosts of the inventory (their own workspaces)
WS = {A: "/workspace", B: "/root/ws-b", C: "/root/ws-c"}

# What a diverged PyTorch trainer prints: f"loss {loss.item()}" gives "loss nan" / "loss inf", and
# json.dumps of a non-finite loss gives the bare NaN / -Infinity tokens.
DIVERGED = """\
import time
print("step 1/100 loss 2.5 lr 3e-4 tok/s 1000", flush=True)
time.sleep(0.4)
print("step 2/100 loss inf tok/s 1000", flush=True)
time.sleep(0.4)
print('{"step": 3, "loss": -Infinity, "tok_s": Infinity, "grad_norm": NaN}', flush=True)
time.sleep(0.4)
print("step 4/100 loss nan lr 3e-4 tok/s 990", flush=True)
time.sleep(1.2)
"""

# A sample row from a hostile node (or a trainer that writes the run's metrics.jsonl): a string where a
# number goes, a bool, NaN and Infinity among the figures, an entry of gpus that is no object, xid not a list.
BAD_SAMPLE = ('{"t": %(t)s, "kind": "sys", "gpus": [{"i": 0, "name": "NVIDIA H200", "util": 50, "mem_used": 1024, '
              '"mem_total": "x", "power": Infinity}, "bogus", {"i": true, "util": "x"}], '
              '"host": {"mem_used": 2048, "mem_total": "x", "cpu_pct": true, "load1": NaN, "rss": 512}, '
              '"xid": "lots"}')
# Rows no view can place: a t that is not a number, a t that is not finite, not JSON, not an object.
BAD_ROWS = ['{"t": "x", "kind": "sys", "gpus": [], "host": {}}', '{"t": 1e999, "kind": "train", "step": 9, "loss": 1}',
            "not json at all", "[1, 2]", '{"kind": "train", "step": 5, "loss": 0.1}']


def strict(text: str) -> Any:
    """json.loads that refuses NaN, Infinity and -Infinity, as every JSON parser but Python's does."""
    def refuse(name: str) -> Any:
        raise ValueError(f"not JSON: a bare {name}")
    return json.loads(text, parse_constant=refuse)


@dataclass
class Diverged:
    tb: Testbed
    inv: Path
    tmp: Path
    job: Path
    runs: dict[str, str]  # host -> its run of the diverged trainer

    def dfo(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return _cli.dfo(self.inv, *args, timeout=timeout)

    def sh(self, cmd: str) -> str:
        r = self.tb.node_exec(self.tb.nodes[0], cmd)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def run_dir(self, host: str) -> str:
        return f"{WS[host]}/.dfo/runs/{self.runs[host]}"


def _inventory(tb: Testbed, tmp: Path) -> Path:
    inv = inventory_copy(tb, tmp)
    doc = yaml.safe_load(inv.read_text())
    doc["defaults"]["price_per_hour"] = 3.6
    for alias in (B, C):  # the same node as another host, with its own workspace: its own runs
        doc["hosts"][alias] = dict(doc["hosts"][A], workspace=WS[alias])
    inv.write_text(yaml.safe_dump(doc))
    return inv


def _job(tmp: Path, name: str, command: str) -> Path:
    (tmp / "diverged.py").write_text(DIVERGED)
    doc = {"name": name, "venv": "/usr", "run": {"workdir": "/root/views-test", "upload": ["diverged.py"],
                                                 "command": command, "wait": 0, "metrics_every": 1}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _ended(d: Diverged, hosts: list[str], timeout: float = 60) -> None:
    """Every run of ``hosts`` ended and its supervisor gone (so the sampler's last row is written)."""
    check = ("import json, os, sys\n"
             f"for d in {[d.run_dir(h) for h in hosts]!r}:\n"
             "    if not os.path.exists(d + '/end.json'): sys.exit(1)\n"
             "    pid = json.load(open(d + '/meta.json'))['supervisor_pid']\n"
             "    try: st = open('/proc/%d/stat' % pid).read()\n"
             "    except OSError: continue\n"
             "    if st.rsplit(')', 1)[1].split()[0] not in ('Z', 'X'): sys.exit(1)\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.tb.node_exec(d.tb.nodes[0], f"python3 -c {shlex.quote(check)}").returncode == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"the runs {[d.runs[h] for h in hosts]} did not end in {timeout} s")


@pytest.fixture(scope="module")
def diverged(testbed: Testbed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Diverged]:
    """The diverged trainer run on hosts A and B (one node); then A's metrics.jsonl gets BAD_SAMPLE as its
    last sample and B's gets BAD_ROWS."""
    tmp = tmp_path_factory.mktemp("views")
    inv = _inventory(testbed, tmp)
    job = _job(tmp, f"dv-{int(time.time() * 1000) % 10**8}", "python3 diverged.py")
    r = _cli.dfo(inv, "launch", "-H", f"{A},{B}", "-j", str(job), "--json")
    assert r.returncode == 0, r.stderr
    runs = {h: doc["run"] for h, doc in json.loads(r.stdout)["hosts"].items()}
    d = Diverged(testbed, inv, tmp, job, runs)
    _ended(d, [A, B])
    q = shlex.quote
    d.sh(f"printf '%s\\n' {q(BAD_SAMPLE % {'t': time.time()})} >> {d.run_dir(A)}/metrics.jsonl")
    d.sh(f"printf '%s\\n' {' '.join(q(x) for x in BAD_ROWS)} >> {d.run_dir(B)}/metrics.jsonl")
    yield d


# --------------------------------------------------------------------------- item 2: the one reading place


def test_node_rows_keep_finite_numbers_drop_malformed_entries_and_never_raise() -> None:
    from orchestrator.steps import noderows as nr

    nan, inf = math.nan, math.inf
    sample = {"t": 5.0, "kind": "sys", "xid": [{"bus": "0:6", "xid": 79, "line": "x" * 999}, {"xid": "79"}, 3],
              "gpus": [{"i": 0, "util": 50, "mem_total": "x", "power": inf, "temp": nan, "ecc_uncorr": True,
                        "name": "NVIDIA H200", "throttle": 4, "sm_clock": 10**400}, "bogus", {"util": 1}, {"i": True}],
              "host": {"mem_used": 2048, "mem_total": "x", "cpu_pct": True, "load1": nan, 3: 4, "rss": -1.5}}
    got = nr.row(sample)
    assert got == {"t": 5.0, "kind": "sys", "xid": [{"bus": "0:6", "xid": 79, "line": "x" * nr.MAX_TEXT}],
                   "gpus": [{"i": 0, "util": 50, "name": "NVIDIA H200"}], "host": {"mem_used": 2048, "rss": -1.5}}
    assert nr.row(dict(sample, xid="lots", gpus={"i": 0}, host=[1])) == {  # a list of GPUs, a host object
        "t": 5.0, "kind": "sys", "xid": None, "gpus": [], "host": {}}
    # training figures: nan and inf as the trainer logged them; step and total finite or left out
    train = {"t": 6, "kind": "train", "step": 4, "total": inf, "loss": nan, "tok_s": inf, "lr": -inf, "ok": True,
             "name": "x", "acc": 0.5, "n": 10**400}
    got = nr.row(train)
    assert got is not None and set(got) == {"t", "kind", "step", "loss", "tok_s", "lr", "acc"}
    assert math.isnan(got["loss"]) and got["tok_s"] == inf and got["lr"] == -inf and got["acc"] == 0.5
    assert nr.row({"t": 6, "kind": "train", "step": nan, "loss": 1}) == {"t": 6, "kind": "train", "step": None,
                                                                         "loss": 1}
    for bad in (None, [], "x", 3, {}, {"t": 1}, {"t": "1", "kind": "sys"}, {"t": nan, "kind": "sys"},
                {"t": inf, "kind": "train"}, {"t": True, "kind": "sys"}, {"t": 1, "kind": "other"},
                {"t": 1, "kind": 1}):
        assert nr.row(bad) is None, bad
    assert nr.rows("x") == [] and nr.rows([sample, "x", None, train]) == [nr.row(sample), nr.row(train)]
    assert nr.last({"sys": train, "train": sample}) is None  # each where it belongs, or nothing
    assert nr.last({"sys": sample, "train": "x"}) == {"sys": nr.row(sample), "train": None}
    assert nr.last([1]) is None and nr.last(None) is None
    # a metrics.jsonl as a stream: NaN tokens read, filler and junk dropped, thinned as the node thins
    from remote.runs.metrics import thin

    good = [{"t": 1 + i, "kind": "train", "step": i, "loss": 1.0 / (i + 1)} for i in range(500)]
    lines = [b"{}", b"not json", b'{"kind": "sys", "t": "x"}', b"[1]", b'{"t": 3, "kind": "train", "loss": NaN}']
    text = b"\n".join(lines + [json.dumps(x).encode() for x in good]) + b"\n"
    chunks = [text[i:i + 7] for i in range(0, len(text), 7)]
    got = nr.read_chunks(chunks, max_rows=50)
    want = thin([3, *(x["t"] for x in good)], 50)  # the NaN row is a row: it counts, as on the node
    assert [r["t"] for r in got] == want and got[-1] == good[-1] and math.isnan(got[0]["loss"])
    assert nr.read_chunks(chunks, max_rows=50, since=400)[0]["t"] > 400
    assert list(nr.split_lines([b"cut line\nwhole\nlast"], skip_first=True)) == [b"whole", b"last"]
    assert list(nr.split_lines([b"a" * 10, b"a\nb\n"], max_line=5)) == [b"b"]  # the long line dropped whole


def test_the_views_never_fail_on_any_row() -> None:
    """Whatever a node sends, cleaned or not, the figures and texts of top, status, plot and report are made."""
    import random

    from orchestrator.commands.plot import terminal_plot
    from orchestrator.steps import metrics as sm
    from orchestrator.steps import noderows as nr
    from orchestrator.steps.runs import RunInfo

    junk: list[Any] = [None, True, "x", "", 3, -1, 1e308, math.nan, math.inf, -math.inf, 10**400, [], {}, [1], {"a": 1}]
    rnd = random.Random(32)

    def any_value(depth: int = 0) -> Any:
        if depth < 2 and rnd.random() < 0.3:
            return {k: any_value(depth + 1) for k in rnd.sample(["i", "util", "mem_used", "mem_total", "power", "t",
                                                                   "kind", "loss", "step", "total", "xid"], 4)}
        if depth < 2 and rnd.random() < 0.2:
            return [any_value(depth + 1) for _ in range(3)]
        return rnd.choice(junk)

    info = RunInfo(id="r", state="running", started_ts=math.nan, ended_ts=math.inf)  # type: ignore[arg-type]
    assert info.started_ts is None and info.ended_ts is None
    for _ in range(300):
        raw = [{"t": rnd.choice([1.0, 2.0, *junk]), "kind": rnd.choice(["sys", "train", *junk]),
                "gpus": any_value(), "host": any_value(), "xid": any_value(), "step": any_value(),
                "total": any_value(), "loss": any_value(), "tok_s": any_value()} for _ in range(4)]
        for rows in (nr.rows(raw), raw):
            for m in ("loss", "tok_s", "gpu_util", "gpu_mem", "cpu_pct", "mem_used"):
                xs, ys = sm.series(rows, m)
                terminal_plot(xs, ys)
            sm.summary(info, rows, 1.0)
            sm.view(info, rows, 1.0)
            for r in rows:
                sm.train_text(r)
                sm.sample_line({"sys": r, "train": r})
                for g in r.get("gpus") if isinstance(r.get("gpus"), list) else []:
                    sm.gpu_text(g if isinstance(g, dict) else {})
                sm.host_text(r.get("host") if isinstance(r.get("host"), dict) else {})
        info2 = RunInfo.model_validate({"id": "r", "state": "running", "metrics": {"sys": raw[0], "train": raw[1]}})
        assert info2.metrics is None or set(info2.metrics) == {"sys", "train"}


def test_json_output_is_strict_whatever_the_figures() -> None:
    from pydantic import BaseModel

    from orchestrator.cli_common import finite_json, json_text

    class Doc(BaseModel):
        loss: float
        more: dict[str, Any]

    doc = {"a": math.nan, "b": [math.inf, -math.inf, 1.5, (math.nan, 2)], "c": Doc(loss=math.nan, more={
        "x": math.inf}).model_dump(), math.nan: 1, 2: "two", "p": Path("/x")}
    text = json_text(doc)
    assert strict(text) == {"a": None, "b": [None, None, 1.5, [None, 2]], "c": {"loss": None, "more": {"x": None}},
                            "nan": 1, "2": "two", "p": "/x"}
    assert doc["a"] is not None and finite_json(1e308) == 1e308 and finite_json(True) is True  # a copy; finite kept


def test_the_terminal_plot_marks_points_that_are_not_finite() -> None:
    from orchestrator.commands.plot import nonfinite, terminal_plot

    xs, ys = [1.0, 2.0, 3.0, 4.0, 5.0], [2.0, math.inf, -math.inf, math.nan, 1.0]
    out = terminal_plot(xs, ys, width=5, height=3, xlabel="step")
    assert out[0] == "2 |*^ ! " and out[2] == "1 |  v *", out
    assert out[-3:] == ["  ! nan at step 4", "  ^ inf at step 2", "  v -inf at step 3"]
    assert nonfinite(xs, ys) == [{"x": 2.0, "value": "inf"}, {"x": 3.0, "value": "-inf"}, {"x": 4.0, "value": "nan"}]
    assert terminal_plot([1.0], [math.nan])[-2:] == ["  ! nan at x 1", "  (no finite values)"]


def test_the_sampler_reads_nan_and_inf_as_a_diverged_trainer_prints_them() -> None:
    from remote.runs import metrics as m

    pats = m.compile_patterns({})
    got = m.parse_line("step 2/100 loss nan lr 3e-4 tok/s inf", pats)
    assert math.isnan(got.pop("loss")) and got == {"step": 2, "total": 100, "lr": 3e-4, "tok_s": math.inf}
    assert m.parse_line("loss: -Infinity", pats) == {"loss": -math.inf}
    assert m.parse_line("loss nancy 3", pats) == {} and m.parse_line("train_loss infinite", pats) == {}


def test_one_host_that_cannot_be_shown_hides_no_other(capsys: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli_common import emit
    from orchestrator.hosts import Outcome

    def render(host: str, value: Any) -> None:
        print(f"{host}: {1 / value}")

    code = emit([Outcome("bad", value=0), Outcome("good", value=4)], False, lambda v: {"v": 1 / v}, render)
    out, err = capsys.readouterr()
    assert code == 1 and "good: 0.25" in out and "bad" in err and "ZeroDivisionError" in err, (out, err)
    code = emit([Outcome("bad", value=0), Outcome("good", value=4)], True, lambda v: {"v": 1 / v}, render)
    doc = strict(capsys.readouterr().out)["hosts"]
    assert doc["good"] == {"v": 0.25} and doc["bad"]["ok"] is False and "ZeroDivisionError" in doc["bad"]["error"][
        "message"]


def test_the_from_s3_bound_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.errors import UsageError
    from orchestrator.steps import metrics as sm

    monkeypatch.delenv(sm.BOUND_ENV, raising=False)
    assert sm.from_s3_bound("metrics.jsonl") == 16 << 20 and sm.from_s3_bound("log") == 64 << 20
    monkeypatch.setenv(sm.BOUND_ENV, "0.5")
    assert sm.from_s3_bound("metrics.jsonl") == 1 << 19
    for bad in ("x", "0", "-1", "nan", "inf"):
        monkeypatch.setenv(sm.BOUND_ENV, bad)
        with pytest.raises(UsageError) as err:
            sm.from_s3_bound("log")
        assert sm.BOUND_ENV in err.value.render()


# --------------------------------------------------------------------------- item 2, on the testbed


def test_a_diverged_trainer_and_a_bad_sample_never_break_top_status_plot_report(diverged: Diverged) -> None:
    d = diverged
    ra, rb = d.runs[A], d.runs[B]
    # top --once --json: strict JSON, both hosts, nan as null, the bad figures dropped
    r = d.dfo("top", "-H", f"{A},{B}", "--once", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    top = strict(r.stdout)["hosts"]
    assert top[A]["run"] == ra and top[B]["run"] == rb
    for h in (A, B):
        assert top[h]["train"]["step"] == 4 and top[h]["train"]["loss"] is None, top[h]
        assert top[h]["train"]["tok_s"] == 990 and top[h]["train"]["total"] == 100
    assert top[A]["host"] == {"mem_used": 2048, "rss": 512}  # "x", true and NaN left out
    assert top[A]["gpus"] == [{"i": 0, "name": "NVIDIA H200", "util": 50, "mem_used": 1024}]
    assert top[A]["xid"] == 0 and top[B]["gpus"] == []
    # top's table: every host shown, the loss as what it is
    r = d.dfo("top", "-H", f"{A},{B}", "--once")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ra in r.stdout and rb in r.stdout and r.stdout.count("loss nan") == 2, r.stdout
    assert "ram 2.0/-G" in r.stdout and "error" not in r.stdout, r.stdout
    # status: the detail view of A's run, and --json of both hosts
    r = d.dfo("status", "-H", A, ra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 GPU util 50%" in r.stdout and "ram 2.0/-G" in r.stdout and "step 4/100 loss nan" in r.stdout, r.stdout
    r = d.dfo("status", "-H", f"{A},{B}", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    st = strict(r.stdout)["hosts"]
    run_a = next(x for x in st[A]["runs"] if x["id"] == ra)
    assert run_a["metrics"]["sys"]["host"] == {"mem_used": 2048, "rss": 512}
    assert run_a["metrics"]["train"]["loss"] is None and run_a["metrics"]["train"]["step"] == 4
    assert any(x["id"] == rb for x in st[B]["runs"])
    # plot: the non-finite losses are marked points, null in JSON; the PNG is written
    png = d.tmp / "diverged.png"
    r = d.dfo("plot", "-H", A, ra, "loss", "tok_s", "-o", str(png), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    series = {s["metric"]: s for s in strict(r.stdout)["series"]}
    assert series["loss"]["x"] == [1, 2, 3, 4] and series["loss"]["y"] == [2.5, None, None, None]
    assert series["loss"]["nonfinite"] == [{"x": 2, "value": "inf"}, {"x": 3, "value": "-inf"},
                                           {"x": 4, "value": "nan"}]
    assert series["tok_s"]["y"] == [1000, 1000, None, 990]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = d.dfo("plot", "-H", A, ra, "loss")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2.5 |*" in r.stdout and "^ inf at step 2" in r.stdout, r.stdout
    assert "v -inf at step 3" in r.stdout and "! nan at step 4" in r.stdout, r.stdout
    # report: last loss nan (null in JSON), means over the finite figures only
    r = d.dfo("report", "-H", f"{A},{B}", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = strict(r.stdout)["hosts"]
    for h in (A, B):
        assert rep[h]["last_step"] == 4 and rep[h]["last_loss"] is None and rep[h]["mean_tok_s"] == 996.7, rep[h]
    r = d.dfo("report", "-H", A, ra)
    assert r.returncode == 0 and "last loss  nan" in r.stdout, r.stdout + r.stderr


# --------------------------------------------------------------------------- every --json, strict


def _json_commands() -> set[str]:
    from orchestrator.cli import COMMANDS, load_command

    return {name for name in COMMANDS
            if any("--json" in getattr(p, "opts", ()) for p in load_command(name).params)}


def test_every_command_with_json_prints_strict_json(diverged: Diverged, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each dfo command that has --json, run on the testbed (against the diverged runs where it reads
    runs), prints one document that a strict parser accepts. The commands come from the CLI's own table:
    a new command with --json and no line here fails this test."""
    d = diverged
    monkeypatch.setenv("XDG_STATE_HOME", str(d.tmp / "state"))  # dfo submit's record of what it sent
    ra = d.runs[A]
    job = str(d.job)
    cases: dict[str, list[str]] = {
        "verify-env": ["-H", A, "--json"],
        "provision": ["-H", C, "-j", job, "--json"],
        "stage-model": ["-H", C, "-j", job, "--json"],  # no model: in the job: the error document
        "sync-data": ["-H", C, "-j", job, "--json"],  # no data: either
        "sync-code": ["-H", C, "-j", job, "--json"],
        "pull": ["-H", A, ra, "metrics.jsonl", "--to", str(d.tmp / "pulled"), "--json"],
        "outputs": ["-H", A, ra, "--json"],
        "status": ["-H", f"{A},{B}", "--json"],
        "top": ["-H", f"{A},{B}", "--once", "--json"],
        "plot": ["-H", A, ra, "--json"],
        "report": ["-H", f"{A},{B}", "--json"],
        "exec": ["-H", f"{A},{B}", "--json", "--", "python3", "-c", "print(float('nan'))"],
        "launch": ["-H", C, "-j", job, "--json"],
        "stop": ["-H", C, "RUN", "--json"],  # RUN: the one launch started
        "up": ["-H", C, "-j", job, "--no-tail", "--json"],  # /usr is no venv: up stops at provision (exit 3)
        "submit": ["-H", C, "-j", job, "--json"],  # the queue (docs/queue.md)
        "queue": ["-H", f"{A},{C}", "--json"],
        "cancel": ["-H", C, "RUN", "--json"],  # RUN: the one submit queued (stopped, or it had ended)
        "login": ["--check", "-H", f"{A},{C}", "--json"],  # which hosts have a shared connection (exit 4: none)
    }
    assert _json_commands() == set(cases), "a dfo command with --json has no line in this test: add it"
    started: list[str] = []
    for name, args in cases.items():
        args = [started[-1] if a == "RUN" else a for a in args]
        r = d.dfo(name, *args)
        try:
            doc = strict(r.stdout)
        except ValueError as exc:
            raise AssertionError(f"dfo {name} --json: {exc}: {r.stdout[-2000:]}\n{r.stderr[-2000:]}") from None
        assert isinstance(doc, dict) and doc, (name, r.stdout)
        assert "Traceback" not in r.stderr and "unexpected" not in r.stderr, (name, r.stderr)
        if name == "launch":
            assert r.returncode == 0, (name, r.stderr)
            started.append(doc["hosts"][C]["run"])
        if name == "submit":
            assert r.returncode == 0, (name, r.stderr)
            started.append(doc["hosts"][C]["runs"][0]["run"])
        if name in ("top", "plot", "report", "status"):  # the diverged runs' nan figures are there, as null
            assert r.returncode == 0 and "null" in r.stdout, (name, r.stdout)



# --------------------------------------------------------------------------- item 3: --from-s3, bounded


@dataclass
class FromS3:
    tb: Testbed
    inv: Path
    job: Path
    bucket: str
    prefix: str  # of the run's files: DEST.dfo-runs/RUN/
    run: str

    def env(self, **extra: str) -> dict[str, str]:
        assert self.tb.s3 is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update({"AWS_ACCESS_KEY_ID": self.tb.s3.access_key, "AWS_SECRET_ACCESS_KEY": self.tb.s3.secret_key,
                    "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", **extra})
        return _cli.cli_env(env)

    def put(self, name: str, data: bytes) -> None:
        assert self.tb.s3 is not None
        self.tb.s3.put_bytes(self.bucket, self.prefix + name, data)

    def dfo(self, *args: str, **extra: str) -> tuple[subprocess.CompletedProcess[str], int]:
        """The real CLI, and the peak resident memory of its process (KiB: its VmHWM, read every 20 ms while it
        runs). Not wait4's ru_maxrss: that counts the memory of the process it was forked from (the pytest
        worker, hundreds of MiB after a torch test) before its exec."""
        with open(self.inv.parent / "out.txt", "w+") as out, open(self.inv.parent / "err.txt", "w+") as err:
            p = subprocess.Popen(_cli.dfo_argv(self.inv, *args), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                 env=self.env(**extra), text=True)
            peak = 0
            try:
                deadline = time.monotonic() + 300
                while p.poll() is None and time.monotonic() < deadline:
                    try:
                        hwm = [ln for ln in Path(f"/proc/{p.pid}/status").read_text().splitlines()
                               if ln.startswith("VmHWM:")]
                        if hwm:  # (Popen returns once the exec is done: this is dfo's own memory)
                            peak = max(peak, int(hwm[0].split()[1]))
                    except (OSError, ValueError):
                        pass
                    time.sleep(0.02)
                p.wait(5)
            except BaseException:
                p.kill()
                raise
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read()), peak


@pytest.fixture
def from_s3(testbed: Testbed, tmp_path: Path) -> FromS3:
    import secrets

    from remote.runs.runship import key_prefix

    assert testbed.s3 is not None
    bucket = f"views-{secrets.token_hex(3)}"
    testbed.s3.create_bucket(bucket)
    run = f"gone-{secrets.token_hex(3)}"
    doc = {"name": "gone", "venv": "/usr", "run": {"command": "true"},
           "s3": {"endpoint_url": testbed.s3.url, "region": testbed.s3.region},
           "outputs": {"path": "/root/ckpt/{run_id}", "dest": f"s3://{bucket}/ckpt/{{run_id}}/"}}
    job = tmp_path / "gone.yaml"
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    _, prefix = key_prefix(f"s3://{bucket}/ckpt/{run}/", run)
    return FromS3(testbed, inventory_copy(testbed, tmp_path), job, bucket, prefix, run)


def test_from_s3_reads_a_bounded_tail_as_a_stream_thinned_as_the_node_thins(from_s3: FromS3) -> None:
    """20 MiB of ``{}`` lines, then 60,000 real sample rows: report and plot --from-s3 read the last 16 MiB
    (and say so), keep 20,000 rows picked as the node's metrics op picks them (the newest kept), and stay
    small in memory."""
    from remote.runs.metrics import thin

    f = from_s3
    rows = [{"t": 1000 + i, "kind": "sys", "gpus": [{"i": 0, "util": i % 100}], "host": {}} for i in range(60000)]
    body = b"{}\n" * ((20 << 20) // 3) + b"".join(json.dumps(x).encode() + b"\n" for x in rows)
    f.put("metrics.jsonl", body)
    started = time.monotonic()
    r, peak_kib = f.dfo("report", "-H", A, "--from-s3", "-j", str(f.job), f.run, "--json")
    took = time.monotonic() - started
    assert r.returncode == 0, r.stderr
    assert f"{len(body) / 2**20:.1f} MiB, over the bound of 16 MiB" in r.stderr, r.stderr
    assert "DFO_FROM_S3_MAX_MIB" in r.stderr, r.stderr
    rep = strict(r.stdout)["hosts"][A]
    assert rep["samples"] == 20000 and rep["mean_gpu_util"] is not None
    assert rep["seconds"] == 59999.0  # the first and the last rows kept
    assert 0 < peak_kib < 300 * 1024, f"dfo report --from-s3 peaked at {peak_kib // 1024} MiB"
    r, _ = f.dfo("plot", "--from-s3", "-j", str(f.job), f.run, "gpu_util", "--json")
    assert r.returncode == 0, r.stderr
    got = strict(r.stdout)["series"][0]
    want = thin(rows, 20000)
    assert got["x"] == [float(x["t"] - 1000) for x in want] and got["y"] == [x["gpus"][0]["util"] for x in want]
    print(f"report --from-s3 of {len(body) >> 20} MiB: {took:.1f} s, peak {peak_kib // 1024} MiB")


def test_from_s3_log_is_bounded_and_the_bound_can_be_set(from_s3: FromS3) -> None:
    f = from_s3
    lines = [f"line {i:07d}" for i in range(300000)]  # 3.6 MiB
    f.put("log", "".join(x + "\n" for x in lines).encode())
    r, _ = f.dfo("tail", "-H", A, "--from-s3", "-j", str(f.job), f.run, "-n", "2", DFO_FROM_S3_MAX_MIB="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == lines[-2:]
    assert "over the bound of 1 MiB" in r.stderr and "read its last 1 MiB" in r.stderr, r.stderr
    r, _ = f.dfo("tail", "-H", A, "--from-s3", "-j", str(f.job), f.run, "-n", "+1", DFO_FROM_S3_MAX_MIB="1")
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[-1] == lines[-1] and len(out) < len(lines) and out[0] in lines[1:], out[:2]  # a whole line first
    assert math.isclose(sum(len(x) + 1 for x in out), 1 << 20, rel_tol=0.001)
    r, _ = f.dfo("tail", "-H", A, "--from-s3", "-j", str(f.job), f.run, "-n", "2", DFO_FROM_S3_MAX_MIB="x")
    assert r.returncode == 2 and "DFO_FROM_S3_MAX_MIB" in r.stderr and "Traceback" not in r.stderr, r.stderr
