"""Dest safety on the node (stdlib only): which destinations a transfer refuses, and paths under one
opened without ever following a symlink.

Refused before anything is read from S3 or written (RemoteError "config" -> exit 2, one line naming
the field, the path and the reason), with or without delete:

* ``/``, ``$HOME`` or a folder that holds it, ``~/.ssh`` and dfo's own ``~/.cache/dfo`` (or anything
  inside them), the job's workspace root or a folder that holds it, a folder that holds (or is) the
  job's venv, a path with a ``.dfo`` component, a dest that holds another destination's ``.dfo``;
* a symlink on the way to dest owned by someone other than this user or root;
* a folder above dest owned by someone other than this user or root, or writable by others without
  the sticky bit (/dev/shm and /tmp are fine: root's, sticky);
* dest, its ``.dfo/``, or a folder under dest that a key goes through: not a folder, a symlink, not
  owned by this user, or writable by group or others (sticky or not).

Created folders: dest and the folders under it 0755, ``.dfo/`` and ``.dfo/tmp/`` 0700. Every
folder under dest is opened relative to its parent with O_NOFOLLOW|O_DIRECTORY (``Tree``), so a
symlink that appears later makes the open fail; it is never followed.

``open_meta``: the same checks for the ``.dfo`` of any folder the user chose where dfo keeps records
(outputs.path's shipper), opened the same way.
"""
from __future__ import annotations

import _thread
import errno
import os
import stat

from remote._proto import RemoteError
from remote.lib.fsutil import node_path

META_DIR = ".dfo"
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _name(uid):
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return None


def _who(uid):
    name = _name(uid)
    return "%s (uid %d)" % (name, uid) if name else "uid %d" % uid


def refuse(field, message, hint=None):
    raise RemoteError("config", "%s: %s" % (field, message), hint=hint, field=field)


