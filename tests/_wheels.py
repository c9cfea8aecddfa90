"""Small fake wheels, built with the standard library, so provision tests run offline.

The packages mimic the real trio whose pins caused trouble (torch pins triton exactly):

* ``faketorch 2.11.0``  Requires-Dist: faketriton==3.6.0; extra "fla" pulls fakefla
* ``faketorch 2.12.0``  Requires-Dist: faketriton==3.7.0
* ``faketriton 3.5.0 / 3.6.0 / 3.7.0``  no requirements
* ``fakefla 0.6.0``     Requires-Dist: faketriton>=3.3, faketorch>=2.5

Each has an importable module of the same name whose ``__version__`` matches the wheel. The
names are not the real ones on purpose: every install in the tests runs with ``--no-index``
and ``--find-links`` (the nodes have no network), and fake names can never be confused with,
or shadow, a real torch or triton anywhere else (the controller's venv, a user's cache).

The wheelhouse also holds uv's own wheel (provision installs uv into a venv on a node that
has none). It comes from ``.cache/wheelhouse`` in the checkout, which ``.ci/setup`` fills once
with ``pip download --no-deps --only-binary=:all: uv==<the controller's uv version>``; when it is
missing, the fixture runs that same download (a one-time, cached step).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
UV_CACHE = REPO / ".cache" / "wheelhouse"
_EPOCH = (1980, 1, 1, 0, 0, 0)

# (name, version, requires)
FAKES: list[tuple[str, str, list[str]]] = [
    ("faketorch", "2.11.0", ["faketriton==3.6.0", 'fakefla>=0.6; extra == "fla"']),
    ("faketorch", "2.12.0", ["faketriton==3.7.0"]),
    ("faketriton", "3.5.0", []),
    ("faketriton", "3.6.0", []),
    ("faketriton", "3.7.0", []),
    ("fakefla", "0.6.0", ["faketriton>=3.3", "faketorch>=2.5"]),
]


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def build_wheel(dest: Path, name: str, version: str, requires: list[str], *, extras: list[str] | None = None) -> Path:
    """Write ``name-version-py3-none-any.whl`` (METADATA, WHEEL, RECORD, a module) into ``dest``."""
    info = f"{name}-{version}.dist-info"
    provides = sorted(set(extras or []) | {r.split('extra == "')[1].rstrip('"') for r in requires if "extra ==" in r})
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
            f"Summary: a fake {name} for dfo's provision tests"]
    meta += [f"Provides-Extra: {e}" for e in provides]
    meta += [f"Requires-Dist: {r}" for r in requires]
    files = {
        f"{name}/__init__.py": f'"""Fake {name} for dfo tests."""\n__version__ = "{version}"\n'.encode(),
        f"{info}/METADATA": ("\n".join(meta) + "\n\n").encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: dfo-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/top_level.txt": f"{name}\n".encode(),
    }
    record = [_record_line(p, d) for p, d in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{name}-{version}-py3-none-any.whl"
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for p, data in files.items():
            zi = zipfile.ZipInfo(p, date_time=_EPOCH)
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
    tmp.replace(path)
    return path


def uv_wheel() -> Path:
    """uv's wheel for this machine, the version the controller runs (downloaded once, cached)."""
    version = importlib.metadata.version("uv")
    found = sorted(UV_CACHE.glob(f"uv-{version}-*.whl"))
    if not found:
        UV_CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "-d", str(UV_CACHE), f"uv=={version}"], check=True, timeout=300)
        found = sorted(UV_CACHE.glob(f"uv-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"no uv wheel for uv {version} in {UV_CACHE}; run: bash .ci/setup")
    return found[0]


def build_wheelhouse(dest: Path, *, with_uv: bool = True) -> Path:
    for name, version, requires in FAKES:
        build_wheel(dest, name, version, requires)
    if with_uv:
        src = uv_wheel()
        shutil.copy2(src, dest / src.name)
    return dest


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of fake wheels (see FAKES) plus uv's wheel, for ``--no-index --find-links``."""
    return build_wheelhouse(tmp_path_factory.mktemp("wheelhouse"))
