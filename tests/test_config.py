"""Unit tests of inventory/job parsing: errors name the file, the line and the field (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator.cli import cli
from orchestrator.config.models import expand_targets, load_inventory, load_job
from orchestrator.errors import ConfigError, UsageError
from orchestrator.transport.resolve import resolve_host

INV = """\
defaults:
  user: root
  identity: ~/.ssh/id_ed25519
  known_hosts: kh
hosts:
  gpu-a: {host: 10.0.0.1, port: 2222}
  gpu-b:
    host: 10.0.0.2
    port: notaport
groups:
  fleet: [gpu-a, gpu-b]
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_bad_port_names_file_line_and_field(tmp_path: Path) -> None:
    p = write(tmp_path, "inventory.yaml", INV)
    with pytest.raises(ConfigError) as ei:
        load_inventory(p)
    assert ei.value.message == f"{p}:9: hosts.gpu-b.port: value is not a valid integer"
    assert ei.value.exit_code == 2


def test_unknown_field_is_refused_with_line(tmp_path: Path) -> None:
    p = write(tmp_path, "inventory.yaml", INV.replace("port: notaport", "port: 22\n    prot: 5"))
    with pytest.raises(ConfigError) as ei:
        load_inventory(p)
    assert ei.value.message.startswith(f"{p}:10: hosts.gpu-b.prot: unknown field")


def test_yaml_syntax_error_has_line(tmp_path: Path) -> None:
    p = write(tmp_path, "inventory.yaml", "hosts:\n  a: {host: x\n  b: 1\n")
    with pytest.raises(ConfigError) as ei:
        load_inventory(p)
    assert "not valid YAML" in ei.value.message and f"{p}:" in ei.value.message


def test_groups_and_all_expand_in_order(tmp_path: Path) -> None:
    p = write(tmp_path, "inventory.yaml", INV.replace("notaport", "22") + "  both: [fleet, gpu-a]\n")
    inv, path = load_inventory(p)
    assert expand_targets(inv, ["fleet"], path) == ["gpu-a", "gpu-b"]
    assert expand_targets(inv, ["all"], path) == ["gpu-a", "gpu-b"]
    assert expand_targets(inv, ["gpu-b", "both"], path) == ["gpu-b", "gpu-a"]
    with pytest.raises(UsageError):
        expand_targets(inv, ["nope"], path)


def test_group_with_unknown_member(tmp_path: Path) -> None:
    p = write(tmp_path, "inventory.yaml", "hosts:\n  a: {host: x}\ngroups:\n  g: [a, zz]\n")
    with pytest.raises(ConfigError, match="groups.g: unknown host 'zz'"):
        load_inventory(p)


def test_ssh_config_alias_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write(tmp_path, "ssh_config", """\
Host h200-a
  HostName 192.0.2.7
  Port 10638
  User ubuntu
  IdentityFile ~/.ssh/h200
  ProxyJump jump@bastion:2200
""")
    monkeypatch.setenv("DFO_SSH_CONFIG", str(cfg))
    p = write(tmp_path, "inventory.yaml",
              "defaults: {known_hosts: kh}\nhosts:\n  h200-a: {}\n  b: {host: h200-a, port: 22, user: root}\n")
    inv, path = load_inventory(p)
    h = resolve_host(inv, "h200-a", path)
    assert (h.hostname, h.port, h.user, h.proxy_jump) == ("192.0.2.7", 10638, "ubuntu", "jump@bastion:2200")
    assert h.identities[0].endswith("/.ssh/h200")
    assert h.known_hosts == str(tmp_path / "kh")
    b = resolve_host(inv, "b", path)  # the host's own entry wins over ~/.ssh/config
    assert (b.hostname, b.port, b.user) == ("192.0.2.7", 22, "root")


def test_ssh_config_wins_over_inventory_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write(tmp_path, "ssh_config", "Host h200-a\n  HostName 192.0.2.7\n  Port 10638\n  User ubuntu\n")
    monkeypatch.setenv("DFO_SSH_CONFIG", str(cfg))
    p = write(tmp_path, "inventory.yaml", "defaults: {user: root, port: 2222, identity: nokey}\nhosts:\n  h200-a: {}\n"
                                          "  other: {host: 192.0.2.9}\n")
    inv, path = load_inventory(p)
    h = resolve_host(inv, "h200-a", path)
    assert (h.port, h.user, h.identities) == (10638, "ubuntu", [])  # a missing default key is dropped
    o = resolve_host(inv, "other", path)
    assert (o.hostname, o.port, o.user) == ("192.0.2.9", 2222, "root")


def test_missing_host_identity_is_a_config_error(tmp_path: Path) -> None:
    p = write(tmp_path, "inventory.yaml", "hosts:\n  a: {host: 192.0.2.1, identity: missing_key}\n")
    inv, path = load_inventory(p)
    with pytest.raises(ConfigError, match="hosts.a.identity: .*missing_key does not exist"):
        resolve_host(inv, "a", path)


JOB = """\
name: demo
installer: uv
packages: [torch==2.11.0]
overrides:
  - {package: triton==3.7.0, reason: "sm_120 autotuner fixes"}
run:
  command: "{python} train.py"
  wait: -1
"""


def test_job_field_error(tmp_path: Path) -> None:
    p = write(tmp_path, "demo.yaml", JOB)
    with pytest.raises(ConfigError) as ei:
        load_job(p)
    assert ei.value.message.startswith(f"{p}:8: run.wait: input should be greater than or equal to 0")


def test_job_missing_section_is_named(tmp_path: Path) -> None:
    p = write(tmp_path, "demo.yaml", JOB.replace("  wait: -1\n", ""))
    lj = load_job(p)
    assert lj.job.overrides[0].name == "triton"
    with pytest.raises(ConfigError, match="needs a 'data:' section"):
        lj.need("data")


def test_cli_bad_inventory_exits_2_without_traceback(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli import main

    p = write(tmp_path, "inventory.yaml", INV)
    with pytest.raises(SystemExit) as ei:
        main(["-i", str(p), "verify-env", "-H", "gpu-a"])
    assert ei.value.code == 2
    err = capfd.readouterr().err
    assert f"{p}:9: hosts.gpu-b.port: value is not a valid integer" in err.replace("\n", "")
    assert "Traceback" not in err


def test_cli_help_lists_every_command() -> None:
    res = CliRunner().invoke(cli, ["--help"])
    assert res.exit_code == 0
    for name in ["verify-env", "provision", "stage-model", "sync-data", "launch", "tail", "status", "stop", "up",
                 "demo"]:
        assert name in res.output


@pytest.mark.parametrize("command", ["launch", "up"])
def test_a_gang_over_the_wrong_number_of_hosts_is_refused_before_any_host(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], command: str) -> None:
    """run.nodes: 2 with -H naming one host: exit 2 naming both numbers, before any host is touched (the
    host does not exist: touching it would be exit 4). The gang itself: tests/test_gang.py."""
    from orchestrator.cli import main

    inv = write(tmp_path, "inventory.yaml", "hosts: {ghost: {host: 192.0.2.1}}\n")
    job = write(tmp_path, "gang.yaml", "name: gang\nrun:\n  command: echo hi\n  nodes: 2\n")
    with pytest.raises(SystemExit) as ei:
        main(["-i", str(inv), command, "-H", "ghost", "-j", str(job)])
    assert ei.value.code == 2
    err = capfd.readouterr().err.replace("\n", "")
    assert "job gang: run.nodes is 2 but -H names 1 host (ghost)" in err and "Traceback" not in err
