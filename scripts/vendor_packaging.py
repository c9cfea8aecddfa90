#!/usr/bin/env python3
"""Refresh the copy of ``packaging`` that ships with dfo's node-side code: remote/_vendor/packaging.

The node runs remote/ with its own python3 (3.8+), where ``packaging`` may be missing, so dfo
carries a copy. Its version and the sha256 of its wheel are pinned in one place,
remote/_vendor/vendor.txt (a pip requirements line with ``--hash``). This script:

1. downloads that wheel from PyPI with pip (hash-checking mode), or takes the file given by --wheel;
2. checks the wheel's sha256 against the pin, and every file it takes against the wheel's RECORD;
3. replaces remote/_vendor/packaging by the wheel's ``packaging/`` folder plus its licence files
   (LICENSE, LICENSE.APACHE, LICENSE.BSD), and writes the wheel's RECORD as
   remote/_vendor/packaging.RECORD, against which ``--check`` and the tests verify the copy.

``--check`` downloads nothing: it verifies that the vendored files are exactly the wheel's
(RECORD hashes, no file missing or added) and that ``__version__`` is the pinned version.

To move to another release: check on PyPI that its Requires-Python still allows 3.8, put its
version and its wheel's sha256 in vendor.txt, run this script, then the tests. The vendored
files are never edited by hand.
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "remote" / "_vendor"
NAME = "packaging"
PIN_RE = re.compile(r"^packaging==(?P<version>[0-9][0-9A-Za-z.+!-]*)\s+--hash=sha256:(?P<sha256>[0-9a-f]{64})\s*$")
LICENCE_RE = re.compile(r"^packaging-[^/]+\.dist-info/licenses/(?P<name>LICENSE[^/]*)$")


class VendorError(Exception):
    pass


def read_pin(vendor: Path) -> tuple[str, str]:
    """(version, sha256) from vendor.txt: the one line that is not a comment."""
    path = vendor / "vendor.txt"
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    m = PIN_RE.match(lines[0]) if len(lines) == 1 else None
    if m is None:
        raise VendorError(f"{path}: expected one line 'packaging==VERSION --hash=sha256:HEX', found {lines!r}")
    return m.group("version"), m.group("sha256")


def record_digest(data: bytes) -> str:
    """A RECORD hash field: sha256 in urlsafe base64 without padding (the wheel spec)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def parse_record(text: str) -> dict[str, str]:
    """Path in the wheel -> its RECORD hash, for the files that have one."""
    return {row[0]: row[1] for row in csv.reader(io.StringIO(text)) if len(row) >= 2 and row[1]}


def vendored_path(member: str) -> str | None:
    """Where a wheel member goes under remote/_vendor (relative), or None when it is not vendored."""
    if member.startswith(NAME + "/") and not member.endswith("/"):
        return member
    m = LICENCE_RE.match(member)
    return f"{NAME}/{m.group('name')}" if m else None


