"""The generation record's compare-and-swap (remote/runs/generation.py) against both S3 servers of the
testbed: SeaweedFS honours If-Match / If-None-Match, rclone serve s3 ignores them; a stale writer is
refused on both, and the shipper's check sees a newer generation. Then the uploads themselves under the
generation's guard (WriteGuard): an old generation never overwrites a newer one's object."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.testbed.s3 import S3Server, find_binary
from remote.runs import generation as gen
from remote.s3.client import S3Client
from remote.s3.upload import MIB, Uploader, open_uploads
from remote.ship import shipper
from tests.test_shipper import age, make_spec

pytestmark = pytest.mark.testbed


@contextlib.contextmanager
def _server(tmp_path: Path, server: str) -> Iterator[tuple[Any, S3Client]]:
    """One S3 server of the testbed's kinds with a bucket "gens": (its endpoint, a client)."""
    if not find_binary("weed" if server == "seaweedfs" else "rclone"):
        pytest.skip(f"no {server} binary here")
    srv = S3Server(tmp_path / server, "127.0.0.1", server)
    ep = srv.start()
    try:
        ep.create_bucket("gens")
        yield ep, S3Client(ep.url, ep.region, {"access_key": ep.access_key, "secret_key": ep.secret_key})
    finally:
        srv.stop()


@pytest.mark.parametrize("server", ["seaweedfs", "rclone"])
def test_a_stale_writer_is_refused_and_an_old_generation_is_superseded(server: str, tmp_path: Path) -> None:
    with _server(tmp_path, server) as (_ep, c):
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


class _Racer(gen.WriteGuard):
    """A guard whose first look is followed, before the commit, by another writer's upload of the key: the
    window between the check and the write, made to happen."""

    def __init__(self, client: S3Client, bucket: str, mine: int, other: Callable[[], None]) -> None:
        super().__init__(client, bucket, mine)
        self.other: Callable[[], None] | None = other

    def condition(self, key: str, stop: Any = None) -> dict[str, str]:
        cond = super().condition(key, stop)
        if self.other is not None:
            other, self.other = self.other, None
            other()
        return cond


def _put(c: S3Client, bucket: str, generation: int, path: Path, key: str,
         guard: gen.WriteGuard | None = None) -> dict[str, Any]:
    up = Uploader(c, bucket, concurrency=2, part_size=5 * MIB, threshold=6 * MIB,
                  guard=guard or gen.WriteGuard(c, bucket, generation))
    (res,) = up.upload([{"path": str(path), "key": key, "size": path.stat().st_size}])
    return res


def _body(c: S3Client, bucket: str, key: str) -> bytes:
    resp = c.request("GET", bucket, key)
    data = resp.read()
    assert resp.status == 200, (resp.status, data[:200])
    return data


