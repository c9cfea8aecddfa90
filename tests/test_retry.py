"""remote.lib.retry, the node's one retry loop (issue 11, "Boundaries that leak"): unit tests with a fake
sleep and random source; then sync-data through a fault proxy in front of the testbed's SeaweedFS that
answers 503, 429, SlowDown or resets the connection (tests/test_retry.py::test_sync_data_heals_*)."""

from __future__ import annotations

import json
import os
import secrets
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.testbed import Testbed
from orchestrator.testbed.proxy import FAULT_MODES, FaultProxy
from remote.lib.retry import ATTEMPTS, BASE_S, CAP_S, Stopped, backoff, parse_retry_after, retry
from tests._s3_fixtures import MIB, Dataset, Xfer, upload


class Flaky(Exception):
    def __init__(self, retryable: bool = True, retry_after: float | None = None) -> None:
        super().__init__("flaky")
        self.retryable = retryable
        self.retry_after = retry_after


def failing(n: int, exc: Exception | None = None, result: str = "ok") -> tuple[list[int], object]:
    calls: list[int] = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= n:
            raise exc if exc is not None else Flaky()
        return result

    return calls, fn


def test_full_jitter_sleeps_within_bounds_and_succeeds() -> None:
    sleeps: list[float] = []
    calls, fn = failing(4)
    for r in (0.0, 0.5, 0.999):
        sleeps.clear()
        calls.clear()
        assert retry(fn, attempts=5, base=0.5, cap=3.0, sleep=sleeps.append, rand=lambda r=r: r) == "ok"
        assert len(calls) == 5
        bounds = [min(3.0, 0.5 * 2 ** k) for k in range(4)]  # 0.5, 1, 2, 3 (capped)
        assert sleeps == pytest.approx([r * b for b in bounds])
    # the real random source: every sleep between 0 and its bound
    for _ in range(50):
        sleeps.clear()
        calls.clear()
        retry(fn, attempts=5, base=0.5, cap=3.0, sleep=sleeps.append)
        assert all(0 <= s <= b for s, b in zip(sleeps, [0.5, 1, 2, 3], strict=True))


def test_gives_up_after_attempts_with_the_last_error() -> None:
    sleeps: list[float] = []
    calls, fn = failing(99)
    with pytest.raises(Flaky) as info:
        retry(fn, attempts=3, sleep=sleeps.append, rand=lambda: 1.0)
    assert len(calls) == 3 and len(sleeps) == 2  # no sleep after the last attempt
    assert info.value.attempts == 3
    assert sleeps == [BASE_S, BASE_S * 2]
    assert ATTEMPTS >= 3 and CAP_S >= BASE_S


def test_non_retryable_raises_at_once() -> None:
    sleeps: list[float] = []
    calls, fn = failing(5, Flaky(retryable=False))
    with pytest.raises(Flaky):
        retry(fn, sleep=sleeps.append)
    assert (len(calls), sleeps) == (1, [])
    calls, fn = failing(5, ValueError("a bug, not the network"))
    with pytest.raises(ValueError):
        retry(fn, sleep=sleeps.append)
    assert (len(calls), sleeps) == (1, [])
    # a predicate of the caller's decides instead of the attribute
    calls, fn = failing(2, KeyError("x"))
    assert retry(fn, retry_on=lambda e: isinstance(e, KeyError), sleep=sleeps.append, rand=lambda: 0.0) == "ok"
    assert len(calls) == 3


def test_retry_after_is_honoured_and_capped() -> None:
    sleeps: list[float] = []
    calls, fn = failing(2, Flaky(retry_after=2.5))
    retry(fn, base=0.1, cap=4.0, sleep=sleeps.append, rand=lambda: 0.5)
    assert sleeps == [2.5, 2.5]  # the server's word over a shorter jittered wait
    sleeps.clear()
    calls, fn = failing(1, Flaky(retry_after=3600))
    retry(fn, base=0.1, cap=4.0, sleep=sleeps.append, rand=lambda: 0.5)
    assert sleeps == [4.0]  # never an hour on a node's clock
    assert backoff(3, base=1, cap=100, rand=lambda: 1.0, retry_after=0.5) == 8  # a longer backoff stays
    assert (parse_retry_after("7"), parse_retry_after(" 1.5 "), parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            parse_retry_after("-3"), parse_retry_after(None)) == (7.0, 1.5, None, None, None)