def download(version: str, sha256: str, into: Path) -> Path:
    """The pinned wheel, fetched by pip in hash-checking mode (pip refuses any other bytes)."""
    req = into / "req.txt"
    req.write_text(f"{NAME}=={version} --hash=sha256:{sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(into / "dl"),
           "-r", str(req)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise VendorError(f"pip download failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    wheels = sorted((into / "dl").glob(f"{NAME}-{version}-*.whl"))
    if len(wheels) != 1:
        raise VendorError(f"expected one {NAME}-{version} wheel from pip, found {[w.name for w in wheels]}")
    return wheels[0]


def unpack(wheel: Path, version: str, sha256: str, vendor: Path) -> list[str]:
    """Verify ``wheel`` and replace vendor/packaging and vendor/packaging.RECORD with its contents."""
    data = wheel.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise VendorError(f"{wheel.name}: sha256 is {got}, vendor.txt pins {sha256}; nothing was changed")
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        record_name = f"{NAME}-{version}.dist-info/RECORD"
        try:
            record_text = zf.read(record_name).decode("utf-8")
        except KeyError:
            raise VendorError(f"{wheel.name} has no {record_name}: is it the {NAME} {version} wheel?") from None
        record = parse_record(record_text)
        files: dict[str, bytes] = {}
        for member in zf.namelist():
            rel = vendored_path(member)
            if rel is None:
                continue
            body = zf.read(member)
            if record.get(member) != record_digest(body):
                raise VendorError(f"{wheel.name}: {member} does not match the wheel's RECORD; nothing was changed")
            files[rel] = body
    init = files.get(f"{NAME}/__init__.py", b"").decode("utf-8")
    m = re.search(r'^__version__\s*=\s*"([^"]+)"', init, re.M)
    if m is None or m.group(1) != version:
        raise VendorError(f"{wheel.name}: __version__ is {m.group(1) if m else None!r}, vendor.txt pins {version}")
    if not any(rel.startswith(f"{NAME}/LICENSE") for rel in files):
        raise VendorError(f"{wheel.name} carries no licence file; refusing to vendor it without one")
    stage = Path(tempfile.mkdtemp(prefix=f".{NAME}.new.", dir=vendor))
    try:
        for rel, body in files.items():
            out = stage / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(body)
        (stage / f"{NAME}.RECORD").write_text(record_text)
        old = vendor / f".{NAME}.old"
        shutil.rmtree(old, ignore_errors=True)
        if (vendor / NAME).exists():
            os.replace(vendor / NAME, old)
        os.replace(stage / NAME, vendor / NAME)
        os.replace(stage / f"{NAME}.RECORD", vendor / f"{NAME}.RECORD")
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return sorted(files)


def check(vendor: Path) -> list[str]:
    """Problems with the vendored copy (empty when it is exactly the pinned wheel's files)."""
    version, _sha = read_pin(vendor)
    problems = []
    try:
        record = parse_record((vendor / f"{NAME}.RECORD").read_text())
    except OSError as exc:
        return [f"cannot read {NAME}.RECORD: {exc}"]
    want = {rel: digest for member, digest in record.items() if (rel := vendored_path(member))}
    have = {p.relative_to(vendor).as_posix() for p in (vendor / NAME).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}
    for rel in sorted(set(want) - have):
        problems.append(f"{rel}: missing")
    for rel in sorted(have - set(want)):
        problems.append(f"{rel}: not in the wheel")
    for rel in sorted(have & set(want)):
        if record_digest((vendor / rel).read_bytes()) != want[rel]:
            problems.append(f"{rel}: differs from the wheel (the vendored code is never edited by hand)")
    m = re.search(r'^__version__\s*=\s*"([^"]+)"', (vendor / NAME / "__init__.py").read_text(), re.M)
    if m is None or m.group(1) != version:
        problems.append(f"{NAME}/__init__.py: __version__ {m.group(1) if m else None!r}, vendor.txt pins {version}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", type=Path, help="use this wheel file instead of downloading the pinned one")
    ap.add_argument("--check", action="store_true", help="verify the vendored copy against its RECORD and pin")
    ap.add_argument("--vendor-dir", type=Path, default=VENDOR, help=argparse.SUPPRESS)  # tests point it at tmp
    args = ap.parse_args(argv)
    try:
        if args.check:
            problems = check(args.vendor_dir)
            for p in problems:
                print(f"{args.vendor_dir}/{p}", file=sys.stderr)
            if not problems:
                print(f"{NAME} {read_pin(args.vendor_dir)[0]}: the vendored copy is the pinned wheel's files")
            return 1 if problems else 0
        version, sha256 = read_pin(args.vendor_dir)
        with tempfile.TemporaryDirectory() as tmp:
            wheel = args.wheel or download(version, sha256, Path(tmp))
            files = unpack(wheel, version, sha256, args.vendor_dir)
        print(f"vendored {NAME} {version} ({len(files)} files) into {args.vendor_dir / NAME}")
        return 0
    except VendorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
