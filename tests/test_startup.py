"""A fast start (issue 11, part 5): the command line imports its heavy libraries only for a command
that needs them, and the installed package runs the demo outside a git checkout (part 4)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from orchestrator import cli as cli_mod

ROOT = Path(__file__).resolve().parent.parent
HEAVY = {"pydantic", "paramiko", "fabric", "invoke", "rich", "botocore", "boto3", "yaml", "cryptography"}

PROBE = """
import json, sys
from orchestrator.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = %r
print(json.dumps({"code": code, "heavy": sorted({m.split(".")[0] for m in sys.modules} & set(heavy))}))
"""


def imported_by(*argv: str) -> tuple[int, list[str], str]:
    r = subprocess.run([sys.executable, "-c", PROBE % sorted(HEAVY), *argv], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    return doc["code"], doc["heavy"], r.stdout + r.stderr


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["--version"], ["stauts"], ["--bogus"], []])
def test_top_level_imports_nothing_heavy(argv: list[str]) -> None:
    code, heavy, out = imported_by(*argv)
    assert heavy == [], (argv, heavy)
    if argv in (["--help"], ["-h"], ["--version"]):
        assert code in (0, None), out
    else:
        assert code == 2 or argv == [], out


def test_mistyped_command_is_usage_error_with_a_suggestion() -> None:
    res = CliRunner().invoke(cli_mod.cli, ["stauts"])
    assert res.exit_code == 2
    assert "No such command 'stauts'" in res.output and "'status'" in res.output.split("Did you mean")[1]


def test_version() -> None:
    res = CliRunner().invoke(cli_mod.cli, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == "dfo, version " + cli_mod.__version__


def test_command_table_matches_the_commands() -> None:
    """Every command that a module in orchestrator/commands exports is in cli.COMMANDS, with its own
    short help (what `dfo --help` shows without importing it), and every row names a real command."""
    exported: dict[str, click.Command] = {}
    for f in sorted((ROOT / "orchestrator" / "commands").glob("*.py")):
        tree = ast.parse(f.read_text())
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "COMMANDS" for t in n.targets)
               for n in tree.body):
            mod = __import__(f"orchestrator.commands.{f.stem}", fromlist=["COMMANDS"])
            for cmd in mod.COMMANDS:
                exported[cmd.name] = cmd
    assert sorted(exported) == sorted(cli_mod.COMMANDS)
    for name, (_module, _attr, short) in cli_mod.COMMANDS.items():
        cmd = cli_mod.load_command(name)
        assert cmd is exported[name]
        assert cmd.get_short_help_str(10_000) == short, name


def test_help_lists_the_table_in_order() -> None:
    res = CliRunner().invoke(cli_mod.cli, ["--help"])
    assert res.exit_code == 0
    lines = [ln.split()[0] for ln in res.output.split("Commands:")[1].splitlines() if ln.strip()]
    assert lines == list(cli_mod.COMMANDS)


# ------------------------------------------------------------------ part 4: boto3 is test-only

NO_BOTO3 = """
import sys
sys.modules["boto3"] = None  # import boto3 fails: what a plain `pip install dfo-orchestrator` has
from pathlib import Path
from orchestrator.testbed.s3 import S3Server
srv = S3Server(Path(sys.argv[1]), "127.0.0.1")
ep = srv.start()
try:
    tree = Path(sys.argv[1]) / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("alpha")
    (tree / "sub" / "b.txt").write_text("beta")
    ep.create_bucket("nob3")
    ep.create_bucket("nob3")  # again: already yours is fine
    print(ep.put_tree("nob3", "p", tree))
    ep.put_bytes("nob3", "one", b"1")
    c = ep.core_client()
    print(sorted(o["Key"] for o in c.list_objects_v2(Bucket="nob3")["Contents"]))
    print(c.get_object(Bucket="nob3", Key="p/sub/b.txt")["Body"].read())
finally:
    srv.stop()
