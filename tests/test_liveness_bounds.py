"""The liveness bounds (orchestrator/transport/liveness.py): dfo's defaults keep the 30 s promise, the environment
may set them (the tests do: tests/conftest.py), a bad value is exit 2 before any connection, and the
watch honours the bounds it is given. No testbed: a stand-in transport."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from orchestrator.errors import ConfigError
from orchestrator.transport import liveness
from orchestrator.transport.liveness import ALIVE_CHECK_S, ALIVE_DEAD_S, ALIVE_INTERVAL_S, Bounds, Liveness, bounds
from tests._cli import cli_env, dfo


def test_the_defaults_keep_the_30_s_promise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFO_ALIVE_INTERVAL_S", raising=False)
    monkeypatch.delenv("DFO_ALIVE_DEAD_S", raising=False)
    assert bounds() == Bounds(ALIVE_INTERVAL_S, ALIVE_DEAD_S) == Bounds(5.0, 20.0)
    assert ALIVE_DEAD_S + ALIVE_CHECK_S < 30  # from a cut link to exit 4, as README and security.md promise


def test_the_environment_sets_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFO_ALIVE_INTERVAL_S", "0.5")
    monkeypatch.setenv("DFO_ALIVE_DEAD_S", " 3 ")
    assert bounds() == Bounds(0.5, 3.0)


@pytest.mark.parametrize(("interval", "dead", "says"), [
    ("", "abc", "DFO_ALIVE_DEAD_S='abc' is not a number"),
    ("", "0", "DFO_ALIVE_DEAD_S='0' is not a number of seconds above 0"),
    ("-1", "", "DFO_ALIVE_INTERVAL_S='-1'"),
    ("", "nan", "DFO_ALIVE_DEAD_S='nan'"),
    ("", "inf", "DFO_ALIVE_DEAD_S='inf'"),
    ("", "4", "DFO_ALIVE_DEAD_S=4 must be above DFO_ALIVE_INTERVAL_S=5"),
    ("2", "2", "must be above"),
])
def test_a_bad_value_is_a_config_error(monkeypatch: pytest.MonkeyPatch, interval: str, dead: str, says: str) -> None:
    monkeypatch.setenv("DFO_ALIVE_INTERVAL_S", interval)
    monkeypatch.setenv("DFO_ALIVE_DEAD_S", dead)
    with pytest.raises(ConfigError) as exc:
        bounds()
    assert says in exc.value.message and exc.value.exit_code == 2


def test_a_bad_value_is_exit_2_before_any_connection(tmp_path: Path) -> None:
    """An SSH host on a closed port: the bad bound is reported (exit 2), not the refused connection (4)."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"defaults: {{known_hosts: {tmp_path / 'kh'}, connect_timeout: 3}}\n"
                   "hosts:\n  n1: {host: 127.0.0.1, port: 9}\n")
    r = dfo(inv, "status", "-H", "n1", env=cli_env(DFO_ALIVE_DEAD_S="soon"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "DFO_ALIVE_DEAD_S='soon' is not a number of seconds above 0" in r.stderr
    assert "refused" not in r.stderr and "Traceback" not in r.stderr


class _Transport:
    """What Liveness needs of paramiko's Transport; ``answer`` False: keepalives are never answered."""

    def __init__(self, answer: bool) -> None:
        self.answer, self.active, self.asked = answer, True, 0
        self._closed = threading.Event()

    def is_active(self) -> bool:
        return self.active

    def global_request(self, kind: str, wait: bool = True) -> None:
        assert kind == liveness.ALIVE_REQUEST and wait
        self.asked += 1
        if not self.answer:
            self._closed.wait()  # paramiko returns once the transport closes

    def close(self) -> None:
        self.active = False
        self._closed.set()


def test_the_watch_honours_its_bounds() -> None:
    dead: list[str] = []
    quiet = _Transport(answer=False)
    t0 = time.monotonic()
    watch = Liveness(quiet, lambda why: (dead.append(why), quiet.close()), "quiet", Bounds(0.05, 0.3))
    while not dead and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    took = time.monotonic() - t0
    watch.stop()
    assert dead and "has not answered for" in dead[0], dead
    assert 0.3 <= took < 0.3 + ALIVE_CHECK_S + 2, took

    alive = _Transport(answer=True)
    calls: list[str] = []
    watch = Liveness(alive, calls.append, "alive", Bounds(0.05, 0.3))
    time.sleep(0.8)  # more than twice the dead bound, keepalives answered all along
    watch.stop()
    alive.close()
    assert calls == [] and alive.asked >= 5, (calls, alive.asked)  # about 16 asked
