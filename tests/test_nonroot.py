"""Nodes as rented images have them (issue 18, items 6 and 7): a login user that is not root, a python3
without ensurepip, a python3 too old for dfo, and logins that fail.

* ``~`` and ``$HOME`` in a job's node paths are the node user's home, expanded on the node; the default
  venv is ~/venv, the default workspace /workspace when the user may write it and ~/workspace when not.
* verify-env shows the workspace and the user, and with -j flags each path of the job the user cannot
  write (exit 3, naming the field) and warns when provision would need an ensurepip the node lacks.
* python3 older than 3.8: exit 3, "needs python3 >= 3.8 on the node; found 3.6.15 at PATH".
* a refused login says what to do (exit 4), from one hint table (errors.AUTH_HINTS).

The testbed's nodes here log in as ``ubuntu`` (uid 1000, home /home/ubuntu; /root is 0700 and /workspace
root's, as on Lambda's and AWS's images); one node's python3 has no ensurepip (hidden in its mount
namespace, as Debian without python3.X-venv). Python 3.6 is a stand-in (Debian 12 has none): the node's
real python3 under a driver that says 3.6.15 and compiles as 3.6 does (``from __future__ import
annotations`` is a SyntaxError), and a shell script that only prints 3.6's SyntaxError.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.testbed import Testbed
from tests._cli import cli_env, dfo
from tests.conftest import _netns_choice, start_testbed

REPO = Path(__file__).resolve().parent.parent
HOME = "/home/ubuntu"

# --------------------------------------------------------------------------- stand-ins for python 3.6

PY36 = '''\
"""python 3.6 as dfo sees it: the real interpreter under this driver says 3.6.15 (sys.version_info,
sys.version, -V) and compiles as 3.6 does (a module with `from __future__ import annotations` is a
SyntaxError). Only `[options] -m MODULE [args]`, `[options] -c CODE [args]` and -V, which is all dfo runs."""
import builtins
import os
import runpy
import sys

args = sys.argv[1:]
if args[:1] in (["-V"], ["--version"]):
    print("Python 3.6.15")
    sys.exit(0)
while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
    args.pop(0)
if len(args) < 2 or args[0] not in ("-m", "-c"):
    sys.exit("fake python 3.6: only -m MODULE or -c CODE")
_compile = builtins.compile


def compile36(source, filename, mode, flags=0, dont_inherit=False, optimize=-1, **kw):
    text = source.decode("utf-8", "replace") if isinstance(source, (bytes, bytearray)) else str(source)
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip() == "from __future__ import annotations":
            raise SyntaxError("future feature annotations is not defined", (filename, n, 1, line))
    return _compile(source, filename, mode, flags, dont_inherit, optimize, **kw)


builtins.compile = compile36
sys.version_info = (3, 6, 15, "final", 0)
sys.version = "3.6.15 (default, Dec  2 2021, 00:00:00) \\n[GCC 12.2.0]"
sys.executable = os.environ.get("FAKE_PY36_SELF") or sys.argv[0]
if args[0] == "-c":
    sys.argv = ["-c"] + args[2:]
    exec(compile36(args[1], "<string>", "exec"), {"__name__": "__main__"})
else:
    sys.argv = [args[1]] + args[2:]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
'''

# only what an old python prints when it meets dfo's modules (and -V): no python code runs at all
SH36 = '''#!/bin/sh
case "$1" in -V|--version) echo "Python 3.6.15"; exit 0;; esac
echo '  File "remote/env/probe.py", line 13' >&2
echo '    from __future__ import annotations' >&2
echo 'SyntaxError: future feature annotations is not defined' >&2
exit 1
'''


# --------------------------------------------------------------------------- unit: node paths


def test_node_paths_are_expanded_on_the_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """remote.lib.fsutil.node_path: ~, $HOME, ${HOME} at the start only; default_workspace: /workspace when
    writable or creatable, else ~/workspace. (Before: no such helper; `~/venv` was a folder named ~.)"""
    from remote.lib import fsutil

    monkeypatch.setenv("HOME", "/home/u")
    assert fsutil.node_path("~") == "/home/u"
    assert fsutil.node_path("~/venv") == "/home/u/venv"
    assert fsutil.node_path("$HOME/a b") == "/home/u/a b"
    assert fsutil.node_path("${HOME}/x") == "/home/u/x"
    for same in ("/abs/~", "$HOMEX/y", "~root/x", "rel/~", ""):
        assert fsutil.node_path(same) == same
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    writable = tmp_path / "ws"
    writable.mkdir()
    monkeypatch.setattr(fsutil, "DEFAULT_WORKSPACE", str(writable))
    assert fsutil.default_workspace()[0] == str(writable)
    monkeypatch.setattr(fsutil, "DEFAULT_WORKSPACE", str(tmp_path / "new"))  # absent, its parent writable
    assert fsutil.default_workspace()[0] == str(tmp_path / "new")
    monkeypatch.setattr(fsutil, "DEFAULT_WORKSPACE", str(tmp_path / "no" / "ws"))  # cannot be made
    path, why = fsutil.default_workspace()
    assert path == str(tmp_path / "home" / "workspace") and "cannot create" in why
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(fsutil, "DEFAULT_WORKSPACE", str(tmp_path / "file"))
    assert fsutil.default_workspace() == (str(tmp_path / "home" / "workspace"), f"{tmp_path / 'file'} is not a folder")
    assert fsutil.workspace("~/w/") == str(tmp_path / "home" / "w")


def test_job_paths_keep_home_for_the_node(tmp_path: Path) -> None:
    """Defaults under the node user's home (~/venv, run.workdir ~, no workspace: the node decides), $HOME
    spelled ~, a relative path refused (exit 2). (Before: /root/venv, /root, /workspace.)"""
    from orchestrator.config.models import HostDefaults, Job, load_job
    from orchestrator.errors import ConfigError

    job = Job.model_validate({"name": "j", "run": {"command": "true"}})
    assert (job.venv, job.venv_python, job.workspace) == ("~/venv", "~/venv/bin/python", None)
    assert job.run is not None and job.run.workdir == "~"
    assert HostDefaults().workspace is None
    f = tmp_path / "j.yaml"
    f.write_text("name: j\nvenv: $HOME/v\nworkspace: ${HOME}/ws\ndata: {source: 's3://b/d/', dest: ~/d}\n"
                 "code: {dest: $HOME/code}\nrun: {workdir: $HOME/w, command: 'true'}\n")
    j = load_job(f).job
    assert (j.venv, j.workspace, j.data.dest, j.code.dest, j.run.workdir) == (  # type: ignore[union-attr]
        "~/v", "~/ws", "~/d", "~/code", "~/w")
    f.write_text("name: j\nvenv: venvs/v\n")
    with pytest.raises(ConfigError, match=r"venv: 'venvs/v' must be an absolute path on the node or one under"):
        load_job(f)


def test_shell_commands_leave_home_and_workspace_to_the_node(tmp_path: Path) -> None:
    """run.command's paths under ~ are "$HOME"/..., the node's default workspace "$DFO_WORKSPACE"; the
    agent's launcher finds an interpreter under ~. (Before: '~/venv/bin/python', quoted: never expanded.)"""
    from orchestrator.agent import launch, module_command
    from orchestrator.config.models import load_job
    from orchestrator.steps.runs import render_command

    f = tmp_path / "j.yaml"
    f.write_text("name: j\nvenv: ~/my venv\ndata: {source: 's3://b/d/', dest: $HOME/d}\n"
                 "run: {command: '{python} t.py --d {data.dest} --ws {workspace} --rd {run_dir}'}\n")
    cmd = render_command(load_job(f).job, run_id="r-1")
    assert cmd == '"$HOME"\'/my venv/bin/python\' t.py --d "$HOME"/d --ws "$DFO_WORKSPACE" --rd "$DFO_RUN_DIR"'
    out = subprocess.run(["sh", "-c", cmd.replace("t.py", "", 1).replace('"$HOME"\'/my venv/bin/python\'',
                                                                        "printf '%s\\n'", 1)],
                         env={"HOME": "/home/u", "DFO_WORKSPACE": "/home/u/workspace", "DFO_RUN_DIR": "/r"},
                         capture_output=True, text=True).stdout.split("\n")
    assert out[:6] == ["--d", "/home/u/d", "--ws", "/home/u/workspace", "--rd", "/r"]
    line = module_command("remote.env.probe", "~/py/bin/python3")
    assert 'command -v "$HOME"/py/bin/python3 ' in line and 'exec "$HOME"/py/bin/python3  -c ' in line
    assert line.endswith(" " + launch("remote.env.probe") + " ")


