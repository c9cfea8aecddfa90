"""Helpers for transfer tests: data sets on the testbed's S3, job files, the real dfo CLI, node checks."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.testbed import S3Endpoint, Testbed
from tests import _cli

MIB = 1 << 20


@dataclass
class Dataset:
    bucket: str
    prefix: str
    files: dict[str, bytes] = field(repr=False)

    @property
    def source(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def total(self) -> int:
        return sum(len(b) for b in self.files.values())

    def digests(self) -> dict[str, str]:
        return {k: hashlib.sha256(v).hexdigest() for k, v in self.files.items()}


def upload(tb: Testbed, bucket: str, prefix: str, files: dict[str, bytes], multipart: set[str] = frozenset(),
           bare: set[str] = frozenset(), s3: S3Endpoint | None = None) -> Dataset:
    """Put files on the testbed's S3 (or on ``s3``, another server): single PUTs (plain MD5 ETags);
    multipart uploads in 5 MiB parts (ETag "<md5>-N") for the names in ``multipart``, with boto3's
    default COMPOSITE CRC32 checksum, or without any checksum for the names also in ``bare``."""
    import io

    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    ep = s3 or tb.s3
    assert ep is not None
    ep.create_bucket(bucket)
    client = ep.client()
    plain = client
    if bare:
        import boto3

        plain = boto3.client("s3", endpoint_url=ep.url, aws_access_key_id=ep.access_key,
                             aws_secret_access_key=ep.secret_key, region_name=ep.region,
                             config=Config(s3={"addressing_style": "path"},
                                           request_checksum_calculation="when_required"))
        plain = ep._fix(plain)  # rclone: no "Expect: 100-continue" (see orchestrator/testbed/s3.py drop_expect_header)
    cfg = TransferConfig(multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB)

    def put(item: tuple[str, bytes]) -> None:
        rel, data = item
        key = prefix + rel
        if rel in multipart:
            (plain if rel in bare else client).upload_fileobj(io.BytesIO(data), bucket, key, Config=cfg)
        else:
            client.put_object(Bucket=bucket, Key=key, Body=data)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, files.items()))
    return Dataset(bucket, prefix, dict(files))


def random_files(count: int, size: int, name: str = "part-{i:04d}.bin") -> dict[str, bytes]:
    return {name.format(i=i): os.urandom(size) for i in range(count)}


@pytest.fixture(scope="module")
def mixed(testbed: Testbed) -> Dataset:
    """40 small objects in nested folders, an empty one, a 9 MiB single PUT, a 12 MiB multipart upload with a
    composite CRC32 and an 11 MiB one without checksums (jobs fetch objects >= 8 MiB in 5 MiB ranged parts)."""
    files: dict[str, bytes] = {}
    for i in range(40):
        files[f"shards/{i % 4}/s-{i:03d}.bin"] = os.urandom(1024 * (1 + (i * 37) % 64))
    files["empty.txt"] = b""
    files["big/plain-9m.bin"] = os.urandom(9 * MIB)
    files["big/multi-12m.bin"] = os.urandom(12 * MIB)
    files["big/bare-11m.bin"] = os.urandom(11 * MIB)
    return upload(testbed, "mixed-" + secrets.token_hex(3), "data/", files,
                  multipart={"big/multi-12m.bin", "big/bare-11m.bin"}, bare={"big/bare-11m.bin"})


@pytest.fixture(scope="module")
def many(testbed: Testbed) -> Dataset:
    """600 objects of 64 KiB: slow enough at concurrency 1 to interrupt in the middle."""
    return upload(testbed, "many-" + secrets.token_hex(3), "tok/", random_files(600, 64 * 1024))


class Xfer:
    """One test's corner of the node, its job files, and dfo runs through the real CLI."""

    def __init__(self, tb: Testbed, tmp: Path) -> None:
        assert tb.s3 is not None
        self.tb, self.tmp, self.s3 = tb, tmp, tb.s3
        self.node = tb.nodes[0]
        self.id = secrets.token_hex(4)
        self.base = f"/workspace/xfer-{self.id}" if tb.isolated else str(tmp / "node-workspace")
        self.shm = f"/dev/shm/xfer-{self.id}" if tb.isolated else str(tmp / "node-shm")

    def job(self, *, data: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
            s3: dict[str, Any] | None = None, name: str = "xferjob") -> Path:
        s3conf = {"endpoint_url": self.s3.url, "region": self.s3.region, "concurrency": 8,
                  "part_size_mb": 5, "multipart_threshold_mb": 8}
        s3conf.update(s3 or {})
        doc: dict[str, Any] = {"name": name, "s3": s3conf}
        if data is not None:
            doc["data"] = data
        if model is not None:
            doc["model"] = model
        path = self.tmp / f"{name}-{secrets.token_hex(3)}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def env(self, **over: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update({"AWS_ACCESS_KEY_ID": self.s3.access_key, "AWS_SECRET_ACCESS_KEY": self.s3.secret_key,
                    "AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"})
        for k, v in over.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def argv(self, *args: str) -> list[str]:
        return _cli.dfo_argv(self.tb.inventory_path, *args)

    def dfo(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return _cli.dfo(self.tb.inventory_path, *args, timeout=timeout, cwd=self.tmp, env=env or self.env())

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return _cli.dfo_popen(self.tb.inventory_path, *args, cwd=self.tmp, env=env or self.env())

    def run_json(self, command: str, job: Path, *extra: str, env: dict[str, str] | None = None
                 ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
        r = self.dfo(command, "-H", self.node.name, "-j", str(job), "--json", *extra, env=env)
        assert r.stdout.strip(), f"no JSON on stdout (exit {r.returncode}): {r.stderr}"
        return r, json.loads(r.stdout)["hosts"][self.node.name]

    # ---------------------------------------------------------------- looking at the node
    def sh(self, cmd: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = self.tb.node_exec(self.node, cmd, timeout=timeout)
        if check:
            assert r.returncode == 0, f"{cmd}: {r.stderr}"
        return r

    def digests(self, dest: str) -> dict[str, str]:
        """sha256 of every file under dest (dfo's .dfo/ excluded), computed on the node."""
        q = shlex.quote(dest)
        out = self.sh(f"cd {q} && find . -path ./.dfo -prune -o -type f -print0 | xargs -0 -r sha256sum").stdout
        res = {}
        for line in out.splitlines():
            digest, name = line.split(None, 1)
            res[name.strip()[2:]] = digest
        return res

    def stats(self, dest: str) -> dict[str, tuple[str, str]]:
        """(inode, mtime with ns) of every file under dest, as the node sees them."""
        q = shlex.quote(dest)
        out = self.sh(f"cd {q} && find . -path ./.dfo -prune -o -type f -printf '%P|%i|%T@\\n'").stdout
        return {p: (i, t) for p, i, t in (line.split("|") for line in out.splitlines())}

    def recorded(self, dest: str) -> set[str]:
        """Files the manifest (manifest.json + journal) says are finished."""
        q = shlex.quote(dest)
        r = self.sh(f"cat {q}/.dfo/manifest.json 2>/dev/null; echo; cat {q}/.dfo/journal.jsonl 2>/dev/null",
                    check=False)
        done: set[str] = set()
        for line in r.stdout.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "files" in rec:
                done |= set(rec["files"])
            elif rec.get("deleted"):
                done.discard(rec["k"])
            elif "k" in rec:
                done.add(rec["k"])
        return done

    def lock_pid(self, dest: str) -> int | None:
        r = self.sh(f"cat {shlex.quote(dest)}/.dfo/lock 2>/dev/null", check=False)
        return int(r.stdout.strip()) if r.stdout.strip().isdigit() else None

    def wait_recorded(self, dest: str, at_least: int, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.sh(f"wc -l < {shlex.quote(dest)}/.dfo/journal.jsonl 2>/dev/null || echo 0", check=False)
            n = int((r.stdout.strip() or "0").split()[0])
            if n >= at_least:
                return n
            time.sleep(0.02)
        raise AssertionError(f"{dest}: fewer than {at_least} files finished within {timeout}s")

    def wait_gone(self, pid: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sh(f"kill -0 {pid} 2>/dev/null", check=False).returncode != 0:
                return
            time.sleep(0.05)
        raise AssertionError(f"pid {pid} still alive after {timeout}s")


@pytest.fixture
def xfer(testbed: Testbed, tmp_path: Path) -> Iterator[Xfer]:
    x = Xfer(testbed, tmp_path)
    yield x
    x.sh(f"rm -rf {shlex.quote(x.base)} {shlex.quote(x.shm)}", check=False)
