"""The GPU health gate's measurements on a real GPU (remote/gpu/health.py, health_worker.py): a healthy GPU
passes with every figure judged, and three faults made with processes only are caught: another tenant's
matmuls, a process holding most of the memory, CUDA_VISIBLE_DEVICES hiding the GPUs. Plus the all-reduce
op on one rank (the only NCCL this one-GPU machine can run; the N-GPU all-reduce needs N GPUs).

Run on a GPU machine: ``python3 -m pytest -q tests/test_gpu_health.py`` (bench/gpu/health_device.sh does).
Without an NVIDIA driver here (CI) the module skips with the reason tests/allowed_skips.txt lists.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if not any(os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/dxg")):  # pragma: no cover - by machine
    pytest.skip("no NVIDIA GPU here: the health gate's measurements run on GPU machines", allow_module_level=True)

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
FAST = {"matmul_seconds": 1.5, "link_bytes": 128 << 20, "copy_bytes": 512 << 20}


def gate(request: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    r = subprocess.run([sys.executable, "-m", "remote.gpu.health"], input=json.dumps(request) + "\n", cwd=ROOT,
                       env=e, capture_output=True, text=True, timeout=180)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("@@DFO-RESULT@@ "))
    doc = json.loads(line.split(" ", 1)[1])
    assert doc["ok"], doc
    return dict(doc["data"])


def fails(data: dict[str, Any]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for c in data["checks"]:
        if c["verdict"] == "fail":
            out.setdefault(c["check"], []).append(c["message"])
    return out


@pytest.fixture
def fault() -> Iterator[Any]:
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, str(ROOT / "bench" / "gpu" / "health_faults.py"), *args],
                             stdout=subprocess.PIPE, text=True)
        procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline()  # "ready: ..." once the fault is in place
        assert line.startswith("ready"), line
        time.sleep(1.0)  # nvidia-smi's utilisation is an average over its last sample period
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_healthy_gpu_passes_with_each_figure_judged() -> None:
    d = gate(dict(FAST))
    assert d["ok"], fails(d)
    assert d["seconds"] < 60
    for g in d["gpus"]:
        for fig in ("matmul_bf16_tflops", "hbm_copy_tbps", "h2d_gbps", "d2h_gbps"):
            c = next(c for c in d["checks"] if c["check"] == fig and c["gpu"] == g["index"])
            assert c["value"] and c["value"] > 0, c
            assert c["verdict"] == ("pass" if g["model"] else "info"), c
    names = {c["check"] for c in d["checks"]}
    assert {"processes", "memory_in_use", "ecc", "xid", "reset_state", "power_limit", "throttle", "pcie_link"} <= names


def test_another_tenants_matmuls_fail_the_gate(fault: Any) -> None:
    fault("matmul")
    f = fails(gate(dict(FAST)))
    assert "processes" in f or "busy_before" in f, f  # someone else on the GPU, named
    assert "matmul_bf16_tflops" in f, f  # and our share of the GPU is what it would be for the job


def test_a_process_holding_the_memory_fails_the_gate(fault: Any) -> None:
    fault("hold", "0.9")
    f = fails(gate(dict(FAST)))
    assert "memory_in_use" in f, f
    assert "GiB in use before the gate" in f["memory_in_use"][0]


def test_cuda_visible_devices_hiding_the_gpus_fails_the_gate() -> None:
    d = gate(dict(FAST), env={"CUDA_VISIBLE_DEVICES": ""})
    f = fails(d)
    assert "gpus_visible" in f and "CUDA_VISIBLE_DEVICES=''" in f["gpus_visible"][0], f
    # the job's own run.env may set it too: the request's env wins over the login shell's
    d = gate(dict(FAST, measure=True, env={"CUDA_VISIBLE_DEVICES": "99"}))
    assert "gpus_visible" in fails(d)


def test_the_all_reduce_op_runs_on_one_rank() -> None:
    """NCCL through the worker as the gate drives it, world size 1: the sum is right; busbw is 0 by
    nccl-tests' definition (2(n-1)/n), so only the mechanics are checked here."""
    import socket

    from remote.gpu.health_worker import PREFIX

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "remote.gpu.health_worker", "0"], cwd=ROOT, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="0"),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdin is not None and p.stdout is not None
        out = p.stdout

        def reply() -> dict[str, Any]:
            while True:
                line = out.readline()
                assert line, "the worker ended"
                if line.startswith(PREFIX):
                    return dict(json.loads(line[len(PREFIX):]))
        assert reply()["visible"] is True
        p.stdin.write(json.dumps({"op": "nccl", "rank": 0, "world": 1, "port": port, "bytes": 64 << 20}) + "\n")
        p.stdin.flush()
        r = reply()
        assert r.get("sum_right") is True and r["busbw_gbps"] == 0 and r["algbw_gbps"] > 0, r
    finally:
        p.kill()
        p.wait()