def test_on_retry_sees_each_failure() -> None:
    seen: list[tuple[int, float]] = []
    calls, fn = failing(2)
    retry(fn, on_retry=lambda exc, attempt, delay: seen.append((attempt, delay)), sleep=lambda s: None,
          rand=lambda: 1.0)
    assert seen == [(0, BASE_S), (1, BASE_S * 2)]


def test_stop_ends_the_sleep_at_once() -> None:
    stop = threading.Event()
    calls, fn = failing(99)
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        retry(fn, attempts=5, base=60.0, cap=60.0, stop=stop, rand=lambda: 1.0)  # would sleep 60 s
    assert time.monotonic() - t0 < 5
    assert len(calls) == 1
    # already set: no sleep at all, and a Stopped from fn itself is never retried
    sleeps: list[float] = []
    with pytest.raises(Stopped):
        retry(fn, stop=stop, sleep=sleeps.append)
    assert sleeps == []
    calls, fn = failing(5, Stopped())
    with pytest.raises(Stopped):
        retry(fn, sleep=sleeps.append)
    assert len(calls) == 1


def test_no_hand_written_retry_loops_left_on_the_node() -> None:
    """The node's S3 code goes through remote.lib.retry: no other loop sleeps between attempts."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "remote"
    found = []
    for p in sorted(root.glob("s3/*.py")):
        text = p.read_text()
        if re.search(r"for attempt in|RETRIES\b|_backoff\(", text):
            found.append(p.name)
    assert found == []


# --------------------------------------------------------------------------- faults through a real S3 server

SMALL = {f"s/f-{i:02d}.bin": bytes([i]) * (20000 + i) for i in range(6)}
BIG = "big/b-9m.bin"  # above the jobs' 8 MiB threshold: a HEAD, then two 5 MiB ranged parts
ONE = "s/f-03.bin"


@pytest.fixture(scope="module")
def faultset(testbed: Testbed) -> Dataset:
    files = dict(SMALL)
    files[BIG] = os.urandom(9 * MIB)
    return upload(testbed, "retry-" + secrets.token_hex(3), "d/", files)


@pytest.fixture
def proxied(testbed: Testbed, tmp_path: Path) -> Iterator[Callable[..., tuple[FaultProxy, Xfer]]]:
    """make(mode, **FaultProxy options) -> (a started fault proxy before the testbed's S3, an Xfer using it)."""
    made: list[tuple[FaultProxy, Xfer]] = []

    def make(mode: str, **kw: Any) -> tuple[FaultProxy, Xfer]:
        assert testbed.s3 is not None
        proxy = FaultProxy(testbed.s3, testbed.bridge_address or "127.0.0.1", mode, **kw)
        x = Xfer(testbed, tmp_path)
        x.s3 = proxy.start()
        made.append((proxy, x))
        return proxy, x

    yield make
    for proxy, x in made:
        proxy.stop()
        x.sh(f"rm -rf {shlex.quote(x.base)}", check=False)


def _sync(x: Xfer, ds: Dataset) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], str, float]:
    dest = f"{x.base}/data"
    t0 = time.monotonic()
    r = x.dfo("sync-data", "-H", x.node.name, "-j", str(x.job(data={"source": ds.source, "dest": dest})), "--json")
    doc = json.loads(r.stdout)["hosts"][x.node.name] if r.stdout.strip() else {}
    return r, doc, dest, time.monotonic() - t0


