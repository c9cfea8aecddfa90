"""A run's generation record in S3 (python3 3.8+, stdlib only): who may write outputs.dest now (issue 20).

Each launch of a run that recovers (run.spares or run.restarts in the job) is a new *generation*: a
number that only grows per outputs.dest. The record is one object beside the outputs, at
``DEST/.dfo/generation.json`` (restore skips ``.dfo`` keys, the shipper never scans them)::

    {"version": 1, "job": NAME, "lineage": FIRST_RUN_ID, "generation": N, "run": RUN_ID_OF_N,
     "hosts": [rank order], "state": "running" | "recovering" | "succeeded" | "failed",
     "restarts": [{"at", "why", "lost_host", "spare", "resumed_step", "generation"}],
     "lost": [hosts], "recovery": {...} | null, "watcher": {"id", "host", "pid"} | null,
     "writer": NONCE, "updated": ISO}

The watcher's lease is a second object, ``DEST/.dfo/watcher.json`` ({"id", "host", "pid", "beat"}).
Writers (``dfo up``/``launch`` for generation 1 of a lineage, ``dfo watch`` after) change it with a
compare-and-swap: ``If-Match: ETAG`` (``If-None-Match: *`` to create it), then a read-back of the
``writer`` nonce. A server that honours the conditions (SeaweedFS, AWS S3) refuses the loser with
412. For one that ignores them (rclone serve s3) the ETag is also compared just before the PUT, and
the read-back catches a write that lands after ours; two writers both win only when one's PUT and
read-back both fit between the other's check and its PUT (the window docs/recovery.md describes).

The shipper calls ``superseded(client, bucket, prefix, spec)`` before a pass uploads anything: a
record whose generation is newer than the run's own means the run is an old generation (a node cut
off by a partition that came back): nothing is uploaded, and ``stop_trainer`` ends the run's trainer.
``WriteGuard`` makes each upload conditional as well, which closes the window between that check and
the upload where the server honours If-Match.
"""
import json
import os
import signal
import time
import uuid

KEY = ".dfo/generation.json"
LEASE_KEY = ".dfo/watcher.json"  # the watcher's lease, renewed apart from the record (dfo watch)


class Conflict(Exception):
    """Someone else changed the record first (HTTP 412, or the read-back named another writer)."""


def key_of(prefix, name=KEY):
    return (prefix or "") + name


def read(client, bucket, prefix, name=KEY):
    """(record or None, its ETag or None). A missing object is (None, None); other errors raise S3Error."""
    key = key_of(prefix, name)
    resp = client.request("GET", bucket, key)
    body = resp.read()
    if resp.status == 404:
        return None, None
    client.check(resp, bucket, key, "GET")
    try:
        doc = json.loads(body.decode("utf-8"))
    except ValueError:
        doc = None
    return (doc if isinstance(doc, dict) else None), (resp.getheader("etag") or "").strip() or None


