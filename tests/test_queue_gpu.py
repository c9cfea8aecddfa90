"""dfo submit on a real GPU machine (issue 36): one node (this machine, ``transport: local``), runs that each
take one GPU, one more than it has, so the last waits in the queue; each run sees exactly its GPU
(torch.cuda.device_count() == 1 inside it) and no two runs share one.

Needs an NVIDIA GPU and torch with CUDA in the interpreter that runs the tests (the runs use it too);
skipped otherwise, for the reason tests/allowed_skips.txt lists ("no CUDA GPU").
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import yaml

if not any(os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/dxg")):  # pragma: no cover - by machine
    pytest.skip("no CUDA GPU", allow_module_level=True)
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # pragma: no cover - by machine
    pytest.skip("no CUDA GPU", allow_module_level=True)

from tests._cli import cli_env  # noqa: E402
from tests._cli import dfo as run_dfo  # noqa: E402

pytestmark = pytest.mark.gpu

PROBE = """\
import os, sys, time, torch
n = torch.cuda.device_count()
x = torch.ones(1 << 20, device="cuda")  # holds the GPU: nvidia-smi shows the process on it
print("CUDA_VISIBLE_DEVICES=%s device_count=%d name=%s" % (os.environ.get("CUDA_VISIBLE_DEVICES"), n,
      torch.cuda.get_device_name(0)), flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(0 if n == 1 else 3)
"""


def test_each_queued_run_sees_only_its_gpu(tmp_path: Path) -> None:
    gpus = torch.cuda.device_count()
    ws = tmp_path / "ws"
    inv = tmp_path / "inventory.yaml"  # no gpus: here: the node's count is nvidia-smi's
    inv.write_text(yaml.safe_dump({"defaults": {"known_hosts": str(tmp_path / "kh")},
                                   "hosts": {"gpu": {"transport": "local", "workspace": str(ws)}}}))
    (tmp_path / "probe.py").write_text(PROBE)
    job = tmp_path / "probe.yaml"
    job.write_text(yaml.safe_dump({"name": "probe", "venv": sys.prefix, "run": {
        "workdir": str(tmp_path / "wd"), "upload": ["probe.py"], "gpus": 1, "wait": 0,
        "command": "{python} probe.py 3"}}))
    env = cli_env(XDG_STATE_HOME=str(tmp_path / "state"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    placed = []
    for _ in range(gpus + 1):
        r = run_dfo(inv, "submit", "-H", "gpu", "-j", str(job), "--json", env=env)
        assert r.returncode == 0, r.stderr
        placed.append(json.loads(r.stdout)["hosts"]["gpu"]["runs"][0])
    assert [p["state"] for p in placed] == ["running"] * gpus + ["queued"]
    assert sorted(p["gpus"][0] for p in placed[:gpus]) == list(range(gpus))
    runs = ws / ".dfo" / "runs"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not all((runs / p["run"] / "end.json").exists() for p in placed):
        time.sleep(0.5)
    spans = []
    for p in placed:
        meta = json.loads((runs / p["run"] / "meta.json").read_text())
        end = json.loads((runs / p["run"] / "end.json").read_text())
        line = (runs / p["run"] / "log").read_text().splitlines()[0]
        assert end["exit_code"] == 0, line
        assert f"CUDA_VISIBLE_DEVICES={meta['gpus'][0]} device_count=1 " in line
        spans.append((meta["gpus"][0], meta["started_ts"], end["ended_ts"]))
    last = spans[-1]
    assert last[1] >= min(e for g, _, e in spans[:-1] if g == last[0])  # it waited for its GPU to be given back
    for g in range(gpus):
        mine = sorted((s, e) for gg, s, e in spans if gg == g)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(mine, mine[1:], strict=False))
