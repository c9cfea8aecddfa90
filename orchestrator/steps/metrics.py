"""Run metrics, the library side: what launch sends the sampler, reading metrics.jsonl back, and the
figures top, status, plot and report show (step rate, ETA, cost, GPU-hours, mean utilisation).

What launch sends the node is orchestrator/steps/metrics_spec.py. The node side is remote/runs/metrics.py
(the sampler), remote/runs/notify.py (alerts) and the ``metrics`` op of remote/runs/ops.py. Row shapes: docs/metrics.md.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..agent import NODE, run_module
from ..errors import ConfigError, UsageError
from ..transport.base import Transport
from . import noderows
from .runs import RunInfo

if TYPE_CHECKING:
    from ..config.inventory import Inventory
    from ..config.models import LoadedJob


def fetch(conn: Transport, workspace: str | None, run: str | None = None, job: str | None = None,
          since: float = 0, max_rows: int = 20000) -> tuple[RunInfo, list[dict[str, Any]]]:
    """The run and its metrics.jsonl rows (after ``since``, thinned to ``max_rows``), read through
    noderows: finite figures only, malformed rows dropped."""
    data = run_module(conn, NODE.runs, {"op": "metrics", "workspace": workspace, "run": run, "job": job,
                                        "since": since, "max_rows": max_rows}, timeout=120)
    return RunInfo.model_validate(data), noderows.rows(data.get("rows"))


def read_jsonl(path: Path, max_rows: int = 20000) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl on this machine (a pulled one), read as a stream, thinned as the node thins."""
    with path.open("rb") as f:
        return noderows.read_chunks(iter(lambda: f.read(CHUNK), b""), max_rows)


def parse_jsonl(data: bytes, max_rows: int = 20000) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl held in memory."""
    return noderows.read_chunks([data], max_rows)


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


def _num(v: object) -> float | None:
    n = noderows.finite(v)
    return None if n is None else float(n)


def _dicts(v: object) -> list[dict[str, Any]]:
    """The objects of a list (a sample's gpus, its xid); [] for anything else."""
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _is_train(r: dict[str, Any]) -> bool:
    return r.get("kind") == "train"


def series(rows: list[dict[str, Any]], metric: str) -> tuple[list[float], list[float]]:
    """(x, y) of one metric: a train metric against its step (time where a row has none); ``gpu_util``,
    ``gpu_mem``, ``gpu_power``, ``gpu_temp`` (mean over the GPUs) and ``cpu_pct``, ``rss``, ``mem_used``
    against seconds since the first row. A training figure the trainer logged as nan or +-inf is kept
    as that float (plot marks it; JSON prints null); a sample's figures are finite (noderows)."""
    t0 = min((t for r in rows if (t := _num(r.get("t"))) is not None), default=0.0)
    xs: list[float] = []
    ys: list[float] = []
    gpu_key = {"gpu_util": "util", "gpu_mem": "mem_used", "gpu_power": "power", "gpu_temp": "temp"}.get(metric)
    for r in rows:
        t = _num(r.get("t"))
        if t is None:
            continue
        if gpu_key or metric in ("cpu_pct", "rss", "mem_used", "load1"):
            if r.get("kind") != "sys":
                continue
            if gpu_key:
                vals = [v for g in _dicts(r.get("gpus")) if (v := _num(g.get(gpu_key))) is not None]
                if not vals:
                    continue
                y = sum(vals) / len(vals)
            else:
                host = r.get("host")
                v = _num(host.get(metric)) if isinstance(host, dict) else None
                if v is None:
                    continue
                y = v
            xs.append(t - t0)
            ys.append(y)
        elif _is_train(r) and (fig := noderows.figure(r.get(metric))) is not None:
            step = _num(r.get("step"))
            xs.append(step if step is not None else t - t0)
            ys.append(float(fig))
    return xs, ys


def x_label(rows: list[dict[str, Any]], metric: str) -> str:
    if metric.startswith("gpu_") or metric in ("cpu_pct", "rss", "mem_used", "load1"):
        return "seconds"
    return "step" if any(_is_train(r) and r.get("step") is not None for r in rows) else "seconds"


def step_rate(rows: list[dict[str, Any]], window: int = 20) -> float | None:
    """Steps per second over the last ``window`` train rows that carry a step."""
    pts = [(t, step) for r in rows if _is_train(r) and (t := _num(r.get("t"))) and
           (step := _num(r.get("step"))) is not None]
    pts = pts[-window:]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0] or pts[-1][1] <= pts[0][1]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def eta_seconds(rows: list[dict[str, Any]]) -> float | None:
    """Seconds left when the trainer logs a total (``step 10/500``) and steps advance."""
    rate = step_rate(rows)
    last = next((r for r in reversed(rows) if _is_train(r) and _num(r.get("total"))), None)
    if rate is None or last is None:
        return None
    total, step = _num(last.get("total")), _num(last.get("step"))
    if total is None or step is None:
        return None
    return max(0.0, (total - step) / rate)


