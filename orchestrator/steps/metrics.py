"""Run metrics, the library side: what launch sends the sampler, reading metrics.jsonl back, and the
figures top, status, plot and report show (step rate, ETA, cost, GPU-hours, mean utilisation).

What launch sends the node is orchestrator/steps/metrics_spec.py. The node side is remote/runs/metrics.py
(the sampler), remote/runs/notify.py (alerts) and the ``metrics`` op of remote/runs/ops.py. Row shapes: docs/metrics.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..agent import NODE, run_module
from ..config.models import Inventory, LoadedJob
from ..errors import ConfigError, UsageError
from ..transport.base import Transport
from .runs import RunInfo


def fetch(conn: Transport, workspace: str | None, run: str | None = None, job: str | None = None,
          since: float = 0, max_rows: int = 20000) -> tuple[RunInfo, list[dict[str, Any]]]:
    """The run and its metrics.jsonl rows (after ``since``, thinned to ``max_rows``)."""
    data = run_module(conn, NODE.runs, {"op": "metrics", "workspace": workspace, "run": run, "job": job,
                                        "since": since, "max_rows": max_rows}, timeout=120)
    rows = [r for r in data.get("rows") or [] if isinstance(r, dict)]
    return RunInfo.model_validate(data), rows


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl on this machine (a pulled one)."""
    return parse_jsonl(path.read_bytes())


def parse_jsonl(data: bytes) -> list[dict[str, Any]]:
    out = []
    for ln in data.decode(errors="replace").splitlines():
        try:
            row = json.loads(ln)
        except ValueError:
            continue
        if isinstance(row, dict):
            out.append(row)
    return out


def price_of(inv: Inventory, host: str) -> float | None:
    entry = inv.hosts.get(host)
    if entry is not None and entry.price_per_hour is not None:
        return entry.price_per_hour
    return inv.defaults.price_per_hour


def run_seconds(info: RunInfo, now: float | None = None) -> float | None:
    if info.started_ts is None:
        return None
    end = info.ended_ts if info.ended_ts is not None else (now if now is not None else time.time())
    return max(0.0, end - info.started_ts)


def cost(info: RunInfo, price: float | None, now: float | None = None) -> float | None:
    secs = run_seconds(info, now)
    return None if price is None or secs is None else round(price * secs / 3600.0, 2)


def series(rows: list[dict[str, Any]], metric: str) -> tuple[list[float], list[float]]:
    """(x, y) of one metric: a train metric against its step (time where a row has none); ``gpu_util``,
    ``gpu_mem``, ``gpu_power``, ``gpu_temp`` (mean over the GPUs) and ``cpu_pct``, ``rss``, ``mem_used``
    against seconds since the first row."""
    t0 = min((float(r.get("t") or 0) for r in rows), default=0.0)
    xs: list[float] = []
    ys: list[float] = []
    gpu_key = {"gpu_util": "util", "gpu_mem": "mem_used", "gpu_power": "power", "gpu_temp": "temp"}.get(metric)
    for r in rows:
        if gpu_key or metric in ("cpu_pct", "rss", "mem_used", "load1"):
            if r.get("kind") != "sys":
                continue
            if gpu_key:
                vals = [g[gpu_key] for g in r.get("gpus") or [] if isinstance(g.get(gpu_key), int | float)]
                if not vals:
                    continue
                y = sum(vals) / len(vals)
            else:
                v = (r.get("host") or {}).get(metric)
                if not isinstance(v, int | float):
                    continue
                y = float(v)
            xs.append(float(r.get("t") or 0) - t0)
            ys.append(y)
        elif r.get("kind") == "train" and isinstance(r.get(metric), int | float):
            step = r.get("step")
            xs.append(float(step) if isinstance(step, int | float) else float(r.get("t") or 0) - t0)
            ys.append(float(r[metric]))
    return xs, ys


def x_label(rows: list[dict[str, Any]], metric: str) -> str:
    if metric.startswith("gpu_") or metric in ("cpu_pct", "rss", "mem_used", "load1"):
        return "seconds"
    return "step" if any(r.get("kind") == "train" and r.get("step") is not None for r in rows) else "seconds"


