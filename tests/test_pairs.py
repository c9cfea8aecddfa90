"""The demo trainer's --dp-pairs mode on the CPU: every pair runs on "cpu", one thread per pair.

Runs orchestrator/demo/job/train.py in a subprocess with a tiny model and data set (written by
orchestrator.demo.data). Needs torch in the Python running the tests; without it every test skips.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

# torch is imported by the tests that use it, not at collection (2 s of CPU in every pytest-xdist worker)
if importlib.util.find_spec("torch") is None:
    pytest.skip("could not import 'torch': No module named 'torch'", allow_module_level=True)

from orchestrator.demo.data import write_data, write_model  # noqa: E402

TRAIN = Path(__file__).resolve().parents[1] / "orchestrator" / "demo" / "job" / "train.py"
SMALL = ["--batch-size", "4", "--seq-len", "64", "--width", "64", "--block-size", "4", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pairs-src")
    write_model(d / "model", vocab=128, d=32, layers=1, heads=2)
    write_data(d / "data", vocab=128, shards=2, tokens_per_shard=20_000)
    return d


def train(src: Path, out: Path, *args: str) -> tuple[int, str]:
    cmd = [sys.executable, str(TRAIN), "--device", "cpu", "--target-model", str(src / "model"),
           "--data-dir", str(src / "data"), "--output-dir", str(out), *SMALL, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return p.returncode, p.stdout + p.stderr


def losses(log: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+ loss ([0-9.]+) tok/s", log, re.M)]


def ckpt(out: Path) -> dict:
    import torch

    return torch.load(out / "ckpt-last.pt", map_location="cpu")


def test_two_pairs_train_in_threads_loss_falls_and_twice_the_tokens(src: Path, tmp_path: Path) -> None:
    rc2, log2 = train(src, tmp_path / "p2", "--dp-pairs", "2", "--max-steps", "40", "--log-interval", "5")
    assert rc2 == 0, log2
    assert "pairs: [('cpu', 'cpu'), ('cpu', 'cpu')]; tokens/step 512" in log2
    ls = losses(log2)
    assert len(ls) == 8, log2
    assert sum(ls[-2:]) / 2 < ls[0] - 0.1, ls   # it learns: the last losses are clearly below the first
    rc1, log1 = train(src, tmp_path / "p1", "--dp-pairs", "1", "--max-steps", "3", "--log-interval", "1")
    assert rc1 == 0, log1
    assert "tokens/step 256" in log1
    two, one = ckpt(tmp_path / "p2"), ckpt(tmp_path / "p1")
    assert (two["step"], two["dp_pairs"], one["step"], one["dp_pairs"]) == (40, 2, 3, 1)
    assert two["tokens"] / two["step"] == 2 * one["tokens"] / one["step"] == 2 * 256


def test_pairs_resume_from_checkpoint(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    rc, log = train(src, out, "--dp-pairs", "2", "--max-steps", "20", "--log-interval", "20", "--save-interval", "10")
    assert rc == 0, log
    first, before = losses(log)[-1], ckpt(out)
    assert (before["step"], before["tokens"]) == (20, 20 * 512)
    rc, log = train(src, out, "--dp-pairs", "2", "--max-steps", "30", "--log-interval", "1")
    assert rc == 0, log
    assert f"resumed from {out / 'ckpt-last.pt'} at step 20" in log
    steps = [int(s) for s in re.findall(r"^step (\d+) loss", log, re.M)]
    assert steps == list(range(21, 31)), log
    after = ckpt(out)
    assert (after["step"], after["tokens"]) == (30, 30 * 512)
    assert losses(log)[0] < first + 0.3   # it went on from the trained drafter, not from a fresh one (~4.85)
    assert int(after["opt"]["state"][0]["step"]) == 30   # AdamW's state came back too


def load_train():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("demo_train", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_grads_are_averaged_over_pairs_and_drafters_stay_equal() -> None:
    import torch

    train_mod = load_train()
    torch.manual_seed(0)
    base = train_mod.Drafter(8, 16, 2, 12)
    drafters = [train_mod.copy.deepcopy(base) for _ in range(3)]
    ref = train_mod.copy.deepcopy(base)
    xs = [torch.randn(5, 8) for _ in drafters]
    for d, x in zip(drafters, xs, strict=True):   # each pair sees its own data: different grads
        d(x).square().mean().backward()
    want = {n: torch.stack([dict(d.named_parameters())[n].grad for d in drafters]).mean(0)
            for n, _ in ref.named_parameters()}
    opt = torch.optim.AdamW(drafters[0].parameters(), lr=1e-2)
    train_mod.average_and_step(drafters, opt)
    for n, p in drafters[0].named_parameters():
        assert torch.allclose(p.grad, want[n], atol=1e-6), n
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)   # one optimizer stepping on the mean grad
    for n, p in ref.named_parameters():
        p.grad = want[n].clone()
    ref_opt.step()
    for d in drafters:
        for (n, p), q in zip(d.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), n   # every pair's drafter holds the master's new weights
    assert not torch.equal(next(ref.parameters()), next(base.parameters()))   # and they did change


def test_pair_devices_on_cpu() -> None:
    import torch

    train_mod = load_train()
    cpu = torch.device("cpu")
    assert train_mod.pair_devices(2, "cpu") == [(cpu, cpu), (cpu, cpu)]


def test_pairs_with_replicas_is_a_usage_error(src: Path, tmp_path: Path) -> None:
    rc, log = train(src, tmp_path / "x", "--dp-pairs", "2", "--dp-replicas", "2", "--max-steps", "1")
    assert rc == 2, log
    assert "--dp-pairs takes N >= 1 and does not combine with --dp-replicas" in log
