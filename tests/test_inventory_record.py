"""The validated inventory is kept (orchestrator/config/inventory.py): a later command that reads the same text
loads neither YAML nor pydantic (issue 35, item 5: the models' import was most of a fleet command's own start);
an edit, a broken file or a damaged record is validated as before, with the same FILE:LINE errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config import inventory
from orchestrator.errors import ConfigError

INV = """defaults:
  user: root
  connect_timeout: 7
hosts:
  a: {host: 10.0.0.1, gpus: 8}
  b: {host: 10.0.0.2, port: 2222, start_timeout: 45}
groups:
  both: [a, b]
"""


def _load_elsewhere(path: Path, env: dict[str, str]) -> dict[str, object]:
    """load_inventory in a fresh interpreter: what it loaded, and which of yaml/pydantic it imported."""
    code = ("import json, sys\n"
            "from orchestrator.config.inventory import load_inventory, to_doc\n"
            f"inv, _ = load_inventory({str(path)!r})\n"
            "print(json.dumps({'doc': to_doc(inv), 'yaml': 'yaml' in sys.modules, "
            "'pydantic': 'pydantic' in sys.modules}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_a_second_command_loads_the_same_inventory_without_yaml_or_pydantic(tmp_path: Path) -> None:
    p = tmp_path / "inventory.yaml"
    p.write_text(INV)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    env.pop("DFO_INVENTORY_CACHE", None)
    first = _load_elsewhere(p, env)
    assert first["pydantic"] is True  # validated: the schema ran
    second = _load_elsewhere(p, env)
    assert second["pydantic"] is False and second["yaml"] is False
    assert second["doc"] == first["doc"]
    doc = second["doc"]
    assert isinstance(doc, dict)
    assert doc["defaults"]["connect_timeout"] == 7.0 and doc["hosts"]["b"]["port"] == 2222
    assert doc["hosts"]["a"]["gpus"] == 8 and doc["groups"] == {"both": ["a", "b"]}
    records = list((tmp_path / "cache" / "dfo" / "inventory").glob("*.json"))
    assert len(records) == 1 and oct(records[0].stat().st_mode & 0o777) == "0o600"
    # an edit is a new text: validated again, its values used
    p.write_text(INV.replace("connect_timeout: 7", "connect_timeout: 9"))
    third = _load_elsewhere(p, env)
    assert third["pydantic"] is True and third["doc"]["defaults"]["connect_timeout"] == 9.0  # type: ignore[index]
    # DFO_INVENTORY_CACHE=0: validated every time
    assert _load_elsewhere(p, dict(env, DFO_INVENTORY_CACHE="0"))["pydantic"] is True


def test_a_broken_inventory_is_refused_every_time_with_its_line(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DFO_INVENTORY_CACHE", raising=False)
    p = tmp_path / "inventory.yaml"
    p.write_text(INV.replace("gpus: 8", "gpus: -1"))
    for _ in range(2):  # no record of a refused text
        with pytest.raises(ConfigError) as e:
            inventory.load_inventory(p)
        assert e.value.message.startswith(f"{p}:5: hosts.a.gpus: ")
    # a group naming an unknown host: the record of the (valid) schema does not skip this check
    p.write_text(INV.replace("both: [a, b]", "both: [a, c]"))
    for _ in range(2):
        with pytest.raises(ConfigError, match="groups.both: unknown host 'c'"):
            inventory.load_inventory(p)


def test_a_damaged_or_foreign_record_is_validated_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("DFO_INVENTORY_CACHE", raising=False)
    p = tmp_path / "inventory.yaml"
    p.write_text(INV)
    inv, _ = inventory.load_inventory(p)
    (record,) = (tmp_path / "cache" / "dfo" / "inventory").glob("*.json")
    for bad in ("{not json", json.dumps({"defaults": {"nonsense": 1}, "hosts": {}, "groups": {}}), "[]"):
        record.write_text(bad)
        again, _ = inventory.load_inventory(p)
        assert again == inv  # the file's own values, validated again (and the record written anew)
        assert json.loads(record.read_text()) == inventory.to_doc(inv)


def test_the_fleet_path_imports_no_pydantic() -> None:
    """What exec, tail and top load to reach the hosts: the CLI, the session, the OpenSSH transport."""
    code = ("import sys\n"
            "import orchestrator.cli, orchestrator.hosts, orchestrator.commands.exec, orchestrator.transport.openssh\n"
            "import orchestrator.transport.resolve, orchestrator.steps.exec\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'pydantic_core', 'yaml')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