def _mean(vals: list[float]) -> float | None:
    return round(sum(vals) / len(vals), 1) if vals else None


def summary(info: RunInfo, rows: list[dict[str, Any]], price: float | None) -> dict[str, Any]:
    """What dfo report prints: cost, GPU-hours, mean GPU utilisation, tokens/s, restarts, last loss.
    Means are over finite figures; the last loss is what the trainer logged (nan when it diverged)."""
    secs = run_seconds(info)
    sys_rows = [r for r in rows if r.get("kind") == "sys"]
    ngpu = max((len(_dicts(r.get("gpus"))) for r in sys_rows), default=0)
    utils = [v for r in sys_rows for g in _dicts(r.get("gpus")) if (v := _num(g.get("util"))) is not None]
    toks = [v for r in rows if _is_train(r) and (v := _num(r.get("tok_s"))) is not None]
    xids = [x for r in sys_rows for x in _dicts(r.get("xid"))]
    last_train = next((r for r in reversed(rows) if _is_train(r)), None) or {}
    shipper = ((info.outputs or {}).get("shipper") or {}) if isinstance(info.outputs, dict) else {}
    restarts = noderows.finite(shipper.get("restarts")) if isinstance(shipper, dict) else None
    return {
        "run": info.id, "job": info.job, "host": info.host, "state": info.state, "started": info.started,
        "ended": info.ended, "seconds": round(secs, 1) if secs is not None else None,
        "price_per_hour": price, "cost": cost(info, price), "gpus": ngpu,
        "gpu_hours": round(ngpu * (secs or 0) / 3600.0, 3) if ngpu else 0.0,
        "mean_gpu_util": _mean(utils), "mean_tok_s": _mean(toks),
        "last_step": noderows.finite(last_train.get("step")), "last_loss": noderows.figure(last_train.get("loss")),
        "samples": len(sys_rows), "xid": xids,
        "restarts": {"shipper": restarts or 0} if shipper else {},
    }


def view(info: RunInfo, rows: list[dict[str, Any]], price: float | None, now: float | None = None) -> dict[str, Any]:
    """One host's `dfo top --json` document: the run, its last sample (per GPU and the host), its last
    training figures, step rate, ETA, XIDs seen in the rows read, and the cost so far."""
    last_sys = next((r for r in reversed(rows) if r.get("kind") == "sys"), None) or {}
    last_train = next((r for r in reversed(rows) if _is_train(r)), None)
    secs = run_seconds(info, now)
    rate = step_rate(rows)
    return {
        "run": info.id, "job": info.job, "state": info.state, "started": info.started,
        "seconds": round(secs, 1) if secs is not None else None, "sample_t": last_sys.get("t"),
        "gpus": _dicts(last_sys.get("gpus")),
        "host": last_sys.get("host") if isinstance(last_sys.get("host"), dict) else {},
        "train": last_train, "steps_per_s": round(rate, 4) if rate is not None else None,
        "eta_s": round(e, 1) if (e := eta_seconds(rows)) is not None else None,
        "xid": sum(len(x) for r in rows if r.get("kind") == "sys" and isinstance(x := r.get("xid"), list)),
        "price_per_hour": price, "cost": cost(info, price, now),
    }


