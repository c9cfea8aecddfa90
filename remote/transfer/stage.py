"""``python3 -m remote.transfer.stage``: put a model in place on the node (normally under /dev/shm).

Request: the ``remote.transfer.sync`` request plus ``margin_pct``; ``source`` is one of

* ``s3://bucket/prefix/``   the S3 engine of remote.transfer.sync (the same manifest, checks and resume);
* ``/a/path`` or ``file:///a/path``  a directory (or one file) already on the node, copied in
  parallel: CRC32 of the bytes read, CRC32 of the temp file read back, equal sizes, then rename;
  the manifest records each file's size and mtime, so a re-run copies only what changed;
* ``hf://org/name[@revision]``  through huggingface_hub (run by the job's venv python; it must be
  importable there), with ``hf_token`` from the request; sizes checked against the Hub's listing.

Always: the destination is checked first (``remote.lib.destsafety``: exit 2 for /, $HOME, the workspace
root, a dest others own or may write, symlinks inside it ...), the destination filesystem's free
space is checked against what is missing plus ``margin_pct`` before any byte moves (RemoteError
"verify" with the numbers), and a model whose manifest matches (files still the ones dfo wrote:
size, mtime, inode, ctime, owner) is left alone (status "no change"); a file changed on the node
is fetched again and named in ``changed``.
"""
from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

from remote._proto import RemoteError, main
from remote.lib.destsafety import identity
from remote.transfer.sync import (
    Progress,
    Signals,
    check_space,
    checked_dest,
    open_manifest,
    resolve_dest,
    summary_names,
    sync,
)

CHUNK = 8 << 20


def stage(req):
    source = (req.get("source") or "").strip()
    req = dict(req, what="model")
    if source.startswith("s3://"):
        out = sync(req)
    elif source.startswith("hf://"):
        out = stage_hf(req)
    elif source.startswith("file://") or source.startswith("/") or source.startswith("~"):
        out = copy_local(req)
    else:
        raise RemoteError("config", "model.source %r: expected s3://bucket/prefix/, hf://org/name or a path on "
                                    "the node" % source)
    out["status"] = "no change" if out["fetched"] == 0 and out.get("deleted", 0) == 0 else "done"
    return out


# --------------------------------------------------------------------------- a path on the node


def _walk(src):
    if os.path.isfile(src):
        st = os.stat(src)
        return os.path.dirname(src), [(os.path.basename(src), st.st_size, st.st_mtime_ns)]
    out = []
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if d != ".dfo"]
        for name in files:
            path = os.path.join(root, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            out.append((os.path.relpath(path, src), st.st_size, st.st_mtime_ns))
    return src, out


def _crc_file(fd, size):
    crc, off = 0, 0
    while off < size:
        data = os.pread(fd, min(CHUNK, size - off), off)
        if not data:
            break
        crc = zlib.crc32(data, crc)
        off += len(data)
    return crc, off


def copy_local(req):
    t0 = time.monotonic()
    src = resolve_dest(req["source"][7:] if req["source"].startswith("file://") else req["source"], "model.source")
    shown, dest = checked_dest(req, "model")
    if not os.path.exists(src):
        raise RemoteError("verify", "model.source %s does not exist on the node" % src,
                          hint="copy the model there first, or use an s3:// or hf:// source")
    if dest == src or dest.startswith(src.rstrip("/") + "/") or src.startswith(dest.rstrip("/") + "/"):
        raise RemoteError("config", "model.source %s and model.dest %s overlap" % (src, dest))
    base, files = _walk(src)
    if not files:
        raise RemoteError("verify", "model.source %s holds no files" % src)
    manifest = open_manifest(dest, "file://" + src, "model.dest")
    stop = threading.Event()
    try:
        for f in files:
            manifest.tree.check(f[0])  # a symlinked or foreign folder on the way: refused before any change
        todo = [f for f in files if not manifest.present(f[0], f[1], "%d-%d" % (f[1], f[2]))]
        need = sum(f[1] for f in todo)
        if todo:
            check_space(shown, need, req.get("margin_pct") or 0, src)
        progress = Progress(len(todo), need, stop)
        progress.emit("plan", source="file://" + src, dest=shown, files_total=len(files),
                      bytes_total=sum(f[1] for f in files), to_fetch=len(todo), bytes_to_fetch=need,
                      skipped=len(files) - len(todo))
        errors = []

        def one(item):
            if stop.is_set():
                return
            rel, size, mtime = item
            tmp = hashlib.sha1(rel.encode("utf-8")).hexdigest()[:20]
            try:
                st = _copy_one(os.path.join(base, rel), manifest, tmp, rel, size, progress, stop)
                manifest.record(rel, size, "%d-%d" % (size, mtime), st.st_mtime_ns, identity(st))
                progress.file_done("crc32")
            except Exception as exc:  # noqa: BLE001 - the first failure stops the copy
                errors.append((rel, exc))
                stop.set()

        if todo:
            with Signals(stop) as sigs, ThreadPoolExecutor(max(1, min(8, int(req.get("concurrency") or 8)))) as ex:
                progress.start(hooks=[manifest.sync])
                list(ex.map(one, todo))
                progress.finish()
            manifest.clear_tmp()
            if errors:
                rel, exc = errors[0]
                if isinstance(exc, RemoteError):
                    raise exc
                raise RemoteError("verify", "copying %s to %s failed: %s" % (
                    os.path.join(base, rel), shown, getattr(exc, "strerror", None) or exc),
                    hint="finished files are kept; run stage-model again after fixing the cause")
            if sigs.got or progress.broken:
                raise RemoteError("interrupted", "interrupted after %d of %d files; the next run resumes"
                                  % (progress.files, len(todo)))
    finally:
        try:
            manifest.close()
        except OSError:
            pass
    seconds = time.monotonic() - t0
    out = {"source": "file://" + src, "dest": shown, "fetched": progress.files, "skipped": len(files) - len(todo),
           "deleted": 0, "bytes": progress.bytes, "files_total": len(files),
           "bytes_total": sum(f[1] for f in files), "seconds": round(seconds, 3),
           "mb_per_s": round(progress.bytes / 1e6 / seconds, 1) if seconds > 0 else 0.0,
           "verified": progress.verified}
    return summary_names(out, "changed", manifest.changed)


def _copy_one(src, manifest, tmp, rel, size, progress, stop):
    """Copy ``src`` to temp name ``tmp`` under .dfo/tmp/, check it, rename it to ``rel`` (its folder opened
    without following symlinks); the lstat of the result."""
    dst = os.path.join(manifest.dest, rel)
    fdi = os.open(src, os.O_RDONLY)
    try:
        fdo = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=manifest.tmp_fd)
        try:
            crc, off = 0, 0
            while True:
                if stop.is_set():
                    raise RemoteError("interrupted", "interrupted")
                data = os.read(fdi, CHUNK)
                if not data:
                    break
                crc = zlib.crc32(data, crc)
                view = memoryview(data)
                while view:
                    view = view[os.write(fdo, view):]
                off += len(data)
                progress.add(len(data))
            if off != size:
                raise RemoteError("verify", "%s changed while it was copied (%d bytes read, %d listed)"
                                  % (src, off, size))
            back, n = _crc_file(fdo, off)
            if n != size or back != crc:
                raise RemoteError("verify", "%s: the copy reads back different bytes (crc32 %08x vs %08x)"
                                  % (dst, back, crc))
        finally:
            os.close(fdo)
    finally:
        os.close(fdi)
    reldir, name = manifest.tree.split(rel)
    dfd = manifest.tree.dir(reldir, create=True)
    os.rename(tmp, name, src_dir_fd=manifest.tmp_fd, dst_dir_fd=dfd)
    return os.stat(name, dir_fd=dfd, follow_symlinks=False)


