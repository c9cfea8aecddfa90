"""GPU tests (need an NVIDIA GPU, torch and triton; skipped cleanly without them).

Run: ``python3 -m pytest -m gpu tests/test_gpu.py`` (bench/gpu/run_all.sh does, on the device).
The reproducers run in subprocesses so each starts with stock Triton (no guard installed).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

# no NVIDIA driver here (its device nodes; WSL2's is /dev/dxg): no GPU, without importing torch (2 s of
# CPU in every pytest-xdist worker at collection)
if not any(os.path.exists(dev) for dev in ("/dev/nvidiactl", "/dev/dxg")):  # pragma: no cover - by machine
    pytest.skip("no CUDA GPU", allow_module_level=True)
torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
if not torch.cuda.is_available():  # pragma: no cover - depends on the machine
    pytest.skip("no CUDA GPU", allow_module_level=True)

import triton.language as tl  # noqa: E402

from remote.gpu import autotune_guard  # noqa: E402
from remote.gpu.warmup import sequential_warmup  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
RACE = ROOT / "bench" / "gpu" / "autotune_race.py"


def _race(tmp_path: Path, *args: str, **env: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "race.jsonl"
    e = dict(os.environ)
    e.setdefault("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    e.update(env)
    r = subprocess.run([sys.executable, str(RACE), "--json", str(out), *args], cwd=ROOT, env=e,
                       capture_output=True, text=True, timeout=240)
    assert out.exists(), r.stdout[-2000:] + r.stderr[-2000:]
    return r.returncode, json.loads(out.read_text().splitlines()[-1])


def test_reproducer_fails_without_guard(tmp_path: Path) -> None:
    rc, s = _race(tmp_path, "--no-guard", "--trials", "3", "--scenarios", "crash,foreign")
    assert rc == 1
    assert s["counts"]["crash"]["type_error"] == 3  # 'NoneType' object is not a mapping, every time
    assert s["counts"]["foreign"]["foreign"] == 3  # hooks saw the other thread's tensors
    assert s["guard_installed"] is False


def test_reproducer_passes_with_guard(tmp_path: Path) -> None:
    rc, s = _race(tmp_path, "--guard", "--trials", "30", "--scenarios", "crash,foreign,realistic")
    assert rc == 0, s["examples"]
    for scenario in ("crash", "foreign", "realistic"):
        assert s["counts"][scenario] == {"passed": 30, "failed": 0, "type_error": 0, "foreign": 0, "other": 0}
    assert s["guard_stats"]["reused_after_wait"] >= 1  # realistic: one thread waited, then reused


def test_sitecustomize_installs_guard_in_an_unchanged_program(tmp_path: Path) -> None:
    log = tmp_path / "guard.jsonl"
    site = ROOT / "remote" / "gpu" / "sitecustomize_guard"
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    rc, s = _race(tmp_path, "--no-guard", "--trials", "5", "--scenarios", "crash,foreign",
                  PYTHONPATH=path, DFO_AUTOTUNE_GUARD_LOG=str(log))
    assert rc == 0 and s["guard_installed"] is True
    rec = json.loads(log.read_text().splitlines()[0])
    assert rec["installed"] is True and rec["verified"] is True and rec["triton"] == triton.__version__


@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b, w in ((256, 2), (1024, 4))],
                 key=["N"], restore_value=["acc"])
@triton.jit
def _accumulate(acc, x, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(acc + offs, tl.load(acc + offs, mask=mask) + tl.load(x + offs, mask=mask), mask=mask)


def _accumulate_call(acc: Any, x: Any) -> None:
    n = acc.numel()
    _accumulate[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](acc, x, n)


def test_restore_value_is_per_thread_under_the_guard() -> None:
    """restore_value clones ``acc`` before each benchmarked config and copies it back after:
    with the guard, each thread gets its own acc back, so acc == acc0 + x exactly once."""
    autotune_guard.install()
    errors: list[str] = []
    for trial in range(5):
        _accumulate.cache.clear()
        barrier = threading.Barrier(2)

        def body(seed: int, barrier: threading.Barrier = barrier) -> None:
            try:
                g = torch.Generator(device="cuda").manual_seed(seed)
                acc = torch.randn(1 << 16, device="cuda", generator=g)
                x = torch.randn(1 << 16, device="cuda", generator=g)
                want = acc + x
                barrier.wait(10)
                _accumulate_call(acc, x)
                torch.cuda.synchronize()
                if not torch.equal(acc, want):
                    errors.append(f"seed {seed}: acc is not acc0 + x")
            except Exception as exc:
                errors.append(f"seed {seed}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=body, args=(trial * 2 + i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert errors == []


def test_sequential_warmup_reports_what_it_tuned() -> None:
    acc = torch.zeros(4096, device="cuda")
    big = torch.zeros(8192, device="cuda")
    _accumulate.cache.clear()
    report = sequential_warmup({
        0: lambda: _accumulate_call(acc, torch.ones_like(acc)),
        "cuda:0": lambda: _accumulate_call(big, torch.ones_like(big)),
    })
    assert report["ok"] and [d["device"] for d in report["devices"]] == ["cuda:0", "cuda:0"]
    first, second = report["devices"]
    assert list(first["tuned"]) == ["_accumulate"] and "4096" in first["tuned"]["_accumulate"][0]
    assert first["tuned_keys"] == 1 and second["tuned_keys"] == 1 and "8192" in second["tuned"]["_accumulate"][0]
    assert float(acc[0]) == 1.0 and float(big[0]) == 1.0  # restore_value kept each call's effect single
    again = sequential_warmup({0: lambda: _accumulate_call(acc, torch.ones_like(acc))})
    assert again["devices"][0]["tuned_keys"] == 0  # nothing left to tune for that shape


def test_sequential_warmup_records_a_failure() -> None:
    def boom() -> None:
        raise RuntimeError("model failed")

    report = sequential_warmup({0: boom, "cuda:0": lambda: None})
    assert report["ok"] is False
    assert report["devices"][0]["error"] == "RuntimeError: model failed" and report["devices"][1]["ok"]


def test_preflight_reports_gpu_arch_and_kernel_checks() -> None:
    r = subprocess.run([sys.executable, "-m", "remote.gpu.preflight"], input=json.dumps({"fla": False}),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = [x for x in r.stdout.splitlines() if x.startswith("@@DFO-RESULT@@ ")][-1]
    data = json.loads(line.split(" ", 1)[1])["data"]
    assert len(data["gpus"]) == torch.cuda.device_count()
    gpu = data["gpus"][0]
    major, minor = torch.cuda.get_device_capability(0)
    assert gpu["capability"] == f"{major}.{minor}" and gpu["arch"] == f"sm_{major}{minor}"
    assert gpu["arch_in_build"] is True and gpu["triton_ok"] is True and gpu["fla_ok"] is None
    names = [c["name"] for c in gpu["checks"]]
    assert names == ["arch_in_build", "torch_op", "triton_kernel"] and all(c["ok"] for c in gpu["checks"])
    assert data["torch"] == torch.__version__ and data["arch_list"] == torch.cuda.get_arch_list()
