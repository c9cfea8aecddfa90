"""Sequential warmup: tune every autotune key once, one device after another.

A trainer that will run per-device work in threads (one forward per GPU pair, say) calls::

    from remote.gpu.warmup import sequential_warmup
    report = sequential_warmup({0: lambda: model_a(batch_a), 2: lambda: model_b(batch_b)})

before starting its threads. Each callable runs once, on its device (``torch.cuda.device``),
followed by ``torch.cuda.synchronize``; the report says how long each took and which
``(kernel, key)`` pairs each one tuned (a diff of every Triton ``Autotuner``'s ``cache``),
so the run log shows that the threads start with nothing left to tune for these shapes.
A shape seen only later (a new batch size, a longer sequence) still tunes inside the
threads: that is what ``remote.gpu.autotune_guard`` makes safe.

Import cost: stdlib only at import time; torch and triton are imported when called.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple


def _kernel_name(kernel: Any) -> str:
    base = getattr(kernel, "base_fn", None)
    name = getattr(base, "__name__", None)
    if name is None:
        fn = getattr(kernel, "fn", None)
        name = getattr(fn, "__name__", None) or type(kernel).__name__
    return str(name)


def _snapshot() -> Dict[int, Tuple[Any, Set[Any]]]:
    from remote.gpu.autotune_guard import autotuner_instances

    snap: Dict[int, Tuple[Any, Set[Any]]] = {}
    for kernel in autotuner_instances():
        try:
            snap[id(kernel)] = (kernel, set(dict(kernel.cache).keys()))
        except Exception:  # a cache with unhashable keys: skip the kernel, never fail warmup
            continue
    return snap


def tuned_between(before: Dict[int, Tuple[Any, Set[Any]]], after: Dict[int, Tuple[Any, Set[Any]]]
                  ) -> Dict[str, List[str]]:
    """The autotuner cache keys new in ``after`` (snapshots: id -> (kernel, keys)), by kernel name."""
    tuned: Dict[str, List[str]] = {}
    for ident, (kernel, keys) in after.items():
        old = before.get(ident, (kernel, set()))[1]
        new = keys - old
        if new:
            tuned.setdefault(_kernel_name(kernel), []).extend(sorted(repr(k) for k in new))
    return tuned


def _device_label(device: Any) -> str:
    if isinstance(device, int):
        return "cuda:%d" % device
    return str(device)


def sequential_warmup(
    callables_by_device: Mapping[Any, Callable[[], Any]],
    stop_on_error: bool = False,
    emit: Optional[Callable[[Dict[str, Any]], None]] = None,
) -> Dict[str, Any]:
    """Run each callable once, one device after another, and report what got tuned.

    ``callables_by_device`` maps a device (int index, "cuda:1" or torch.device) to a
    callable taking no argument. A callable that raises is recorded (``ok: false``) and the
    next device still runs, unless ``stop_on_error``. ``emit`` gets one dict per device as
    it finishes (progress for a log). Returns::

        {"ok": bool, "seconds": float, "kernels": int, "guard_installed": bool,
         "devices": [{"device": "cuda:0", "ok": bool, "error": str|None, "seconds": float,
                      "tuned": {"kernel_name": ["(4096, 'torch.float32')", ...]},
                      "tuned_keys": int}]}
    """
    import torch

    from remote.gpu import autotune_guard

    started = time.perf_counter()
    devices: List[Dict[str, Any]] = []
    before = _snapshot()
    for device, fn in callables_by_device.items():
        dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        entry: Dict[str, Any] = {"device": _device_label(device), "ok": True, "error": None}
        t0 = time.perf_counter()
        try:
            with torch.cuda.device(dev):
                fn()
                torch.cuda.synchronize(dev)
        except Exception as exc:  # reported, not raised: the caller decides
            entry["ok"] = False
            entry["error"] = "%s: %s" % (type(exc).__name__, exc)
        entry["seconds"] = round(time.perf_counter() - t0, 4)
        after = _snapshot()
        entry["tuned"] = tuned_between(before, after)
        entry["tuned_keys"] = sum(len(v) for v in entry["tuned"].values())
        before = after
        devices.append(entry)
        if emit is not None:
            emit(dict(entry))
        if not entry["ok"] and stop_on_error:
            break
    return {
        "ok": all(d["ok"] for d in devices),
        "seconds": round(time.perf_counter() - started, 4),
        "kernels": len(before),
        "guard_installed": autotune_guard.is_installed(),
        "devices": devices,
    }