def step_rate(rows: list[dict[str, Any]], window: int = 20) -> float | None:
    """Steps per second over the last ``window`` train rows that carry a step."""
    pts = [(float(r["t"]), float(r["step"])) for r in rows
           if r.get("kind") == "train" and isinstance(r.get("step"), int | float) and r.get("t")]
    pts = pts[-window:]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0] or pts[-1][1] <= pts[0][1]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def eta_seconds(rows: list[dict[str, Any]]) -> float | None:
    """Seconds left when the trainer logs a total (``step 10/500``) and steps advance."""
    rate = step_rate(rows)
    last = next((r for r in reversed(rows) if r.get("kind") == "train" and r.get("total")), None)
    if rate is None or last is None or not isinstance(last.get("step"), int | float):
        return None
    return max(0.0, (float(last["total"]) - float(last["step"])) / rate)


def summary(info: RunInfo, rows: list[dict[str, Any]], price: float | None) -> dict[str, Any]:
    """What dfo report prints: cost, GPU-hours, mean GPU utilisation, tokens/s, restarts, last loss."""
    secs = run_seconds(info)
    sys_rows = [r for r in rows if r.get("kind") == "sys"]
    ngpu = max((len(r.get("gpus") or []) for r in sys_rows), default=0)
    utils = [float(g["util"]) for r in sys_rows for g in r.get("gpus") or [] if isinstance(g.get("util"), int | float)]
    toks = [float(r["tok_s"]) for r in rows if r.get("kind") == "train" and isinstance(r.get("tok_s"), int | float)]
    xids = [x for r in sys_rows for x in (r.get("xid") or [])]
    last_train = next((r for r in reversed(rows) if r.get("kind") == "train"), None)
    shipper = ((info.outputs or {}).get("shipper") or {}) if isinstance(info.outputs, dict) else {}
    return {
        "run": info.id, "job": info.job, "host": info.host, "state": info.state, "started": info.started,
        "ended": info.ended, "seconds": round(secs, 1) if secs is not None else None,
        "price_per_hour": price, "cost": cost(info, price), "gpus": ngpu,
        "gpu_hours": round(ngpu * (secs or 0) / 3600.0, 3) if ngpu else 0.0,
        "mean_gpu_util": round(sum(utils) / len(utils), 1) if utils else None,
        "mean_tok_s": round(sum(toks) / len(toks), 1) if toks else None,
        "last_step": (last_train or {}).get("step"), "last_loss": (last_train or {}).get("loss"),
        "samples": len(sys_rows), "xid": xids,
        "restarts": {"shipper": shipper.get("restarts", 0)} if shipper else {},
    }


def view(info: RunInfo, rows: list[dict[str, Any]], price: float | None, now: float | None = None) -> dict[str, Any]:
    """One host's `dfo top --json` document: the run, its last sample (per GPU and the host), its last
    training figures, step rate, ETA, XIDs seen in the rows read, and the cost so far."""
    last_sys = next((r for r in reversed(rows) if r.get("kind") == "sys"), None)
    last_train = next((r for r in reversed(rows) if r.get("kind") == "train"), None)
    secs = run_seconds(info, now)
    rate = step_rate(rows)
    return {
        "run": info.id, "job": info.job, "state": info.state, "started": info.started,
        "seconds": round(secs, 1) if secs is not None else None, "sample_t": (last_sys or {}).get("t"),
        "gpus": (last_sys or {}).get("gpus") or [], "host": (last_sys or {}).get("host") or {},
        "train": last_train, "steps_per_s": round(rate, 4) if rate is not None else None,
        "eta_s": round(e, 1) if (e := eta_seconds(rows)) is not None else None,
        "xid": sum(len(r.get("xid") or []) for r in rows if r.get("kind") == "sys"),
        "price_per_hour": price, "cost": cost(info, price, now),
    }


def _g(v: Any, fmt: str, unit: str = "") -> str:
    return "-" if not isinstance(v, int | float) else format(v, fmt) + unit


