"""Shared fixtures. Each block is owned by one topic; append new blocks below, keep them delimited."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

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