@pytest.mark.parametrize("server", ["seaweedfs", "rclone"])
def test_an_old_generation_never_overwrites_a_newer_ones_object(server: str, tmp_path: Path) -> None:
    """The uploads themselves (remote.runs.generation.WriteGuard), a single PUT and a multipart upload each:
    every object carries its generation; an old generation's upload where a newer one wrote is refused
    (Superseded, nothing committed, no multipart upload left open); a newer one's write that lands between
    the old one's look and its commit is refused by SeaweedFS (412 on the PUT and on the completion, then a
    second look) and gets through on rclone serve s3, which ignores conditions: the window docs/recovery.md
    names; a newer generation is never held back by an older one's write in that gap."""
    with _server(tmp_path, server) as (_ep, c):
        honours = server == "seaweedfs"
        files = {}
        for size, shape in ((1000, "single"), (11 * MIB, "multipart")):
            for g in (1, 2, 3):
                files[shape, g] = tmp_path / f"{shape}-{g}"
                files[shape, g].write_bytes(os.urandom(size))
        for shape in ("single", "multipart"):
            key = f"runs/j/{shape}.pt"
            assert _put(c, "gens", 1, files[shape, 1], key)["ok"]
            assert c.head("gens", key)[gen.META] == "1"
            assert _put(c, "gens", 2, files[shape, 2], key)["ok"]  # a newer generation overwrites an older one
            assert c.head("gens", key)[gen.META] == "2"
            # generation 1 comes back (a partitioned node): refused before anything is sent
            res = _put(c, "gens", 1, files[shape, 1], key)
            assert not res["ok"] and isinstance(res.get("refused"), gen.Superseded), res
            assert res["refused"].generation == 2 and "this upload is not sent" in res["error"], res["error"]
            assert _body(c, "gens", key) == files[shape, 2].read_bytes()
            if honours:  # (rclone serve s3 cannot list multipart uploads)
                assert open_uploads(c, "gens", key) == []
            # the race: generation 3 writes between generation 2's look and its commit
            racer = _Racer(c, "gens", 2, lambda k=key, s=shape: _put(c, "gens", 3, files[s, 3], k))
            res = _put(c, "gens", 2, files[shape, 2], key, guard=racer)
            if honours:  # 412, a second look: generation 3 is there
                assert not res["ok"] and isinstance(res.get("refused"), gen.Superseded), res
                assert _body(c, "gens", key) == files[shape, 3].read_bytes()
            else:  # rclone ignores If-Match: the older write lands (the window the look leaves there)
                assert res["ok"], res
                assert _body(c, "gens", key) == files[shape, 2].read_bytes()
            if honours:
                assert open_uploads(c, "gens", key) == []
            # an older generation's write in the newer one's gap: the newer one still gets through
            racer = _Racer(c, "gens", 4, lambda k=key, s=shape: _put(c, "gens", 3, files[s, 3], k))
            res = _put(c, "gens", 4, files[shape, 1], key, guard=racer)
            assert res["ok"], res
            assert _body(c, "gens", key) == files[shape, 1].read_bytes() and c.head("gens", key)[gen.META] == "4"


def test_a_shipper_pass_of_an_old_generation_stops_at_a_newer_object(tmp_path: Path) -> None:
    """The shipper with the guard: the generation record still says 1 (the check before the pass passes: the
    newer generation started after it), but the key holds generation 2's checkpoint: the pass ships nothing
    over it, says superseded, and asks the trainer to stop (stop.json)."""
    with _server(tmp_path, "seaweedfs") as (ep, c):
        gen.write(c, "gens", "runs/j/", {"generation": 1, "run": "r"}, None)
        newer = tmp_path / "newer.pt"
        newer.write_bytes(b"generation 2's checkpoint")
        assert _put(c, "gens", 2, newer, "runs/j/ckpt.pt")["ok"]
        root, run_dir = tmp_path / "out", tmp_path / "run"
        root.mkdir()
        run_dir.mkdir()
        (run_dir / "meta.json").write_text(json.dumps({"stop_grace": 5}))
        (root / "ckpt.pt").write_bytes(b"generation 1's checkpoint")
        age(root / "ckpt.pt", 60)
        spec = make_spec(ep, root, "s3://gens/runs/j/", generation=1)  # type: ignore[arg-type]
        p = shipper.run_pass(spec, str(run_dir), final=True)
        assert not p["ok"] and p.get("superseded") == 2 and "superseded: generation 2" in p["error"], p
        assert _body(c, "gens", "runs/j/ckpt.pt") == b"generation 2's checkpoint"
        assert json.loads((run_dir / "stop.json").read_text())["why"] == "superseded by generation 2"
        # the same pass for generation 2 (its own record) ships over it
        spec = make_spec(ep, root, "s3://gens/runs/j/", generation=3)  # type: ignore[arg-type]
        p = shipper.run_pass(spec, str(tmp_path), final=True)
        assert p["ok"] and p["files"] == 1, p
        assert c.head("gens", "runs/j/ckpt.pt")[gen.META] == "3"
