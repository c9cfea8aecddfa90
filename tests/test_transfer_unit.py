"""Unit tests of the transfer engine's pure parts: SigV4, verifiers, the manifest, key safety, the controller's
job checks and credential resolution. (The engine end to end is in test_transfer.py, on the testbed.)"""

from __future__ import annotations

import base64
import datetime
import hashlib
import os
import zlib
from pathlib import Path
from unittest import mock

import pytest

from orchestrator.config.models import LoadedJob, S3Config, load_job
from orchestrator.errors import ConfigError
from orchestrator.steps.transfer import build_request, controller_credentials
from remote._proto import RemoteError
from remote.s3 import verify as s3verify
from remote.s3.manifest import Manifest
from remote.s3.sig import node_credentials, sign
from remote.transfer.sync import check_space, list_source

DOC_CREDS = {"access_key": "AKIAIOSFODNN7EXAMPLE", "secret_key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"}


# ------------------------------------------------------------------------------------------ SigV4


def _sig(headers: dict[str, str]) -> str:
    return headers["Authorization"].rsplit("Signature=", 1)[1]


def test_sigv4_s3_documented_get_object_example() -> None:
    """AWS S3 docs, "Signature Calculations for the Authorization Header", GET Object with a Range."""
    h = sign("GET", "/test.txt", [], {"host": "examplebucket.s3.amazonaws.com", "range": "bytes=0-9"},
             DOC_CREDS, "us-east-1", timestamp="20130524T000000Z")
    assert _sig(h) == "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    assert "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date," in h["Authorization"]


def test_sigv4_s3_documented_list_objects_example() -> None:
    h = sign("GET", "/", [("max-keys", "2"), ("prefix", "J")], {"host": "examplebucket.s3.amazonaws.com"},
             DOC_CREDS, "us-east-1", timestamp="20130524T000000Z")
    assert _sig(h) == "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7"


def test_sigv4_test_suite_get_vanilla() -> None:
    """aws-sig-v4-test-suite/get-vanilla (service "service", no payload hash header)."""
    creds = {"access_key": "AKIDEXAMPLE", "secret_key": "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"}
    h = sign("GET", "/", [], {"host": "example.amazonaws.com"}, creds, "us-east-1", service="service",
             timestamp="20150830T123600Z", content_sha_header=False)
    assert _sig(h) == "5fa00fa31553b73ebf1942676e86291e8372ff2a2260956d9b8aae1d763fbf31"


def test_sigv4_matches_botocore_on_awkward_keys_and_queries() -> None:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    from remote.s3.sig import EMPTY_SHA256, uri_encode

    key = "dir with spaces/ünï+cödé=&~x (1).bin"
    query = [("list-type", "2"), ("prefix", "a b/ü+&="), ("continuation-token", "1/2+3==")]
    path = "/bucket/" + uri_encode(key, True)
    qs = "&".join(f"{uri_encode(k, False)}={uri_encode(v, False)}" for k, v in query)
    creds = {"access_key": "AK", "secret_key": "SK/with+chars", "session_token": "TOKEN"}
    ours = sign("GET", path, query, {"host": "10.0.0.1:8333", "range": "bytes=5-9"}, creds, "eu-west-3",
                timestamp="20240102T030405Z")
    req = AWSRequest(method="GET", url=f"http://10.0.0.1:8333{path}?{qs}",
                     headers={"range": "bytes=5-9", "x-amz-content-sha256": EMPTY_SHA256})
    auth = S3SigV4Auth(Credentials("AK", "SK/with+chars", "TOKEN"), "s3", "eu-west-3")
    with mock.patch("botocore.auth.get_current_datetime", return_value=datetime.datetime(2024, 1, 2, 3, 4, 5)):
        auth.add_auth(req)
    assert _sig(ours) == req.headers["Authorization"].rsplit("Signature=", 1)[1]
    assert ours["x-amz-security-token"] == "TOKEN"


# ------------------------------------------------------------------------------------------ verifiers


def _multipart_etag(data: bytes, part: int) -> str:
    digests = [hashlib.md5(data[i:i + part]).digest() for i in range(0, len(data), part)]
    return f"{hashlib.md5(b''.join(digests)).hexdigest()}-{len(digests)}"


def _composite_crc32(data: bytes, part: int) -> str:
    crcs = b"".join(zlib.crc32(data[i:i + part]).to_bytes(4, "big") for i in range(0, len(data), part))
    return base64.b64encode(zlib.crc32(crcs).to_bytes(4, "big")).decode() + f"-{-(-len(data) // part)}"


