"""The one retry loop of the node's code (python3 3.8+, stdlib): exponential backoff with full jitter.

``retry(fn)`` calls ``fn()`` up to ``attempts`` times. After a failure that ``retry_on(exc)`` calls
retryable (default: the exception's ``retryable`` attribute is true, as on ``remote.s3.client.S3Error``)
it sleeps ``rand() * min(cap, base * 2**k)`` seconds (k = 0 after the first failure: "full jitter",
so that many workers that failed together do not come back together), or at least the server's
Retry-After (the exception's ``retry_after`` seconds, capped at ``cap``), then calls again. Any other
exception is raised at once; after the last attempt the last exception is raised, with
``attempts`` set on it (how many calls were made) when it takes attributes.

``stop`` (a ``threading.Event``, set by SIGTERM/SIGINT or by a failed sibling worker) ends a sleep
at once with ``Stopped``. ``on_retry(exc, attempt, delay)`` runs before each sleep (drop a broken
connection, un-count progress). ``sleep`` and ``rand`` are for tests.
"""
import random
import time

ATTEMPTS = 5  # calls in all, the first one included
BASE_S = 0.25  # the first backoff's upper bound; it doubles per failure ...
CAP_S = 8.0  # ... up to this (and a server's Retry-After is honoured up to this too)


class Stopped(Exception):
    """The work was asked to stop (another worker failed, or a signal)."""


def is_retryable(exc):
    return getattr(exc, "retryable", False) is True


def backoff(attempt, base=BASE_S, cap=CAP_S, rand=random.random, retry_after=None):
    """Seconds to wait after failure number ``attempt`` (0-based): full jitter, at least ``retry_after``
    (capped at ``cap``) when the server gave one."""
    delay = rand() * min(cap, base * (2 ** attempt))
    if retry_after is not None and retry_after > 0:
        delay = max(delay, min(float(retry_after), cap))
    return delay


def retry(fn, attempts=ATTEMPTS, base=BASE_S, cap=CAP_S, retry_on=is_retryable, stop=None, on_retry=None,
          sleep=None, rand=random.random):
    """``fn()``'s result, calling it again after a retryable failure (see the module's docstring)."""
    attempts = max(1, int(attempts))
    for attempt in range(attempts):
        try:
            return fn()
        except Stopped:
            raise
        except Exception as exc:  # noqa: BLE001 - retry_on decides; the rest is raised unchanged
            if not retry_on(exc):
                raise
            if attempt == attempts - 1:
                if attempts > 1:
                    try:
                        setattr(exc, "attempts", attempts)  # noqa: B010 - any exception type
                    except AttributeError:
                        pass
                raise
            delay = backoff(attempt, base, cap, rand, getattr(exc, "retry_after", None))
            if on_retry is not None:
                on_retry(exc, attempt, delay)
            if stop is not None and stop.is_set():
                raise Stopped() from None
            if sleep is not None:
                sleep(delay)
            elif stop is not None:
                if stop.wait(delay):
                    raise Stopped() from None
            else:
                time.sleep(delay)
            if stop is not None and stop.is_set():
                raise Stopped() from None
    raise AssertionError("unreachable code")


def parse_retry_after(value):
    """A Retry-After header's seconds (delta-seconds only; an HTTP date is ignored), or None."""
    try:
        seconds = float((value or "").strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
