"""YAML 1.1's traps (issue 32, item 7): PyYAML reads a bare on/off/yes/no as a bool, 3.10 as 3.1, 0755 as
493, 1:30 as 90. dfo's loader (orchestrator/config/yaml11.py) gives the value the user meant where the
schema says what a field is, or refuses with exit 2 naming the file, the line, the field and the quoting
that fixes it (docs/configuration.md, "YAML 1.1 traps")."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config.models import expand_targets, load_inventory, load_job
from orchestrator.errors import ConfigError

BASE = "name: y11\noutputs: {dest: 's3://b/runs/{name}/'}\n"


def job(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(BASE + text)
    return p


def refused(path: Path, *, inventory: bool = False) -> str:
    with pytest.raises(ConfigError) as ei:
        load_inventory(path) if inventory else load_job(path)
    assert ei.value.exit_code == 2
    return ei.value.message


def test_a_bare_on_key_is_on_in_restarts_and_notify(tmp_path: Path) -> None:
    """docs/recovery.md's contract: `on: [lost, signal]` bare, block and flow style (was: `run.restarts.1:
    keys should be strings`, exit 2)."""
    p = job(tmp_path, "run:\n  command: 'true'\n  restarts:\n    max: 2\n    on: [lost, signal, 134]\n"
                      "notify: {webhook: $HOOK, on: [failed, lost]}\n")
    j = load_job(p).job
    assert j.run is not None and j.run.restarts is not None and j.notify is not None
    assert j.run.restarts.on == ["lost", "signal", 134] and j.run.restarts.max == 2
    assert j.notify.on == ["failed", "lost"]
    p = job(tmp_path, "run: {command: 'true', restarts: {on: [signal], backoff: 5}}\n")
    assert load_job(p).job.run.restarts.on == ["signal"]  # type: ignore[union-attr]


def test_keys_are_their_text_everywhere(tmp_path: Path) -> None:
    """A host named `no`, a group member `no`, a variable `ON`, a metric `yes`: strings, as written."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  no: {host: 10.0.0.1}\n  on: {host: 10.0.0.2}\ngroups:\n  g: [no, on]\n")
    i, path = load_inventory(inv)
    assert list(i.hosts) == ["no", "on"] and expand_targets(i, ["g"], path) == ["no", "on"]
    p = job(tmp_path, "run:\n  command: 'true'\n  env: {ON: 1, OFF: x}\n  log_metrics: {yes: 'y ([0-9]+)'}\n")
    r = load_job(p).job.run
    assert r is not None and r.env == {"ON": "1", "OFF": "x"} and r.log_metrics == {"yes": "y ([0-9]+)"}


def test_string_fields_get_the_text_as_written(tmp_path: Path) -> None:
    """Where a string is wanted: a bare yes/off/date is its text (run.env had yes -> "true"), a number that
    Python writes the same way is its text; quoted values and strings that only look like versions pass."""
    p = job(tmp_path, "python: python3.10\npackages: [torch==2.11, triton==3.10.0]\nrun:\n  command: 'true'\n"
                      "  env: {FLAG: yes, DEBUG: off, N: 8, RATE: 3.5, DAY: 2026-12-02, PY: '3.10', T: true}\n"
                      "  upload: [on]\n")
    j = load_job(p).job
    assert j.python == "python3.10" and j.packages == ["torch==2.11", "triton==3.10.0"]
    assert j.run is not None and j.run.upload == ["on"]
    assert j.run.env == {"FLAG": "yes", "DEBUG": "off", "N": "8", "RATE": "3.5", "DAY": "2026-12-02", "PY": "3.10",
                         "T": "true"}
    inv = tmp_path / "inventory.yaml"
    inv.write_text("defaults: {user: no}\nhosts:\n  a: {host: 10.0.0.1, user: yes}\n")
    i, _ = load_inventory(inv)
    assert (i.defaults.user, i.hosts["a"].user) == ("no", "yes")


@pytest.mark.parametrize("line, field, text, number", [
    ("python: 3.10\n", "python", "3.10", "3.1"),
    ("run:\n  command: 'true'\n  env: {CUDA: 12.10}\n", "run.env.CUDA", "12.10", "12.1"),
    ("run:\n  command: 'true'\n  env:\n    MODE: 0755\n", "run.env.MODE", "0755", "493"),
    ("run:\n  command: 'true'\n  env: {AT: 1:30}\n", "run.env.AT", "1:30", "90"),
    ("packages: [2.10]\n", "packages.0", "2.10", "2.1"),
])
def test_a_number_that_is_not_what_was_written_is_refused_with_the_quoting(
        tmp_path: Path, line: str, field: str, text: str, number: str) -> None:
    p = job(tmp_path, line)
    at = 2 + len(line.splitlines())  # the field's own line: the last of `line`, after BASE's two
    assert refused(p) == f"{p}:{at}: {field}: YAML 1.1 reads {text} as the number {number}: write it quoted: '{text}'"


def test_a_version_in_an_inventory_string_field_is_refused(tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  a:\n    host: 10.0.0.1\n    python: 3.10\n")
    assert refused(inv, inventory=True) == (
        f"{inv}:4: hosts.a.python: YAML 1.1 reads 3.10 as the number 3.1: write it quoted: '3.10'")


def test_a_bare_bool_where_a_number_is_wanted_is_refused(tmp_path: Path) -> None:
    """`gpus: yes` was 1, `max: on` 1 restart, `on: [lost, yes]` a restart on exit code 1."""
    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts:\n  a: {host: 10.0.0.1, gpus: yes}\n")
    assert refused(inv, inventory=True) == f"{inv}:2: hosts.a.gpus: YAML 1.1 reads yes as true, not a number: " \
                                           "write a number"
    p = job(tmp_path, "run:\n  command: 'true'\n  restarts: {max: on}\n")
    assert refused(p).endswith("run.restarts.max: YAML 1.1 reads on as true, not a number: write a number")
    p = job(tmp_path, "run:\n  command: 'true'\n  restarts: {on: [lost, yes]}\n")
    assert refused(p) == f"{p}:5: run.restarts.on: value error, 'yes': each entry is 'lost', 'signal' or an exit " \
                         "code from 1 to 255"


def test_yaml_reads_bools_and_numbers_right_where_they_are_wanted(tmp_path: Path) -> None:
    p = job(tmp_path, "index: {no_index: on}\ndata: {source: 's3://b/d/', dest: /workspace/d, delete: yes}\n"
                      "run:\n  command: 'true'\n  wait: 3.10\n  nproc_per_node: 2\n  autotune_guard: off\n")
    j = load_job(p).job
    assert j.index.no_index is True and j.data is not None and j.data.delete is True
    assert j.run is not None and (j.run.wait, j.run.nproc_per_node, j.run.autotune_guard) == (3.1, 2, False)


def test_the_cli_exits_2_naming_the_field_and_the_quoting(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from orchestrator.cli import main

    inv = tmp_path / "inventory.yaml"
    inv.write_text("hosts: {ghost: {host: 192.0.2.1}}\n")
    p = job(tmp_path, "run:\n  command: 'true'\n  env: {TORCH_VERSION: 2.10}\n")
    with pytest.raises(SystemExit) as ei:
        main(["-i", str(inv), "launch", "-H", "ghost", "-j", str(p)])
    assert ei.value.code == 2
    err = capfd.readouterr().err.replace("\n", "")
    assert f"{p}:5: run.env.TORCH_VERSION: YAML 1.1 reads 2.10 as the number 2.1: write it quoted: '2.10'" in err
    assert "Traceback" not in err


def test_aliases_are_walked_once(tmp_path: Path) -> None:
    """A mapping that holds itself, and nested aliases (9^8 paths), are refused quickly, as before: exit 2."""
    p = job(tmp_path, "run:\n  command: 'true'\n  env: &a {A: *a}\n")
    assert refused(p).endswith("run.env.A: input should be a valid string")
    lines = ["x1: &a1 [" + ", ".join(["yes"] * 9) + "]"]
    lines += [f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(2, 10)]
    p = job(tmp_path, "\n".join(lines) + "\n")
    assert "x1: unknown field" in refused(p)
