"""What the upload engine may use (python3 3.8+, stdlib only): CPU time and memory.

* ``CpuGovernor``: the process's CPU time (all threads: hashing, Python, the kernel's send work) at
  most ``cores`` per second of wall time, averaged over ``window`` seconds: a worker that finds the
  budget spent sleeps before its next chunk of work.
* ``MemBudget``: bytes of file content held in memory at once (whole small files and parts being
  sent): a worker waits for room.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Deque, Tuple

from remote.lib.retry import Stopped


class CpuGovernor:
    """At most ``cores`` of CPU time per second of wall time, averaged over ``window`` seconds.

    ``throttle()`` is called by workers between chunks of work: when the CPU time used over the last
    window is above budget, it sleeps as long as it takes the average to come back under it.
    ``cpu``, ``clock`` and ``sleep`` are for tests (defaults: process CPU time of all threads, monotonic)."""

    def __init__(self, cores=2.0, window=3.0, cpu=time.process_time, clock=time.monotonic, sleep=time.sleep,
                 stop=None):
        self.cores = float(cores) if cores else 0.0
        self.window = window
        self.cpu, self.clock, self.sleep, self.stop = cpu, clock, sleep, stop
        self.lock = threading.Lock()
        self.samples: Deque[Tuple[float, float]] = collections.deque()  # (wall, cpu)
        self.slept = 0.0

    def throttle(self):
        if self.cores <= 0:
            return 0.0
        with self.lock:
            now, used = self.clock(), self.cpu()
            self.samples.append((now, used))
            while len(self.samples) > 1 and now - self.samples[0][0] > self.window:
                self.samples.popleft()
            t0, c0 = self.samples[0]
            over = (used - c0) - self.cores * (now - t0)
        if over <= 0:
            return 0.0
        delay = min(over / self.cores, self.window)
        if self.stop is not None:
            self.stop.wait(delay)
        else:
            self.sleep(delay)
        with self.lock:
            self.slept += delay
        return delay


class MemBudget:
    """Bytes of file content held in memory at once (whole small files, parts): a worker waits for room.
    One request bigger than the budget gets it all, alone."""

    def __init__(self, limit, stop):
        self.limit, self.stop = max(1, int(limit)), stop
        self.used = 0
        self.cond = threading.Condition()

    def take(self, n):
        n = min(int(n), self.limit)
        with self.cond:
            while self.used and self.used + n > self.limit:
                if self.stop.is_set():
                    raise Stopped()
                self.cond.wait(0.5)
            self.used += n
        return n

    def give(self, n):
        with self.cond:
            self.used -= n
            self.cond.notify_all()
