"""The laptop's own record of what ``dfo submit`` sent, so a run queued on a node that is lost can be sent
again elsewhere (``dfo submit --requeue-from HOST``) as it was when first submitted.

``$XDG_STATE_HOME/dfo/submits/`` (else ``~/.local/state/dfo/submits/``), 0700, only this user's:

* ``runs/RUN_ID/record.json``: the run id, its job as submitted (after ``--set``), the job file it came
  from, the host it went to and how it stood when this laptop last looked (``queued``, ``running``,
  ``started``, ``cancelled``, ``failed``), each move; beside it run.upload's files as submitted;
* ``code/DIGEST/``: the code as submitted (what git would commit, less code.exclude), one copy per tree:
  every run of a sweep that does not change the code shares it. The submit pushes from this copy, so the
  node holds exactly what the laptop keeps.

Nothing a node says decides a path here: the run id is made on this machine, the digest is of the files
here. Records older than ``KEEP_DAYS`` are removed at the next submit, with the code no record names.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..config.models import Job, LoadedJob
from ..errors import ConfigError

KEEP_DAYS = 30.0
RECORD = "record.json"


def state_dir() -> Path:
    """dfo's state folder for submits: $XDG_STATE_HOME/dfo/submits, else ~/.local/state/dfo/submits."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "dfo" / "submits"
    try:
        base.mkdir(parents=True, exist_ok=True, mode=0o700)
        if base.stat().st_uid != os.geteuid():
            raise ConfigError(f"{base}: dfo's record of submits belongs to another user",
                              hint="remove it, or set XDG_STATE_HOME to a folder of yours")
        os.chmod(base, 0o700)
    except OSError as exc:
        raise ConfigError(f"{base}: cannot make dfo's record of submits: {exc.strerror or exc}",
                          hint="check that your home (or $XDG_STATE_HOME) is writable") from None
    return base


class Move(BaseModel):
    model_config = ConfigDict(extra="ignore")

    at: str
    source: str  # the host it left
    to: str
    why: str


class Submitted(BaseModel):
    """One run as this laptop submitted it."""

    model_config = ConfigDict(extra="ignore")

    run: str
    job: str
    job_doc: dict[str, Any]  # the job as submitted (after --set), code.source and run.upload pointing here
    job_file: str
    sets: list[str] = []
    host: str | None = None
    state: str = "submitting"  # queued | running | started | cancelled | failed, as last seen
    submitted: str
    submitted_ts: float = 0.0  # the order of submits (several in one second)
    seen: str | None = None
    gpus: int | None = None
    moves: list[Move] = []

    def folder(self) -> Path:
        return state_dir() / "runs" / self.run

    def save(self) -> None:
        d = self.folder()
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = d / f".{RECORD}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.model_dump(), indent=1))
        os.replace(tmp, d / RECORD)

    def loaded(self) -> LoadedJob:
        """The job as submitted, its files the copies kept here."""
        return LoadedJob(job=Job.model_validate(self.job_doc), path=self.folder() / "job.yaml")

    def seen_as(self, state: str, host: str | None = None) -> None:
        self.state, self.seen = state, now_iso()
        if host is not None:
            self.host = host
        self.save()


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def all_records() -> list[Submitted]:
    """Every record here, oldest first (a damaged one is skipped)."""
    out: list[Submitted] = []
    base = state_dir() / "runs"
    if not base.is_dir():
        return out
    for d in base.iterdir():
        try:
            out.append(Submitted.model_validate_json((d / RECORD).read_text()))
        except (OSError, ValueError):
            continue
    out.sort(key=lambda r: (r.submitted_ts, r.submitted, r.run))
    return out


def record_of(run: str) -> Submitted | None:
    try:
        return Submitted.model_validate_json((state_dir() / "runs" / run / RECORD).read_text())
    except (OSError, ValueError):
        return None


def _keep_code(loaded: LoadedJob) -> Path | None:
    """The job's code copied to code/DIGEST (once per tree); its path, or None without code:."""
    if loaded.job.code is None:
        return None
    from .code import start_local
    from .codetree import Reader

    local = start_local(loaded).result()
    view = local.view()
    base = state_dir() / "code"
    dest = base / local.digest
    if dest.is_dir():  # (made under a temporary name and renamed: a folder of that name is whole)
        return dest
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = base / f".tmp-{secrets.token_hex(4)}"
    tmp.mkdir(mode=0o700)
    try:
        with Reader(local.source) as reader:
            for rel in sorted(view):
                entry, f = view[rel], local.files[rel]
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                if f.link is not None:
                    os.symlink(f.link, target)
                    continue
                data = reader.read_bytes(f.via or rel)
                if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                    raise ConfigError(f"code: {local.source / rel} changed while dfo copied it",
                                      hint="submit again once it is saved")
                target.write_bytes(data)
                os.chmod(target, int(entry["mode"] or 0o644) & 0o777)  # type: ignore[call-overload]
        try:
            os.rename(tmp, dest)
        except OSError:  # another submit kept the same tree meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def keep(loaded: LoadedJob, run: str, sets: list[str]) -> Submitted:
    """A record of the run about to be submitted, with its code and uploads copied here; ``.loaded()``
    is the job to submit (it reads its files from those copies)."""
    prune()
    doc = loaded.job.model_dump(mode="json", exclude_unset=True)
    code_dir = _keep_code(loaded)
    rec = Submitted(run=run, job=loaded.job.name, job_doc=doc, job_file=str(loaded.path), sets=list(sets),
                    submitted=now_iso(), submitted_ts=time.time(),
                    gpus=loaded.job.run.gpus if loaded.job.run else None)
    folder = rec.folder()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if code_dir is not None:
        doc.setdefault("code", {})["source"] = str(code_dir)
        doc["code"].pop("exclude", None)  # applied once already: the copy holds what was chosen
    run_doc = doc.get("run") or {}
    names = []
    for rel in run_doc.get("upload") or []:
        src = loaded.path.parent / rel
        shutil.copyfile(src, folder / src.name)
        os.chmod(folder / src.name, src.stat().st_mode & 0o777)
        names.append(src.name)
    if run_doc:
        run_doc["upload"] = names
    rec.job_doc = doc
    rec.save()
    return rec


def forget(run: str) -> None:
    shutil.rmtree(state_dir() / "runs" / run, ignore_errors=True)


def prune() -> None:
    """Records older than KEEP_DAYS go, and the code copies no record names."""
    base = state_dir()
    cutoff = time.time() - KEEP_DAYS * 86400
    named: set[str] = set()
    runs = base / "runs"
    for d in runs.iterdir() if runs.is_dir() else []:
        try:
            if (d / RECORD).stat().st_mtime < cutoff:
                shutil.rmtree(d, ignore_errors=True)
                continue
            doc = json.loads((d / RECORD).read_text())
            src = ((doc.get("job_doc") or {}).get("code") or {}).get("source")
            if isinstance(src, str):
                named.add(Path(src).name)
        except (OSError, ValueError):
            continue
    code = base / "code"
    for d in code.iterdir() if code.is_dir() else []:
        # never a copy another submit is making or has just made (no record names it yet)
        if d.name not in named and d.stat().st_mtime < time.time() - 3600:
            shutil.rmtree(d, ignore_errors=True)
