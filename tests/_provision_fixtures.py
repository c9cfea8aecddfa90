"""Helpers for provision tests: the wheelhouse on a testbed node, job files, the real dfo CLI."""

from __future__ import annotations

import io
import json
import secrets
import shlex
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.testbed import Testbed
from tests._cli import dfo
from tests._wheels import wheelhouse  # noqa: F401 - re-exported fixture

PROJECT = Path(__file__).resolve().parent.parent


def tar_dir(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(src.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


@pytest.fixture(scope="session")
def node_wheelhouse(testbed: Testbed, wheelhouse: Path) -> str:  # noqa: F811
    """The wheelhouse copied onto the (first) testbed node, over SSH; its path there."""
    if not testbed.isolated:
        return str(wheelhouse)  # loopback nodes see this machine's files
    dest = "/root/dfo-test-wheels"
    cmd = f"rm -rf {dest} && mkdir -p {dest} && tar -xf - -C {dest}"
    r = subprocess.run(testbed.ssh_argv(testbed.nodes[0], cmd), input=tar_dir(wheelhouse), capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    return dest


class Pv:
    """One test's corner of the node: its own venv and workspace, its job files, dfo runs."""

    def __init__(self, tb: Testbed, wheels: str, tmp: Path) -> None:
        self.tb, self.wheels, self.tmp = tb, wheels, tmp
        self.node = tb.nodes[0]
        base = f"/root/pv-{secrets.token_hex(4)}" if tb.isolated else str(tmp / "node")
        self.base = base
        self.venv = f"{base}/venv"
        self.workspace = f"{base}/ws"

    def job(self, name: str = "pvjob", **fields: Any) -> Path:
        doc: dict[str, Any] = {"name": name, "python": "python3", "venv": self.venv, "installer": "uv",
                               "workspace": self.workspace,
                               "index": {"find_links": [self.wheels], "no_index": True}}
        doc.update(fields)
        path = self.tmp / f"{name}-{secrets.token_hex(3)}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def dfo(self, *args: str, inventory: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return dfo(inventory or self.tb.inventory_path, *args, timeout=timeout, cwd=self.tmp)

    def provision(self, job: Path, *extra: str, as_json: bool = True) -> tuple[subprocess.CompletedProcess[str],
                                                                             dict[str, Any] | None]:
        r = self.dfo("provision", "-H", self.node.name, "-j", str(job), *(["--json"] if as_json else []), *extra)
        doc = json.loads(r.stdout)["hosts"][self.node.name] if as_json and r.stdout.strip() else None
        return r, doc

    def sh(self, cmd: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.tb.ssh(self.node, cmd, timeout=timeout)

    def packages(self) -> dict[str, str]:
        """What the venv's interpreter itself reports (importlib.metadata), read over SSH."""
        code = ("import importlib.metadata as m, json; "
                "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
        r = self.sh(f"{shlex.quote(self.venv + '/bin/python')} -c {shlex.quote(code)}")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def read_json(self, path: str) -> dict[str, Any]:
        r = self.sh(f"cat {shlex.quote(path)}")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def cleanup(self) -> None:
        if self.tb.isolated:
            self.sh(f"rm -rf {shlex.quote(self.base)}")


@pytest.fixture
def pv(testbed: Testbed, node_wheelhouse: str, tmp_path: Path) -> Iterator[Pv]:
    p = Pv(testbed, node_wheelhouse, tmp_path)
    yield p
    p.cleanup()


def statuses(doc: dict[str, Any]) -> dict[str, str]:
    return {s["name"]: s["status"] for s in doc["steps"]}