# --------------------------------------------------------------------------- unit: prerequisites


def test_old_python_says_so_before_any_module_compiles(tmp_path: Path) -> None:
    """remote/__init__.py checks sys.version_info in syntax every python parses, and answers with one
    result frame: PythonTooOld, exit 3. (Before: remote.env.probe's SyntaxError, 'gave no result', exit 1.)"""
    from orchestrator.agent import parse_output
    from orchestrator.errors import EXIT_VERIFY, PythonTooOld
    from orchestrator.transport.base import Result

    driver = tmp_path / "py36.py"
    driver.write_text(PY36)
    r = subprocess.run([sys.executable, str(driver), "-S", "-m", "remote.env.probe"], input="{}", capture_output=True,
                       text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1",
                                                     FAKE_PY36_SELF="/opt/py36/bin/python3"))
    assert "SyntaxError" not in r.stderr, r.stderr

    class Conn:
        name = "n1"

    with pytest.raises(PythonTooOld) as ei:
        parse_output(Conn(), Result(host="n1", command="", stdout=r.stdout, stderr=r.stderr,  # type: ignore[arg-type]
                                    exit_code=r.returncode, seconds=0.0), "remote.env.probe")
    assert ei.value.message == "needs python3 >= 3.8 on the node; found 3.6.15 at /opt/py36/bin/python3"
    assert ei.value.exit_code == EXIT_VERIFY and "hosts.NAME.python" in (ei.value.hint or "")
    import ast

    ast.parse((REPO / "remote" / "__init__.py").read_text(), feature_version=(3, 0))  # the gate parses anywhere


