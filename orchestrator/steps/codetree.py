"""The local side of sync-code: which files are the code, their content hashes, and warnings.

In a git work tree the code is what git would commit, as the work tree is now: ``git ls-files
--cached --others --exclude-standard`` (tracked files, plus untracked ones .gitignore does not
exclude), less files deleted from the work tree. Outside git it is every file under the source.
Then, always: ``code.exclude`` (gitignore-style patterns) and names dfo never pushes (``.git/``
and any name starting with ``.dfo``). Outside git, .gitignore files are not read (dfo is not git:
a partial emulation would differ in corners); list such names in ``code.exclude``.

Hashes (sha256) are cached by (size, mtime_ns, inode) in ~/.cache/dfo/code/, so a push with
nothing changed reads no file content. Beside them, per node and dest, the manifest the last push
left there (``Pushed``): what the next push sends without asking first.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from remote.lib.fsutil import human_bytes, write_atomic
from remote.lib.globpat import compile_rules

from .. import cache_dir
from ..errors import ConfigError

BIG_FILE = 100 * 1000 * 1000  # bytes: a file over this is warned about before it travels
BIG_TREE = 10_000  # files: a tree over this is warned about before it travels


@dataclass
class LocalFile:
    size: int
    mode: int | None  # 0o755 or 0o644 (git's view: only the executable bit); None for a symlink
    link: str | None  # a symlink's target (relative, inside the tree)
    sha256: str | None = None
    key: tuple[int, int, int] = (0, 0, 0)  # (size, mtime_ns, inode) for the hash cache
    via: str | None = None  # where it is read from when a folder on its path is a symlink (its real path, relative)


# --------------------------------------------------------------------------- gitignore-style patterns


class Excluder:
    """gitignore-style patterns: ``*``, ``?``, ``[..]``, ``**``; a leading ``/`` or a ``/`` inside
    anchors at the source folder, else the pattern matches a name at any depth; a trailing ``/``
    matches folders only; ``!`` re-includes. A pattern that matches a folder excludes all below it;
    the last pattern that matches a path decides."""

    def __init__(self, patterns: list[str]) -> None:
        self.rules: list[tuple[re.Pattern[str], bool, bool]] = compile_rules(patterns)

    def excluded(self, rel: str) -> bool:
        if not self.rules:
            return False
        parts = rel.split("/")
        dirs = ["/".join(parts[:i]) for i in range(1, len(parts))]
        out = False
        for rx, neg, dir_only in self.rules:
            cands = dirs if dir_only else [*dirs, rel]
            if any(rx.fullmatch(c) for c in cands):
                out = not neg
        return out


def never_pushed(rel: str) -> bool:
    if ".git" not in rel and ".dfo" not in rel:
        return False
    return any(p == ".git" or p.startswith(".dfo") for p in rel.split("/"))


# --------------------------------------------------------------------------- listing


def _git_files(source: Path) -> list[str] | None:
    """What git would commit under ``source`` (relative to it), or None outside a git work tree."""
    try:
        res = subprocess.run(["git", "-c", "core.quotepath=off", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=source, capture_output=True, timeout=120)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    return list(dict.fromkeys(os.fsdecode(n) for n in res.stdout.split(b"\0") if n))


def _walk(source: Path) -> list[str]:
    out: list[str] = []
    stack = [""]
    while stack:
        d = stack.pop()
        with os.scandir(source / d if d else source) as it:
            for e in it:
                rel = f"{d}/{e.name}" if d else e.name
                if e.name == ".git" or e.name.startswith(".dfo"):
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append(rel)
                else:
                    out.append(rel)
    return out


def _check_name(source: Path, rel: str) -> None:
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"code: {source / rel!r} is not a UTF-8 name; dfo pushes UTF-8 names only",
                          hint="rename it, or add it to code.exclude") from None


def _link_target(source: Path, real_source: str, rel: str) -> str:
    """A symlink's target, refused (exit 2, naming it) unless it stays inside the tree."""
    target = os.readlink(source / rel)
    lexical = os.path.normpath(os.path.join(os.path.dirname(rel), target))
    real = os.path.realpath(source / rel)
    inside = real == real_source or real.startswith(real_source.rstrip("/") + "/")
    if os.path.isabs(target) or lexical == ".." or lexical.startswith("../") or not inside:
        raise ConfigError(f"code: symlink {rel} -> {target} points outside {source}; dfo pushes only symlinks "
                          "that stay inside the tree", hint="add it to code.exclude, or make the link relative and "
                                                            "inside the code folder")
    return target


