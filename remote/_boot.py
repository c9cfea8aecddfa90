"""Install dfo's node code from stdin, then run a node module: the first call to a node that lacks it.

The controller (orchestrator/agent.py) runs this file's text as
``python3 -c TEXT HASH HOME_BASE WORKSPACE... -- PARTS MODULE ARGS...`` when it does not know that the node
holds the parts of the bundle a module needs, so the code travels in the same command as the call (no extra
round trip):

* ``HASH``: the bundle's name; ``PARTS``: ``name:sha256:size`` joined by commas, in the order their bytes come
  first on stdin (each a tar.gz: ``core``, all of remote/ but the vendored packaging; ``vendor``,
  remote/_vendor/packaging); then the module and its arguments, as ``python3 -m MODULE ARGS...`` gets them;
* where the bundle's folder ``D`` may be, in order: the home's cache ``HOME_BASE/HASH``
  (``$HOME/.cache/dfo/agent``), then ``WORKSPACE/.dfo/agent/HASH`` for each workspace given (the job's, the
  node's defaults), then ``/tmp/dfo-agent-UID/HASH``. The shell's plain call (no parts carried) looks in
  the same places, in the same order.

A ``D`` that holds every part the call needs (its markers: ``D/.complete`` for core, ``D/.vendor`` for vendor)
is used; the parts' bytes are read and dropped. Else the parts go to the first place that can take them: its
filesystem writable, with room for them (their files and bytecode) and ``FLOOR`` left free after (a home
that is nearly full is never filled: no write of dfo's takes a filesystem under the floor); a workspace's
``.dfo`` and the /tmp folder must be folders of this user's that nobody else may write (made 0700; a
symlink, another owner's or a group- or world-writable one is refused, never used). A place that fails while
the parts go in (a quota) is cleaned up and the next one tried. Where none can take them: one error frame,
kind "verify" (exit 3), naming each place and why. A place other than the home's says so in one line
``@@DFO-AGENT@@ {json}`` on stdout (the controller says it under -v).

A part is checked against its sha256 first (a short or damaged stream is refused: one error frame, kind
"agent", nothing installed), unpacked under a temporary name, then renamed into place and marked, so no
reader ever sees half a bundle. Then the module runs as ``-m`` would run it, its request and payload being
the rest of stdin.

This text must parse on any python from 2.7 on (no f-strings, no annotations): an older interpreter
then reaches remote/__init__.py, which says it is too old in one result frame.
"""
import errno
import hashlib
import io
import json
import os
import shutil
import stat
import sys
import tarfile

MARKERS = {"core": ".complete", "vendor": ".vendor"}
NEED_UPLOAD = 97  # as orchestrator/agent.py's
FLOOR = 4 << 20  # bytes every filesystem keeps free after dfo writes its code there (remote/lib/fsutil.ROOM_FLOOR)
NOTE = "@@DFO-AGENT@@ "


def frame(doc):
    sys.stdout.write("@@DFO-RESULT@@ " + json.dumps(doc) + "\n")
    sys.stdout.flush()
    sys.exit(0)


def fail(message, kind="agent", hint=None):
    frame({"ok": False, "error": {
        "kind": kind, "message": message,
        "hint": hint or "run the command again; if it fails again, check that $HOME on the node is writable and "
                        "has room"}})


def read_exact(stream, n):
    chunks = []
    while n > 0:
        buf = stream.read(min(n, 1 << 20))
        if not buf:
            break
        chunks.append(buf)
        n -= len(buf)
    return b"".join(chunks), n


def unpack(blob, dest):
    """The tar.gz's regular files under ``dest`` (names under remote/ only; nothing else is made)."""
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        for m in tar.getmembers():
            parts = m.name.split("/")
            if not m.isfile() or parts[0] != "remote" or any(p in ("", ".", "..") for p in parts):
                fail("dfo's node code holds an unexpected entry %r; refused" % m.name)
            path = os.path.join(dest, *parts)
            if not os.path.isdir(os.path.dirname(path)):
                os.makedirs(os.path.dirname(path))
            src = tar.extractfile(m)
            with open(path, "wb") as f:
                f.write(src.read() if src is not None else b"")


