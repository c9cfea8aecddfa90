"""sync-data and stage-model through the real CLI, on testbed nodes, against the testbed's real S3 server."""

from __future__ import annotations

import json
import re
import shlex
import signal

import pytest

from tests._s3_fixtures import MIB, Xfer, many, mixed, random_files, upload, xfer  # noqa: F401

pytestmark = pytest.mark.testbed


def _isolated(x: Xfer) -> None:
    if not x.tb.isolated:
        pytest.skip("needs a node with its own mounts (root + network namespaces)")


def test_full_sync_then_noop(xfer: Xfer, mixed) -> None:  # noqa: F811
    dest = f"{xfer.base}/data"
    job = xfer.job(data={"source": mixed.source, "dest": dest})
    r, doc = xfer.run_json("sync-data", job)
    assert r.returncode == 0, r.stderr
    assert doc["ok"] is True and doc["dest"] == dest
    assert (doc["fetched"], doc["skipped"], doc["deleted"], doc["bytes"]) == (len(mixed.files), 0, 0, mixed.total)
    # 41 whole GETs + the 9 MiB single PUT in ranged parts: MD5; the multipart uploads, part by part: the
    # composite CRC32 boto3 gave one of them, the "<md5>-N" ETag of the other
    assert doc["verified"] == {"md5": 42, "crc32-composite": 1, "md5-multipart": 1}
    assert doc["mb_per_s"] > 0 and doc["seconds"] > 0
    assert xfer.digests(dest) == mixed.digests()
    assert xfer.sh(f"ls -A {dest}/.dfo/tmp").stdout == ""

    human = xfer.dfo("sync-data", "-H", xfer.node.name, "-j", str(job))
    assert human.returncode == 0, human.stderr
    assert f"{xfer.node.name}: sync-data: no change: {len(mixed.files)} files" in human.stdout
    r, doc = xfer.run_json("sync-data", job)
    assert (doc["fetched"], doc["skipped"], doc["bytes"]) == (0, len(mixed.files), 0)


def test_changes_on_both_sides_and_delete(xfer: Xfer) -> None:  # noqa: F811
    ds = upload(xfer.tb, "chg-" + xfer.id, "d/", random_files(10, 4096, "f{i}.bin"))
    dest = f"{xfer.base}/chg"
    job = xfer.job(data={"source": ds.source, "dest": dest})
    assert xfer.run_json("sync-data", job)[1]["fetched"] == 10
    client = xfer.s3.client()
    client.put_object(Bucket=ds.bucket, Key="d/f1.bin", Body=b"new content")
    client.delete_object(Bucket=ds.bucket, Key="d/f2.bin")
    xfer.sh(f"truncate -s 7 {dest}/f3.bin && echo stray > {dest}/local-only.txt")
    r, doc = xfer.run_json("sync-data", job)
    assert r.returncode == 0, r.stderr
    assert (doc["fetched"], doc["skipped"], doc["deleted"]) == (2, 7, 0)  # f1 changed on S3, f3 damaged here
    assert "f2.bin" in xfer.digests(dest)  # no --delete: kept
    r, doc = xfer.run_json("sync-data", job, "--delete")
    assert (doc["fetched"], doc["deleted"]) == (0, 1)  # f2.bin; local-only.txt is not dfo's: it stays
    expected = {k: v for k, v in ds.digests().items() if k != "f2.bin"}
    expected["f1.bin"] = __import__("hashlib").sha256(b"new content").hexdigest()
    expected["local-only.txt"] = __import__("hashlib").sha256(b"stray\n").hexdigest()
    assert xfer.digests(dest) == expected
    assert "manifest.json" in xfer.sh(f"ls {dest}/.dfo").stdout


