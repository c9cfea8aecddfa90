"""The GPU health gate without a GPU (issue 34): nvidia-smi's XML, ``topo -m``, ``nvlink -s`` and the kernel
log parsed from real captures (tests/data/health, SOURCES.md says where each comes from), the table of
GPU models, the verdicts (they give what the gate said on the H100 for the same captures), run.health in
the job file, the request the controller sends, and the node module itself run here with a fake
nvidia-smi that replays the captures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from remote.gpu import health_verdict as hv
from remote.gpu.health_smi import norm_bus, parse_nvlink_status, parse_smi_xml, parse_topo, parse_xids
from remote.gpu.health_table import achievable, link_achievable, lookup, nccl_achievable, pcie_gbps, table

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data" / "health"


def smi(name: str) -> dict[str, Any]:
    return parse_smi_xml((DATA / "h100" / f"{name}-q.xml").read_text())


def device_gate(name: str) -> dict[str, Any]:
    """What the gate itself said on the H100 (bench/gpu/health_bench.py's record)."""
    return dict(json.loads((DATA / "h100" / f"gate-{name}.json").read_text())["result"]["data"])


def verdicts(checks: list[dict[str, Any]]) -> dict[str, str]:
    return {c["check"]: c["verdict"] for c in checks}


# --------------------------------------------------------------------------- nvidia-smi -q -x


def test_the_xml_of_an_idle_h100_reads_as_nvidia_smi_printed_it() -> None:
    d = smi("idle")
    assert (d["driver"], d["cuda"]) == ("580.159.04", "13.0")
    (g,) = d["gpus"]
    assert g["name"] == "NVIDIA H100 80GB HBM3" and g["uuid"] == "GPU-cf9ba398-3067-5941-6b63-f1c97b5cd835"
    assert g["bus"] == "0000:00:06" and g["bus_id"] == "00000000:00:06.0"
    assert (g["memory_total_mib"], g["memory_used_mib"], g["util_gpu"]) == (81559, 0, 0)
    assert g["pcie"] == {"gen": 5, "gen_max": 5, "gen_device_max": 5, "gen_host_max": None, "width": 16,
                         "width_max": 16}  # the host's maximum reads N/A in this VM
    assert g["power"]["limit"] == 700 and g["power"]["default"] == 700
    assert g["reasons"] == ["gpu_idle"] and g["processes"] == []
    assert g["ecc"] == {"mode": "Enabled", "volatile_uncorrected": 0, "aggregate_uncorrected": 0}
    assert g["pages"]["rows_pending"] is False and g["pages"]["retire_pending"] is None  # N/A on Hopper
    assert g["reset"]["recovery_action"] == "None"
    # the text form says the same numbers (the XML is what the gate reads)
    text = (DATA / "h100" / "idle-q.txt").read_text()
    assert "81559 MiB" in text and "GPU 00000000:00:06.0" in text


def test_the_xml_names_another_tenant_and_the_memory_it_holds() -> None:
    (t,) = smi("tenant")["gpus"]
    assert t["util_gpu"] == 99 and t["reasons"] == ["sw_power_cap"] and t["power"]["draw"] > 600
    assert t["processes"] == [{"pid": 697, "type": "C", "name": "python3", "used_mib": 1002}]
    (c,) = [c for c in hv.before_load(dict(t), 0.05) if c["check"] == "processes"]
    assert "pid 697 (python3, user " in c["message"] and ", 1002.0 MiB)" in c["message"]
    (h,) = smi("hog")["gpus"]
    assert h["memory_used_mib"] == 73591 and h["processes"][0]["used_mib"] == 73582


def test_unreadable_xml_is_an_error_that_says_so() -> None:
    from remote.gpu.health_smi import SmiError

    with pytest.raises(SmiError, match="no readable XML"):
        parse_smi_xml("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")


def test_pci_addresses_compare_whoever_wrote_them() -> None:
    assert norm_bus("00000000:00:06.0") == norm_bus("0000:00:06") == norm_bus("00:06.0") == "0000:00:06"
    assert norm_bus("00000000:3B:00.0") == norm_bus("0000:3b:00") == "0000:3b:00"


# --------------------------------------------------------------------------- topology, NVLink, kernel log


def test_topology_matrices_parse_to_gpu_pairs() -> None:
    one = parse_topo((DATA / "h100" / "topo-m.txt").read_text())  # with the driver's underline escape
    assert one == {"gpus": ["GPU0"], "links": {}}
    nv = parse_topo((DATA / "public" / "topo-8xh100-nv18.txt").read_text())
    assert len(nv["gpus"]) == 8 and len(nv["links"]) == 28 and set(nv["links"].values()) == {"NV18"}
    pcie = parse_topo((DATA / "public" / "topo-8x4090-sys.txt").read_text())  # tabs, and two NICs
    assert len(pcie["links"]) == 28 and set(pcie["links"].values()) == {"SYS"}


def test_nvlink_status_counts_active_and_inactive_links() -> None:
    assert parse_nvlink_status((DATA / "h100" / "nvlink-s.txt").read_text()) == {}  # one GPU: nothing printed
    assert parse_nvlink_status((DATA / "public" / "nvlink-s-v100-inactive.txt").read_text()) == {
        3: {"active": 4, "inactive": 2}}
    assert parse_nvlink_status((DATA / "public" / "nvlink-s-a100.txt").read_text()) == {
        0: {"active": 12, "inactive": 0}, 1: {"active": 12, "inactive": 0}}


def test_xids_from_dmesg_dmesg_ctime_and_journalctl() -> None:
    assert parse_xids((DATA / "h100" / "dmesg.txt").read_text()) == []  # NVRM lines, no XID
    ctime = parse_xids((DATA / "public" / "kernel-gpud-dmesg-ctime.txt").read_text())
    assert [(x["bus"], x["xid"]) for x in ctime] == [("0000:cb:00", 13)] * 3 + [("0000:cb:00", 109)]
    jk = parse_xids((DATA / "public" / "kernel-journalctl-xid45.txt").read_text())
    assert {x["bus"] for x in jk} == {"0000:dc:00", "0000:ed:00", "0000:ba:00", "0000:97:00"}
    assert {x["xid"] for x in jk} == {45}  # "caused by previous Xid 149" is not a second XID
    off = parse_xids((DATA / "public" / "kernel-nvsentinel-fallen-off-bus.txt").read_text())
    assert [(x["bus"], x["xid"]) for x in off] == [("0000:b3:00", 79)]  # three lines, no XID: 79


def test_xid_verdicts_per_gpu() -> None:
    gpus = [{"index": i, "name": "NVIDIA H100 80GB HBM3", "bus": b} for i, b in
            enumerate(("0000:b3:00", "0000:cb:00", "0000:01:00", "0000:00:06"))]
    found = (parse_xids((DATA / "public" / "kernel-nvsentinel-fallen-off-bus.txt").read_text())
             + parse_xids((DATA / "public" / "kernel-gpud-dmesg-ctime.txt").read_text())
             + parse_xids((DATA / "public" / "kernel-collenchyma-xid31.txt").read_text()))
    got = [c["verdict"] for c in hv.xids(gpus, found, "dmesg", None)]
    assert got == ["fail", "warn", "warn", "pass"]  # 79: the GPU is gone; 13/109 and 31: a program's fault
    assert "XID 79" in hv.xids(gpus, found, "dmesg", None)[0]["message"]
    unreadable = hv.xids(gpus[:1], None, "", "dmesg: read kernel buffer failed: Operation not permitted")
    assert unreadable[0]["verdict"] == "skip" and "Operation not permitted" in unreadable[0]["message"]


# --------------------------------------------------------------------------- the table


def test_the_table_knows_the_models_the_issue_names() -> None:
    names = {
        "NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H200": "h200",
        "NVIDIA A100-SXM4-40GB": "a100-sxm-40", "NVIDIA A100-SXM4-80GB": "a100-sxm-80",
        "NVIDIA A100-PCIE-40GB": "a100-pcie-40", "NVIDIA A100 80GB PCIe": "a100-pcie-80", "NVIDIA L40S": "l40s",
        "NVIDIA GeForce RTX 4090": "rtx-4090", "NVIDIA RTX PRO 6000 Blackwell Server Edition": "rtx-pro-6000-blackwell",
        "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition": "rtx-pro-6000-blackwell", "NVIDIA B200": "b200",
    }
    for name, key in names.items():
        m = lookup(name)
        assert m is not None and m["key"] == key, name
    assert lookup("Tesla T4") is None and lookup("NVIDIA H200 NVL") is None and lookup(None) is None


def test_every_figure_has_a_source() -> None:
    for m in table()["models"]:
        assert "https://" in m["datasheet"]["source"], m["key"]  # the vendor's page
        for fig, got in m["measured"].items():
            assert got["value"] > 0 and "health_device.sh" in got["command"], (m["key"], fig)
            assert list(ROOT.glob(got["file"])), got["file"]  # the measurement is in the tree
    for r in table()["ratios"].values():
        assert 0 < r["value"] <= 1 and r["source"]


def test_achievable_figures_measured_derived_or_none() -> None:
    h100, h200 = lookup("NVIDIA H100 80GB HBM3"), lookup("NVIDIA H200")
    assert achievable(h100, "matmul_bf16_tflops")[0] == 698  # measured here
    v, src = achievable(h200, "matmul_bf16_tflops")
    assert v == pytest.approx(989 * 0.7) and "datasheet" in src  # derived
    assert achievable(lookup("NVIDIA RTX PRO 6000 Blackwell Server Edition"), "matmul_bf16_tflops")[0] is None
    assert achievable(None, "hbm_copy_tbps") == (None, "this GPU model is not in dfo's table "
                                                       "(remote/gpu/gpu_models.json)")
    assert pcie_gbps(5, 16) == pytest.approx(63.0, abs=0.05) and pcie_gbps(4, 8) == pytest.approx(15.75, abs=0.01)
    assert link_achievable(lookup("NVIDIA L40S"), "h2d_gbps", None, None)[0] == pytest.approx(31.5 * 0.88, abs=0.1)
    assert link_achievable(None, "h2d_gbps", 4, 16)[0] == pytest.approx(31.5 * 0.88, abs=0.1)  # nvidia-smi's max
    assert nccl_achievable(h100, True)[0] == pytest.approx(450 * 0.7)
    assert nccl_achievable(h100, False)[0] is None and nccl_achievable(lookup("NVIDIA L40S"), True)[0] is None


# --------------------------------------------------------------------------- verdicts


def test_before_load_verdicts_match_what_the_gate_said_on_the_h100() -> None:
    cases: list[tuple[str, set[str]]] = [("idle", set()), ("tenant", {"processes", "busy_before"}),
                                         ("hog", {"processes", "memory_in_use"})]
    for name, bad in cases:
        (g,) = smi(name)["gpus"]
        got = verdicts(hv.before_load(g, 0.05))
        assert {k for k, v in got.items() if v == "fail"} == bad, (name, got)
        said = verdicts([c for c in device_gate("healthy-1" if name == "idle" else name)["checks"]
                         if c["check"] in got])
        assert said == got, name


def test_a_lowered_power_limit_and_a_pending_row_remap_fail() -> None:
    (g,) = smi("idle")["gpus"]
    g["power"]["limit"] = 500.0  # what `nvidia-smi -pl 500` would show (not done on the lent machine)
    g["pages"]["rows_pending"] = True
    got = {c["check"]: c for c in hv.before_load(g, 0.05)}
    assert got["power_limit"]["verdict"] == "fail" and "power limit 500 W, default 700 W: lowered" in \
        got["power_limit"]["message"]
    assert got["memory_pages"]["verdict"] == "fail" and "row remap is pending" in got["memory_pages"]["message"]


def test_throttle_and_link_under_load() -> None:
    (idle,) = smi("idle")["gpus"]
    (loaded,) = smi("tenant")["gpus"]  # a GPU under a full matmul load: SW power cap, Gen5 x16
    got = {c["check"]: c for c in hv.under_load(idle, loaded)}
    assert got["throttle"]["verdict"] == "pass" and "(also: sw_power_cap)" in got["throttle"]["message"]
    assert got["pcie_link"]["verdict"] == "pass" and "Gen5 x16" in got["pcie_link"]["message"]
    loaded["reasons"] = ["hw_thermal_slowdown"]
    loaded["pcie"]["gen"], loaded["pcie"]["width"] = 3.0, 8.0
    got = {c["check"]: c for c in hv.under_load(idle, loaded)}
    assert got["throttle"]["verdict"] == "fail" and "hw_thermal_slowdown" in got["throttle"]["message"]
    assert got["pcie_link"]["verdict"] == "fail" and "Gen3 where Gen5" in got["pcie_link"]["message"]
    assert "x8 where x16" in got["pcie_link"]["message"]


def test_measured_figures_against_the_table() -> None:
    (g,) = smi("idle")["gpus"]
    figures = device_gate("tenant")["gpus"][0]["figures"]  # the H100's figures while another tenant ran
    got = {c["check"]: c for c in hv.measured(g, figures, 0.8, g["pcie"])}
    m = got["matmul_bf16_tflops"]
    assert m["verdict"] == "fail" and m["expected"] == 698 and m["threshold"] == pytest.approx(558.4)
    assert "GPU 0 (NVIDIA H100 80GB HBM3): bf16 matmul 328 TFLOPS, expected at least 558 TFLOPS" in m["message"]
    assert got["h2d_gbps"]["verdict"] == "pass"
    healthy = device_gate("healthy-1")["gpus"][0]["figures"]
    assert {c["verdict"] for c in hv.measured(g, healthy, 0.8, g["pcie"])} == {"pass"}
    # a model not in the table: the figures are shown, not judged, and it says so
    t4 = dict(g, name="Tesla T4")
    got = {c["check"]: c for c in hv.measured(t4, healthy, 0.8, g["pcie"])}
    assert got["model"]["verdict"] == "info" and "not in dfo's table" in got["model"]["message"]
    assert got["matmul_bf16_tflops"]["verdict"] == "info" and got["hbm_copy_tbps"]["verdict"] == "info"
    assert got["h2d_gbps"]["verdict"] == "pass"  # held to nvidia-smi's own link maximum


def test_gpus_hidden_from_torch_and_missing_from_the_listing() -> None:
    hidden = device_gate("hidden")
    assert verdicts(hidden["checks"])["gpus_visible"] == "fail"
    (c,) = hv.gpu_count(1, 0, None, "")
    assert c["message"] == "torch sees 0 of the 1 GPU(s) nvidia-smi lists (CUDA_VISIBLE_DEVICES='' hides the others)"
    assert [x["verdict"] for x in hv.gpu_count(7, 7, 8, None)] == ["fail", "pass"]  # the listing says 8


def test_between_gpus_nvlink_down_and_the_all_reduce() -> None:
    h100 = [{"index": i, "name": "NVIDIA H100 80GB HBM3"} for i in range(8)]
    nv = parse_topo((DATA / "public" / "topo-8xh100-nv18.txt").read_text())
    sys_ = parse_topo((DATA / "public" / "topo-8x4090-sys.txt").read_text())
    ok = {"bytes": 1 << 30, "ranks": 8, "busbw_gbps": 361.0, "seconds": 0.005}
    got = verdicts(hv.between(h100, nv, None, [[True] * 8] * 8, ok, 0.8))
    assert got == {"topology": "pass", "p2p": "pass", "nccl_allreduce": "pass"}
    slow = dict(ok, busbw_gbps=120.0)
    c = {x["check"]: x for x in hv.between(h100, nv, None, None, slow, 0.8)}["nccl_allreduce"]
    assert c["verdict"] == "fail" and c["threshold"] == pytest.approx(0.8 * 315)
    # SXM GPUs whose pairs all go over the PCIe/SMP path: NVLink is down
    down = {x["check"]: x for x in hv.between(h100, sys_, None, None, None, 0.8)}
    assert down["topology"]["verdict"] == "fail" and "NVLink down?" in down["topology"]["message"]
    # the same topology on RTX 4090s is what they have (no NVLink): it passes
    rtx = [{"index": i, "name": "NVIDIA GeForce RTX 4090"} for i in range(8)]
    assert verdicts(hv.between(rtx, sys_, None, None, None, 0.8))["topology"] == "pass"
    links = parse_nvlink_status((DATA / "public" / "nvlink-s-v100-inactive.txt").read_text())
    assert verdicts(hv.between(h100, nv, links, None, None, 0.8))["nvlink"] == "fail"
    assert hv.between(h100[:1], None, None, None, None, 0.8)[0]["verdict"] == "skip"


# --------------------------------------------------------------------------- the node module, here


def _fake_smi(tmp: Path, capture: str) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "q.xml").write_text((DATA / "h100" / f"{capture}-q.xml").read_text())
    exe = bin_dir / "nvidia-smi"
    exe.write_text('#!/bin/sh\n[ "$*" = "-q -x" ] && exec cat "$(dirname "$0")/q.xml"\necho "not replayed: $*" >&2\n'
                   "exit 2\n")
    exe.chmod(0o755)
    return bin_dir


