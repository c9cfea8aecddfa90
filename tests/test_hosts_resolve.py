"""hosts.resolve_all: on the OpenSSH transport a command's hosts resolve at once (each waits for its own
`ssh -G`), and what comes back, or what is raised, is what resolving them one after another gives."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from orchestrator import hosts
from orchestrator.errors import ConfigError, HostError
from orchestrator.transport import resolve

P = Path("inventory.yaml")


def inv(names: list[str], transport: str | None = "openssh", default: str | None = None) -> Any:
    """What resolve_all reads of an inventory: each host's transport and the defaults'."""
    return SimpleNamespace(hosts={n: SimpleNamespace(transport=transport) for n in names},
                           defaults=SimpleNamespace(transport=default))


class FakeResolve:
    """Stands in for resolve_host. A call for a name in ``hold`` waits (up to 10 s) until ``together``
    calls have been under way at once, or until the call for ``release_after`` has ended (an `ssh -G`
    that takes a while); then it gives the name back or raises what ``fail`` says for it. No timing:
    waits end on events."""

    def __init__(self, hold: set[str] | None = None, together: int = 0, release_after: str | None = None,
                 fail: dict[str, Exception] | None = None) -> None:
        self.hold, self.together, self.release_after = hold or set(), together, release_after
        self.fail = fail or {}
        self.threads: dict[str, str] = {}
        self.ended: list[str] = []
        self.running = self.most = 0
        self.released = False
        self.cond = threading.Condition()

    def __call__(self, inv: Any, name: str, path: Path) -> str:
        with self.cond:
            self.threads[name] = threading.current_thread().name
            self.running += 1
            self.most = max(self.most, self.running)
            if self.together and self.running >= self.together:
                self.released = True
            self.cond.notify_all()
            if name in self.hold:
                assert self.cond.wait_for(lambda: self.released, timeout=10), f"{name} held for 10 s"
        try:
            if name in self.fail:
                raise self.fail[name]
            return f"resolved {name}"
        finally:
            with self.cond:
                self.running -= 1
                self.ended.append(name)
                if name == self.release_after:
                    self.released = True
                self.cond.notify_all()


def test_every_host_comes_back_in_the_order_given_and_the_rest_resolve_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"h{i}" for i in range(8)]
    fake = FakeResolve(hold=set(names[1:]), together=7)  # none of the seven ends before all seven began
    monkeypatch.setattr(resolve, "resolve_host", fake)
    got = hosts.resolve_all(inv(names), names, P)
    assert list(got) == names and all(got[n] == f"resolved {n}" for n in names)  # type: ignore[comparison-overlap]
    assert fake.threads["h0"] == threading.current_thread().name  # the first one fills the caches, alone
    assert {fake.threads[n] for n in names[1:]} == {"dfo-resolve"}
    assert fake.most == 7


def test_the_first_failing_host_in_order_is_raised_not_the_first_to_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["a", "b", "c", "d"]
    # b is held until d has failed; b fails after it
    fake = FakeResolve(hold={"b"}, release_after="d", fail={"b": ConfigError("b: bad port"),
                                                            "d": HostError("d: no ssh -G")})
    monkeypatch.setattr(resolve, "resolve_host", fake)
    with pytest.raises(ConfigError, match="b: bad port"):
        hosts.resolve_all(inv(names), names, P)
    assert fake.ended.index("d") < fake.ended.index("b")  # d failed first; b, first in order, is raised


def test_after_a_failure_no_more_hosts_are_begun(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"h{i}" for i in range(hosts.PARALLEL + 10)]
    late = names[hosts.PARALLEL + 1:]  # more than there are threads: begun only as earlier ones end
    fake = FakeResolve(fail={"h1": HostError("h1: ssh -G failed")})
    monkeypatch.setattr(resolve, "resolve_host", fake)
    with pytest.raises(HostError, match="h1: ssh -G failed"):
        hosts.resolve_all(inv(names), names, P)
    assert "h1" in fake.threads and not set(late) <= set(fake.threads)


def test_at_most_parallel_hosts_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [f"h{i}" for i in range(hosts.PARALLEL + 6)]
    fake = FakeResolve(hold=set(names[1:]), together=hosts.PARALLEL)
    monkeypatch.setattr(resolve, "resolve_host", fake)
    assert list(hosts.resolve_all(inv(names), names, P)) == names
    assert fake.most == hosts.PARALLEL


@pytest.mark.parametrize(("transport", "default", "forced"), [
    ("paramiko", None, None),  # its notes on stderr keep the hosts' order
    ("local", None, None),
    (None, "paramiko", None),
    (None, None, "paramiko"),  # transport: ssh where no OpenSSH client is: the paramiko fallback
])
def test_the_paramiko_fallback_and_local_hosts_resolve_in_the_loop(
        monkeypatch: pytest.MonkeyPatch, transport: str | None, default: str | None, forced: str | None) -> None:
    if forced:
        monkeypatch.setenv("DFO_SSH_TRANSPORT", forced)
    names = ["a", "b", "c", "d"]
    fake = FakeResolve(fail={"b": ConfigError("b: bad")})
    monkeypatch.setattr(resolve, "resolve_host", fake)
    with pytest.raises(ConfigError, match="b: bad"):
        hosts.resolve_all(inv(names, transport, default), names, P)
    assert fake.threads == {"a": threading.current_thread().name, "b": threading.current_thread().name}


def test_two_hosts_or_one_stay_in_this_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeResolve()
    monkeypatch.setattr(resolve, "resolve_host", fake)
    assert list(hosts.resolve_all(inv(["y", "z"]), ["y", "z"], P)) == ["y", "z"]
    assert set(fake.threads.values()) == {threading.current_thread().name}
