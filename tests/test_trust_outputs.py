"""Issue 19, finding 8 and the result-frame flood: the laptop does not trust the node, and dfo's node code
does not trust what it finds in a user's folder.

* The outputs shipper keeps its lock and bookkeeping in ``outputs.path/.dfo``. A ``.dfo`` there that is a
  symlink, not a folder, owned by another user or writable by others fails the pass with a message that
  ``dfo status`` and ``dfo outputs`` show, and nothing is written through it (the same checks as
  sync-data's destination: remote/lib/destsafety.py).
* A node that prints many result frames (or endless output to a plain command) cannot grow the laptop's
  memory: the collector keeps one result frame (a second is an error naming the host) and at most
  ``_Collector.ALL_MAX`` bytes of a plain command's output.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator.errors import VerifyError
from orchestrator.testbed import S3Endpoint, Testbed
from orchestrator.transport.base import _Collector
from remote.ship import shipper
from tests.test_outputs_node import ShipBed
from tests.test_shipper import ShipperProc, age, make_spec, objects, outputs_json

pytestmark = pytest.mark.testbed


@pytest.fixture
def s3(testbed: Testbed) -> S3Endpoint:
    assert testbed.s3 is not None
    return testbed.s3


@pytest.fixture
def bucket(s3: S3Endpoint) -> str:
    name = "trust-" + secrets.token_hex(4)
    s3.create_bucket(name)
    return name


# --------------------------------------------------------------------------- finding 8, on a node


def test_on_a_node_a_dfo_symlink_in_outputs_path_fails_the_pass_and_nothing_goes_through_it(
        testbed: Any, tmp_path: Path) -> None:
    t = ShipBed(testbed, tmp_path)
    target = f"/workspace/trust-link-target-{t.id}"
    t.sh(f"mkdir -p {t.out} {target} && ln -s {target} {t.out}/.dfo")
    try:
        job, name = t.job(n=2, d=0.3, s=0, every=0.5)
        r = t.dfo("launch", "-H", t.node.name, "-j", str(job), "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        run = json.loads(r.stdout)["hosts"][t.node.name]["run"]
        r = t.dfo("tail", "-H", t.node.name, run, timeout=120)
        assert "trainer done" in r.stdout, r.stdout + r.stderr
        st = t.status(run)
        assert st["state"] == "succeeded"  # the run itself is untouched
        out = st["outputs"]
        assert out["state"] == "failed" and out["final"]["ok"] is False, out
        err = out["errors"][-1]["error"]
        assert f"{t.out}/.dfo is a symlink" in err, err
        r = t.dfo("outputs", "-H", t.node.name, run)
        assert f"{t.out}/.dfo is a symlink" in r.stdout, r.stdout + r.stderr
        # nothing written through the link, nothing shipped
        assert t.sh(f"ls -A {target}") == ""
        assert t.sh(f"readlink {t.out}/.dfo").strip() == target  # left as it was
        assert t.objects(name) == {}
    finally:
        t.sh(f"rm -rf {t.out} {target}")


# --------------------------------------------------------------------------- finding 8, the shipper in-process


def _ckpt(root: Path) -> None:
    root.mkdir()
    (root / "ckpt-1.bin").write_bytes(os.urandom(1000))
    age(root / "ckpt-1.bin", 60)


def _bad_meta(kind: str, root: Path, target: Path) -> str:
    """Make ROOT/.dfo bad in one way; the words the refusal must hold."""
    meta = root / ".dfo"
    if kind == "symlink":
        meta.symlink_to(target)
        return f"{meta} is a symlink"
    if kind == "dangling":
        meta.symlink_to(target / "not-yet")  # a dangling link: open(O_CREAT) would create its target
        return f"{meta} is a symlink"
    if kind == "file":
        meta.write_text("not a folder")
        return f"{meta} is not a folder"
    meta.mkdir()
    if kind == "other-user":
        os.chown(meta, 65534, 65534)
        return f"{meta} is owned by"
    if kind == "group-writable":
        meta.chmod(0o770)
        return f"{meta} is writable by others (mode 0770)"
    assert kind == "world-writable"
    meta.chmod(0o1777)
    return f"{meta} is writable by others (mode 1777)"


@pytest.mark.parametrize("kind", ["symlink", "dangling", "file", "other-user", "group-writable", "world-writable"])
def test_a_bad_dfo_in_outputs_path_fails_the_pass_with_nothing_written(
        kind: str, s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    root, run_dir, target = tmp_path / "ckpt", tmp_path / "run", tmp_path / "elsewhere"
    _ckpt(root)
    run_dir.mkdir()
    target.mkdir()
    words = _bad_meta(kind, root, target)
    before = sorted(p.name for p in (root / ".dfo").iterdir()) if kind not in ("symlink", "dangling", "file") else []
    spec = make_spec(s3, root, f"s3://{bucket}/o/")
    for final in (False, True):  # a pass, and the last pass
        p = shipper.run_pass(spec, str(run_dir), final=final)
        assert p["ok"] is False and p["status"] == "failed", p
        assert words in p["error"] and "outputs.path" in p["error"], p["error"]
        doc = outputs_json(run_dir)
        assert words in doc["errors"][-1]["error"]
    assert doc["state"] == "failed"
    assert list(target.iterdir()) == []  # nothing written through a link
    if kind not in ("symlink", "dangling", "file"):
        assert sorted(p.name for p in (root / ".dfo").iterdir()) == before  # nothing written into it
    if kind == "file":
        assert (root / ".dfo").read_text() == "not a folder"
    assert objects(s3, bucket) == {}  # a pass that cannot keep its records ships nothing


def test_the_shipper_process_reports_a_dfo_symlink_and_writes_nothing_through_it(
        s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    root, run_dir, target = tmp_path / "ckpt", tmp_path / "run", tmp_path / "elsewhere"
    _ckpt(root)
    run_dir.mkdir()
    target.mkdir()
    (root / ".dfo").symlink_to(target)
    sp = ShipperProc(run_dir, make_spec(s3, root, f"s3://{bucket}/o/"))
    try:
        sp.wait_passes(1)
        sp.say("final")
        rc, out, err = sp.finish()
    finally:
        if sp.proc.poll() is None:
            sp.proc.kill()
            sp.proc.wait()
    assert rc == 1, (out, err)
    assert f"FAILED: outputs.path: {root}/.dfo is a symlink" in out, out
    assert list(target.iterdir()) == [] and objects(s3, bucket) == {}


def test_a_good_dfo_is_still_used_and_a_missing_one_is_made_0700(s3: S3Endpoint, bucket: str, tmp_path: Path) -> None:
    root, run_dir = tmp_path / "ckpt", tmp_path / "run"
    _ckpt(root)
    run_dir.mkdir()
    p = shipper.run_pass(make_spec(s3, root, f"s3://{bucket}/o/"), str(run_dir))
    assert p["ok"] and p["files"] == 1, p
    st = os.lstat(root / ".dfo")
    assert st.st_mode & 0o777 == 0o700
    assert sorted(x.name for x in (root / ".dfo").iterdir()) == ["ship.lock", "shipped.json"]  # no multipart


# --------------------------------------------------------------------------- the result-frame flood

FLOOD = 200_000
PAD = "x" * 40
LIAR = f"""\
import sys
out = sys.stdout
for i in range({FLOOD}):
    out.write('@@DFO-RESULT@@ {{"ok":true,"data":{{"n":' + str(i) + ',"pad":"{PAD}"}}}}\\n')
