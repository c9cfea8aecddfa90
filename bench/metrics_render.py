"""Render a metrics.jsonl recorded on a node (bench/results/gpu/metrics-h200/, made by drv.py there) with dfo's own
code: the `dfo top` table and the `dfo plot` PNG, as the commands would show that run.

    .venv/bin/python bench/metrics_render.py bench/results/gpu/metrics-h200
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

from rich.console import Console

from orchestrator.commands.plot import write_png
from orchestrator.commands.top import render
from orchestrator.steps import metrics as sm
from orchestrator.steps.runs import RunInfo

d = Path(sys.argv[1])
rows = sm.read_jsonl(d / "metrics.jsonl")
t0, t1 = rows[0]["t"], rows[-1]["t"]
info = RunInfo(id="h200-metrics-demo", job="demo", state="running", started_ts=t0, host="h200")
# top, as at the middle of the run (the rows of its first half), with the H200's list price on a rental
mid = [r for r in rows if r["t"] <= (t0 + t1) / 2]
doc = sm.view(info, mid, 3.5, now=mid[-1]["t"])
con = Console(record=True, width=250, force_terminal=False, file=io.StringIO())
con.print(render({"h200": doc}))
(d / "top.txt").write_text(con.export_text())
series = [{"host": "h200", "run": info.id, "metric": m, "xlabel": sm.x_label(rows, m),
           "x": sm.series(rows, m)[0], "y": sm.series(rows, m)[1]} for m in ("loss", "tok_s", "gpu_util", "gpu_power")]
write_png(series, ["loss", "tok_s", "gpu_util", "gpu_power"], d / "plot.png")
print((d / "top.txt").read_text(), end="")
