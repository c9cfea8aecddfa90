"""The demo trainer under torchrun on the CPU (gloo): 2 ranks, one all-reduced loss, rank 0's
checkpoint, resume from it, and a rank that exits 1 ending the run. Needs torch in the Python
running the tests (bash .ci/setup --demo does not put it there: these tests skip without it)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# torch is imported by the tests that use it, not at collection (2 s of CPU in every pytest-xdist worker)
if importlib.util.find_spec("torch") is None:
    pytest.skip("could not import 'torch': No module named 'torch'", allow_module_level=True)

from orchestrator.demo.data import write_data, write_model  # noqa: E402

TRAIN = Path(__file__).resolve().parent.parent / "orchestrator" / "demo" / "job" / "train.py"


def torchrun(tmp: Path, out: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(TRAIN),
         "--target-model", str(tmp / "model"), "--data-dir", str(tmp / "data"), "--output-dir", str(tmp / out),
         "--log-interval", "5", "--save-interval", "10", "--batch-size", "4", "--seq-len", "64", *extra],
        capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("ddp")
    write_model(tmp / "model")
    write_data(tmp / "data", shards=2, tokens_per_shard=20000)
    return tmp


def losses(text: str) -> dict[int, dict[int, str]]:
    """{step: {rank: loss}} from the ranks' log lines."""
    out: dict[int, dict[int, str]] = {}
    for rank, step, loss in re.findall(r"rank (\d+): step (\d+) loss (\S+) \(all-reduced over 2 ranks\)", text):
        out.setdefault(int(step), {})[int(rank)] = loss
    return out


def test_ranks_log_one_all_reduced_loss_and_resume_from_rank0s_checkpoint(demo: Path) -> None:
    r = torchrun(demo, "out", "--max-steps", "20")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    seen = losses(r.stdout)
    assert sorted(seen) == [5, 10, 15, 20]
    for step, by_rank in seen.items():
        assert set(by_rank) == {0, 1} and by_rank[0] == by_rank[1], (step, by_rank)
    import torch

    assert torch.load(demo / "out" / "ckpt-last.pt", map_location="cpu")["step"] == 20
    again = torchrun(demo, "out", "--max-steps", "25")
    assert again.returncode == 0, again.stderr[-2000:]
    for rank in (0, 1):
        assert f"rank {rank}: resumed from {demo / 'out' / 'ckpt-last.pt'} at step 20" in again.stdout
    assert sorted(losses(again.stdout)) == [25]


def test_a_rank_that_exits_1_ends_the_run_non_zero(demo: Path) -> None:
    r = torchrun(demo, "out-fail", "--max-steps", "40", "--exit-at-step", "7", "--exit-rank", "1")
    assert r.returncode != 0
    assert "rank 1: exiting with 1 at step 7" in r.stdout
    assert "rank 0: done" not in r.stdout
