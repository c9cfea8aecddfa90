"""Issue 32, items 1 and 6: a node cannot steer the watcher. The generation record and the watcher's
lease sit under outputs.dest, where every node holds write keys; dfo signs what it writes there with a
key only the laptop holds (orchestrator/steps/recordauth.py), refuses old records written back, and holds
even a signed record to the job's own hosts. A gang member's claim that a peer is lost is not evidence.

The hostile node is played with the nodes' own S3 credentials (the testbed's keys, the ones every node's
shipper holds)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.config.models import RestartsConfig, load_job
from orchestrator.errors import ConfigError
from orchestrator.steps import recordauth
from orchestrator.steps.generation import Place, begin
from orchestrator.steps.recordauth import RecordForged
from orchestrator.steps.recovery import Watcher, classify
from orchestrator.steps.runs import RunInfo
from remote.runs import generation as gen
from tests.test_recovery import SAVE, Bed, MakeTestbed
from tests.test_recovery_s3 import _server

# --------------------------------------------------------------------------- the key and the records (S3)


@pytest.fixture
def own_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's dfo config folder (its key and the seq it has seen), never the machine's own."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("DFO_RECORD_KEY_FILE", raising=False)
    return tmp_path / "config" / "dfo" / "record.key"


@pytest.mark.testbed
def test_records_are_signed_and_a_forged_or_replayed_one_is_refused(tmp_path: Path, own_key: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    with _server(tmp_path, "seaweedfs") as (ep, c):
        where = Place(c, "gens", "runs/j/")
        first, e1 = where.write({"generation": 1, "run": "r", "hosts": ["a"]}, None)
        assert own_key.exists() and (own_key.stat().st_mode & 0o777) == 0o600
        raw1 = json.dumps(first).encode()
        assert first["seq"] == 1 and first["auth"]["alg"] == "hmac-sha256"
        doc, e = where.read()
        assert doc is not None and doc["run"] == "r" and e == e1
        second, e2 = where.write(dict(doc, generation=2, run="r.g2"), e)
        assert second["seq"] == 2

        def put(body: bytes) -> None:
            resp = c.request("PUT", "gens", "runs/j/" + gen.KEY, headers={"content-type": "application/json"},
                             body=body)
            resp.read()
            assert resp.status == 200, resp.status

        # a node changes one field and keeps the signature
        forged = dict(second, hosts=["stranger"])
        put(json.dumps(forged).encode())
        with pytest.raises(RecordForged, match="does not match its content") as e_mac:
            where.read()
        assert e_mac.value.exit_code == 3 and "s3://gens/runs/j/.dfo/generation.json" in e_mac.value.message
        # a node writes a record of its own, unsigned
        put(json.dumps({k: v for k, v in forged.items() if k != "auth"}).encode())
        with pytest.raises(RecordForged, match="carries no dfo signature"):
            where.read()
        put(b"not json at all")
        with pytest.raises(RecordForged, match="not a JSON object"):
            where.read()
        # a node writes back the genuine first record (its signature is good): an old one, refused
        put(raw1)
        with pytest.raises(RecordForged, match="seq 1 is older than seq 2"):
            where.read()
        # read untrusted, a launch starts a new lineage over whatever is there, numbers only growing
        assert where.read(trusted=False)[0] == first

        # another machine's key: said, with the way to give it the right one
        other = tmp_path / "other.key"
        other.write_text("ab" * 32 + "\n")
        other.chmod(0o600)
        monkeypatch.setenv("DFO_RECORD_KEY_FILE", str(other))
        put(json.dumps(second).encode())
        with pytest.raises(RecordForged, match=r"not this machine's key") as e_key:
            where.read()
        assert "copy record.key from the machine that launched the run" in e_key.value.render()
        other.chmod(0o644)
        with pytest.raises(ConfigError, match="may be read by others") as e_mode:
            recordauth.load_key()
        assert f"chmod 600 {other}" in e_mode.value.render()
        monkeypatch.delenv("DFO_RECORD_KEY_FILE")


@pytest.mark.testbed
def test_a_launch_over_a_forged_record_starts_a_signed_lineage_with_a_higher_generation(
        tmp_path: Path, own_key: Path) -> None:
    with _server(tmp_path, "seaweedfs") as (ep, c):
        job = tmp_path / "j.yaml"
        job.write_text(yaml.safe_dump({
            "name": "j", "s3": {"endpoint_url": ep.url, "region": ep.region},
            "outputs": {"path": "/workspace/out", "dest": "s3://gens/runs/j/"},
            "run": {"command": "true", "restarts": {"max": 1}}}))
        body = json.dumps({"generation": 7, "seq": 40, "state": "recovering", "hosts": ["stranger"]}).encode()
        resp = c.request("PUT", "gens", "runs/j/" + gen.KEY, body=body)
        resp.read()
        env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key}
        with _env(env):
            fields = begin(load_job(job), "j-1", ["a"])
            assert fields["generation"] == 8
            doc, _ = Place(c, "gens", "runs/j/").read()
        assert doc is not None and doc["seq"] == 41 and doc["hosts"] == ["a"] and doc["restarts"] == []


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------- even a signed record is held


def _watcher(tmp_path: Path, targets: list[str], spares: list[str]) -> Watcher:
    inv = tmp_path / "inventory.yaml"
    inv.write_text(yaml.safe_dump({"hosts": {h: {"host": "127.0.0.1"} for h in ("a", "b", "s1", "s2", "x")}}))
    job = tmp_path / "j.yaml"
    job.write_text(yaml.safe_dump({
        "name": "j", "s3": {"endpoint_url": "http://127.0.0.1:9", "region": "us-east-1"},
        "outputs": {"path": "/workspace/out", "dest": "s3://b/runs/j/"},
        "run": {"command": "true", "spares": spares, "restarts": {"max": 2}}}))
    with _env({"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}):  # no S3 is reached here
        return Watcher(inv, load_job(job), targets, say=lambda _s: None)


def _doc(**kw: Any) -> dict[str, Any]:
    return dict({"lineage": "L", "generation": 1, "run": "L", "hosts": ["a", "b"], "state": "running",
                 "restarts": [], "recovery": None}, **kw)


def test_a_record_naming_a_host_outside_the_job_is_not_obeyed(tmp_path: Path) -> None:
    w = _watcher(tmp_path, ["a", "b"], ["s1"])
    assert w._vet(_doc()) is not None
    for doc, field in [(_doc(hosts=["a", "x"]), "hosts"),
                       (_doc(recovery={"phase": "launch", "hosts": ["x"], "generation": 2, "old_generation": 1}),
                        "recovery.hosts"),
                       (_doc(recovery={"phase": "stop", "old_hosts": ["a", "x"], "generation": 2,
                                       "old_generation": 1}), "recovery.old_hosts")]:
        with pytest.raises(RecordForged, match=f"field {field} names x: neither a target") as e:
            w._vet(doc)
        assert e.value.exit_code == 3
    # a spare in the record is one of run.spares, never a target or another host of the inventory
    with pytest.raises(RecordForged, match="recovery.spare names b: not one of the job's run.spares"):
        w._vet(_doc(recovery={"phase": "parity", "spare": "b", "lost_host": "a", "generation": 2,
                              "old_generation": 1}))
    assert w._vet(_doc(recovery={"phase": "parity", "spare": "s1", "lost_host": "a", "hosts": ["a", "b"],
                                 "old_hosts": ["a", "b"], "generation": 2, "old_generation": 1}))


def test_the_restart_count_and_generation_never_go_down(tmp_path: Path) -> None:
    w = _watcher(tmp_path, ["a", "b"], ["s1"])
    one = [{"why": "signal", "generation": 2}]
    w._vet(_doc(generation=2, restarts=one))
    with pytest.raises(RecordForged, match="went back to generation 2 with 0 restart"):
        w._vet(_doc(generation=2, restarts=[]))
    with pytest.raises(RecordForged, match="went back to generation 1"):
        w._vet(_doc(generation=1, restarts=one))
    w._vet(_doc(generation=3, restarts=one + one))
    assert w.high["L"] == (2, 3)
    w._vet(_doc(lineage="M", generation=4, restarts=[]))  # a new launch's lineage starts its own count
    with pytest.raises(RecordForged, match="not a whole number"):
        w._vet(_doc(generation="9"))


# --------------------------------------------------------------------------- item 6: one member's claim


def _r(state: str, **kw: Any) -> RunInfo:
    return RunInfo(id="r", state=state, **kw)


def test_a_members_claim_that_a_peer_is_lost_is_not_evidence() -> None:
    claim = {"rank": 1, "watch": {"first_failure": {"host": "gpu1", "how": "lost"}}}
    policy = RestartsConfig()
    # gpu2 (a member) says gpu1 is lost while gpu1 itself answers running: nothing happens
    v = classify(["gpu1", "gpu2"], {"gpu1": _r("running"), "gpu2": _r("running", gang=claim)}, {}, policy)
    assert v.kind == "ok", v
    # even when gpu1 does not answer for a moment: a member's word does not count, only lost_after does
    v = classify(["gpu1", "gpu2"], {"gpu1": None, "gpu2": _r("running", gang=claim)}, {"gpu1": 2.0}, policy)
    assert v.kind == "ok", v
    # the hub's claim about a node that answered with a live run does not count either
    hub = {"rank": 0, "watch": {"first_failure": {"host": "gpu2", "how": "lost"}}}
    v = classify(["gpu1", "gpu2"], {"gpu1": _r("running", gang=hub), "gpu2": _r("running")}, {}, policy)
    assert v.kind == "ok", v
    # the hub's claim about a node that did not answer is what it was: lost at once
    v = classify(["gpu1", "gpu2"], {"gpu1": _r("stopped", gang=hub), "gpu2": None}, {"gpu2": 1.0}, policy)
    assert (v.kind, v.lost_host) == ("restart", "gpu2"), v


# --------------------------------------------------------------------------- the hostile node, end to end


@pytest.mark.timeout(300)
def test_a_forged_record_moves_nothing_and_the_watcher_says_so(make_testbed: MakeTestbed, tmp_path: Path) -> None:
    """The finding as it was played: a node writes ``state: recovering``, ``restarts: []`` and a recovery in
    its launch phase onto a host that is neither a target nor a spare. The watcher refuses it (exit 3,
    naming the record and what was wrong) and does nothing on any node: no code or run on that host, the
    healthy run still running, the record left as it is."""
    tb = make_testbed(nodes=3, s3=True)
    a, spare, stranger = tb.nodes
    bed = Bed(tb, tmp_path, "forged", spares=[spare.name], restarts={"max": 1, "backoff": 0, "lost_after": 60})
    try:
        up = bed.start("up.log", "up", "-H", a.name, "-j", bed.job.name)  # follows the run (stopped at the end)
        bed.wait("a checkpoint shipped", lambda: bed.shipped_step() >= SAVE, 240, [up])
        genuine = bed.record()
        assert genuine["auth"]["alg"] == "hmac-sha256" and genuine["seq"] >= 1, genuine
        lineage = genuine["lineage"]
        forged = dict(genuine, state="recovering", restarts=[], recovery={
            "phase": "launch", "hosts": [stranger.name], "generation": 2, "run": f"{lineage}.g2", "why": "lost",
            "lost_host": a.name, "spare": stranger.name, "old_run": lineage, "old_hosts": [a.name],
            "old_generation": 1, "at": "2026-12-06T00:00:00Z", "at_ts": 0, "not_before": 0})
        cases = [("does not match its content", forged),
                 ("carries no dfo signature", {k: v for k, v in forged.items() if k != "auth"})]
        for words, doc in cases:
            body = json.dumps(doc).encode()
            bed.s3.put_object(Bucket="recovery", Key=bed.record_key, Body=body)
            w = bed.run("watch", "-H", a.name, "-j", bed.job.name, timeout=90)
            out = w.stdout + w.stderr
            assert w.returncode == 3, out
            assert f"s3://recovery/{bed.record_key}" in out and words in out and "not obeyed" in out, out
            assert "Traceback" not in out
            assert bed.obj(bed.record_key) == body  # the record as the node left it
        # nothing on the stranger: no run, no code pushed; the healthy run still runs on its node
        r = tb.ssh(stranger, "ls /workspace/.dfo/runs 2>/dev/null | wc -l; test -e /workspace/forged && echo code")
        assert r.stdout.split() == ["0"], r.stdout
        st = bed.run("status", "-H", a.name, lineage, "--json")
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["hosts"][a.name]["runs"][0]["state"] == "running", st.stdout
        # a launch puts things right: a new lineage, signed, whatever the node wrote
        bed.run("stop", "-H", a.name, lineage, "--outputs-wait", "30")
    finally:
        bed.close()