def _g(v: Any, fmt: str, unit: str = "") -> str:
    """A figure as text: ``-`` where there is no number; nan and inf as themselves."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "-"
    return format(v, fmt) + unit


def _div(v: Any, by: float) -> float | None:
    n = _num(v)
    return None if n is None else n / by


def gpu_text(g: dict[str, Any]) -> str:
    """``0 100% 1.1/140G 692W 61C 1515MHz`` (one GPU of a sample)."""
    used = _div(g.get("mem_used"), 1024)
    mem = "-" if used is None else f"{used:.1f}/{_g(_div(g.get('mem_total'), 1024), '.0f')}G"
    i = g.get("i")
    return (f"{i if _num(i) is not None else '?'} {_g(_num(g.get('util')), '.0f', '%')} {mem} "
            f"{_g(_num(g.get('power')), '.0f', 'W')} {_g(_num(g.get('temp')), '.0f', 'C')} "
            f"{_g(_num(g.get('sm_clock')), '.0f', 'MHz')}")


def host_text(h: dict[str, Any]) -> str:
    def gib(k: str) -> str:
        return _g(_div(h.get(k), 1024), ".1f")
    return (f"cpu {_g(_num(h.get('cpu_pct')), '.0f', '%')} load {_g(_num(h.get('load1')), '.1f')} "
            f"ram {gib('mem_used')}/{gib('mem_total')}G shm {gib('shm_used')}G disk {gib('disk_used')}/"
            f"{gib('disk_total')}G rss {_mib(h.get('rss'))}")


def _mib(v: Any) -> str:
    n = _num(v)
    if n is None:
        return "-"
    return f"{n / 1024:.1f}G" if n >= 1024 else f"{n:.0f}M"


def figure_text(v: Any) -> str:
    """A training figure: ``2.31``, ``nan``, ``inf``, ``-inf`` (what the trainer logged), ``-`` for none."""
    f = noderows.figure(v)
    if f is None:
        return "-"
    if isinstance(f, float) and not math.isfinite(f):
        return str(f)  # nan, inf, -inf
    return f"{f:.4g}" if isinstance(f, float) else str(f)


def train_text(t: dict[str, Any] | None) -> str:
    if not isinstance(t, dict) or not t:
        return "-"
    keys = [k for k in t if k not in ("t", "kind", "step", "total")]
    step, total = noderows.finite(t.get("step")), noderows.finite(t.get("total"))
    head = f"step {step if step is not None else '-'}" + (f"/{total}" if total else "")
    return " ".join([head, *(f"{k} {figure_text(t[k])}" for k in keys[:6])])


def sample_line(metrics: dict[str, Any] | None) -> str | None:
    """status's one line of the last sample: GPUs (mean), host, training figures."""
    if not isinstance(metrics, dict) or not metrics:
        return None
    s, t = metrics.get("sys") or {}, metrics.get("train")
    s = s if isinstance(s, dict) else {}
    gpus = _dicts(s.get("gpus"))
    parts = []
    if gpus:
        util = [v for g in gpus if (v := _num(g.get("util"))) is not None]
        power = [v for g in gpus if (v := _num(g.get("power"))) is not None]
        parts.append(f"{len(gpus)} GPU util {_g(sum(util) / len(util) if util else None, '.0f', '%')} "
                     f"power {_g(sum(power) if power else None, '.0f', 'W')}")
    if isinstance(s.get("host"), dict) and s["host"]:
        parts.append(host_text(s["host"]))
    if isinstance(t, dict) and t:
        parts.append(train_text(t))
    return " | ".join(parts) or None