def test_login_hints_one_table() -> None:
    """errors.AUTH_HINTS: what to do for each way a login fails; AuthFailed is exit 4, JSON kind unreachable."""
    from orchestrator.errors import AUTH_HINTS, EXIT_HOST, AuthFailed, auth_hint

    assert set(AUTH_HINTS) >= {"no_key", "encrypted_key", "too_many_keys", "refused"}
    e = AuthFailed("authentication failed for ubuntu@h: x", reason="encrypted_key", host="h", key="/k/id")
    assert e.exit_code == EXIT_HOST and e.to_json()["kind"] == "unreachable" and e.reason == "encrypted_key"
    assert "ssh-add /k/id" in (e.hint or "")
    assert "ssh-add" in auth_hint("no_key") and "identity:" in auth_hint("no_key")
    assert "IdentitiesOnly yes" in auth_hint("too_many_keys")


# --------------------------------------------------------------------------- testbed nodes


def _namespace_nodes_or_skip() -> None:
    if _netns_choice() is False:
        pytest.skip("a non-root node user needs namespace nodes (DFO_TESTBED_NETNS=0 forces loopback)")


@pytest.fixture(scope="module")
def ubuntu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    """One node, login user ubuntu (home /home/ubuntu; /root 0700, /workspace root's), and S3."""
    _namespace_nodes_or_skip()
    tb = start_testbed(tmp_path_factory.mktemp("ubuntu"), nodes=1, s3=True, user="ubuntu", use_netns=True)
    try:
        yield tb
    finally:
        tb.stop()


def _inventory(tb: Testbed, tmp: Path, **host: Any) -> Path:
    inv = yaml.safe_load(Path(tb.inventory_path).read_text())
    inv["defaults"]["known_hosts"] = str(tmp / "known_hosts")
    inv["hosts"][tb.nodes[0].name].update(host)
    p = tmp / "inventory.yaml"
    p.write_text(yaml.safe_dump(inv))
    return p


