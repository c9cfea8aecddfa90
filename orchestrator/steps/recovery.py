"""Recovery (issue 20): a watcher that holds no state of its own replaces a lost node by a spare, or
relaunches a run whose trainer a signal killed, and the run goes on from its last shipped checkpoint.

Everything that matters is in the run's generation record in S3 (orchestrator.steps.generation,
remote/runs/generation.py) and in the runs on the nodes: the generation, the hosts in rank order, the
restarts so far, the lost hosts, the recovery under way (with its phase) and the watcher's lease. A
watcher killed at any point and started again reads them and goes on from there; it never starts a
second recovery of the same loss, because the recovery is written to the record (compare-and-swap)
before anything is done for it.

``classify`` is the pure decision (tested alone); ``Watcher`` does the rest. What a watcher does, in
order, for one restart (each phase recorded before the next begins):

1. ``stop``: the old generation is stopped on every node that answers, and its last outputs pass
   waited for (so the checkpoint it left ships);
2. ``fence``: the generation number goes up by one: from now on, an old node's shipper refuses to
   upload (it checks before every pass) and stops its trainer;
3. ``parity``: the first healthy spare (lost node only) is provisioned, gets the model and the data
   (the same steps as dfo up, each verified);
4. ``launch``: the new generation starts on the hosts, the spare in the lost node's rank, a fresh
   rendezvous (gangs: the gang preflight and address check first); launch restores the last
   shipped outputs on a node whose outputs.path is empty.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from remote.runs import generation as gen

from ..config.models import LoadedJob, RestartsConfig, expand_targets
from ..errors import EXIT_RUN, EXIT_USAGE, EXIT_VERIFY, DfoError, UsageError, VerifyError
from ..hosts import HostSession
from . import runs
from .generation import Place, launch_fields, place
from .recordauth import RecordForged
from .workspace import job_workspace

POLL_S = float(os.environ.get("DFO_WATCH_POLL_S") or 3.0)  # seconds between looks at the nodes
PROBE_S = 20.0  # a node that has not answered a look within this long is unreachable for that look
LEASE_S = 30.0  # a watcher that has not renewed its lease this long is gone: another may take over
STOP_WAIT_S = 60.0  # how long the old generation's last outputs pass is waited for
S3_PATIENCE_S = 300.0  # S3 unreadable this long: the watcher gives up (exit 3); never a restart for it
# a lost node with no healthy spare: the watcher looks again every 10 s for this long, then the run fails (exit 5)
SPARE_WAIT_S = float(os.environ.get("DFO_WATCH_SPARE_WAIT_S") or 600.0)
SPARE_SAY_S = 60.0  # how often a watcher still waiting for a spare says so
RESUMED = re.compile(r"resum\w*\b.*?\bstep[ =:]*(\d+)", re.I)
# torchrun exits 1 whatever ended a worker; its failure report names the cause: "Root Cause (first observed
# failure):" then "exitcode  : -9 (pid: 123)" for a worker killed by SIGKILL
TORCHRUN_ROOT = re.compile(r"Root Cause \(first observed failure\)")
TORCHRUN_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)\b")

Say = Callable[[str], None]


# --------------------------------------------------------------------------- the decision


@dataclass
class Verdict:
    """What the watcher makes of one look at the nodes."""

    kind: str  # ok | done | restart | fail | stopped
    why: str = ""  # restart/fail: lost | signal | exit N; done/stopped/fail: the sentence
    lost_host: str | None = None
    detail: str = ""


def _signal_of(info: runs.RunInfo) -> str | None:
    if info.signal:
        return str(info.signal)
    code = info.exit_code
    if code is not None and 128 < code <= 128 + 64:  # bash -c COMMAND that did not exec: 128 + the signal
        return f"signal {code - 128} (exit {code})"
    if info.state == "lost":
        return "the run's processes vanished (no end recorded)"
    if info.state == "missing":
        return "the node answers but has no such run (a reboot, a wiped disk?)"
    return None


def _cause(hosts: list[str], reach: dict[str, runs.RunInfo]) -> tuple[str, str, str] | None:
    """(host, kind, text) of the first failure: kind signal | exit | stopped | lost; None when none.

    A gang watch's claim about another node counts only from the gang's hub (rank 0, ``hosts[0]``: the
    node every member reports to), and never about a node that answered this look with a live run: a
    member's word that a peer is lost is not evidence (issue 32), and a node's own answer outweighs
    anyone's claim about it."""
    hub = reach.get(hosts[0]) if hosts else None
    ff = ((hub.gang or {}).get("watch") or {}).get("first_failure") if hub is not None else None
    if isinstance(ff, dict) and isinstance(ff.get("host"), str) and ff["host"] in hosts:
        about = reach.get(ff["host"])
        if about is None or about.state not in ("running", "succeeded"):
            how = str(ff.get("how") or "")
            m = re.match(r"exit (\d+)$", how)
            if how == "lost":
                if about is None:  # a node that answered (with any run) is not lost
                    return str(ff["host"]), "lost", "its gang watch declared it lost"
            elif how == "stopped":
                return str(ff["host"]), "stopped", "stopped (dfo stop)"
            elif m:
                code = int(m.group(1))
                if 128 < code <= 192:
                    return str(ff["host"]), "signal", f"signal {code - 128} (exit {code})"
                return str(ff["host"]), "exit", str(code)
            elif how.startswith("signal"):
                return str(ff["host"]), "signal", how
    for h in hosts:
        r = reach.get(h)
        if r is None or r.state in ("running", "succeeded"):
            continue
        if r.state == "stopped":
            continue
        sig = _signal_of(r)
        if sig:
            return h, "signal", sig
        return h, "exit", str(r.exit_code)
    for h in hosts:
        r = reach.get(h)
        if r is not None and r.state == "stopped":
            return h, "stopped", "stopped (dfo stop)"
    return None