def _holds(outer, inner):
    """True when folder ``outer`` is ``inner`` or one of its ancestors (both normalised, absolute)."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _real(path):
    return os.path.realpath(node_path(path)) if path else None


def _lstat(path):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _check_dir_stat(field, path, st, uid, what="it"):
    """dest, .dfo and folders under dest: a real folder of this user that nobody else may write."""
    if stat.S_ISLNK(st.st_mode):
        refuse(field, "%s is a symlink; dfo never follows a symlink inside a destination" % path,
               "replace it with a real folder, or point %s at the real place" % field)
    if not stat.S_ISDIR(st.st_mode):
        refuse(field, "%s is not a folder" % path, "remove it, or pick another %s" % field)
    if st.st_uid != uid:
        refuse(field, "%s is owned by %s, not by the SSH user %s: that user could swap the files in %s"
               % (path, _who(st.st_uid), _who(uid), what),
               "pick a folder of your own, or chown it to the SSH user")
    if st.st_mode & 0o022:
        refuse(field, "%s is writable by others (mode %04o): another user could swap the files in %s"
               % (path, stat.S_IMODE(st.st_mode), what), "chmod go-w %s, or pick another %s" % (path, field))


def check_dest(dest, field, workspace=None, venv=None):
    """The real path of ``dest`` (absolute, normalised), or RemoteError "config" naming why it is refused."""
    uid = os.geteuid()
    parts = [p for p in dest.split("/") if p]
    if META_DIR in parts:
        refuse(field, "%s lies inside a %s folder, where dfo keeps its own records" % (dest, META_DIR),
               "pick a folder of its own")
    for i in range(1, len(parts) + 1):  # symlinks on the way: only this user's or root's are followed
        prefix = "/" + "/".join(parts[:i])
        st = _lstat(prefix)
        if st is None:
            break
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, uid):
            refuse(field, "%s is a symlink owned by %s: that user decides where %s goes"
                   % (prefix, _who(st.st_uid), dest), "pick a path without it, or remove it")
    real = os.path.realpath(dest)
    shown = dest if real == dest else "%s (%s on the node)" % (dest, real)
    if real == "/":
        refuse(field, "%s is the root of the node's filesystem; pick a folder of its own, e.g. /workspace/data"
               % shown)
    home = _real("~")
    user = _name(uid) or "uid %d" % uid
    if home and home != "/":
        if real == home:
            refuse(field, "%s is $HOME of %s on the node; pick a folder of its own, e.g. %s/data"
                   % (shown, user, home.rstrip("/")))
        if _holds(real, home):
            refuse(field, "%s holds $HOME of %s (%s); pick a folder of its own, e.g. %s/data"
                   % (shown, user, home, home.rstrip("/")))
        for sub, why in ((".ssh", "SSH keeps its keys and authorized_keys"), (".cache/dfo", "dfo keeps its own code")):
            guarded = os.path.join(home, sub)
            if _holds(guarded, real):
                refuse(field, "%s is inside %s, where %s; pick a folder of its own, e.g. %s/data"
                       % (shown, guarded, why, home.rstrip("/")))
    ws = _real(workspace)
    if ws and ws != "/":
        if real == ws:
            refuse(field, "%s is the job's workspace root on the node (its .dfo/ holds the runs and provision "
                          "records); pick a folder of its own, e.g. %s/data" % (shown, ws.rstrip("/")))
        if _holds(real, ws):
            refuse(field, "%s holds the job's workspace %s; pick a folder of its own, e.g. %s/data"
                   % (shown, ws, ws.rstrip("/")))
    env = _real(venv)
    if env and _holds(real, env):
        refuse(field, "%s %s the job's venv %s; pick a folder beside it, e.g. %s-data"
               % (shown, "is" if real == env else "holds", env, env.rstrip("/")))
    _check_ancestors(field, real, uid)
    st = _lstat(real)
    if st is not None:
        _check_dir_stat(field, real, st, uid)
        meta = os.path.join(real, META_DIR)
        mst = _lstat(meta)
        if mst is not None:
            _check_dir_stat(field, meta, mst, uid, "the manifest")
        nested = find_nested_meta(real)
        if nested is not None:
            refuse(field, "%s holds %s, the records of another dfo destination; pick a folder that holds none, "
                          "or remove that destination first" % (shown, nested))
    return real


def _check_ancestors(field, real, uid):
    """Folders above dest: root's or this user's; writable by others only with the sticky bit."""
    path = "/"
    for part in [p for p in real.split("/") if p][:-1]:
        path = os.path.join(path, part)
        st = _lstat(path)
        if st is None:
            return  # created by this transfer, as this user
        if st.st_uid not in (0, uid):
            refuse(field, "%s, a folder above %s, is owned by %s: that user could swap the destination"
                   % (path, real, _who(st.st_uid)), "pick a place whose folders are yours or root's")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            refuse(field, "%s, a folder above %s, is writable by others without the sticky bit (mode %04o): "
                          "another user could swap the destination" % (path, real, stat.S_IMODE(st.st_mode)),
                   "chmod go-w (or +t) %s, or pick another place" % path)


def find_nested_meta(real):
    """The first ``.dfo`` found below ``real`` (not ``real/.dfo`` itself), without following symlinks."""
    stack = [real]
    while stack:
        top = stack.pop()
        try:
            it = os.scandir(top)
        except OSError:
            continue
        with it:
            for entry in it:
                if entry.name == META_DIR and top != real:
                    return entry.path
                try:
                    if entry.is_dir(follow_symlinks=False) and entry.name != META_DIR:
                        stack.append(entry.path)
                except OSError:
                    pass
    return None


# --------------------------------------------------------------------------- opening without following


def _open_child(parent_fd, name, parent_path, field, mode, create, what="it"):
    """Open folder ``name`` under ``parent_fd`` (O_NOFOLLOW), creating it with ``mode``; None if missing."""
    path = os.path.join(parent_path, name)
    for _ in range(2):
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except FileNotFoundError:
            if not create:
                return None
            try:
                os.mkdir(name, mode, dir_fd=parent_fd)
            except FileExistsError:
                pass
            continue
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                _check_dir_stat(field, path, st, os.geteuid(), what)
            raise
        try:
            _check_dir_stat(field, path, os.fstat(fd), os.geteuid(), what)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise OSError(errno.ENOENT, "could not create", path)


def open_meta(folder, field, create=True, what="dfo's records"):
    """The fd of ``folder``/.dfo, where dfo keeps its records for a folder the user chose (outputs.path's
    shipper: its lock, shipped.json, uploads.json). ``folder`` itself is opened as given (a symlink to it is
    the user's choice); ``.dfo`` is opened relative to it with O_NOFOLLOW and checked as a destination's
    ``.dfo`` is: a symlink, not a folder, owned by another user or writable by group or others ->
    RemoteError "config" naming ``field`` and the path, with nothing written. Created 0700 when missing
    and ``create``; None when missing and not ``create``. Everything under it is then opened relative to
    this fd (``dir_fd=``), so a ``.dfo`` swapped for a symlink later is never written through."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        return _open_child(fd, META_DIR, folder, field, 0o700, create, what)
    finally:
        os.close(fd)


def open_dest(real, field):
    """A folder fd for ``real`` (created 0755 as needed), every component opened with O_NOFOLLOW."""
    fd = os.open("/", DIR_FLAGS)
    path = "/"
    parts = [p for p in real.split("/") if p]
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    refuse(field, "%s is %s" % (os.path.join(path, part), "a symlink" if exc.errno == errno.ELOOP
                                                 else "not a folder"), "pick another %s" % field)
                raise
            os.close(fd)
            fd, path = nfd, os.path.join(path, part)
            if last:
                _check_dir_stat(field, path, os.fstat(fd), os.geteuid())
    except BaseException:
        os.close(fd)
        raise
    return fd


def identity(st):
    """What shows a file was swapped though its size and mtime were kept."""
    return {"ino": st.st_ino, "ctime_ns": st.st_ctime_ns, "uid": st.st_uid}


class Tree:
    """Folders under one destination, opened relative to it without following symlinks (fds cached)."""

    def __init__(self, dest, dest_fd, field="dest"):
        self.dest = dest
        self.fd = dest_fd
        self.field = field
        self._dirs = {"": dest_fd}
        self._lock = _thread.allocate_lock()  # threading.Lock, without importing threading (2 ms)

    @staticmethod
    def split(rel):
        d, _, name = rel.rpartition("/")
        return d, name

    def dir(self, reldir, create=False):
        """The fd of folder ``reldir`` (relative, "" = dest), or None when it is missing and not ``create``."""
        with self._lock:
            fd = self._dirs.get(reldir)
            if fd is not None:
                return fd
            cur, pfd = "", self.fd
            for part in reldir.split("/"):
                nxt = cur + "/" + part if cur else part
                fd = self._dirs.get(nxt)
                if fd is None:
                    fd = _open_child(pfd, part, os.path.join(self.dest, cur), self.field, 0o755, create,
                                     "the destination")
                    if fd is None:
                        return None
                    self._dirs[nxt] = fd
                cur, pfd = nxt, fd
            return pfd

    def check(self, rel):
        """Refuse (RemoteError config) when a folder on the way to file ``rel`` is a symlink or not ours."""
        self.dir(self.split(rel)[0])

    def lstat(self, rel):
        """lstat of file ``rel`` (never following a symlink on the way), or None when it is missing."""
        d, name = self.split(rel)
        fd = self.dir(d)
        if fd is None:
            return None
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def drop(self, reldir):
        with self._lock:
            for key in [k for k in self._dirs if k and (k == reldir or k.startswith(reldir + "/"))]:
                os.close(self._dirs.pop(key))

    def close(self):
        """Close every folder fd, dest's own included (safe to call twice)."""
        with self._lock:
            for fd in self._dirs.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._dirs = {}