"""


def test_testbed_s3_fills_buckets_without_boto3(tmp_path: Path) -> None:
    from orchestrator.testbed.s3 import S3Server

    if S3Server.missing():
        pytest.skip(S3Server.missing())
    r = subprocess.run([sys.executable, "-c", NO_BOTO3, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == ["['p/a.txt', 'p/sub/b.txt']", "['one', 'p/a.txt', 'p/sub/b.txt']", "b'beta'"]


def test_boto3_is_not_a_runtime_dependency() -> None:
    import tomllib

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].split("[")[0].strip().lower() for d in proj["dependencies"]]
    assert "boto3" not in names and "botocore" in names
    assert any(d.lower().startswith("boto3") for d in proj["optional-dependencies"]["test"])


# ------------------------------------------------------------------ part 4: the demo from a wheel

INSTALLED = """
import json, os, sys
from pathlib import Path
import orchestrator, remote
from orchestrator.demo import setup as demo
from orchestrator.config.models import load_job
from orchestrator.testbed.node import PROJECT_ROOT, hidden_paths
out = Path(sys.argv[1])
job = load_job(str(demo.demo_job(out, "http://10.9.9.9:9000", 7))).job
print(json.dumps({
    "orchestrator": orchestrator.__file__, "remote": remote.__file__, "checkout": str(demo.checkout()),
    "demo_job": str(demo.DEMO_JOB), "wheels": str(demo.DEFAULT_WHEELS),
    "upload": job.run.upload, "endpoint": job.s3.endpoint_url, "command": job.run.command,
    "project_root": str(PROJECT_ROOT), "hidden": hidden_paths(out),
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dfo built as a wheel from this working tree and installed into a fresh venv (its dependencies
    seen from this environment): the venv's directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    src = tmp / "src"
    for f in files:
        if (ROOT / f).is_file():
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            (src / f).write_bytes((ROOT / f).read_bytes())
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("dfo_orchestrator-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, timeout=120)
    if sys.prefix != sys.base_prefix:  # this environment is itself a venv: the new one sees its packages
        import site

        (next(venv.glob("lib/python3*/site-packages")) / "deps.pth").write_text("\n".join(site.getsitepackages()))
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return venv


def test_installed_wheel_runs_the_demo_outside_a_checkout(installed: Path, tmp_path: Path) -> None:
    site = str(next(installed.glob("lib/python3*/site-packages")))
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run([str(installed / "bin" / "python"), "-c", INSTALLED, str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    # the installed copy, not this checkout, and the demo's files come with it
    assert doc["orchestrator"].startswith(site) and doc["remote"].startswith(site)
    assert doc["checkout"] == "None"
    assert doc["demo_job"] == f"{site}/orchestrator/demo/job/demo.yaml"
    assert doc["upload"] == [f"{site}/orchestrator/demo/job/train.py"]
    assert Path(doc["upload"][0]).read_text().startswith('"""A small but real DFlash-style trainer')
    assert doc["endpoint"] == "http://10.9.9.9:9000" and "--max-steps 7" in doc["command"]
    assert doc["wheels"] == str(tmp_path / "cache" / "dfo" / "demo-wheels")
    # the testbed hides the installed package from its nodes (here under /tmp, which a node has its own of)
    assert doc["project_root"] == site
    assert any(site == h or site.startswith(h + "/") for h in [*doc["hidden"], "/tmp", "/root"]), doc["hidden"]
    # the console script: fast paths, the demo's help, and what to do without wheels
    dfo = str(installed / "bin" / "dfo")
    v = subprocess.run([dfo, "--version"], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert v.returncode == 0 and v.stdout.strip() == "dfo, version " + cli_mod.__version__
    h = subprocess.run([dfo, "demo", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert h.returncode == 0 and "throwaway node" in h.stdout, h.stderr
    assert str(tmp_path / "cache" / "dfo" / "demo-wheels") in "".join(h.stdout.split())  # the default, wrapped
    d = subprocess.run([dfo, "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert d.returncode == 2, d.stderr
    assert "no torch wheel in" in d.stderr and "pip download" in d.stderr and "torch==2.13.0+cpu" in d.stderr
    assert ".ci/setup" not in d.stderr and "Traceback" not in d.stderr


# ------------------------------------------------------------------ the way to a node's first byte

AT_CONNECT = """
import json, socket, sys
seen = []
real = socket.socket.connect
def spy(self, addr):
    if not seen:
        seen.append(sorted(sys.modules))
    return real(self, addr)
socket.socket.connect = spy
from orchestrator.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print(json.dumps({"code": exc.code, "at_connect": seen[0] if seen else None, "after": sorted(sys.modules)}))
"""


@pytest.mark.parametrize("command", ["status", "tail"])
def test_nothing_needless_is_imported_before_the_first_byte(command: str, tmp_path: Path) -> None:
    """`dfo status` and `dfo tail`, the commands run all day, import neither rich (output comes after
    the node answers), nor botocore, boto3 or packaging (S3 and installs are other commands' business)
    before they connect; here to a port that refuses at once (exit 4)."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"defaults: {{user: root, identity: {tmp_path}/key, known_hosts: {tmp_path}/kh}}\n"
                   "hosts:\n  dead: {host: 127.0.0.1, port: 1}\n")
    (tmp_path / "key").write_text("")
    r = subprocess.run([sys.executable, "-c", AT_CONNECT, "-i", str(inv), command, "-H", "dead"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60, env={**__import__("os").environ,
                                                                        "HOME": str(tmp_path)})
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["code"] == 4, r.stderr
    assert doc["at_connect"] is not None, r.stderr  # it did try to connect
    tops = {m.split(".")[0] for m in doc["at_connect"]}
    assert {"rich", "botocore", "boto3", "packaging"} & tops == set(), sorted(tops)
    assert "orchestrator.commands.preflight" not in doc["at_connect"]
    assert "orchestrator.steps.transfer" not in doc["at_connect"]
    assert "rich" in {m.split(".")[0] for m in doc["after"]}  # the error itself is printed with rich


def test_lazy_console_drives_a_progress_bar_and_plain_output() -> None:
    """cli_common's consoles are made on first use; what rich does with them (a live progress bar on a
    terminal, `with console:`, attribute writes) reaches the real console."""
    import io
    import time

    from orchestrator.cli_common import LazyConsole
    from orchestrator.steps.transfer import ProgressView

    buf = io.StringIO()
    con = LazyConsole(file=buf, force_terminal=True, width=100, highlight=False)
    with ProgressView(con, enabled=True) as view:
        on = view.callback("node-1")
        on({"kind": "plan", "bytes_to_fetch": 1000, "to_fetch": 2})
        on({"kind": "progress", "bytes": 500, "files": 1, "files_total": 2})
        time.sleep(0.2)
    assert "node-1" in buf.getvalue() and "1/2 files" in buf.getvalue()
    pipe = io.StringIO()
    plain = LazyConsole(file=io.StringIO(), highlight=False)
    plain.file = pipe  # an attribute write goes to the real console
    with plain:
        plain.print("x" * 300 + "   ")
    assert pipe.getvalue() == "x" * 300 + "\n"  # not a terminal: neither wrapped nor padded


@pytest.mark.parametrize("module", ["orchestrator.cli_common", "orchestrator.hosts"])
def test_shared_cli_pieces_import_nothing_heavy(module: str) -> None:
    """The option decorators and HostSession load config/connection only when a session opens, so a
    command module that needs only them keeps its --help and usage errors light."""
    probe = ("import importlib, json, sys; importlib.import_module(sys.argv[1]); "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[2:]))))")
    r = subprocess.run([sys.executable, "-c", probe, module, *sorted(HEAVY)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [], (module, r.stdout)


LEAVE = """
import atexit, sys, threading, time
from orchestrator import cli
atexit.register(lambda: sys.stdout.write("atexit ran\\n"))
sys.stdout.write("written, not flushed\\n")
if sys.argv[2] == "thread":
    def late():
        time.sleep(0.5)
        sys.stdout.write("the thread finished\\n")
    threading.Thread(target=late).start()
cli._leave(None if sys.argv[1] == "none" else int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
sys.stdout.write("not reached\\n")
"""


@pytest.mark.parametrize(("code", "thread", "status"), [("0", "", 0), ("4", "", 4), ("none", "", 0),
                                                         ("no such run", "", 1), ("5", "thread", 5)])
def test_the_console_script_leaves_with_its_code_output_and_atexit_but_no_teardown(
        code: str, thread: str, status: int) -> None:
    """The console script skips the interpreter's teardown (cli._leave): the exit status is sys.exit's,
    buffered stdout arrives, atexit's handlers run, a string goes to stderr (exit 1), and a non-daemon
    thread still running is waited for (sys.exit's way)."""
    r = subprocess.run([sys.executable, "-c", LEAVE, code, thread or "-"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == status, r
    lines = r.stdout.splitlines()
    assert lines[0] == "written, not flushed" and "atexit ran" in lines and "not reached" not in lines, r
    assert ("the thread finished" in lines) is bool(thread), r
    assert r.stderr == ("no such run\n" if code == "no such run" else ""), r.stderr


def test_the_console_script_exits_with_the_commands_code(tmp_path: Path) -> None:
    """`dfo` itself (the entry point, which leaves through cli._leave): a usage error is exit 2 with its
    message on stderr; --version prints and exits 0."""
    dfo = Path(sys.executable).parent / "dfo"
    if not dfo.is_file():
        pytest.skip("no dfo console script beside this python (pip install -e .)")
    (tmp_path / "inventory.yaml").write_text("hosts: {a: {host: 192.0.2.1}}\n")
    r = subprocess.run([str(dfo), "-i", str(tmp_path / "inventory.yaml"), "status", "-H", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown host or group 'nope'" in r.stderr, r
    r = subprocess.run([str(dfo), "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip(), r


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["status", "--help"], ["status", "--help"]])
def test_a_reader_that_leaves_early_gets_a_quiet_exit(argv: list[str]) -> None:
    """`dfo ... | head -1`: the pipe's reader is gone before dfo writes: no traceback, no "Exception ignored",
    exit 1 (as click does for its own output), whether the bytes failed in a write or in the last flush.
    `status --help` twice: rendered, then from the help cache (written outside click)."""
    p = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=ROOT)
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before the interpreter is up: its first write or flush meets a closed pipe
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 1 and err == "", err
