"""How a testbed node's sshd is configured and started (used by orchestrator/testbed/__init__.py).

Root mode: `ip netns exec NS unshare --mount --uts --propagation private sh -c SCRIPT`, where
SCRIPT sets up the node's private mounts and hostname, then execs sshd (so the Popen pid is the
sshd listener). Loopback mode: sshd directly, with paths into the workdir.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

# the folder that holds dfo's code: the checkout (an editable install) or, installed from a wheel, the
# site-packages folder (its environment, sys.prefix, is hidden from nodes as well)
PROJECT_ROOT = Path(__file__).resolve().parents[2]
SSHD = "/usr/sbin/sshd"


def sshd_config(address: str, port: int, etc: str) -> str:
    """sshd_config of a node whose config, host keys and authorized_keys live in `etc`."""
    lines = [
        f"ListenAddress {address}:{port}",
        f"HostKey {etc}/ssh_host_ed25519_key",
        f"PidFile {etc}/sshd.pid",
        f"AuthorizedKeysFile {etc}/authorized_keys",
        "PermitRootLogin prohibit-password", "PubkeyAuthentication yes",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no",
        "UsePAM no", "StrictModes no", "UseDNS no", "PrintMotd no", "PrintLastLog no",
        "X11Forwarding no", "AcceptEnv LANG LC_*", "Subsystem sftp internal-sftp",
        "MaxSessions 64", "MaxStartups 64", "LogLevel VERBOSE",
    ]
    return "\n".join(lines) + "\n"


def checkouts(root: Path = PROJECT_ROOT) -> list[Path]:
    """Every work tree of the git repository ``root`` belongs to: ``root`` itself, the main checkout
    and each linked worktree (``git worktree add``); just ``root`` outside git. Read from the files
    git keeps (<git dir>/worktrees/*/gitdir), without running git."""
    found = [root]
    dotgit = root / ".git"
    common: Path | None = dotgit if dotgit.is_dir() else None
    if dotgit.is_file():  # a linked worktree: "gitdir: <main>/.git/worktrees/<name>"
        line = dotgit.read_text(errors="replace").strip()
        if line.startswith("gitdir:"):
            gitdir = (root / line.partition(":")[2].strip()).resolve()
            if gitdir.parent.name == "worktrees":
                common = gitdir.parent.parent
    if common is not None:
        if common.name == ".git":
            found.append(common.parent)
        for gd in sorted(common.glob("worktrees/*/gitdir")):
            try:
                found.append(Path(gd.read_text(errors="replace").strip()).parent)
            except OSError:
                continue
    out: list[Path] = []
    for p in found:
        p = p.resolve()
        if p not in out and p.is_dir():
            out.append(p)
    return out


def hidden_paths(workdir: Path) -> list[str]:
    """Controller paths a node must not see: the checkout (and the repository's other work trees),
    the controller's Python, the workdir.

    /root and /tmp are replaced anyway; /, /usr and /usr/local are the node's own system too."""
    cands = [*checkouts(), workdir]
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        p = Path(prefix).resolve()
        if str(p) not in ("/", "/usr", "/usr/local"):
            cands.append(p)
    covered = (Path("/root"), Path("/tmp"))
    out: list[Path] = []
    for p in sorted(set(cands), key=lambda x: len(x.parts)):
        if not any(p == c or c in p.parents for c in (*covered, *out)):
            out.append(p)
    return [str(p) for p in out]


def netns_sshd_argv(netns: str, node_dir: Path, hostname: str, shm_size: str, hidden: list[str],
                    extra: Sequence[str] = ()) -> list[str]:
    """argv that starts the node's sshd inside its network namespace and private mounts (``extra``: more
    shell lines, run after the node's own binds and before the controller's paths are hidden)."""
    q = shlex.quote
    script = [
        "set -e",
        f"mount --bind {q(str(node_dir / 'etc'))} /etc/ssh",
        f"mount --bind {q(str(node_dir / 'workspace'))} /workspace",
        f"mount --bind {q(str(node_dir / 'root'))} /root",
        *extra,
        "mount -t tmpfs -o mode=1777 dfo-tmp /tmp",
        f"mount -t tmpfs -o mode=1777,size={q(shm_size)} dfo-shm /dev/shm",
        *(f"if [ -d {q(p)} ]; then mount -t tmpfs -o ro,size=4k,mode=755 dfo-hidden {q(p)}; fi"
          for p in hidden),
        f"hostname {q(hostname)}",
        f"exec {SSHD} -D -e -f /etc/ssh/sshd_config",
    ]
    return ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", "\n".join(script)]


def user_mounts(node_dir: Path, user: str, uid: int) -> list[str]:
    """A login user of the node's own (not root): passwd and group entries in copies of this machine's
    files bound over /etc/passwd and /etc/group, and /home bound from ``node_dir/home`` holding its
    home, /home/USER (owned by it). /root becomes 0700 and /workspace stays root's (0755): the user
    can write neither, as on the images of Lambda and AWS (user ubuntu)."""
    home = node_dir / "home"
    (home / user).mkdir(parents=True, exist_ok=True)
    os.chown(home / user, uid, uid)
    (home / user).chmod(0o755)
    (node_dir / "root").chmod(0o700)
    def others(path: str) -> list[str]:  # this machine's entries, less any of the same name or id
        return [ln for ln in Path(path).read_text().splitlines()
                if ln.split(":")[0] != user and ln.split(":")[2:3] != [str(uid)]]

    passwd, group = others("/etc/passwd"), others("/etc/group")
    (node_dir / "passwd").write_text("\n".join(passwd + [f"{user}:x:{uid}:{uid}:dfo testbed:/home/{user}:/bin/bash"])
                                     + "\n")
    (node_dir / "group").write_text("\n".join(group + [f"{user}:x:{uid}:"]) + "\n")
    q = shlex.quote
    return [f"mount --bind {q(str(node_dir / 'passwd'))} /etc/passwd",
            f"mount --bind {q(str(node_dir / 'group'))} /etc/group",
            f"mount --bind {q(str(home))} /home"]


# the stdlib's ensurepip of every python3.X of the node, hidden (an empty read-only folder: `python3 -m
# venv` fails as on Debian without python3-venv; `import ensurepip` finds no package file)
NO_ENSUREPIP = ("for d in /usr/lib/python3*/ensurepip /usr/local/lib/python3*/ensurepip; do "
                "if [ -d \"$d\" ]; then mount -t tmpfs -o ro,size=4k,mode=755 dfo-no-ensurepip \"$d\"; fi; done")


def loopback_sshd_argv(node_dir: Path) -> list[str]:
    return [SSHD, "-D", "-e", "-f", str(node_dir / "etc" / "sshd_config")]
