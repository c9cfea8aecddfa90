"""The run's outputs shipper as the supervisor starts and watches it (python3 3.8+, stdlib only).

``remote.runs.supervisor`` starts ``python3 -m remote.ship.shipper RUN_DIR`` next to the trainer (not in the
trainer's process group: ``dfo stop`` ends the trainer, never the shipper), writes it ONE line on stdin
-- the outputs spec with the credentials -- and keeps that pipe open. Credentials so reach the shipper
by a pipe alone: never argv, an environment, meta.json or the log.

* Whatever the shipper prints goes to the run's log, each line prefixed with ``[dfo outputs] ``.
* If it dies, it is started again (``MAX_RESTARTS`` times in the run, after 1, 2, 4 s) with the spec
  again, which the supervisor therefore keeps in memory until the shipper's last exit (it held the
  trainer's secret environment the same way). Once the budget is spent the supervisor records
  outputs.json as failed ("gave up") and nothing more ships; the run itself goes on.
* ``finish()`` (the trainer ended, end.json written) sends ``final`` and closes the pipe: the shipper
  makes its last pass and exits; outputs.json then says how that went. A shipper that dies during its
  last pass is restarted into a last pass again, within the same budget.
* ``terminate()`` (the supervisor got SIGTERM after the trainer ended) forwards SIGTERM: the shipper
  finishes or aborts its current object, records, and exits; it is not restarted.

RUN_DIR/shipper.json says which process is the shipper (pid + /proc start time, so a reused pid is
never signalled), how many times it was restarted and how each one ended.
"""
import json
import os
import subprocess
import sys
import threading
import time
from typing import Optional

from remote.runs.record import OUTPUTS, SHIPPER, now_iso, proc_stat, read_json, write_json

PREFIX = b"[dfo outputs] "
MAX_RESTARTS = 3
BACKOFF_S = (1.0, 2.0, 4.0)
ENDED = ("done", "failed")


def _described(code):
    return "signal %d" % -code if code < 0 else "exit code %d" % code


class ShipperWatch:
    def __init__(self, run_dir, spec, credentials, log_path):
        self.run_dir = run_dir
        self.public = dict((k, spec.get(k)) for k in ("dest", "path", "every"))
        line = json.dumps(dict(spec, credentials=credentials), separators=(",", ":")) + "\n"
        self._line: Optional[bytes] = line.encode()
        self.log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.lock = threading.Lock()
        self.proc = None
        self.starttime = None
        self.restarts = 0
        self.final = False
        self.terminating = False
        self.exits = []
        self.done = threading.Event()
        self.thread = None

    # ------------------------------------------------------------------ the supervisor's calls

    def start(self):
        self.thread = threading.Thread(target=self._watch, name="shipper-watch", daemon=True)
        self.thread.start()

    def finish(self):
        """The trainer ended: ask for the last pass (now, or as soon as a restarted shipper is up)."""
        with self.lock:
            self.final = True
            proc = self.proc
            if proc is not None and proc.poll() is None:
                self._send_final(proc)
                self._record(proc.pid, self.starttime, False)  # final_sent: `ship` now waits for this pass

    def terminate(self):
        """Forward a SIGTERM (called from a signal handler: no lock taken)."""
        self.terminating = True
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.terminate()
            except OSError:
                pass

    def wait(self):
        while not self.done.wait(0.5):
            pass

    # ------------------------------------------------------------------ inside

    def _say(self, text):
        try:
            os.write(self.log_fd, PREFIX + text.encode("utf-8", "replace") + b"\n")
        except OSError:
            pass

    def _send_final(self, proc):
        try:
            proc.stdin.write(b"final\n")
            proc.stdin.flush()
        except (OSError, ValueError):
            pass  # it is dying: the watcher restarts it into a last pass
        try:
            proc.stdin.close()
        except (OSError, ValueError):
            pass

    def _spawn(self):
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "remote.ship.shipper", self.run_dir], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, close_fds=True,
            )
        except OSError as exc:
            self._say("could not start the shipper: %s" % exc)
            return None
        assert proc.stdin is not None and self._line is not None  # PIPE; the line stays until the watch ends
        try:
            proc.stdin.write(self._line)
            proc.stdin.flush()
        except OSError:
            pass  # it died at once; its exit is seen below
        st = proc_stat(proc.pid)
        self.starttime = st[2] if st else None
        self._record(proc.pid, self.starttime, False)
        return proc

    def _relay(self, proc):
        for line in iter(proc.stdout.readline, b""):
            try:
                os.write(self.log_fd, PREFIX + line.rstrip(b"\n") + b"\n")
            except OSError:
                pass
        proc.stdout.close()

    def _record(self, pid, starttime, gave_up):
        write_json(os.path.join(self.run_dir, SHIPPER), {
            "pid": pid, "starttime": starttime, "restarts": self.restarts, "exits": self.exits[-10:],
            "final_sent": self.final, "gave_up": gave_up, "updated": now_iso(),
        })

    def _finished(self):
        got = read_json(os.path.join(self.run_dir, OUTPUTS)) or {}
        return got.get("state") in ENDED

    def _watch(self):
        try:
            while True:
                with self.lock:
                    proc = self._spawn()
                    self.proc = proc
                    if proc is not None and self.final:
                        self._send_final(proc)
                code = None
                if proc is not None:
                    relay = threading.Thread(target=self._relay, args=(proc,), daemon=True)
                    relay.start()
                    code = proc.wait()
                    relay.join(5)
                with self.lock:
                    final = self.final
                if self.terminating or (final and self._finished()):
                    self.exits.append({"at": now_iso(), "code": code, "final": final})
                    self._record(None, None, False)
                    return
                why = "could not start" if code is None else _described(code)
                self.exits.append({"at": now_iso(), "code": code, "final": final})
                if self.restarts >= MAX_RESTARTS:
                    self._give_up(why)
                    return
                self.restarts += 1
                self._say("the shipper ended (%s)%s; starting it again (%d of %d)" % (
                    why, " during its last pass" if final else "", self.restarts, MAX_RESTARTS))
                time.sleep(BACKOFF_S[min(self.restarts, len(BACKOFF_S)) - 1])
        finally:
            self._line = None  # the credentials leave this process's memory with the last shipper
            self.proc = None
            self.done.set()
            try:
                os.close(self.log_fd)
            except OSError:
                pass

    def _give_up(self, why):
        msg = "the shipper ended %d times (last: %s); gave up: nothing more ships for this run" % (
            self.restarts + 1, why)
        self._say(msg)
        path = os.path.join(self.run_dir, OUTPUTS)
        got = read_json(path) or dict(self.public, passes=0, failed_passes=0, last_pass=None, final=None,
                                      shipped={"files": 0, "bytes": 0}, pending=None, lag_s=None)
        errors = list(got.get("errors") or [])
        errors.append({"at": now_iso(), "error": msg})
        got.update({"pid": None, "state": "failed", "gave_up": True, "errors": errors[-5:]})
        write_json(path, got)
        self._record(None, None, True)
