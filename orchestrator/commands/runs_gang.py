"""A gang's run as one: the summary that `status -H GROUP RUN` adds over its nodes (issue 13)."""

from __future__ import annotations

from typing import Any

from ..cli_common import safe
from ..steps import runs as steps


def gang_summary(outcomes: list[Any]) -> dict[str, Any] | None:
    """{"run", "state", "first_failure": {"host", "how"} | None, "nodes": {host: state}} when the runs
    asked for are one gang's; None otherwise. The first failure is rank 0's record when rank 0
    answers, else the first member's that has one. A node that does not answer is "unreachable"
    (its run may be gone with it: a gang member whose watch declared it lost says "lost")."""
    runs: dict[str, steps.RunInfo] = {}
    for o in outcomes:
        if o.error is None and o.value and o.value[0].gang:
            runs[o.host] = o.value[0]
    if not runs:
        return None
    any_run = next(iter(runs.values()))
    gang = any_run.gang or {}
    hosts = list(gang.get("hosts") or [o.host for o in outcomes])
    nodes: dict[str, str] = {}
    for o in outcomes:
        if o.host in runs:
            nodes[o.host] = runs[o.host].state
        else:
            nodes[o.host] = "unreachable"
    watches = sorted(((r.gang or {}).get("rank", 99), h, (r.gang or {}).get("watch") or {}) for h, r in runs.items())
    first = None
    for _, _, w in watches:  # rank 0 first: the hub's record is the gang's
        if w.get("first_failure"):
            first = w["first_failure"]
            break
    hub = next((w for rank, _, w in watches if rank == 0), {})
    for host, st in (hub.get("members") or {}).items():
        if host in nodes and nodes[host] == "unreachable" and st == "lost":
            nodes[host] = "lost (unreachable)"
    states = [r.state for r in runs.values()]
    if (first or {}).get("how") == "stopped" and not any(s in ("failed", "lost") for s in states):
        state = "stopped"  # dfo stop ended it (a node stopped by hand ends its gang too)
    elif first is not None or any(s in ("failed", "lost") for s in states):
        state = "failed"
    elif all(s == "succeeded" for s in states) and len(runs) == len(hosts):
        state = "succeeded"
    elif any(s == "running" for s in states):
        state = "running"
    else:
        state = "stopped" if all(s in ("stopped", "succeeded") for s in states) else "unknown"
    if first is None and state == "failed":  # nothing recorded by a watch: the first node that failed
        ended = sorted((r.ended_ts or 0, h) for h, r in runs.items() if r.state in ("failed", "lost"))
        if ended:
            r = runs[ended[0][1]]
            how = "lost" if r.state == "lost" else (f"exit {r.exit_code}" if r.exit_code is not None else str(r.signal))
            first = {"host": ended[0][1], "how": how}
    return {"run": any_run.id, "state": state, "first_failure": first, "nodes": nodes}


def gang_line(gang: dict[str, Any]) -> str:
    ff = gang.get("first_failure")
    nodes = ", ".join(f"{h} {s}" for h, s in gang["nodes"].items())
    failed = f"; first failure: {ff['host']} ({ff['how']})" if ff else ""
    return safe(f"gang {gang['run']}: {gang['state']}{failed} [{nodes}]")
