"""Code that runs ON the node, as ``python3 -m remote.<name>``.

Every module here runs on python3 3.8+ with the standard library only, except the ones that
exist to drive torch/triton (remote/gpu/). Each one reads its request (JSON) from stdin and
answers with one framed JSON document (see remote/_proto.py).
"""
import os as _os
import sys as _sys

PROTOCOL_VERSION = 1

# Before any module of this package is compiled (`python3 -m remote.X` imports this file first), an
# interpreter older than 3.8 says so in one result frame (remote/_proto.py) instead of a SyntaxError.
# This block must stay parseable by every python from 2.7 on: no f-strings, no annotations.
if _sys.version_info < (3, 8):
    import json as _json

    _sys.stdout.write("@@DFO-RESULT@@ " + _json.dumps({"ok": False, "error": {
        "kind": "python_too_old",
        "message": "needs python3 >= 3.8 on the node; found %s at %s" % (
            _sys.version.split()[0], _sys.executable or "(unknown path)"),
        "version": _sys.version.split()[0], "executable": _sys.executable}}) + "\n")
    _sys.stdout.flush()
    _sys.exit(3)

# The module command (orchestrator/agent.py) sets DFO_NODE_PYC=1 for dfo's own modules run by the host's
# python: their content-addressed copy never changes, so their bytecode is written beside them once and
# read by every later call (about 20 ms of the node's CPU a call). Popped at once, so a child (the
# shipper, a pip, an import of the job's packages) keeps PYTHONDONTWRITEBYTECODE=1 and writes none.
if _os.environ.pop("DFO_NODE_PYC", None) == "1":
    _sys.dont_write_bytecode = False