@pytest.mark.parametrize("how", ["kill-remote-process", "drop-ssh"])
def test_resume_after_interruption(xfer: Xfer, many, how: str) -> None:  # noqa: F811
    dest = f"{xfer.base}/tok"
    job = xfer.job(data={"source": many.source, "dest": dest}, s3={"concurrency": 1})
    proc = xfer.popen("sync-data", "-H", xfer.node.name, "-j", str(job), "--json")
    try:
        xfer.wait_recorded(dest, 15)  # early: the node may finish many more before it sees the link gone
        pid = xfer.lock_pid(dest)
        assert pid is not None
        if how == "kill-remote-process":
            xfer.sh(f"kill -{int(signal.SIGKILL)} {pid}")
        else:
            assert xfer.tb.kill_ssh_sessions(xfer.node) >= 1
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 4, out + err  # the controller lost its node side: exit 4, resumable
    assert "stopped without a result" in out
    if how == "drop-ssh":
        xfer.wait_gone(pid)  # the node side noticed the closed link and stopped by itself, cleanly
        assert xfer.sh(f"ls -A {dest}/.dfo/tmp").stdout == ""  # its temp files are gone already
    done = xfer.recorded(dest)
    assert 15 <= len(done) < len(many.files), "the transfer ended before it was interrupted"
    before = xfer.stats(dest)
    partial = xfer.digests(dest)
    for rel in done:  # every finished file is complete and correct
        assert partial[rel] == many.digests()[rel]

    r, doc = xfer.run_json("sync-data", job)
    assert r.returncode == 0, r.stderr
    assert doc["fetched"] == len(many.files) - len(done)
    assert doc["skipped"] == len(done)
    after = xfer.stats(dest)
    assert all(after[rel] == before[rel] for rel in done), "a finished file was written again"
    assert xfer.digests(dest) == many.digests()
    assert xfer.sh(f"ls -A {dest}/.dfo/tmp").stdout == ""


def test_credentials_never_visible(xfer: Xfer, many) -> None:  # noqa: F811
    secret = xfer.s3.secret_key
    dest = f"{xfer.base}/cred"
    job = xfer.job(data={"source": many.source, "dest": dest}, s3={"concurrency": 1})
    proc = xfer.popen("sync-data", "-H", xfer.node.name, "-j", str(job))
    try:
        xfer.wait_recorded(dest, 5)
        pid = xfer.lock_pid(dest)
        listing = xfer.sh("ps -eo pid,args").stdout
        own = xfer.sh(f"tr '\\0' '\\n' < /proc/{pid}/environ; tr '\\0' ' ' < /proc/{pid}/cmdline").stdout
        assert "remote.transfer.sync" in listing
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert secret not in listing and secret not in own
    assert "AWS_SECRET" not in own
    assert secret not in out + err
    where = "/root /workspace /tmp /dev/shm" if xfer.tb.isolated else f"{shlex.quote(dest)} $HOME/.cache/dfo"
    found = xfer.sh(f"grep -rlF -e {shlex.quote(secret)} {where} 2>/dev/null", check=False).stdout
    assert found == ""
    for log in xfer.tb.workdir.rglob("*.log"):
        assert secret not in log.read_text(errors="replace"), log


def test_model_that_does_not_fit_is_refused_before_any_transfer(xfer: Xfer, mixed) -> None:  # noqa: F811
    _isolated(xfer)
    dest = f"{xfer.shm}/model"
    filler = f"/dev/shm/filler-{xfer.id}"
    job = xfer.job(model={"source": mixed.source, "dest": dest, "margin_pct": 5})
    leave = 10 * MIB  # the model is 21 MiB
    try:
        xfer.sh(f"fallocate -l $(( $(df --output=avail -B1 /dev/shm | tail -1) - {leave} )) {filler}")
        r = xfer.dfo("stage-model", "-H", xfer.node.name, "-j", str(job))
        assert r.returncode == 3, r.stderr
        assert f"{xfer.node.name}:" in r.stderr
        assert re.search(r"needs [\d.]+ MiB \([\d.]+ MiB to fetch \+ 5% margin\) on the filesystem of "
                         + re.escape(dest) + r", which has [\d.]+ MiB free \(of 256.0 MiB\)", r.stderr), r.stderr
        assert "nothing was transferred" in r.stderr
        assert xfer.digests(dest) == {}
        xfer.sh(f"rm -f {filler}")
        r, doc = xfer.run_json("stage-model", job)
        assert r.returncode == 0, r.stderr
        assert (doc["status"], doc["fetched"]) == ("done", len(mixed.files))
        assert xfer.digests(dest) == mixed.digests()
        r, doc = xfer.run_json("stage-model", job)
        assert (doc["status"], doc["fetched"], doc["skipped"]) == ("no change", 0, len(mixed.files))
    finally:
        xfer.sh(f"rm -f {filler}", check=False)