class _Dirs:
    """Where each folder of the listing really is: a folder with a symlink on its path resolves elsewhere.
    One realpath per folder (not per file); None when the real path leaves the source."""

    def __init__(self, source: Path, real_source: str) -> None:
        self.source, self.real_source = source, real_source
        self.seen: dict[str, str | None] = {}

    def real(self, d: str) -> str | None:
        """``d``'s real path relative to the source ("" for the source itself), or None when outside it."""
        if d not in self.seen:
            real = os.path.realpath(os.path.join(self.source, d))
            if real == self.real_source:
                self.seen[d] = ""
            elif real.startswith(self.real_source.rstrip("/") + "/"):
                self.seen[d] = real[len(self.real_source.rstrip("/")) + 1:]
            else:
                self.seen[d] = None
        return self.seen[d]

    def first_link(self, d: str) -> str:
        """The first folder on ``d``'s path that is a symlink (``d`` itself when none is found)."""
        parts = d.split("/")
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if os.path.islink(os.path.join(self.source, sub)):
                return sub
        return d


def _through_link(source: Path, dirs: _Dirs, listed: set[str], rel: str) -> tuple[bool, str | None]:
    """A path whose folders include a symlink: (skip it, where to read it from).

    Its real path outside the source: refused (exit 2, naming it). Inside: when the symlinked folder
    travels itself (as a link), the file is skipped, as git would commit it (a tracked path beyond a
    symlink is gone) and the link brings it on the node; when the link is not pushed (ignored,
    excluded), the file travels as a plain file, read from its real path."""
    d, _, name = rel.rpartition("/")
    real_d = dirs.real(d)
    link = dirs.first_link(d)
    if real_d is None:
        target = os.readlink(os.path.join(source, link)) if os.path.islink(os.path.join(source, link)) else "?"
        raise ConfigError(f"code: {rel} lies beyond the symlink {link} -> {target}, which leads outside {source}; "
                          "dfo pushes nothing whose real path is outside the code folder",
                          hint=f"replace {link} with a real folder, or add {link}/ to code.exclude")
    if link in listed:
        return True, None
    via = f"{real_d}/{name}" if real_d else name
    if never_pushed(via):
        raise ConfigError(f"code: {rel} lies beyond the symlink {link}, which leads into {real_d or '.'}, "
                          "where dfo never pushes from (.git or a .dfo name)",
                          hint=f"replace {link} with a real folder, or add it to code.exclude")
    return False, via


def list_code(source: Path, exclude: list[str]) -> tuple[dict[str, LocalFile], bool]:
    """rel -> LocalFile (hashes not yet filled), and whether git chose the files.

    A path with a symlink among its folders (git lists a tracked file whose folder became a link; the
    walk never enters a linked folder) is refused unless its real path stays under the source."""
    names = _git_files(source)
    in_git = names is not None
    ex = Excluder(exclude)
    real_source = os.path.realpath(source)
    base = str(source) + "/"
    listed = [rel for rel in (names if names is not None else _walk(source))
              if not (never_pushed(rel) or ex.excluded(rel))]
    dirs = _Dirs(source, real_source)
    listed_set: set[str] | None = None
    files: dict[str, LocalFile] = {}
    lstat = os.lstat
    for rel in listed:
        via = None
        d = rel.rpartition("/")[0]
        if d and dirs.real(d) != d:  # a symlink on the path
            if listed_set is None:
                listed_set = set(listed)
            skip, via = _through_link(source, dirs, listed_set, rel)
            if skip:
                continue
        try:
            st = lstat(base + (via or rel))
        except (FileNotFoundError, NotADirectoryError):
            continue  # deleted from the work tree: gone, as git would commit it
        except OSError as exc:  # a symlink loop on the path
            raise ConfigError(f"code: {source / rel}: {exc.strerror}", hint="fix the path, or add it to code.exclude") \
                from None
        if not rel.isascii():
            _check_name(source, rel)
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        if stat.S_ISLNK(st.st_mode):
            if via is not None:  # inside the tree both here (its real place) and on the node (at rel)
                _link_target(source, real_source, via)
            files[rel] = LocalFile(0, None, _link_target(source, real_source, rel), key=key, via=via)
        elif stat.S_ISREG(st.st_mode):
            files[rel] = LocalFile(st.st_size, 0o755 if st.st_mode & 0o100 else 0o644, None, key=key, via=via)
        # a folder here is a git submodule: its files are not pushed (documented)
    return files, in_git


