"""The node protocol (python3 3.8+, stdlib only): the request a node module reads, the frames it prints.

The request is the first line of stdin: one JSON object (so secrets never sit in argv). A module
with several operations names them in it, ``{"op": NAME, ...}``, and ``serve(ops)`` runs
``ops[NAME](request)``; a module with one job reads the whole object (``main(handler)``). Bytes
after that line are the operation's payload (code push's files: ``payload()``), never JSON.

A remote module may print anything (banners, warnings, locale noise); the controller only
reads two kinds of lines:

* events: ``@@DFO-EVENT@@ {json}`` -- progress while the module works (zero or more), each
  ``{"kind": NAME, ...fields}`` (``emit_event(NAME, **fields)``; the kinds: ``EVENTS`` below);
* the result: ``@@DFO-RESULT@@ {json}`` -- exactly one, last. It is ``{"ok": true, "data": ...}``
  or ``{"ok": false, "error": {"kind": str, "message": str, ...}}``.

A frame may start anywhere in a line: a login shell on the node (``~/.bashrc``) may print a
terminal-title escape or a banner with no trailing newline, which glues onto the first frame.
``split_frame`` finds the earliest prefix in a line; JSON never holds a raw newline, so a frame
always ends its line.

Every op's request and reply shapes are written down as TypedDicts at the top of the module that
serves it (remote/runs/ops.py, remote/gang/ops.py, remote/files/push.py, remote/files/pull.py).

The event envelope: every event is one JSON object whose ``kind`` says what it is; the other keys
are that kind's fields. ``EVENTS`` is the one vocabulary, each kind with its fields and its sender;
``emit_event`` writes no other (tests/test_node_events.py checks every call in remote/), and the
controller (orchestrator/agent.py ``run_module``) passes on only events that carry a kind. A kind
whose payload is an open-ended report nests it under one field (``step``, ``outputs``), so no key
of the report can clash with ``kind``.
"""
import sys

from remote.lib import fastjson as json  # json.loads/dumps without importing json (3.5 ms a call)

EVENT_PREFIX = "@@DFO-EVENT@@ "
RESULT_PREFIX = "@@DFO-RESULT@@ "


def split_frame(line):
    """``("event"|"result", json_text)`` for a line holding a frame, wherever it starts; else None.

    The earliest prefix wins: a log chunk event may quote a frame's prefix inside its JSON."""
    e = line.find(EVENT_PREFIX)
    r = line.find(RESULT_PREFIX)
    if r >= 0 and (e < 0 or r < e):
        return "result", line[r + len(RESULT_PREFIX):]
    if e >= 0:
        return "event", line[e + len(EVENT_PREFIX):]
    return None


class RemoteError(Exception):
    """An expected failure: becomes ``{"ok": false, "error": {...}}`` with exit status 0."""

    def __init__(self, kind, message, **extra):
        Exception.__init__(self, message)
        self.kind = kind
        self.message = message
        self.extra = extra


def _write(line):
    out = sys.stdout
    out.write(line + "\n")
    out.flush()


# kind -> "its fields -- who sends it". docs/architecture-layout.md ("Events") has the same table.
EVENTS = {
    # provision (remote/env/)
    "step": "step: the step's report {name, status, message, seconds, ...} -- env/provision.py, as each step ends",
    "install": "command: the installer's command line, credentials redacted -- env/installers.py, before it runs",
    # verify-env --gpu
    "check": "gpu: index, name: the check, ok: bool, seconds -- gpu/preflight.py, as each check ends",
    # verify-env --health, run.health
    "health": "phase: its name, seconds -- gpu/health.py, as each phase of the gate ends",
    # sync-data, stage-model, launch's restore of outputs (pull makes the same two on the controller)
    "plan": "source, dest, files_total, bytes_total, to_fetch, bytes_to_fetch, skipped -- transfer/sync.py, "
            "transfer/stage.py, before any byte moves",
    "progress": "bytes, bytes_total, files, files_total, rate (B/s), seconds -- transfer/sync.py's Progress "
                "(sync and stage), every 0.5 s and at the end",
    # follow a run's log (remote/runs/ops.py follow)
    "start": "offset, run, job, pid, ino (DEV:INO or null) -- always the first event of a follow",
    "chunk": "o: the offset of its first byte, t: its text (UTF-8), or d: its bytes (base64) -- log bytes",
    "hb": "offset -- a heartbeat while the log is quiet",
    "reset": "offset, why: truncated|replaced, log: its path, ino -- the log was cut or replaced",
    "opened": "ino -- the log file appeared after the start",
    "outputs": "outputs: the run's outputs state (remote/runs/outputs.py) -- follow after the run's end, "
               "ship and stop while the last pass goes on",
    # exec (remote/exec.py)
    "stdout": "lines: [str] -- the command's stdout lines, as they come",
    "stderr": "lines: [str] -- its stderr lines",
    "tick": "(no fields) -- every 2 s while the command is quiet, so a write fails once the controller is gone",
}


def emit_event(kind, **fields):
    """Print one event, ``{"kind": kind, **fields}``; ``kind`` must be one of ``EVENTS`` (TypeError
    otherwise: a programming error, never a frame the controller would drop)."""
    if kind not in EVENTS:
        raise TypeError("emit_event: unknown event kind %r (remote/_proto.py EVENTS lists them)" % (kind,))
    obj = {"kind": kind}
    obj.update(fields)
    _write(EVENT_PREFIX + json.dumps(obj, separators=(",", ":"), default=str))


def emit_result(obj):
    _write(RESULT_PREFIX + json.dumps(obj, separators=(",", ":"), default=str))


def read_request():
    """The request: the first line of stdin, a JSON object (``{}`` when there is none)."""
    raw = sys.stdin.buffer.readline()
    if not raw.strip():
        return {}
    return json.loads(raw.decode("utf-8", "surrogateescape"))


def payload():
    """stdin after the request line, as a binary stream: the bytes an op takes (code push's files)."""
    return sys.stdin.buffer


def dispatch(ops, request):
    """``ops[request["op"]](request)``; an unknown op is a usage error naming the known ones."""
    name = request.get("op")
    op = ops.get(name) if isinstance(name, str) else None
    if op is None:
        raise RemoteError("usage", "unknown op %r (this module knows: %s)" % (name, ", ".join(sorted(ops))))
    return op(request)


def serve(ops):
    """The entry of a node module with operations, ``{name: handler(request) -> data}``: read the
    request, run the op it names, print the framed result (see ``main``). Never raises."""
    main(lambda request: dispatch(ops, request))


def main(handler):
    """Run ``handler(request) -> data`` and print the framed result. Never raises."""
    try:
        request = read_request()
        data = handler(request)
        emit_result({"ok": True, "data": data})
    except RemoteError as exc:
        err = {"kind": exc.kind, "message": exc.message}
        err.update(exc.extra)
        emit_result({"ok": False, "error": err})
    except KeyboardInterrupt:
        emit_result({"ok": False, "error": {"kind": "interrupted", "message": "interrupted"}})
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - report, never a bare traceback
        import traceback  # here: ~1.5 ms of every node call's start otherwise

        emit_result({
            "ok": False,
            "error": {
                "kind": "internal",
                "message": "%s: %s" % (type(exc).__name__, exc),
                "traceback": traceback.format_exc(limit=8),
            },
        })
    sys.stdout.flush()
