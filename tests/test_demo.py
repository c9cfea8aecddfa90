"""`dfo demo`: dfo's whole job (`dfo up`) end to end on a throwaway testbed node, through the real CLI."""

from __future__ import annotations

import os
import re

import pytest

from orchestrator.demo.setup import DEFAULT_WHEELS
from orchestrator.testbed import Testbed
from tests._cli import dfo

pytestmark = pytest.mark.testbed


@pytest.mark.skipif(not any(DEFAULT_WHEELS.glob("torch-*.whl")), reason="no demo wheels: run bash .ci/setup --demo")
@pytest.mark.skipif(bool(Testbed.missing_requirements(s3=True)), reason="testbed cannot start here")
def test_demo_runs_up_end_to_end(tmp_path) -> None:  # type: ignore[no-untyped-def]
    r = dfo(None, "demo", "--steps", "60", "--workdir", str(tmp_path), timeout=600, env=dict(os.environ))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    for step in ("==> provision", "==> stage-model", "==> sync-data", "==> launch", "==> tail"):
        assert step in out
    assert "torch==2.13.0: done" in out or "torch==2.13.0: no change" in out
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+) ", r.stdout, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0]  # steps 20, 40, 60; training works
    assert re.search(r"run demo-\S+ succeeded", out)
    assert "node and S3 endpoint stopped" in out
