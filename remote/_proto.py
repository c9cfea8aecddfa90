"""The node protocol (python3 3.8+, stdlib only): the request a node module reads, the frames it prints.

The request is the first line of stdin: one JSON object (so secrets never sit in argv). A module
with several operations names them in it, ``{"op": NAME, ...}``, and ``serve(ops)`` runs
``ops[NAME](request)``; a module with one job reads the whole object (``main(handler)``). Bytes
after that line are the operation's payload (code push's files: ``payload()``), never JSON.

A remote module may print anything (banners, warnings, locale noise); the controller only
reads two kinds of lines:

* events: ``@@DFO-EVENT@@ {json}`` -- progress while the module works (zero or more);
* the result: ``@@DFO-RESULT@@ {json}`` -- exactly one, last. It is ``{"ok": true, "data": ...}``
  or ``{"ok": false, "error": {"kind": str, "message": str, ...}}``.

A frame may start anywhere in a line: a login shell on the node (``~/.bashrc``) may print a
terminal-title escape or a banner with no trailing newline, which glues onto the first frame.
``split_frame`` finds the earliest prefix in a line; JSON never holds a raw newline, so a frame
always ends its line.

Every op's request and reply shapes are written down as TypedDicts at the top of the module that
serves it (remote/runs/ops.py, remote/gang/ops.py, remote/files/push.py, remote/files/pull.py).
"""
import json
import sys
import traceback

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


def emit_event(obj):
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
        emit_result({
            "ok": False,
            "error": {
                "kind": "internal",
                "message": "%s: %s" % (type(exc).__name__, exc),
                "traceback": traceback.format_exc(limit=8),
            },
        })
    sys.stdout.flush()
