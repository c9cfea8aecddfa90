"""Speed choices of the node's S3 engine that a refactor could silently undo (no testbed needed).

The figures behind each one are in docs/benchmarks.md (## sync-data)."""
from __future__ import annotations

from remote.s3 import client as s3client


def test_the_receive_buffer_fits_a_cores_l2_cache() -> None:
    # Each chunk is received into this buffer, then written into the page cache with pwrite() and
    # hashed: with 1 MiB the pwrite copy read its source from L3/DRAM and took ~50% of the engine's
    # CPU (perf: copy_folio_from_iter_atomic); with 256 KiB it stays in L2 (512 KiB per core on the
    # testbed's EPYC) and the engine needs about half the CPU for the 4 x 256 MiB case.
    assert 64 << 10 <= s3client.BUF_SIZE <= 256 << 10