def gpu_text(g: dict[str, Any]) -> str:
    """``0 100% 1.1/140G 692W 61C 1515MHz`` (one GPU of a sample)."""
    mem = "-" if not isinstance(g.get("mem_used"), int | float) else (
        f"{g['mem_used'] / 1024:.1f}/{_g((g.get('mem_total') or 0) / 1024, '.0f')}G")
    return (f"{g.get('i', '?')} {_g(g.get('util'), '.0f', '%')} {mem} {_g(g.get('power'), '.0f', 'W')} "
            f"{_g(g.get('temp'), '.0f', 'C')} {_g(g.get('sm_clock'), '.0f', 'MHz')}")


def host_text(h: dict[str, Any]) -> str:
    def gib(k: str) -> str:
        return _g((h.get(k) or 0) / 1024 if k in h else None, ".1f")
    return (f"cpu {_g(h.get('cpu_pct'), '.0f', '%')} load {_g(h.get('load1'), '.1f')} "
            f"ram {gib('mem_used')}/{gib('mem_total')}G shm {gib('shm_used')}G disk {gib('disk_used')}/"
            f"{gib('disk_total')}G rss {_mib(h.get('rss'))}")


def _mib(v: Any) -> str:
    if not isinstance(v, int | float):
        return "-"
    return f"{v / 1024:.1f}G" if v >= 1024 else f"{v:.0f}M"


def train_text(t: dict[str, Any] | None) -> str:
    if not t:
        return "-"
    keys = [k for k in t if k not in ("t", "kind", "step", "total")]
    step = f"step {t.get('step')}" + (f"/{t['total']}" if t.get("total") else "")
    return " ".join([step, *(f"{k} {t[k]:.4g}" if isinstance(t[k], float) else f"{k} {t[k]}" for k in keys[:6])])


def sample_line(metrics: dict[str, Any] | None) -> str | None:
    """status's one line of the last sample: GPUs (mean), host, training figures."""
    if not metrics:
        return None
    s, t = metrics.get("sys") or {}, metrics.get("train")
    gpus = s.get("gpus") or []
    parts = []
    if gpus:
        util = [g["util"] for g in gpus if isinstance(g.get("util"), int | float)]
        power = [g["power"] for g in gpus if isinstance(g.get("power"), int | float)]
        parts.append(f"{len(gpus)} GPU util {_g(sum(util) / len(util) if util else None, '.0f', '%')} "
                     f"power {_g(sum(power) if power else None, '.0f', 'W')}")
    if s.get("host"):
        parts.append(host_text(s["host"]))
    if t:
        parts.append(train_text(t))
    return " | ".join(parts) or None


def from_s3(loaded: LoadedJob, run_id: str, name: str) -> bytes:
    """RUN's ``log`` or ``metrics.jsonl`` as the node's supervisor put them beside the checkpoints
    (beside outputs.dest: DEST.dfo-runs/RUN/, remote/runs/runship.py), read with this machine's S3 credentials."""
    from remote.runs.runship import key_prefix
    from remote.s3.client import S3Client

    from .outputs import outputs_credentials, outputs_spec

    out = loaded.job.outputs
    if out is None or not out.dest:
        raise ConfigError(f"{loaded.path}: --from-s3 needs outputs.dest in the job file",
                          hint="the log and metrics.jsonl ship beside the checkpoints only with outputs.dest")
    if not run_id or not run_id.strip():
        raise UsageError("--from-s3 needs the run's whole id", hint="dfo status or the launch's output names it")
    spec = outputs_spec(loaded, run_id)
    bucket, prefix = key_prefix(spec["dest"], run_id)
    client = S3Client(spec["endpoint_url"], spec["region"] or "us-east-1", outputs_credentials(loaded))
    try:
        resp = client.request("GET", bucket, prefix + name)
        body: bytes = resp.read()
    except Exception as exc:  # noqa: BLE001 -- the endpoint cannot be reached: say which, exit 4
        raise ConfigError(f"s3://{bucket}/{prefix}{name}: {type(exc).__name__}: {exc}",
                          hint="check s3.endpoint_url and the network") from None
    if resp.status == 404:
        raise UsageError(f"no {name} of run {run_id} at s3://{bucket}/{prefix}",
                         hint="the run's id must be whole; its node ships it every outputs.every seconds")
    if resp.status // 100 != 2:
        raise ConfigError(f"s3://{bucket}/{prefix}{name}: HTTP {resp.status}",
                          hint="check the S3 credentials of this shell (AWS_ACCESS_KEY_ID, s3.profile)")
    return body
