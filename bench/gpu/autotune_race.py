#!/usr/bin/env python3
"""Reproducer: Triton's Autotuner shared per-call state, called from two threads.

Cold start: a fresh TRITON_CACHE_DIR unless one is given, Triton's autotune disk cache off
(TRITON_CACHE_AUTOTUNING=0), and ``kernel.cache.clear()`` before every trial, so every trial
tunes. The kernel is a vector add autotuned over 8 configs (key N). Its ``do_bench`` runs the
config once, synchronizes and sleeps 1 ms (releases the GIL) and uses Events to order the
threads, so each failure mode is deterministic rather than a matter of luck:

* ``crash``: the main thread tunes N=4096; thread A tunes N=8192 and, inside its first
  benchmark, waits until thread B has made one cached N=4096 call. On stock Triton B's call
  ends with ``self.nargs = None`` and A's next ``_bench`` raises
  ``TypeError: 'NoneType' object is not a mapping`` (autotuner.py ``{**self.nargs, ...}``).
* ``foreign``: the same, but B's cached call is held *inside* its config pre_hook (after
  ``run`` set ``self.nargs`` to B's arguments) while A benchmarks its next config: A's hooks
  then receive B's tensors. An ownership assertion in every hook catches that.
* ``realistic``: two threads wait on a Barrier, then both call the same cold key (no Event
  ordering; ``sys.setswitchinterval(1e-6)``); as on two GPUs but here both on one GPU.

Every hook call checks that the ``x`` it receives belongs to the calling thread, and every
call's output is checked against ``x + y``. Exit status 0 when no trial failed.
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
from typing import Any

if "TRITON_CACHE_DIR" not in os.environ:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="dfo-race-triton-")
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# DFO_BENCH_DEVICE=cpu with TRITON_INTERPRET=1 runs the same logic on a CPU (a dry run
# of this script only: the interpreter is no evidence about GPU behaviour).
DEVICE = os.environ.get("DFO_BENCH_DEVICE", "cuda")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


OWNER: dict[int, int] = {}  # x.data_ptr() -> thread ident that owns it
FOREIGN: list[str] = []
EV: dict[str, threading.Event] = {n: threading.Event() for n in ("a_in_bench", "b_in_call", "a_checked", "b_done")}
MODE = {"scenario": "none"}
WAIT_S = 10.0


def _check_owner(where: str, nargs: dict[str, Any]) -> None:
    x = nargs.get("x")
    if x is None:
        return
    owner = OWNER.get(x.data_ptr())
    me = threading.get_ident()
    if owner is not None and owner != me:
        FOREIGN.append(f"{where}: thread {threading.current_thread().name} got the x of thread {owner}")


def _config_pre_hook(nargs: dict[str, Any]) -> None:
    _check_owner("config.pre_hook", nargs)
    name = threading.current_thread().name
    if MODE["scenario"] == "foreign":
        if name == "A" and EV["b_in_call"].is_set() and not EV["a_checked"].is_set():
            EV["a_checked"].set()
        elif name == "B" and not EV["b_in_call"].is_set():
            EV["b_in_call"].set()  # B's run() has set self.nargs = B's args; hold it there
            EV["a_checked"].wait(WAIT_S)


def _pre_hook(nargs: dict[str, Any], reset_only: bool = False) -> None:
    _check_owner("autotuner.pre_hook", nargs)


def _do_bench(call: Any, quantiles: Any = None) -> list[float]:
    call()
    sync()
    name = threading.current_thread().name
    if name == "A" and not EV["a_in_bench"].is_set():
        EV["a_in_bench"].set()
        if MODE["scenario"] == "crash":
            EV["b_done"].wait(WAIT_S)
        elif MODE["scenario"] == "foreign":
            EV["b_in_call"].wait(WAIT_S)
    time.sleep(0.001)
    return [1.0, 1.0, 1.0]


CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, pre_hook=_config_pre_hook)
           for b in (256, 512, 1024, 2048) for w in (2, 4)]


@triton.autotune(configs=CONFIGS, key=["N"], pre_hook=_pre_hook, do_bench=_do_bench)
@triton.jit
def add_kernel(x, y, out, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(out + offs, tl.load(x + offs, mask=mask) + tl.load(y + offs, mask=mask), mask=mask)


if DEVICE == "cpu":  # Triton's interpreter is not thread-safe: one kernel body at a time
    _interp_lock = threading.Lock()
    _interp_run = add_kernel.fn.run

    def _locked_run(*args: Any, **kwargs: Any) -> Any:
        with _interp_lock:
            return _interp_run(*args, **kwargs)

    add_kernel.fn.run = _locked_run


def call(n: int) -> None:
    """One kernel call on this thread's own tensors; raises on a wrong result."""
    x = torch.randn(n, device=DEVICE)
    y = torch.randn(n, device=DEVICE)
    out = torch.empty_like(x)
    OWNER[x.data_ptr()] = threading.get_ident()
    try:
        add_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, out, n)
        sync()
        if not torch.equal(out, x + y):
            raise AssertionError(f"wrong result for N={n}")
    finally:
        OWNER.pop(x.data_ptr(), None)


