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
    assert "No such command 'stauts'" in res.output and "Did you mean 'status'?" in res.output


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
from orchestrator.testbed_s3 import S3Server
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
    from orchestrator.testbed_s3 import S3Server

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
