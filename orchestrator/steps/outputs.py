"""outputs: on the controller: the shipper's spec, restore before launch, and what was shipped.

The node side is remote/ship/shipper.py (one pass, and the long-lived shipper the run's supervisor
starts) and the ``outputs`` / ``ship`` ops of remote/runs/ops.py. This side builds the spec the launch
request carries (``{name}`` and ``{run_id}`` expanded in outputs.path and outputs.dest, the job's
``s3:`` settings), resolves S3 credentials like sync-data does (steps/transfer.controller_credentials:
they go in the request on stdin only), and before a launch puts back what outputs.dest holds when
outputs.path on the node is missing or empty (restore), with sync-data's engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from ..agent import NODE, run_module
from ..errors import RemoteCommandError
from ..transport.base import Transport
from .report import MoveReport

if TYPE_CHECKING:
    from ..config.models import LoadedJob, OutputsConfig


def files(n: int) -> str:
    return f"{n} file{'s' if n != 1 else ''}"


def expand(text: str, name: str, run_id: str) -> str:
    """``{name}`` and ``{run_id}`` filled in (the only placeholders outputs: knows; jobrules checks it)."""
    return text.replace("{name}", name).replace("{run_id}", run_id)


def dest_url(dest: str) -> str:
    """An outputs.dest as a prefix: ends with "/" (an object's key is dest + the path relative to path)."""
    return dest if dest.endswith("/") else dest + "/"


def config(loaded: LoadedJob | None) -> OutputsConfig | None:
    return loaded.job.outputs if loaded is not None else None


def outputs_spec(loaded: LoadedJob, run_id: str) -> dict[str, Any]:
    """The shipper's spec for this run, without credentials (those travel beside it, on stdin)."""
    out = loaded.job.outputs
    assert out is not None
    s3 = loaded.job.s3
    name = loaded.job.name
    return {
        "path": expand(out.path, name, run_id).rstrip("/") or "/",
        "dest": dest_url(expand(out.dest, name, run_id)) if out.dest else None,
        "every": out.every, "settle": out.settle, "include": list(out.include), "cpu": out.cpu,
        "endpoint_url": s3.endpoint_url, "region": s3.region, "credentials_mode": s3.credentials,
        "profile": s3.profile, "concurrency": s3.concurrency, "part_size_mb": s3.part_size_mb,
        "multipart_threshold_mb": s3.multipart_threshold_mb,
    }


def outputs_credentials(loaded: LoadedJob) -> dict[str, str | None] | None:
    """S3 credentials for the shipper (None with s3.credentials: node or anonymous); a ConfigError
    (exit 2) when none can be found here."""
    from .transfer import controller_credentials

    return controller_credentials(loaded.job.s3, loaded.path)


def check(loaded: LoadedJob) -> None:
    """Before any host is touched: credentials for outputs.dest exist here (else ConfigError, exit 2)."""
    out = loaded.job.outputs
    if out is not None and out.dest:
        outputs_credentials(loaded)


def launch_fields(loaded: LoadedJob, run_id: str) -> dict[str, Any]:
    """What a launch request carries for outputs: nothing without outputs.dest (nothing ships)."""
    out = loaded.job.outputs
    if out is None or not out.dest:
        return {}
    return {"outputs": outputs_spec(loaded, run_id), "outputs_credentials": outputs_credentials(loaded)}


# --------------------------------------------------------------------------- restore


class RestoreReport(MoveReport):
    """What restore fetched (sync-data's report) or why it was skipped (status "skipped")."""

    why: str | None = None  # skipped: outputs.path holds files already


def look(conn: Transport, path: str) -> tuple[str, str]:
    """("missing" | "empty" | "full" | "notdir", the path expanded on the node): remote.runs op ``look``.
    dfo's own .dfo names do not count: a folder holding only them is empty."""
    data = run_module(conn, NODE.runs, {"op": "look", "path": path}, timeout=60)
    if not isinstance(data, dict) or data.get("kind") not in ("missing", "empty", "full", "notdir"):
        raise RemoteCommandError(f"could not look at outputs.path {path} on the node", host=conn.name)
    return str(data["kind"]), str(data.get("path") or path)


def restore_request(loaded: LoadedJob, run_id: str, path: str) -> dict[str, Any]:
    """sync-data's request with source = outputs.dest and dest = outputs.path (the .dfo names under
    dest are skipped, an empty dest is no error: there is simply nothing to restore yet)."""
    out = loaded.job.outputs
    assert out is not None and out.dest
    s3 = loaded.job.s3
    return {
        "what": "outputs", "dest_field": "outputs.path", "restore": True,
        "source": dest_url(expand(out.dest, loaded.job.name, run_id)), "dest": path,
        "endpoint_url": s3.endpoint_url, "region": s3.region, "profile": s3.profile,
        "credentials_mode": s3.credentials, "credentials": outputs_credentials(loaded),
        "concurrency": s3.concurrency, "part_size_mb": s3.part_size_mb,
        "multipart_threshold_mb": s3.multipart_threshold_mb, "check_space": True, "margin_pct": 0.0, "delete": False,
    }


def restore(conn: Transport, loaded: LoadedJob, run_id: str,
            on_event: Callable[[dict[str, Any]], None] | None = None, refresh: bool = False) -> RestoreReport | None:
    """Before a launch: fetch outputs.dest into outputs.path when the node lacks it (missing, or holding
    nothing but dfo's .dfo names). None when the job does not restore (no outputs:, no dest, restore:
    false). ``refresh`` (a recovering run's generation 2 and later): also into a path that holds files,
    every file that differs from outputs.dest replaced by the shipped one, so that every node of the new
    generation resumes from the same last shipped checkpoint, never from an older one a node kept on its
    disk, nor a newer one only it has (files that are not in outputs.dest stay)."""
    out = loaded.job.outputs
    if out is None or not out.dest or not out.restore:
        return None
    from .transfer import transfer

    path = expand(out.path, loaded.job.name, run_id).rstrip("/") or "/"
    kind, shown = look(conn, path)
    source = dest_url(expand(out.dest, loaded.job.name, run_id))
    if kind == "full" and not refresh:
        return RestoreReport(host=conn.name, status="skipped", why=f"{shown} holds files already", fetched=0,
                             skipped=0, bytes=0, seconds=0.0, mb_per_s=0.0, dest=shown, source=source, files_total=0,
                             bytes_total=0)
    r = transfer(conn, loaded, "data", restore_request(loaded, run_id, path), on_event=on_event)
    return RestoreReport(**{k: v for k, v in r.model_dump().items() if k in MoveReport.model_fields}, host=conn.name)


def restore_line(r: RestoreReport) -> str:
    """The one line launch prints about it (plain text; escape before printing as markup)."""
    from remote.lib.fsutil import human_bytes

    if r.status == "skipped":
        return f"restore: skipped: {r.why}"
    if not r.files_total:
        return f"restore: nothing at {r.source}"
    if not r.fetched:
        return (f"restore: {r.dest} already holds the {files(r.files_total)} ({human_bytes(r.bytes_total)}) "
                f"of {r.source}")
    return f"restore: {files(r.fetched)}, {human_bytes(r.bytes)} from {r.source} into {r.dest} ({r.seconds:.1f}s)"


# --------------------------------------------------------------------------- what was shipped


class OutputsReport(BaseModel):
    """`dfo outputs --json` for one host: the run and its shipper's record (RUN_DIR/outputs.json)."""

    model_config = ConfigDict(defer_build=True)  # built when first used, not at import

    run: str
    job: str | None = None
    run_state: str
    state: str | None  # idle | shipping | done | failed | starting; None: the run ships nothing
    dest: str | None = None
    path: str | None = None
    every: float | None = None
    passes: int = 0
    failed_passes: int = 0
    shipped: dict[str, int] = {}
    pending: int = 0
    lag_s: float | None = None
    last_pass: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = []

    @classmethod
    def of(cls, info: Any) -> OutputsReport:
        o = info.outputs or {}
        return cls(run=info.id, job=info.job, run_state=info.state, state=o.get("state"), dest=o.get("dest"),
                   path=o.get("path"), every=o.get("every"), passes=o.get("passes") or 0,
                   failed_passes=o.get("failed_passes") or 0, shipped=o.get("shipped") or {},
                   pending=o.get("pending") or 0, lag_s=o.get("lag_s"), last_pass=o.get("last_pass"),
                   final=o.get("final"), errors=o.get("errors") or [])


class ShipReport(MoveReport):
    """`dfo outputs --ship --json` for one host: sync-data's shape (fetched = files sent)."""

    run: str
    pending: int = 0  # files still being written (changed within settle): the next pass takes them
    changed_during: int = 0  # files that changed while being sent: not completed, retried next pass
    error: str | None = None

    @classmethod
    def of(cls, host: str, run: str, p: dict[str, Any], source: str, dest: str,
           before: dict[str, int] | None = None) -> ShipReport:
        """``before``: the run's shipped totals before this pass (files_total/bytes_total then count
        what dest holds from this run, as sync-data's count what the destination holds)."""
        files, skipped = int(p.get("files") or 0), int(p.get("skipped") or 0)
        before = before or {}
        ok = bool(p.get("ok", p.get("error") is None))
        status = "failed" if not ok else ("no change" if not files else "done")
        return cls(host=host, run=run, ok=ok, status=status, fetched=files, skipped=skipped,
                   bytes=int(p.get("bytes") or 0), seconds=float(p.get("seconds") or 0.0),
                   mb_per_s=float(p.get("mb_per_s") or 0.0), dest=dest, source=source,
                   files_total=int(p.get("files_total") or (before.get("files") or 0) + files + skipped),
                   bytes_total=int(p.get("bytes_total") or (before.get("bytes") or 0) + int(p.get("bytes") or 0)),
                   pending=int(p.get("pending") or 0),
                   changed_during=int(p.get("changed_during") or 0), error=p.get("error"))


def request(workspace: str | None, run: str | None, job: str | None) -> dict[str, Any]:
    return {"workspace": workspace, "run": run, "job": job}


def ship(conn: Transport, workspace: str | None, run: str, loaded: LoadedJob | None,
         on_event: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """A pass now for run ``run`` (an id: resolve RUN first with ``outputs``): the run's shipper does it
    when it is alive, else the node runs one itself with the spec (and credentials) sent here, which
    needs the job (-j). Returns the PASS dict plus "run"."""
    req: dict[str, Any] = {"op": "ship", **request(workspace, run, loaded.job.name if loaded else None)}
    if loaded is not None and loaded.job.outputs is not None and loaded.job.outputs.dest:
        req["outputs"] = outputs_spec(loaded, run)
        req["outputs_credentials"] = outputs_credentials(loaded)
    passed: dict[str, Any] = run_module(conn, NODE.runs, req, timeout=7 * 24 * 3600.0, on_event=on_event)
    return passed


def summary_line(o: dict[str, Any] | None) -> str | None:
    """One line about a run's outputs for status: state, shipped totals, last pass, lag, last error."""
    from remote.lib.fsutil import human_bytes

    if not o:
        return None
    state = o.get("state") or "?"
    if state == "starting":
        return "outputs: starting (no pass yet)"
    shipped = o.get("shipped") or {}
    parts = [f"outputs: {state}", f"shipped {files(shipped.get('files', 0))} ({human_bytes(shipped.get('bytes', 0))})"]
    if o.get("dest"):
        parts[-1] += f" to {o['dest']}"
    last = o.get("final") or o.get("last_pass")
    if last:
        what = "final pass" if last.get("final") else "last pass"
        when = (last.get("ended") or "").replace("T", " ").replace("Z", "")
        parts.append(f"{what} {'ok' if last.get('ok') else 'FAILED'}" + (f" at {when}" if when else ""))
    if o.get("lag_s"):
        parts.append(f"lag {float(o['lag_s']):.0f}s")
    if o.get("pending"):
        parts.append(f"{o['pending']} pending")
    errors = o.get("errors") or []
    if errors and (last is None or not last.get("ok")):
        parts.append(f"last error: {errors[-1].get('error')}")
    return "; ".join(parts)


def final_line(o: dict[str, Any] | None) -> tuple[str, bool] | None:
    """After the run ended (tail, up): how its last pass went, and whether it failed."""
    from remote.lib.fsutil import human_bytes

    if not o:
        return None
    p = o.get("final") or o.get("last_pass") or {}
    dest = o.get("dest") or "?"
    if o.get("state") == "failed" or (p and not p.get("ok", True)):
        err = (p.get("error") or next((e.get("error") for e in reversed(o.get("errors") or [])), None)
               or "see dfo outputs")
        return f"outputs: last pass FAILED: {err}", True
    if o.get("state") != "done":
        return f"outputs: the last pass has not finished (state {o.get('state')}); see dfo outputs", False
    total = o.get("shipped") or {}
    return (f"outputs: last pass shipped {files(p.get('files', 0))} ({human_bytes(p.get('bytes', 0))}) to {dest}; "
            f"{files(total.get('files', 0))} ({human_bytes(total.get('bytes', 0))}) shipped in all"), False