def room(blob):
    """Bytes a part takes once unpacked: its files in whole 4 KiB blocks, twice (their bytecode), and folders."""
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        members = tar.getmembers()
    files = sum(-(-max(m.size, 1) // 4096) * 4096 for m in members)
    return 2 * files + 4096 * len(set(os.path.dirname(m.name) for m in members))


def mark(path):
    open(path, "w").close()


def install(d, name, blob):
    tmp = "%s.tmp.%d" % (d, os.getpid()) if name == "core" else os.path.join(d, ".vendor.tmp.%d" % os.getpid())
    try:
        unpack(blob, tmp)
        if name == "core":
            mark(os.path.join(tmp, MARKERS["core"]))
            if os.path.isdir(d) and not os.path.exists(os.path.join(d, MARKERS["core"])):
                shutil.rmtree(d, ignore_errors=True)  # an unfinished copy of an older dfo's upload
            try:
                os.rename(tmp, d)
            except OSError:
                if not os.path.exists(os.path.join(d, MARKERS["core"])):  # not a concurrent install: a failure
                    raise
        else:
            where = os.path.join(d, "remote", "_vendor", "packaging")
            if os.path.isdir(where):
                shutil.rmtree(where, ignore_errors=True)  # not marked: unfinished
            try:
                os.rename(os.path.join(tmp, "remote", "_vendor", "packaging"), where)
            except OSError:
                if not os.path.isdir(where):
                    raise
            mark(os.path.join(d, MARKERS["vendor"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def private(path, make):
    """Why ``path`` cannot be dfo's folder (None: it can): it must be a folder of this user's that nobody else
    may write, not a symlink; ``make``: created 0700 when missing (its parents as well)."""
    try:
        st = os.lstat(path)
    except OSError:
        if not make:
            return "missing"
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent)
        os.mkdir(path, 0o700)
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "%s is a symlink: not used (remove it)" % path
    if not stat.S_ISDIR(st.st_mode):
        return "%s is not a folder: not used (remove it)" % path
    if st.st_uid != os.geteuid():
        return "%s belongs to uid %d: not used (remove it)" % (path, st.st_uid)
    if st.st_mode & 0o022:
        return "%s is writable by group or others (mode %o): not used (remove it)" % (path, st.st_mode & 0o777)
    return None


def why_not(d, need):
    """Why the filesystem that would hold ``d`` cannot take ``need`` more bytes and keep FLOOR free; None: it can."""
    probe = d
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError as exc:
        return str(exc)
    if st.f_flag & getattr(os, "ST_RDONLY", 1):
        return "read-only file system"
    if not os.access(probe, os.W_OK | os.X_OK):
        return "%s is not writable by uid %d" % (probe, os.geteuid())
    free = st.f_bavail * st.f_frsize
    if free < need + FLOOR:
        return "%d KB free of the %d KB dfo needs there (its code, %d KB, and %d KB it leaves free)" % (
            free // 1024, (need + FLOOR) // 1024, need // 1024, FLOOR // 1024)
    return None


def places(digest, home, workspaces):
    """(base that must be private or None, D, label) of each place, in order."""
    out = [(None, os.path.join(home, digest), home)]  # type: list
    seen = set()
    for w in workspaces:
        base = os.path.join(w, ".dfo")
        if w and base not in seen:
            seen.add(base)
            out.append((base, os.path.join(base, "agent", digest), os.path.join(base, "agent")))
    tmp = "/tmp/dfo-agent-%d" % os.geteuid()
    out.append((tmp, os.path.join(tmp, digest), tmp))
    return out


def has(d, names):
    return all(os.path.exists(os.path.join(d, MARKERS[n])) for n in names)


def choose(digest, home, workspaces, blobs):
    """The folder D the module runs from, the parts installed there as needed (see the module's docstring)."""
    names = [n for n, _ in blobs]
    want = set(names) | set(["core"])
    where = places(digest, home, workspaces)
    usable = [(base, d, label) for base, d, label in where if base is None or private(base, False) is None]
    for _, d, _ in usable:  # a copy that holds every part needed
        if has(d, want):
            return d
    for _, d, _ in usable:  # core is there, a part is missing: it goes beside it when there is room
        if has(d, ["core"]):
            missing = [(n, b) for n, b in blobs if not has(d, [n])]
            if why_not(d, sum(room(b) for _, b in missing)) is None:
                try:
                    for n, b in missing:
                        install(d, n, b)
                    return d
                except (OSError, tarfile.TarError):
                    pass
    if "core" not in names:
        sys.exit(NEED_UPLOAD)  # the controller thought core was here: it sends every part again
    need = sum(room(b) for _, b in blobs)
    passed = []  # type: list
    for base, d, label in where:
        try:
            why = private(base, True) if base is not None else None
        except OSError as exc:
            why = "cannot make %s: %s" % (base, exc.strerror or exc)
        why = why or why_not(d, need)
        if why is None:
            try:
                for n, b in blobs:
                    if not has(d, [n]):
                        install(d, n, b)
            except (OSError, tarfile.TarError) as exc:
                gone = "quota exceeded" if getattr(exc, "errno", None) == errno.EDQUOT else str(exc)
                why = "could not write there: %s" % gone
                shutil.rmtree(d, ignore_errors=True)
        if why is None:
            if passed:
                sys.stdout.write(NOTE + json.dumps({"where": d, "passed": passed}) + "\n")
            return d
        passed.append([label, why])
    fail("no folder on the node can take dfo's code (%d KB, leaving %d KB free): %s" % (
        need // 1024, FLOOR // 1024, "; ".join("%s: %s" % (p, w) for p, w in passed)), kind="verify",
        hint="make room in the node's home (or make it writable), or give the host (inventory) or the job a "
             "workspace: on a disk with room")


def main():
    cut = sys.argv.index("--")
    digest, home, workspaces = sys.argv[1], sys.argv[2], sys.argv[3:cut]
    specs, module, args = sys.argv[cut + 1], sys.argv[cut + 2], sys.argv[cut + 3:]
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    blobs = []
    for spec in specs.split(","):
        name, sha, size = spec.split(":")
        blob, short = read_exact(stdin, int(size))
        if short:
            fail("dfo's node code (%s) arrived short by %d bytes; nothing was installed" % (name, short))
        if hashlib.sha256(blob).hexdigest() != sha:
            fail("dfo's node code (%s) arrived damaged (its sha256 is not the one sent); nothing was installed"
                 % name)
        blobs.append((name, blob))
    try:
        d = choose(digest, home, workspaces, blobs)
    except (OSError, tarfile.TarError) as exc:
        fail("could not install dfo's node code: %s" % exc)
    os.chdir(d)
    sys.path[0] = d
    os.environ["PYTHONPATH"] = d  # as the plain call sets it: node modules start others by name
    sys.argv = [module] + args
    import runpy
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
