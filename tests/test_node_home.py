"""Issue 33, item 4: a node whose home is read-only, full or nearly full (quota'd homes with a scratch disk
beside them). dfo's node code goes where it can: the home's cache, else the job's workspace, else a private
folder under /tmp (0700, this user's, checked), said with -v; where nothing can be written, exit 3 naming each
folder and why; verify-env shows the home's free space beside the workspace's; no write of dfo's fills a
filesystem past the floor it checks first.

The node's home is changed inside the node's own mount namespace only (a read-only remount of its /root bind,
or a small tmpfs over it), on the testbed's namespace nodes; this machine's files are never touched. Before
this change: exit 1 "remote.env.probe gave no result: mkdir: cannot create directory '/root/.cache': Read-only
file system" (read-only), exit 1 "run the command again" (196 KB free), and provision blamed python3.X-venv
while dfo's code filled a 1.5 MB home to 0 bytes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import _cli
from tests.conftest import _netns_choice, start_testbed

JOB = {"name": "rohome", "venv": "/workspace/venv", "workspace": "/workspace",
       "run": {"workdir": "/workspace", "wait": 0, "upload": ["train.py"],
               "command": "{python} train.py {workspace}"}}
TRAINER = "import os, sys\nprint('ran with', sys.executable, 'home writable', os.access(os.path.expanduser('~'), " \
          "os.W_OK))\nopen(os.path.join(sys.argv[1], 'trained'), 'w').write('ok')\n"


@pytest.fixture(scope="module")
def node_tb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if _netns_choice() is False:
        pytest.skip("a node home of its own needs namespace nodes (DFO_TESTBED_NETNS=0 forces loopback)")
    tb = start_testbed(tmp_path_factory.mktemp("nodehome"), nodes=1, s3=False, use_netns=True)
    try:
        yield tb
    finally:
        tb.stop()


@pytest.fixture
def home(node_tb: Any) -> Iterator[Any]:
    """The node, with whatever a test mounts over its /root, /workspace or /tmp taken away afterwards."""
    yield node_tb
    _sh(node_tb, "while grep -q '^dfo-test-home /root ' /proc/mounts; do umount /root; done; "
                 "mount -o remount,bind,rw /root; mount -o remount,bind,rw /workspace; mount -o remount,rw /tmp; "
                 "mount -o remount,bind,rw /tmp; rm -rf /tmp/dfo-agent-* /workspace/.dfo /workspace/venv "
                 "/workspace/trained /root/.cache/dfo; true")


def _sh(tb: Any, cmd: str) -> str:
    r = tb.node_exec(tb.nodes[0], cmd)
    assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def _free_kb(tb: Any, path: str) -> int:
    return int(_sh(tb, f"df -Pk {path} | tail -1").split()[3])


def _small_home(tb: Any, kb: int) -> None:
    """A tmpfs of ``kb`` KB over the node's /root: a home that is nearly full."""
    _sh(tb, f"mount -t tmpfs -o size={kb}k,mode=700 dfo-test-home /root")


def _inventory(tb: Any, tmp: Path) -> Path:
    doc = yaml.safe_load(Path(tb.inventory_path).read_text())
    doc["defaults"]["known_hosts"] = str(tmp / "known_hosts")
    p = tmp / "inventory.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def dfo(inv: Path, *args: str, **kw: Any) -> Any:
    # a cache of its own: dfo's record of which nodes hold its code is this test's alone
    env = _cli.cli_env(XDG_CACHE_HOME=str(inv.parent / "cache"))
    return _cli.dfo(inv, *args, env=env, timeout=kw.pop("timeout", 120), **kw)


