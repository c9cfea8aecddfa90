"""A recovering run's generation record, the controller's side (issue 20; docs/recovery.md).

The record itself, its compare-and-swap and the shipper's check live in remote/runs/generation.py (the
same code reads it on the node). Here: where it is for a job (``place``), and ``begin``: a fresh launch of
a job with run.spares or run.restarts starts generation N+1 of a new lineage before any node starts it,
so a run of an older generation still alive somewhere stops shipping at its next pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from remote.runs import generation as gen
from remote.s3.client import S3Client, S3Error

from ..config.models import LoadedJob
from ..errors import ConfigError, VerifyError
from . import recordauth
from .outputs import outputs_spec

CAS_TRIES = 6


@dataclass
class Place:
    """Where a job's generation record is: its S3 client, bucket and outputs.dest prefix.

    Every record read here is checked (recordauth: the laptop's HMAC, and a ``seq`` not below what this
    machine has seen) unless ``trusted=False`` is asked for; every record written is signed."""

    client: Any
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        return self.url_of(gen.KEY)

    def url_of(self, name: str) -> str:
        return f"s3://{self.bucket}/{gen.key_of(self.prefix, name)}"

    def read(self, name: str = gen.KEY, trusted: bool = True) -> tuple[dict[str, Any] | None, str | None]:
        """(record, ETag); (None, None) when there is none. ``trusted``: a record dfo did not write raises
        recordauth.RecordForged (exit 3); else it comes back as it is (a dict or None)."""
        try:
            doc, etag = gen.read(self.client, self.bucket, self.prefix, name)
        except S3Error as exc:
            raise VerifyError(f"generation record {self.url_of(name)}: {exc.described()}",
                              hint="check s3.endpoint_url and the credentials of outputs.dest") from None
        if not trusted or (doc is None and etag is None):
            return doc, etag
        url = self.url_of(name)
        return recordauth.fresh(recordauth.check(doc, url), url), etag

    def write(self, doc: dict[str, Any], etag: str | None, name: str = gen.KEY) -> tuple[dict[str, Any], str | None]:
        """Compare-and-swap, signed, ``seq`` one more than the highest seen; raises
        remote.runs.generation.Conflict when someone else wrote first."""
        url = self.url_of(name)
        key = recordauth.load_key()
        last = doc.get("seq")
        seq = max(last if isinstance(last, int) and not isinstance(last, bool) else 0, recordauth.seen_seq(url)) + 1
        body = {k: v for k, v in doc.items() if k != "auth"}
        body["seq"] = seq
        try:
            written, etag2 = gen.write(self.client, self.bucket, self.prefix, body, etag, name,
                                       seal=lambda d: recordauth.seal(d, key))
        except S3Error as exc:
            raise VerifyError(f"generation record {url}: {exc.described()}",
                              hint="check s3.endpoint_url and the credentials of outputs.dest") from None
        recordauth.note_seq(url, seq)
        return written, etag2


def place(loaded: LoadedJob) -> Place:
    """The job's record: beside its outputs (outputs.dest + .dfo/generation.json)."""
    from remote.ship.shipper import dest_parts

    from .transfer import controller_credentials

    job = loaded.job
    if job.outputs is None or not job.outputs.dest:
        raise ConfigError(f"{loaded.path}: recovery needs outputs.dest (a restart resumes from what shipped there)",
                          hint="add outputs: {dest: s3://BUCKET/PREFIX/} to the job file")
    spec = outputs_spec(loaded, "run")
    bucket, prefix = dest_parts(spec["dest"])
    creds = controller_credentials(job.s3, loaded.path)
    try:
        client = S3Client(job.s3.endpoint_url, job.s3.region, creds, timeout=20.0)
    except ValueError as exc:
        raise ConfigError(f"{loaded.path}: s3.endpoint_url: {exc}") from None
    return Place(client, bucket, prefix)


def launch_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """What a node's run records of its generation (meta.json "generation")."""
    return {"lineage": doc.get("lineage"), "generation": doc.get("generation"), "restarts": doc.get("restarts") or [],
            "record": None}


def _count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def begin(loaded: LoadedJob, run_id: str, hosts: list[str]) -> dict[str, Any]:
    """Generation N+1 of a new lineage named ``run_id`` on ``hosts`` (rank order); returns launch_fields."""
    where = place(loaded)
    for _ in range(CAS_TRIES):
        # the old record's number only: a new lineage obeys nothing in it (it may be a node's forgery)
        doc, etag = where.read(trusted=False)
        old = doc if isinstance(doc, dict) else {}
        # numbers only grow: the old generation's (its nodes stop shipping) and seq (a watcher elsewhere
        # that saw the old record's seq takes this one for newer, not for a replay)
        new = {"version": 1, "job": loaded.job.name, "lineage": run_id, "generation": _count(old.get("generation")) + 1,
               "run": run_id, "hosts": list(hosts), "state": "running", "restarts": [], "lost": [], "recovery": None,
               "watcher": None, "seq": _count(old.get("seq"))}
        try:
            written, _ = where.write(new, etag)
        except gen.Conflict:
            continue
        out = launch_fields(written)
        out["record"] = where.url
        return out
    raise VerifyError(f"generation record {where.url}: it kept changing while this launch tried to write it",
                      hint="is a dfo watch or another launch of this job running? try again")


def story(g: dict[str, Any] | None) -> str | None:
    """status's line for a recovering run: its generation and who replaced whom (None: no generation)."""
    if not g:
        return None
    rs = list(g.get("restarts") or [])
    text = f"generation {g.get('generation')} of run {g.get('lineage')}; restarts: {len(rs)}"
    for r in rs:
        who = f"{r.get('lost_host')} lost, {r.get('spare')} took its place" if r.get("lost_host") else str(
            r.get("detail") or r.get("why"))
        step = r.get("resumed_step")
        text += f"; [{r.get('at')}] {who}" + (f", resumed at step {step}" if step is not None else "")
    return text
