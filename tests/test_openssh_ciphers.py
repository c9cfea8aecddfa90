"""Issue 23: dfo's own OpenSSH connections prefer AES-GCM (cheaper per byte than chacha20-poly1305 on a CPU
with AES instructions: docs/benchmarks.md, "## pull"), but only where neither the user's ssh_config nor the
inventory sets Ciphers, and without removing any cipher ssh allows by default.

Each case asks the real ssh client (`ssh -G`) what it would offer with the ssh_config dfo writes for the
host (openssh_setup.resolve: dfo's rules, the user's file, the inventory's defaults, the preference).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from orchestrator.transport import openssh_setup as setup

pytestmark = pytest.mark.skipif(setup.usable_ssh() is None, reason="needs an OpenSSH client 8.0+")
GCM = ["aes128-gcm@openssh.com", "aes256-gcm@openssh.com"]


def offered(tmp_path: Path, user_config: str, options: list[str] | None = None) -> list[str]:
    """The ciphers ssh would offer, in order, for a host named in an ssh_config of ``user_config``."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text(user_config + "Host gpu-1\n  HostName 192.0.2.1\n")
    _, resolved = setup.resolve("gpu-1", options or [], {}, str(cfg), 5)
    return resolved["ciphers"][0].split(",")


def ssh_default() -> list[str]:
    ssh = setup.usable_ssh()
    assert ssh is not None
    out = subprocess.run([ssh, "-G", "-F", "/dev/null", "gpu-1"], capture_output=True, text=True, check=True).stdout
    return next(ln.split(" ", 1)[1] for ln in out.splitlines() if ln.startswith("ciphers ")).split(",")


def test_without_a_ciphers_setting_aes_gcm_comes_first_and_nothing_is_removed(tmp_path: Path) -> None:
    v = setup.ssh_version(setup.usable_ssh() or "")
    if v is None or v < setup.CIPHERS_FIRST_SINCE:
        pytest.skip("ssh older than 8.1: no '^' in Ciphers, dfo sets no preference")
    got = offered(tmp_path, "")
    assert got[:2] == GCM, got
    assert sorted(got) == sorted(ssh_default()), (got, ssh_default())  # the same set, reordered


@pytest.mark.parametrize("line", ["Ciphers chacha20-poly1305@openssh.com",
                                  "Ciphers -aes128-gcm@openssh.com,aes256-gcm@openssh.com",
                                  "Ciphers ^aes256-ctr"])
def test_the_users_own_ciphers_setting_is_used_as_it_is(tmp_path: Path, line: str) -> None:
    """Set, reduced or reordered by the user (for this host, in a Host block): theirs, not dfo's preference."""
    cfg_dir = tmp_path / "u"
    cfg_dir.mkdir()
    got = offered(cfg_dir, f"Host gpu-1\n  {line}\n")
    alone = tmp_path / "alone"
    alone.write_text(f"Host gpu-1\n  {line}\n")
    ssh = setup.usable_ssh()
    assert ssh is not None
    out = subprocess.run([ssh, "-G", "-F", str(alone), "gpu-1"], capture_output=True, text=True, check=True).stdout
    want = next(ln.split(" ", 1)[1] for ln in out.splitlines() if ln.startswith("ciphers ")).split(",")
    assert got == want, (got, want)
    if line.startswith("Ciphers chacha"):
        assert got == ["chacha20-poly1305@openssh.com"]
    if line.startswith("Ciphers -"):
        assert not set(GCM) & set(got), got


def test_the_inventorys_ssh_options_ciphers_wins(tmp_path: Path) -> None:
    got = offered(tmp_path, "", ["Ciphers=aes256-ctr"])
    assert got == ["aes256-ctr"], got