def _healed(x: Xfer, ds: Dataset, proxy: FaultProxy, faults: int) -> None:
    r, doc, dest, _ = _sync(x, ds)
    assert r.returncode == 0, r.stderr
    assert (doc["fetched"], doc["bytes"]) == (len(ds.files), ds.total), doc  # retried bytes counted once
    assert x.digests(dest) == ds.digests()
    assert x.sh(f"ls -A {shlex.quote(dest)}/.dfo/tmp").stdout == ""
    assert proxy.faults == faults, proxy.log
    bad = [e for e in proxy.log if e[3] in (0, 429, 503)]
    assert len(bad) >= faults, proxy.log  # the faults were answered (a reset-body may also cut a HEAD)


@pytest.mark.testbed
@pytest.mark.parametrize("mode", FAULT_MODES)
def test_sync_data_heals_object_faults(proxied: Callable[..., tuple[FaultProxy, Xfer]], faultset: Dataset,
                                       mode: str) -> None:
    """The first 3 object GETs answer 503 / 429 / SlowDown, or lose their connection (before the answer, or
    in the middle of the body): sync-data retries them and ends verified."""
    proxy, x = proxied(mode, target="object", count=3)
    _healed(x, faultset, proxy, 3)


@pytest.mark.testbed
@pytest.mark.parametrize(("mode", "target", "count"), [("status-503", "list", 4), ("reset", "list", 3),
                                                       ("slowdown", "head", 4), ("reset", "head", 2)])
def test_sync_data_heals_list_and_head_faults(proxied: Callable[..., tuple[FaultProxy, Xfer]], faultset: Dataset,
                                              mode: str, target: str, count: int) -> None:
    """A listing page and the big object's HEAD are asked again too (4 failures in a row: the listing
    used to give up after 3)."""
    proxy, x = proxied(mode, target=target, count=count)
    _healed(x, faultset, proxy, count)


@pytest.mark.testbed
def test_sync_data_heals_a_random_fraction(proxied: Callable[..., tuple[FaultProxy, Xfer]], faultset: Dataset) -> None:
    proxy, x = proxied("reset-body", target="any", fraction=0.5, count=4)
    _healed(x, faultset, proxy, 4)


@pytest.mark.testbed
def test_retry_after_is_honoured(proxied: Callable[..., tuple[FaultProxy, Xfer]], faultset: Dataset) -> None:
    """A 429 with Retry-After: 1 is asked again no sooner than a second later (full jitter alone waits
    at most 0.25 s after a first failure)."""
    proxy, x = proxied("status-429", path=ONE, count=1, retry_after="1")
    _healed(x, faultset, proxy, 1)
    times = [t for e, t in zip(proxy.log, proxy.times, strict=True) if e[1].endswith(ONE)]
    assert len(times) == 2 and times[1] - times[0] >= 0.95, times


@pytest.mark.testbed
@pytest.mark.parametrize(("mode", "code", "words"), [("status-503", 3, "ServiceUnavailable (HTTP 503)"),
                                                     ("slowdown", 3, "SlowDown (HTTP 503)"),
                                                     ("reset", 4, "connection lost")])
def test_persistent_fault_is_a_clear_error(proxied: Callable[..., tuple[FaultProxy, Xfer]], faultset: Dataset,
                                           mode: str, code: int, words: str) -> None:
    """One object that never heals: the same exit code as before the retry helper, the object, the status and
    the attempts named, within bounded time; the other objects' finished files are kept, no temp left."""
    proxy, x = proxied(mode, path=ONE)
    r, _, dest, seconds = _sync(x, faultset)
    assert r.returncode == code, (r.returncode, r.stderr)
    out = r.stdout + r.stderr
    assert words in out and ONE in out and "gave up after 5 attempts" in out, out
    assert "Traceback" not in out
    assert seconds < 60
    whole = [e for e in proxy.log if e[1].endswith(ONE) and e[0] == "GET"]
    assert len(whole) == (10 if mode == "reset" else 5), whole  # a reset is also reopened once at once
    assert x.sh(f"ls -A {shlex.quote(dest)}/.dfo/tmp").stdout == ""
