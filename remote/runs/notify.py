"""Alerts with no controller (python3 3.8+, stdlib only): the supervisor posts a Slack-compatible JSON
message to the job's notify.webhook when the run ends (succeeded, failed, stopped) or its GPUs sit idle.

The webhook URL is a secret: it reaches the supervisor in its stdin spec (like the S3 keys reach the
shipper) and lives only in this process's memory; RUN_DIR/notify.jsonl records each message's event,
whether it was delivered, the attempts and the HTTP status or error class, never the URL.

The message: ``{"text": "dfo: run R on HOST failed (exit code 1) after 0:05:12", "dfo": {...}}``;
``text`` is what Slack (and Mattermost, and Discord's /slack endpoint) shows, ``dfo`` the same facts as
fields for a script. A post is tried up to ``ATTEMPTS`` times (1, 2, 4, 8 s apart, 10 s each).

Idle (dstack's utilization_policy): every GPU under ``idle_util_pct`` for ``idle_minutes`` -> the
``idle`` event; with ``idle_action: stop`` the run is stopped too (stop.json says why), as ``dfo stop``
would: SIGTERM to the trainer's group, SIGKILL after run.stop_grace.
"""
import json
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional

from remote.runs.record import now_iso

NOTIFY_LOG = "notify.jsonl"
ATTEMPTS = 5
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)
EVENTS = ("failed", "lost", "restarted", "succeeded", "stopped", "idle")


def _hms(seconds):
    s = int(max(0, seconds or 0))
    return "%d:%02d:%02d" % (s // 3600, s // 60 % 60, s % 60)


def message(event, meta, extra=None):
    """The Slack-compatible document for ``event`` of the run ``meta``."""
    extra = dict(extra or {})
    facts = {"event": event, "run": meta.get("id"), "job": meta.get("job"), "host": meta.get("host"),
             "started": meta.get("started")}
    facts.update(extra)
    how = ""
    if event in ("failed", "succeeded", "stopped"):
        how = " (%s)" % ("killed by %s" % extra["signal"] if extra.get("signal")
                         else "exit code %s" % extra.get("exit_code"))
    elif event == "restarted":
        how = " (generation %s, after %s%s)" % (extra.get("generation"), extra.get("why") or "?",
                                                 " on %s" % extra["lost_host"] if extra.get("lost_host") else "")
    elif event == "idle":
        how = " (every GPU under %s%% for %s min%s)" % (extra.get("idle_util_pct"), extra.get("idle_minutes"),
                                                       "; stopping it" if extra.get("action") == "stop" else "")
    took = ""
    if meta.get("started_ts"):
        took = " after %s" % _hms((extra.get("ended_ts") or time.time()) - meta["started_ts"])
    text = "dfo: run %s on %s %s%s%s" % (meta.get("id"), meta.get("host") or "?", event, how, took)
    if event == "lost":  # sent by another node of the gang: the lost one cannot speak
        text = "dfo: run %s: node %s lost (silent %ss; seen from %s)%s" % (
            meta.get("id"), extra.get("lost_host") or "?", extra.get("silent_s"), meta.get("host") or "?", took)
    return {"text": text, "dfo": facts}


def post(url, doc, attempts=ATTEMPTS, timeout=10.0, sleep=time.sleep):
    """(delivered, attempts made, last status or error class). Never raises, never names the URL."""
    body = json.dumps(doc).encode()
    last: Any = None
    for n in range(1, attempts + 1):
        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                               "User-Agent": "dfo-notify"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 -- the job's own webhook
                last = resp.status
                if 200 <= resp.status < 300:
                    return True, n, last
        except urllib.error.HTTPError as exc:
            last = exc.code
            if 400 <= exc.code < 500 and exc.code not in (408, 429):
                return False, n, last  # the URL or the message is wrong: trying again will not help
        except Exception as exc:  # noqa: BLE001 -- refused, reset, timed out, bad URL: name the class only
            last = type(exc).__name__
        if n < attempts:
            sleep(BACKOFF_S[min(n - 1, len(BACKOFF_S) - 1)])
    return False, attempts, last


class Notifier(object):
    """Posts in threads of their own (a slow webhook never holds the supervisor); ``wait`` before exiting."""

    def __init__(self, run_dir: str, spec: Optional[Dict[str, Any]], meta: Dict[str, Any]) -> None:
        spec = spec or {}
        self.run_dir, self.meta = run_dir, meta
        self.url: Optional[str] = spec.get("webhook") or None
        self.on = set(spec.get("on") or ("failed", "lost", "restarted", "succeeded", "idle"))
        self.threads: List[threading.Thread] = []
        self.lock = threading.Lock()

    def send(self, event, extra=None):
        if not self.url or event not in self.on:
            return
        doc = message(event, self.meta, extra)
        t = threading.Thread(target=self._send, args=(event, doc), name="dfo-notify", daemon=True)
        self.threads.append(t)
        t.start()

    def _send(self, event, doc):
        t0 = time.time()
        ok, n, last = post(self.url, doc)
        rec = {"event": event, "at": now_iso(t0), "delivered": ok, "attempts": n, "status": last,
               "seconds": round(time.time() - t0, 2)}
        line = (json.dumps(rec, sort_keys=True) + "\n").encode()
        with self.lock:
            fd = os.open(os.path.join(self.run_dir, NOTIFY_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)

    def wait(self, seconds=60.0):
        deadline = time.time() + seconds
        for t in self.threads:
            t.join(max(0.0, deadline - time.time()))


class IdleWatch(object):
    """Feeds on the sampler's sys rows; calls ``on_idle(extra)`` once per idle spell."""

    def __init__(self, util_pct, minutes, action, on_idle):
        self.util_pct, self.seconds, self.action = float(util_pct), float(minutes) * 60.0, action
        self.on_idle = on_idle
        self.since: Optional[float] = None
        self.fired = False

    def feed(self, sample):
        gpus = sample.get("gpus") or []
        utils = [g.get("util") for g in gpus if g.get("util") is not None]
        if not utils:
            return  # no GPU figures: never idle by this rule
        t = float(sample["t"]) if sample.get("t") is not None else time.time()
        if max(utils) >= self.util_pct:
            self.since, self.fired = None, False
            return
        if self.since is None:
            self.since = t
        if not self.fired and t - self.since >= self.seconds:
            self.fired = True
            self.on_idle({"idle_util_pct": self.util_pct, "idle_minutes": self.seconds / 60.0, "action": self.action,
                          "idle_since": now_iso(self.since), "util": utils})