def _run_gate(request: dict[str, Any]) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "remote.gpu.health"], input=json.dumps(request) + "\n", cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("@@DFO-RESULT@@ "))
    doc = json.loads(line.split(" ", 1)[1])
    assert doc["ok"], doc
    return dict(doc["data"])


@pytest.mark.parametrize("capture,fails", [("idle", set()), ("hog", {"processes", "memory_in_use"}),
                                           ("tenant", {"processes", "busy_before"})])
def test_the_quick_gate_here_on_replayed_captures(tmp_path: Path, capture: str, fails: set[str]) -> None:
    d = _run_gate({"measure": False, "path": str(_fake_smi(tmp_path, capture)), "expect_gpus": 1, "job": "j"})
    assert {c["check"] for c in d["checks"] if c["verdict"] == "fail"} == fails
    assert d["ok"] is (not fails) and [p["kind"] for p in d["problems"]] == ["health"] * len(fails)
    if capture == "tenant":  # read twice, a second apart: a tenant's load does not stop
        busy = next(c for c in d["checks"] if c["check"] == "busy_before")
        assert "the lower of 99% and 99%, 1 s apart" in busy["message"]
    assert d["phases"]["nvidia_smi"] < 5 and d["kernel_log"]["source"] in ("dmesg", "journalctl", "/var/log/kern.log",
                                                                          "")