BOUND_ENV = "DFO_FROM_S3_MAX_MIB"
# What --from-s3 reads at most, in MiB, unless DFO_FROM_S3_MAX_MIB says otherwise: twice what the node
# itself keeps (metrics.jsonl is thinned past 8 MiB: remote/runs/metrics.py; the log goes up to its last
# 32 MiB: remote/runs/runship.py). A bigger object was not put there by dfo's node code: its newest part is read.
FROM_S3_MAX_MIB = {"metrics.jsonl": 16.0, "log": 64.0}
CHUNK = 1 << 16


def from_s3_bound(name: str) -> int:
    """The bound on what ``--from-s3`` reads of ``name``, in bytes (DFO_FROM_S3_MAX_MIB, else the default)."""
    raw = os.environ.get(BOUND_ENV, "").strip()
    if not raw:
        return int(FROM_S3_MAX_MIB.get(name, 64.0) * 2**20)
    try:
        mib = float(raw)
    except ValueError:
        mib = math.nan
    if not math.isfinite(mib) or mib <= 0 or mib > 1 << 20:
        raise UsageError(f"{BOUND_ENV}={raw[:40]!r} is not a number of MiB",
                         hint=f"{BOUND_ENV}=64 (MiB; above 0) bounds what --from-s3 reads; unset: "
                              f"{FROM_S3_MAX_MIB['metrics.jsonl']:g} for metrics.jsonl, "
                              f"{FROM_S3_MAX_MIB['log']:g} for the log")
    return max(1, int(mib * 2**20))


def _bound_mib(n: int) -> str:
    return f"{n / 2**20:g}"


class S3Body:
    """An object beside outputs.dest, read in chunks of at most ``bound`` bytes in all: ``lines()``.
    ``note`` says, once read, where the bound was hit and what was read instead (None: all of it)."""

    def __init__(self, client: Any, resp: Any, where: str, bound: int, size: int | None, start: int,
                 note: str | None) -> None:
        self.client, self.resp, self.where, self.bound = client, resp, where, bound
        self.size, self.start, self.note = size, start, note
        self.read_bytes = 0

    def chunks(self) -> Iterator[bytes]:
        import http.client

        limit = self.bound + (1 if self.start else 0)  # a ranged read has one byte more: the newline before
        try:
            while self.read_bytes < limit:
                try:
                    data: bytes = self.resp.read(min(CHUNK, limit - self.read_bytes))
                except (OSError, ValueError, http.client.HTTPException) as exc:
                    raise ConfigError(f"{self.where}: the read broke after {self.read_bytes} bytes: "
                                      f"{type(exc).__name__}: {exc}", hint="run the command again") from None
                if not data:
                    return
                self.read_bytes += len(data)
                yield data
            if self.note is None and (self.size is None and self.resp.read(1) or (self.size or 0) > limit):
                self.note = (f"{self.where} is more than {_bound_mib(self.bound)} MiB, over the bound: read its "
                             f"first {_bound_mib(self.bound)} MiB ({BOUND_ENV}=N sets the bound)")
        finally:
            self.resp.close()
            self.client.close()  # a body left unread: this connection is not reused

    def lines(self) -> Iterator[bytes]:
        """Its lines, whole ones only: a ranged read's first (cut) line is dropped."""
        return noderows.split_lines(self.chunks(), skip_first=self.start > 0)


def _get(client: Any, bucket: str, key: str, where: str, headers: dict[str, str] | None = None) -> Any:
    try:
        return client.request("GET", bucket, key, headers=headers)
    except Exception as exc:  # noqa: BLE001 -- the endpoint cannot be reached: say which
        raise ConfigError(f"{where}: {type(exc).__name__}: {exc}",
                          hint="check s3.endpoint_url and the network") from None


