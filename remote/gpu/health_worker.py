"""One GPU's measurements for the health gate: ``python -m remote.gpu.health_worker INDEX`` (the job's
python, which has torch; one process per GPU, started by remote/gpu/health.py).

It imports torch, takes GPU INDEX (torch's numbering, after CUDA_VISIBLE_DEVICES) and says hello; then
it answers one JSON request per stdin line with one ``@@DFO-HW@@ {json}`` line, until ``exit`` or the end
of stdin. Ops: ``link`` (pinned host<->device copies), ``compute`` (bf16 matmuls for some seconds, then a
device-to-device copy; it says ``started`` first, so the parent reads nvidia-smi under load), ``p2p`` (the
peer-access matrix), ``nccl`` (an all-reduce over every rank, nccl-tests' bus bandwidth). A failed op
answers ``{"error": ...}`` and the worker goes on.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

PREFIX = "@@DFO-HW@@ "


def reply(obj: Dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _timed(torch: Any, fn: Callable[[], Any], iters: int) -> float:
    """Seconds for ``iters`` calls of ``fn`` on the current stream, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def hello(index: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    import torch

    out: Dict[str, Any] = {"hello": True, "index": index, "torch": torch.__version__,
                           "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}
    out["count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out["import_s"] = round(time.perf_counter() - t0, 3)
    if index >= out["count"]:
        out["visible"] = False
        return out
    torch.cuda.set_device(index)
    p = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)  # the context is made here
    uuid = getattr(p, "uuid", None)
    bus = None
    if all(hasattr(p, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = "%04x:%02x:%02x" % (p.pci_domain_id, p.pci_bus_id, p.pci_device_id)
    out.update(visible=True, name=p.name, uuid=str(uuid) if uuid is not None else None, bus=bus,
               capability="%d.%d" % (p.major, p.minor), sms=p.multi_processor_count,
               free_mib=round(free / 1048576.0), total_mib=round(total / 1048576.0),
               init_s=round(time.perf_counter() - t0, 3))
    return out


def link(index: int, req: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    nbytes, iters = int(req.get("bytes") or 256 << 20), int(req.get("iters") or 5)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
    dev.copy_(host, non_blocking=True)
    host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize(index)
    h2d = _timed(torch, lambda: dev.copy_(host, non_blocking=True), iters)
    d2h = _timed(torch, lambda: host.copy_(dev, non_blocking=True), iters)
    return {"h2d_gbps": round(nbytes * iters / h2d / 1e9, 2), "d2h_gbps": round(nbytes * iters / d2h / 1e9, 2),
            "bytes": nbytes}


def _matmul(index: int, n: int, seconds: float) -> List[float]:
    """bf16 matmul TFLOPS of each batch of 10 products, for ``seconds`` (3 batches at least)."""
    import torch

    device = torch.device("cuda", index)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize(index)
    reply({"started": True})
    rates: List[float] = []
    batch = 10
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or len(rates) < 3:
        t = _timed(torch, lambda: torch.matmul(a, b, out=c), batch)
        rates.append(2.0 * n ** 3 * batch / t / 1e12)
    return sorted(rates)


def _copy(index: int, want: int) -> Dict[str, Any]:
    """Device-to-device copy bandwidth, bytes read and written: 2 x size x 10 / time."""
    import torch

    free = torch.cuda.mem_get_info(index)[0]
    nbytes = min(want, int(free * 0.25)) // (1 << 20) * (1 << 20)
    x = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize(index)
    t = _timed(torch, lambda: y.copy_(x), 10)
    return {"hbm_copy_tbps": round(2.0 * nbytes * 10 / t / 1e12, 3), "copy_bytes": nbytes}


def compute(index: int, req: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    n = int(req.get("n") or 8192)
    rates = _matmul(index, n, float(req.get("seconds") or 3.0))
    out: Dict[str, Any] = {"matmul_bf16_tflops": round(rates[len(rates) // 2], 1), "matmul_min": round(rates[0], 1),
                           "matmul_max": round(rates[-1], 1), "matmul_batches": len(rates), "matmul_n": n}
    try:
        out.update(_copy(index, int(req.get("copy_bytes") or 1 << 30)))
    except Exception as exc:  # out of memory (someone holds it): the figure is missing, the matmul stands
        out["copy_error"] = "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[0][:300])
    torch.cuda.empty_cache()
    return out


def p2p(index: int, req: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    n = torch.cuda.device_count()
    return {"p2p": [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)] for i in range(n)]}


def nccl(index: int, req: Dict[str, Any]) -> Dict[str, Any]:
    """All-reduce (sum, float32) of ``bytes`` over ``world`` ranks, one per GPU: algbw = bytes / time,
    busbw = algbw x 2(n-1)/n (nccl-tests' definition for all-reduce)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(req["rank"]), int(req["world"])
    device = torch.device("cuda", index)
    kw: Dict[str, Any] = {"init_method": "tcp://127.0.0.1:%d" % int(req["port"]), "rank": rank,
                          "world_size": world, "timeout": timedelta(seconds=float(req.get("timeout") or 30))}
    try:
        dist.init_process_group("nccl", device_id=device, **kw)
    except TypeError:  # torch before 2.3 has no device_id
        dist.init_process_group("nccl", **kw)
    try:
        free = torch.cuda.mem_get_info(index)[0]
        nbytes = min(int(req.get("bytes") or 1 << 30), int(free * 0.3)) // 4 * 4
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dist.all_reduce(x)
        torch.cuda.synchronize(index)
        right = float(x[0].item()) == float(world)
        for _ in range(2):
            dist.all_reduce(x)
        iters = int(req.get("iters") or 10)
        dist.barrier()
        t = _timed(torch, lambda: dist.all_reduce(x), iters) / iters
        algbw = nbytes / t / 1e9
        return {"bytes": nbytes, "ranks": world, "seconds": t, "algbw_gbps": round(algbw, 2),
                "busbw_gbps": round(algbw * 2.0 * (world - 1) / world, 2), "sum_right": right}
    finally:
        dist.destroy_process_group()


OPS: Dict[str, Callable[[int, Dict[str, Any]], Dict[str, Any]]] = {
    "link": link, "compute": compute, "p2p": p2p, "nccl": nccl}


def main(argv: List[str]) -> int:
    index = int(argv[1])
    try:
        info = hello(index)
    except Exception as exc:  # torch missing or broken: said, not a traceback
        reply({"hello": True, "index": index, "error": "%s: %s" % (type(exc).__name__, exc)})
        return 0
    reply(info)
    if not info.get("visible"):
        return 0
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        op = req.get("op")
        if op == "exit":
            break
        fn = OPS.get(op)
        try:
            out = fn(index, req) if fn else {"error": "unknown op %r" % (op,)}
        except Exception as exc:
            text = str(exc).strip()
            out = {"error": "%s: %s" % (type(exc).__name__, text.splitlines()[0][:300] if text else "")}
        reply(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