# --------------------------------------------------------------------------- Hugging Face Hub


def _dir_bytes(path):
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def stage_hf(req):
    t0 = time.monotonic()
    spec = req["source"][5:]
    repo, _, revision = spec.partition("@")
    if repo.count("/") != 1:
        raise RemoteError("config", "model.source hf://%s: expected hf://org/name[@revision]" % spec)
    shown, dest = checked_dest(req, "model")
    try:
        from huggingface_hub import HfApi, snapshot_download
    except ImportError:
        raise RemoteError("verify", "huggingface_hub is not importable by the python that stages hf:// models",
                          hint="add huggingface_hub to the job's packages and run dfo provision") from None
    token = req.get("hf_token") or None
    try:
        info = HfApi().model_info(repo, revision=revision or None, files_metadata=True, token=token)
    except Exception as exc:  # noqa: BLE001 - the Hub client raises many kinds
        raise RemoteError("unreachable", "hf://%s: %s: %s" % (spec, type(exc).__name__, str(exc)[:300]),
                          hint="check the repo name, the revision, the token (HF_TOKEN) and that the node can "
                               "reach the Hub") from None
    files = [(s.rfilename, int(s.size or 0)) for s in info.siblings or []]
    source = "hf://%s@%s" % (repo, info.sha)
    manifest = open_manifest(dest, source, "model.dest")
    try:
        for f in files:
            manifest.tree.check(f[0])
        todo = [f for f in files if not manifest.present(f[0], f[1], info.sha)]
        need = sum(f[1] for f in todo)
        if todo:
            check_space(shown, need, req.get("margin_pct") or 0, "hf://" + spec)
            stop = threading.Event()
            progress = Progress(len(todo), need, stop)
            progress.emit("plan", source=source, dest=shown, files_total=len(files),
                          bytes_total=sum(f[1] for f in files), to_fetch=len(todo), bytes_to_fetch=need,
                          skipped=len(files) - len(todo))
            before = _dir_bytes(dest)
            progress.start(hooks=[lambda: setattr(progress, "bytes", max(0, _dir_bytes(dest) - before))])
            try:
                snapshot_download(repo, revision=info.sha, local_dir=dest, token=token,
                                  max_workers=max(1, min(16, int(req.get("concurrency") or 8))))
            except Exception as exc:  # noqa: BLE001
                raise RemoteError("unreachable", "hf://%s: download failed: %s: %s" % (
                    spec, type(exc).__name__, str(exc)[:300]), hint="run stage-model again to resume") from None
            finally:
                progress.finish()
            for rel, size in todo:
                st = manifest.tree.lstat(rel)  # written by huggingface_hub: checked without following symlinks
                got = st.st_size if st is not None and stat.S_ISREG(st.st_mode) else -1
                if got != size:
                    raise RemoteError("verify", "hf://%s: %s has %d bytes, the Hub lists %d" % (spec, rel, got, size))
                manifest.record(rel, size, info.sha, st.st_mtime_ns, identity(st))
    finally:
        try:
            manifest.close()
        except OSError:
            pass
    seconds = time.monotonic() - t0
    fetched_bytes = sum(f[1] for f in todo)
    out = {"source": source, "dest": shown, "fetched": len(todo), "skipped": len(files) - len(todo), "deleted": 0,
           "bytes": fetched_bytes, "files_total": len(files), "bytes_total": sum(f[1] for f in files),
           "seconds": round(seconds, 3), "mb_per_s": round(fetched_bytes / 1e6 / seconds, 1) if seconds else 0.0,
           "verified": {"size": len(todo)} if todo else {}}
    return summary_names(out, "changed", manifest.changed)


if __name__ == "__main__":
    main(stage)
