"""remote/lib/fastjson.py: the node's JSON without ``import json`` gives what json gives, byte for byte,
on this Python and on the oldest one dfo supports (3.8); remote/lib/fsutil.which agrees with shutil.which.
And the node modules called most import neither json, re, typing, subprocess nor shutil to answer."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from remote.lib import fastjson, fsutil

ROOT = Path(__file__).resolve().parent.parent

# run as a script (here, and by python3.8): every value and option, json's text against fastjson's
CHECK = r'''
import json, sys
sys.path.insert(0, sys.argv[1])
from remote.lib import fastjson as fj

class Odd:
    def __str__(self):
        return "odd!"

values = [
    {"a": 1, "b": [1, 2.5, -0.0, 1e300, 1e-7, None, True, False], "n": 10 ** 30},
    {"\u00fc": "snow\u2603 \ud800 \x00\x1f\"\\/"},
    {"nan": float("nan"), "inf": float("inf"), "-inf": -float("inf")},
    [], {}, [[[]]], [{"k": {"z": 1, "a": 2}}], {"odd": Odd()}, {1: "int key", None: 1, 2.5: 3, True: 0},
    {"rows": [["a/b.py", 33188, 12, 1700000000123456789, "0" * 64, None]] * 50},
]
options = [dict(separators=(",", ":"), default=str), dict(sort_keys=True, default=str), dict(default=str),
           dict(indent=1, sort_keys=True, default=str), dict(separators=(",", ":"))]
n = 0
for v in values:
    for kw in options:
        try:
            want = json.dumps(v, **kw)
        except (TypeError, ValueError) as exc:
            want = "%s: %s" % (type(exc).__name__, exc)
        try:
            got = fj.dumps(v, **kw)
        except (TypeError, ValueError) as exc:
            got = "%s: %s" % (type(exc).__name__, exc)
        assert got == want, (v, kw, got, want)
        if not want.startswith(("TypeError", "ValueError")):
            a, b = json.loads(want), fj.loads(want)
            assert json.dumps(a, default=str) == json.dumps(b, default=str), (a, b)
            assert json.dumps(fj.loads(want.encode()), default=str) == json.dumps(a, default=str)
        n += 1
for text in [" {\"a\": [1, 2]} \n", "\t[1]\r\n", "\"s\"", "3", "null", "-1.5e3"]:
    assert fj.loads(text) == json.loads(text), text
    n += 1
for raw in [b'\xef\xbb\xbf{"a": 1}', b'"\xed\xa0\x80"', '{"a": "\u00fc"}'.encode("utf-16"),
            '[1, "\u00fc"]'.encode("utf-32-le"), b'{"a": "\xc3\xbc"}']:
    assert fj.loads(raw) == json.loads(raw), raw  # bytes: a BOM, UTF-16/32 and lone surrogates as json reads them
    n += 1
for bad in ["", "   ", "{", "[1,]", "{} x", "nul", "\"abc", "{\"a\" 1}", "[1] [2]"]:
    try:
        fj.loads(bad)
    except ValueError:
        n += 1
    else:
        raise AssertionError("no error for %r" % bad)
print("checked", n, "cases on", sys.version.split()[0], "with the C scanner" if fj._scan else "without")
'''


def test_fastjson_gives_what_json_gives(tmp_path: Path) -> None:
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    r = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0 and "with the C scanner" in r.stdout, r.stdout + r.stderr


def test_fastjson_gives_what_json_gives_on_python_3_8(tmp_path: Path) -> None:
    from tests.test_hardening_packaging import _python38

    py38 = _python38()
    if py38 is None:
        pytest.skip("no python3.8 here (bash .ci/setup installs uv's)")
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    r = subprocess.run([py38, "-S", str(script), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0 and "on 3.8" in r.stdout and "with the C scanner" in r.stdout, r.stdout + r.stderr


def test_without_the_c_accelerator_json_does_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastjson, "_json", None)
    monkeypatch.setattr(fastjson, "_scan", None)
    doc = {"a": [1, "\u00fc"], "b": None}
    assert fastjson.dumps(doc, separators=(",", ":")) == json.dumps(doc, separators=(",", ":"))
    assert fastjson.loads('{"a": [1, "\\u00fc"], "b": null}') == doc
    with pytest.raises(ValueError):
        fastjson.loads("{")


def test_which_finds_what_shutil_finds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin1, bin2 = tmp_path / "b1", tmp_path / "b2"
    bin1.mkdir()
    bin2.mkdir()
    (bin1 / "tool").write_text("")  # not executable: skipped
    (bin2 / "tool").write_text("#!/bin/sh\n")
    (bin2 / "tool").chmod(0o755)
    (bin1 / "dir").mkdir()  # a folder: never a command
    (bin2 / "dir").mkdir()
    monkeypatch.setenv("PATH", f"{bin1}{os.pathsep}{bin2}{os.pathsep}")  # an empty entry too, as shutil reads it
    for name in ("tool", "dir", "absent", str(bin2 / "tool"), str(bin1 / "tool"), "sh"):
        assert fsutil.which(name) == shutil.which(name), name
    assert fsutil.which("tool") == str(bin2 / "tool")
    monkeypatch.setenv("PATH", "")  # set and empty: nothing
    assert fsutil.which("sh") is None and shutil.which("sh") is None


@pytest.mark.parametrize("module, request_line", [
    ("remote.runs", '{"op": "status", "workspace": "WS"}'),
    ("remote.env.probe", "{}"),
    ("remote.files.push", '{"op": "state", "dest": "WS/code"}'),
])
def test_the_modules_called_most_answer_without_the_heavy_imports(tmp_path: Path, module: str,
                                                                  request_line: str) -> None:
    """As the controller starts them (orchestrator/agent.py launch, python's -S): what they import to answer
    leaves out json, re, typing, subprocess, shutil and runpy (each costs a node call 1-4 ms)."""
    from orchestrator.agent import SITE_FREE, launch

    assert module in SITE_FREE
    code = launch(module).split(" ", 1)[1].strip("'")
    probe = (code + "; import sys; sys.stdout.write('\\nMODULES ' + ' '.join(sorted(sys.modules)) + '\\n')")
    r = subprocess.run([sys.executable, "-S", "-c", probe], input=request_line.replace("WS", str(tmp_path)),
                       capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert '@@DFO-RESULT@@ {"ok":true' in r.stdout, r.stdout + r.stderr
    loaded = set(r.stdout.split("MODULES ", 1)[1].split())
    heavy = {"json", "re", "typing", "subprocess", "shutil", "runpy"}
    if module == "remote.env.probe":  # what a GPU node (nvidia-smi) or one without /etc/os-release needs
        heavy -= {"subprocess"} if shutil.which("nvidia-smi") else set()
        heavy -= set() if os.path.exists("/etc/os-release") else {"re"}
    assert loaded & heavy == set(), sorted(loaded)