def test_a_read_only_home_runs_a_job_from_the_workspace(home: Any, tmp_path: Path) -> None:
    tb = home
    _sh(tb, "mount -o remount,bind,ro /root && ! touch /root/x 2>/dev/null")
    inv = _inventory(tb, tmp_path)
    node = tb.nodes[0].name
    r = dfo(inv, "-v", "verify-env", "-H", node)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"dfo's node code is in /workspace/\.dfo/agent/\S+ .*read-only", r.stderr), r.stderr
    assert re.search(r"free home +.+ of .+ at /root \(not writable\)", r.stdout), r.stdout
    assert re.search(r"free workspace +.+ of .+ at /workspace\n", r.stdout), r.stdout
    r = dfo(inv, "-v", "verify-env", "-H", node)  # said once: where it was put
    assert r.returncode == 0 and "node code is in" not in r.stderr, r.stderr
    (tmp_path / "train.py").write_text(TRAINER)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    r = dfo(inv, "up", "-H", node, "-j", str(tmp_path / "job.yaml"), cwd=tmp_path, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "ran with /workspace/venv/bin/python home writable False" in r.stdout + r.stderr, r.stdout[-3000:]
    assert _sh(tb, "cat /workspace/trained") == "ok"


@pytest.mark.parametrize("kb", [196, 1536])
def test_a_full_home_is_left_as_it_is(home: Any, tmp_path: Path, kb: int) -> None:
    tb = home
    _small_home(tb, kb)
    free = _free_kb(tb, "/root")
    inv = _inventory(tb, tmp_path)
    node = tb.nodes[0].name
    r = dfo(inv, "-v", "verify-env", "-H", node, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    disk = json.loads(r.stdout)["hosts"][node]["node"]["disk"]
    assert disk["home"]["path"] == "/root" and disk["home"]["free"] == free * 1024, disk
    assert re.search(rf"in /workspace/\.dfo/agent/\S+ .*{free} KB free of the \d+ KB", r.stderr), r.stderr
    assert _free_kb(tb, "/root") == free  # nothing of dfo's went there
    # provision's venv in that home: refused before anything is written, naming the room it lacks
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({"name": "tiny", "venv": "~/venv"}))
    r = dfo(inv, "provision", "-H", node, "-j", str(tmp_path / "job.yaml"))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "/root/venv" in r.stderr and f"{free} KB free" in r.stderr, r.stderr
    assert "python3.X-venv" not in r.stderr and "ensurepip" not in r.stderr, r.stderr
    assert _free_kb(tb, "/root") == free


def test_nowhere_to_write_is_exit_3_naming_each_folder(home: Any, tmp_path: Path) -> None:
    tb = home
    _sh(tb, "mount -o remount,bind,ro /root && mount -o remount,bind,ro /workspace && mount -o remount,ro /tmp")
    inv = _inventory(tb, tmp_path)
    node = tb.nodes[0].name
    r = dfo(inv, "verify-env", "-H", node)
    assert r.returncode == 3, r.stdout + r.stderr
    for where in ("/root/.cache/dfo/agent", "/workspace/.dfo/agent", "/tmp/dfo-agent-0"):
        assert where in r.stderr, r.stderr
    assert "read-only" in r.stderr and "workspace:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_tmp_folder_is_used_only_when_it_is_private(home: Any, tmp_path: Path) -> None:
    tb = home
    _sh(tb, "mount -o remount,bind,ro /root && mount -o remount,bind,ro /workspace")
    _sh(tb, "mkdir -m 777 /tmp/dfo-agent-0")  # made by someone else's hand: others may write it
    inv = _inventory(tb, tmp_path)
    node = tb.nodes[0].name
    r = dfo(inv, "verify-env", "-H", node)
    assert r.returncode == 3 and "/tmp/dfo-agent-0" in r.stderr and "others" in r.stderr, r.stderr
    _sh(tb, "rmdir /tmp/dfo-agent-0")
    r = dfo(inv, "-v", "verify-env", "-H", node)
    assert r.returncode == 0 and "node code is in /tmp/dfo-agent-0/" in r.stderr, r.stdout + r.stderr
    assert _sh(tb, "stat -c '%a %u' /tmp/dfo-agent-0").split() == ["700", "0"]
    r = dfo(inv, "status", "-H", node)  # the next command finds it there
    assert r.returncode == 0, r.stderr


def test_the_floor_is_one_number_on_the_node() -> None:
    """remote/_boot.py (which cannot import remote/: it installs it) keeps the same floor as remote/lib/fsutil."""
    from orchestrator.agent import REMOTE_ROOT
    from remote.lib.fsutil import ROOM_FLOOR, room_problem

    text = (REMOTE_ROOT / "_boot.py").read_text()
    assert re.search(r"^FLOOR = 4 << 20 ", text, re.M) and ROOM_FLOOR == 4 << 20
    assert room_problem("/", 1 << 60) is not None and "KB free of the" in str(room_problem("/", 1 << 60))
