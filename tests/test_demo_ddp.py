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


def _stop_after(argv: list[str], seen: str, cwd: Path) -> tuple[int, str]:
    """Start the trainer (its own process group), SIGTERM the group once ``seen`` is in its output (a
    planned stop, as dfo stop sends it), and return (exit code, output)."""
    import signal
    import time

    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    out: list[str] = []
    deadline = time.monotonic() + 240
    assert p.stdout is not None
    for line in p.stdout:
        out.append(line)
        if seen in line:
            os.killpg(p.pid, signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(out)[-2000:]
    out.append(p.stdout.read())
    return p.wait(timeout=120), "".join(out)


def _last_logged(text: str, prefix: str = "") -> int:
    return max(int(s) for s in re.findall(rf"^{prefix}step (\d+) loss", text, re.M))


def test_a_planned_stop_saves_the_step_it_ended_on_and_the_next_run_resumes_there(demo: Path) -> None:
    """SIGTERM mid-run (dfo stop, a preemption notice): the step in progress ends, the checkpoint holds
    that step, exit 0; no step is lost (the next run resumes at it). One process, then 2 ranks under
    torchrun (both stop after the same step; rank 0 saves)."""
    import torch

    common = ["--target-model", str(demo / "model"), "--data-dir", str(demo / "data"), "--log-interval", "1",
              "--save-interval", "1000", "--batch-size", "4", "--seq-len", "64", "--max-steps", "100000"]
    rc, out = _stop_after([sys.executable, str(TRAIN), "--output-dir", str(demo / "stop1"), *common], "step 3 loss",
                          demo)
    assert rc == 0, out[-2000:]
    n = int(re.search(r"^stopping at step (\d+) on SIGTERM$", out, re.M).group(1))  # type: ignore[union-attr]
    assert n >= 3 and n == _last_logged(out), out[-2000:]
    assert torch.load(demo / "stop1" / "ckpt-last.pt", map_location="cpu")["step"] == n
    again = subprocess.run([sys.executable, str(TRAIN), "--output-dir", str(demo / "stop1"), *common[:-1],
                            str(n + 1)], capture_output=True, text=True, timeout=300, cwd=demo)
    assert again.returncode == 0 and f"at step {n}\n" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]

    rc, out = _stop_after([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(TRAIN), "--output-dir", str(demo / "stop2"), *common], "rank 0: step 3 loss", demo)
    stops = {int(r): int(s) for r, s in re.findall(r"^rank (\d): stopping at step (\d+) on SIGTERM$", out, re.M)}
    assert set(stops) == {0, 1} and stops[0] == stops[1], out[-3000:]
    n = stops[0]
    assert torch.load(demo / "stop2" / "ckpt-last.pt", map_location="cpu")["step"] == n, out[-3000:]
    assert _last_logged(out, r"rank 0: ") == n, out[-3000:]
    assert "rank 0: done" in out, out[-3000:]
