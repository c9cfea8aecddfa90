"""Shared fixtures. Each block is owned by one topic; append new blocks below, keep them delimited."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# ============================================================================================
# bytecode: the suite starts hundreds of dfo processes (and its node modules on local nodes); with
# PYTHONDONTWRITEBYTECODE set, each one compiled dfo's modules from source again (about 60 ms of CPU a
# run). The suite lets Python write its bytecode where it always does (__pycache__ beside each module,
# ignored by git), for this process and every process it starts. Not PYTHONPYCACHEPREFIX: under a
# prefix Python looks for no other bytecode, so every torch import compiled torch from source.
# ============================================================================================
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# ============================================================================================
# testbed fixtures (orchestrator/testbed/__init__.py): real sshd nodes + a real S3 server on this machine
#
#   testbed        session: 1 node + S3. Shared: do not rotate its host key or leave its link down.
#   testbed2       module: 2 nodes + S3.
#   make_testbed   function: make_testbed(nodes=1, s3=True, shm_size="256m") -> a private Testbed,
#                  stopped after the test. Use it for tests that change a node (host key, link).
#
# DFO_TESTBED_NETNS=0 forces the loopback fallback (no root features); =1 requires namespaces.
# Tests are skipped, with the reason, when sshd / ssh-keygen / an S3 server binary is missing.
# ============================================================================================
from orchestrator.testbed import Testbed  # noqa: E402


def _netns_choice() -> bool | None:
    v = os.environ.get("DFO_TESTBED_NETNS", "").strip().lower()
    return {"0": False, "no": False, "false": False, "1": True, "yes": True, "true": True}.get(v)


def start_testbed(workdir: Path, **kw: object) -> Testbed:
    """Start a Testbed, or skip the calling test with the reason it cannot start here."""
    kw.setdefault("use_netns", _netns_choice())
    missing = Testbed.missing_requirements(bool(kw.get("s3", True)), kw["use_netns"])  # type: ignore[arg-type]
    if missing:
        pytest.skip("testbed unavailable: " + "; ".join(missing))
    return Testbed(workdir, **kw).start()  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    tb = start_testbed(tmp_path_factory.mktemp("testbed"), nodes=1, s3=True)
    try:
        yield tb
    finally:
        tb.stop()


@pytest.fixture(scope="module")
def testbed2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    tb = start_testbed(tmp_path_factory.mktemp("testbed2"), nodes=2, s3=True)
    try:
        yield tb
    finally:
        tb.stop()


@pytest.fixture
def make_testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Testbed]]:
    started: list[Testbed] = []

    def make(nodes: int = 1, s3: bool = True, shm_size: str = "256m", **kw: object) -> Testbed:
        tb = start_testbed(tmp_path_factory.mktemp("tb"), nodes=nodes, s3=s3, shm_size=shm_size, **kw)
        started.append(tb)
        return tb

    yield make
    for tb in started:
        tb.stop()

# ============================================================================================
# end of testbed fixtures
# ============================================================================================


# ============================================================================================
# test lanes: markers set automatically, short timeouts for tests, skips that CI allows
#
#   pytest -m "not testbed"     the unit lane (no sshd, no S3 server; the CPU-torch trainer tests too)
#   pytest -m "not testbed and not slow"   the quick lane, while you work
#   pytest -m "not slow"        everything but the tests of 20 s or more
#   pytest tests/test_fleet.py  one file (the testbed starts on demand)
#
# testbed: set on every test that uses a testbed fixture (testbed, testbed2, make_testbed, or a fixture
#   that uses one of them), or a fixture/test whose code starts a Testbed, an S3Server or start_testbed
#   itself; the hand-written marks (`dfo demo` runs start one in a subprocess) stay. A test that starts
#   a testbed without the mark fails (DFO_TESTBED_FORBIDDEN), so the unit lane cannot grow one unseen.
# slow: SLOW below lists them (20 s or more on a 2-core machine, measured; keep it up to date).
# serial: runs alone (no other test of this session at the same time, under pytest-xdist too): tests
#   that time themselves or change the checkout's .venv.
# Timeouts: the tests' dfo processes (and in-process connections) see DFO_ALIVE_INTERVAL_S=1 and
#   DFO_ALIVE_DEAD_S=4 (production: 5 and 20; orchestrator/transport/liveness.py), unless already set.
# DFO_STRICT_SKIPS=1 (.ci/run sets it): the run fails when a test skipped for a reason that
#   tests/allowed_skips.txt does not list (one regular expression per line, with why).
# ============================================================================================
import fcntl  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

HERE = Path(__file__).resolve().parent
TEST_TIMEOUTS = {"DFO_ALIVE_INTERVAL_S": "1", "DFO_ALIVE_DEAD_S": "4"}
TESTBED_FIXTURES = {"testbed", "testbed2", "make_testbed"}
TESTBED_NAMES = {"Testbed", "start_testbed", "S3Server"}  # a function that names one of these starts one
FORBID_ENV = "DFO_TESTBED_FORBIDDEN"
# "file.py::test" (all its cases) or "file.py::test[case]": 20 s or more on its own on the 2-core machine
# (30 s or more in a full parallel run there), or torch on the CPU. Measured: keep it up to date.
SLOW: set[str] = {
    # the demo trainer with torch: in this process's Python (CPU torch from the demo's wheels) or on nodes
    "test_demo.py::test_demo_runs_up_end_to_end",
    "test_demo_ddp.py::test_ranks_log_one_all_reduced_loss_and_resume_from_rank0s_checkpoint",
    "test_demo_ddp.py::test_a_rank_that_exits_1_ends_the_run_non_zero",
    "test_demo_ddp.py::test_a_planned_stop_saves_the_step_it_ended_on_and_the_next_run_resumes_there",
    "test_pairs.py::test_two_pairs_train_in_threads_loss_falls_and_twice_the_tokens",
    "test_pairs.py::test_pairs_resume_from_checkpoint",
    "test_pairs.py::test_pairs_with_replicas_is_a_usage_error",
    "test_pairs.py::test_grads_are_averaged_over_pairs_and_drafters_stay_equal",  # importing torch: 2-4 s
    "test_pairs.py::test_pair_devices_on_cpu",
    "test_autotune_guard_cpu.py::test_gdn_reference_matches_a_hand_computation",
    "test_gang.py::test_demo_ddp_on_a_gang_of_three_logs_one_all_reduced_loss",
    "test_node_dies.py::test_a_node_dies_and_the_run_goes_on",
    "test_hardening_newcomer.py::test_demo_leaves_nothing_behind",
    "test_hardening_newcomer.py::test_demo_with_workdir_keeps_it_and_says_what_is_there",
    "test_startup.py::test_installed_wheel_runs_the_demo_outside_a_checkout",
    # whole stories, many dfo runs, or a node-side bound (the gang watch's 20 s silence, sshd noticing a
    # dead session, launch --wait's reconnect budget)
    "test_node_dies.py::test_a_node_dies_and_the_run_goes_on_without_torch",
    "test_gang.py::test_a_vanished_node_ends_the_others_and_shows_as_lost",
    "test_metrics_node.py::test_a_lost_node_is_reported_by_another_node_of_the_gang",
    "test_health_gate.py::test_up_and_launch_stop_at_the_gate_and_go_once_it_passes",  # the GPU health gate
    "test_health_gate.py::test_a_spare_that_fails_the_gate_is_skipped_for_the_next",
    "test_recovery.py::test_a_lost_node_is_replaced_by_a_spare",  # recovery (issue 20): whole stories
    "test_recovery.py::test_a_killed_trainer_is_restarted_and_exit_1_is_not",
    "test_recovery.py::test_a_watcher_killed_mid_recovery_finishes_it_when_started_again",
    "test_recovery.py::test_a_partitioned_node_that_comes_back_is_fenced",
    "test_recovery_gang.py::test_a_gang_loses_rank_0_and_a_spare_takes_its_rank",
    "test_recovery_gang.py::test_a_gang_restarts_on_sigkill_and_not_on_exit_1",
    "test_recovery_gang.py::test_a_ddp_gang_loses_a_node_then_a_worker_and_goes_on",  # torch on 3 nodes: ~4 min
    "test_recovery_gang.py::test_a_ddp_gang_whose_rank_exits_1_is_not_restarted",  # torch on 2 nodes
    "test_recovery.py::test_a_lost_node_with_no_healthy_spare_fails_after_a_bounded_wait",
    "test_fleet.py::test_exec_ctrl_c_ends_the_commands_on_the_node",
    "test_hardening_cli.py::test_printed_commands_work_when_pasted",
    "test_hardening_dest.py::test_dangerous_dests_are_refused",
    "test_hardening_dest.py::test_dest_owned_or_writable_by_others_is_refused",
    "test_hardening_dest.py::test_symlinks_inside_dest_are_never_followed",
    "test_hardening_link.py::test_launch_wait_on_a_cut_link_exits_4_within_30s_and_the_run_goes_on",
    "test_hardening_link.py::test_sync_data_on_a_cut_link_exits_4_within_30s_and_a_rerun_resumes",
    "test_hardening_s3compat.py::test_sync_data_big_objects",
    "test_hardening_secrets.py::test_package_line_credentials_never_leak",
    "test_outputs_cli.py::test_outputs_shows_what_was_shipped_and_ship_makes_a_pass",
    "test_outputs_cli.py::test_restore_fetches_dest_into_an_empty_path_and_skips_a_full_one",
    "test_outputs_cli.py::test_tail_and_up_exit_3_when_the_run_succeeded_but_its_last_pass_failed",
    "test_pull.py::test_pull_resumes_and_checks_the_whole_file",
    "test_up_session.py::test_up_json_is_one_document_over_one_connection_per_host",
    "test_nonroot.py::test_a_whole_job_with_the_defaults_only",
    "test_nonroot.py::test_no_ensurepip_is_named_before_provision_needs_it",
    "test_nonroot.py::test_python_older_than_3_8_is_named",
    "test_nonroot.py::test_up_with_home_paths_on_a_non_root_node",
    "test_openssh.py::test_without_an_openssh_client_ssh_means_paramiko_and_says_so",
    "test_trust_code.py::test_another_jobs_push_is_refused_while_the_owner_runs_and_never_deletes_its_files",
    "test_trust_gang.py::test_a_flood_from_outside_the_gang_does_not_break_it",
    "test_trust_gang.py::test_the_hub_listens_on_the_gang_address_only",
    "test_trust_pull.py::test_a_git_name_from_the_node_is_refused",
    "test_trust_pull.py::test_a_run_id_from_the_node_never_leads_outside_runs",
    "test_trust_pull.py::test_pull_never_replaces_a_local_file_it_did_not_write",
}


def _read_list(name: str) -> list[tuple[str, str]]:
    """(entry, why) for each line of tests/NAME that is not blank or a comment: `ENTRY  # why`."""
    out = []
    for line in (HERE / name).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            entry, _, why = line.partition("  # ")
            out.append((entry.strip(), why.strip()))
    return out


def _names_used(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_used(const)
    return names


def _starts_a_testbed(fn: object) -> bool:
    code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
    return code is not None and bool(_names_used(code) & TESTBED_NAMES)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes 20 s or more (SLOW in tests/conftest.py); "
                                       "-m 'not slow' leaves them out")
    config.addinivalue_line("markers", "serial: runs with no other test at the same time (times itself, or "
                                       "changes what every test shares)")
    for k, v in TEST_TIMEOUTS.items():
        os.environ.setdefault(k, v)
    # dfo's caches on this machine (help texts, code hashes, what each node holds): a folder of this test
    # session, never the real ~/.cache/dfo (each pytest-xdist worker gets its own; removed at exit)
    if "DFO_TEST_CACHE" not in os.environ:
        import atexit
        import shutil
        import tempfile

        cache = tempfile.mkdtemp(prefix="dfo-test-cache-")
        atexit.register(shutil.rmtree, cache, True)
        os.environ["DFO_TEST_CACHE"] = os.environ["XDG_CACHE_HOME"] = cache
        # dfo's config folder too (the record key it signs generation records with, the seq it has seen):
        # never the machine's own ~/.config/dfo
        os.environ["XDG_CONFIG_HOME"] = os.path.join(cache, "config")


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
        if (TESTBED_FIXTURES & set(getattr(item, "fixturenames", ())) or _starts_a_testbed(getattr(item, "obj", None))
                or any(_starts_a_testbed(d.func) for d in defs if d.baseid)):  # the project's fixtures only
            item.add_marker(pytest.mark.testbed)
        # "file.py::test_name" (every parametrized case) or "file.py::test_name[case]"
        where = item.nodeid.split("/")[-1]
        if where in SLOW or where.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
    _heaviest_files_first(items)


# Seconds of each test in a whole run on the 2-core machine (setup and teardown included), written by
# `scripts/test_timeline.py TIMELINE --durations-out tests/durations.json`; a test not in it weighs by its
# marks (WEIGHT). Only the order of the files depends on these: a stale figure costs time, never a result.
DURATIONS: dict[str, float] = json.loads((HERE / "durations.json").read_text())
WEIGHT = {"slow": 40.0, "testbed": 4.0, "unit": 0.2}


def _weight(item: pytest.Item) -> float:
    if item.nodeid in DURATIONS:
        return DURATIONS[item.nodeid]
    if item.get_closest_marker("slow") is not None:
        return WEIGHT["slow"]
    return WEIGHT["testbed"] if item.get_closest_marker("testbed") is not None else WEIGHT["unit"]


def _heaviest_files_first(items: list[pytest.Item]) -> None:
    """Whole files, heaviest first (each file's tests keep their order). pytest-xdist runs the suite with
    --dist loadfile --no-loadscope-reorder: a worker takes the next whole file in this order when it is
    nearly done with its own, so the long files start first and the short ones fill in at the end
    (longest-first scheduling), and a file's module fixtures (a testbed of its own) start once."""
    weight: dict[str, float] = {}
    for item in items:
        f = item.nodeid.split("::")[0]
        weight[f] = weight.get(f, 0.0) + _weight(item)
    first = {f: i for i, f in reversed(list(enumerate(item.nodeid.split("::")[0] for item in items)))}
    items.sort(key=lambda it: (-weight[it.nodeid.split("::")[0]], first[it.nodeid.split("::")[0]]))


@pytest.fixture(scope="session")
def _lanes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """Under pytest-xdist: the session's temp folder that every worker shares (basetemp/popen-gwN's parent)."""
    return tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None


@pytest.fixture(autouse=True)
def _lanes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, _lanes_dir: Path | None
           ) -> Iterator[None]:
    """A test without the testbed mark may not start one (nor may its dfo processes); a serial test
    runs alone: every test holds the lanes lock shared, a serial test holds it exclusively."""
    if request.node.get_closest_marker("testbed") is None:
        monkeypatch.setenv(FORBID_ENV, request.node.nodeid)
    with _lanes_lock(_lanes_dir, exclusive=request.node.get_closest_marker("serial") is not None):
        yield


