#!/usr/bin/env python3
"""Reproducer: two threads running an FLA Gated DeltaNet layer (or op) on a cold autotune cache.

As in the incident: two "models" run their forward at the same time from a thread pool.
Here both threads share ONE GPU (the device tool lends one H200); on a real node each
thread would ``torch.cuda.set_device`` its own GPU. The race is in the Python objects
(Triton's ``Autotuner`` instances are module globals shared by every thread), so one GPU
shows it as well; the GPU timings of course interleave.

Cold start: TRITON_CACHE_AUTOTUNING=0, FLA_CACHE_RESULTS=0 and FLA_CACHE_MODE=disabled are set
before importing triton/fla, and every Autotuner's ``cache`` is cleared before each trial, so
each trial tunes every kernel again. The compiled kernels stay in memory (and in
TRITON_CACHE_DIR): only the first pass compiles.

``--bench-ms W,R`` makes Triton's default benchmarker use W ms warmup and R ms repetitions
instead of 25,100 (to fit many trials in a short GPU lease); ``--bench-ms default`` keeps
Triton's own.

Backward: FLA 0.6.0 refuses the gated backward on Hopper with triton >= 3.4.0, < 3.7.1
(FLA #640) unless tilelang is usable. A single-threaded probe (forward, then backward)
runs first; the trials include the backward only where the probe's backward ran.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

if "TRITON_CACHE_DIR" not in os.environ:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="dfo-fla-race-triton-")
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "0")
os.environ.setdefault("FLA_CACHE_RESULTS", "0")
os.environ.setdefault("FLA_CACHE_MODE", "disabled")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402


def set_bench_ms(spec: str) -> None:
    if spec == "default":
        return
    warm_ms, rep_ms = (int(v) for v in spec.split(","))
    original = triton.testing.do_bench

    def do_bench(fn: Any, warmup: int = 25, rep: int = 100, grad_to_none: Any = None,
                 quantiles: Any = None, return_mode: str = "mean") -> Any:
        return original(fn, warmup=warm_ms, rep=rep_ms, grad_to_none=grad_to_none, quantiles=quantiles,
                        return_mode=return_mode)

    triton.testing.do_bench = do_bench  # the NVIDIA driver imports it at each get_benchmarker()


def make_work(mode: str, seed: int, backward: bool) -> tuple[Callable[[], torch.Tensor], Any]:
    """A closure running one forward (and backward) for one 'model', and its module if any."""
    torch.manual_seed(seed)
    dev = torch.device("cuda", 0)
    if mode == "layer":
        from fla.layers import GatedDeltaNet

        layer = GatedDeltaNet(hidden_size=1024, head_dim=128, num_heads=8, expand_v=1.0, mode="chunk",
                              use_short_conv=True, use_gate=True, layer_idx=0)
        layer = layer.to(device=dev, dtype=torch.bfloat16)
        x = torch.randn(2, 1024, 1024, device=dev, dtype=torch.bfloat16)

        def run() -> torch.Tensor:
            with torch.cuda.device(dev):
                xi = x.clone().requires_grad_(backward)
                y = layer(xi)[0]
                if backward:
                    y.float().pow(2).mean().backward()
                    layer.zero_grad(set_to_none=True)
                return y.detach()

        return run, layer
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, T, H, K = 2, 1024, 8, 128  # H, K as in the preflight and overhead runs: compiled kernels are shared
    q = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K, device=dev, dtype=torch.float32), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, K, device=dev, dtype=torch.bfloat16)
    g = F.logsigmoid(torch.rand(B, T, H, device=dev) + 2.0).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device=dev).sigmoid().to(torch.bfloat16)

    def run_op() -> torch.Tensor:
        with torch.cuda.device(dev):
            ins = [t.clone().requires_grad_(backward) for t in (q, k, v, g, beta)]
            o, _ = chunk_gated_delta_rule(*ins)
            if backward:
                o.float().pow(2).mean().backward()
            return o.detach()

    return run_op, None


def autotuners() -> list[Any]:
    from remote.gpu.autotune_guard import autotuner_instances
    return autotuner_instances()


def _err(exc: BaseException) -> str:
    last = traceback.format_exc(limit=-1).strip().splitlines()
    return f"{type(exc).__name__}: {str(exc)[:300]} | {last[-3].strip() if len(last) >= 3 else ''}"


def _body(i: int, work: Callable[[], Any], barrier: threading.Barrier, outs: list[Any], errors: list[str]) -> None:
    try:
        barrier.wait(30)
        outs[i] = work()
    except BaseException as exc:  # recorded per trial
        errors.append(f"thread {i}: {_err(exc)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--guard", dest="guard", action="store_true", default=False)
    ap.add_argument("--no-guard", dest="guard", action="store_false")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--mode", choices=("layer", "op"), default="layer")
    ap.add_argument("--bench-ms", default="5,20")
    ap.add_argument("--time-budget", type=float, default=240.0, help="stop starting trials after this many s")
    ap.add_argument("--json", help="append the summary as one JSON line to this file")
    args = ap.parse_args()
    set_bench_ms(args.bench_ms)
    import fla

    guard_report = None
    if args.guard:
        from remote.gpu import autotune_guard
        guard_report = autotune_guard.install()

    # Probe, single-threaded: is the backward allowed here? (FLA #640)
    t0 = time.perf_counter()
    probe_run, _ = make_work(args.mode, 0, backward=True)
    backward_ok, backward_msg = True, "ran"
    try:
        probe_run()
    except RuntimeError as exc:
        if "#640" not in str(exc):
            raise
        backward_ok, backward_msg = False, str(exc).splitlines()[0]
    torch.cuda.synchronize()
    probe_s = time.perf_counter() - t0
    works = [make_work(args.mode, seed, backward_ok) for seed in (1, 2)]
    kernels = autotuners()
    # Reference outputs: each model once, single-threaded (its kernels now tuned).
    refs = [w[0]() for w in works]

    counts = {"passed": 0, "failed": 0, "type_error": 0, "other_error": 0, "wrong_output": 0}
    examples: list[str] = []
    trial_s: list[float] = []
    started = time.perf_counter()
    for _trial in range(args.trials):
        if time.perf_counter() - started > args.time_budget:
            break
        for kern in kernels:
            kern.cache.clear()
        barrier = threading.Barrier(2)
        errors: list[str] = []
        outs: list[Any] = [None, None]

        t1 = time.perf_counter()
        threads = [threading.Thread(target=_body, args=(i, works[i][0], barrier, outs, errors), name=f"model{i}")
                   for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        torch.cuda.synchronize()
        trial_s.append(round(time.perf_counter() - t1, 2))
        wrong = []
        for i in (0, 1):
            if outs[i] is not None:
                err = float((outs[i].float() - refs[i].float()).pow(2).mean().sqrt()
                            / refs[i].float().pow(2).mean().sqrt())
                if not err < 2e-2:
                    wrong.append(f"thread {i}: output differs from its single-threaded reference (rel RMS {err:.2e})")
        if any(t.is_alive() for t in threads):
            errors.append("a thread hung")
        ok = not errors and not wrong
        counts["passed" if ok else "failed"] += 1
        counts["type_error"] += any("TypeError" in e for e in errors)
        counts["other_error"] += any("TypeError" not in e for e in errors)
        counts["wrong_output"] += bool(wrong)
        if not ok and len(examples) < 4:
            examples.append("; ".join(errors + wrong))
    summary: dict[str, Any] = {
        "script": "fla_race.py", "mode": args.mode, "guard": args.guard,
        "trials_run": counts["passed"] + counts["failed"], "trials_asked": args.trials,
        "counts": counts, "examples": examples, "trial_seconds": trial_s,
        "backward_in_trials": backward_ok, "backward_probe": backward_msg,
        "probe_seconds": round(probe_s, 2), "autotuners": len(kernels),
        "autotuner_classes": sorted({type(k).__name__ for k in kernels}),
        "bench_ms": args.bench_ms, "torch": torch.__version__, "triton": triton.__version__,
        "fla": getattr(fla, "__version__", None), "gpu": torch.cuda.get_device_name(0),
        "threads_share_one_gpu": True, "guard_report": guard_report,
    }
    from remote.gpu import autotune_guard
    summary["guard_installed"] = autotune_guard.is_installed()
    summary["guard_stats"] = autotune_guard.stats() if args.guard else None
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if args.json:  # one compact line appended: several runs can share one file
        with open(args.json, "a") as f:
            f.write(json.dumps(summary, default=str) + "\n")
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