def _feed_parts(v: s3verify.PartsVerifier, data: bytes, download_part: int) -> None:
    """Download parts in reverse order (as workers may finish them), each fed in odd-sized chunks."""
    for start in reversed(range(0, len(data), download_part)):
        seg = v.segment(start, min(download_part, len(data) - start))
        chunk = data[start:start + download_part]
        for i in range(0, len(chunk), 777):
            seg.update(chunk[i:i + 777])


@pytest.mark.parametrize("size", [5 * 1024, 15 * 1024, 15 * 1024 + 1, 20 * 1024 - 3])
def test_parts_verifiers_match_what_s3_computes(size: int) -> None:
    data, part = os.urandom(size), 5 * 1024
    etag = _multipart_etag(data, part)
    v = s3verify.for_ranged(etag, size, {}, part1_size=part)
    assert isinstance(v, s3verify.PartsVerifier) and v.kind == "md5-multipart"
    _feed_parts(v, data, 2 * part)  # download parts of two upload parts each
    assert v.ok() and v.actual() == etag
    crc = _composite_crc32(data, part)
    head = {"x-amz-checksum-crc32": crc, "x-amz-checksum-type": "COMPOSITE"}
    v = s3verify.for_ranged(etag, size, head, part1_size=part)
    assert v.kind == "crc32-composite"  # the cheaper check wins
    _feed_parts(v, data, part)
    assert v.ok() and v.actual() == crc
    bad = s3verify.for_ranged(etag, size, {}, part1_size=part)
    _feed_parts(bad, data[:-1] + bytes([data[-1] ^ 1]), part)
    assert not bad.ok()
    with pytest.raises(ValueError):
        v.segment(1, 10)  # a download part must start on an upload part boundary


def test_verifier_choice() -> None:
    data = os.urandom(3000)
    md5 = hashlib.md5(data).hexdigest()
    sha = base64.b64encode(hashlib.sha256(data).digest()).decode()
    crc = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    assert s3verify.for_whole_get(md5, {}).kind == "md5"
    # SSE-KMS: the ETag is not an MD5 of the bytes; use the checksum the object carries instead
    kms = {"x-amz-server-side-encryption": "aws:kms", "x-amz-checksum-sha256": sha}
    v = s3verify.for_whole_get(md5, kms)
    v.update(data)
    assert v.kind == "sha256" and v.ok()
    v = s3verify.for_whole_get("abc-2", {"x-amz-checksum-crc32": crc})
    v.update(data)
    assert v.kind == "crc32" and v.ok()
    assert s3verify.for_whole_get("abc-2", {"x-amz-checksum-crc32": crc + "-2"}) is None  # composite: skipped
    # a part 1 size that cannot give N equal parts: no multipart check (and nothing else to check)
    assert s3verify.for_ranged(md5[:32] + "-3", 100 * 1024, {}, part1_size=10 * 1024) is None


# ------------------------------------------------------------------------------------------ manifest


def test_manifest_records_survive_a_torn_journal_and_detect_local_changes(tmp_path: Path) -> None:
    dest = str(tmp_path / "d")
    os.makedirs(dest)
    m = Manifest(dest, "s3://b/p/").open()
    for name in ("a", "b"):
        Path(dest, name).write_bytes(b"x" * 10)
        m.record(name, 10, "e-" + name, os.stat(os.path.join(dest, name)).st_mtime_ns)
    assert m.present("a", 10, "e-a") and not m.present("a", 10, "other-etag") and not m.present("a", 11, "e-a")
    os.close(m._lock_fd)  # as a killed process would: the lock goes, nothing is compacted
    m._lock_fd = None
    with open(m.journal_path, "ab") as f:
        f.write(b'{"source":"s3://b/p/","k":"c","si')  # a torn last line
    m2 = Manifest(dest, "s3://b/p/").open()
    assert set(m2.files) == {"a", "b"}
    Path(dest, "b").write_bytes(b"y" * 10)  # changed on the node (mtime differs)
    os.utime(os.path.join(dest, "b"), ns=(1, 1))
    assert m2.present("a", 10, "e-a") and not m2.present("b", 10, "e-b")
    with pytest.raises(BlockingIOError, match=r"another dfo transfer \(pid \d+\)"):
        Manifest(dest, "s3://b/p/").open(lock_wait=0.2)
    m2.close()
    assert os.path.getsize(m2.journal_path) == 0 and "e-a" in Path(m2.path).read_text()
    assert Manifest(dest, "s3://other/").open().files == {}  # another source: nothing counts as present


