"""The node side's choice of a run (remote.runs.ops.resolve): pure logic over a folder of run records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from remote._proto import RemoteError
from remote.runs import ops as runs


def _workspace(tmp_path: Path) -> Path:
    root = tmp_path / ".dfo" / "runs"
    for i, rid in enumerate(["job-a-1", "job-a-2"]):
        (root / rid).mkdir(parents=True)
        (root / rid / "meta.json").write_text(json.dumps({"job": "job", "started_ts": 1000 + i}))
    return tmp_path


@pytest.mark.parametrize("run", ["", "   "])
def test_an_empty_run_id_is_refused_on_the_node_too(tmp_path: Path, run: str) -> None:
    ws = _workspace(tmp_path)
    for op in ("status", "stop", "follow"):
        with pytest.raises(RemoteError) as e:
            runs.resolve({"op": op, "workspace": str(ws), "run": run})
        assert e.value.kind == "usage" and "empty" in e.value.message


def test_stop_without_a_run_id_is_refused_but_status_takes_the_newest(tmp_path: Path) -> None:
    ws = _workspace(tmp_path)
    with pytest.raises(RemoteError) as e:
        runs.resolve({"op": "stop", "workspace": str(ws), "run": None})
    assert e.value.kind == "usage"
    assert runs.resolve({"op": "status", "workspace": str(ws), "run": None})[0] == "job-a-2"
    assert runs.resolve({"op": "status", "workspace": str(ws), "run": "job-a-1"})[0] == "job-a-1"