def write(client, bucket, prefix, doc, etag, name=KEY, seal=None):
    """Compare-and-swap: write ``doc`` if the record's ETag is still ``etag`` (None: if there is none).
    Returns (doc as written, new ETag); raises Conflict when another writer came first. ``seal``: a
    function applied to the document last, once its nonce and time are in (the laptop's signature:
    orchestrator/steps/recordauth.py)."""
    key = key_of(prefix, name)
    _, now = read(client, bucket, prefix, name)  # a server that ignores If-Match: the ETag is compared here too
    if now != etag:
        raise Conflict("the generation record changed since it was read")
    doc = dict(doc, writer=uuid.uuid4().hex, updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if seal is not None:
        doc = seal(doc)
    body = (json.dumps(doc, sort_keys=True, indent=1) + "\n").encode("utf-8")
    headers = {"content-type": "application/json"}
    if etag:
        headers["if-match"] = etag
    else:
        headers["if-none-match"] = "*"
    resp = client.request("PUT", bucket, key, headers=headers, body=body)
    resp.read()
    if resp.status in (409, 412):
        raise Conflict("the generation record changed meanwhile (HTTP %d)" % resp.status)
    client.check(resp, bucket, key, "PUT")
    back, new_etag = read(client, bucket, prefix, name)  # a server that ignores If-Match: the nonce says who won
    if back is None or back.get("writer") != doc["writer"]:
        raise Conflict("another writer changed the generation record at the same time")
    return doc, new_etag


def superseded(client, bucket, prefix, spec):
    """The newer generation's number when the record says this run is an old generation, else None.
    A spec without a generation (a job that does not recover) is never superseded."""
    mine = spec.get("generation")
    if not mine:
        return None
    doc, _ = read(client, bucket, prefix)
    if doc is None:
        return None
    try:
        now = int(doc.get("generation") or 0)
    except (TypeError, ValueError):
        return None
    return now if now > int(mine) else None


def stop_trainer(run_dir, why):
    """The old generation learns of a newer one: stop.json says why, the trainer's group gets SIGTERM
    (the supervisor records the run as stopped; its last pass is refused by the same check)."""
    try:
        with open(os.path.join(run_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    stop = os.path.join(run_dir, "stop.json")
    if not os.path.exists(stop):
        from remote.lib.fsutil import write_json

        write_json(stop, {"requested": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "why": why,
                          "grace": meta.get("stop_grace")})
    pgid = meta.get("pgid")
    if not pgid:
        return False
    from remote.runs.record import leftovers

    if not leftovers(meta):
        return False
    try:
        os.killpg(int(pgid), signal.SIGTERM)
    except OSError:
        return False
    return True


class Superseded(Exception):
    ends_pass = True  # raised inside the upload engine too (WriteGuard): the pass ends, the trainer is stopped

    def __init__(self, generation, mine, what="nothing uploaded"):
        Exception.__init__(self, "superseded: generation %d of this run started elsewhere (this is generation %d); "
                                 "%s, the trainer is stopped" % (generation, mine, what))
        self.generation = generation


META = "x-amz-meta-dfo-generation"  # the generation that wrote an object of outputs.dest


class WriteGuard:
    """Each upload of a generation's outputs, conditional on what the key holds (issue 20: the window left
    by the check before a pass). Every object written carries its generation (``META``). Right before an
    object is committed (its PUT, or CompleteMultipartUpload) the engine asks ``condition(key)``: one HEAD.
    An object there from a newer generation raises Superseded (nothing written); otherwise the commit is
    made conditional on what was seen: ``If-Match: ETAG``, or ``If-None-Match: *`` where there was nothing.
    A newer generation's write landing between the look and the commit is then refused by a server that
    honours conditions (SeaweedFS, AWS S3: HTTP 412, on the PUT and on the completion), and the engine
    looks again. A server that ignores them (rclone serve s3) still has the look: the window there is the
    milliseconds between the HEAD and the commit."""

    def __init__(self, client, bucket, mine):
        self.client, self.bucket, self.mine = client, bucket, int(mine)

    def headers(self):
        return {META: str(self.mine)}

    def condition(self, key, stop=None):
        from remote.lib.retry import retry
        from remote.s3.errors import S3Error

        try:
            seen = retry(lambda: self.client.head(self.bucket, key), stop=stop)  # a stopped shipper waits no more
        except S3Error as exc:
            if exc.status == 404:
                return {"if-none-match": "*"}
            if exc.status == 403:  # credentials that may write but not read: unconditional, as without a guard
                return {}
            raise
        try:
            theirs = int((seen.get(META) or "0").strip())
        except ValueError:
            theirs = 0
        if theirs > self.mine:
            raise Superseded(theirs, self.mine, "%s was written by it, this upload is not sent"
                             % self.client.where(self.bucket, key))
        etag = (seen.get("etag") or "").strip()
        return {"if-match": etag} if etag else {}


def fence(client, bucket, prefix, spec, run_dir):
    """Before a pass uploads: raise Superseded (after stopping the trainer) when a newer generation exists."""
    newer = superseded(client, bucket, prefix, spec)
    if newer is None:
        return
    stop_trainer(run_dir, "superseded by generation %d" % newer)
    raise Superseded(newer, int(spec["generation"]))
