"""The test lanes (tests/conftest.py): testbed marks set by themselves, a test that starts a testbed
unmarked fails, and under DFO_STRICT_SKIPS=1 (.ci/run) a skip whose reason tests/allowed_skips.txt does
not list fails the run, in one process and under pytest-xdist. Each check runs pytest in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SLOW, _read_list

ROOT = Path(__file__).resolve().parents[1]
PROBE = "tests/test_lanes.py::test_probe"


def test_probe() -> None:
    """Does nothing, except for the runs below: skips with $DFO_LANES_PROBE_SKIP, or starts a testbed
    (unmarked) with $DFO_LANES_PROBE_TESTBED."""
    if os.environ.get("DFO_LANES_PROBE_SKIP"):
        pytest.skip(os.environ["DFO_LANES_PROBE_SKIP"])
    if os.environ.get("DFO_LANES_PROBE_TESTBED"):  # in a subprocess, as `dfo demo` starts one
        code = "import sys; from orchestrator.testbed import Testbed; Testbed(sys.argv[1], s3=False).start()"
        r = subprocess.run([sys.executable, "-c", code, os.environ["DFO_LANES_PROBE_TESTBED"]], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr


def _pytest(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """pytest in a subprocess, its temp folder inside ``tmp``: pytest's default one, beside this session's,
    would also remove the older runs' folders there (seconds to a minute of deleting, and not the test's to
    touch)."""
    mine = ("DFO_LANES_", "DFO_STRICT", "DFO_TEST_TIMELINE", "PYTEST_")  # this session's, not the inner run's
    e = {k: v for k, v in os.environ.items() if not k.startswith(mine)}
    e.pop("DFO_TESTBED_FORBIDDEN", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp",
                           str(tmp / "inner-pytest"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**e, **env})


def test_an_unlisted_skip_fails_a_strict_run(tmp_path: Path) -> None:
    """Under pytest-xdist, as CI runs: the workers' reports reach the controller's check."""
    r = _pytest(tmp_path, "-n", "2", PROBE, DFO_STRICT_SKIPS="1", DFO_LANES_PROBE_SKIP="frobnicate is not installed")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "skips not allowed (DFO_STRICT_SKIPS=1)" in r.stdout
    assert f"{PROBE}: frobnicate is not installed" in r.stdout, r.stdout


def test_a_listed_skip_passes_a_strict_run(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "-n", "0", PROBE, DFO_STRICT_SKIPS="1", DFO_LANES_PROBE_SKIP="no CUDA GPU")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 skipped" in r.stdout and "not allowed" not in r.stdout


def test_an_unlisted_skip_outside_ci_is_only_reported(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "-n", "0", PROBE, DFO_LANES_PROBE_SKIP="frobnicate is not installed")
    assert r.returncode == 0 and "SKIPPED" in r.stdout and "not allowed" not in r.stdout, r.stdout


def test_an_unmarked_test_that_starts_a_testbed_fails(tmp_path: Path) -> None:
    r = _pytest(tmp_path, "-n", "0", PROBE, DFO_LANES_PROBE_TESTBED=str(tmp_path / "tb"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "started a testbed but is not marked testbed" in r.stdout, r.stdout
    assert not (tmp_path / "tb").exists()  # refused before anything was made


def test_tests_that_use_the_testbed_are_marked_by_themselves(tmp_path: Path) -> None:
    """Files that mark nothing by hand (test_code, test_pull) and a fixture built on one (test_outputs_node's):
    their testbed tests leave the unit lane, their unit tests stay."""
    r = _pytest(tmp_path, "-n", "0", "--collect-only", "-m", "testbed", "tests/test_code.py", "tests/test_pull.py",
                "tests/test_outputs_node.py", "tests/test_gang.py")
    assert r.returncode == 0, r.stdout + r.stderr
    testbed = {line for line in r.stdout.splitlines() if "::" in line}
    for f in ("test_code", "test_pull", "test_outputs_node", "test_gang"):
        assert any(t.startswith(f"tests/{f}.py::") for t in testbed), (f, testbed)
    assert "tests/test_gang.py::test_stop_on_the_group_stops_every_node" in testbed  # its own 3-node fixture
    assert "tests/test_pull.py::test_pull_resumes_and_checks_the_whole_file" in testbed  # penv, on testbed
    assert "tests/test_code.py::test_sync_code_imports_the_ssh_layer_only_when_it_connects" not in testbed


def test_the_lists_name_tests_that_exist() -> None:
    """Every SLOW entry names a test function that exists; every allowed skip says why."""
    for entry in SLOW:
        file, _, name = entry.partition("::")
        assert f"def {name.split('[')[0]}(" in (ROOT / "tests" / file).read_text(), entry
    allowed = _read_list("allowed_skips.txt")
    assert allowed and all(why for _, why in allowed), allowed


def test_a_serial_test_waits_for_the_others_and_holds_back_new_ones(tmp_path: Path) -> None:
    """The lanes lock (flock on files in the session's shared folder): a serial holder waits until the
    shared holders leave, and a shared one that comes while it waits gets in only after it."""
    import threading
    import time

    from tests.conftest import _lanes_lock

    order: list[str] = []
    first_in, serial_waiting, release_first = threading.Event(), threading.Event(), threading.Event()

    def hold(name: str, exclusive: bool, entered: threading.Event | None = None,
             until: threading.Event | None = None) -> None:
        with _lanes_lock(tmp_path, exclusive):
            order.append(f"{name} in")
            if entered is not None:
                entered.set()
            if until is not None:
                assert until.wait(10)
            order.append(f"{name} out")

    a = threading.Thread(target=hold, args=("a", False, first_in, release_first))
    a.start()
    assert first_in.wait(10)
    s = threading.Thread(target=lambda: (serial_waiting.set(), hold("serial", True)))
    s.start()
    assert serial_waiting.wait(10)
    time.sleep(0.2)  # the serial one now waits on the lock, holding the turnstile
    c = threading.Thread(target=hold, args=("c", False))
    c.start()
    time.sleep(0.2)
    assert order == ["a in"]  # neither got in beside a
    release_first.set()
    for t in (a, s, c):
        t.join(10)
    assert order == ["a in", "a out", "serial in", "serial out", "c in", "c out"], order
