"""verify-env's probe of the node's GPUs (remote/env/probe.py nvidia): a fake nvidia-smi on PATH stands in
for the driver (this machine has none). The CUDA version comes from libcuda when it loads (no second
nvidia-smi: that one costs about 100 ms on an H200 node), else from nvidia-smi's header."""

from __future__ import annotations

from pathlib import Path

import pytest

from remote.env import probe

FAKE_SMI = """#!/bin/sh
echo "$*" >> {log}
case "$1" in
  --query-gpu=*) printf '0, NVIDIA H200, 143771, 9.0, 580.159.04\\n1, NVIDIA H200, 143771, 9.0, 580.159.04\\n';;
  "") printf '| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 12.4     |\\n';;
  *) exit 9;;
esac
"""


@pytest.fixture
def smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text(FAKE_SMI.format(log=log))
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    return log


def test_the_cuda_version_comes_from_libcuda_with_one_nvidia_smi(smi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "driver_cuda", lambda: "13.0")
    got = probe.nvidia()
    assert got["cuda"] == "13.0" and got["driver"] == "580.159.04" and len(got["gpus"]) == 2
    assert got["gpus"][1] == {"index": 1, "name": "NVIDIA H200", "memory": 143771 << 20, "capability": "9.0"}
    assert len(smi.read_text().splitlines()) == 1  # the query alone


def test_without_libcuda_nvidia_smis_header_says_it(smi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "driver_cuda", lambda: None)
    got = probe.nvidia()
    assert got["cuda"] == "12.4" and len(got["gpus"]) == 2
    assert sorted(smi.read_text().splitlines()) == ["", "--query-gpu=index,name,memory.total,compute_cap,"
                                                        "driver_version --format=csv,noheader,nounits"]


def test_the_driver_version_number_reads_as_cuda_writes_it() -> None:
    assert probe.cuda_str(13000) == "13.0" and probe.cuda_str(12040) == "12.4" and probe.cuda_str(11080) == "11.8"
    assert probe.cuda_str(12020) == "12.2" and probe.cuda_str(0) is None


def test_libcuda_absent_here_gives_none() -> None:
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has libcuda")
    assert probe.driver_cuda() is None


def test_no_nvidia_smi_is_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert probe.nvidia() == {"present": False, "gpus": []}