def classify(hosts: list[str], results: dict[str, runs.RunInfo | None], unreachable_for: dict[str, float],
             policy: RestartsConfig) -> Verdict:
    """One look: ``results`` maps each host of the generation to its run (None: the host did not answer),
    ``unreachable_for`` to the seconds it has not answered in a row. A transient SSH error is never a
    restart: a host counts as lost only after ``policy.lost_after`` seconds without an answer, or when
    its gang watch says so."""
    reach = {h: r for h, r in results.items() if r is not None}
    lost = next((h for h in hosts if results.get(h) is None and unreachable_for.get(h, 0.0) >= policy.lost_after),
                None)
    cause = _cause(hosts, reach)
    if lost is None and cause is not None and cause[1] == "lost" and cause[0] in hosts:
        lost = cause[0]
    if lost is not None:
        why = (f"{lost}: unreachable for {unreachable_for.get(lost, 0):.0f}s" if results.get(lost) is None
               else f"{lost}: its gang watch declared it lost")
        if "lost" in policy.on:
            return Verdict("restart", "lost", lost, why)
        return Verdict("fail", "lost", lost, f"{why}, and restarts.on has no 'lost'")
    if len(reach) < len(hosts):
        return Verdict("ok", detail="waiting for " + ", ".join(h for h in hosts if h not in reach))
    if all(reach[h].state == "succeeded" for h in hosts):
        return Verdict("done", detail="every node's run succeeded")
    if cause is None:
        return Verdict("ok")
    host, kind, text = cause
    if kind == "stopped":
        return Verdict("stopped", detail=f"{host}: the run was stopped by hand; not restarted")
    if kind == "signal":
        code = reach[host].exit_code if host in reach else None
        if "signal" in policy.on or (code is not None and code in policy.on):
            return Verdict("restart", "signal", None, f"{host}: trainer killed by {text}")
        return Verdict("fail", "signal", None, f"{host}: trainer killed by {text}; restarts.on has no 'signal'")
    code = int(text) if text.isdigit() else None
    if code is not None and code in policy.on:
        return Verdict("restart", f"exit {code}", None, f"{host}: trainer exited {code} (listed in restarts.on)")
    return Verdict("fail", f"exit {text}", None, f"{host}: trainer exited {text}: a failure of its own, "
                   "not restarted (list the exit code in run.restarts.on to restart on it)")


def torchrun_root_cause(lines: list[str]) -> int | None:
    """The exit code of the root cause in the last failure report torchrun printed in ``lines`` (negative:
    the worker was killed by that signal); None when there is none."""
    code: int | None = None
    in_root = False
    for text in lines:
        if TORCHRUN_ROOT.search(text):
            in_root, code = True, None
            continue
        m = TORCHRUN_EXITCODE.match(text)
        if m and in_root:
            code, in_root = int(m.group(1)), False
    return code


# How likely a worker's signal is the gang's root cause rather than an echo of it (lower: likelier; any
# signal not named here ranks 1)
_SIGNAL_RANK: dict[int, int] = {signal.SIGKILL: 0, signal.SIGABRT: 2, signal.SIGTERM: 3}


def backoff_s(policy: RestartsConfig, done: int) -> float:
    """Seconds before restart number ``done`` + 1: backoff, doubled each time."""
    return float(policy.backoff) * (2 ** done)


# --------------------------------------------------------------------------- the watcher


@dataclass
class Probe:
    """A look at one host, in its own thread: a host that does not answer holds back nobody."""

    thread: threading.Thread
    box: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)


