"""``packaging`` shipped with the agent (remote/_vendor), its pin and refresh script, and the
python 3.8 compatibility of everything that runs on the node (vermin, and a real 3.8 when this
machine has one)."""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENDOR = ROOT / "remote" / "_vendor"
SCRIPT = ROOT / "scripts" / "vendor_packaging.py"
NODE_MODULES = ["remote.env.pkgcheck", "remote.env.known_bad", "remote.env.installers", "remote.env.provision",
                "remote.gpu.preflight", "remote.lib.fsutil"]


def _pin() -> tuple[str, str]:
    lines = [ln for ln in (VENDOR / "vendor.txt").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert len(lines) == 1, lines
    m = re.fullmatch(r"packaging==(\S+) --hash=sha256:([0-9a-f]{64})", lines[0].strip())
    assert m, lines[0]
    return m.group(1), m.group(2)


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


# -- the vendored copy ---------------------------------------------------------------------

def test_vendored_packaging_is_the_pinned_release_unmodified() -> None:
    from remote._vendor import packaging as vendored

    assert vendored.__version__ == _pin()[0]
    assert Path(vendored.__file__).parent == VENDOR / "packaging"
    for name in ("LICENSE", "LICENSE.APACHE", "LICENSE.BSD"):
        assert (VENDOR / "packaging" / name).stat().st_size > 100 or name == "LICENSE", name
    r = _script("--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_catches_an_edited_or_added_vendored_file(tmp_path: Path) -> None:
    copy = tmp_path / "_vendor"
    shutil.copytree(VENDOR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "packaging" / "version.py", "a") as f:
        f.write("# a local patch\n")
    (copy / "packaging" / "extra.py").write_text("")
    r = _script("--check", "--vendor-dir", str(copy))
    assert r.returncode == 1
    assert "packaging/version.py: differs from the wheel" in r.stderr
    assert "packaging/extra.py: not in the wheel" in r.stderr


def _wheel_from_vendored(path: Path, version: str, tamper: str | None = None) -> str:
    """A wheel with the vendored files and RECORD (the real one's members); returns its sha256."""
    dist = f"packaging-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        for p in sorted((VENDOR / "packaging").rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                rel = p.relative_to(VENDOR).as_posix()
                if p.name.startswith("LICENSE"):
                    rel = f"{dist}/licenses/{p.name}"
                data = p.read_bytes() + (b"# tampered\n" if rel == tamper else b"")
                zf.writestr(rel, data)
        zf.writestr(f"{dist}/RECORD", (VENDOR / "packaging.RECORD").read_text())
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_refresh_unpacks_only_a_wheel_that_matches_the_pin(tmp_path: Path) -> None:
    version, _sha = _pin()
    dest = tmp_path / "_vendor"
    dest.mkdir()
    wheel = tmp_path / f"packaging-{version}-py3-none-any.whl"
    sha = _wheel_from_vendored(wheel, version)

    (dest / "vendor.txt").write_text(f"# pin\npackaging=={version} --hash=sha256:{'0' * 64}\n")
    r = _script("--wheel", str(wheel), "--vendor-dir", str(dest))
    assert r.returncode == 1 and "sha256 is " + sha in r.stderr and "nothing was changed" in r.stderr
    assert not (dest / "packaging").exists()

    (dest / "vendor.txt").write_text(f"packaging=={version} --hash=sha256:{sha}\n")
    r = _script("--wheel", str(wheel), "--vendor-dir", str(dest))
    assert r.returncode == 0, r.stderr
    got = {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    want = {p.relative_to(VENDOR).as_posix(): p.read_bytes() for p in VENDOR.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts  # a checkout where Python wrote its bytecode too
            and (p.name not in ("__init__.py", "vendor.txt")
                 or p.parent.name == "packaging" and p.name == "__init__.py" or p.parent.name == "licenses")}
    want["vendor.txt"] = (dest / "vendor.txt").read_bytes()
    assert got == want
    assert _script("--check", "--vendor-dir", str(dest)).returncode == 0

    bad = tmp_path / "bad" / wheel.name
    bad.parent.mkdir()
    sha = _wheel_from_vendored(bad, version, tamper="packaging/specifiers.py")
    (dest / "vendor.txt").write_text(f"packaging=={version} --hash=sha256:{sha}\n")
    r = _script("--wheel", str(bad), "--vendor-dir", str(dest))
    assert r.returncode == 1 and "packaging/specifiers.py does not match the wheel's RECORD" in r.stderr
    assert (dest / "packaging" / "specifiers.py").read_bytes() == (VENDOR / "packaging" / "specifiers.py").read_bytes()


def test_agent_bundle_ships_vendored_packaging_with_its_licences() -> None:
    from orchestrator.agent import bundle

    with tarfile.open(fileobj=io.BytesIO(bundle()[1]), mode="r:gz") as tar:
        names = set(tar.getnames())
    for rel in ("packaging/LICENSE", "packaging/LICENSE.APACHE", "packaging/LICENSE.BSD", "packaging/version.py",
                "packaging/requirements.py", "vendor.txt", "__init__.py"):
        assert f"remote/_vendor/{rel}" in names, rel


def test_node_code_never_imports_an_installed_packaging() -> None:
    """On a node without ``packaging``, every node-side module still imports and works."""
    code = (
        "import sys; sys.modules['packaging'] = None\n"  # any `import packaging` now fails
        f"import importlib; [importlib.import_module(m) for m in {NODE_MODULES!r}]\n"
        "from remote.env import known_bad, pkgcheck\n"
        "assert known_bad.version_matches('3.7.1rc1', '>=3.4.0,<3.7.1')\n"
        "assert pkgcheck.exact_version(pkgcheck._parse('a==1.0').specifier) == '1.0'\n"
        "assert sys.modules['packaging'] is None and not [m for m in sys.modules if m.startswith('packaging.')]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr


# -- python 3.8 on the node ----------------------------------------------------------------

def test_remote_is_python_3_8_compatible_per_vermin(tmp_path: Path) -> None:
    """vermin over every node-side module (the vendored packaging is upstream's, tested on 3.8 there;
    vermin cannot see its version guards)."""
    # the running interpreter's vermin (a test extra, its script beside the interpreter), not PATH's:
    # `.venv/bin/python -m pytest` does not put .venv/bin on PATH (vermin has no __main__ for -m)
    vermin = Path(sys.executable).parent / "vermin"
    if not vermin.is_file():
        pytest.skip(f"vermin is not installed beside {sys.executable} (pip install -e '.[test]')")
    argv = [str(vermin), "-t=3.8-", "--no-tips", "--violations", "--exclude-regex", r"/_vendor/"]
    r = subprocess.run(argv + [str(ROOT / "remote")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    files = len([p for p in (ROOT / "remote").rglob("*.py") if "_vendor" not in p.parts])
    assert re.search(rf"Analyzing {files} files", r.stdout), r.stdout  # every module, not a few
    probe = tmp_path / "probe.py"
    probe.write_text("import zoneinfo\n")  # new in 3.9
    r = subprocess.run(argv + [str(probe)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "zoneinfo" in r.stdout  # the check can fail


def _uv_python38() -> str:
    """uv's own python3.8 (bash .ci/setup installs one where none is found), asked of the uv beside
    the running interpreter (a test extra), not of PATH."""
    uv = Path(sys.executable).parent / "uv"
    if not uv.is_file():
        return ""
    r = subprocess.run([str(uv), "python", "find", "--managed-python", "3.8"], capture_output=True, text=True,
                       timeout=60)
    return r.stdout.strip() if r.returncode == 0 else ""


def _python38() -> str | None:
    candidates = [os.environ.get("DFO_PYTHON38") or "", shutil.which("python3.8") or ""]
    candidates += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.8*/bin/python3.8")))
    candidates.append(_uv_python38())
    for exe in filter(None, candidates):
        try:
            r = subprocess.run([exe, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                               text=True, timeout=30)
        except OSError:
            continue
        if r.returncode == 0 and r.stdout.strip() == "(3, 8)":
            return exe
    return None


def test_node_code_runs_on_python_3_8() -> None:
    """A real python3.8, without packaging: import every node-side module, match known-bad entries
    and run pkgcheck (pins, markers, a missing distribution) through the vendored packaging."""
    exe = _python38()
    if exe is None:
        pytest.skip("no python3.8 here (bash .ci/setup installs one with uv; or set DFO_PYTHON38 to one)")
    code = (
        "import sys, json; sys.modules['packaging'] = None\n"
        f"import importlib; [importlib.import_module(m) for m in {NODE_MODULES!r}]\n"
        "from remote.env import known_bad, pkgcheck\n"
        "kb = [p['package'] for p in known_bad.match_known_bad("
        "{'triton': '3.6.0', 'fla_core': '0.6.0'}, ['9.0'], None)]\n"
        "data = pkgcheck.check({'pins': ['pip>=1', 'no-such-dist==1.0', \"pip<1; python_version < '3'\"],"
        " 'names': []})\n"
        "print(json.dumps({'kb': kb, 'problems': data['problems'], 'python': data['python']}))\n"
    )
    r = subprocess.run([exe, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["python"].startswith("3.8.") and out["kb"] == ["triton"]
    assert [(p["kind"], p["package"]) for p in out["problems"]
            if p["package"] in ("pip", "no-such-dist")] == [("missing", "no-such-dist")]


# -- one of each: name normaliser, byte-size formatter, durable JSON writer -----------------

def _node_and_controller_sources() -> list[Path]:
    return [p for d in ("orchestrator", "remote") for p in (ROOT / d).rglob("*.py") if "_vendor" not in p.parts]


def test_one_package_name_normaliser() -> None:
    from orchestrator.steps.verify_env import dist_name
    from remote.env import known_bad
    from remote.env.installers import req_key

    assert dist_name("Fla_Core.X[gpu]>=0.5") == req_key("Fla_Core.X[gpu]>=0.5") == "fla-core-x"
    odd = {"FLA.Core": "0.6.0", "Triton": "3.6.0"}  # spelled as some metadata spells them
    assert [p["package"] for p in known_bad.match_known_bad(odd, ["9.0"], None)] == ["triton"]
    hand_written = [p.relative_to(ROOT).as_posix() for p in _node_and_controller_sources()
                    if '"[-_.]+"' in p.read_text()]
    assert hand_written == [], "use packaging.utils.canonicalize_name"


@pytest.mark.parametrize("n,text", [
    (0, "0 B"), (1000, "1000 B"), (1536, "1.5 KiB"), (21 * 2**20, "21.0 MiB"),
    (int(10.04 * 2**30), "10.04 GiB"), (3 * 2**40, "3.00 TiB"),
])
def test_one_byte_size_formatter(n: int, text: str) -> None:
    from orchestrator.steps import transfer
    from remote.lib import fsutil
    from remote.s3 import download as s3engine

    assert fsutil.human_bytes(n) == text
    assert transfer.human_bytes is s3engine.human is fsutil.human_bytes
    own_units = [p.relative_to(ROOT).as_posix() for p in _node_and_controller_sources()
                 if p.name != "fsutil.py" and re.search(r"""["'](KiB|MiB|GiB)""", p.read_text())]
    assert own_units == [], "format sizes with remote.lib.fsutil.human_bytes"


def _writers(tmp_path: Path) -> dict[str, object]:
    from remote.env import installers as provision_lib
    from remote.runs import record as runrecord
    from remote.s3 import manifest as s3manifest

    def manifest(path: Path, doc: dict[str, object]) -> None:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            s3manifest.write_atomic(fd, path.name, json.dumps(doc).encode())
        finally:
            os.close(fd)

    return {"run record": runrecord.write_json, "provision record": provision_lib.write_json,
            "data manifest": manifest}


@pytest.mark.parametrize("which", ["run record", "provision record", "data manifest"])
def test_every_record_is_written_durably_and_owner_only(tmp_path: Path, which: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    write = _writers(tmp_path)[which]
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    target = tmp_path / "rec.json"
    write(target, {"a": 1})  # type: ignore[operator]
    assert json.loads(target.read_text()) == {"a": 1}
    assert synced == ["file", "dir"]  # the data, then the rename
    assert target.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.json"]


@pytest.mark.parametrize("which", ["run record", "provision record", "data manifest"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path, which: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    write = _writers(tmp_path)[which]
    target = tmp_path / "rec.json"
    write(target, {"v": 1})  # type: ignore[operator]

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        write(target, {"v": 2})  # type: ignore[operator]
    assert json.loads(target.read_text()) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec.json"]


def test_a_planted_symlink_at_the_temp_name_is_not_written_through(tmp_path: Path) -> None:
    import threading

    from remote.lib import fsutil

    victim = tmp_path / "victim"
    victim.write_text("keep")
    target = tmp_path / "rec.json"
    tmp = tmp_path / f".rec.json.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.symlink_to(victim)
    fsutil.write_atomic(str(target), b"new")
    assert victim.read_text() == "keep" and target.read_bytes() == b"new" and not target.is_symlink()
    assert not os.path.lexists(tmp)
