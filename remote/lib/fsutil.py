"""Files on the node: the one durable atomic writer, and byte sizes for people (python3 3.8+, stdlib only).

Every JSON record dfo keeps (run records, provision records, the data manifest) goes through
``write_atomic``; every size shown to a user, on the node or on the controller, through
``human_bytes``.
"""
from __future__ import annotations

import _thread
import os

FILE_FLAGS = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: str) -> None:
    """Make a rename in directory ``path`` durable (best effort: some filesystems refuse it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes, mode: int = 0o600, dir_fd: int | None = None) -> None:
    """Write ``data`` to ``path`` durably: a new temp file in the same folder, fsync, rename, fsync
    of the folder. A reader sees the old file or the new one, never half of one, even after a crash
    or a power loss; a failed write leaves no temp file. The file gets ``mode`` (less the umask):
    the owner's only unless the caller says otherwise. Neither the temp file nor ``path`` is
    followed if it is a symlink. With ``dir_fd``, ``path`` is a name in that open folder (nothing
    is looked up by path, so a folder swapped for a symlink meanwhile is never written through)."""
    folder, name = os.path.split(path)
    if dir_fd is not None and folder:
        raise ValueError("with dir_fd, write_atomic takes a name, not a path: %r" % (path,))
    tmp = os.path.join(folder, ".%s.%d.%d.tmp" % (name, os.getpid(), _thread.get_ident()))
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # a temp file left by a crash keeps its old mode: start anew
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS, mode, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    if dir_fd is None:
        fsync_dir(folder or ".")
    else:
        try:
            os.fsync(dir_fd)
        except OSError:
            pass


def write_json(path: str, obj: object, mode: int = 0o600) -> None:
    """``obj`` as indented JSON with sorted keys (non-JSON values as their str), through write_atomic."""
    import json  # here: most node calls write no record, and json costs 3.5 ms to import

    text = json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n"
    write_atomic(path, text.encode("utf-8"), mode)


def which(name: str) -> str | None:
    """``shutil.which(name)`` on a POSIX node, without importing shutil (1.5 ms: it pulls in the
    compression modules): a path is checked as it is, a bare name is looked up on $PATH."""
    if os.path.dirname(name):
        return name if _runnable(name) else None
    path = os.environ.get("PATH")
    if path is None:
        path = os.defpath
    if not path:
        return None  # PATH set and empty: nothing is found (shutil.which says the same)
    for folder in path.split(os.pathsep):
        path = os.path.join(folder, name)
        if _runnable(path):
            return path
    return None


def _runnable(path: str) -> bool:
    return os.path.exists(path) and os.access(path, os.X_OK) and not os.path.isdir(path)


ROOM_FLOOR = 4 << 20  # bytes a filesystem keeps free after a write of dfo's there (remote/_boot.py: FLOOR)


def room_problem(path: str, need: int) -> str | None:
    """Why the filesystem that would hold ``path`` (its nearest existing folder) cannot take ``need`` more bytes
    and keep ROOM_FLOOR free (read-only, not writable, too little room: said in KB); None when it can. Checked
    before dfo writes there, so that no write of dfo's fills a filesystem."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError as exc:
        return "%s: %s" % (probe, exc.strerror or exc)
    if st.f_flag & getattr(os, "ST_RDONLY", 1):
        return "%s is on a read-only file system" % probe
    if not os.access(probe, os.W_OK | os.X_OK):
        return "%s is not writable by this user" % probe
    free = st.f_bavail * st.f_frsize
    if free < need + ROOM_FLOOR:
        return "%s has %d KB free of the %d KB it needs (%d KB, and %d KB dfo leaves free)" % (
            probe, free // 1024, (need + ROOM_FLOOR) // 1024, need // 1024, ROOM_FLOOR // 1024)
    return None


def human_bytes(n: float) -> str:
    """``1000 B``, ``1.5 KiB``, ``21.0 MiB``, ``10.04 GiB``: binary units, two decimals from GiB on
    (where one decimal could print the same number for what a transfer needs and what is free)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return "%d %s" % (n, unit) if unit == "B" else "%.*f %s" % (2 if unit == "GiB" else 1, n, unit)
        n /= 1024.0
    return "%.2f TiB" % n


# --------------------------------------------------------------------------- node paths

DEFAULT_WORKSPACE = "/workspace"
_HOME_PREFIXES = ("~", "${HOME}", "$HOME")


def home():
    """The node user's home: $HOME, else the password database's (as ``~`` in a shell)."""
    return os.path.expanduser("~")


def node_path(path):
    """A path of a job or inventory as this node means it: ``~``, ``$HOME`` and ``${HOME}`` at its start
    (alone or before a ``/``) are the node user's home; any other path is returned as it is. Every
    remote module expands the paths of its request with this, once, where it reads them (the
    controller never expands them: the laptop's home is not the node's)."""
    if not path:
        return path
    for pre in _HOME_PREFIXES:
        if path == pre or path.startswith(pre + "/"):
            h = home().rstrip("/")
            return (h + path[len(pre):]) or "/"
    return path


def default_workspace():
    """(path, why): /workspace when this user can write it, or create it (root, usually); else
    ~/workspace (a user like ubuntu, for whom /workspace is root's or cannot be made)."""
    ws = DEFAULT_WORKSPACE
    if os.path.isdir(ws):
        if os.access(ws, os.W_OK | os.X_OK):
            return ws, "%s is writable" % ws
        why = "%s is not writable by this user" % ws
    elif os.path.lexists(ws):
        why = "%s is not a folder" % ws
    elif os.access(os.path.dirname(ws), os.W_OK | os.X_OK):
        return ws, "%s can be created" % ws
    else:
        why = "%s does not exist and this user cannot create it" % ws
    return os.path.join(home(), "workspace"), why


def workspace(path=None):
    """The workspace a request names (expanded with node_path), else the node's default one."""
    return node_path(path).rstrip("/") or "/" if path else default_workspace()[0]
