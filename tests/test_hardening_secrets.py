"""Secrets stay secret (issue 10, items 8-10): credentials in package lines, secret env values, local transport.

* 8: a package line ``pkg @ http://user:TOKEN@host/pkg.whl`` never shows TOKEN in the node's process
  listing, the terminal, ``--json``, the provision record (written 0600) or an error message;
* 9: a run.env value holding URL credentials is secret (never in meta.json) whatever its name, and
  secret names are matched as whole words (TOKENIZERS_PARALLELISM is not secret, HF_TOKEN is);
* 10: with ``transport: local`` the trainer gets an allow-listed environment, not the controller's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shlex
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests._cli import dfo
from tests._provision_fixtures import Pv, node_wheelhouse, pv, wheelhouse  # noqa: F401
from tests._runs_fixtures import RunsEnv, inventory_copy
from tests._wheels import build_wheel

# ---------------------------------------------------------------------------------------------
# unit: the matcher and the redaction


@pytest.mark.parametrize("name", [
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID",
    "AWS_SESSION_TOKEN", "GITHUB_PAT", "NPM_TOKEN", "DB_PASSWORD", "MYSQL_PWD", "PGPASSWORD", "HFTOKEN",
    "CLIENT_SECRET", "OPENAI_APIKEY", "GOOGLE_APPLICATION_CREDENTIALS", "SENTRY_DSN", "BASIC_AUTH",
    "GPG_PASSPHRASE", "PRIVATE_KEY_PATH", "hf_token", "NVIDIA_API_KEY",
])
def test_secret_names_are_whole_words(name: str) -> None:
    from orchestrator.config.models import is_secret_env

    assert is_secret_env(name), name


@pytest.mark.parametrize("name", [
    "TOKENIZERS_PARALLELISM", "MAX_NEW_TOKENS", "KEYBOARD_LAYOUT", "MONKEY_PATCH", "AUTHOR", "COMPASS_DIR",
    "BYPASS_CACHE", "PWD", "OLDPWD", "PYTORCH_CUDA_ALLOC_CONF", "SESSIONS_DIR", "KEYRING_BACKEND", "PATH",
])
def test_names_that_only_contain_a_secret_word_are_not_secret(name: str) -> None:
    from orchestrator.config.models import is_secret_env

    assert not is_secret_env(name), name


def test_a_value_with_url_credentials_is_secret_whatever_its_name(tmp_path: Path) -> None:
    from orchestrator.config.models import is_secret_env, load_job
    from orchestrator.steps.runs import split_env

    assert is_secret_env("DATABASE_URL", value="postgres://u:pass@db/x")
    assert is_secret_env("REPO", value="https://ghp_abc@github.com/o/r.git")  # a token as the user
    assert not is_secret_env("DATABASE_URL", value="postgres://db:5432/x")
    assert not is_secret_env("NOTE", value="mail me at a@b.org, see https://host/x?y=a@b")
    assert is_secret_env("X", job=None) is False
    job_file = tmp_path / "j.yaml"
    job_file.write_text("name: j\nrun: {command: c, env: {DATABASE_URL: 'postgres://u:pass@db/x', "
                        "TOKENIZERS_PARALLELISM: 'false', HF_TOKEN: t}}\n")
    plain, secret = split_env(load_job(job_file))
    assert plain == {"TOKENIZERS_PARALLELISM": "false"}
    assert secret == {"DATABASE_URL": "postgres://u:pass@db/x", "HF_TOKEN": "t"}


@pytest.mark.parametrize("text, want", [
    ("foo @ https://user:tok@host/foo.whl", "foo @ https://***@host/foo.whl"),
    ("git+https://TOKEN@github.com/o/r.git", "git+https://***@github.com/o/r.git"),
    ("--extra-index-url=https://u:p@ss@h:8080/simple/", "--extra-index-url=https://***@h:8080/simple/"),
    ("a http://u:p@h/x and https://v:q@k/y", "a http://***@h/x and https://***@k/y"),
    ("https://host/x?who=a@b", "https://host/x?who=a@b"),
    ("https://host:8080/simple", "https://host:8080/simple"),
])
def test_redact(text: str, want: str) -> None:
    from remote.lib.redact import redact

    assert redact(text) == want


def test_redact_obj_reaches_every_string() -> None:
    from remote.lib.redact import redact_obj

    doc = {"a": ["x @ https://u:SECRET@h/x.whl", {"https://u:SECRET@h": 1}], "n": 3, "t": ("http://u:SECRET@h",)}
    assert "SECRET" not in json.dumps(redact_obj(doc))
    assert redact_obj(doc)["n"] == 3


# ---------------------------------------------------------------------------------------------
# item 8: credentials in a package line, on a real node


class _WheelServer:
    """A small HTTP server with basic auth on the testbed's bridge address, serving one wheel.

    When an authorized request for the wheel arrives, the installer that sent it is running: the
    server reads the node's process listing right then (``snapshots``), before it answers."""

    def __init__(self, pv: Pv, wheel: Path, user: str, password: str) -> None:  # noqa: F811
        self.pv, self.wheel, self.data = pv, wheel, wheel.read_bytes()
        self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.snapshots: list[str] = []
        self.requests: list[tuple[str, str, bool]] = []
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: bool) -> None:
                ok = self.headers.get("Authorization") == srv.auth
                srv.requests.append((self.command, self.path, ok))
                if not ok:
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="wheels"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if self.path.rstrip("/").endswith(".whl") and not srv.snapshots:
                    srv.snapshots.append(srv.pv.tb.node_exec(srv.pv.node, "ps -ww -eo args", timeout=20).stdout)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(srv.data)))
                self.end_headers()
                if body:
                    self.wfile.write(srv.data)

            def do_GET(self) -> None:  # noqa: N802
                self._answer(True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(False)

            def log_message(self, *args: Any) -> None:
                pass

        address = pv.tb.bridge_address if pv.tb.isolated and pv.tb.bridge_address else "127.0.0.1"
        self.httpd = ThreadingHTTPServer((address, 0), Handler)
        self.url_base = f"http://{address}:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def wheel_server(pv: Pv, tmp_path: Path) -> Iterator[tuple[_WheelServer, str]]:  # noqa: F811
    token = "SECRETTOKEN" + secrets.token_hex(6)
    wheel = build_wheel(tmp_path / "served", "dfosecretpkg", "1.0", [])
    srv = _WheelServer(pv, wheel, "wheeluser", token)
    try:
        yield srv, token
    finally:
        srv.close()


def _record(pv: Pv, name: str) -> tuple[str, str]:  # noqa: F811
    """(the provision record's text, its mode) on the node."""
    path = f"{pv.workspace}/.dfo/provision/{name}.json"
    r = pv.sh(f"stat -c %a {shlex.quote(path)} && cat {shlex.quote(path)}")
    assert r.returncode == 0, r.stderr
    mode, _, text = r.stdout.partition("\n")
    return text, mode.strip()


@pytest.mark.testbed
@pytest.mark.parametrize("installer", ["uv", "pip"])
def test_package_line_credentials_never_leak(pv: Pv, wheel_server: tuple[_WheelServer, str],  # noqa: F811
                                             installer: str) -> None:
    srv, token = wheel_server
    line = f"dfosecretpkg @ http://wheeluser:{token}@{srv.url_base[len('http://'):]}/{srv.wheel.name}"
    job = pv.job("secretjob", packages=["faketriton==3.6.0", line], installer=installer)
    # on a terminal
    r, _ = pv.provision(job, as_json=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert srv.snapshots, f"the wheel was never fetched with the right credentials: {srv.requests}"
    ps = srv.snapshots[0]
    assert "pip install" in ps and pv.venv in ps, "the installer was not running when ps was read:\n" + ps
    assert token not in ps, [ln for ln in ps.splitlines() if token in ln]  # the node's process listing
    assert token not in r.stdout + r.stderr
    assert "dfosecretpkg @ http://***@" in r.stdout  # the step is still named, redacted
    assert pv.packages().get("dfosecretpkg") == "1.0"
    text, mode = _record(pv, "secretjob")
    assert token not in text and mode == "600", mode
    # --json, on a fresh venv so the install runs again
    assert pv.sh(f"rm -rf {shlex.quote(pv.venv)}").returncode == 0
    srv.snapshots.clear()
    r, doc = pv.provision(job)
    assert r.returncode == 0, r.stderr
    assert doc and doc["ok"] is True and srv.snapshots and token not in srv.snapshots[0]
    assert token not in r.stdout + r.stderr
    assert any(s["name"].startswith("dfosecretpkg @ http://***@") for s in doc["steps"])
    text, mode = _record(pv, "secretjob")
    assert token not in text and mode == "600"
    # no file dfo left on the node holds it (the requirements file is gone)
    leak = pv.sh(f"grep -rl {token} {shlex.quote(pv.base)} /tmp ~/.cache 2>/dev/null; true")
    assert leak.stdout.strip() == ""


@pytest.mark.testbed
def test_wrong_credentials_fail_without_showing_them(pv: Pv, wheel_server: tuple[_WheelServer, str]) -> None:  # noqa: F811
    srv, _ = wheel_server
    wrong = "WRONGSECRET" + secrets.token_hex(6)
    line = f"dfosecretpkg @ http://wheeluser:{wrong}@{srv.url_base[len('http://'):]}/{srv.wheel.name}"
    job = pv.job("wrongjob", packages=[line])
    r, doc = pv.provision(job)
    assert r.returncode == 3, r.stdout + r.stderr
    assert any(not ok for _, _, ok in srv.requests), srv.requests  # the installer did ask, and was refused
    assert doc and doc["ok"] is False and wrong not in r.stdout + r.stderr
    text, mode = _record(pv, "wrongjob")
    assert wrong not in text and mode == "600"
    r, _ = pv.provision(job, as_json=False)
    assert r.returncode == 3 and "error" in r.stderr.lower()
    assert wrong not in r.stdout + r.stderr
    # verify-env reads the venv (pkgcheck: "asked LINE; ... is not installed") and the record
    for extra in ([], ["--json"]):
        r = pv.dfo("verify-env", "-H", pv.node.name, "-j", str(job), *extra)
        assert r.returncode == 3 and "dfosecretpkg" in r.stdout + r.stderr, r.stdout + r.stderr
        assert wrong not in r.stdout + r.stderr


def test_a_bad_spec_with_credentials_is_exit_2_without_them(tmp_path: Path) -> None:
    job = tmp_path / "bad.yaml"
    job.write_text(yaml.safe_dump({"name": "bad", "packages": ["foo @ https://u:BADSPECSECRET@h/foo.whl ; os_name =="],
                                   "index": {"extra_urls": ["https://u:IDXSECRET@h/simple  x"]}}))
    inv = tmp_path / "inv.yaml"
    inv.write_text("defaults: {known_hosts: %s}\nhosts:\n  me: {transport: local}\n" % (tmp_path / "kh"))
    r = dfo(inv, "provision", "-H", "me", "-j", str(job), timeout=60, env=dict(os.environ))
    assert r.returncode == 2, r.stderr
    assert "BADSPECSECRET" not in r.stdout + r.stderr and "https://***@h/foo.whl" in r.stderr


# ---------------------------------------------------------------------------------------------
# item 9: meta.json on a real node


@pytest.mark.testbed
def test_url_credentials_in_run_env_never_reach_meta_json(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    env = RunsEnv(testbed, testbed.nodes[0], inventory_copy(testbed, tmp_path), tmp_path)
    password = "DBPASS" + secrets.token_hex(6)
    url = f"postgres://u:{password}@db/x"
    show = ("import hashlib, os\n"
            "print('DATABASE_URL', hashlib.sha256(os.environ.get('DATABASE_URL', '').encode()).hexdigest())\n"
            "print('TOKENIZERS_PARALLELISM', os.environ.get('TOKENIZERS_PARALLELISM'))\n")
    job, _ = env.job("python3 show.py", {"show.py": show},
                     env={"DATABASE_URL": url, "TOKENIZERS_PARALLELISM": "false"})
    h = env.dfo("launch", "-H", env.node.name, "-j", str(job), "--json", "--wait", "5")
    assert h.returncode == 0, h.stderr
    run = json.loads(h.stdout)["hosts"][env.node.name]["run"]
    env.wait_state(run, ("succeeded", "failed"))
    r = env.dfo("tail", "-H", env.node.name, run, "-n", "+1", "--no-follow")
    got = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert got.get("DATABASE_URL") == hashlib.sha256(url.encode()).hexdigest(), r.stdout  # the trainer has it
    assert got.get("TOKENIZERS_PARALLELISM") == "false"
    meta = env.run_file(run, "meta.json")
    assert "DATABASE_URL" in meta["secret_env"] and "DATABASE_URL" not in meta["env"]
    assert meta["env"].get("TOKENIZERS_PARALLELISM") == "false"
    assert password not in json.dumps(meta) and password not in h.stdout + h.stderr
    leak = env.tb.node_exec(env.node, f"grep -rl {password} /workspace/.dfo /root/runs-test; true")
    assert leak.stdout == ""


# ---------------------------------------------------------------------------------------------
# item 10: transport: local


def test_local_transport_gives_the_trainer_an_allow_listed_environment(tmp_path: Path) -> None:
    home, ws, work = tmp_path / "home", tmp_path / "ws", tmp_path / "work"
    home.mkdir()
    inv = tmp_path / "inv.yaml"
    inv.write_text(yaml.safe_dump({"defaults": {"known_hosts": str(tmp_path / "kh")},
                                   "hosts": {"me": {"transport": "local", "workspace": str(ws),
                                                    "python": sys.executable}}}))
    job = tmp_path / "envjob.yaml"
    job.write_text(yaml.safe_dump({"name": "envjob", "venv": "/usr", "run": {
        "workdir": str(work), "command": "env", "wait": 0,
        "env": {"PLAIN": "declared"}, "secret_env": ["WANDB_API_KEY"]}}))
    controller = {k: v for k, v in os.environ.items() if not k.startswith(("DFO_", "AWS_", "HF_"))}
    controller.update({
        "HOME": str(home), "AWS_SECRET_ACCESS_KEY": "awsSECRETvalue", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY",
        "HF_TOKEN": "hfSECRETvalue", "NVIDIA_API_KEY": "nvSECRETvalue", "SOME_RANDOM_SETTING": "controllerOnly",
        "CUDA_VISIBLE_DEVICES": "0,1", "LANG": "C.UTF-8", "HF_HOME": str(tmp_path / "hf"),
        "PIP_INDEX_URL": "https://u:pipSECRETvalue@h/simple", "WANDB_API_KEY": "wandbDECLARED",
    })
    r = dfo(inv, "launch", "-H", "me", "-j", str(job), "--json", "--wait", "10", timeout=120, env=controller,
            cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    run = json.loads(r.stdout)["hosts"]["me"]["run"]
    log = (ws / ".dfo" / "runs" / run / "log").read_text()
    got = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "HF_TOKEN", "NVIDIA_API_KEY", "SOME_RANDOM_SETTING",
                 "PIP_INDEX_URL"):
        assert name not in got, f"{name} reached the trainer"
    assert "SECRETvalue" not in log and "controllerOnly" not in log
    assert got["PLAIN"] == "declared" and got["WANDB_API_KEY"] == "wandbDECLARED"  # what the job names
    assert got["CUDA_VISIBLE_DEVICES"] == "0,1" and got["LANG"] == "C.UTF-8" and got["HOME"] == str(home)
    assert got["HF_HOME"] == str(tmp_path / "hf") and got["PATH"] == controller["PATH"]
    assert got["DFO_RUN_ID"] == run


@pytest.mark.testbed
def test_the_node_keeps_url_credentials_out_of_meta_json_even_when_sent_as_plain(testbed, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Defence in depth: remote.runs itself moves a credentialed value (and a secret name) out of meta.json."""
    from orchestrator.agent import run_module
    from orchestrator.config.models import load_inventory
    from orchestrator.transport import open_connection
    from orchestrator.transport.resolve import resolve_host

    inv_path = inventory_copy(testbed, tmp_path)
    inv, p = load_inventory(inv_path)
    conn = open_connection(resolve_host(inv, testbed.nodes[0].name, p))
    password = "NODEPASS" + secrets.token_hex(6)
    run_id = f"plainsent-{secrets.token_hex(3)}"
    try:
        run_module(conn, "remote.runs", {
            "op": "launch", "workspace": "/workspace", "run_id": run_id, "job": "plainsent", "host": conn.name,
            "command": "true", "workdir": "/root/runs-test", "force": True, "autotune_guard": False,
            "env": {"DATABASE_URL": f"postgres://u:{password}@db/x", "HF_TOKEN": password + "x", "PLAIN": "v"},
            "secret_env": {}, "stop_grace": 5, "job_file": "plainsent.yaml", "uploads": []}, timeout=60)
    finally:
        conn.close()
    env = RunsEnv(testbed, testbed.nodes[0], inv_path, tmp_path)
    meta = env.run_file(run_id, "meta.json")
    assert password not in json.dumps(meta)
    assert meta["secret_env"] == ["DATABASE_URL", "HF_TOKEN"] and meta["env"]["PLAIN"] == "v"
