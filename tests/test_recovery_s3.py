"""The generation record's compare-and-swap (remote/runs/generation.py) against both S3 servers of the
testbed: SeaweedFS honours If-Match / If-None-Match, rclone serve s3 ignores them; a stale writer is
refused on both, and the shipper's check sees a newer generation."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.testbed.s3 import S3Server, find_binary
from remote.runs import generation as gen
from remote.s3.client import S3Client

pytestmark = pytest.mark.testbed


@pytest.mark.parametrize("server", ["seaweedfs", "rclone"])
def test_a_stale_writer_is_refused_and_an_old_generation_is_superseded(server: str, tmp_path: Path) -> None:
    if not find_binary("weed" if server == "seaweedfs" else "rclone"):
        pytest.skip(f"no {server} binary here")
    srv = S3Server(tmp_path / server, "127.0.0.1", server)
    ep = srv.start()
    try:
        ep.create_bucket("gens")
        c = S3Client(ep.url, ep.region, {"access_key": ep.access_key, "secret_key": ep.secret_key})
        assert gen.read(c, "gens", "runs/j/") == (None, None)
        doc, e1 = gen.write(c, "gens", "runs/j/", {"generation": 1, "run": "r"}, None)
        with pytest.raises(gen.Conflict):  # it exists now: a second creator loses
            gen.write(c, "gens", "runs/j/", {"generation": 1, "run": "other"}, None)
        _, e2 = gen.write(c, "gens", "runs/j/", dict(doc, generation=2, run="r.g2"), e1)
        with pytest.raises(gen.Conflict):  # a writer that read generation 1 is refused
            gen.write(c, "gens", "runs/j/", dict(doc, generation=2, run="r.g2-again"), e1)
        now, e_now = gen.read(c, "gens", "runs/j/")
        assert now is not None and now["run"] == "r.g2" and e_now == e2
        # the shipper's check: generation 1's run is superseded, generation 2's is not, a plain job never
        assert gen.superseded(c, "gens", "runs/j/", {"generation": 1}) == 2
        assert gen.superseded(c, "gens", "runs/j/", {"generation": 2}) is None
        assert gen.superseded(c, "gens", "runs/j/", {}) is None
        assert gen.superseded(c, "gens", "runs/other/", {"generation": 1}) is None
    finally:
        srv.stop()