def _put(tb: Testbed, path: str, data: bytes, mode: str = "755") -> None:
    """A file on the node, written over SSH as its user (``path`` under ~ is the user's home)."""
    q = shlex.quote(path[2:]) if path.startswith("~/") else shlex.quote(path)
    where = f'"$HOME"/{q}' if path.startswith("~/") else q
    cmd = f'mkdir -p "$(dirname {where})" && cat > {where} && chmod {mode} {where}'
    r = subprocess.run(tb.ssh_argv(tb.nodes[0], cmd), input=data, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _no_tilde_folders(tb: Testbed) -> None:
    """Nothing made a folder literally named ~ (what `~/venv` did, relative to dfo's agent cache)."""
    r = tb.ssh(tb.nodes[0], "find / -xdev -name '~' 2>/dev/null; find \"$HOME\" -name '~' 2>/dev/null; true")
    assert r.stdout.strip() == "", r.stdout


def test_verify_env_shows_the_workspace_and_paths_the_user_cannot_write(ubuntu: Testbed, tmp_path: Path) -> None:
    """Without -j: the user and the workspace it uses (~/workspace: /workspace is root's). With -j: each
    path the user cannot write is a problem naming its field (exit 3). (Before: neither shown nor flagged.)"""
    inv = _inventory(ubuntu, tmp_path)
    node = ubuntu.nodes[0].name
    r = dfo(inv, "verify-env", "-H", node, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    n = json.loads(r.stdout)["hosts"][node]["node"]
    assert n["user"]["name"] == "ubuntu" and n["user"]["home"] == HOME
    assert n["workspace"]["path"] == f"{HOME}/workspace" and n["workspace"]["default"] is True
    assert "/workspace is not writable" in n["workspace"]["why"]
    r = dfo(inv, "verify-env", "-H", node)
    assert re.search(rf"workspace +{HOME}/workspace \(default: /workspace is not writable", r.stdout), r.stdout
    job = tmp_path / "bad.yaml"
    job.write_text("name: bad\nvenv: /root/venv\ndata: {source: 's3://b/d/', dest: /workspace/data}\n"
                   "outputs: {path: '~/ckpt/{name}/{run_id}'}\nrun: {workdir: /opt/work, command: 'true'}\n")
    r = dfo(inv, "verify-env", "-H", node, "-j", str(job), "--json")
    assert r.returncode == 3, r.stdout + r.stderr
    probs = {p["message"].split(":")[0]: p for p in json.loads(r.stdout)["hosts"][node]["problems"]
             if p["kind"] == "not_writable"}
    assert set(probs) == {"venv", "data.dest", "run.workdir"}, probs  # ~/ckpt/... and ~/workspace are fine
    assert probs["venv"]["message"].startswith("venv: ubuntu on node-1 cannot write /root/venv (/root: owned by root, "
                                               "mode 700)")
    assert "/workspace: owned by root, mode 755" in probs["data.dest"]["message"]
    r = dfo(inv, "verify-env", "-H", node, "-j", str(job))
    assert r.returncode == 3 and "problem: run.workdir: ubuntu on node-1 cannot write /opt/work" in r.stdout


# a stdlib trainer (as tests/test_node_dies.py's CI story): says where it runs and what it sees, writes a checkpoint
TRAINER = '''\
import argparse, json, os, sys
p = argparse.ArgumentParser()
p.add_argument("--data-dir")
p.add_argument("--model-dir")
p.add_argument("--output-dir")
p.add_argument("--workspace", required=True)
p.add_argument("--run-dir", required=True)
a = p.parse_args()
print("python", sys.executable)
print("cwd", os.getcwd())
print("workspace", a.workspace, os.path.isdir(a.workspace))
print("run_dir", a.run_dir, os.path.isdir(a.run_dir))
if a.data_dir:
    print("data", a.data_dir, sorted(n for n in os.listdir(a.data_dir) if not n.startswith(".")))
if a.model_dir:
    print("model", a.model_dir, sorted(n for n in os.listdir(a.model_dir) if not n.startswith(".")))
if a.output_dir:
    os.makedirs(a.output_dir, exist_ok=True)
    with open(os.path.join(a.output_dir, "ckpt-1.json"), "w") as f:
        json.dump({"step": 1}, f)
    print("saved", os.path.join(a.output_dir, "ckpt-1.json"))
'''


@pytest.mark.timeout(300)
def test_up_with_home_paths_on_a_non_root_node(ubuntu: Testbed, tmp_path: Path) -> None:
    """The demo's job shape with every node path under ~ (or $HOME): provision, stage-model, sync-data, the
    code push, launch, outputs shipped, tail, then pull. (Before: $HOME refused by the job file's rules,
    exit 2; with ~ alone, provision failed, exit 3, "Permission denied: '/~'", after making folders named ~
    in dfo's agent cache.)"""
    tb = ubuntu
    assert tb.s3 is not None
    node = tb.nodes[0].name
    bucket = "home-paths"
    tb.s3.create_bucket(bucket)
    for key, body in (("data/a.bin", b"a" * 100), ("data/b.bin", b"b" * 200), ("model/config.json", b"{}")):
        tb.s3.put_bytes(bucket, key, body)
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "train.py").write_text(TRAINER)
    job = tmp_path / "home.yaml"
    job.write_text(yaml.safe_dump({
        "name": "home", "python": "python3", "venv": "~/venv-home", "workspace": "~/ws",
        "s3": {"endpoint_url": tb.s3.url, "region": tb.s3.region},
        "model": {"source": f"s3://{bucket}/model/", "dest": "$HOME/model"},
        "data": {"source": f"s3://{bucket}/data/", "dest": "~/data"},
        "code": {"source": "trainer"},
        "outputs": {"path": "~/checkpoints/{name}", "dest": f"s3://{bucket}/runs/{{name}}/", "every": 1,
                    "settle": 0.2, "include": ["ckpt-*.json"]},
        "run": {"workdir": "~/stand-in", "wait": 0,
                "command": "{python} train.py --data-dir {data.dest} --model-dir {model.dest} "
                           "--output-dir ~/checkpoints/home --workspace {workspace} --run-dir {run_dir}"},
    }, sort_keys=False))
    inv = _inventory(tb, tmp_path)
    env = cli_env(**{k: v for k, v in tb.s3.env().items() if k != "AWS_ENDPOINT_URL"},
                  AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent")
    r = dfo(inv, "up", "-H", node, "-j", str(job), env=env, cwd=tmp_path, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"python {HOME}/venv-home/bin/python\n" in out
    assert f"cwd {HOME}/stand-in\n" in out
    assert f"workspace {HOME}/ws True\n" in out
    assert re.search(rf"^run_dir {HOME}/ws/\.dfo/runs/home-\S+ True$", out, re.M), out[-3000:]
    assert f"data {HOME}/data ['a.bin', 'b.bin']\n" in out, out[-3000:]
    assert f"model {HOME}/model ['config.json']\n" in out, out[-3000:]
    assert f"saved {HOME}/checkpoints/home/ckpt-1.json\n" in out, out[-3000:]
    assert re.search(rf"outputs: last pass shipped 1 file\b.* to s3://{bucket}/runs/home/", out), out[-3000:]
    shipped = tb.s3.core_client().get_object(Bucket=bucket, Key="runs/home/ckpt-1.json")["Body"].read()
    assert json.loads(shipped) == {"step": 1}
    r = dfo(inv, "pull", "-H", node, "-j", str(job), "--to", str(tmp_path / "got"), env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "got" / "ckpt-1.json").read_text()) == {"step": 1}
    _no_tilde_folders(tb)


@pytest.mark.timeout(300)
def test_a_whole_job_with_the_defaults_only(ubuntu: Testbed, tmp_path: Path) -> None:
    """No venv, workspace or workdir given: the venv is ~/venv, the workspace ~/workspace (/workspace is
    root's), the workdir ~; status without -j finds the run. (Before: exit 1, PermissionError '.dfo'.)"""
    tb = ubuntu
    node = tb.nodes[0].name
    (tmp_path / "train.py").write_text(TRAINER)
    job = tmp_path / "plain.yaml"
    job.write_text("name: plain\nrun:\n  upload: [train.py]\n  wait: 0\n"
                   "  command: '{python} train.py --workspace {workspace} --run-dir {run_dir}'\n")
    inv = _inventory(tb, tmp_path)
    r = dfo(inv, "up", "-H", node, "-j", str(job), cwd=tmp_path, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert f"python {HOME}/venv/bin/python\n" in out and f"cwd {HOME}\n" in out
    assert f"workspace {HOME}/workspace True\n" in out
    run = re.findall(r"started run (\S+)", out)[0]
    assert f"run_dir {HOME}/workspace/.dfo/runs/{run} True\n" in out
    r = dfo(inv, "status", "-H", node, "--json")
    assert r.returncode == 0, r.stderr
    runs = json.loads(r.stdout)["hosts"][node]["runs"]
    assert [(x["id"], x["state"]) for x in runs if x["job"] == "plain"] == [(run, "succeeded")]
    assert tb.ssh(tb.nodes[0], "test -f ~/workspace/.dfo/provision/plain.json && echo ok").stdout.strip() == "ok"
    _no_tilde_folders(tb)


def test_python_older_than_3_8_is_named(ubuntu: Testbed, tmp_path: Path) -> None:
    """The host's python: a 3.6 stand-in. verify-env exits 3 naming version and path, whether the gate in
    remote/__init__.py runs (the driver) or only a SyntaxError comes back (the shell script).
    (Before: "remote.env.probe gave no result (exit 1): ... SyntaxError", exit 1.)"""
    tb = ubuntu
    node = tb.nodes[0].name
    _put(tb, "~/fakepy/py36.py", PY36.encode(), "644")
    _put(tb, "~/fakepy/python3", b'#!/bin/sh\nFAKE_PY36_SELF="$0" exec /usr/bin/python3 "$HOME/fakepy/py36.py" "$@"\n')
    _put(tb, "~/fakesh/python3", SH36.encode())
    for py in (f"{HOME}/fakepy/python3", "$HOME/fakesh/python3"):
        inv = _inventory(tb, tmp_path, python=py)
        for args in (("verify-env", "-H", node), ("status", "-H", node)):
            r = dfo(inv, *args)
            assert r.returncode == 3, (py, r.stdout + r.stderr)
            where = py.replace("$HOME", HOME)
            assert f"{node}: needs python3 >= 3.8 on the node; found 3.6.15 at {where}\n" in r.stderr, r.stderr
            assert "hosts.NAME.python" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def no_ensurepip(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    """One node, user ubuntu, whose python3 has no ensurepip (Debian without python3.X-venv)."""
    _namespace_nodes_or_skip()
    tb = start_testbed(tmp_path_factory.mktemp("nopip"), nodes=1, s3=False, user="ubuntu", ensurepip=False,
                       use_netns=True)
    try:
        yield tb
    finally:
        tb.stop()


@pytest.mark.timeout(300)
def test_no_ensurepip_is_named_before_provision_needs_it(no_ensurepip: Testbed, tmp_path: Path) -> None:
    """installer pip: verify-env -j warns, naming python3.X-venv; provision fails at once, saying so (exit 3).
    installer uv: with uv in ~/.local/bin (where uv's installer puts it) the venv is made with uv, no
    ensurepip needed; without uv, both name uv and the package. (Before: no warning; uv in ~/.local/bin
    unused, provision failed at `python3 -m venv`.)"""
    tb = no_ensurepip
    node = tb.nodes[0].name
    xy = tb.node_exec(tb.nodes[0], "python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'").stdout.strip()
    pkg = f"python{xy}-venv"
    inv = _inventory(tb, tmp_path)
    pip_job = tmp_path / "pip.yaml"
    pip_job.write_text("name: pipjob\ninstaller: pip\nvenv: ~/venv-pip\n")
    uv_job = tmp_path / "uv.yaml"
    uv_job.write_text("name: uvjob\ninstaller: uv\nvenv: ~/venv-uv\n")

    r = dfo(inv, "verify-env", "-H", node, "-j", str(pip_job), "--json")
    warns = [w for w in json.loads(r.stdout)["hosts"][node]["warnings"] if w["kind"] == "ensurepip_missing"]
    assert len(warns) == 1 and warns[0]["package"] == pkg, r.stdout
    assert f"install {pkg} on the node (sudo apt install {pkg})" in warns[0]["message"]
    r = dfo(inv, "provision", "-H", node, "-j", str(pip_job))
    assert r.returncode == 3, r.stdout + r.stderr
    assert "cannot create the venv /home/ubuntu/venv-pip: `python3 -m venv` needs ensurepip" in r.stderr, r.stderr
    assert f"sudo apt install {pkg}" in r.stderr
    assert tb.ssh(tb.nodes[0], "test -e ~/venv-pip && echo made || echo none").stdout.strip() == "none"

    r = dfo(inv, "verify-env", "-H", node, "-j", str(uv_job))
    assert "warning: installer: uv, but the node has no uv" in r.stdout and pkg in r.stdout, r.stdout
    r = dfo(inv, "provision", "-H", node, "-j", str(uv_job))
    assert r.returncode == 3 and "installer: uv, but the node has no uv" in r.stderr, r.stdout + r.stderr

    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        pytest.skip("no uv binary beside this interpreter (bash .ci/setup installs it into .venv)")
    _put(tb, "~/.local/bin/uv", uv.read_bytes())
    r = dfo(inv, "verify-env", "-H", node, "-j", str(uv_job), "--json")
    assert not [w for w in json.loads(r.stdout)["hosts"][node]["warnings"] if w["kind"] == "ensurepip_missing"]
    r = dfo(inv, "provision", "-H", node, "-j", str(uv_job), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"created {HOME}/venv-uv with {HOME}/.local/bin/uv" in r.stdout, r.stdout


# --------------------------------------------------------------------------- logins (paramiko)


@pytest.mark.timeout(180)
def test_refused_logins_say_what_to_do(testbed: Testbed, tmp_path: Path) -> None:
    """On the paramiko transport: no key offered, an encrypted key without an agent, too many keys from
    the agent each get the hint of errors.AUTH_HINTS (exit 4). (Before: "No authentication methods
    available" / "No existing session" with no hint, or "check user and identity".)"""
    node = testbed.nodes[0]
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (tmp_path / "ssh_config").write_text("")

    def inv(identity: Path | None = None) -> Path:
        host: dict[str, Any] = {"host": node.address, "port": node.port}
        if identity is not None:
            host["identity"] = str(identity)
        p = tmp_path / "inv.yaml"
        p.write_text(yaml.safe_dump({"defaults": {"user": node.user, "known_hosts": str(tmp_path / "kh")},
                                     "hosts": {"n": host}}))
        return p

    env = cli_env(SSH_AUTH_SOCK=None, HOME=str(home), DFO_SSH_CONFIG=str(tmp_path / "ssh_config"),
                  DFO_SSH_TRANSPORT="paramiko")
    r = dfo(inv(), "status", "-H", "n", env=env)
    assert r.returncode == 4 and "no key was offered: load one into ssh-agent (ssh-add" in r.stderr, r.stderr
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(tmp_path / "enc")], check=True)
    r = dfo(inv(tmp_path / "enc"), "status", "-H", "n", env=env)
    assert r.returncode == 4 and f"run ssh-add {tmp_path / 'enc'}" in r.stderr, r.stderr
    sock = tmp_path / "agent.sock"
    agent = subprocess.run(["ssh-agent", "-s", "-a", str(sock)], capture_output=True, text=True, check=True)
    pid = int(agent.stdout.split("SSH_AGENT_PID=")[1].split(";")[0])
    try:
        for i in range(7):  # sshd's MaxAuthTries is 6
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / f"k{i}")], check=True)
            subprocess.run(["ssh-add", "-q", str(tmp_path / f"k{i}")], env=dict(env, SSH_AUTH_SOCK=str(sock)),
                           check=True, capture_output=True)
        r = dfo(inv(), "status", "-H", "n", env=dict(env, SSH_AUTH_SOCK=str(sock)))
        assert r.returncode == 4 and "IdentitiesOnly yes" in r.stderr, r.stderr
    finally:
        os.kill(pid, signal.SIGTERM)