@contextlib.contextmanager
def _lanes_lock(folder: Path | None, exclusive: bool) -> Iterator[None]:
    """A readers-writer lock across the workers (flock). The turnstile keeps a waiting serial test from
    starving behind a stream of shared holders: it is held while the serial test waits and runs."""
    if folder is None:  # one process: nothing runs beside this test
        yield
        return
    with open(folder / "dfo-lanes.turnstile", "a") as gate, open(folder / "dfo-lanes.lock", "a") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)


# -- timeline: DFO_TEST_TIMELINE=FILE writes one JSON line per test (worker, start, end, setup and teardown
# included) -- how busy each worker was, and what ran last (scripts/test_timeline.py reads it)
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path = os.environ.get("DFO_TEST_TIMELINE")
    t0 = time.time()
    yield
    if path:
        line = json.dumps({"w": os.environ.get("PYTEST_XDIST_WORKER", "main"), "id": item.nodeid,
                           "start": round(t0, 3), "end": round(time.time(), 3)})
        with open(path, "a") as f:  # one write of one short line: whole under O_APPEND
            f.write(line + "\n")


# -- skips --------------------------------------------------------------------------------------
_skips: list[tuple[str, str]] = []  # (nodeid, reason) of every skipped test this session


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under pytest-xdist the controller gets every worker's reports here too."""
    _note_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A module that skips as a whole (pytest.importorskip at its top)."""
    _note_skip(report)


def _note_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and isinstance(report.longrepr, (tuple, list)):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
        _skips.append((report.nodeid, reason))


def _unlisted_skips() -> list[tuple[str, str]]:
    allowed = [re.compile(entry) for entry, _ in _read_list("allowed_skips.txt")]
    return [(n, r) for n, r in _skips if not any(a.search(r) for a in allowed)]


def _strict(config: pytest.Config) -> bool:
    return os.environ.get("DFO_STRICT_SKIPS") == "1" and not hasattr(config, "workerinput")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _strict(session.config) and _unlisted_skips() and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    if not _strict(config):
        return
    bad = _unlisted_skips()
    if bad:
        terminalreporter.section("skips not allowed (DFO_STRICT_SKIPS=1)", red=True)
        for nodeid, reason in bad:
            terminalreporter.line(f"{nodeid}: {reason}")
        terminalreporter.line(f"{len(bad)} test(s) skipped for a reason tests/allowed_skips.txt does not list: "
                              "install what they need (bash .ci/setup), or list the reason there with why")


# ============================================================================================
# ssh transports (orchestrator/transport/openssh.py, orchestrator/transport/ssh.py); tests never touch the real ~/.ssh
#
#   each_ssh_transport   function, params "openssh" and "paramiko": sets DFO_SSH_TRANSPORT, so that
#                        `transport: ssh` (every testbed inventory) means that one, in this process and in
#                        the dfo processes a test starts. @pytest.mark.usefixtures("each_ssh_transport").
# DFO_SSH_CONFIG: unless already set, a session file holding only `UserKnownHostsFile <tmp>`: both
#   transports read it alone (as ssh -F), never ~/.ssh/config nor ~/.ssh/known_hosts. A test that needs an
#   ssh_config of its own sets DFO_SSH_CONFIG (or the inventory's defaults.ssh_config).
# ============================================================================================
SSH_TRANSPORTS = ["openssh", "paramiko"]


@pytest.fixture(scope="session", autouse=True)
def _no_real_ssh_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if os.environ.get("DFO_SSH_CONFIG"):
        yield
        return
    folder = tmp_path_factory.mktemp("ssh-config")
    cfg = folder / "ssh_config"
    cfg.write_text(f"# the tests' ssh_config (tests/conftest.py): no ~/.ssh\nHost *\n"
                   f"  UserKnownHostsFile {folder / 'user_known_hosts'}\n")
    os.environ["DFO_SSH_CONFIG"] = str(cfg)
    try:
        yield
    finally:
        os.environ.pop("DFO_SSH_CONFIG", None)


@pytest.fixture(params=SSH_TRANSPORTS)
def each_ssh_transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DFO_SSH_TRANSPORT", request.param)
    return str(request.param)

# ============================================================================================
# end of ssh transports
# ============================================================================================


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short XDG_RUNTIME_DIR (control sockets live in dfo-ssh/ under it: a socket path holds 107 bytes)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="dfo-rt-"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    try:
        yield d / "dfo-ssh"
    finally:
        shutil.rmtree(d, ignore_errors=True)
