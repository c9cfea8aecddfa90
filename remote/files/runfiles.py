"""run.upload's files written into the run's working directory on the node (python3 3.8+, stdlib only).

The launch request lists each upload's path, sha256 and mode; a file whose content differs comes with
its bytes (base64). Used by ``remote.runs`` launch.
"""
import base64
import hashlib
import os

from remote._proto import RemoteError


def _sha256(path):
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError:
        return None
    return h.hexdigest()


def _safe_rel(rel):
    norm = os.path.normpath(rel)
    if os.path.isabs(norm) or norm == ".." or norm.startswith("../"):
        raise RemoteError("config", "run.upload: %r leaves the working directory" % rel,
                          hint="list files under the job file's folder")
    return norm


def sync_uploads(workdir, uploads):
    """Write changed uploads into ``workdir``; [need] when some changed file came without content."""
    need, done = [], []
    for up in uploads:
        dest = os.path.join(workdir, _safe_rel(up["path"]))
        same = _sha256(dest) == up["sha256"]
        if not same and up.get("content_b64") is None:
            need.append(up["path"])
        done.append((up, dest, same))
    if need:
        return need, []
    report = []
    for up, dest, same in done:
        if not same:
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            data = base64.b64decode(up["content_b64"])
            if hashlib.sha256(data).hexdigest() != up["sha256"]:
                raise RemoteError("verify", "run.upload %s: content does not match its sha256" % up["path"])
            tmp = "%s.dfo-%d.tmp" % (dest, os.getpid())
            with open(tmp, "wb") as f:
                f.write(data)
            os.chmod(tmp, up.get("mode", 0o644) & 0o777)
            os.replace(tmp, dest)
            if _sha256(dest) != up["sha256"]:
                raise RemoteError("verify", "run.upload %s: written file does not match its sha256" % up["path"])
        report.append({"path": up["path"], "sha256": up["sha256"], "changed": not same})
    return [], report
