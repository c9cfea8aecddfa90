"""Install dfo's node code from stdin, then run a node module: the first call to a node that lacks it.

The controller (orchestrator/agent.py) runs this file's text as ``python3 -c TEXT D PARTS MODULE ARGS...``
when it does not know that the node holds the parts of the bundle a module needs, so the code travels
in the same command as the call (no extra round trip):

* ``D``: the bundle's folder, ``$HOME/.cache/dfo/agent/<hash>``;
* ``PARTS``: ``name:sha256:size`` joined by commas, in the order their bytes come first on stdin
  (each a tar.gz: ``core``, all of remote/ but the vendored packaging; ``vendor``, remote/_vendor/packaging);
* then the module and its arguments, as ``python3 -m MODULE ARGS...`` would get them.

A part already on the node (its marker: ``D/.complete`` for core, ``D/.vendor`` for vendor) is read and
dropped (a part carried without core, core being absent: exit 97, and the controller sends them all).
A missing one is checked against its sha256 first (a short or damaged stream is refused: one
error frame, kind "agent", nothing installed), unpacked under a temporary name, then renamed into place
and marked, so no reader ever sees half a bundle. Then the module runs as ``-m`` would run it, its
request and payload being the rest of stdin.

This text must parse on any python from 2.7 on (no f-strings, no annotations): an older interpreter
then reaches remote/__init__.py, which says it is too old in one result frame.
"""
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile

MARKERS = {"core": ".complete", "vendor": ".vendor"}
NEED_UPLOAD = 97  # as orchestrator/agent.py's


def fail(message):
    sys.stdout.write("@@DFO-RESULT@@ " + json.dumps({"ok": False, "error": {
        "kind": "agent", "message": message,
        "hint": "run the command again; if it fails again, check that $HOME on the node is writable and has room"}})
        + "\n")
    sys.stdout.flush()
    sys.exit(0)


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


def main():
    d, specs, module, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    for spec in specs.split(","):
        name, sha, size = spec.split(":")
        blob, short = read_exact(stdin, int(size))
        if short:
            fail("dfo's node code (%s) arrived short by %d bytes; nothing was installed" % (name, short))
        if os.path.exists(os.path.join(d, MARKERS[name])):
            continue
        if hashlib.sha256(blob).hexdigest() != sha:
            fail("dfo's node code (%s) arrived damaged (its sha256 is not the one sent); nothing was installed"
                 % name)
        if name != "core" and not os.path.exists(os.path.join(d, MARKERS["core"])):
            sys.exit(NEED_UPLOAD)  # the controller thought core was here: it sends every part again
        try:
            install(d, name, blob)
        except (OSError, tarfile.TarError) as exc:
            fail("could not install dfo's node code (%s) in %s: %s" % (name, d, exc))
    os.chdir(d)
    sys.path[0] = d
    os.environ["PYTHONPATH"] = d  # as the plain call sets it: node modules start others by name
    sys.argv = [module] + args
    import runpy
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
