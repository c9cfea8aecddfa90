"""What dfo submit, queue and cancel print (the human view; --json is the contract), and this machine's
record of its submits brought up to date with what the nodes said (orchestrator/steps/submits.py).

Every string from a node (run ids, job names, times) goes through ``safe``: text, never rich markup."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import click

from ..cli_common import console, err_console, safe
from ..errors import HostError
from ..hosts import Outcome
from ..steps import queue as steps
from ..steps import submits
from .runs_view import dfo_cmd


def warn(text: str) -> None:
    err_console.print(f"dfo: {safe(text)}", highlight=False, soft_wrap=True)


def seen(p: steps.Placed) -> None:
    """What the hosts said of their runs while this one was placed: the records of earlier submits follow."""
    for host, ids in p.seen.items():
        note_seen(host, ids.get("queued") or [], ids.get("running") or [], skip=p.run)


def gpus_words(p: steps.Placed) -> str:
    if p.state == "running":
        if not p.gpus:
            return "no GPU"
        return f"GPU{'s' if len(p.gpus) > 1 else ''} {','.join(str(g) for g in p.gpus)}"
    return f"needs {p.needs} GPU{'s' if p.needs != 1 else ''} of {p.node_gpus}"


def render_placed(ctx: click.Context, p: steps.Placed, job_path: str | None) -> None:
    moved = f" (from {safe(p.requeued_from)})" if p.requeued_from else ""
    if p.state == "running":
        console.print(f"[bold]{safe(p.host)}[/]: run [bold]{safe(p.run)}[/] started on {safe(gpus_words(p))}{moved}"
                      f": {safe(p.why)}", soft_wrap=True, highlight=False)
    elif p.state == "queued":
        console.print(f"[bold]{safe(p.host)}[/]: run [bold]{safe(p.run)}[/] queued at position {p.position} "
                      f"({safe(gpus_words(p))}){moved}: {safe(p.why)}", soft_wrap=True, highlight=False)
    else:
        console.print(f"[bold]{safe(p.host)}[/]: run [bold]{safe(p.run)}[/] [red]could not start[/]: "
                      f"{safe(p.error or p.state)}", soft_wrap=True, highlight=False)
        return
    if p.state == "running":
        console.print(f"  follow: {safe(dfo_cmd(ctx, 'tail', p.host, p.run, job_path=job_path))}", highlight=False,
                      soft_wrap=True)
    else:
        console.print(f"  queue:  {safe(dfo_cmd(ctx, 'queue', p.host, job_path=job_path))}", highlight=False,
                      soft_wrap=True)


def placed_json(placed: list[steps.Placed], unreachable: dict[str, str],
                stayed: list[str] | None = None) -> dict[str, Any]:
    hosts: dict[str, Any] = {}
    for p in placed:
        hosts.setdefault(p.host, {"runs": []})["runs"].append(p.model_dump())
    doc: dict[str, Any] = {"hosts": hosts, "unreachable": unreachable}
    if stayed is not None:  # --requeue-from: runs that had started on the lost host, left there
        doc["started_there"] = stayed
    return doc


def dur(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def render_queue(host: str, v: steps.QueueView) -> None:
    free = f"GPU{'s' if len(v.free) > 1 else ''} {','.join(str(g) for g in v.free)}" if v.free else "none"
    other = f"; held outside dfo: {','.join(str(g) for g in v.busy_other)}" if v.busy_other else ""
    src = {"inventory": "the inventory's gpus:", "nvidia-smi": "nvidia-smi"}.get(v.gpus_from or "", "none known")
    console.print(f"[bold]{safe(host)}[/]: {v.gpus} GPU{'s' if v.gpus != 1 else ''} ({safe(src)}); free: "
                  f"{safe(free)}{safe(other)}; {len(v.running)} running, {len(v.queued)} queued", soft_wrap=True,
                  highlight=False)
    if not v.running and not v.queued:
        return
    rows = [("run", "job", "state", "gpus", "pos", "waited", "running")]
    now = v.now or time.time()
    for r in sorted(v.running, key=lambda r: (r.started_ts or 0, r.id)):
        gpus = "all" if r.gpus is None else (",".join(str(g) for g in r.gpus) or "none")
        rows.append((r.id, r.job or "-", "running", gpus, "-", dur(r.waited_s),
                     dur(now - r.started_ts if r.started_ts else None)))
    for q in v.queued:
        rows.append((q.id, q.job or "-", "queued", f"{q.needs} GPU{'s' if q.needs != 1 else ''}", str(q.position),
                     dur(q.waiting_s), "-"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        console.print("  " + "  ".join(safe(str(c)).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(),
                      highlight=False, soft_wrap=True)
    for rid, to in moved_away(host, v):
        what = "takes it out here" if rid in {q.id for q in v.queued} else "stops it here (it started here too)"
        console.print(f"  note: {safe(rid)} was requeued to {safe(to)} from this machine: dfo cancel -H "
                      f"{safe(host)} {safe(rid)} {what}", highlight=False, soft_wrap=True)


def moved_away(host: str, v: steps.QueueView) -> list[tuple[str, str]]:
    """Runs queued or running on ``host`` that this machine has since requeued elsewhere (the host was out of
    reach, then came back: its queue went on meanwhile)."""
    out: list[tuple[str, str]] = []
    ids = [q.id for q in v.queued] + [r.id for r in v.running]
    if not ids:
        return out
    mine = {r.run: r for r in submits.all_records()}  # (looked up by the node's ids, never a path made of them)
    for rid in ids:
        r = mine.get(rid)
        if r is not None and r.host != host and any(m.source == host for m in r.moves):
            out.append((rid, r.host or "?"))
    return out


def note_seen(host: str, queued_ids: Iterable[str], running_ids: Iterable[str], skip: str | None = None) -> None:
    """This machine's records of runs it queued on ``host``: how they stand now, as the node just said (for
    --requeue-from, which moves the ones last seen queued). ``skip``: a run whose record the caller writes."""
    queued, running = set(queued_ids), set(running_ids)
    for r in submits.all_records():
        if r.run == skip:
            continue
        if r.host != host or r.state not in ("queued", "running"):
            continue
        state = "queued" if r.run in queued else "running" if r.run in running else "started"
        if state != r.state:
            r.seen_as(state)


def lost_queue(o: Outcome[Any]) -> list[str]:
    """The runs this machine queued on an unreachable host, as last seen (hint and JSON say them)."""
    if not isinstance(o.error, HostError):
        return []
    return [r.run for r in submits.all_records() if r.host == o.host and r.state == "queued"]