def test_the_measuring_workers_start_answer_and_end_without_a_gpu(tmp_path: Path) -> None:
    """The parent and its per-GPU worker processes (remote/gpu/health_worker.py), for real, on a machine
    whose torch sees no GPU (CPU torch) or that has none: the gate says which, and no worker is left."""
    import importlib.util

    d = _run_gate({"path": str(_fake_smi(tmp_path, "idle")), "seconds": 30})
    fails = {c["check"]: c["message"] for c in d["checks"] if c["verdict"] == "fail"}
    if importlib.util.find_spec("torch") is not None:
        assert fails == {"gpus_visible": "torch sees 0 of the 1 GPU(s) nvidia-smi lists (no CUDA_VISIBLE_DEVICES: "
                                         "the driver or the container hides them)"}, fails
        assert d["torch"] and "workers" in d["phases"]
    else:
        assert list(fails) == ["torch"] and "No module named 'torch'" in fails["torch"], fails
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"remote.gpu.health_worker" in cmd and Path(f"/proc/{pid}/cwd").resolve() == ROOT:
            left.append(pid)
    assert left == []  # every worker reaped


def test_no_nvidia_smi_and_bad_requests_are_said(tmp_path: Path) -> None:
    d = _run_gate({"measure": False, "path": str(tmp_path)})
    if not any(Path(p, "nvidia-smi").exists() for p in ("/usr/bin", "/usr/local/nvidia/bin", "/usr/local/bin")):
        assert d["ok"] is False and d["checks"][0]["check"] == "nvidia_smi"
    r = subprocess.run([sys.executable, "-m", "remote.gpu.health"], input='{"min_fraction": 7}\n', cwd=ROOT,
                       capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    doc = json.loads(r.stdout.strip().splitlines()[-1].split(" ", 1)[1])
    assert doc["ok"] is False and doc["error"]["kind"] == "usage" and "min_fraction" in doc["error"]["message"]


# --------------------------------------------------------------------------- the job's run.health, the request


@pytest.mark.parametrize("value,want", [
    ("on", {"min_fraction": 0.8, "measure": True}), ("'on'", {"min_fraction": 0.8}), ("true", {"seconds": 60.0}),
    ("off", None), ("{min_fraction: 0.7, measure: false}", {"min_fraction": 0.7, "measure": False}),
])
def test_run_health_in_the_job_file(tmp_path: Path, value: str, want: dict[str, Any] | None) -> None:
    from orchestrator.config.models import load_job

    (tmp_path / "j.yaml").write_text(f"name: j\nrun:\n  command: echo hi\n  health: {value}\n")
    got = load_job(tmp_path / "j.yaml").job.run.health  # type: ignore[union-attr]
    if want is None:
        assert got is None
    else:
        assert got is not None and {k: getattr(got, k) for k in want} == want


@pytest.mark.parametrize("value,message", [
    ("maybe", "run.health: on, off, or thresholds such as {min_fraction: 0.8}"),
    ("{min_fraction: 2}", "run.health.min_fraction: input should be less than or equal to 1"),
    ("{min_frac: 0.5}", "run.health.min_frac: unknown field"),
])
def test_a_bad_run_health_is_exit_2_naming_the_field(tmp_path: Path, value: str, message: str) -> None:
    from orchestrator.config.models import load_job
    from orchestrator.errors import ConfigError

    (tmp_path / "j.yaml").write_text(f"name: j\nrun:\n  command: echo hi\n  health: {value}\n")
    with pytest.raises(ConfigError) as exc:
        load_job(tmp_path / "j.yaml")
    assert message in exc.value.message and exc.value.exit_code == 2


def test_the_request_carries_the_jobs_gpu_environment(tmp_path: Path) -> None:
    from orchestrator.config.models import ResolvedHost, load_job
    from orchestrator.steps.health import request

    (tmp_path / "j.yaml").write_text(
        "name: j\nrun:\n  command: echo hi\n  health: {min_fraction: 0.6}\n  env: {CUDA_VISIBLE_DEVICES: '0,1', "
        "NCCL_P2P_DISABLE: '1', PATH: /opt/bin:/usr/bin, HF_TOKEN: secret}\n")
    job = load_job(tmp_path / "j.yaml").job

    class Conn:
        host = ResolvedHost(name="n", gpus=8)

    req = request(Conn(), job, None)  # type: ignore[arg-type]
    assert req["min_fraction"] == 0.6 and req["expect_gpus"] == 8 and req["job"] == "j"
    assert req["env"] == {"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_P2P_DISABLE": "1"}  # never the job's secrets
    assert req["path"] == "/opt/bin:/usr/bin"
