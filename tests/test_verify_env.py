"""verify-env and the SSH layer against real testbed nodes (real sshd, real host keys)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from tests._cli import dfo

pytestmark = pytest.mark.testbed


def inventory_copy(tb, tmp_path: Path, **extra_hosts: dict) -> Path:  # type: ignore[no-untyped-def]
    """The testbed's inventory with a private known_hosts and extra hosts added."""
    inv = yaml.safe_load(Path(tb.inventory_path).read_text())
    inv["defaults"]["known_hosts"] = str(tmp_path / "known_hosts")
    inv["defaults"]["connect_timeout"] = 3
    inv["hosts"].update(extra_hosts)
    p = tmp_path / "inventory.yaml"
    p.write_text(yaml.safe_dump(inv))
    return p


def test_verify_env_reports_the_node(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    inv = inventory_copy(testbed, tmp_path)
    node = testbed.nodes[0]
    r = dfo(inv, "verify-env", "-H", node.name, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    h = doc["hosts"][node.name]
    assert h["ok"] is True and h["problems"] == []
    real_py = testbed.node_exec(node, "python3 -c 'import platform; print(platform.python_version())'").stdout.strip()
    assert h["python"] == real_py
    shm = h["node"]["disk"]["shm"]
    assert shm["path"] == "/dev/shm" and 0 < shm["total"] <= 512 * 2**20  # the node's own small tmpfs
    # first contact recorded the node's key in dfo's known_hosts (accept-new)
    kh = (tmp_path / "known_hosts").read_text()
    label = node.address if node.port == 22 else f"[{node.address}]:{node.port}"
    assert kh.startswith(label + " ")
    # human output is a table naming the host
    r2 = dfo(inv, "verify-env", "-H", node.name)
    assert r2.returncode == 0 and f"{node.name}: ok" in r2.stdout and "free shm" in r2.stdout


def test_job_without_venv_is_a_problem(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    inv = inventory_copy(testbed, tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text("name: nothere\nvenv: /root/no-such-venv\npackages: [faketorch==2.11.0]\n")
    r = dfo(inv, "verify-env", "-H", testbed.nodes[0].name, "-j", str(job), "--json")
    assert r.returncode == 3, r.stderr
    probs = json.loads(r.stdout)["hosts"][testbed.nodes[0].name]["problems"]
    assert probs[0]["kind"] == "venv_missing"
    assert f"dfo -i {inv} provision -H {testbed.nodes[0].name} -j {job}" in probs[0]["message"]  # as given


def test_changed_host_key_is_refused_and_nothing_runs(make_testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    tb = make_testbed(nodes=1, s3=False)
    inv = inventory_copy(tb, tmp_path)
    node = tb.nodes[0]
    assert dfo(inv, "verify-env", "-H", node.name).returncode == 0
    tb.rotate_host_key(node)
    tb.node_exec(node, "rm -rf /root/.cache/dfo")
    r = dfo(inv, "verify-env", "-H", node.name)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "CHANGED" in r.stderr and "SHA256:" in r.stderr and "ssh-keygen -R" in r.stderr
    assert "Traceback" not in r.stderr
    # nothing ran on the node: the remote code was never uploaded again
    assert tb.node_exec(node, "test -e /root/.cache/dfo && echo yes || echo no").stdout.strip() == "no"
    # the recorded key was not replaced
    assert dfo(inv, "verify-env", "-H", node.name).returncode == 4


def test_unreachable_host_exits_4_within_timeout_and_hides_no_other(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    node = testbed.nodes[0]
    # an address in the testbed's private range that no node answers on
    dead = node.address.rsplit(".", 1)[0] + ".250"
    inv = inventory_copy(testbed, tmp_path, ghost={"host": dead, "port": 22})
    t0 = time.monotonic()
    r = dfo(inv, "verify-env", "-H", node.name, "-H", "ghost", "--json")
    elapsed = time.monotonic() - t0
    assert r.returncode == 4, r.stderr
    doc = json.loads(r.stdout)["hosts"]
    assert doc[node.name]["ok"] is True  # the reachable host's result is there
    assert doc["ghost"]["ok"] is False and doc["ghost"]["error"]["kind"] == "unreachable"
    assert elapsed < 60  # bounded by connect_timeout (3 s), not by TCP's own minutes


def test_bad_inventory_exits_2(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  a: {host: x, port: 99999}\n")
    r = dfo(inv, "verify-env", "-H", "a")
    assert r.returncode == 2
    assert f"{inv}:2: hosts.a.port: input should be less than or equal to 65535" in r.stderr.replace("\n", " ")


from tests._provision_fixtures import node_wheelhouse, wheelhouse  # noqa: E402,F401


def test_pins_requirements_and_overrides(testbed, node_wheelhouse: str, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """A venv made by hand (not by dfo): torch pins triton 3.6.0 but 3.7.0 is installed, fla is missing."""
    node = testbed.nodes[0]
    venv = "/root/ve-verify"
    r = testbed.ssh(node, f"rm -rf {venv} && python3 -m venv {venv} && {venv}/bin/pip install -q --no-index "
                          f"--find-links {node_wheelhouse} --no-deps faketorch==2.11.0 faketriton==3.7.0", timeout=120)
    assert r.returncode == 0, r.stderr
    inv = inventory_copy(testbed, tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "pins", "venv": venv,
                                   "packages": ["faketorch==2.11.0", "faketriton==3.6.0", "fakefla==0.6.0"]}))
    r = dfo(inv, "verify-env", "-H", node.name, "-j", str(job), "--json")
    assert r.returncode == 3, r.stderr
    h = json.loads(r.stdout)["hosts"][node.name]
    assert h["packages"] == {"faketorch": "2.11.0", "faketriton": "3.7.0", "fakefla": None}
    msgs = " | ".join(p["message"] for p in h["problems"])
    assert "faketorch 2.11.0 requires faketriton==3.6.0" in msgs and "3.7.0" in msgs
    pin = [p for p in h["problems"] if p["package"] == "faketriton" and p["expected"]]
    assert pin and pin[0]["found"] == "3.7.0"
    assert any(p["package"] == "fakefla" and p["found"] is None for p in h["problems"])
    # the same venv with a deliberate override: a warning that quotes the reason, exit 0
    job.write_text(yaml.safe_dump({"name": "pins", "venv": venv,
                                   "packages": ["faketorch==2.11.0", "faketriton==3.7.0"],
                                   "overrides": [{"package": "faketriton==3.7.0",
                                                  "reason": "sm_120 autotuner fixes"}]}))
    r = dfo(inv, "verify-env", "-H", node.name, "-j", str(job), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    h = json.loads(r.stdout)["hosts"][node.name]
    assert h["ok"] and h["problems"] == []
    assert any("sm_120 autotuner fixes" in (w.get("reason") or w["message"]) for w in h["warnings"])
    human = dfo(inv, "verify-env", "-H", node.name, "-j", str(job))
    assert "warning" in human.stdout and "sm_120 autotuner fixes" in human.stdout


def test_proxy_jump_reaches_a_node_through_another(testbed2, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """ProxyJump (one hop): node-2 reached through node-1, both host keys checked and recorded."""
    jump, target = testbed2.nodes[0], testbed2.nodes[1]
    inv = inventory_copy(testbed2, tmp_path, via={"host": target.address, "port": target.port,
                                                  "proxy_jump": f"root@{jump.address}:{jump.port}"})
    r = dfo(inv, "verify-env", "-H", "via", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["hosts"]["via"]["node"]["hostname"] == target.name
    kh = (tmp_path / "known_hosts").read_text()
    assert jump.address in kh and target.address in kh  # both keys recorded on first contact
    # the jump host's key is checked too: a changed key there refuses the whole path, nothing runs
    testbed2.rotate_host_key(jump)
    testbed2.node_exec(target, "rm -rf /root/.cache/dfo")
    r2 = dfo(inv, "verify-env", "-H", "via")
    assert r2.returncode == 4, r2.stdout + r2.stderr
    assert "CHANGED" in r2.stderr and jump.address in r2.stderr
    assert testbed2.node_exec(target, "test -e /root/.cache/dfo && echo yes || echo no").stdout.strip() == "no"
