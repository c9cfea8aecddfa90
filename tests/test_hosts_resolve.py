"""hosts.resolve_all: a command's hosts resolve at once (each waits for its own `ssh -G`), and what comes
back, or what is raised, is what resolving them one after another gives."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator import hosts
from orchestrator.errors import ConfigError, HostError
from orchestrator.transport import resolve


class FakeResolve:
    """Stands in for resolve_host: each call waits ``wait[name]`` seconds (an `ssh -G` that takes that long),
    then gives the name back or raises what ``fail`` says for it."""

    def __init__(self, wait: dict[str, float], fail: dict[str, Exception] | None = None) -> None:
        self.wait, self.fail = wait, fail or {}
        self.threads: dict[str, str] = {}
        self.running = self.most = 0
        self.lock = threading.Lock()

    def __call__(self, inv: Any, name: str, path: Path) -> str:
        with self.lock:
            self.threads[name] = threading.current_thread().name
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(self.wait.get(name, 0.0))
            if name in self.fail:
                raise self.fail[name]
            return f"resolved {name}"
        finally:
            with self.lock:
                self.running -= 1


def test_every_host_comes_back_in_the_order_given(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"h{i}" for i in range(8)]
    fake = FakeResolve({n: 0.5 - 0.05 * i for i, n in enumerate(names)})  # the later the name, the sooner done
    monkeypatch.setattr(resolve, "resolve_host", fake)
    got = hosts.resolve_all(object(), names, Path("inv.yaml"))  # type: ignore[arg-type]
    assert list(got) == names and all(got[n] == f"resolved {n}" for n in names)  # type: ignore[comparison-overlap]
    assert fake.threads["h0"] == threading.current_thread().name  # the first one fills the caches, alone
    assert {fake.threads[n] for n in names[1:]} == {"dfo-resolve"}
    assert fake.most == 7  # the other seven at once


def test_the_first_failing_host_in_order_is_raised_not_the_first_to_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["a", "b", "c", "d"]
    fake = FakeResolve({"b": 0.3, "d": 0.0}, {"b": ConfigError("b: bad port"), "d": HostError("d: no ssh -G")})
    monkeypatch.setattr(resolve, "resolve_host", fake)
    with pytest.raises(ConfigError, match="b: bad port"):
        hosts.resolve_all(object(), names, Path("inv.yaml"))  # type: ignore[arg-type]
    assert set(fake.threads) == set(names)  # every host was tried (none left running behind the error)


def test_one_host_and_a_failing_first_host_stay_in_this_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeResolve({}, {"a": ConfigError("a: unknown host")})
    monkeypatch.setattr(resolve, "resolve_host", fake)
    assert hosts.resolve_all(object(), ["z"], Path("i")) == {"z": "resolved z"}  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a: unknown host"):
        hosts.resolve_all(object(), ["a", "b"], Path("i"))  # type: ignore[arg-type]
    assert "b" not in fake.threads  # as the loop did: nothing after the first host's error


def test_at_most_parallel_hosts_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"h{i}" for i in range(hosts.PARALLEL + 6)]
    fake = FakeResolve({n: 0.3 for n in names})
    monkeypatch.setattr(resolve, "resolve_host", fake)
    assert list(hosts.resolve_all(object(), names, Path("i"))) == names  # type: ignore[arg-type]
    assert fake.most == hosts.PARALLEL