out.flush()
"""


class _Measured(_Collector):
    """The real collector, measuring what it keeps (result frames kept and the rest's buffer)."""

    peak = 0
    frames = 0

    def feed(self, data: bytes) -> None:
        try:
            super().feed(data)
        finally:
            kept = sum(len(k) for k in self.kept) + len(self.buf)
            _Measured.peak = max(_Measured.peak, kept)
            _Measured.frames = max(_Measured.frames, len(self.kept))


def _conn(testbed: Testbed, tmp_path: Path) -> Any:
    from orchestrator.config.models import load_inventory
    from orchestrator.transport import open_connection
    from orchestrator.transport.resolve import resolve_host
    from tests._runs_fixtures import inventory_copy

    inv_path = inventory_copy(testbed, tmp_path)
    inv, p = load_inventory(inv_path)
    return open_connection(resolve_host(inv, testbed.nodes[0].name, p))


def test_a_node_that_floods_result_frames_is_an_error_naming_the_host_with_memory_bounded(
        testbed: Testbed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator import agent
    from orchestrator.transport import ssh as connection

    conn = _conn(testbed, tmp_path)
    mod = f"trustflood_{secrets.token_hex(3)}"
    cache = f"/root/.cache/dfo/agent/{agent.bundle_digest()}"
    try:
        agent.run_module(conn, "remote.env.probe", {}, timeout=60)  # the agent is on the node
        r = testbed.node_exec(testbed.nodes[0], f"cat > {cache}/remote/{mod}.py <<'EOF'\n{LIAR}EOF")
        assert r.returncode == 0, r.stderr
        monkeypatch.setattr(connection, "_Collector", _Measured)
        _Measured.peak = _Measured.frames = 0
        t0 = time.monotonic()
        with pytest.raises(VerifyError) as ei:
            agent.run_module(conn, f"remote.{mod}", {}, timeout=120)
        seconds = time.monotonic() - t0
    finally:
        conn.close()
        testbed.node_exec(testbed.nodes[0], f"rm -f {cache}/remote/{mod}.py")
    e = ei.value
    assert e.host == testbed.nodes[0].name and "more than one result" in e.message, e.render()
    assert e.exit_code == 3
    # one frame is ~70 bytes; 200,000 of them are 14 MB. Kept: one frame and the 16 KiB tail, at most
    assert _Measured.frames <= 1 and _Measured.peak < 64 << 10, (_Measured.frames, _Measured.peak)
    assert seconds < 60


def test_the_collector_keeps_one_result_frame_and_refuses_a_second() -> None:
    c = _Collector(lambda line: "@@DFO-RESULT@@" in line, host="node-x")
    c.feed(b"banner\n@@DFO-EVENT@@ {}\n@@DFO-RESULT@@ {\"ok\":true}\n")
    c.feed(b"trailing noise\n")
    c.flush()
    assert c.text().endswith('@@DFO-RESULT@@ {"ok":true}\n') and len(c.kept) == 1
    c2 = _Collector(lambda line: "@@DFO-RESULT@@" in line, host="node-x")
    line = b'@@DFO-RESULT@@ {"ok":true,"data":1}\n'
    with pytest.raises(VerifyError) as ei:
        for _ in range(FLOOD):
            c2.feed(line * 100)
    assert ei.value.host == "node-x" and "more than one result" in ei.value.message
    assert len(c2.kept) == 1


def test_plain_command_output_is_capped_with_an_error_naming_the_host() -> None:
    c = _Collector(None, host="node-x")
    chunk = b"y\n" * (32 << 10)  # 64 KiB
    with pytest.raises(VerifyError) as ei:
        for _ in range((_Collector.ALL_MAX // len(chunk)) + 16):
            c.feed(chunk)
    assert len(c.buf) <= _Collector.ALL_MAX
    assert ei.value.host == "node-x" and "more than 256 MiB" in ei.value.message, ei.value.message
    ok = _Collector(None, host="node-x")
    ok.feed(b"small\n")
    ok.flush()
    assert ok.text() == "small\n"


def test_on_a_node_endless_output_to_a_plain_command_stops_at_the_cap(testbed: Testbed, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from orchestrator.transport import openssh
    from orchestrator.transport import ssh as connection

    monkeypatch.setattr(_Measured, "ALL_MAX", 8 << 20)  # the same code path, a smaller cap: quicker
    monkeypatch.setattr(connection, "_Collector", _Measured)
    monkeypatch.setattr(openssh, "_Collector", _Measured)  # whichever transport `ssh` means here
    _Measured.peak = 0
    conn = _conn(testbed, tmp_path)
    try:
        with pytest.raises(VerifyError) as ei:
            conn.run("yes dfo-flood", timeout=120)
    finally:
        conn.close()
    assert ei.value.host == testbed.nodes[0].name and "more than 8 MiB" in ei.value.message, ei.value.render()
    assert _Measured.peak <= 8 << 20
    deadline = time.monotonic() + 10  # the command was ended (the channel closed: yes gets SIGPIPE)
    while "yes dfo-flood" in testbed.node_exec(testbed.nodes[0], "ps -eo args").stdout:
        assert time.monotonic() < deadline, "yes dfo-flood still runs on the node"
        time.sleep(0.2)


# --------------------------------------------------------------------------- the workspace's .dfo (runs, records)


@pytest.mark.parametrize("command", ["launch", "provision"])
def test_launch_and_provision_refuse_a_workspace_whose_dfo_is_a_symlink_and_write_nothing_through_it(
        command: str, testbed: Any, tmp_path: Path) -> None:
    import yaml

    from tests._runs_fixtures import COUNTER, RunsEnv, inventory_copy

    env = RunsEnv(testbed, testbed.nodes[0], inventory_copy(testbed, tmp_path), tmp_path)
    tag = secrets.token_hex(3)
    ws, target = f"/root/trust-ws-{tag}", f"/root/trust-ws-target-{tag}"
    env.node_sh(f"mkdir -p {ws} {target} && ln -s {target} {ws}/.dfo")
    try:
        job, _ = env.job("python3 count.py 2 0", {"count.py": COUNTER}, name=f"trustws-{tag}")
        spec = yaml.safe_load(job.read_text())
        spec.update(workspace=ws, venv=f"/root/trust-venv-{tag}", packages=[])
        job.write_text(yaml.safe_dump(spec, sort_keys=False))
        r = env.dfo(command, "-H", env.node.name, "-j", str(job))
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"workspace: {ws}/.dfo is a symlink" in r.stdout + r.stderr, r.stdout + r.stderr
        assert env.node_sh(f"ls -A {target}") == ""  # no runs/, no .launch.lock, no provision record
        assert env.node_sh(f"readlink {ws}/.dfo").strip() == target
    finally:
        env.node_sh(f"rm -rf {ws} {target} /root/trust-venv-{tag}")
