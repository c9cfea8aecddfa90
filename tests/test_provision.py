"""dfo provision on real testbed nodes, through the real CLI, offline from local wheels (tests/_wheels.py)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests._provision_fixtures import Pv, node_wheelhouse, pv, statuses, wheelhouse  # noqa: F401

pytestmark = pytest.mark.testbed

TORCH_PIN = "faketorch 2.11.0 requires faketriton==3.6.0"
REASON = "sm_120 autotuner fixes"


def need_isolation(pv: Pv) -> None:  # noqa: F811
    if not pv.tb.isolated:
        pytest.skip("changes the node's installer configuration in /root: needs isolated (netns) nodes")


@pytest.fixture
def node_config(pv: Pv) -> Iterator[list[str]]:  # noqa: F811
    """Installer config files a test writes on the node; removed afterwards."""
    need_isolation(pv)
    written: list[str] = []
    yield written
    for path in written:
        pv.sh(f"rm -f {shlex.quote(path)}")


def write_node_file(pv: Pv, path: str, text: str) -> None:  # noqa: F811
    r = pv.sh(f"mkdir -p {shlex.quote(str(Path(path).parent))} && printf %s {shlex.quote(text)} > {shlex.quote(path)}")
    assert r.returncode == 0, r.stderr


def test_fresh_node_then_second_run_makes_no_install_call(pv: Pv) -> None:  # noqa: F811
    cache = f"{pv.base}/triton-cache"
    job = pv.job(packages=["faketorch==2.11.0", "faketriton==3.6.0", "fakefla==0.6.0"],
                 run={"command": "true", "workdir": f"{pv.base}/run", "env": {"TRITON_CACHE_DIR": cache}})
    r, doc = pv.provision(job)
    assert r.returncode == 0, r.stderr
    assert doc and doc["ok"] is True
    assert statuses(doc) == {"workspace": "done", "venv": "done", "installer": "done", "faketorch==2.11.0": "done",
                             "faketriton==3.6.0": "no change", "fakefla==0.6.0": "done"}
    assert doc["packages"] == {"faketorch": "2.11.0", "faketriton": "3.6.0", "fakefla": "0.6.0"}
    assert pv.packages()["faketriton"] == "3.6.0"
    torch_step = next(s for s in doc["steps"] if s["name"] == "faketorch==2.11.0")
    assert torch_step["before"] is None and torch_step["after"] == "2.11.0"
    assert "faketorch==2.11.0" in torch_step["installer"][0]["command"]
    # the record on the node, and verify-env agrees with it
    rec = pv.read_json(f"{pv.workspace}/.dfo/provision/pvjob.json")
    assert rec["ok"] is True and rec["asked"] == ["faketorch==2.11.0", "faketriton==3.6.0", "fakefla==0.6.0"]
    assert {i["asked"]: i["after"] for i in rec["installed"]} == {"faketorch==2.11.0": "2.11.0",
                                                                  "fakefla==0.6.0": "0.6.0"}
    assert "pip" in rec["packages_before"] and "faketorch" not in rec["packages_before"]
    assert rec["packages_after"]["faketorch"] == "2.11.0"
    v = pv.dfo("verify-env", "-H", pv.node.name, "-j", str(job), "--json")
    vdoc = json.loads(v.stdout)["hosts"][pv.node.name]
    assert v.returncode == 0 and vdoc["ok"] is True, v.stdout + v.stderr
    assert vdoc["packages"] == {"faketorch": "2.11.0", "faketriton": "3.6.0", "fakefla": "0.6.0"}

    # second run: wrap the venv's uv so any call to it is logged, and give the Triton cache some bytes
    uv, log = f"{pv.venv}/bin/uv", f"{pv.base}/uv-calls.log"
    wrapper = f'#!/bin/sh\necho "$@" >> {log}\nexec {uv}.real "$@"\n'
    r2 = pv.sh(f"mv {uv} {uv}.real && printf %s {shlex.quote(wrapper)} > {uv} && chmod +x {uv} && "
               f"mkdir -p {cache}/abc && head -c 1000 /dev/zero > {cache}/abc/kernel.cubin")
    assert r2.returncode == 0, r2.stderr
    before = pv.sh(f"ls -l --time-style=full-iso {pv.venv}/lib/python3*/site-packages").stdout
    r, _ = pv.provision(job, "--clear-triton-cache", as_json=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for name in ["workspace", "venv", "installer", "faketorch==2.11.0", "faketriton==3.6.0", "fakefla==0.6.0"]:
        assert any(ln.startswith(f"{name}: no change") for ln in lines), r.stdout
    assert any(ln.startswith("triton cache: done") and "removed 1000 B (1 file)" in ln for ln in lines), r.stdout
    calls = pv.sh(f"cat {log} 2>/dev/null").stdout.splitlines()
    assert calls == [], calls  # uv was not run at all
    assert pv.sh(f"ls -l --time-style=full-iso {pv.venv}/lib/python3*/site-packages").stdout == before
    assert pv.sh(f"ls -A {cache}").stdout.strip() == ""
    rec = pv.read_json(f"{pv.workspace}/.dfo/provision/pvjob.json")
    assert rec["ok"] is True and rec["installed"] == [] and rec["changed"] == []
    assert [i["asked"] for i in rec["history"][0]["installed"]] == ["faketorch==2.11.0", "fakefla==0.6.0"]


def test_pip_installer_second_run_runs_no_pip(pv: Pv, node_config: list[str]) -> None:  # noqa: F811
    job = pv.job(installer="pip", packages=["faketorch==2.11.0"])
    r, doc = pv.provision(job)
    assert r.returncode == 0, r.stderr
    assert doc and statuses(doc)["installer"] == "no change" and statuses(doc)["faketorch==2.11.0"] == "done"
    # pip's own config makes every pip run append to a log: the proof that no pip ran
    conf, log = "/root/.config/pip/pip.conf", f"{pv.base}/pip.log"
    write_node_file(pv, conf, f"[global]\nlog = {log}\n")
    node_config.append(conf)
    r, doc = pv.provision(job)
    assert r.returncode == 0, r.stderr
    assert set(statuses(doc).values()) == {"no change"}  # type: ignore[arg-type]
    assert pv.sh(f"test -e {log}").returncode == 1, "pip ran during a no-op provision"
    # the probe works: a real (no-op) pip install does write the log
    pv.sh(f"{pv.venv}/bin/python -m pip install --no-index --find-links {pv.wheels} faketorch==2.11.0")
    assert pv.sh(f"test -s {log}").returncode == 0


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_forbidden_pin_fails_then_override_with_reason_succeeds(pv: Pv, installer: str) -> None:  # noqa: F811
    job = pv.job(installer=installer, packages=["faketorch==2.11.0", "faketriton==3.7.0"])
    r, doc = pv.provision(job)
    assert r.returncode == 3, r.stdout + r.stderr
    assert doc and doc["ok"] is False
    assert TORCH_PIN in doc["error"]["message"], doc["error"]
    assert "the venv is unchanged" in doc["error"]["message"]
    assert doc["steps"][-1]["name"] == "faketriton==3.7.0" and doc["steps"][-1]["status"] == "failed"
    assert doc["problems"][0]["package"] == "faketriton" and doc["problems"][0]["expected"] == "==3.7.0"
    assert pv.packages()["faketriton"] == "3.6.0"  # the failed install left the working version in place
    # human output names the pin too
    r, _ = pv.provision(job, as_json=False)
    assert r.returncode == 3 and TORCH_PIN in r.stderr and "faketriton==3.7.0: failed" in r.stdout

    job = pv.job(installer=installer, packages=["faketorch==2.11.0", "faketriton==3.7.0"],
                 overrides=[{"package": "faketriton==3.7.0", "reason": REASON}])
    r, doc = pv.provision(job)
    assert r.returncode == 0, r.stdout + r.stderr
    assert doc and doc["ok"] is True and pv.packages()["faketriton"] == "3.7.0"
    assert statuses(doc)["faketriton==3.7.0"] == "warning"
    assert any(TORCH_PIN in w["message"] and w["reason"] == REASON and REASON in w["message"]
               for w in doc["warnings"]), doc["warnings"]
    r, _ = pv.provision(job, as_json=False)
    assert r.returncode == 0 and f'"{REASON}"' in r.stdout and "faketriton==3.7.0: no change" in r.stdout
    v = pv.dfo("verify-env", "-H", pv.node.name, "-j", str(job), "--json")
    vdoc = json.loads(v.stdout)["hosts"][pv.node.name]
    assert v.returncode == 0 and vdoc["ok"] is True, v.stdout + v.stderr
    assert any(REASON in (w.get("reason") or "") for w in vdoc["warnings"]), vdoc["warnings"]


@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_installer_that_exits_0_without_installing_is_caught(pv: Pv, installer: str,  # noqa: F811
                                                             node_config: list[str]) -> None:
    r, _ = pv.provision(pv.job(installer=installer, packages=["faketriton==3.6.0"]))
    assert r.returncode == 0, r.stderr
    if installer == "uv":  # a user-level uv.toml that overrides the request (the incident's silent no-op)
        conf, text = "/root/.config/uv/uv.toml", 'override-dependencies = ["faketriton==3.6.0"]\n'
    else:  # a user-level pip.conf that installs somewhere else ("Successfully installed", exit 0)
        conf, text = "/root/.config/pip/pip.conf", f"[install]\ntarget = {pv.base}/elsewhere\n"
    write_node_file(pv, conf, text)
    node_config.append(conf)
    r, doc = pv.provision(pv.job(installer=installer, packages=["faketriton==3.7.0"]))
    assert r.returncode == 3, r.stdout + r.stderr
    step = doc["steps"][-1] if doc else {}
    assert step["status"] == "failed" and step["asked"] == "faketriton==3.7.0"
    assert step["before"] == "3.6.0" and step["after"] == "3.6.0"
    assert [run["exit_code"] for run in step["installer"]] == [0]
    assert "the installer exited 0 but faketriton is still 3.6.0" in doc["error"]["message"]  # type: ignore[index]
    if installer == "pip":
        assert "Successfully installed faketriton-3.7.0" in step["installer"][0]["output_tail"]
    assert pv.packages()["faketriton"] == "3.6.0"


def test_bad_package_spec_is_exit_2_before_any_host_is_touched(pv: Pv) -> None:  # noqa: F811
    job = pv.job(packages=["faketorch==2.11.0", "faketriton>=3.*"])
    r, _ = pv.provision(job, as_json=False)
    assert r.returncode == 2, r.stderr
    assert f"{job.resolve()}:" in r.stderr and "packages.1" in r.stderr and "'faketriton>=3.*'" in r.stderr
    assert "Traceback" not in r.stderr
    assert pv.sh(f"test -e {pv.workspace}").returncode == 1
    bad = pv.job(packages=["faketorch"], overrides=[{"package": "faketriton", "reason": "no version given"}])
    r, _ = pv.provision(bad, as_json=False)
    assert r.returncode == 2 and "names no version" in r.stderr


def test_unreachable_index_fails_with_the_installers_words(pv: Pv) -> None:  # noqa: F811
    r, _ = pv.provision(pv.job(packages=["faketriton==3.6.0"]))  # the venv and its uv, from the wheelhouse
    assert r.returncode == 0, r.stderr
    job = pv.job(packages=["faketriton==3.7.0"], index={"url": "http://127.0.0.1:9/simple"})
    r, _ = pv.provision(job, as_json=False)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "faketriton==3.7.0: uv exited" in r.stderr and "the venv is unchanged" in r.stderr
    assert "127.0.0.1:9" in r.stderr and "Traceback" not in r.stderr
    assert pv.packages()["faketriton"] == "3.6.0"


def test_missing_python_on_the_node(pv: Pv, tmp_path: Path) -> None:  # noqa: F811
    r, doc = pv.provision(pv.job(python="python3.99", packages=["faketorch==2.11.0"]))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "the job's python 'python3.99' is not on the node" in doc["error"]["message"]  # type: ignore[index]
    assert pv.sh(f"test -e {pv.venv}").returncode == 1
    inv = yaml.safe_load(pv.tb.inventory_path.read_text())
    inv["defaults"]["python"] = "/usr/bin/python3.99"
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(inv))
    r = pv.dfo("provision", "-H", pv.node.name, "-j", str(pv.job(packages=[])), inventory=tmp_path / "inv.yaml")
    assert r.returncode == 3 and "/usr/bin/python3.99 not found on the node" in r.stderr, r.stderr


def test_unreachable_host_is_exit_4(pv: Pv, tmp_path: Path) -> None:  # noqa: F811
    inv = yaml.safe_load(pv.tb.inventory_path.read_text())
    inv["hosts"] = {"gone": {"host": "127.0.0.1", "port": 1}}
    inv["defaults"]["connect_timeout"] = 3
    inv["groups"] = {}
    (tmp_path / "inv.yaml").write_text(yaml.safe_dump(inv))
    r = pv.dfo("provision", "-H", "gone", "-j", str(pv.job(packages=[])), "--json", inventory=tmp_path / "inv.yaml")
    assert r.returncode == 4, r.stdout + r.stderr
    doc = json.loads(r.stdout)["hosts"]["gone"]
    assert doc["ok"] is False and doc["steps"] == [] and doc["error"]["kind"] == "unreachable"
