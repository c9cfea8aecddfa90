#!/usr/bin/env python3
"""Cost of the autotune guard on the cached fast path: time per call, guard off vs on.

Workloads, each already tuned (cached key) before timing:
* ``tiny``: a vector add (N=4096) autotuned over 4 configs: launch-bound, so the time per call
  is almost all Python/launch overhead, the worst case for any wrapper;
* ``fla BxTxH``: FLA ``chunk_gated_delta_rule`` forward (no grad), bf16, K=V=128, for the
  shapes in ``--fla-shapes`` (default 1x512x8, 4x4096x8, 16x16384x8: from launch-bound, where
  FLA's ~450 us of Python and launches per call dominate, to GPU-bound).

Variants, alternated round by round in one process (``install()``/``uninstall()``), so drift
hits all alike: ``off`` (stock Triton), ``on`` (the guard as installed on a verified Triton:
cached calls take the guard's own launch path), ``on-wrapper`` (the guard with
``fast_path=False``: every call goes through Triton's ``run``, as on a forced, unverified
version). Calls are issued back to back and synchronized once per round, as a trainer would.
Reported: median over rounds of the per-call time, and ratios to ``off``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from remote.gpu import autotune_guard  # noqa: E402

DEVICE = os.environ.get("DFO_BENCH_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: a dry run only


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _cpu_bench(fn: Callable[[], Any], quantiles: Any = None) -> list[float]:
    fn()
    return [1.0, 1.0, 1.0]


@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w)
                          for b, w in ((256, 2), (512, 4), (1024, 4), (2048, 8))],
                 key=["N"], do_bench=_cpu_bench if DEVICE == "cpu" else None)
@triton.jit
def tiny_add(x, y, out, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(out + offs, tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)


def tiny_work() -> Callable[[], Any]:
    n = 4096
    x, y = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    out = torch.empty_like(x)
    launch = tiny_add[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)]

    def call() -> None:
        launch(x, y, out, n)

    return call


def fla_work(B: int, T: int, H: int) -> Callable[[], Any]:
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    K = 128
    q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    k = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
    g = F.logsigmoid(torch.rand(B, T, H, device="cuda") + 2.0).to(torch.bfloat16)
    beta = torch.rand(B, T, H, device="cuda").sigmoid().to(torch.bfloat16)

    def call() -> None:
        with torch.no_grad():
            chunk_gated_delta_rule(q, k, v, g, beta)

    return call


def set_variant(name: str) -> None:
    autotune_guard.uninstall()
    if name == "on":
        autotune_guard.install()
    elif name == "on-wrapper":
        autotune_guard.install(fast_path=False)


def time_per_call(call: Callable[[], Any], n: int) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def measure(name: str, call: Callable[[], Any], n: int, rounds: int, variants: list[str]) -> dict[str, Any]:
    for v in variants:  # tune every key and warm every path first
        set_variant(v)
        for _ in range(3):
            call()
    sync()
    per: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds):
        order = variants if r % 2 == 0 else list(reversed(variants))
        for v in order:
            set_variant(v)
            per[v].append(time_per_call(call, n))
    set_variant("off")
    med = {v: statistics.median(xs) for v, xs in per.items()}
    out: dict[str, Any] = {"workload": name, "calls_per_round": n, "rounds": rounds,
                           "median_us": {v: round(m, 3) for v, m in med.items()},
                           "all_us": {v: [round(x, 3) for x in xs] for v, xs in per.items()}}
    for v in variants:
        if v != "off":
            out[f"ratio_{v}"] = round(med[v] / med["off"], 4)
            out[f"delta_us_{v}"] = round(med[v] - med["off"], 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--calls", type=int, default=20000, help="calls per round for the tiny kernel")
    ap.add_argument("--fla-shapes", default="1x512x8:500,4x4096x8:200,16x16384x8:20",
                    help="BxTxH:calls_per_round, comma-separated")
    ap.add_argument("--no-tiny", action="store_true")
    ap.add_argument("--json", help="append the summary as one JSON line to this file")
    args = ap.parse_args()
    variants = ["off", "on", "on-wrapper"]
    results = [] if args.no_tiny else [measure("tiny", tiny_work(), args.calls, args.rounds, variants)]
    fla_version = None
    if not args.no_fla:
        try:
            import fla
            fla_version = getattr(fla, "__version__", None)
        except ImportError:
            pass
        for item in (s for s in args.fla_shapes.split(",") if s.strip()) if fla_version is not None else []:
            shape, _, calls = item.partition(":")
            B, T, H = (int(v) for v in shape.split("x"))
            results.append(measure(f"fla B{B} T{T} H{H}", fla_work(B, T, H), int(calls or 100), args.rounds, variants))
            torch.cuda.empty_cache()
    summary = {"script": "guard_overhead.py", "torch": torch.__version__, "triton": triton.__version__,
               "fla": fla_version, "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
               "results": results}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:  # one compact line appended: several runs can share one file
        with open(args.json, "a") as f:
            f.write(json.dumps(summary, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