class Reader:
    """Opens the code's files for reading without following any symlink: every folder on the path is
    opened relative to its parent with O_NOFOLLOW | O_DIRECTORY, the file itself with O_NOFOLLOW.
    A folder swapped for a symlink after the listing is refused (exit 2), never read through."""

    MAX_FDS = 64

    def __init__(self, source: Path) -> None:
        self.source = source
        self.root = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.fds: dict[str, int] = {}

    def _refuse(self, rel: str, why: str) -> ConfigError:
        return ConfigError(f"code: {self.source / rel}: {why}; dfo reads no code through a symlinked folder",
                           hint="it changed while dfo read the code: look at it, then push again")

    def _dir(self, d: str, rel: str) -> int:
        if not d:
            return self.root
        fd = self.fds.get(d)
        if fd is None:
            if len(self.fds) >= self.MAX_FDS:
                self._close_dirs()
            parent, _, name = d.rpartition("/")
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                             dir_fd=self._dir(parent, rel))
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise self._refuse(rel, f"{d} is not a folder now (a symlink?)") from None
                raise
            self.fds[d] = fd
        return fd

    def open(self, rel: str) -> int:
        """A file descriptor of the regular file ``rel`` (relative to the source)."""
        d, _, name = rel.rpartition("/")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._dir(d, rel))
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._refuse(rel, "it is a symlink now") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._refuse(rel, "it is not a regular file now")
        return fd

    def read_bytes(self, rel: str) -> bytes:
        with os.fdopen(self.open(rel), "rb") as f:
            return f.read()

    def read_keyed(self, rel: str) -> tuple[bytes, tuple[int, int, int]]:
        """The file's bytes and its (size, mtime_ns, inode) as they stand once read (the hash cache's key)."""
        with os.fdopen(self.open(rel), "rb") as f:
            data = f.read()
            st = os.fstat(f.fileno())
        return data, (st.st_size, st.st_mtime_ns, st.st_ino)

    def sha256(self, rel: str) -> str:
        h = hashlib.sha256()
        with os.fdopen(self.open(rel), "rb", buffering=0) as f:
            while True:
                buf = f.read(1 << 20)
                if not buf:
                    return h.hexdigest()
                h.update(buf)

    def _close_dirs(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def close(self) -> None:
        self._close_dirs()
        os.close(self.root)

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- hashes


def _cache_path(source: Path) -> Path:
    base = cache_dir() / "code"
    return base / (hashlib.sha256(str(source).encode("utf-8", "surrogateescape")).hexdigest()[:20] + ".json")


def fill_hashes(source: Path, files: dict[str, LocalFile]) -> None:
    """sha256 of each file (a symlink's: of its target text), from the cache where (size, mtime_ns, inode) match."""
    cpath = _cache_path(source)
    try:
        cache = json.loads(cpath.read_text())
    except (OSError, ValueError):
        cache = {}
    new: dict[str, list[object]] = {}
    changed = False
    reader: Reader | None = None
    try:
        for rel, f in files.items():
            if f.link is not None:
                f.sha256 = hashlib.sha256(f.link.encode("utf-8", "surrogateescape")).hexdigest()
                continue
            hit = cache.get(rel)
            if isinstance(hit, list) and len(hit) == 4 and tuple(hit[:3]) == f.key:
                f.sha256 = str(hit[3])
            else:
                reader = reader or Reader(source)
                f.sha256 = reader.sha256(f.via or rel)
                changed = True
            new[rel] = [*f.key, f.sha256]
    finally:
        if reader is not None:
            reader.close()
    if changed or len(new) != len(cache):
        try:
            cpath.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(str(cpath), json.dumps(new).encode("utf-8", "surrogateescape"))
        except OSError:
            pass  # a cache that cannot be written only costs time


def stat_digest(files: dict[str, LocalFile]) -> str:
    """One sha256 over every file's path, (size, mtime_ns, inode), mode and link target: the keys
    the hash cache trusts, for the whole tree at once."""
    h = hashlib.sha256()
    for rel in sorted(files):
        f = files[rel]
        h.update(f"{rel}\0{f.key[0]}\0{f.key[1]}\0{f.key[2]}\0{f.mode}\0{f.link}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def cached_tree_digest(source: Path, stat_sum: str) -> str | None:
    """The tree digest (remote.files.push.digest_of) recorded with ``stat_sum``: when every file has the
    key it had then, every hash is the cached one, and so is the digest; the 5,000-entry hash cache
    need not be read."""
    try:
        doc = json.loads(_cache_path(source).with_suffix(".tree").read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(doc, dict) and doc.get("stat") == stat_sum and isinstance(doc.get("digest"), str)
    return doc["digest"] if ok else None


def save_tree_digest(source: Path, stat_sum: str, digest: str) -> None:
    p = _cache_path(source).with_suffix(".tree")
    try:
        p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(str(p), json.dumps({"stat": stat_sum, "digest": digest}).encode())
    except OSError:
        pass  # a cache that cannot be written only costs time


def manifest_view(files: dict[str, LocalFile]) -> dict[str, dict[str, object]]:
    return {rel: {"sha256": f.sha256, "mode": f.mode, "link": f.link} for rel, f in files.items()}


# --------------------------------------------------------------------------- what the node held after the last push


def _pushed_path(node: str) -> Path:
    base = cache_dir() / "code"
    return base / ("node-" + hashlib.sha256(node.encode("utf-8", "surrogateescape")).hexdigest()[:20] + ".json")


PUSHED_VERSION = 2  # the first line's version: an older or other file is no guess at all


class Pushed:
    """The node's manifest as the last push from here left it: its digest (the file's first line,
    read alone) and, only when needed, path -> [sha256, mode, link] (the second line). Only a
    guess of what to send: the node checks the result against the digest wanted."""

    def __init__(self, node: str) -> None:
        self.node, self.path = node, _pushed_path(node)
        self.digest: str | None = None
        try:
            with open(self.path, "rb") as f:
                head = json.loads(f.readline())
        except (OSError, ValueError):
            return
        if isinstance(head, dict) and head.get("version") == PUSHED_VERSION and head.get("node") == node \
                and isinstance(head.get("digest"), str):
            self.digest = head["digest"]

    def files(self) -> dict[str, list[object]] | None:
        try:
            with open(self.path, "rb") as f:
                head = json.loads(f.readline())
                files = json.loads(f.readline())
        except (OSError, ValueError):
            return None
        ok = isinstance(head, dict) and head.get("digest") == self.digest and isinstance(files, dict)
        return files if ok else None

    def encode(self, digest: str, files: dict[str, LocalFile]) -> bytes:
        """The file's bytes for ``save`` (made beforehand in a thread while the push runs: ~4 ms for 5,000 files)."""
        head = json.dumps({"version": PUSHED_VERSION, "node": self.node, "digest": digest})
        body = json.dumps({rel: [f.sha256, f.mode, f.link] for rel, f in files.items()})
        return (head + "\n" + body + "\n").encode("utf-8", "surrogateescape")

    def save(self, digest: str, files: dict[str, LocalFile], data: bytes | None = None) -> None:
        """Record that the node holds ``files`` (tree digest ``digest``); ``data``: ``encode``'s, made already."""
        if digest == self.digest:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(str(self.path), data if data is not None else self.encode(digest, files))
            self.digest = digest
        except OSError:
            pass  # a cache that cannot be written only costs a round trip


# --------------------------------------------------------------------------- warnings


def warnings(source: Path, files: dict[str, LocalFile], to_send: list[str]) -> list[str]:
    """Big files about to travel, and a tree over BIG_TREE files when anything travels."""
    out: list[str] = []
    big = sorted(((files[r].size, r) for r in to_send if files[r].size > BIG_FILE), reverse=True)
    if big:
        names = ", ".join(f"{r} ({human_bytes(s)})" for s, r in big[:5])
        names += f" and {len(big) - 5} more" if len(big) > 5 else ""
        out.append(f"code: {len(big)} file{'s' if len(big) != 1 else ''} over {BIG_FILE // 1_000_000} MB in {source}: "
                   f"{names}; did you mean to exclude {'them' if len(big) != 1 else 'it'}? (code.exclude)")
    if to_send and len(files) > BIG_TREE:
        per: dict[str, int] = {}
        for rel in files:
            top = rel.split("/")[0] + "/" if "/" in rel else "(top level)"
            per[top] = per.get(top, 0) + 1
        tops = sorted(per.items(), key=lambda kv: -kv[1])[:5]
        out.append(f"code: {len(files)} files in {source} (over {BIG_TREE:,}); biggest folders: "
                   + ", ".join(f"{d} ({n} files)" for d, n in tops) + "; did you mean to exclude some? (code.exclude)")
    return out