# ------------------------------------------------------------------------------------------ listing, space


class _FakeLister:
    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def list_objects(self, bucket: str, prefix: str):  # noqa: ANN201
        for k in self.keys:
            yield {"key": prefix + k, "size": 1, "etag": "e", "checksum_algorithm": None}


def test_listing_skips_folder_markers_and_refuses_unsafe_keys() -> None:
    objs = list_source(_FakeLister(["a/", "a/x.bin", "b/c/d.bin"]), "bkt", "p/")
    assert [o.rel for o in objs] == ["a/x.bin", "b/c/d.bin"]
    for bad in ("../etc/passwd", "a//b", "a/./b", ".dfo/manifest.json"):
        with pytest.raises(RemoteError, match="cannot be a file under the destination"):
            list_source(_FakeLister([bad]), "bkt", "p/")


def test_capacity_check_gives_the_numbers(tmp_path: Path) -> None:
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    assert check_space(str(tmp_path), 1 << 20, 5, "s3://b/m/") > 1 << 20  # fits: no error, the free bytes
    with pytest.raises(RemoteError) as ei:
        check_space(str(tmp_path), free, 10, "s3://b/m/")
    assert ei.value.kind == "verify" and "+ 10% margin" in ei.value.message
    assert "nothing was transferred" in ei.value.message
    assert ei.value.extra["needed"] == int(free * 1.1) and ei.value.extra["available"] > 0


# ------------------------------------------------------------------------------------------ credentials


def test_node_credentials_env_then_file(tmp_path: Path) -> None:
    f = tmp_path / "credentials"
    f.write_text("[default]\naws_access_key_id = FA\naws_secret_access_key = FS\n[p2]\naws_access_key_id = PA\n"
                 "aws_secret_access_key = PS\naws_session_token = PT\n")
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(f), "AWS_EC2_METADATA_DISABLED": "true"}
    assert node_credentials(None, dict(env, AWS_ACCESS_KEY_ID="EA", AWS_SECRET_ACCESS_KEY="ES"))["access_key"] == "EA"
    assert node_credentials(None, env)["access_key"] == "FA"
    got = node_credentials("p2", env)
    assert (got["access_key"], got["session_token"]) == ("PA", "PT")
    assert node_credentials("absent", env) is None


def _job(tmp_path: Path, text: str) -> LoadedJob:
    p = tmp_path / "j.yaml"
    p.write_text(text)
    return load_job(p)


def test_controller_credentials_and_request(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    creds = tmp_path / "creds"
    creds.write_text("[prof]\naws_access_key_id = PA\naws_secret_access_key = PS\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert controller_credentials(S3Config(profile="prof"), tmp_path)["secret_key"] == "PS"
    with pytest.raises(ConfigError, match="s3.profile 'nope'"):
        controller_credentials(S3Config(profile="nope"), tmp_path)
    assert controller_credentials(S3Config(credentials="node"), tmp_path) is None
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "EA")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ES")
    req = build_request(_job(tmp_path, "name: j\ns3: {endpoint_url: 'http://h:1'}\n"
                                       "data: {source: 's3://b/p', dest: /w/d, delete: true}\n"), "data")
    assert req["credentials"] == {"access_key": "EA", "secret_key": "ES", "session_token": None}
    assert (req["delete"], req["margin_pct"], req["endpoint_url"]) == (True, 0.0, "http://h:1")
    with pytest.raises(ConfigError, match="j.yaml:2: model.source: 'gs://b/m'"):  # a rule of the model (FILE:LINE)
        _job(tmp_path, "name: j\nmodel: {source: 'gs://b/m', dest: /dev/shm/m}\n")
    job = _job(tmp_path, "name: j\nmodel: {source: 's3://b/m/', dest: /dev/shm/m}\n")
    with pytest.raises(ConfigError, match="needs a 'data:' section"):
        build_request(job, "data")


def test_node_side_modules_parse_as_python_3_8() -> None:
    """The node may only have python3.8: the engine's modules must not use newer syntax."""
    import ast

    root = Path(__file__).resolve().parent.parent / "remote"
    for name in ("s3/client", "s3/download", "s3/manifest", "s3/sig", "transfer/stage", "transfer/sync",
                 "s3/verify"):
        ast.parse((root / f"{name}.py").read_text(), feature_version=(3, 8))