def _thread(name: str, fn: Any, errors: list[str]) -> threading.Thread:
    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # recorded per trial
            where = traceback.format_exc(limit=-1).strip().splitlines()[-3].strip()
            errors.append(f"{name}: {type(exc).__name__}: {exc} | {where}")
    return threading.Thread(target=body, name=name)


def trial(scenario: str) -> dict[str, Any]:
    add_kernel.cache.clear()
    for ev in EV.values():
        ev.clear()
    FOREIGN.clear()
    errors: list[str] = []
    MODE["scenario"] = scenario
    t0 = time.perf_counter()
    if scenario in ("crash", "foreign"):
        MODE["scenario"] = "none"
        call(4096)  # the main thread tunes N=4096: B's call below is a cached one
        MODE["scenario"] = scenario

        def b() -> None:
            if not EV["a_in_bench"].wait(WAIT_S):
                raise TimeoutError("A never reached its benchmark")
            call(4096)
            EV["b_done"].set()

        threads = [_thread("A", lambda: call(8192), errors), _thread("B", b, errors)]
    else:
        barrier = threading.Barrier(2)

        def both() -> None:
            barrier.wait(WAIT_S)
            call(1 << 16)

        threads = [_thread("A", both, errors), _thread("B", both, errors)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        errors.append(f"hung threads: {hung}")
    MODE["scenario"] = "none"
    return {"scenario": scenario, "ok": not errors and not FOREIGN, "errors": errors,
            "foreign": list(FOREIGN), "seconds": round(time.perf_counter() - t0, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--guard", dest="guard", action="store_true", default=False)
    ap.add_argument("--no-guard", dest="guard", action="store_false")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--scenarios", default="crash,foreign",
                    help="comma-separated: crash, foreign, realistic (each trial runs each)")
    ap.add_argument("--json", help="append the summary as one JSON line to this file")
    args = ap.parse_args()
    if "realistic" in args.scenarios:
        sys.setswitchinterval(1e-6)
    guard_report = None
    if args.guard:
        from remote.gpu import autotune_guard
        guard_report = autotune_guard.install()
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    counts = {s: {"passed": 0, "failed": 0, "type_error": 0, "foreign": 0, "other": 0} for s in scenarios}
    examples: dict[str, list[str]] = {s: [] for s in scenarios}
    t0 = time.perf_counter()
    for _ in range(args.trials):
        for s in scenarios:
            r = trial(s)
            c = counts[s]
            c["passed" if r["ok"] else "failed"] += 1
            c["type_error"] += any("TypeError" in e for e in r["errors"])
            c["foreign"] += bool(r["foreign"])
            c["other"] += any("TypeError" not in e for e in r["errors"])
            if not r["ok"] and len(examples[s]) < 3:
                examples[s].append("; ".join(r["errors"] + r["foreign"][:2]))
    summary: dict[str, Any] = {
        "script": "autotune_race.py", "guard": args.guard, "trials": args.trials,
        "torch": torch.__version__, "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
        "triton_cache_dir": os.environ["TRITON_CACHE_DIR"],
        "counts": counts, "examples": examples, "seconds": round(time.perf_counter() - t0, 2),
        "guard_report": guard_report,
    }
    from remote.gpu import autotune_guard
    summary["guard_installed"] = autotune_guard.is_installed()  # also true when a sitecustomize did it
    summary["guard_stats"] = autotune_guard.stats() if args.guard else None
    text = json.dumps(summary, indent=1, default=str)
    print(text)
    if args.json:  # one compact line appended: several runs can share one file
        with open(args.json, "a") as f:
            f.write(json.dumps(summary, default=str) + "\n")
    return 0 if all(c["failed"] == 0 for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