def test_stage_model_from_a_node_path(xfer: Xfer) -> None:  # noqa: F811
    src, dest = f"{xfer.base}/hub/model-a", f"{xfer.shm}/model-a"
    xfer.sh(f"mkdir -p {src}/sub && head -c 3145728 /dev/urandom > {src}/w-1.safetensors && "
            f"head -c 1000 /dev/urandom > {src}/sub/config.json && : > {src}/empty")
    job = xfer.job(model={"source": src, "dest": dest})
    r, doc = xfer.run_json("stage-model", job)
    assert r.returncode == 0, r.stderr
    assert (doc["fetched"], doc["verified"]) == (3, {"crc32": 3})
    assert xfer.digests(dest) == xfer.digests(src)
    assert xfer.run_json("stage-model", job)[1]["status"] == "no change"
    xfer.sh(f"echo more >> {src}/sub/config.json")
    r, doc = xfer.run_json("stage-model", job)
    assert (doc["fetched"], doc["skipped"]) == (1, 2)
    assert xfer.digests(dest) == xfer.digests(src)


def test_credentials_from_the_node(xfer: Xfer, mixed) -> None:  # noqa: F811
    _isolated(xfer)
    creds = f"[dfo-test]\naws_access_key_id = {xfer.s3.access_key}\naws_secret_access_key = {xfer.s3.secret_key}\n"
    no_aws = xfer.env(AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None)
    try:
        xfer.sh(f"mkdir -p /root/.aws && printf %s {shlex.quote(creds)} > /root/.aws/credentials")
        job = xfer.job(data={"source": mixed.source, "dest": f"{xfer.base}/nodecred"},
                       s3={"credentials": "node", "profile": "dfo-test"})
        r, doc = xfer.run_json("sync-data", job, env=no_aws)
        assert r.returncode == 0, r.stderr
        assert doc["fetched"] == len(mixed.files)
        job = xfer.job(data={"source": mixed.source, "dest": f"{xfer.base}/nodecred2"},
                       s3={"credentials": "node", "profile": "absent"})
        r = xfer.dfo("sync-data", "-H", xfer.node.name, "-j", str(job), env=no_aws)
        assert r.returncode == 3 and "has no AWS credentials" in r.stderr
    finally:
        xfer.sh("rm -rf /root/.aws", check=False)


# ------------------------------------------------------------------------------------------- errors


