"""The GPU health gate, controller side: ``verify-env --health``, ``run.health`` before ``up`` and ``launch``
launch, and before a spare takes a lost node's place (steps/recovery.py).

The node runs remote/gpu/health.py with the job's python (torch measures; nvidia-smi and the kernel
log say the rest) and returns every check with its verdict. A failed check stops the launch: exit 3,
naming the host, the GPU, the figure and the value it should have. The last verdict per host is kept on
this machine (dfo's cache folder, ``health/``): ``dfo top`` and ``dfo report`` show it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from remote.lib.fsutil import write_atomic

from .. import cache_dir
from ..agent import NODE, run_module
from ..config.health import HealthConfig
from ..errors import DfoError, VerifyError

if TYPE_CHECKING:
    from ..config.models import Job, LoadedJob, ResolvedHost
    from ..hosts import HostSession
    from ..transport.base import Transport

PASS_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")  # with NCCL_*: the job's run.env the gate runs under
SHOWN = 6  # failed checks named in one error, per host


def request(conn: Transport, job: Job | None, cfg: HealthConfig | None) -> dict[str, Any]:
    """What the node's gate is asked: the thresholds, the inventory's GPU count, the job's name (its runs'
    processes are its own) and the part of run.env that decides which GPUs and links the trainer gets."""
    cfg = cfg or (job.run.health if job and job.run else None) or HealthConfig()
    env = dict(job.run.env) if job and job.run else {}
    req = cfg.request()
    req.update(job=job.name if job else None, expect_gpus=conn.host.gpus,
               env={k: v for k, v in env.items() if k in PASS_ENV or k.startswith("NCCL_")},
               path=env.get("PATH"))
    return req


def run_gate(conn: Transport, job: Job | None, cfg: HealthConfig | None = None, python: str | None = None
             ) -> dict[str, Any]:
    """The node's gate (its data: ok, checks, gpus, phases...), recorded as this host's last verdict."""
    req = request(conn, job, cfg)
    py = python or (job.venv_python if job is not None else conn.host.python)
    data = run_module(conn, NODE.gpu_health, req, python=py, timeout=float(req["seconds"]) + 60)
    if not isinstance(data, dict) or not isinstance(data.get("checks"), list):
        raise VerifyError("the health gate gave no checks", host=conn.name)
    remember(conn.host, data)
    return data


def failures(data: dict[str, Any]) -> list[str]:
    return [str(c.get("message")) for c in data.get("checks") or [] if c.get("verdict") == "fail"]


def verdict_line(data: dict[str, Any]) -> str:
    """``healthy (4 GPUs, 23.1 s)`` or ``FAILED: first failure (+2 more)``."""
    bad = failures(data)
    n = len(data.get("gpus") or [])
    if not bad:
        return f"healthy ({n} GPU{'s' if n != 1 else ''}, {float(data.get('seconds') or 0):.1f}s)"
    more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
    return f"FAILED: {bad[0]}{more}"


def gate(sess: HostSession, loaded: LoadedJob, names: list[str], say: Callable[[str], None] | None = None) -> None:
    """run.health on ``names`` at once; nothing when the job has no run.health. A host that fails raises
    VerifyError (exit 3) naming, for every host that failed, each GPU, figure and expected value."""
    run = loaded.job.run
    if run is None or run.health is None or not names:
        return
    cfg = run.health
    if say is not None:
        say(f"checking the GPUs of {', '.join(names)} (run.health; up to {cfg.seconds:.0f}s)")
    outs = sess.each(lambda conn: run_gate(conn, loaded.job, cfg), names=names)
    for o in outs:
        if o.error is not None:
            raise o.error  # unreachable (exit 4), or the gate could not run there
    bad: list[str] = []
    for o in outs:
        assert o.value is not None
        if say is not None:
            say(f"{o.host}: {verdict_line(o.value)}")
        fails = failures(o.value)
        bad += [f"{o.host}: {m}" for m in fails[:SHOWN]]
        if len(fails) > SHOWN:
            bad.append(f"{o.host}: and {len(fails) - SHOWN} more")
    if bad:
        hosts = " ".join(f"-H {h}" for h in names)
        raise VerifyError("the GPU health gate (run.health) failed: " + "; ".join(bad),
                          hint=f"every figure: dfo verify-env {hosts} -j {loaded.path} --health; run.health's "
                               "thresholds: docs/gpu.md")


def gate_spare(conn: Transport, loaded: LoadedJob, say: Callable[[str], None]) -> bool:
    """The recovery watcher's gate on a spare (after its parity): True when it passes or the job has no
    run.health; False (said, with the failures) when the spare must be set aside for the next one."""
    run = loaded.job.run
    if run is None or run.health is None:
        return True
    try:
        data = run_gate(conn, loaded.job, run.health)
    except DfoError as exc:
        say(f"watch: spare {conn.name}: the health gate could not run ({exc.message}); it is set aside")
        return False
    if data.get("ok"):
        say(f"watch: spare {conn.name}: health gate passed ({verdict_line(data)})")
        return True
    say(f"watch: spare {conn.name} failed the health gate: {'; '.join(failures(data)[:SHOWN])}; it is set aside")
    return False


# --------------------------------------------------------------------------- the last verdict per host


def _record_path(host: ResolvedHost) -> Any:
    key = f"{host.user or ''}@{host.hostname}:{host.port}/{host.name}"
    return cache_dir() / "health" / (hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:20]
                                     + ".json")


def remember(host: ResolvedHost, data: dict[str, Any]) -> None:
    """Keep the gate's verdict for ``dfo top`` and ``dfo report`` (a short summary, not the node's text)."""
    doc = {"host": host.name, "time": time.time(), "ok": bool(data.get("ok")), "line": verdict_line(data),
           "seconds": data.get("seconds"), "fails": failures(data)[:SHOWN]}
    path = _record_path(host)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(str(path), json.dumps(doc).encode())
    except OSError:
        pass  # no record: top and report show none


def last_verdict(host: ResolvedHost) -> dict[str, Any] | None:
    """The host's last gate verdict as this machine recorded it: {ok, line, time, fails}; None: none."""
    try:
        doc = json.loads(_record_path(host).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("host") != host.name or not isinstance(doc.get("line"), str):
        return None
    return doc


def age(doc: dict[str, Any]) -> str:
    s = max(0.0, time.time() - float(doc.get("time") or 0))
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.0f}h" if s < 172800 \
        else f"{s / 86400:.0f}d"


def brief(host: ResolvedHost) -> dict[str, Any] | None:
    """The last verdict for ``dfo top`` and ``dfo report`` (their --json's "health"): ok, line, time, age."""
    doc = last_verdict(host)
    if doc is None:
        return None
    return {"ok": bool(doc.get("ok")), "line": doc["line"], "time": float(doc.get("time") or 0), "age": age(doc)}


def brief_text(b: dict[str, Any], width: int = 70) -> str:
    """``gate: healthy (1 GPU, 7.7s), 5m ago`` or ``gate: FAILED 5m ago: GPU 0 (...): ...`` (cut to ``width``)."""
    if b.get("ok"):
        return f"gate: {b['line']}, {b['age']} ago"
    text = str(b["line"]).removeprefix("FAILED: ")
    return f"gate: FAILED {b['age']} ago: " + (text if len(text) <= width else text[:width - 3] + "...")