def open_from_s3(loaded: LoadedJob, run_id: str, name: str) -> S3Body:
    """RUN's ``log`` or ``metrics.jsonl`` as the node's supervisor put them beside the checkpoints
    (beside outputs.dest: DEST.dfo-runs/RUN/, remote/runs/runship.py), read with this machine's S3
    credentials, at most ``from_s3_bound(name)`` bytes of it: an object over the bound is read from
    where its last that many bytes begin (a ranged GET), and ``note`` says so."""
    from remote.runs.runship import key_prefix
    from remote.s3.client import S3Client
    from remote.s3.errors import as_int

    from .outputs import outputs_credentials, outputs_spec

    out = loaded.job.outputs
    if out is None or not out.dest:
        raise ConfigError(f"{loaded.path}: --from-s3 needs outputs.dest in the job file",
                          hint="the log and metrics.jsonl ship beside the checkpoints only with outputs.dest")
    if not run_id or not run_id.strip():
        raise UsageError("--from-s3 needs the run's whole id", hint="dfo status or the launch's output names it")
    bound = from_s3_bound(name)
    spec = outputs_spec(loaded, run_id)
    bucket, prefix = key_prefix(spec["dest"], run_id)
    key, where = prefix + name, f"s3://{bucket}/{prefix}{name}"
    client = S3Client(spec["endpoint_url"], spec["region"] or "us-east-1", outputs_credentials(loaded))
    resp = _get(client, bucket, key, where)
    if resp.status == 404:
        resp.close()
        client.close()
        raise UsageError(f"no {name} of run {run_id} at s3://{bucket}/{prefix}",
                         hint="the run's id must be whole; its node ships it every outputs.every seconds")
    if resp.status // 100 != 2:
        resp.close()
        client.close()
        raise ConfigError(f"{where}: HTTP {resp.status}",
                          hint="check the S3 credentials of this shell (AWS_ACCESS_KEY_ID, s3.profile)")
    size = as_int(resp.getheader("content-length"))
    if size is None or size <= bound:
        return S3Body(client, resp, where, bound, size, 0, None)
    resp.close()
    client.close()  # its body unread: a new connection for the ranged GET
    start = size - bound - 1  # one byte before: a newline there means the first line read is whole
    resp = _get(client, bucket, key, where, {"range": f"bytes={start}-{size - 1}"})
    said = f"{where} is {size / 2**20:.1f} MiB, over the bound of {_bound_mib(bound)} MiB"
    ranged = resp.getheader("content-range") or ""
    if resp.status == 206 and (not ranged or ranged.startswith(f"bytes {start}-")):
        return S3Body(client, resp, where, bound, size, start,
                      f"{said}: read its last {_bound_mib(bound)} MiB (the newest; {BOUND_ENV}=N sets the bound)")
    if resp.status == 200:  # the server ignored the range: the whole object comes, its first bytes are read
        return S3Body(client, resp, where, bound, size, 0,
                      f"{said}: read its first {_bound_mib(bound)} MiB (the server ignored the range asked for; "
                      f"{BOUND_ENV}=N sets the bound)")
    resp.close()
    client.close()
    raise ConfigError(f"{where}: HTTP {resp.status} to a ranged GET ({ranged or 'no Content-Range'})",
                      hint=f"{BOUND_ENV} above {size / 2**20:.0f} reads the whole object in one GET")


def rows_from_s3(loaded: LoadedJob, run_id: str, max_rows: int = 20000) -> tuple[list[dict[str, Any]], str | None]:
    """RUN's metrics.jsonl beside outputs.dest: its rows (at most the bound read, parsed as they come,
    thinned to ``max_rows`` as the node's metrics op thins), and the note of a bound hit (None: none)."""
    body = open_from_s3(loaded, run_id, "metrics.jsonl")
    got = noderows.read_chunks(body.chunks(), max_rows, skip_first=body.start > 0)
    return got, body.note