def test_missing_bucket_wrong_secret_wrong_endpoint_empty_prefix(xfer: Xfer, mixed) -> None:  # noqa: F811
    node = xfer.node.name
    dest = f"{xfer.base}/err"

    def run(source: str, env: dict[str, str] | None = None, **s3: object) -> tuple[int, str]:
        job = xfer.job(data={"source": source, "dest": dest}, s3=dict(s3))
        r = xfer.dfo("sync-data", "-H", node, "-j", str(job), env=env)
        assert "Traceback" not in r.stderr
        return r.returncode, r.stderr

    code, err = run("s3://no-such-bucket-dfo/x/")
    assert code == 3 and "NoSuchBucket" in err and "s3://no-such-bucket-dfo/x/" in err and f"{node}:" in err
    assert xfer.s3.url in err
    wrong = "wrong-secret-" + xfer.id
    code, err = run(mixed.source, env=xfer.env(AWS_SECRET_ACCESS_KEY=wrong))
    assert code == 3 and ("SignatureDoesNotMatch" in err or "AccessDenied" in err) and wrong not in err
    host = xfer.s3.url.rsplit(":", 1)[0]
    code, err = run(mixed.source, endpoint_url=f"{host}:1")
    assert code == 4 and "connection refused" in err and f"{host}:1" in err
    code, err = run(f"s3://{mixed.bucket}/nothing-here/")
    assert code == 3 and "no objects under" in err
    job = xfer.job(data={"source": "gs://bucket/x", "dest": dest})
    r = xfer.dfo("sync-data", "-H", node, "-j", str(job), "--json")
    assert r.returncode == 2 and "data.source" in r.stderr
    assert json.loads(r.stdout)["error"]["kind"] == "config"  # --json: stdout holds only the error document
    job = xfer.job(data={"source": mixed.source, "dest": "relative/dir"})
    r = xfer.dfo("sync-data", "-H", node, "-j", str(job))
    assert r.returncode == 2 and "data.dest" in r.stderr
    job = xfer.job(data={"source": "s3://no-such-bucket-dfo/x/", "dest": dest})
    r, doc = xfer.run_json("sync-data", job)
    assert r.returncode == 3 and doc["ok"] is False and doc["error"]["kind"] == "verify"


def test_destination_not_writable(xfer: Xfer, mixed) -> None:  # noqa: F811
    _isolated(xfer)
    ro = f"{xfer.base}/ro"
    xfer.sh(f"mkdir -p {ro} && mount -t tmpfs -o ro,size=1m dfo-test-ro {ro}")
    try:
        job = xfer.job(data={"source": mixed.source, "dest": f"{ro}/data"})
        r = xfer.dfo("sync-data", "-H", xfer.node.name, "-j", str(job))
        assert r.returncode == 3 and "not writable" in r.stderr and f"{ro}/data" in r.stderr, r.stderr
    finally:
        xfer.sh(f"umount {ro}", check=False)


def test_disk_full_mid_transfer_then_resume(xfer: Xfer, mixed) -> None:  # noqa: F811
    """A filesystem with bytes to spare but few inodes: the capacity check passes, writes then fail
    with ENOSPC part-way (a real "no space left on device")."""
    _isolated(xfer)
    mnt = f"{xfer.base}/tiny"
    dest = f"{mnt}/data"
    xfer.sh(f"mkdir -p {mnt} && mount -t tmpfs -o size=64m,nr_inodes=30 dfo-test-tiny {mnt}")
    try:
        job = xfer.job(data={"source": mixed.source, "dest": dest}, s3={"concurrency": 4})
        r = xfer.dfo("sync-data", "-H", xfer.node.name, "-j", str(job))
        assert r.returncode == 3, r.stderr
        assert "no space left" in r.stderr and f"s3://{mixed.bucket}/" in r.stderr and f"{xfer.node.name}:" in r.stderr
        done = xfer.recorded(dest)
        assert 0 < len(done) < len(mixed.files)
        partial = xfer.digests(dest)
        assert set(partial) >= done
        for rel in done:
            assert partial[rel] == mixed.digests()[rel]
        assert xfer.sh(f"ls -A {dest}/.dfo/tmp").stdout == ""
        xfer.sh(f"mount -o remount,nr_inodes=400 {mnt}")
        r, doc = xfer.run_json("sync-data", job)
        assert r.returncode == 0, r.stderr
        assert doc["fetched"] == len(mixed.files) - len(done)
        assert xfer.digests(dest) == mixed.digests()
    finally:
        xfer.sh(f"umount {mnt}", check=False)


def test_hf_source_needs_huggingface_hub_on_the_node(xfer: Xfer) -> None:  # noqa: F811
    """No Hub is reachable here: only the clear refusal is tested (see docs/data.md)."""
    job = xfer.job(model={"source": "hf://org/name", "dest": f"{xfer.shm}/hf"})
    r = xfer.dfo("stage-model", "-H", xfer.node.name, "-j", str(job))
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "not found on the node" in r.stderr or "huggingface_hub is not importable" in r.stderr

