"""Throwaway SSH nodes and an S3 endpoint on this machine, for the tests and `dfo demo`.

    with Testbed(workdir, nodes=2) as tb:
        tb.inventory_path, tb.nodes, tb.identity, tb.s3.url, tb.node_exec(tb.nodes[0], "df /dev/shm")

As root with `ip netns` (use_netns=None picks it when usable) each node is:
- a network namespace `dfo-<id>-<n>` whose eth0 (10.77.<k>.<n+1>/24) is a veth onto a private
  bridge `dfo-<id>-br` (10.77.<k>.1 on the host side); no default route, so a node reaches only
  the other nodes and the host's bridge address. <id> is random per Testbed, <k> a free /24.
- a private mount + UTS namespace in which OpenSSH's sshd runs on <address>:22 with: /etc/ssh
  bound from <workdir>/<node>/etc (its own config, host keys, authorized_keys), /root and
  /workspace bound from <workdir>/<node>/, a fresh tmpfs on /tmp, a tmpfs of `shm_size` on
  /dev/shm, and empty read-only tmpfs over the project checkout, the controller's Python prefix
  (when outside /usr) and the testbed workdir, so nothing passes by reading controller files.
The S3 server (see testbed/s3.py) listens on the bridge address, reachable from nodes and controller.
How sshd is configured and started lives in testbed/node.py; processes and namespaces in testbed/system.py.

Beyond the core API: tb.ssh(node, cmd) / tb.ssh_argv(node, *cmd) (the system ssh client with the testbed
key, accept-new), tb.host_public_key(node), tb.isolated, tb.bridge_address, tb.timings, tb.vanish(node).
sshd as a site may run it (tb.sshd_options, tb.set_password): a second factor after the key is

    tb.set_password(node, "pw")                       # namespace nodes only: the node's own /etc/shadow
    tb.sshd_options(node, AuthenticationMethods="publickey,password", PasswordAuthentication="yes",
                    PermitRootLogin="yes")            # or publickey,keyboard-interactive with
                                                      # UsePAM="yes", KbdInteractiveAuthentication="yes"

Without root or netns (use_netns=False) sshd listens on 127.0.0.1:<free port> as the current
user, with no private mounts: the node sees this machine's files, /dev/shm is the host's (no
size limit), /workspace and /root are the real ones, `hostname` is this machine's, and
link_down freezes sshd (SIGSTOP) instead of cutting a link. S3 listens on 127.0.0.1.

The testbed stops only what it started (its processes, namespaces and links), on stop(),
__exit__ and at interpreter exit; a testbed whose process was killed is reaped by the next
one (state in /run/dfo-testbed). In root mode it creates /run/sshd and an empty /workspace
on the host if missing (mount points; left in place).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import random
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import yaml

from orchestrator.testbed import node as tnode
from orchestrator.testbed import system as tsys
from orchestrator.testbed.node import PROJECT_ROOT, SSHD
from orchestrator.testbed.s3 import S3Endpoint, S3Server
from orchestrator.testbed.system import TestbedError

__all__ = ["PROJECT_ROOT", "Node", "S3Endpoint", "Testbed", "TestbedError"]


@dataclass(frozen=True)
class Node:
    name: str
    address: str
    port: int = 22
    user: str = "root"
    shm_size: str = "256m"


@dataclass
class _NodeState:
    node: Node
    dir: Path
    netns: str | None = None
    link: str | None = None  # host side of the veth pair
    proc: subprocess.Popen[bytes] | None = None


class Testbed:
    """Throwaway nodes (+ S3). Use as a context manager, or start() and stop()."""

    __test__ = False  # not a pytest test class

    def __init__(self, workdir: Path, nodes: int = 1, s3: bool = True, shm_size: str = "256m",
                 use_netns: bool | None = None, s3_server: str | None = None, user: str = "root",
                 ensurepip: bool = True) -> None:
        """``user``: the nodes' login user; another than root (e.g. "ubuntu") gets a home of its own,
        /home/USER, and can write neither /root nor /workspace. ``ensurepip=False``: the nodes' python3
        has no ensurepip (Debian without python3-venv). Both need namespace nodes (root)."""
        if not 1 <= nodes <= 200:
            raise ValueError("nodes must be between 1 and 200")
        if not re.fullmatch(r"\d+[kmgKMG]?", shm_size):
            raise ValueError(f"shm_size {shm_size!r}: expected a size like 256m or 2g")
        self.workdir = Path(workdir).resolve()
        self.count, self.want_s3, self.shm_size, self.s3_server = nodes, s3, shm_size, s3_server
        self.use_netns = use_netns
        if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", user):
            raise ValueError(f"user {user!r}: expected a login name like ubuntu")
        self.user, self.ensurepip = user, ensurepip
        self.id = secrets.token_hex(3)
        self.nodes: list[Node] = []
        self.s3: S3Endpoint | None = None
        self.identity = self.workdir / "id_ed25519"
        self.known_hosts = self.workdir / "known_hosts"
        self.inventory_path = self.workdir / "inventory.yaml"
        self.timings: dict[str, float] = {}
        self._state: dict[str, _NodeState] = {}
        self._bridge: str | None = None
        self.bridge_address: str | None = None  # the host side of the node network (root mode)
        self._server: S3Server | None = None
        self._started = self._stopped = False

    # ----- requirements -------------------------------------------------------------------
    @staticmethod
    def missing_requirements(s3: bool = True, use_netns: bool | None = None) -> list[str]:
        """Why a Testbed with these options cannot start here (empty when it can)."""
        out: list[str] = []
        if not os.access(SSHD, os.X_OK):
            out.append(f"{SSHD} not found (apt-get install openssh-server)")
        if shutil.which("ssh-keygen") is None or shutil.which("ssh") is None:
            out.append("ssh/ssh-keygen not found (apt-get install openssh-client)")
        if use_netns and (why := tsys.netns_usable()):
            out.append(f"network namespaces unusable: {why}")
        if s3 and (why := S3Server.missing()):
            out.append(why)
        return out

    @property
    def isolated(self) -> bool:
        """True when nodes have their own network, /dev/shm, /root, /workspace and /tmp."""
        return bool(self.use_netns)

    # ----- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.stop()
        except Exception:
            if et is None:
                raise

    def start(self) -> Testbed:
        if self._started:
            return self
        tsys.refuse_if_forbidden("a testbed")
        missing = self.missing_requirements(self.want_s3, self.use_netns)
        if missing:
            raise TestbedError("testbed cannot start: " + "; ".join(missing))
        if self.use_netns is None:
            self.use_netns = tsys.netns_usable() is None
        if not self.use_netns and (self.user != "root" or not self.ensurepip):
            raise TestbedError("testbed cannot start: a node user other than root, or a node without ensurepip, "
                               "needs namespace nodes (root, ip netns)")
        self._started = True
        atexit.register(self.stop)
        t0 = time.monotonic()
        try:
            self.workdir.mkdir(parents=True, exist_ok=True)
            if self.use_netns:
                tsys.reap_stale()
                self._make_network()
            self.timings["network"] = time.monotonic() - t0
            with ThreadPoolExecutor(1) as pool:
                s3_future = pool.submit(self._start_s3) if self.want_s3 else None
                t1 = time.monotonic()
                self._start_nodes()
                self.timings["nodes"] = time.monotonic() - t1
                if s3_future is not None:
                    self.s3 = s3_future.result()
            self._write_inventory()
        except BaseException:
            with contextlib.suppress(Exception):
                self.stop()
            raise
        self.timings["total"] = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Stop everything this testbed started; idempotent."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        problems: list[str] = []
        for st in self._state.values():
            try:
                if st.proc is not None and not st.netns:
                    tsys.signal_pids(self._sshd_pids(st, listener=True), signal.SIGCONT)
                    tsys.signal_pids(self._sshd_pids(st), signal.SIGKILL)
                    tsys.stop_process(st.proc, grace=2)
            except Exception as exc:
                problems.append(f"{st.node.name}: {exc}")
        if self.use_netns:
            try:
                links = [st.link for st in self._state.values() if st.link] + [self._bridge or ""]
                tsys.teardown_netns([st.netns for st in self._state.values() if st.netns], links)
            except Exception as exc:
                problems.append(f"network: {exc}")
            for st in self._state.values():
                if st.proc is not None:
                    with contextlib.suppress(Exception):
                        tsys.stop_process(st.proc, grace=2)
        if self._server is not None:
            try:
                self._server.stop()
            except Exception as exc:
                problems.append(f"s3: {exc}")
        if self.use_netns:
            tsys.drop_state(self.id)
        if problems:
            raise TestbedError("testbed stop: " + "; ".join(problems))

    # ----- setup ----------------------------------------------------------------------------
    def _record(self) -> None:
        tsys.write_state(self.id, {
            "owner": os.getpid(), "workdir": str(self.workdir),
            "netns": [st.netns for st in self._state.values() if st.netns],
            "links": [st.link for st in self._state.values() if st.link] + [self._bridge or ""],
            "pids": [self._server.proc.pid] if self._server and self._server.proc else [],
        })

    def _make_network(self) -> None:
        ip = tsys.run
        with tsys.global_lock():
            free = sorted(set(range(1, 255)) - tsys.used_subnets())
            if not free:
                raise TestbedError("no free 10.77.X.0/24 range for the testbed bridge")
            k = random.choice(free)
            self._bridge = f"dfo-{self.id}-br"
            self._record()
            ip(["ip", "link", "add", self._bridge, "type", "bridge"])
            ip(["ip", "addr", "add", f"10.77.{k}.1/24", "dev", self._bridge])
            ip(["ip", "link", "set", self._bridge, "up"])
        self.bridge_address = f"10.77.{k}.1"
        for n in range(1, self.count + 1):
            name, ns = f"node-{n}", f"dfo-{self.id}-{n}"
            st = _NodeState(Node(name, f"10.77.{k}.{n + 1}", 22, self.user, self.shm_size),
                            self.workdir / name, netns=ns, link=ns)
            self._state[name] = st
            self._record()
            ip(["ip", "netns", "add", ns])
            ip(["ip", "link", "add", ns, "type", "veth", "peer", "name", "eth0", "netns", ns])
            ip(["ip", "link", "set", ns, "master", self._bridge, "up"])
            ip(["ip", "-n", ns, "addr", "add", f"{st.node.address}/24", "dev", "eth0"])
            ip(["ip", "-n", ns, "link", "set", "eth0", "up"])
            ip(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _start_s3(self) -> S3Endpoint:
        address = self.bridge_address or "127.0.0.1"
        self._server = S3Server(self.workdir / "s3", address, self.s3_server)
        endpoint = self._server.start()
        self.timings["s3"] = self._server.startup_s
        if self.use_netns:
            self._record()
        return endpoint

    def _start_nodes(self) -> None:
        if not self.identity.exists():
            tsys.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"dfo-testbed-{self.id}",
                      "-f", str(self.identity)])
        pubkey = self.identity.with_suffix(".pub").read_text()
        if self.use_netns:
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
            Path("/workspace").mkdir(mode=0o755, exist_ok=True)
        else:
            user = pwd.getpwuid(os.geteuid()).pw_name
            for n, port in enumerate(tsys.free_ports(self.count, "127.0.0.1"), start=1):
                node = Node(f"node-{n}", "127.0.0.1", port, user, self.shm_size)
                self._state[node.name] = _NodeState(node, self.workdir / node.name)
        for st in self._state.values():
            for sub in ("etc", "root", "workspace"):
                (st.dir / sub).mkdir(parents=True, exist_ok=True)
            (st.dir / "etc" / "authorized_keys").write_text(pubkey)
            self._keygen(st)
            etc = "/etc/ssh" if st.netns else str(st.dir / "etc")
            (st.dir / "etc" / "sshd_config").write_text(tnode.sshd_config(st.node.address, st.node.port, etc))
            self._spawn_sshd(st)
        for st in self._state.values():
            assert st.proc is not None
            try:
                tsys.wait_banner(st.node.address, st.node.port, timeout=15, alive=st.proc)
            except TestbedError as exc:
                raise TestbedError(f"{st.node.name}: {exc}; log {st.dir / 'sshd.log'}:\n"
                                   f"{tsys.log_tail(st.dir / 'sshd.log')}") from None
        self.nodes = [st.node for st in self._state.values()]

    def _keygen(self, st: _NodeState) -> None:
        for old in (st.dir / "etc").glob("ssh_host_*"):
            old.unlink()
        tsys.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", st.node.name,
                  "-f", str(st.dir / "etc" / "ssh_host_ed25519_key")])

    def _spawn_sshd(self, st: _NodeState) -> None:
        if st.netns:
            extra = [] if self.user == "root" else tnode.user_mounts(st.dir, self.user, 1000)
            extra += [] if self.ensurepip else [tnode.NO_ENSUREPIP]
            argv = tnode.netns_sshd_argv(st.netns, st.dir, st.node.name, st.node.shm_size,
                                         tnode.hidden_paths(self.workdir), extra)
        else:
            argv = tnode.loopback_sshd_argv(st.dir)
        with open(st.dir / "sshd.log", "ab") as log:
            st.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)

    def _write_inventory(self) -> None:
        doc = {
            "defaults": {"user": self.nodes[0].user, "identity": str(self.identity),
                         "known_hosts": str(self.known_hosts)},
            "hosts": {n.name: {"host": n.address, "port": n.port} for n in self.nodes},
            "groups": {"testbed": [n.name for n in self.nodes]},
        }
        self.inventory_path.write_text(yaml.safe_dump(doc, sort_keys=False))

    # ----- acting on nodes ------------------------------------------------------------------
    def _st(self, node: Node | str) -> _NodeState:
        name = node if isinstance(node, str) else node.name
        if name not in self._state:
            raise KeyError(f"no node {name!r} in this testbed ({', '.join(self._state)})")
        return self._state[name]

    def node(self, name: str) -> Node:
        return self._st(name).node

    def _sshd_pids(self, st: _NodeState, listener: bool = False) -> list[int]:
        """The per-connection sshd processes under the listener (plus the listener if asked)."""
        if st.proc is None:
            return []
        kids = [p for p in tsys.descendants(st.proc.pid) if tsys.comm(p).startswith("sshd")]
        return [st.proc.pid, *kids] if listener else kids

    def ssh_argv(self, node: Node | str, *command: str, connect_timeout: int = 5,
                 known_hosts: Path | None = None) -> list[str]:
        """The system ssh client's argv for a node: testbed key, accept-new into known_hosts."""
        n = self._st(node).node
        return ["ssh", "-i", str(self.identity), "-p", str(n.port), "-o", "BatchMode=yes",
                "-o", "IdentitiesOnly=yes", "-o", f"UserKnownHostsFile={known_hosts or self.known_hosts}",
                "-o", "StrictHostKeyChecking=accept-new", "-o", "HashKnownHosts=no",
                "-o", f"ConnectTimeout={connect_timeout}",
                "-o", "LogLevel=ERROR", f"{n.user}@{n.address}", *command]

    def ssh(self, node: Node | str, command: str, timeout: float = 30,
            known_hosts: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Run a shell command on the node over real SSH (the system client)."""
        return subprocess.run(self.ssh_argv(node, command, known_hosts=known_hosts), capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def node_exec(self, node: Node | str, cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run `sh -c cmd` inside the node (its network, mount and UTS namespaces), not over SSH."""
        st = self._st(node)
        if st.netns and st.proc is not None:
            argv = ["nsenter", "-t", str(st.proc.pid), "-n", "-m", "-u", "--", "sh", "-c", cmd]
        else:
            argv = ["sh", "-c", cmd]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def link_down(self, node: Node | str) -> None:
        """Cut the node's link: connections hang, new ones time out (loopback mode: sshd frozen)."""
        st = self._st(node)
        if st.link:
            tsys.run(["ip", "link", "set", st.link, "down"])
        else:
            tsys.signal_pids(self._sshd_pids(st, listener=True), signal.SIGSTOP)

    def link_up(self, node: Node | str) -> None:
        """Mend the cut: back once the node's sshd greets again (at most 10 s): right after
        `ip link set up` the host's neighbour entry for the node can still be the failed one of the cut, and
        a connection then is refused with "No route to host"."""
        st = self._st(node)
        if st.link:
            tsys.run(["ip", "link", "set", st.link, "up"])
            with contextlib.suppress(TestbedError):  # not back in 10 s: the test's own connection says so
                tsys.wait_banner(st.node.address, st.node.port, timeout=10)
        else:
            tsys.signal_pids(self._sshd_pids(st, listener=True), signal.SIGCONT)

    def node_pids(self, node: Node | str) -> list[int]:
        """Live processes of a namespace node: in its network or mount namespace ([] in loopback mode)."""
        st = self._st(node)
        return tsys.namespace_pids(st.netns, tsys.node_namespaces(st.proc.pid if st.proc else None)) if st.netns else []

    def vanish(self, node: Node | str) -> list[int]:
        """Gone like a reclaimed rented node: see testbed/system.py vanish_netns. Returns the pids killed."""
        st = self._st(node)
        if not st.netns or st.proc is None:
            raise TestbedError(f"{st.node.name}: vanish needs a namespace node (root); this testbed is loopback")
        return tsys.vanish_netns(st.netns, st.proc, st.link)

    def kill_ssh_sessions(self, node: Node | str) -> int:
        """Drop every SSH connection of the node (the listener stays); returns how many sshd died.

        Processes a session detached (setsid) survive, as they would on a real node."""
        pids = self._sshd_pids(self._st(node))
        tsys.signal_pids(pids, signal.SIGKILL)
        return len(pids)

    def host_public_key(self, node: Node | str) -> str:
        """The node's host key as "ssh-ed25519 AAAA..." (no comment)."""
        text = (self._st(node).dir / "etc" / "ssh_host_ed25519_key.pub").read_text()
        return " ".join(text.split()[:2])

    def rotate_host_key(self, node: Node | str, timeout: float = 15) -> str:
        """New host key; sshd re-executes (SIGHUP, same pid). Returns the new public key."""
        st = self._st(node)
        assert st.proc is not None
        self._keygen(st)
        new = self.host_public_key(node)
        st.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            scan = tsys.run(["ssh-keyscan", "-T", "2", "-t", "ed25519", "-p", str(st.node.port),
                             st.node.address], check=False)
            if any(" ".join(line.split()[1:3]) == new for line in scan.stdout.splitlines()):
                return new
            time.sleep(0.05)
        raise TestbedError(f"{st.node.name}: sshd did not serve the new host key within {timeout:.0f}s")

    def sshd_options(self, node: Node | str, timeout: float = 15, **options: str) -> None:
        """Set keywords of the node's sshd_config (each replaces the line that sets it, else is added: sshd
        takes a keyword's first value), then make its sshd read it again (SIGHUP: it re-executes, same pid);
        back once it listens anew. A config sshd refuses is TestbedError with its log."""
        st = self._st(node)
        assert st.proc is not None
        path, log = st.dir / "etc" / "sshd_config", st.dir / "sshd.log"
        lines = path.read_text().splitlines()
        for key, value in options.items():
            line = f"{key} {value}"
            at = [i for i, ln in enumerate(lines) if ln.split()[:1] and ln.split()[0].lower() == key.lower()]
            if at:
                lines[at[0]] = line
            else:
                lines.append(line)
        path.write_text("\n".join(lines) + "\n")
        listening = tsys.log_tail(log, 10_000).count("Server listening on")
        st.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while tsys.log_tail(log, 10_000).count("Server listening on") <= listening:
            if st.proc.poll() is not None or time.monotonic() > deadline:
                raise TestbedError(f"{st.node.name}: sshd did not come back with {options}:\n{tsys.log_tail(log)}")
            time.sleep(0.05)
        tsys.wait_banner(st.node.address, st.node.port, timeout=max(1.0, deadline - time.monotonic()))

    def set_password(self, node: Node | str, password: str) -> None:
        """Give the node's login user ``password``: a copy of this machine's /etc/shadow with that user's hash
        changed (or added), bound over /etc/shadow inside the node's own mount namespace (this machine's file is
        untouched). The password goes to openssl and to the node on stdin, never in argv. Namespace nodes only;
        sshd asks for it once sshd_options allows password or keyboard-interactive logins."""
        st = self._st(node)
        if not st.netns or st.proc is None:
            raise TestbedError(f"{st.node.name}: set_password needs a namespace node (root); this testbed is loopback")
        hashed = tsys.run_input(["openssl", "passwd", "-6", "-stdin"], password + "\n").stdout.strip()
        user = st.node.user
        rows = Path("/etc/shadow").read_text().splitlines()
        mine = f"{user}:{hashed}:20000:0:99999:7:::"
        rows = [mine if r.split(":")[0] == user else r for r in rows]
        if mine not in rows:
            rows.append(mine)
        argv = ["nsenter", "-t", str(st.proc.pid), "-m", "--", "sh", "-c",
                "umask 077 && cat > /tmp/.dfo-shadow && mount --bind /tmp/.dfo-shadow /etc/shadow"]
        tsys.run_input(argv, "\n".join(rows) + "\n")

    def set_login_shell(self, node: Node | str, shell: str) -> None:
        """Give the node's login user another login shell (fish, tcsh, ...: installed on this machine), for
        new SSH sessions: a copy of the node's /etc/passwd with that user's shell changed, bound over
        /etc/passwd inside the node's own mount namespace (this machine's file is untouched)."""
        st = self._st(node)
        if not st.netns:
            raise TestbedError(f"{st.node.name}: set_login_shell needs a namespace node (root); "
                               "this testbed is loopback")
        if not os.access(shell, os.X_OK):
            raise TestbedError(f"{shell} is not installed here (apt-get install {Path(shell).name})")
        user = st.node.user
        script = (f"awk -F: -v OFS=: -v u={shlex.quote(user)} -v s={shlex.quote(shell)} "
                  "'$1 == u { $7 = s } { print }' /etc/passwd > /tmp/.dfo-passwd && "
                  "mount --bind /tmp/.dfo-passwd /etc/passwd")
        r = self.node_exec(node, script)
        if r.returncode != 0:
            raise TestbedError(f"{st.node.name}: could not set the login shell: {r.stderr.strip()}")