class Watcher:
    """``run()`` watches the job's current lineage until it succeeds, fails for good or is stopped."""

    def __init__(self, inventory: str | os.PathLike[str] | None, loaded: LoadedJob, targets: list[str],
                 run: str | None = None, say: Say = print, poll_s: float = POLL_S) -> None:
        from ..config.models import load_inventory

        job = loaded.job
        if job.run is None or not job.run.recovers:
            raise UsageError(f"{loaded.path}: dfo watch needs run.spares or run.restarts in the job",
                             hint="add run: {spares: [HOST], restarts: {max: 3}} (docs/recovery.md)")
        self.loaded, self.job, self.run_arg, self.say, self.poll_s = loaded, job, run, say, poll_s
        self.inventory_arg = inventory
        self.inv, self.inv_path = load_inventory(inventory)
        self.targets = expand_targets(self.inv, targets, self.inv_path)
        self.spares = expand_targets(self.inv, job.run.spares, self.inv_path) if job.run.spares else []
        self.policy = job.run.restart_policy
        self.place: Place = place(loaded)
        self.me = {"id": uuid.uuid4().hex[:12], "host": socket.gethostname(), "pid": os.getpid()}
        self.since: dict[str, float] = {}  # host -> when it first did not answer (this watcher's own view)
        self.probes: dict[str, Probe] = {}
        self.lease_etag: str | None = None
        self.lease_done, self.lease_lost = threading.Event(), threading.Event()
        self.no_spare_said = -SPARE_SAY_S  # when this watcher last said it waits for a spare (monotonic)
        # per lineage: the most restarts and the highest generation of any record this watcher has verified
        # (a record, even a signed one, that goes below them is refused: restarts.max always ends a loop)
        self.high: dict[str, tuple[int, int]] = {}

    # ------------------------------------------------------------------ the record
    def _read(self) -> tuple[dict[str, Any], str | None]:
        doc, etag = self.place.read()  # checked: this machine's key signed it, and it is not an old one
        if doc is None:
            raise UsageError(f"job {self.job.name}: no generation record at {self.place.url}",
                             hint="launch the run with dfo up -H HOSTS -j JOB (add --watch to watch it at once)")
        return self._vet(doc), etag

    def _vet(self, doc: dict[str, Any]) -> dict[str, Any]:
        """A verified record, held to what this watcher knows whatever it says (issue 32): every host it names
        is one of the job's targets (-H) or spares (run.spares), a spare chosen is one of run.spares, and
        neither the restart count nor the generation goes below what this watcher has seen of the lineage."""
        url = self.place.url
        allowed = set(self.targets) | set(self.spares)

        def names(v: Any, field: str, within: set[str], what: str) -> None:
            if v is None:
                return
            if not isinstance(v, list) or not all(isinstance(h, str) for h in v):
                raise RecordForged(f"record {url}: field {field} is not a list of host names; not obeyed")
            bad = [h for h in v if h not in within]
            if bad:
                raise RecordForged(
                    f"record {url}: field {field} names {', '.join(sorted(set(bad)))[:200]}: {what}; not obeyed",
                    hint="the watcher acts only on the hosts given with -H and the job's run.spares: name every host "
                         "of the run with -H (dfo status -H HOST -j JOB shows them)")

        names(doc.get("hosts"), "hosts", allowed, "neither a target of this watch (-H) nor a spare (run.spares)")
        rec = doc.get("recovery")
        if rec is not None:
            if not isinstance(rec, dict):
                raise RecordForged(f"record {url}: field recovery is not an object; not obeyed")
            for field in ("hosts", "old_hosts"):
                names(rec.get(field), f"recovery.{field}", allowed,
                      "neither a target of this watch (-H) nor a spare (run.spares)")
            if rec.get("lost_host") is not None:
                names([rec["lost_host"]], "recovery.lost_host", allowed,
                      "neither a target of this watch (-H) nor a spare (run.spares)")
            if rec.get("spare") is not None:
                names([rec["spare"]], "recovery.spare", set(self.spares), "not one of the job's run.spares")
            for field in ("generation", "old_generation"):
                if not _whole(rec.get(field)):
                    raise RecordForged(f"record {url}: field recovery.{field} is {rec.get(field)!r}, not a whole "
                                       "number; not obeyed")
        restarts, number = doc.get("restarts") or [], doc.get("generation")
        if not isinstance(restarts, list) or not all(isinstance(r, dict) for r in restarts):
            raise RecordForged(f"record {url}: field restarts is not a list of objects; not obeyed")
        if not isinstance(number, int) or not _whole(number):
            raise RecordForged(f"record {url}: field generation is {number!r}, not a whole number; not obeyed")
        generation = number
        lineage = str(doc.get("lineage") or "")
        most, highest = self.high.get(lineage, (0, 0))
        if len(restarts) < most or int(generation) < highest:
            raise RecordForged(f"record {url}: run {lineage} went back to generation {generation} with "
                               f"{len(restarts)} restart(s), after this watcher saw generation {highest} with "
                               f"{most}; not obeyed")
        self.high[lineage] = (len(restarts), int(generation))
        return doc

    def _write(self, doc: dict[str, Any], etag: str | None) -> tuple[dict[str, Any], str | None]:
        if self.lease_lost.is_set():
            raise UsageError(f"run {doc.get('lineage')}: another watcher took it over", hint="one watcher per run")
        return self.place.write(dict(doc, watcher=dict(self.me)), etag)

    def _claim(self) -> tuple[dict[str, Any], str | None]:
        """Take the watcher's lease (its own object beside the record, renewed by a thread every LEASE_S / 3
        whatever the watcher is doing), or refuse when another live watcher holds it."""
        doc, etag = self._read()
        if self.run_arg and self.run_arg not in (doc.get("lineage"), doc.get("run")):
            raise UsageError(f"run {self.run_arg}: the generation record of job {self.job.name} names run "
                             f"{doc.get('lineage')} (generation {doc.get('generation')}: {doc.get('run')})",
                             hint="watch that run, or leave RUN out")
        for _ in range(6):
            w, lease_etag = self.place.read(gen.LEASE_KEY)
            if w and w.get("id") != self.me["id"] and not self._gone(w):
                raise UsageError(f"run {doc.get('lineage')}: another watcher holds it (pid {w.get('pid')} on "
                                 f"{w.get('host')}, seen {time.time() - float(w.get('beat') or 0):.0f}s ago)",
                                 hint=f"one watcher per run; stop that one first, or wait {LEASE_S:.0f}s after it "
                                      "ended")
            try:
                _, self.lease_etag = self.place.write(dict(self.me, beat=time.time()), lease_etag, gen.LEASE_KEY)
            except gen.Conflict:
                continue
            threading.Thread(target=self._renew, daemon=True, name="dfo-watch-lease").start()
            return self._read()
        raise VerifyError(f"watcher lease {self.place.url}: it kept changing while this watcher tried to take it")

    def _renew(self) -> None:
        """The lease, renewed every LEASE_S / 3 until released; a write refused means another watcher took it."""
        while not self.lease_done.wait(LEASE_S / 3):
            try:
                _, self.lease_etag = self.place.write(dict(self.me, beat=time.time()), self.lease_etag,
                                                      gen.LEASE_KEY)
            except gen.Conflict:
                self.lease_lost.set()
                return
            except DfoError:
                continue  # S3 did not answer: the next renewal tries again

    def _gone(self, w: dict[str, Any]) -> bool:
        if not w.get("beat") or time.time() - float(w.get("beat") or 0) > LEASE_S:
            return True
        if w.get("host") == self.me["host"] and w.get("pid"):  # this machine's: is that process still there?
            try:
                os.kill(int(w["pid"]), 0)
            except ProcessLookupError:
                return True
            except OSError:
                return False
        return False

    # ------------------------------------------------------------------ the nodes
    def session(self, names: list[str]) -> HostSession:
        return HostSession.from_inventory(self.inv, self.inv_path, names)

    def _ws(self, sess: HostSession, host: str) -> str | None:
        return job_workspace(self.job, sess.hosts[host].workspace)

    def look(self, hosts: list[str], run_id: str) -> dict[str, runs.RunInfo | None]:
        """Each host's run ``run_id`` (None: the host did not answer within PROBE_S, or has no such run)."""
        for h in hosts:
            p = self.probes.get(h)
            if p is not None and p.thread.is_alive():
                continue  # the last look is still hanging there: it counts as no answer

            def one(h: str = h, box: dict[str, Any] | None = None) -> None:
                assert box is not None
                try:
                    with self.session([h]) as sess:
                        found = runs.status(sess.conn(h), self._ws(sess, h), run=run_id, job=self.job.name)
                    box["info"] = found[0] if found else None
                except DfoError as exc:
                    box["error"] = exc

            box: dict[str, Any] = {}
            t = threading.Thread(target=one, kwargs={"box": box}, daemon=True, name=f"dfo-watch-{h}")
            self.probes[h] = Probe(t, box)
            t.start()
        deadline = time.monotonic() + PROBE_S
        for h in hosts:
            self.probes[h].thread.join(max(0.0, deadline - time.monotonic()))
        out: dict[str, runs.RunInfo | None] = {}
        now = time.monotonic()
        for h in hosts:
            box = self.probes[h].box
            info = box.get("info")
            err = box.get("error")
            if err is not None and err.exit_code == EXIT_USAGE:  # it answered: no such run there (any more)
                info, box = runs.RunInfo(id=run_id, state="missing"), {"info": True}
            if "info" in box and info is not None:
                out[h] = info
                self.since.pop(h, None)
            else:
                out[h] = None
                if "error" in box and self.since.get(h) is None:
                    self.say(f"watch: {h}: no answer ({box['error'].message}); lost after "
                             f"{self.policy.lost_after:.0f}s without one")
                self.since.setdefault(h, min(now, self.probes[h].started))  # silent since the look began
        return out

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        doc, etag = self._claim()
        self.say(f"watch: run {doc.get('lineage')} generation {doc.get('generation')} ({doc.get('run')}) on "
                 f"{', '.join(doc.get('hosts') or [])}; spares: {', '.join(self.spares) or 'none'}; "
                 f"restarts {len(doc.get('restarts') or [])}/{self.policy.max}")
        lineage = doc.get("lineage")
        s3_down: float | None = None  # since when S3 has not answered (a transient error is waited out)
        try:
            while True:
                try:
                    doc, etag = self._read()
                    s3_down = None
                except RecordForged:
                    raise  # never waited out, never obeyed: exit 3, nothing done on any node
                except VerifyError as exc:
                    s3_down = s3_down or time.monotonic()
                    if time.monotonic() - s3_down > S3_PATIENCE_S:
                        raise
                    self.say(f"watch: {exc.message}; trying again (the run is not touched meanwhile)")
                    time.sleep(max(self.poll_s, 5.0))
                    continue
                if doc.get("lineage") != lineage:
                    self.say(f"watch: a new launch of job {self.job.name} replaced run {lineage} "
                             f"(now {doc.get('lineage')}); this watcher ends")
                    self._release()
                    return 0
                if self.lease_lost.is_set():
                    raise UsageError(f"run {lineage}: another watcher took it over", hint="one watcher per run")
                state = doc.get("state")
                if state in ("succeeded", "failed", "stopped"):
                    return self._ended(doc, etag)
                try:
                    if doc.get("recovery"):
                        doc, etag = self.recover(doc, etag)
                        continue
                    code = self.check(doc, etag)
                except RecordForged:
                    raise
                except VerifyError as exc:  # S3 did not take a write: the record says where things stand
                    self.say(f"watch: {exc.message}; trying again")
                    time.sleep(max(self.poll_s, 5.0))
                    continue
                if code is not None:
                    return code
                time.sleep(self.poll_s)
        except KeyboardInterrupt:
            self._release()
            self.say("watch: interrupted; the run goes on unwatched (dfo watch starts watching it again)")
            return 130
        finally:
            self.lease_done.set()  # (released above, or left to run out: LEASE_S, or at once for this machine)

    def _ended(self, doc: dict[str, Any], etag: str | None) -> int:
        self._release(doc, etag)
        state = doc.get("state")
        why = f": {doc.get('why')}" if doc.get("why") else ""
        self.say(f"watch: run {doc.get('lineage')} {state} at generation {doc.get('generation')} "
                 f"after {len(doc.get('restarts') or [])} restart(s){why}")
        return 0 if state == "succeeded" else EXIT_RUN

    def _release(self, doc: dict[str, Any] | None = None, etag: str | None = None) -> None:
        """The lease handed back (beat 0): another watcher may start at once."""
        self.lease_done.set()
        if self.lease_lost.is_set():
            return
        try:
            self.place.write(dict(self.me, beat=0), self.lease_etag, gen.LEASE_KEY)
        except (DfoError, gen.Conflict):
            pass

    def check(self, doc: dict[str, Any], etag: str | None) -> int | None:
        """One look at the nodes of the current generation; a recovery is recorded (not done) here."""
        hosts = list(doc.get("hosts") or [])
        results = self.look(hosts, str(doc.get("run")))
        now = time.monotonic()
        unreachable = {h: now - t for h, t in self.since.items()}
        v = classify(hosts, results, unreachable, self.policy)
        if v.kind == "fail" and v.why == "exit 1" and self.job.run is not None and self.job.run.launcher == "torchrun":
            v = self._torchrun_worker_signal(hosts, str(doc.get("run")), results, v)
        self._note_resumed(doc, etag, results)
        if v.kind == "ok":
            return None
        if v.kind in ("done", "stopped", "fail"):
            state = {"done": "succeeded", "stopped": "stopped", "fail": "failed"}[v.kind]
            code = 0
            results = self._last_passes(hosts, str(doc.get("run")), results)
            if v.kind == "done":
                failed = [h for h, r in results.items() if r is not None and r.outputs_failed()]
                if failed:
                    code = EXIT_VERIFY
                    v.detail += f"; the last outputs pass failed on {', '.join(failed)}"
            try:
                doc, etag = self._write(dict(doc, state=state, why=v.detail), etag)
            except gen.Conflict:
                return None
            self.say(f"watch: {v.detail}")
            return self._ended(doc, etag) or code
        done = len(doc.get("restarts") or [])
        if done >= self.policy.max:
            self.say(f"watch: {v.detail}; restarts.max ({self.policy.max}) reached: the run fails for good")
            try:
                doc, etag = self._write(dict(doc, state="failed", why=f"{v.detail}; restarts.max reached"), etag)
            except gen.Conflict:
                return None
            return self._ended(doc, etag)
        new_gen = int(doc.get("generation") or 0) + 1
        wait = backoff_s(self.policy, done)
        rec = {"generation": new_gen, "run": f"{doc.get('lineage')}.g{new_gen}", "why": v.why,
               "detail": v.detail, "lost_host": v.lost_host, "spare": None, "old_run": doc.get("run"),
               "old_hosts": hosts, "old_generation": doc.get("generation"), "at": _iso(), "at_ts": time.time(),
               "not_before": time.time() + wait, "phase": "stop"}
        try:
            self._write(dict(doc, state="recovering", recovery=rec), etag)
        except gen.Conflict:
            return None
        self.say(f"watch: {v.detail}: restart {done + 1}/{self.policy.max} as generation {new_gen}"
                 + (f" after {wait:.0f}s (backoff)" if wait else ""))
        return None

    def _torchrun_worker_signal(self, hosts: list[str], run_id: str, results: dict[str, runs.RunInfo | None],
                                v: Verdict) -> Verdict:
        """torchrun exited 1: was the root cause a worker killed by a signal (the OOM killer's SIGKILL)? The
        failure report at the end of a node's log says so: the first failure's node first, then the other
        nodes that ended (their workers fail on their own when the collective breaks, and may be reported
        first; or the gang watch stopped the node whose worker was killed before its torchrun ended).
        Then it is a signal, as for a trainer run without torchrun. Anything else stays as it was.

        Which node's signal: a SIGKILL first (the OOM killer's, or a user's; a broken collective never sends
        one), then any other signal, then SIGABRT (what a worker does when its peer vanishes: gloo and NCCL
        abort), then SIGTERM (what the gang watch sends); among equals, the first failure's node first."""
        cause = _cause(hosts, {h: r for h, r in results.items() if r is not None})
        ended = [h for st in ("failed", "stopped") for h, r in results.items() if r is not None and r.state == st]
        order = ([cause[0]] if cause else []) + [h for h in ended if not cause or h != cause[0]]
        best: tuple[int, str, int] | None = None
        for host in order:
            code = self._torchrun_root_cause(host, run_id)
            if code is None or code >= 0:
                continue
            rank = _SIGNAL_RANK.get(-code, 1)
            if best is None or rank < best[0]:
                best = (rank, host, code)
            if rank == 0:
                break
        if best is None:
            return v
        _, host, code = best
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"{name} (a worker of torchrun, which exited 1)"
        if "signal" in self.policy.on:
            return Verdict("restart", "signal", None, f"{host}: trainer killed by {text}")
        return Verdict("fail", "signal", None, f"{host}: trainer killed by {text}; restarts.on has no 'signal'")

    def _torchrun_root_cause(self, host: str, run_id: str) -> int | None:
        """torchrun_root_cause of the run's log (its last 400 lines) on ``host``; None when it did not answer."""
        lines: list[str] = []
        try:
            with self.session([host]) as sess:
                runs.read_lines(sess.conn(host), self._ws(sess, host), run_id, 400, lines.append, job=self.job.name)
        except DfoError:
            return None
        return torchrun_root_cause(lines)

    def _last_passes(self, hosts: list[str], run_id: str, results: dict[str, runs.RunInfo | None]
                     ) -> dict[str, runs.RunInfo | None]:
        """The runs once their last outputs pass has finished (or STOP_WAIT_S passed): the end is told
        only when what the trainer left is in S3."""
        deadline = time.monotonic() + STOP_WAIT_S
        while time.monotonic() < deadline:
            busy = [h for h, r in results.items() if r is not None and r.state != "running" and r.outputs
                    and r.outputs.get("state") not in ("done", "failed")]
            if not busy:
                break
            time.sleep(1.0)
            results.update({h: r for h, r in self.look(busy, run_id).items() if r is not None})
        return results

    # ------------------------------------------------------------------ one recovery, phase by phase
    def recover(self, doc: dict[str, Any], etag: str | None) -> tuple[dict[str, Any], str | None]:
        rec = dict(doc["recovery"])
        phase = rec.get("phase")
        if phase == "stop":
            self.say(f"watch: stopping generation {rec['old_generation']} ({rec['old_run']}) where it still runs")
            self._stop_old(rec)
            rec["phase"] = "wait"
        elif phase == "wait":  # the backoff, in slices: the lease is renewed meanwhile
            left = float(rec.get("not_before") or 0) - time.time()
            if left > 0:
                time.sleep(min(left, self.poll_s))
                if left > self.poll_s:
                    return doc, etag
            rec["phase"] = "fence"
        elif phase == "fence":
            # from here on, an old node's shipper refuses to upload and stops its trainer
            return self._advance(dict(doc, generation=rec["generation"],
                                      lost=sorted(set(doc.get("lost") or []) | ({rec["lost_host"]} if rec.get(
                                          "lost_host") else set()))), dict(rec, phase="parity"), etag)
        elif phase == "parity":
            hosts = list(rec["old_hosts"])
            if rec.get("lost_host"):
                spare = rec.get("spare") or self._pick_spare(doc, hosts)
                if spare is None:
                    return self._no_spare(doc, rec, etag, hosts)
                if rec.get("spare") != spare:  # recorded before any work is done on it
                    return self._advance(doc, dict(rec, spare=spare), etag)
                hosts[hosts.index(rec["lost_host"])] = spare
                if not self._parity(spare, hosts):
                    bad = sorted(set(doc.get("bad_spares") or []) | {spare})
                    return self._advance(dict(doc, bad_spares=bad), dict(rec, spare=None), etag)
            rec["hosts"] = hosts
            rec["phase"] = "launch"
        elif phase == "launch":
            return self._launch(doc, rec, etag)
        return self._advance(doc, rec, etag)

    def _no_spare(self, doc: dict[str, Any], rec: dict[str, Any], etag: str | None, hosts: list[str]
                  ) -> tuple[dict[str, Any], str | None]:
        """No spare answered: look again every 10 s (a spare may come back), saying so every SPARE_SAY_S,
        for SPARE_WAIT_S from the first miss (recorded: a restarted watcher does not wait anew); then, or
        at once when no spare is left to try (each in the gang, lost, or set aside after a failed parity),
        the run fails. The record stays at the fenced generation: the old nodes upload nothing more."""
        lost = rec.get("lost_host")
        out = {s: "in the gang" for s in hosts}
        out.update({s: "lost" for s in doc.get("lost") or []})
        out.update({s: "set aside after a failed parity" for s in doc.get("bad_spares") or []})
        left = [s for s in self.spares if s not in out]
        since = float(rec.get("no_spare_since") or 0)
        if left and (not since or time.time() - since < SPARE_WAIT_S):
            if not since:
                since = time.time()
                doc, etag = self._advance(doc, dict(rec, no_spare_since=since), etag)
            now = time.monotonic()
            if now - self.no_spare_said >= SPARE_SAY_S:
                self.no_spare_said = now
                self.say(f"watch: no healthy spare for {lost} yet ({', '.join(left)} not answering); looking "
                         f"again every {max(self.poll_s, 10):.0f}s, for {SPARE_WAIT_S - (time.time() - since):.0f}s "
                         "more, then the run fails")
            time.sleep(max(self.poll_s, 10))
            return doc, etag
        if left:
            why = f"{lost} lost and no healthy spare within {SPARE_WAIT_S:.0f}s ({', '.join(left)} not answering)"
        elif self.spares:
            why = f"{lost} lost and no spare left to try (" + ", ".join(f"{s}: {out[s]}" for s in self.spares) + ")"
        else:
            why = f"{lost} lost and run.spares is empty"
        dest = f"s3://{self.place.bucket}/{self.place.prefix}"
        self.say(f"watch: {why}: the run fails; its last checkpoint stays in {dest} (dfo up on healthy hosts "
                 "resumes from it)")
        try:
            return self._write(dict(doc, state="failed", why=why, recovery=dict(rec, phase="gave-up")), etag)
        except gen.Conflict:
            return self._read()

    def _advance(self, doc: dict[str, Any], rec: dict[str, Any], etag: str | None
                 ) -> tuple[dict[str, Any], str | None]:
        try:
            return self._write(dict(doc, recovery=rec), etag)
        except gen.Conflict:
            return self._read()

    def _stop_old(self, rec: dict[str, Any]) -> None:
        """Stop the old generation on every node that answers; wait for its last outputs pass."""
        old = [h for h in rec["old_hosts"] if h != rec.get("lost_host")]
        grace = min(self.job.run.stop_grace if self.job.run else 30.0, 30.0)

        def one(conn: Any) -> None:
            ws = job_workspace(self.job, conn.host.workspace)
            info = runs.stop(conn, ws, str(rec["old_run"]), grace=grace, job=self.job.name, outputs_wait=STOP_WAIT_S)
            deadline = time.monotonic() + STOP_WAIT_S
            while time.monotonic() < deadline:  # a run that had ended already: its last pass may be under way
                o = info.outputs or {}
                if o.get("state") in ("done", "failed") or not o:
                    return
                time.sleep(1.0)
                info = runs.status(conn, ws, run=str(rec["old_run"]), job=self.job.name)[0]

        if not old:
            return
        with self.session(old) as sess:
            for o in sess.each(one):
                if o.error is not None:
                    self.say(f"watch: {o.host}: could not stop {rec['old_run']} ({o.error.message}); its shipper "
                             "stops uploading once it sees the new generation")

    def _pick_spare(self, doc: dict[str, Any], hosts: list[str]) -> str | None:
        """The first spare that answers and is neither in the gang, lost before, nor failed parity."""
        skip = set(hosts) | set(doc.get("lost") or []) | set(doc.get("bad_spares") or [])
        for s in self.spares:
            if s in skip:
                continue
            try:
                with self.session([s]) as sess:
                    conn = sess.conn(s)
                    conn.run("true", timeout=PROBE_S)
                return s
            except DfoError as exc:
                self.say(f"watch: spare {s} does not answer ({exc.message}); trying the next one")
        return None

    def _parity(self, spare: str, hosts: list[str]) -> bool:
        """provision, stage-model, sync-data on the spare (each a no-op when it is ready already)."""
        from .health import gate_spare
        from .provision import provision
        from .transfer import build_request, transfer

        self.say(f"watch: bringing spare {spare} to parity (provision, stage-model, sync-data)")
        t0 = time.monotonic()
        try:
            with self.session([spare]) as sess:
                conn = sess.conn(spare)
                rep = provision(conn, self.loaded)
                if not rep.ok:
                    self.say(f"watch: spare {spare}: provision failed: {(rep.error or {}).get('message')}")
                    return False
                for what in ("model", "data"):
                    if getattr(self.job, what) is not None:
                        transfer(conn, self.loaded, what, build_request(self.loaded, what))
                if not gate_spare(conn, self.loaded, self.say):  # run.health: a spare that fails it is set aside
                    return False
        except DfoError as exc:
            self.say(f"watch: spare {spare}: {exc.message}; it is set aside")
            return False
        self.say(f"watch: spare {spare} ready in {time.monotonic() - t0:.1f}s")
        return True

    def _launch(self, doc: dict[str, Any], rec: dict[str, Any], etag: str | None
                ) -> tuple[dict[str, Any], str | None]:
        from .gang import is_gang, prepare

        hosts, run_id = list(rec["hosts"]), str(rec["run"])
        fields = dict(launch_fields(dict(doc, generation=rec["generation"])), record=self.place.url)
        entry = {"at": rec["at"], "why": rec["why"], "detail": rec.get("detail"), "lost_host": rec.get("lost_host"),
                 "spare": rec.get("spare"), "resumed_step": None, "generation": rec["generation"],
                 "at_ts": rec.get("at_ts")}
        fields["restarts"] = list(doc.get("restarts") or []) + [entry]
        with self.session(hosts) as sess:
            existing = self.look(hosts, run_id)
            # a watcher killed after the launch finds the new run here, and does not launch it twice
            if not any(v is not None and v.state != "missing" for v in existing.values()):
                plan = None
                if is_gang(self.job):
                    try:
                        plan = prepare(sess, self.job, run_id)
                    except DfoError as exc:
                        self.say(f"watch: gang preflight of generation {rec['generation']}: {exc.message}; "
                                 f"trying again in {max(self.poll_s, 10):.0f}s")
                        time.sleep(max(self.poll_s, 10))
                        return doc, etag
                    plan.generation = fields

                def one(conn: Any) -> runs.RunInfo:
                    return runs.launch(conn, self.loaded, run_id=run_id, gang=plan, generation=fields)

                outs = sess.each(one)
                bad = [o for o in outs if o.error is not None]
                for o in bad:
                    assert o.error is not None
                    self.say(f"watch: launch on {o.host} failed: {o.error.message}")
                if bad:
                    for o in outs:  # a gang starts on every node or on none
                        if o.value is not None:
                            runs.stop(sess.conn(o.host), self._ws(sess, o.host), o.value.id, grace=10,
                                      job=self.job.name)
                    time.sleep(max(self.poll_s, 10))
                    return doc, etag
                for o in outs:
                    if o.value is not None and o.value.restore:
                        self.say(f"watch: {o.host}: restore: {o.value.restore.get('fetched')} file(s) from "
                                 f"{o.value.restore.get('source')}")
        restarts = fields["restarts"][:-1] + [dict(entry, launched_ts=time.time())]
        new = dict(doc, state="running", run=run_id, hosts=hosts, generation=rec["generation"],
                   restarts=restarts, recovery=None)
        try:
            written, etag2 = self._write(new, etag)
        except gen.Conflict:
            return self._read()
        self.since.clear()
        self.say(f"watch: generation {rec['generation']} ({run_id}) started on {', '.join(hosts)}"
                 + (f": {rec['spare']} took {rec['lost_host']}'s place" if rec.get("spare") else ""))
        return written, etag2

    def _note_resumed(self, doc: dict[str, Any], etag: str | None, results: dict[str, runs.RunInfo | None]) -> None:
        """The newest restart's resumed_step, from the trainer's own words in the new run's first lines."""
        rs = list(doc.get("restarts") or [])
        if not rs or rs[-1].get("resumed_step") is not None or rs[-1].get("generation") != doc.get("generation"):
            return
        if time.time() - float(rs[-1].get("at_ts") or 0) > 600:
            return  # the trainer did not say where it resumed: leave it unknown
        hosts = list(doc.get("hosts") or [])
        if not hosts or results.get(hosts[0]) is None:
            return
        found: list[int] = []

        def on_line(text: str) -> None:
            m = RESUMED.search(text)
            if m and not found:
                found.append(int(m.group(1)))

        try:
            with self.session(hosts[:1]) as sess:
                runs.read_lines(sess.conn(hosts[0]), self._ws(sess, hosts[0]), str(doc.get("run")), "+1", on_line,
                                job=self.job.name)
        except DfoError:
            return
        if found:
            rs[-1] = dict(rs[-1], resumed_step=found[0])
            try:
                self._write(dict(doc, restarts=rs), etag)
                self.say(f"watch: generation {doc.get('generation')} resumed at step {found[0]}")
            except gen.Conflict:
                pass


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --------------------------------------------------------------------------- tail across restarts


def _of_lineage(doc: dict[str, Any] | None, followed: str) -> bool:
    lineage = str((doc or {}).get("lineage") or "")
    return bool(lineage) and (followed == lineage or followed.startswith(f"{lineage}.g"))


def replaced(loaded: LoadedJob, followed: str) -> str | None:
    """Why the run ``followed`` is being replaced or was (its record recovering, or a newer generation
    running), or None. For a tail whose node went silent: no use waiting for that node."""
    doc, _ = place(loaded).read()
    if not doc or not _of_lineage(doc, followed):
        return None
    if doc.get("state") == "recovering":
        return "the watcher is recovering the run"
    if doc.get("state") == "running" and doc.get("run") != followed:
        return f"generation {doc.get('generation')} of the run started (run {doc.get('run')})"
    return None


def next_generation(loaded: LoadedJob, followed: str, ended_ok: bool, wait_s: float = 180.0
                    ) -> dict[str, Any] | None:
    """The generation record once a newer generation of the run ``followed`` has started (tail goes on
    there), or None: no newer one, the run ended for good, or no live watcher to start one. While a
    watcher holds the run and is (or may be about to be) recovering it, this waits, up to ``wait_s``."""
    where = place(loaded)
    deadline = time.monotonic() + wait_s
    while True:
        doc, _ = where.read()
        if not doc:
            return None
        if not _of_lineage(doc, followed):
            return None  # another lineage (a new launch) or a job without one
        if doc.get("run") != followed and doc.get("state") == "running":
            return doc
        if doc.get("state") in ("succeeded", "failed", "stopped"):
            return None
        w, _ = where.read(gen.LEASE_KEY)
        alive = bool(w) and time.time() - float((w or {}).get("beat") or 0) <= LEASE_S
        if (ended_ok and doc.get("state") != "recovering") or not alive or time.monotonic() > deadline:
            return None
        time.sleep(2.0)
